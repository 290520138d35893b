"""Conventions other libraries' tests ask of apply_rope and the store: destination outputs
(q_out= / k_out=), Transformer Engine's layout='sbhd', any last stride, the rotated part at the end
of the head (rotary_position='last') and FlashInfer's 3-D paged MLA cache in the store.

Each against the float64 reference on fresh random inputs, outputs and destinations poisoned with
NaN (an unwritten element fails). On CPU the kernels run in the Triton interpreter. The compiled
forms are in test_compile_dynamic.py's tables (fullgraph=True over changing shapes).
"""

import re

import pytest
import torch

import ropekit
from ropekit.core import memo, tuning
from ropekit.tools import reference

from conftest import TOL, fp8_close, make_cache, rel_err, spy_plans

pytestmark = pytest.mark.usefixtures("poison")

NAN = float("nan")
FP8 = torch.float8_e4m3fn


def _nan(*shape, dtype=torch.float32, device="cpu"):
    return torch.full(shape, NAN, device=device).to(dtype)


def _want(x, cache, positions, *, last=False, interleaved=False, scale=None, dtype=None):
    """float64 reference of one rotated tensor (*T, H, D); last: the rotated dims end the head.
    scale / dtype: an fp8 output's rule (divided, saturated, cast)."""
    rot = cache.shape[1]
    c, s = reference.angles_from_table(cache.double(), positions, x.shape[:-2])
    x = x.double()
    if last:
        n = x.shape[-1] - rot
        r = torch.cat((x[..., :n], reference.rotate(x[..., n:], c, s, interleaved=interleaved)), -1)
    else:
        r = reference.rotate(x, c, s, interleaved=interleaved)
    if scale is None:
        return r
    big = torch.finfo(dtype).max
    return (r / scale).clamp(-big, big).to(dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_oracle_rotates_the_last_dims(interleaved):
    """The oracle's apply_rope(rotary_position='last') on a (max_position, rotary_dim) table: the
    last rotary_dim dims rotated, the first ones kept (as the head sliced by hand above)."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(3, 4, 6, 96, generator=g), torch.randn(3, 4, 1, 96, generator=g)
    pos, cache = torch.randint(0, 32, (3, 4), generator=g), make_cache(32, 32)
    rq, rk = reference.apply_rope(
        q.double(), k.double(), pos, cache.double(), rotary_position="last", interleaved=interleaved
    )
    for got, x in ((rq, q), (rk, k)):
        assert rel_err(got, _want(x, cache, pos, last=True, interleaved=interleaved)) < 1e-12
        assert torch.equal(got[..., :64], x[..., :64].double())


# ---------------------------------------------------------------------------------------------
# q_out= / k_out=


@pytest.mark.parametrize("rot", [32, 16])  # full and partial rotary (a tail copied into the destination)
@pytest.mark.parametrize("interleaved", [False, True])
def test_destinations_are_written_and_returned(device, rot, interleaved):
    cache = make_cache(32, rot, device=device)
    q = torch.randn(2, 3, 4, 32, device=device)
    k = torch.randn(2, 3, 2, 32, device=device)
    pos = torch.randint(0, 32, (2, 3), device=device)
    q_buf = _nan(2, 3, 4, 48, device=device)
    q_out = q_buf[..., 8:40]  # strided destination: rows 48 apart, inside a wider buffer
    k_out = _nan(2, 2, 3, 32, device=device).transpose(1, 2)  # permuted destination
    before = q_buf.clone()
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache, interleaved=interleaved, q_out=q_out, k_out=k_out)
    assert got_q is q_out and got_k is k_out
    assert rel_err(q_out, _want(q, cache, pos, interleaved=interleaved)) < TOL[torch.float32]
    assert rel_err(k_out, _want(k, cache, pos, interleaved=interleaved)) < TOL[torch.float32]
    assert torch.equal(q_buf[..., :8].isnan(), before[..., :8].isnan()) and q_buf[..., 40:].isnan().all()


def test_one_destination_alone_and_fp8_destinations(device):
    cache = make_cache(32, 32, device=device)
    q = torch.randn(5, 4, 32, device=device) * 4
    k = torch.randn(5, 2, 32, device=device)
    pos = torch.randint(0, 32, (5,), device=device)
    k_out = _nan(5, 2, 32, device=device)
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache, k_out=k_out)
    assert got_k is k_out and got_q.shape == q.shape
    assert rel_err(got_q, _want(q, cache, pos)) < TOL[torch.float32]
    assert rel_err(k_out, _want(k, cache, pos)) < TOL[torch.float32]
    q8 = _nan(5, 4, 32, dtype=FP8, device=device)
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache, out_dtype=FP8, q_scale=0.05, k_scale=0.5, q_out=q8)
    assert got_q is q8 and got_k.dtype == FP8
    fp8_close(q8, _want(q, cache, pos, scale=0.05, dtype=FP8), FP8)
    fp8_close(got_k, _want(k, cache, pos, scale=0.5, dtype=FP8), FP8)


def test_destinations_with_the_norm(device):
    cache = make_cache(16, 32, device=device)
    q, k = torch.randn(4, 3, 32, device=device), torch.randn(4, 1, 32, device=device)
    w = torch.rand(32, device=device) + 0.5
    pos = torch.randint(0, 16, (4,), device=device)
    q_out, k_out = _nan(4, 3, 32, device=device), _nan(4, 1, 32, device=device)
    ropekit.apply_rope(q, k, pos, cache, q_norm_weight=w, k_norm_weight=w, q_out=q_out, k_out=k_out)
    want_q, want_k = reference.rms_norm_rope(
        q.double(), k.double(), pos, cache.double(), q_norm_weight=w.double(), k_norm_weight=w.double()
    )
    assert rel_err(q_out, want_q) < 1e-5 and rel_err(k_out, want_k) < 1e-5


def test_destinations_refused_by_name_and_nothing_written():
    cache = make_cache(16, 32)
    q, k = torch.randn(4, 3, 32), torch.randn(4, 2, 32)
    pos = torch.randint(0, 16, (4,))
    k_out = _nan(4, 2, 32)
    cases = [
        (dict(q_out=q), "q: expected memory disjoint from q_out (which is written)"),
        (dict(q_out=_nan(4, 3, 32), k_out=k), "k: expected memory disjoint from k_out (which is written)"),
        (dict(q_out=_nan(4, 5, 32)[:, :3], k_out=None), None),  # fine: a strided destination
        (dict(k_out=cache[:8].view(4, 2, 32)), "cos_sin_cache: expected memory disjoint from k_out"),
        (dict(q_out=_nan(4, 3, 32), k_out=_nan(4, 3, 32)[:, :2]), None),
    ]
    for kw, msg in cases:
        if msg is None:
            ropekit.apply_rope(q, k, pos, cache, **kw)
            continue
        q0, k0 = q.clone(), k.clone()
        with pytest.raises(ValueError, match=re.escape("apply_rope: " + msg)):
            ropekit.apply_rope(q, k, pos, cache, **kw)
        assert torch.equal(q, q0) and torch.equal(k, k0)
    buf = _nan(4, 5, 32)
    with pytest.raises(ValueError, match="apply_rope: k_out: expected memory disjoint from q_out"):
        ropekit.apply_rope(q, k, pos, cache, q_out=buf[:, :3], k_out=buf[:, 2:4])
    assert buf.isnan().all()
    with pytest.raises(ValueError, match=r"q_out: expected None while q or k requires grad"):
        ropekit.apply_rope(q.requires_grad_(), k, pos, cache, q_out=_nan(4, 3, 32))
    assert k_out.isnan().all()


# ---------------------------------------------------------------------------------------------
# layout='sbhd'


@pytest.mark.parametrize("pos_form", ["none", "sb", "s1"])
def test_sbhd_layout(device, pos_form):
    S, B = 5, 2
    cache = make_cache(16, 32, device=device)
    q = torch.randn(S, B, 3, 32, device=device)
    k = torch.randn(S, B, 1, 32, device=device)
    pos = {
        "none": None,
        "sb": torch.randint(0, 16, (S, B), device=device),
        "s1": torch.randint(0, 16, (S, 1), device=device),
    }[pos_form]
    # the reference in (B, S) terms
    ref_pos = torch.arange(S, device=device).expand(B, S) if pos is None else pos.transpose(0, 1).expand(B, S)
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache, layout="sbhd")
    assert got_q.shape == q.shape and got_k.shape == k.shape
    for got, x in ((got_q, q), (got_k, k)):
        assert rel_err(got.transpose(0, 1), _want(x.transpose(0, 1), cache, ref_pos)) < TOL[torch.float32]
    # in place: the same values, in the caller's tensors
    q2, k2 = q.clone(), k.clone()
    assert ropekit.apply_rope(q2, k2, pos, cache, layout="sbhd", inplace=True) == (q2, k2)
    assert torch.equal(q2, got_q) and torch.equal(k2, got_k)


def test_sbhd_gradient_and_refusals(device):
    S, B = 4, 2
    cache = make_cache(16, 32, device=device)
    q = torch.randn(S, B, 2, 32, device=device, requires_grad=True)
    pos = torch.randint(0, 16, (S, B), device=device)
    out, _ = ropekit.apply_rope(q, None, pos, cache, layout="sbhd")
    g = torch.randn_like(out)
    out.backward(g)
    c, s = reference.angles_from_table(cache.double(), pos.transpose(0, 1), (B, S))
    want = reference.rotate(g.transpose(0, 1).double(), c, s, inverse=True).transpose(0, 1)
    assert rel_err(q.grad, want) < TOL[torch.float32]
    with pytest.raises(ValueError, match=r"apply_rope: q: expected a 4-D tensor with layout='sbhd'"):
        ropekit.apply_rope(torch.randn(4, 2, 32), None, None, cache, layout="sbhd")
    with pytest.raises(ValueError, match=r"rotate_with_angles: layout: expected 'thd' or 'bshd'"):
        ropekit.rotate_with_angles(q.detach(), None, torch.ones(B, S, 16), torch.zeros(B, S, 16), layout="sbhd")


# ---------------------------------------------------------------------------------------------
# any last stride


def _strided(*shape, device="cpu", dtype=torch.float32):
    """A tensor whose last dim has stride 2 (every other element of a wider buffer)."""
    return torch.randn(*shape[:-1], 2 * shape[-1], device=device, dtype=dtype)[..., ::2]


def test_non_unit_last_stride_out_of_place_gives_contiguous_outputs(device):
    cache = make_cache(16, 32, device=device)
    q = _strided(4, 3, 48, device=device)  # partial rotary: the tail is read through the copy too
    k = _strided(4, 2, 48, device=device)
    pos = torch.randint(0, 16, (4,), device=device)
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert rel_err(got_q, _want(q, cache, pos)) < TOL[torch.float32]
    assert rel_err(got_k, _want(k, cache, pos)) < TOL[torch.float32]
    # a dense permutation whose last dim is not the inner one (torch.empty_like would keep it): contiguous
    t = torch.randn(32, 3, 4, device=device).permute(2, 1, 0)  # (4, 3, 32), strides (1, 4, 12)
    out, _ = ropekit.apply_rope(t, None, pos, cache)
    assert out.is_contiguous() and rel_err(out, _want(t, cache, pos)) < TOL[torch.float32]


def test_unit_last_stride_outputs_keep_a_dense_layout(device):
    cache = make_cache(16, 32, device=device)
    pos = torch.randint(0, 16, (2, 3), device=device)
    q = torch.randn(2, 4, 3, 32, device=device).transpose(1, 2)  # dense (B, S, H, D) view of (B, H, S, D)
    out, _ = ropekit.apply_rope(q, None, pos, cache, layout="bshd")
    assert out.stride() == q.stride()
    sliced = torch.randn(2, 3, 4, 64, device=device)[..., 16:48]  # not dense: contiguous outputs
    out, _ = ropekit.apply_rope(sliced, None, pos, cache)
    assert out.is_contiguous() and rel_err(out, _want(sliced, cache, pos)) < TOL[torch.float32]


def test_non_unit_last_stride_in_place_norm_and_fp8(device):
    cache = make_cache(16, 32, device=device)
    pos = torch.randint(0, 16, (4,), device=device)
    buf = torch.randn(4, 3, 96, device=device)
    q = buf[..., ::2]  # (4, 3, 48), last stride 2; the odd elements must stay as they are
    want = _want(q, cache, pos)
    odd = buf[..., 1::2].clone()
    assert ropekit.apply_rope(q, None, pos, cache, inplace=True)[0] is q
    assert rel_err(q, want) < TOL[torch.float32] and torch.equal(buf[..., 1::2], odd)
    x = _strided(4, 3, 32, device=device)
    w = torch.rand(32, device=device) + 0.5
    out, _ = ropekit.apply_rope(x, None, pos, cache, q_norm_weight=w)
    ref, _ = reference.rms_norm_rope(x.double(), None, pos, cache.double(), q_norm_weight=w.double())
    assert out.is_contiguous() and rel_err(out, ref) < 1e-5
    out8, _ = ropekit.apply_rope(x * 8, None, pos, cache, out_dtype=FP8, q_scale=0.1)
    fp8_close(out8, _want(x * 8, cache, pos, scale=0.1, dtype=FP8), FP8)


def test_non_unit_last_stride_gradients(device):
    cache = make_cache(16, 32, device=device)
    pos = torch.randint(0, 16, (4,), device=device)
    c, s = reference.angles_from_table(cache.double(), pos, (4,))
    base = torch.randn(4, 2, 64, device=device, requires_grad=True)
    q = base[..., ::2]
    out, _ = ropekit.apply_rope(q, None, pos, cache)
    g = torch.randn_like(out)
    out.backward(g)
    want = reference.rotate(g.double(), c, s, inverse=True)
    assert rel_err(base.grad[..., ::2], want) < TOL[torch.float32] and not base.grad[..., 1::2].any()
    # in place under autograd: the view of a non-leaf is rotated (copied back) and the gradient flows
    base.grad = None
    x = base * 1.0
    ropekit.apply_rope(x[..., ::2], None, pos, cache, inplace=True)
    x.backward(torch.cat((g[..., None], torch.ones_like(g)[..., None]), -1).flatten(-2))
    assert rel_err(base.grad[..., ::2], want) < TOL[torch.float32] and torch.equal(
        base.grad[..., 1::2], torch.ones_like(g)
    )
    with pytest.raises(ValueError, match="apply_rope: q: expected a tensor that is not a leaf requiring grad"):
        ropekit.apply_rope(base[..., ::2], None, pos, cache, inplace=True)


STRIDES = [2, 3, "transposed"]


def _col_view(kind, *shape, device="cpu"):
    """(view, base): a (*T, H, D) view whose last dim is not unit-stride. kind 2 or 3: every
    kind-th element of a wider buffer (the others must stay as they are); "transposed": (*T, D, H)
    storage seen as (*T, H, D), last stride H and head stride 1."""
    if kind == "transposed":
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], device=device)
    else:
        base = torch.randn(*shape[:-1], kind * shape[-1], device=device)
    return _view_of(kind, base), base


def _view_of(kind, base):
    """_col_view's view of its base (or of a tensor of the base's layout: its gradient)."""
    return base.transpose(-1, -2) if kind == "transposed" else base[..., ::kind]


def _outside(view, base):
    """The elements of base that view does not hold (a bool tensor of base's shape)."""
    outside = torch.ones_like(base, dtype=torch.bool)
    outside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
    return outside


@pytest.fixture
def strided_plans(monkeypatch):
    """The (STRIDED_IN, STRIDED_OUT) of every rope_kernel plan made: the kernel reads a strided
    last dim itself (no copy in between)."""
    return spy_plans(monkeypatch, lambda m: (m["STRIDED_IN"], m["STRIDED_OUT"]))


def _kernel_ran(device) -> bool:
    """Did the calls run ropekit's Triton kernel (CUDA, or the interpreter), not the PyTorch path?"""
    from ropekit.core import checks

    return checks.triton_runs(torch.empty(1, device=device))


@pytest.mark.parametrize("kind", STRIDES)
@pytest.mark.parametrize("rot,interleaved", [(32, False), (32, True), (16, False)])
def test_strided_last_dim_out_of_place(device, strided_plans, kind, rot, interleaved):
    """q of last stride 2, 3 or a transposed view, k of unit stride, and both strided: read where
    they lie, outputs contiguous (partial rotary: the tail read through the stride too)."""
    cache = make_cache(16, rot, device=device)
    pos = torch.randint(0, 16, (2, 3), device=device)
    q, _ = _col_view(kind, 2, 3, 4, 32, device=device)
    for k in (torch.randn(2, 3, 2, 32, device=device), _col_view(kind, 2, 3, 2, 32, device=device)[0]):
        got_q, got_k = ropekit.apply_rope(q, k, pos, cache, interleaved=interleaved)
        assert got_q.is_contiguous() and got_k.is_contiguous()
        assert rel_err(got_q, _want(q, cache, pos, interleaved=interleaved)) < TOL[torch.float32]
        assert rel_err(got_k, _want(k, cache, pos, interleaved=interleaved)) < TOL[torch.float32]
    if _kernel_ran(device):
        assert strided_plans and all(p == (True, False) for p in strided_plans), strided_plans


@pytest.mark.parametrize("kind", STRIDES)
@pytest.mark.parametrize("rot,interleaved", [(32, True), (16, False)])
def test_strided_last_dim_in_place(device, strided_plans, kind, rot, interleaved):
    """In place, written back through the same strides: the view holds the rotation, every other
    element of its buffer is untouched."""
    cache = make_cache(16, rot, device=device)
    pos = torch.randint(0, 16, (3,), device=device)
    q, q_base = _col_view(kind, 3, 4, 32, device=device)
    k, k_base = _col_view(kind, 3, 2, 32, device=device)
    want_q = _want(q, cache, pos, interleaved=interleaved)
    want_k = _want(k, cache, pos, interleaved=interleaved)
    q_rest, k_rest = q_base.clone(), k_base.clone()
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache, interleaved=interleaved, inplace=True)
    assert got_q is q and got_k is k
    assert rel_err(q, want_q) < TOL[torch.float32] and rel_err(k, want_k) < TOL[torch.float32]
    # the buffers' elements outside the views
    for view, base, rest in ((q, q_base, q_rest), (k, k_base, k_rest)):
        outside = _outside(view, base)
        assert torch.equal(base[outside], rest[outside])
    if _kernel_ran(device):
        assert strided_plans and all(p == (True, True) for p in strided_plans), strided_plans


@pytest.mark.parametrize("kind", STRIDES)
@pytest.mark.parametrize("inplace", [False, True])
def test_strided_last_dim_norm(device, kind, inplace):
    """The fused norm (q per head, k across heads; partial rotary: the tail normalized too) on
    strided q and k, out of place and in place."""
    cache = make_cache(16, 16, device=device)
    pos = torch.randint(0, 16, (3,), device=device)
    q, _ = _col_view(kind, 3, 4, 32, device=device)
    k, _ = _col_view(kind, 3, 2, 32, device=device)
    wq = torch.rand(32, device=device) + 0.5
    wk = torch.rand(2 * 32, device=device) + 0.5
    want_q, want_k = reference.rms_norm_rope(
        q.double(), k.double(), pos, cache.double(), q_norm_weight=wq.double(), k_norm_weight=wk.double()
    )
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache, q_norm_weight=wq, k_norm_weight=wk, inplace=inplace)
    assert (got_q is q) == inplace and (got_k is k) == inplace
    assert rel_err(got_q, want_q) < 1e-5 and rel_err(got_k, want_k) < 1e-5


@pytest.mark.parametrize("kind", STRIDES)
def test_strided_last_dim_backward(device, kind):
    """Gradients of strided q and k (views of leaves), output gradients of a strided layout too;
    in place under autograd (views of a non-leaf); the norm's backward (weights included)."""
    cache = make_cache(16, 32, device=device)
    pos = torch.randint(0, 16, (3,), device=device)
    c, s = reference.angles_from_table(cache.double(), pos, (3,))
    q_base = _col_view(kind, 3, 4, 32, device=device)[1].requires_grad_(True)
    k_base = _col_view(kind, 3, 2, 32, device=device)[1].requires_grad_(True)
    q, k = _view_of(kind, q_base), _view_of(kind, k_base)
    gq, _ = _col_view(kind, 3, 4, 32, device=device)
    gk, _ = _col_view(kind, 3, 2, 32, device=device)
    out_q, out_k = ropekit.apply_rope(q, k, pos, cache)
    torch.autograd.backward((out_q, out_k), (gq, gk))
    dq, dk = _view_of(kind, q_base.grad), _view_of(kind, k_base.grad)
    assert rel_err(dq, reference.rotate(gq.double(), c, s, inverse=True)) < TOL[torch.float32]
    assert rel_err(dk, reference.rotate(gk.double(), c, s, inverse=True)) < TOL[torch.float32]
    # the buffers' other elements get no gradient
    assert not q_base.grad[_outside(q, q_base)].any() and not k_base.grad[_outside(k, k_base)].any()
    # in place under autograd: the strided views of a non-leaf are rotated where they lie
    q_base.grad = None
    x = q_base * 1.0
    view = _view_of(kind, x)
    ropekit.apply_rope(view, None, pos, cache, inplace=True)
    assert rel_err(view, _want(q.detach(), cache, pos)) < TOL[torch.float32]
    x.backward(torch.ones_like(x))
    ones = torch.ones_like(gq)
    dq = _view_of(kind, q_base.grad)
    assert rel_err(dq, reference.rotate(ones.double(), c, s, inverse=True)) < TOL[torch.float32]
    # the norm's backward, x and its weight against autograd through the float64 reference: per
    # head, across heads (whole heads in registers, and walked in blocks), full and partial rotary
    # (the tails), half-split and interleaved
    forms = [(32, None, 32, False), (4 * 32, None, 16, True), (4 * 32, False, 16, False), (32, None, 16, True)]
    for width, whole, rot, interleaved in forms:
        table = make_cache(16, rot, device=device)
        w = (torch.rand(width, device=device) + 0.5).requires_grad_(True)
        q_base.grad = None
        with tuning.override(whole_heads=whole):
            out, _ = ropekit.apply_rope(q, None, pos, table, q_norm_weight=w, interleaved=interleaved)
            out.backward(gq)
        q64 = q.detach().double().requires_grad_(True)
        w64 = w.detach().double().requires_grad_(True)
        ref, _ = reference.rms_norm_rope(q64, None, pos, table.double(), q_norm_weight=w64, interleaved=interleaved)
        ref.backward(gq.double())
        dq = _view_of(kind, q_base.grad)
        assert rel_err(dq, q64.grad) < 1e-5 and rel_err(w.grad, w64.grad) < 1e-5, (width, whole, rot)


# ---------------------------------------------------------------------------------------------
# rotary_position='last'


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_part_last(device, interleaved):
    cache = make_cache(16, 16, device=device)
    q = torch.randn(2, 3, 4, 48, device=device)  # [nope 32 | rope 16]
    k = torch.randn(2, 3, 1, 24, device=device)  # another head size: [nope 8 | rope 16]
    pos = torch.randint(0, 16, (2, 3), device=device)
    kw = dict(interleaved=interleaved, rotary_position="last")
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache, **kw)
    assert rel_err(got_q, _want(q, cache, pos, last=True, interleaved=interleaved)) < TOL[torch.float32]
    assert rel_err(got_k, _want(k, cache, pos, last=True, interleaved=interleaved)) < TOL[torch.float32]
    # in place: the nope dims are not touched
    q2, k2 = q.clone(), k.clone()
    ropekit.apply_rope(q2, k2, pos, cache, inplace=True, **kw)
    assert torch.equal(q2, got_q) and torch.equal(k2, got_k) and torch.equal(q2[..., :32], q[..., :32])
    # into destinations, and as Transformer Engine's layout
    q_out = _nan(2, 3, 4, 48, device=device)
    assert ropekit.apply_rope(q, None, pos, cache, q_out=q_out, **kw)[0] is q_out
    assert torch.equal(q_out, got_q)
    sq, _ = ropekit.apply_rope(q.transpose(0, 1), None, pos.transpose(0, 1), cache, layout="sbhd", **kw)
    assert torch.equal(sq.transpose(0, 1), got_q)


def test_rotary_part_last_fp8_and_gradient(device):
    cache = make_cache(16, 16, device=device)
    pos = torch.randint(0, 16, (5,), device=device)
    q = torch.randn(5, 2, 40, device=device) * 4
    q8, _ = ropekit.apply_rope(q, None, pos, cache, rotary_position="last", out_dtype=FP8, q_scale=0.02)
    fp8_close(q8, _want(q, cache, pos, last=True, scale=0.02, dtype=FP8), FP8)
    x = q.clone().requires_grad_()
    out, _ = ropekit.apply_rope(x, None, pos, cache, rotary_position="last")
    g = torch.randn_like(out)
    out.backward(g)
    c, s = reference.angles_from_table(cache.double(), pos, (5,))
    want = torch.cat((g[..., :24].double(), reference.rotate(g[..., 24:].double(), c, s, inverse=True)), -1)
    assert rel_err(x.grad, want) < TOL[torch.float32]


def test_rotary_position_refusals():
    cache = make_cache(16, 16)
    q = torch.randn(3, 2, 32)
    with pytest.raises(
        ValueError, match=r"apply_rope: rotary_position: expected 'first', 'last' or 'halves', got 'end'"
    ):
        ropekit.apply_rope(q, None, None, cache, rotary_position="end")
    with pytest.raises(ValueError, match=r"apply_rope: rotary_position: expected 'first' with q_norm_weight"):
        ropekit.apply_rope(q, None, None, cache, rotary_position="last", q_norm_weight=torch.ones(32))


# ---------------------------------------------------------------------------------------------
# heads in two parts: q_nope= / k_nope= (FlashInfer's rope_quantize_fp8 inputs)


def _joined(rope, nope, last):
    """The whole head the two parts stand for: [rope | nope], [nope | rope] with last."""
    return torch.cat((nope, rope) if last else (rope, nope), -1)


@pytest.mark.parametrize("last", [False, True], ids=["first", "last"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_parts_give_whole_heads(device, last, interleaved):
    """q / k the rope parts, q_nope / k_nope (strided, another dtype) their no-rope parts: the outputs
    are the whole heads rotated, the parts placed as rotary_position says; a bad position gives NaN in
    the rotated dims only."""
    cache = make_cache(16, 16, device=device)
    q, k = torch.randn(2, 3, 4, 16, device=device), torch.randn(2, 3, 1, 16, device=device)
    q_nope = _strided(2, 3, 4, 24, device=device)
    k_nope = torch.randn(2, 3, 1, 8, device=device, dtype=torch.float16)
    pos = torch.randint(0, 16, (2, 3), device=device)
    pos[0, 1] = 16
    kw = dict(interleaved=interleaved, rotary_position="last" if last else "first")
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache, q_nope=q_nope, k_nope=k_nope, **kw)
    assert got_q.shape == (2, 3, 4, 40) and got_k.shape == (2, 3, 1, 24) and got_q.is_contiguous()
    for got, x, n in ((got_q, q, q_nope), (got_k, k, k_nope)):
        want = _want(_joined(x, n.float(), last), cache, pos, last=last, interleaved=interleaved)
        assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
        assert rel_err(got.nan_to_num(), want.nan_to_num()) < TOL[torch.float32]
    # one part alone: the other output as without parts
    got_q, got_k = ropekit.apply_rope(q, k, pos, cache, q_nope=q_nope, **kw)
    assert got_k.shape == k.shape and torch.equal(got_k.isnan(), _want(k, cache, pos).isnan())


def test_parts_into_fp8_destinations_and_layouts(device):
    """FlashInfer's rope_quantize_fp8 in one call: e4m3 destinations (a strided view), scales, the
    nope parts divided and saturated; 'bhsd' and 'sbhd' parts in the call's layout."""
    cache = make_cache(16, 16, device=device)
    pos = torch.randint(0, 16, (5,), device=device)
    q, q_nope = torch.randn(5, 3, 16, device=device) * 8, torch.randn(5, 3, 32, device=device) * 8
    q_nope[0, 0, :4] = 1e4  # saturated
    k, k_nope = torch.randn(5, 1, 16, device=device), torch.randn(5, 1, 32, device=device)
    buf = _nan(5, 3, 64, dtype=FP8, device=device)
    q_out = buf[..., 8:56]
    got_q, got_k = ropekit.apply_rope(
        q, k, pos, cache, q_nope=q_nope, k_nope=k_nope, out_dtype=FP8, q_scale=0.5, k_scale=0.25, q_out=q_out
    )
    assert got_q is q_out and got_k.dtype == FP8 and got_k.shape == (5, 1, 48)
    fp8_close(q_out, _want(torch.cat((q, q_nope), -1), cache, pos, scale=0.5, dtype=FP8), FP8)
    fp8_close(got_k, _want(torch.cat((k, k_nope), -1), cache, pos, scale=0.25, dtype=FP8), FP8)
    assert q_out.float()[0, 0, 16:20].eq(448).all() and buf[..., :8].float().isnan().all()
    # Hugging Face's (B, H, S, D) and Transformer Engine's (S, B, H, D): parts laid out as q is
    qh, nh = q.view(1, 5, 3, 16).transpose(1, 2), q_nope.view(1, 5, 3, 32).transpose(1, 2)
    out, _ = ropekit.apply_rope(qh, None, pos.view(1, 5), cache, q_nope=nh, layout="bhsd")
    want = _want(torch.cat((q, q_nope), -1).view(1, 5, 3, 48), cache, pos.view(1, 5))
    assert rel_err(out.transpose(1, 2), want) < TOL[torch.float32]
    qs, ns = q.view(5, 1, 3, 16), q_nope.view(5, 1, 3, 32)
    out, _ = ropekit.apply_rope(qs, None, pos.view(5, 1), cache, q_nope=ns, layout="sbhd")
    assert rel_err(out.transpose(0, 1), want) < TOL[torch.float32]


@pytest.mark.parametrize("last", [False, True], ids=["first", "last"])
def test_parts_gradients(device, last):
    """Gradients reach both parts: the rope part's is the inverse rotation, the nope part's passes."""
    cache = make_cache(16, 16, device=device)
    pos = torch.randint(0, 16, (4,), device=device)
    q = torch.randn(4, 2, 16, device=device, requires_grad=True)
    q_nope = torch.randn(4, 2, 8, device=device, requires_grad=True)
    out, _ = ropekit.apply_rope(q, None, pos, cache, q_nope=q_nope, rotary_position="last" if last else "first")
    g = torch.randn_like(out)
    out.backward(g)
    c, s = reference.angles_from_table(cache.double(), pos, (4,))
    g_rope, g_nope = (g[..., 8:], g[..., :8]) if last else (g[..., :16], g[..., 16:])
    assert rel_err(q.grad, reference.rotate(g_rope.double(), c, s, inverse=True)) < TOL[torch.float32]
    assert torch.equal(q_nope.grad, g_nope)


def test_parts_on_the_cpu_path_match_the_kernel(monkeypatch):
    """The pure-PyTorch path and the interpreted kernel: the same values for the two-part forms."""
    cache = make_cache(16, 16)
    pos = torch.tensor([3, 15, 0, 16])
    q, q_nope = torch.randn(4, 3, 16), _strided(4, 3, 8)
    k, k_nope = torch.randn(4, 1, 16), torch.randn(4, 1, 24)
    results = []
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        memo.clear()
        for last in ("first", "last"):
            q_out = _nan(4, 3, 24)
            results.append(
                ropekit.apply_rope(q, k, pos, cache, q_nope=q_nope, k_nope=k_nope, q_out=q_out, rotary_position=last)
            )
    memo.clear()
    for a, b in zip(results[:2], results[2:]):
        for x, y in zip(a, b):
            assert torch.equal(x.isnan(), y.isnan()) and rel_err(x.nan_to_num(), y.nan_to_num()) < 1e-6


def test_parts_refused_by_name_and_nothing_written():
    cache = make_cache(16, 16)
    q, k, pos = torch.randn(4, 3, 16), torch.randn(4, 2, 16), torch.randint(0, 16, (4,))
    q_nope = torch.randn(4, 3, 8)
    q_out = _nan(4, 3, 24)
    cases = [
        (dict(q_nope=q_nope, inplace=True), "q_nope: expected None when inplace=True"),
        (dict(k=None, k_nope=torch.randn(4, 2, 8)), "k_nope: expected None when k is None"),
        (dict(q_nope=q_nope, q_norm_weight=torch.ones(16)), "q_nope: expected None with q_norm_weight"),
        (dict(q=torch.randn(4, 3, 24), q_nope=q_nope), "q: expected head size 16 (rotary_dim: with q_nope given"),
        (dict(q_nope=torch.randn(4, 2, 8)), "q_nope: expected token dims and heads (4, 3) (those of q)"),
        (dict(q_nope=q_nope, q_out=_nan(4, 3, 16)), "q_out: expected shape (4, 3, 24) (q's head and q_nope's"),
        (dict(q_nope=q_out[..., 16:], q_out=q_out), "q_nope: expected memory disjoint from q_out (which is written)"),
    ]
    for kw, msg in cases:
        args = dict(q=q, k=k, positions=pos, cos_sin_cache=cache)
        args.update(kw)
        q0 = args["q"].clone()
        with pytest.raises(ValueError, match=re.escape("apply_rope: " + msg)):
            ropekit.apply_rope(**args)
        assert torch.equal(args["q"], q0) and q_out.isnan().all()


# ---------------------------------------------------------------------------------------------
# the store: FlashInfer's 3-D paged MLA cache


@pytest.mark.parametrize("form", ["views", "k_nope"])
def test_store_takes_a_3d_paged_mla_cache(device, form):
    T, L, R = 5, 24, 16
    cache = make_cache(16, R, device=device)
    q = torch.randn(T, 2, R, device=device)
    k = torch.randn(T, 1, R, device=device)
    latent = torch.randn(T, 1, L, device=device)
    pos = torch.randint(0, 16, (T,), device=device)
    slots = torch.tensor([5, 0, -1, 7, 2], device=device)
    mla = _nan(2, 4, L + R, device=device)  # (num_blocks, block_size, L + R) [latent | rope]
    want_q = _want(q, cache, pos)
    want_k = _want(k, cache, pos)
    if form == "views":
        ropekit.apply_rope_and_store(q, k, latent, pos, cache, mla[..., L:], mla[..., :L], slots)
    else:
        ropekit.apply_rope_and_store(q, k, None, pos, cache, mla, None, slots, k_nope=latent)
    assert rel_err(q, want_q) < TOL[torch.float32]
    rows = mla.view(8, L + R)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(rows[slot, :L], latent[t, 0])
        assert rel_err(rows[slot, L:], want_k[t, 0]) < TOL[torch.float32]
    assert rows[[1, 3, 4, 6]].isnan().all()  # rows no slot names are untouched


# ---------------------------------------------------------------------------------------------
# the pure-PyTorch path (CPU tensors without the interpreter) takes the same views


def test_forms_on_the_cpu_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    memo.clear()
    try:
        cache = make_cache(16, 16)
        pos = torch.randint(0, 16, (4,))
        q, k = torch.randn(4, 3, 32), _strided(4, 1, 24)
        want_q, want_k = _want(q, cache, pos, last=True), _want(k, cache, pos, last=True)
        q_out = _nan(4, 3, 40)[..., 4:36]
        got_q, got_k = ropekit.apply_rope(q, k, pos, cache, rotary_position="last", q_out=q_out)
        assert got_q is q_out and rel_err(q_out, want_q) < TOL[torch.float32]
        assert got_k.is_contiguous() and rel_err(got_k, want_k) < TOL[torch.float32]
        q2 = q.clone()
        ropekit.apply_rope(q2, k, pos, cache, rotary_position="last", inplace=True)
        assert rel_err(q2, want_q) < TOL[torch.float32] and rel_err(k, want_k) < TOL[torch.float32]
        w = torch.rand(32) + 0.5
        normed = _nan(4, 3, 32)
        ropekit.apply_rope(q, None, pos, cache, q_norm_weight=w, q_out=normed)
        ref, _ = reference.rms_norm_rope(q.double(), None, pos, cache.double(), q_norm_weight=w.double())
        assert rel_err(normed, ref) < 1e-5
        s, _ = ropekit.apply_rope(q.view(2, 2, 3, 32), None, None, cache, layout="sbhd")
        ref_pos = torch.arange(2).expand(2, 2)
        assert rel_err(s.transpose(0, 1), _want(q.view(2, 2, 3, 32).transpose(0, 1), cache, ref_pos)) < 1e-6
        q8, _ = ropekit.apply_rope(q * 8, None, pos, cache, rotary_position="last", out_dtype=FP8, q_scale=0.1)
        fp8_close(q8, _want(q * 8, cache, pos, last=True, scale=0.1, dtype=FP8), FP8)
    finally:
        memo.clear()


# ---------------------------------------------------------------------------------------------
# the forms together, eager and under Inductor


def _combined(q, k, pos, cache, q_out):
    return ropekit.apply_rope(q, k, pos, cache, layout="sbhd", rotary_position="last", q_out=q_out)


def _combined_want(q, k, pos, cache):
    """float64 reference of _combined: (S, B) terms -> (B, S) views and back."""
    bs = pos.transpose(0, 1)
    return tuple(_want(x.transpose(0, 1), cache, bs, last=True).transpose(0, 1) for x in (q, k))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_forms_together(backend):
    """sbhd, a strided k, rotary_position='last' and a destination in one call."""
    S, B = 3, 2
    cache = make_cache(16, 16)
    fn = _combined if backend == "eager" else torch.compile(_combined, fullgraph=True, backend="inductor")
    for _ in range(2):  # the second call reuses the compiled graph
        q = torch.randn(S, B, 2, 32)
        k = _strided(S, B, 1, 24)
        pos = torch.randint(0, 16, (S, B))
        q_out = _nan(S, B, 2, 40)[..., 8:]
        got_q, got_k = fn(q, k, pos, cache, q_out)
        want_q, want_k = _combined_want(q, k, pos, cache)
        assert got_q.data_ptr() == q_out.data_ptr() and rel_err(q_out, want_q) < TOL[torch.float32]
        assert rel_err(got_k, want_k) < TOL[torch.float32]
