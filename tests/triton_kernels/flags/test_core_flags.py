"""The core's output flags on apply_rope: inverse=True (de-rotation), fp8 outputs (out_dtype with
q_scale / k_scale), and in-place rotation of tensors that require grad.

Each against the float64 reference on fresh random inputs, outputs poisoned with NaN. On CPU the
kernels run in the Triton interpreter; the pure-PyTorch path is forced where named.
"""

import pytest
import torch

import ropekit
from ropekit.core import memo
from ropekit.core.variant import FLAGS
from ropekit.tools import reference

from conftest import TOL, fp8_close, make_cache, rel_err

pytestmark = pytest.mark.usefixtures("poison")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _angles(cache, positions, token_shape, **kw):
    return reference.angles_from_table(cache.double(), positions, token_shape, **kw)


def _derotated(x, cache, positions, interleaved=False, **kw):
    """float64 R(-angle) x: the reference of inverse=True."""
    c, s = _angles(cache, positions, x.shape[:-2], **kw)
    return reference.rotate(x.double(), c, s, interleaved=interleaved, inverse=True)


VARIANTS = [
    # (token shape, Hq, Hk, D, rotary_dim, keywords)
    ((6,), 4, 2, 64, 64, {}),
    ((6,), 4, 2, 64, 64, {"interleaved": True}),
    ((2, 3), 3, 1, 96, 32, {}),  # partial rotary, two token dims
    ((5,), 4, 2, 64, 64, {"mrope_section": (8, 12, 12)}),
]


@pytest.mark.parametrize("shape,hq,hk,d,rot,kw", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_matches_reference_and_undoes_the_rotation(device, shape, hq, hk, d, rot, kw, dtype):
    cache = make_cache(64, rot, device=device)
    q = torch.randn(*shape, hq, d, dtype=dtype, device=device)
    k = torch.randn(*shape, hk, d, dtype=dtype, device=device)
    pos_shape = ((3,) + shape) if "mrope_section" in kw else shape
    positions = torch.randint(0, 64, pos_shape, device=device)
    ref_kw = {n: v for n, v in kw.items() if n != "interleaved"}
    qo, ko = ropekit.apply_rope(q, k, positions, cache, inverse=True, **kw)
    assert rel_err(qo, _derotated(q, cache, positions, kw.get("interleaved", False), **ref_kw)) < TOL[dtype]
    assert rel_err(ko, _derotated(k, cache, positions, kw.get("interleaved", False), **ref_kw)) < TOL[dtype]
    # rotating the de-rotated tensors gives the inputs back (in place this time)
    ropekit.apply_rope(qo, ko, positions, cache, inplace=True, **kw)
    assert rel_err(qo, q) < 2 * TOL[dtype] and rel_err(ko, k) < 2 * TOL[dtype]


def test_inverse_with_packed_sequences(device):
    cache = make_cache(32, 32, device=device)
    cu = torch.tensor([0, 3, 7, 8], device=device)
    q = torch.randn(8, 2, 32, device=device)
    positions = ropekit.positions_from_cu_seqlens(cu)
    qo, _ = ropekit.apply_rope(q, None, None, cache, cu_seqlens=cu, inverse=True)
    assert rel_err(qo, _derotated(q, cache, positions)) < TOL[torch.float32]


def test_inverse_gradient_is_the_forward_rotation(device):
    cache = make_cache(64, 64, device=device)
    q = torch.randn(5, 3, 64, device=device, requires_grad=True)
    positions = torch.randint(0, 64, (5,), device=device)
    g = torch.randn(5, 3, 64, device=device)
    qo, _ = ropekit.apply_rope(q, None, positions, cache, inverse=True)
    assert rel_err(qo, _derotated(q.detach(), cache, positions)) < TOL[torch.float32]
    qo.backward(g)
    c, s = _angles(cache, positions, (5,))
    assert rel_err(q.grad, reference.rotate(g.double(), c, s)) < TOL[torch.float32]


# ---------------------------------------------------------------------------------------------
# fp8 outputs


def _fp8_reference(x, c, s, scale, dtype, interleaved=False):
    r = reference.rotate(x.double(), c, s, interleaved=interleaved) / scale
    big = torch.finfo(dtype).max
    return r.clamp(-big, big).to(dtype)


@pytest.mark.parametrize("out_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fp8_outputs_random(device, out_dtype, dtype, interleaved):
    cache = make_cache(64, 64, device=device)
    q = torch.randn(7, 4, 96, dtype=dtype, device=device) * 3
    k = torch.randn(7, 2, 96, dtype=dtype, device=device) * 3
    positions = torch.randint(0, 64, (7,), device=device)
    q_scale, k_scale = 0.02, torch.tensor([0.5], device=device)
    qo, ko = ropekit.apply_rope(
        q, k, positions, cache, interleaved=interleaved, out_dtype=out_dtype, q_scale=q_scale, k_scale=k_scale
    )
    assert qo.dtype == out_dtype and ko.dtype == out_dtype and qo.shape == q.shape and ko.shape == k.shape
    c, s = _angles(cache, positions, (7,))
    fp8_close(qo, _fp8_reference(q, c, s, q_scale, out_dtype, interleaved), out_dtype)
    fp8_close(ko, _fp8_reference(k, c, s, 0.5, out_dtype, interleaved), out_dtype)
    # saturation: q / 0.02 reaches past e4m3's 448, and the largest finite value is stored
    if out_dtype == torch.float8_e4m3fn:
        assert qo.float().abs().max().item() == 448.0


@pytest.mark.parametrize("out_dtype", FP8)
def test_fp8_outputs_exact_and_saturated(device, out_dtype):
    """Position 0 (cos 1, sin 0): outputs are q / scale exactly when that is an fp8 value, and the
    largest finite value where it is past the range (tail included, no scale: 1.0)."""
    cache = make_cache(8, 32, device=device)
    big = torch.finfo(out_dtype).max
    vals = torch.tensor([0.5, -1.0, 1.5, 3.0, -6.0, 2 * big, -4 * big, 0.0], dtype=torch.float32)
    q = vals.repeat(6 * 3 * 48 // 8)[: 6 * 3 * 48].view(6, 3, 48).to(device)
    positions = torch.zeros(6, dtype=torch.long, device=device)
    qo, _ = ropekit.apply_rope(q, None, positions, cache, out_dtype=out_dtype)
    want = q.clamp(-big, big).to(out_dtype)
    assert torch.equal(qo.view(torch.uint8), want.view(torch.uint8))


def test_fp8_outputs_on_the_cpu_path(monkeypatch):
    """The pure-PyTorch path (CPU tensors without the interpreter) follows the same rule."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    memo.clear()
    try:
        cache = make_cache(64, 64)
        q = torch.randn(5, 3, 64) * 40
        positions = torch.randint(0, 64, (5,))
        qo, _ = ropekit.apply_rope(q, None, positions, cache, out_dtype=torch.float8_e4m3fn, q_scale=0.1)
        c, s = _angles(cache, positions, (5,))
        fp8_close(qo, _fp8_reference(q, c, s, 0.1, torch.float8_e4m3fn), torch.float8_e4m3fn)
        assert qo.float().abs().max().item() == 448.0
    finally:
        memo.clear()


def test_out_dtype_float_and_compile(device):
    """A float out_dtype (fp32 in, bf16 out) through torch.compile fullgraph with an fp8 twin."""
    cache = make_cache(32, 32, device=device)
    q = torch.randn(4, 2, 32, device=device)
    positions = torch.randint(0, 32, (4,), device=device)

    def f(q, positions):
        a, _ = ropekit.apply_rope(q, None, positions, cache, out_dtype=torch.bfloat16)
        b, _ = ropekit.apply_rope(q, None, positions, cache, out_dtype=torch.float8_e4m3fn, q_scale=0.25)
        c, _ = ropekit.apply_rope(q, None, positions, cache, inverse=True)
        return a, b, c

    eager = f(q, positions)
    compiled = torch.compile(f, fullgraph=True, backend="eager")(q, positions)
    for x, y in zip(eager, compiled):
        assert x.dtype == y.dtype
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert eager[0].dtype == torch.bfloat16


BAD_OUT = [
    ({"out_dtype": torch.float8_e4m3fn, "inplace": True}, "apply_rope: out_dtype: expected None when inplace=True"),
    ({"out_dtype": torch.int8}, "apply_rope: out_dtype: expected None or one of"),
    ({"out_dtype": "fp8"}, "apply_rope: out_dtype: expected a torch.dtype or None, got str"),
    ({"q_scale": 2.0}, "apply_rope: q_scale: expected None without out_dtype"),
    ({"out_dtype": torch.float8_e4m3fn, "k_scale": -1.0}, "apply_rope: k_scale: expected a finite scale > 0"),
    ({"out_dtype": torch.float8_e4m3fn, "q_scale": torch.ones(2)}, "apply_rope: q_scale: expected a 0-d or 1-element"),
    ({"inverse": 1}, "apply_rope: inverse: expected a bool, got int"),
    ({"inverse": True, "q_norm_weight": "w"}, "apply_rope: inverse: expected False with q_norm_weight / k_norm_weight"),
]


@pytest.mark.parametrize("kw,message", BAD_OUT)
def test_output_flags_refused_before_any_write(kw, message):
    cache = make_cache(16, 16)
    q = torch.randn(3, 2, 16)
    q0 = q.clone()
    if kw.get("q_norm_weight") == "w":
        kw = dict(kw, q_norm_weight=torch.ones(16))
    with pytest.raises((ValueError, TypeError)) as e:
        ropekit.apply_rope(q, None, torch.arange(3), cache, **kw)
    assert str(e.value).startswith(message), str(e.value)
    assert torch.equal(q, q0)


def test_fp8_outputs_refused_under_grad():
    cache = make_cache(16, 16)
    q = torch.randn(3, 2, 16, requires_grad=True)
    with pytest.raises(ValueError, match="apply_rope: out_dtype: expected None or q's dtype while q or k requires"):
        ropekit.apply_rope(q, None, torch.arange(3), cache, out_dtype=torch.float8_e4m3fn)
    with torch.no_grad():
        qo, _ = ropekit.apply_rope(q, None, torch.arange(3), cache, out_dtype=torch.float8_e4m3fn)
    assert qo.dtype == torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# in place under autograd


@pytest.mark.parametrize("interleaved", [False, True])
def test_inplace_rotation_of_tensors_that_require_grad(device, interleaved):
    """q and k are non-leaf views of one fused qkv projection (flash-attention / Liger style):
    rotated in place, their gradients match the out-of-place rotation's."""
    cache = make_cache(64, 32, device=device)
    positions = torch.randint(0, 64, (2, 5), device=device)
    w = torch.randn(2, 5, 16, device=device)
    proj = torch.randn(16, 6 * 48, device=device, requires_grad=True)
    g = torch.randn(2, 5, 6, 48, device=device)

    def run(inplace):
        proj.grad = None
        qkv = (w @ proj).view(2, 5, 6, 48)
        q, k = qkv[:, :, :4], qkv[:, :, 4:]
        qo, ko = ropekit.apply_rope(q, k, positions, cache, interleaved=interleaved, inplace=inplace)
        if inplace:
            assert qo is q and ko is k
            out = qkv  # the base sees the rotation through its views
        else:
            out = torch.cat((qo, ko), dim=2)
        (out * g).sum().backward()
        return out.detach(), proj.grad.clone()

    out_in, grad_in = run(True)
    out_ref, grad_ref = run(False)
    assert rel_err(out_in, out_ref) < TOL[torch.float32]
    assert rel_err(grad_in, grad_ref) < TOL[torch.float32]


def test_inplace_rotation_follows_autograds_rules():
    cache = make_cache(16, 16)
    positions = torch.arange(3)
    leaf = torch.randn(3, 2, 16, requires_grad=True)
    before = leaf.detach().clone()
    for x in (leaf, leaf[:, :1]):
        with pytest.raises(ValueError, match="apply_rope: q: expected a tensor that is not a leaf requiring grad"):
            ropekit.apply_rope(x, None, positions, cache, inplace=True)
    assert torch.equal(leaf.detach(), before)  # nothing written
    # a tensor saved by another op for its backward: the version counter catches the overwrite
    x = leaf * 1.0
    y = x.exp()  # exp saves its output... and mul saves its inputs:
    z = (x * x).sum()
    ropekit.apply_rope(x, None, positions, cache, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    assert y.requires_grad


# every boolean flag the flag table gives a keyword (ropekit.core.variant.FLAGS): a new row is tested here
KEYWORD_FLAGS = [f.keyword for f in FLAGS if f.keyword]


@pytest.mark.parametrize("keyword", KEYWORD_FLAGS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_keyword_flags_match_the_oracle(keyword, interleaved, device):
    """Each keyword flag set, forward and backward, against the float64 oracle given the same keyword
    (the backward through torch.autograd of the oracle), partial rotary and GQA heads."""
    g = torch.Generator().manual_seed(len(keyword))
    T, Hq, Hk, D, R = 7, 4, 2, 64, 32
    cache = make_cache(32, R)
    pos = torch.randint(0, 32, (T,), generator=g)
    q = torch.randn(T, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(T, Hk, D, generator=g, dtype=torch.float64)
    qd, kd = (x.float().to(device).requires_grad_() for x in (q, k))
    got = ropekit.apply_rope(qd, kd, pos.to(device), cache.to(device), interleaved=interleaved, **{keyword: True})
    q64, k64 = q.clone().requires_grad_(), k.clone().requires_grad_()
    want = reference.apply_rope(q64, k64, pos, cache.double(), interleaved=interleaved, **{keyword: True})
    for a, b in zip(got, want):
        assert rel_err(a.detach(), b.detach()) < 1e-5
    grads = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in want]
    d_got = torch.autograd.grad(got, (qd, kd), [x.float().to(device) for x in grads])
    d_want = torch.autograd.grad(want, (q64, k64), grads)
    for a, b in zip(d_got, d_want):
        assert rel_err(a, b) < 1e-5


# how a call sets each field a flag row may refuse (its `refuses` column), and the argument the
# error then names: a row refusing a field missing here fails test_keyword_flag_refusals
REFUSED_FIELDS = {
    "norm_q": ({"q_norm_weight": 1}, "q_norm_weight"),
    "norm_k": ({"k_norm_weight": 1}, "k_norm_weight"),
}
REFUSING = [(f.keyword, field) for f in FLAGS if f.keyword for field in f.refuses[0]]
REFUSING_FIELDS = [(f.keyword, f.refuses[0]) for f in FLAGS if f.keyword]


@pytest.mark.parametrize("keyword,field", REFUSING)
def test_keyword_flag_refusals(keyword, field):
    """Each keyword flag with a field it does not compose with: the call is refused naming the
    keyword and the other argument, before anything is written (in place: q and k unchanged)."""
    assert field in REFUSED_FIELDS, f"{keyword} refuses {field}: add how a call sets it to REFUSED_FIELDS"
    g = torch.Generator().manual_seed(3)
    T, Hq, Hk, D = 5, 4, 2, 64
    q = torch.randn(T, Hq, D, generator=g)
    k = torch.randn(T, Hk, D, generator=g)
    q0, k0 = q.clone(), k.clone()
    given, name = REFUSED_FIELDS[field]
    extra = {arg: torch.ones(D) for arg in given}
    with pytest.raises(ValueError, match=rf"apply_rope: {keyword}: expected False with {name} \("):
        ropekit.apply_rope(q, k, torch.arange(T), make_cache(16, D), inplace=True, **extra, **{keyword: True})
    assert torch.equal(q, q0) and torch.equal(k, k0)
    if field != "norm_q" or "norm_k" not in dict(REFUSING_FIELDS)[keyword]:
        return
    # both norms at once: both arguments named, in the table's order
    both = {"q_norm_weight": torch.ones(D), "k_norm_weight": torch.ones(D)}
    with pytest.raises(ValueError, match=rf"{keyword}: expected False with q_norm_weight / k_norm_weight \("):
        ropekit.apply_rope(q, k, torch.arange(T), make_cache(16, D), **both, **{keyword: True})
