"""Autograd of ropekit's ops: gradients against float64 references, in-place rules.

- The reference is checked with torch.autograd.gradcheck in float64 (the public ops take fp16 /
  bf16 / fp32 only, so the kernel is not gradchecked itself).
- The kernel's backward (Triton interpreter on CPU, or CUDA) is compared with the float64
  reference's gradients on fresh random inputs and random upstream gradients, fp32 and bf16:
  fp32 to float32 accuracy, bf16 to one rounding of the output (2^-8 relative).
- In place under autograd: refused with ValueError when q or k requires grad; when a tensor that
  another op saved for its backward is rotated in place, that backward raises (version counter)
  instead of silently using the rotated values.
"""

import zlib
from unittest import mock

import pytest
import torch

import ropekit
from ropekit.core import checks
from ropekit.tools import reference

from conftest import make_cache

DTYPES = [torch.float32, torch.bfloat16]


def tols(dtype, device):
    """|kernel - float64 reference| <= atol + rtol * |reference|: float32 arithmetic on O(1) values,
    or one rounding to bf16 on top of it. On CUDA that rounding is to nearest (half an ulp, 2^-8
    relative); the Triton interpreter (3.x) truncates fp32 -> bf16 even when asked for "rtne", so on
    CPU one rounding costs up to a whole ulp (2^-7)."""
    if dtype == torch.float32:
        return dict(rtol=4e-6, atol=4e-6)
    return dict(rtol=(2**-8 if str(device).startswith("cuda") else 2**-7) * 1.01, atol=1e-5)


def _close(out, ref, dtype, what):
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    assert not torch.isnan(out).any(), f"{what}: NaN"
    torch.testing.assert_close(
        out.double().cpu(), ref.double().cpu(), **tols(dtype, out.device), msg=lambda m: f"{what}: {m}"
    )


def _grads_vs_reference(kernel_fn, ref_fn, inputs, dtype, *, upstream=None):
    """Gradients of sum(out_i * g_i) w.r.t. inputs: kernel (dtype) vs reference (float64).

    inputs: float64 tensors (fresh random). upstream(outs) -> upstream grads (dtype), default
    random. Returns nothing; asserts outputs and gradients match.
    """
    xs = [x.to(dtype).requires_grad_() for x in inputs]
    outs = [o for o in kernel_fn(*xs) if o is not None]
    gs = upstream(outs) if upstream is not None else [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, xs, gs)
    xs64 = [x.detach().double().requires_grad_() for x in xs]  # the same (rounded) values
    refs = [o for o in ref_fn(*xs64) if o is not None]
    ref_grads = torch.autograd.grad(refs, xs64, [g.double() for g in gs])
    for i, (o, r) in enumerate(zip(outs, refs)):
        _close(o, r, dtype, f"output {i}")
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        _close(g, r, dtype, f"grad {i}")


# ---------------------------------------------------------------------------------------------
# the reference: gradcheck in float64


@pytest.mark.parametrize("interleaved,out_interleaved", [(False, False), (True, True), (True, False), (False, True)])
@pytest.mark.parametrize("inverse", [False, True])
def test_gradcheck_reference_rotate(interleaved, out_interleaved, inverse):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 10, dtype=torch.float64, generator=g, requires_grad=True)
    ang = torch.rand(3, 3, dtype=torch.float64, generator=g) * 6.0  # rotary_dim 6 of 10: partial
    cos, sin = ang.cos(), ang.sin()

    def fn(x):
        return reference.rotate(x, cos, sin, interleaved=interleaved, out_interleaved=out_interleaved, inverse=inverse)

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("case", ["plain", "interleaved_partial", "mrope", "mrope_interleaved", "arange"])
def test_gradcheck_reference_apply_rope(case):
    g = torch.Generator().manual_seed(2)
    B, S, D = 2, 3, 12
    q = torch.randn(B, S, 2, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, S, 1, D, dtype=torch.float64, generator=g, requires_grad=True)
    kw = {}
    rot = D
    positions = torch.randint(0, 16, (B, S), generator=g)
    if case == "interleaved_partial":
        rot, kw = 8, dict(interleaved=True)
    elif case.startswith("mrope"):
        positions = torch.randint(0, 16, (3, B, S), generator=g)
        kw = dict(mrope_section=[2, 2, 2], mrope_interleaved=case == "mrope_interleaved")
    elif case == "arange":
        positions = None
    cache = make_cache(16, rot, dtype=torch.float64)
    fn = lambda q, k: reference.apply_rope(q, k, positions, cache, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k))


# ---------------------------------------------------------------------------------------------
# the kernel's backward against the float64 reference


def _rope_fns(positions, cache, **kw):
    cache64 = cache.double()
    return (
        lambda q, k: ropekit.apply_rope(q, k, positions, cache, **kw),
        lambda q, k: reference.apply_rope(q, k, positions, cache64, **kw),
    )


APPLY_CASES = {
    # name: (token shape, Hq, Dq, Hk, Dk, rotary_dim, kwargs, positions kind)
    "tokens_half": ((7,), 4, 16, 2, 16, 16, {}, "pos"),
    "batch_interleaved": ((2, 5), 3, 16, 1, 16, 16, dict(interleaved=True), "pos"),
    "partial_dk_differs": ((2, 5), 4, 24, 2, 12, 8, {}, "pos"),
    "partial_interleaved": ((6,), 2, 20, 2, 20, 12, dict(interleaved=True), "pos"),
    "arange": ((2, 6), 2, 16, 2, 16, 16, {}, None),
    "mrope": ((2, 5), 2, 16, 1, 16, 16, dict(mrope_section=[2, 3, 3]), "mrope"),
    "mrope_interleaved": ((5,), 2, 32, 2, 32, 32, dict(mrope_section=[6, 5, 5], mrope_interleaved=True), "mrope"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(APPLY_CASES))
def test_apply_rope_backward_matches_float64(case, dtype, device, poison):
    tok, hq, dq, hk, dk, rot, kw, pos_kind = APPLY_CASES[case]
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    max_pos = 32
    cache = make_cache(max_pos, rot, device=device)
    if pos_kind == "pos":
        positions = torch.randint(0, max_pos, tok, generator=g).to(device)
    elif pos_kind == "mrope":
        positions = torch.randint(0, max_pos, (3, *tok), generator=g).to(device)
    else:
        positions = None
    q = torch.randn(*tok, hq, dq, dtype=torch.float64, generator=g).to(device)
    k = torch.randn(*tok, hk, dk, dtype=torch.float64, generator=g).to(device)
    _grads_vs_reference(*_rope_fns(positions, cache, **kw), [q, k], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_fused_qkv_views(dtype, device, poison):
    """q and k are strided views of one fused projection; the gradient lands in the buffer."""
    T, Hq, Hk, D = 6, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    buf64 = torch.randn(T, (Hq + 2 * Hk) * D, dtype=torch.float64, generator=g).to(device)
    cache = make_cache(20, D, device=device)
    positions = torch.randint(0, 20, (T,), generator=g).to(device)
    kfn, rfn = _rope_fns(positions, cache)

    def split(buf):
        q = buf[:, : Hq * D].view(T, Hq, D)
        k = buf[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
        return q, k

    _grads_vs_reference(lambda b: kfn(*split(b)), lambda b: rfn(*split(b)), [buf64], dtype)


@pytest.mark.parametrize("layout", ["transposed", "expanded", "sliced"])
def test_backward_upstream_gradient_layouts(layout, device, poison):
    """Upstream gradients autograd really produces: a transposed layout (last stride != 1, as the
    gradient of `q @ k.transpose(-1, -2)` w.r.t. k has), an expanded one (`out.sum()`), a slice."""
    T, H, D = 5, 3, 16
    g = torch.Generator().manual_seed(4)
    cache = make_cache(16, D, device=device)
    positions = torch.randint(0, 16, (T,), generator=g).to(device)
    q = torch.randn(T, H, D, dtype=torch.float64, generator=g).to(device)
    k = torch.randn(T, 2, D, dtype=torch.float64, generator=g).to(device)

    def upstream(outs):
        if layout == "transposed":
            gs = [torch.randn(*o.shape[:-2], o.shape[-1], o.shape[-2], device=device).transpose(-1, -2) for o in outs]
            assert gs[0].stride(-1) != 1
        elif layout == "expanded":
            gs = [torch.randn(o.shape[-1], device=device).expand(o.shape) for o in outs]
        else:
            gs = [torch.randn(*o.shape[:-1], 2 * o.shape[-1], device=device)[..., 1::2] for o in outs]
        return gs

    _grads_vs_reference(*_rope_fns(positions, cache), [q, k], torch.float32, upstream=upstream)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["deepseek", "llama4_strided", "mrope_per_token", "partial_interleaved"])
def test_rotate_with_angles_backward(case, dtype, device, poison):
    """The per-token form Hugging Face uses: DeepSeek's pairs-in / halves-out, Llama 4's stride-2
    cos/sin views, M-RoPE with (3, B, S, half) angles."""
    B, S = 2, 5
    g = torch.Generator().manual_seed(5)
    D, half = 16, 8
    kw = {}
    if case == "deepseek":
        kw = dict(interleaved=True, out_interleaved=False)
    elif case == "partial_interleaved":
        half, kw = 4, dict(interleaved=True)
    ang_shape = (3, B, S, half) if case == "mrope_per_token" else (B, S, half)
    if case == "mrope_per_token":
        kw = dict(mrope_section=[2, 3, 3])
    ang = torch.rand(*ang_shape, dtype=torch.float64, generator=g) * 10
    if case == "llama4_strided":
        fr = torch.view_as_real(torch.polar(torch.ones_like(ang), ang).to(torch.complex64).to(device))
        cos, sin = fr[..., 0], fr[..., 1]
        assert cos.stride(-1) == 2
        kw = dict(interleaved=True)
    else:
        cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    q = torch.randn(B, S, 4, D, dtype=torch.float64, generator=g).to(device)
    k = torch.randn(B, S, 2, D, dtype=torch.float64, generator=g).to(device)

    def ref(q, k):
        c, s = cos.double(), sin.double()
        if "mrope_section" in kw:
            sec = reference.mrope_sections_of_frequencies(half, kw["mrope_section"], False).to(device)
            pick = sec.view(1, 1, 1, -1).expand(1, B, S, half)
            c, s = c.gather(0, pick)[0], s.gather(0, pick)[0]
        rk = {k_: v for k_, v in kw.items() if k_ != "mrope_section"}
        return reference.rotate(q, c, s, **rk), reference.rotate(k, c, s, **rk)

    _grads_vs_reference(lambda q, k: ropekit.rotate_with_angles(q, k, cos, sin, **kw), ref, [q, k], dtype)


@pytest.mark.parametrize("which", ["q_only", "k_only", "k_none"])
def test_backward_partial_requirements(which, device, poison):
    """Only one of q / k requires grad, or k is None; an output left out of the loss gives zeros."""
    T, D = 6, 16
    g = torch.Generator().manual_seed(6)
    cache = make_cache(16, D, device=device)
    positions = torch.randint(0, 16, (T,), generator=g).to(device)
    q64 = torch.randn(T, 2, D, dtype=torch.float64, generator=g).to(device)
    k64 = torch.randn(T, 2, D, dtype=torch.float64, generator=g).to(device)
    q, k = q64.float(), k64.float()
    if which == "k_none":
        q.requires_grad_()
        qo, ko = ropekit.apply_rope(q, None, positions, cache)
        assert ko is None
        up = torch.randn_like(qo)
        (gq,) = torch.autograd.grad(qo, q, up)
        ref, _ = reference.apply_rope(q64.requires_grad_(), None, positions, cache.double())
        (rq,) = torch.autograd.grad(ref, q64, up.double())
        _close(gq, rq, torch.float32, "grad q")
        return
    target = q if which == "q_only" else k
    target.requires_grad_()
    qo, ko = ropekit.apply_rope(q, k, positions, cache)
    out = qo if which == "q_only" else ko
    up = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, target, up)
    target64 = (q64 if which == "q_only" else k64).requires_grad_()
    rq, rk = reference.apply_rope(q64, k64, positions, cache.double())
    (rgrad,) = torch.autograd.grad(rq if which == "q_only" else rk, target64, up.double())
    _close(grad, rgrad, torch.float32, "grad")
    # the other output does not reach the loss: its input gets an exact zero gradient
    q2, k2 = q64.float().requires_grad_(), k64.float().requires_grad_()
    qo, ko = ropekit.apply_rope(q2, k2, positions, cache)
    gq, gk = torch.autograd.grad((qo * torch.randn_like(qo)).sum(), (q2, k2))
    assert gq.abs().sum() > 0 and torch.equal(gk, torch.zeros_like(gk))


def test_double_backward_matches_reference(device):
    """The backward is itself the differentiable op: grad of a gradient agrees with the reference."""
    T, D = 5, 16
    g = torch.Generator().manual_seed(7)
    cache = make_cache(16, D, device=device)
    positions = torch.randint(0, 16, (T,), generator=g).to(device)
    q64 = torch.randn(T, 2, D, dtype=torch.float64, generator=g).to(device)
    v = torch.randn(T, 2, D, dtype=torch.float64, generator=g).to(device)
    w = torch.randn(T, 2, D, dtype=torch.float64, generator=g).to(device)

    def second(fn, q, cache_, v, w):
        up = v.clone().requires_grad_()
        out, _ = fn(q, None, positions, cache_)
        (gq,) = torch.autograd.grad(out, q, up, create_graph=True)
        (gup,) = torch.autograd.grad((gq * w).sum(), up)
        return gq, gup

    q = q64.float().requires_grad_()
    gq, gup = second(ropekit.apply_rope, q, cache, v.float(), w.float())
    rq, rup = second(reference.apply_rope, q64.clone().requires_grad_(), cache.double(), v, w)
    _close(gq, rq, torch.float32, "grad")
    _close(gup, rup, torch.float32, "grad of grad")


# ---------------------------------------------------------------------------------------------
# in place under autograd


@pytest.mark.parametrize("which", ["q", "k"])
def test_inplace_with_requires_grad_is_refused(which, device):
    T, D = 4, 16
    cache = make_cache(8, D, device=device)
    positions = torch.arange(T, device=device)
    q = torch.randn(T, 2, D, device=device)
    k = torch.randn(T, 2, D, device=device)
    (q if which == "q" else k).requires_grad_()
    with torch.no_grad():  # the same call signature allowed (and cached) without grad first
        ropekit.apply_rope(q, k, positions, cache, inplace=True)
    q0, k0 = q.detach().clone(), k.detach().clone()
    with pytest.raises(ValueError, match="inplace"):
        ropekit.apply_rope(q, k, positions, cache, inplace=True)
    assert torch.equal(q.detach(), q0) and torch.equal(k.detach(), k0), "written before raising"
    # a view of a tensor that requires grad is refused too
    base = torch.randn(T, 4, D, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="inplace"):
        ropekit.apply_rope(base[:, :2], None, positions, cache, inplace=True)


def test_inplace_under_no_grad_is_allowed_and_correct(device):
    T, D = 5, 16
    g = torch.Generator().manual_seed(8)
    cache = make_cache(8, D, device=device)
    positions = torch.randint(0, 8, (T,), generator=g).to(device)
    q = torch.randn(T, 2, D, generator=g).to(device).requires_grad_()
    ref, _ = reference.apply_rope(q.detach().double(), None, positions, cache.double())
    with torch.no_grad():
        out, _ = ropekit.apply_rope(q, None, positions, cache, inplace=True)
    assert out is q
    _close(q.detach(), ref, torch.float32, "in place")


def test_inplace_on_tensor_saved_for_backward_raises(device):
    """x does not require grad but `x * w` saved it for w's gradient: rotating x in place must make
    that backward raise (as any in-place torch op would), not silently use the rotated x."""
    T, D = 4, 16
    cache = make_cache(8, D, device=device)
    positions = torch.arange(T, device=device)
    x = torch.randn(T, 2, D, device=device)
    w = torch.randn(T, 2, D, device=device, requires_grad=True)
    y = (x * w).sum()
    version = x._version
    ropekit.apply_rope(x, None, positions, cache, inplace=True)
    assert x._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


# ---------------------------------------------------------------------------------------------
# the cached training path: one call signature under grad and no-grad, and the saved table


def test_same_signature_with_and_without_grad(device, poison):
    """A call signature first seen without grad (cached plan, no backward) and then under grad (and
    back) keeps giving the reference's outputs and gradients: the cache keeps the two apart."""
    T, D = 6, 16
    g = torch.Generator().manual_seed(11)
    cache = make_cache(16, D, device=device)
    positions = torch.randint(0, 16, (T,), generator=g).to(device)
    q = torch.randn(T, 3, D, generator=g).to(device).requires_grad_()
    k = torch.randn(T, 1, D, generator=g).to(device).requires_grad_()
    ref_q, ref_k = reference.apply_rope(q.detach().double(), k.detach().double(), positions, cache.double())
    for grad in (False, True, False, True):
        with torch.set_grad_enabled(grad):
            qo, ko = ropekit.apply_rope(q, k, positions, cache)
        assert qo.requires_grad == grad and ko.requires_grad == grad
        _close(qo.detach(), ref_q, torch.float32, "q out")
        _close(ko.detach(), ref_k, torch.float32, "k out")
        if grad:
            up_q, up_k = torch.randn_like(qo), torch.randn_like(ko)
            gq, gk = torch.autograd.grad((qo, ko), (q, k), (up_q, up_k))
            q64 = q.detach().double().requires_grad_()
            k64 = k.detach().double().requires_grad_()
            o64 = reference.apply_rope(q64, k64, positions, cache.double())
            eq, ek = torch.autograd.grad(o64, (q64, k64), (up_q.double(), up_k.double()))
            _close(gq, eq, torch.float32, "grad q")
            _close(gk, ek, torch.float32, "grad k")


@pytest.mark.parametrize("entry", ["apply_rope", "rotate_with_angles"])
def test_angles_changed_before_backward_raises(entry, device):
    """The angles are saved for the backward: changing them in place in between must raise (as
    autograd does for any saved tensor), not silently give gradients of other angles."""
    T, D = 4, 16
    cache = make_cache(8, D, device=device)
    positions = torch.arange(T, device=device)
    q = torch.randn(T, 2, D, device=device, requires_grad=True)
    if entry == "apply_rope":
        out, _ = ropekit.apply_rope(q, None, positions, cache)
        changed = cache
    else:
        cos, sin = cache[:T, : D // 2].clone(), cache[:T, D // 2 :].clone()
        out, _ = ropekit.rotate_with_angles(q, None, cos, sin)
        changed = cos
    changed.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_hf_dropin_double_backward_matches_hf_math(device):
    """The HF drop-in's backward (Hugging Face's (B, H, S, D) layout, planned through the kernel's
    view) is itself differentiable: gradients of gradients agree with HF's own formula."""
    from ropekit import hf

    B, S, H, D = 2, 5, 3, 16
    g = torch.Generator().manual_seed(12)
    q0 = torch.randn(B, S, H, D, generator=g).to(device).transpose(1, 2)  # (B, H, S, D) view
    k0 = torch.randn(B, S, 1, D, generator=g).to(device).transpose(1, 2)
    pos = torch.arange(S, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, D, 2) / D)
    emb = torch.cat([pos, pos], -1)
    cos = emb.cos().float().to(device).expand(B, S, D)
    sin = emb.sin().float().to(device).expand(B, S, D)

    def hf_math(q, k, c, s):
        def rot_half(x):
            return torch.cat((-x[..., D // 2 :], x[..., : D // 2]), -1)

        c, s = c.unsqueeze(1), s.unsqueeze(1)
        return q * c + rot_half(q) * s, k * c + rot_half(k) * s

    v = torch.randn(B, H, S, D, generator=g).to(device)
    w = torch.randn(B, H, S, D, generator=g).to(device)
    results = []
    # the drop-in twice: the second call is a remembered one (cos and sin handed over unsliced)
    for fn in (hf.apply_rotary_pos_emb, hf.apply_rotary_pos_emb, hf_math):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        up = v.clone().requires_grad_()
        qo, ko = fn(q, k, cos, sin)
        (gq,) = torch.autograd.grad(qo, q, up, create_graph=True)
        (gup,) = torch.autograd.grad((gq * w).sum(), up)
        results.append((qo.detach(), gq.detach(), gup))
    for call in (0, 1):
        for got, want, what in zip(results[call], results[2], ("output", "grad", "grad of grad")):
            _close(got, want, torch.float32, f"call {call}: {what}")


@pytest.mark.parametrize("layout", ["heads-first", "tokens-first-partial"])
def test_hf_dropin_remembered_training_call(device, layout):
    """The drop-in's training calls are validated and planned once per signature (HF's unsliced
    cos/sin go to the kernel as given): outputs and gradients stay HF's, call after call."""
    from ropekit import hf
    from ropekit.core import memo

    memo.clear()
    B, S, H, D = 2, 5, 3, 16
    R = D if layout == "heads-first" else 8  # partial rotary: a narrower table
    ud = 1 if layout == "heads-first" else 2
    g = torch.Generator().manual_seed(13)
    pos = torch.arange(S, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, R, 2) / R)
    emb = torch.cat([pos, pos], -1)
    cos = emb.cos().float().to(device)[None]  # (1, S, R): broadcast over the batch
    sin = emb.sin().float().to(device)[None]

    def hf_math(q, k, c, s):
        def rot_half(x):
            return torch.cat((-x[..., R // 2 :], x[..., : R // 2]), -1)

        c, s = c.unsqueeze(ud), s.unsqueeze(ud)
        out = []
        for x in (q, k):
            xr, xp = x[..., :R], x[..., R:]
            out.append(torch.cat((xr * c + rot_half(xr) * s, xp), -1))
        return tuple(out)

    with mock.patch.object(checks, "angles", wraps=checks.angles) as validated:
        for step in range(3):
            base_q = torch.randn(B, S, H, D, generator=g).to(device)
            base_k = torch.randn(B, S, 1, D, generator=g).to(device)
            if ud == 1:
                base_q, base_k = base_q.transpose(1, 2), base_k.transpose(1, 2)
            ups = [torch.randn_like(base_q), torch.randn_like(base_k)]
            results = []
            for fn in (hf.apply_rotary_pos_emb, hf_math):
                q, k = base_q.clone().requires_grad_(), base_k.clone().requires_grad_()
                outs = fn(q, k, cos, sin, unsqueeze_dim=ud) if fn is not hf_math else fn(q, k, cos, sin)
                grads = torch.autograd.grad(outs, (q, k), ups)
                results.append([o.detach() for o in outs] + list(grads))
            for got, want, what in zip(results[0], results[1], ("q out", "k out", "grad q", "grad k")):
                _close(got, want, torch.float32, f"step {step}: {what}")
    assert validated.call_count == 1, "a repeated training call was validated again"
