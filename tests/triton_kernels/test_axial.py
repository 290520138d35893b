"""Axial (N-D) RoPE: ropekit.axial_inv_freq, complex freqs_cis, and angles computed in the kernel
from positions x inverse frequencies (apply_rope(..., inv_freq=, axes=)), against float64."""

from __future__ import annotations

import pytest
import torch

import ropekit

# ---------------------------------------------------------------------------------------------
# axial_inv_freq


def _freqs64(d, theta):
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)


@pytest.mark.parametrize(
    "axes_dim, theta",
    [
        ((16, 56, 56), 10000.0),  # Flux.1 EmbedND, Qwen-Image
        ((44, 42, 42), 10000.0),  # Wan 2.1 (head dim 128: d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
        ((16, 56, 56), 256.0),  # HunyuanVideo
        ((32, 32), (100.0, 10000.0)),  # one base per axis
        ((64,), 10000.0),  # one axis: ropekit.inv_freq's frequencies
    ],
)
def test_axial_inv_freq_matches_float64(axes_dim, theta):
    f = ropekit.axial_inv_freq(axes_dim, theta)
    thetas = theta if isinstance(theta, tuple) else (theta,) * len(axes_dim)
    want = torch.cat([_freqs64(d, t) for d, t in zip(axes_dim, thetas)])
    assert f.dtype == torch.float32 and f.shape == (sum(axes_dim) // 2,)
    assert torch.equal(f, want.float())  # float64 math rounded once


def test_axial_inv_freq_one_axis_is_inv_freq():
    assert torch.equal(ropekit.axial_inv_freq((64,), 500000.0), ropekit.inv_freq(64, 500000.0)[0])


def test_axial_inv_freq_each_axis_restarts():
    f = ropekit.axial_inv_freq((16, 56, 56))
    assert f[0] == 1.0 and f[8] == 1.0 and f[36] == 1.0  # each section starts at frequency 1


@pytest.mark.parametrize(
    "axes_dim, theta, name, expected",
    [
        ((), 10000.0, "axes_dim", "non-empty"),
        ((16, 7), 10000.0, "axes_dim", "positive even ints"),
        ((16, 0), 10000.0, "axes_dim", "positive even ints"),
        ((16, True), 10000.0, "axes_dim", "positive even ints"),
        ((16, 16), -1.0, "theta", "a positive number"),
        ((16, 16), (1.0, 2.0, 3.0), "theta", "2 numbers"),
        ((16, 16), (1.0, float("nan")), "theta", "a positive number"),
    ],
)
def test_axial_inv_freq_bad_arguments(axes_dim, theta, name, expected):
    with pytest.raises(ValueError, match=f"axial_inv_freq: {name}: expected .*{expected}"):
        ropekit.axial_inv_freq(axes_dim, theta)


# ---------------------------------------------------------------------------------------------
# complex freqs_cis (Meta Llama / torchtitan convention)


def _complex_rotate64(x, fc):
    """x (*T, H, D) viewed as D/2 complex pairs (2i, 2i+1) times fc (*T, half): float64 oracle;
    dims past 2 * half are kept."""
    half = fc.shape[-1]
    xc = torch.view_as_complex(x[..., : 2 * half].double().reshape(*x.shape[:-1], half, 2).contiguous())
    out = torch.view_as_real(xc * fc.to(torch.complex128).unsqueeze(-2)).flatten(-2)
    return torch.cat((out, x[..., 2 * half :].double()), dim=-1)


def _polar(shape, gen, scale=10.0):
    ang = torch.rand(*shape, dtype=torch.float64, generator=gen) * scale
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64)


@pytest.mark.parametrize("case", ["tokens", "batch_broadcast", "partial"])
def test_freqs_cis_matches_complex_product(case, poison):
    g = torch.Generator().manual_seed(0)
    B, S, D = 2, 5, 16
    half = 4 if case == "partial" else D // 2
    fc = _polar((S, half) if case == "batch_broadcast" else (B, S, half), g)
    q = torch.randn(B, S, 3, D, generator=g)
    k = torch.randn(B, S, 2, D, generator=g)
    qo, ko = ropekit.rotate_with_angles(q, k, freqs_cis=fc)
    for x, o in ((q, qo), (k, ko)):
        torch.testing.assert_close(o.double(), _complex_rotate64(x, fc), rtol=1e-6, atol=1e-6)


def test_freqs_cis_bf16_and_half_split(poison):
    g = torch.Generator().manual_seed(1)
    fc = _polar((7, 8), g)
    q = torch.randn(7, 2, 16, generator=g).bfloat16()
    qo, _ = ropekit.rotate_with_angles(q, None, freqs_cis=fc)
    torch.testing.assert_close(qo.double(), _complex_rotate64(q, fc), rtol=1e-2, atol=1e-2)
    # interleaved=False: the halves (i, i + 8) are the complex numbers
    q32 = torch.randn(7, 2, 16, generator=g)
    qo, _ = ropekit.rotate_with_angles(q32, None, freqs_cis=fc, interleaved=False)
    pairs = torch.stack((q32[..., :8], q32[..., 8:]), dim=-1).flatten(-2)
    want = _complex_rotate64(pairs, fc).unflatten(-1, (8, 2))
    torch.testing.assert_close(qo.double(), torch.cat((want[..., 0], want[..., 1]), dim=-1), rtol=1e-6, atol=1e-6)


def test_freqs_cis_backward(poison):
    g = torch.Generator().manual_seed(2)
    fc = _polar((2, 5, 8), g)
    q = torch.randn(2, 5, 3, 16, dtype=torch.float64, generator=g)
    k = torch.randn(2, 5, 2, 16, dtype=torch.float64, generator=g)
    qf, kf = q.float().requires_grad_(), k.float().requires_grad_()
    qo, ko = ropekit.rotate_with_angles(qf, kf, freqs_cis=fc)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    dq, dk = torch.autograd.grad((qo, ko), (qf, kf), (gq, gk))
    q64, k64 = q.requires_grad_(), k.requires_grad_()
    rq, rk = _complex_rotate64(q64, fc), _complex_rotate64(k64, fc)
    wq, wk = torch.autograd.grad((rq, rk), (q64, k64), (gq.double(), gk.double()))
    torch.testing.assert_close(dq.double(), wq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dk.double(), wk, rtol=1e-6, atol=1e-6)


def test_freqs_cis_compile_fullgraph():
    g = torch.Generator().manual_seed(3)
    fc = _polar((6, 8), g)
    q = torch.randn(6, 2, 16, generator=g)

    def f(q, fc):
        return ropekit.rotate_with_angles(q, None, freqs_cis=fc)[0] * 2.0

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, fc)
    torch.testing.assert_close(out.double(), 2.0 * _complex_rotate64(q, fc), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(freqs_cis=torch.ones(4, 8)), ValueError, "freqs_cis: expected dtype complex64, got float32"),
        (dict(freqs_cis=torch.ones(4, 8, dtype=torch.complex128)), ValueError, "expected dtype complex64"),
        (dict(freqs_cis=[1.0]), TypeError, "freqs_cis: expected a torch.Tensor"),
        (dict(), TypeError, "freqs_cis: expected a torch.Tensor"),
        (dict(freqs_cis=torch.ones(4, 8, dtype=torch.complex64), cos=torch.ones(4, 8)), ValueError, "one angle source"),
        (
            dict(freqs_cis=torch.ones(4, 8, dtype=torch.complex64).requires_grad_()),
            ValueError,
            "freqs_cis: expected a tensor that does not require grad",
        ),
        (dict(freqs_cis=torch.ones(3, 8, dtype=torch.complex64)), ValueError, "cos: expected a shape broadcastable"),
    ],
)
def test_freqs_cis_bad_arguments(kwargs, error, message):
    q = torch.randn(4, 2, 16)
    with pytest.raises(error, match=f"rotate_with_angles: .*{message}"):
        ropekit.rotate_with_angles(q, None, **kwargs)


# ---------------------------------------------------------------------------------------------
# apply_rope(..., inv_freq=, axes=): angles computed in the kernel

from ropekit.core import memo  # noqa: E402
from ropekit.tools import reference  # noqa: E402

AXES_CASES = {
    "one_set": None,  # positions (*T), every pair
    "one_axis": (8,),
    "two_axes_vit": (4, 4),
    "three_axes_flux": (2, 3, 3),
    "four_axes": (2, 2, 3, 1),
    "empty_axis": (0, 5, 3),
}


def _freqs_for(axes, half, theta=100.0):
    dims = [2 * a for a in axes] if axes else [2 * half]
    if any(d == 0 for d in dims):  # an axis without pairs: its width contributes nothing
        dims = [d for d in dims if d]
    return ropekit.axial_inv_freq(dims, theta)


def _positions(axes, token_shape, gen, floats):
    shape = ((len(axes),) if axes else ()) + tuple(token_shape)
    if floats:
        return (torch.rand(*shape, dtype=torch.float64, generator=gen) * 80 - 40).float()
    return torch.randint(-40, 40, shape, generator=gen)


def _oracle(x, positions, inv_freq, axes, interleaved):
    c, s = reference.angles_from_freqs(positions, inv_freq, axes or (), torch.float64)
    return reference.rotate(x.double(), c, s, interleaved=interleaved)


def _close(out, ref, dtype=torch.float32):
    tol = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
@pytest.mark.parametrize("case", list(AXES_CASES))
def test_freqs_forward_matches_float64(case, interleaved, poison):
    axes = AXES_CASES[case]
    g = torch.Generator().manual_seed(hash(case) % 1000)
    token_shape = (2, 3)
    f = _freqs_for(axes, 8)
    pos = _positions(axes, token_shape, g, floats=case in ("two_axes_vit", "one_set"))
    q = torch.randn(*token_shape, 3, 16, generator=g)
    k = torch.randn(*token_shape, 1, 16, generator=g)
    qo, ko = ropekit.apply_rope(q, k, pos, None, inv_freq=f, axes=axes, interleaved=interleaved)
    _close(qo, _oracle(q, pos, f, axes, interleaved))
    _close(ko, _oracle(k, pos, f, axes, interleaved))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_freqs_partial_rotary_low_precision_strided(dtype, poison):
    """rotary_dim 2 * len(inv_freq) < head size: the tail is copied; q a slice of a fused buffer."""
    g = torch.Generator().manual_seed(7)
    axes = (2, 2, 2)
    f = _freqs_for(axes, 6)
    pos = _positions(axes, (5,), g, floats=False)
    qkv = torch.randn(5, 6, 32, generator=g).to(dtype)
    q, k = qkv[:, :4], qkv[:, 4:]
    qo, ko = ropekit.apply_rope(q, k, pos, None, inv_freq=f, axes=axes, interleaved=True, rotary_dim=12)
    _close(qo, _oracle(q, pos, f, axes, True), dtype)
    _close(ko, _oracle(k, pos, f, axes, True), dtype)
    assert torch.equal(qo[..., 12:], q[..., 12:])


def test_freqs_inplace(poison):
    g = torch.Generator().manual_seed(8)
    axes = (4, 2, 2)
    f = _freqs_for(axes, 8)
    pos = _positions(axes, (2, 4), g, floats=True)
    q = torch.randn(2, 4, 2, 16, generator=g)
    k = torch.randn(2, 4, 2, 16, generator=g)
    want_q, want_k = _oracle(q, pos, f, axes, False), _oracle(k, pos, f, axes, False)
    qo, ko = ropekit.apply_rope(q, k, pos, None, inv_freq=f, axes=axes, inplace=True)
    assert qo is q and ko is k
    _close(q, want_q)
    _close(k, want_k)


def test_freqs_cpu_path_without_triton(monkeypatch, poison):
    """Plain CPU (no interpreter): the pure-PyTorch path gives the same answers."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    memo.clear()
    g = torch.Generator().manual_seed(9)
    axes = (2, 3, 3)
    f = _freqs_for(axes, 8)
    pos = _positions(axes, (6,), g, floats=True)
    q = torch.randn(6, 2, 16, generator=g)
    try:
        qo, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f, axes=axes, interleaved=True)
        qo2, _ = ropekit.apply_rope(q.clone(), None, pos, None, inv_freq=f, axes=axes, interleaved=True, inplace=True)
    finally:
        memo.clear()
    _close(qo, _oracle(q, pos, f, axes, True))
    _close(qo2, _oracle(q, pos, f, axes, True))


def _autograd_oracle(q, k, pos, f, axes, interleaved):
    """Rotation with float64 angles built by differentiable torch ops (inv_freq's gradient too)."""
    p = reference.pair_positions(pos, axes or (), f.shape[0]).double()
    angle = p * f
    c, s = angle.cos(), angle.sin()
    return [None if x is None else reference.rotate(x, c, s, interleaved=interleaved) for x in (q, k)]


@pytest.mark.parametrize("learn_freqs", [False, True], ids=["fixed", "learnable"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_freqs_backward(interleaved, learn_freqs, poison):
    g = torch.Generator().manual_seed(10)
    axes = (3, 2, 3)
    f64 = _freqs_for(axes, 8).double()
    pos = _positions(axes, (2, 3), g, floats=True)
    q64 = torch.randn(2, 3, 2, 20, dtype=torch.float64, generator=g)
    k64 = torch.randn(2, 3, 1, 20, dtype=torch.float64, generator=g)
    q, k = q64.float().requires_grad_(), k64.float().requires_grad_()
    f = f64.float().requires_grad_(learn_freqs)
    qo, ko = ropekit.apply_rope(q, k, pos, None, inv_freq=f, axes=axes, interleaved=interleaved)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    inputs = (q, k, f) if learn_freqs else (q, k)
    grads = torch.autograd.grad((qo, ko), inputs, (gq, gk))
    r_in = [x.detach().double().requires_grad_() for x in inputs]
    rq, rk = _autograd_oracle(r_in[0], r_in[1], pos, r_in[2] if learn_freqs else f64, axes, interleaved)
    want = torch.autograd.grad((rq, rk), r_in, (gq.double(), gk.double()))
    _close(qo, rq.detach())
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


def test_freqs_grad_only_for_freqs(poison):
    """q and k constants, inv_freq learnable (a ViT with learnable RoPE frequencies, frozen input)."""
    g = torch.Generator().manual_seed(11)
    f = _freqs_for(None, 4).requires_grad_()
    pos = _positions(None, (5,), g, floats=True)
    q = torch.randn(5, 2, 8, generator=g)
    qo, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f)
    (df,) = torch.autograd.grad(qo.square().sum() + qo[..., 0].sum(), f)
    fr = f.detach().double().requires_grad_()
    (rq,) = [x for x in _autograd_oracle(q.double(), None, pos, fr, None, False) if x is not None]
    (want,) = torch.autograd.grad(rq.square().sum() + rq[..., 0].sum(), fr)
    torch.testing.assert_close(df.double(), want, rtol=2e-5, atol=1e-5)


def test_freqs_compile_fullgraph_forward_backward():
    g = torch.Generator().manual_seed(12)
    axes = (2, 3, 3)
    f = _freqs_for(axes, 8).requires_grad_()
    pos = _positions(axes, (6,), g, floats=True)
    q = torch.randn(6, 2, 16, generator=g, requires_grad=True)

    def step(q, f):
        qo, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f, axes=axes, interleaved=True)
        return (qo * qo[..., :1]).sum()

    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(q, f)
    dq, df = torch.autograd.grad(loss, (q, f))
    q2, f2 = q.detach().double().requires_grad_(), f.detach().double().requires_grad_()
    (rq,) = [x for x in _autograd_oracle(q2, None, pos, f2, axes, True) if x is not None]
    want = torch.autograd.grad((rq * rq[..., :1]).sum(), (q2, f2))
    torch.testing.assert_close(loss.double(), (rq * rq[..., :1]).sum().detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dq.double(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(df.double(), want[1], rtol=1e-4, atol=1e-4)


def test_freqs_compile_inplace():
    g = torch.Generator().manual_seed(13)
    f = _freqs_for(None, 8)
    pos = _positions(None, (4,), g, floats=False)
    q = torch.randn(4, 2, 16, generator=g)
    want = _oracle(q, pos, f, None, False)

    def step(q):
        ropekit.apply_rope(q, None, pos, None, inv_freq=f, inplace=True)
        return q.sum()

    total = torch.compile(step, fullgraph=True, backend="aot_eager")(q)
    _close(q, want)
    torch.testing.assert_close(total.double(), want.sum(), rtol=1e-5, atol=1e-5)


def test_freqs_strict_names_a_nan_position():
    f = _freqs_for(None, 4)
    pos = torch.tensor([0.0, 1.5, float("nan"), -3.0])
    q = torch.randn(4, 1, 8)
    with (
        ropekit.strict(),
        pytest.raises(ValueError, match=r"apply_rope: positions: expected finite values, got positions\[2\] = nan"),
    ):
        ropekit.apply_rope(q, None, pos, None, inv_freq=f)
    with ropekit.strict():  # negative and fractional positions are fine
        ropekit.apply_rope(q, None, pos.nan_to_num(), None, inv_freq=f)


def _bad(**over):
    T = 4
    args = dict(
        q=torch.randn(T, 2, 16),
        k=None,
        positions=torch.zeros(3, T, dtype=torch.long),
        cos_sin_cache=None,
        inv_freq=ropekit.axial_inv_freq((4, 6, 6)),
        axes=(2, 3, 3),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, error, message",
    [
        (dict(cos_sin_cache=torch.ones(8, 16)), ValueError, "cos_sin_cache: expected None with inv_freq"),
        (dict(mrope_section=(2, 3, 3)), ValueError, "mrope_section: expected None with inv_freq"),
        (dict(inv_freq=None, cos_sin_cache=torch.ones(8, 16)), ValueError, "inv_freq: expected a tensor when axes"),
        (dict(inv_freq=torch.ones(8, dtype=torch.float64)), ValueError, "inv_freq: expected dtype in \\(float32\\)"),
        (dict(inv_freq=[1.0]), TypeError, "inv_freq: expected a torch.Tensor"),
        (dict(axes=(2, 3, 4)), ValueError, r"axes: expected pairs summing to len\(inv_freq\) = 8, got \(2, 3, 4\)"),
        (dict(axes=(2, 2, 2, 1, 1)), ValueError, "axes: expected 1 to 4 non-negative ints"),
        (dict(axes=(2.0, 3, 3)), ValueError, "axes: expected 1 to 4 non-negative ints"),
        (dict(positions=torch.zeros(4, dtype=torch.long)), ValueError, "positions: expected a 2-D tensor"),
        (dict(positions=torch.zeros(2, 4, dtype=torch.long)), ValueError, r"positions: expected shape \(3, 4\)"),
        (dict(positions=torch.zeros(3, 4, dtype=torch.bool)), ValueError, "positions: expected dtype in"),
        (dict(positions=None), ValueError, r"positions: expected a tensor of shape \(3, 4\)"),
        (dict(rotary_dim=8), ValueError, r"rotary_dim: expected 2 \* len\(inv_freq\) = 16"),
        (dict(q=torch.randn(4, 2, 12)), ValueError, r"q: expected a head size >= rotary_dim \(16\)"),
        (
            dict(inplace=True, inv_freq=ropekit.axial_inv_freq((4, 6, 6)).requires_grad_()),
            ValueError,
            "inplace: expected False when inv_freq requires grad",
        ),
    ],
)
def test_freqs_bad_arguments(over, error, message):
    args = _bad(**over)
    q, q0 = args["q"], args["q"].clone()
    with pytest.raises(error, match=f"apply_rope: {message}"):
        ropekit.apply_rope(args.pop("q"), args.pop("k"), args.pop("positions"), args.pop("cos_sin_cache"), **args)
    assert torch.equal(q, q0)  # nothing written


# ---------------------------------------------------------------------------------------------
# QK-RMSNorm + axial RoPE (per head: Flux, HunyuanVideo, Qwen-Image; across heads: Wan)


def _norm_oracle(x, w, pos, f, axes, interleaved, eps=1e-6):
    y = x.double() if w is None else reference.rms_norm(x.double(), w.double(), eps=eps)
    c, s = reference.angles_from_freqs(pos, f, axes or (), torch.float64)
    return reference.rotate(y, c, s, interleaved=interleaved)


@pytest.mark.parametrize("norm", ["per_head", "across_heads", "q_only"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_freqs_with_qk_norm_forward_backward(norm, interleaved, poison):
    g = torch.Generator().manual_seed(20)
    axes, Hq, Hk, D = (2, 3, 3), 5, 3, 20  # head counts not powers of two; partial rotary (16 of 20)
    f = _freqs_for(axes, 8)
    pos = _positions(axes, (2, 3), g, floats=False)
    q64 = torch.randn(2, 3, Hq, D, dtype=torch.float64, generator=g)
    k64 = torch.randn(2, 3, Hk, D, dtype=torch.float64, generator=g)
    across = norm == "across_heads"
    wq64 = torch.randn(Hq * D if across else D, dtype=torch.float64, generator=g)
    wk64 = None if norm == "q_only" else torch.randn(Hk * D if across else D, dtype=torch.float64, generator=g)
    leaves = [q64.float().requires_grad_(), k64.float().requires_grad_(), wq64.float().requires_grad_()]
    if wk64 is not None:
        leaves.append(wk64.float().requires_grad_())
    q, k, wq = leaves[:3]
    wk = leaves[3] if wk64 is not None else None
    qo, ko = ropekit.apply_rope(
        q, k, pos, None, inv_freq=f, axes=axes, interleaved=interleaved, q_norm_weight=wq, k_norm_weight=wk
    )
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    grads = torch.autograd.grad((qo, ko), leaves, (gq, gk))
    r = [x.detach().double().requires_grad_() for x in leaves]
    rq = _norm_oracle(r[0], r[2], pos, f, axes, interleaved)
    rk = _norm_oracle(r[1], r[3] if wk is not None else None, pos, f, axes, interleaved)
    want = torch.autograd.grad((rq, rk), r, (gq.double(), gk.double()))
    _close(qo, rq.detach())
    _close(ko, rk.detach())
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=5e-5, atol=5e-5 * ref.abs().max().item())


def test_freqs_with_qk_norm_inplace_bf16(poison):
    g = torch.Generator().manual_seed(21)
    axes = (4, 2, 2)
    f = _freqs_for(axes, 8)
    pos = _positions(axes, (6,), g, floats=False)
    q = torch.randn(6, 3, 16, generator=g).bfloat16()
    w = torch.randn(16, generator=g)
    want = _norm_oracle(q, w, pos, f, axes, True)
    out, _ = ropekit.apply_rope(
        q, None, pos, None, inv_freq=f, axes=axes, interleaved=True, q_norm_weight=w, inplace=True
    )
    assert out is q
    _close(q, want, torch.bfloat16)


def test_freqs_with_qk_norm_learnable_freqs(poison):
    """Learnable frequencies with the norm: gradients of q, the weight and inv_freq against float64."""
    g = torch.Generator().manual_seed(23)
    axes = (1, 1, 2)
    f = _freqs_for(axes, 4).requires_grad_()
    pos = _positions(axes, (3,), g, floats=True)
    q = torch.randn(3, 2, 8, generator=g, requires_grad=True)
    w = (torch.rand(8, generator=g) + 0.5).requires_grad_()
    out, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f, axes=axes, interleaved=True, q_norm_weight=w)
    up = torch.randn(3, 2, 8, generator=g)
    (out * up).sum().backward()
    f64, q64, w64 = (x.detach().double().requires_grad_() for x in (f, q, w))
    angle = ropekit.core.freqs.pair_positions(pos.double(), axes, 4) * f64
    want = reference.rotate(reference.rms_norm(q64, w64), angle.cos(), angle.sin(), interleaved=True)
    (want * up.double()).sum().backward()
    for got, ref in ((out, want), (q.grad, q64.grad), (w.grad, w64.grad), (f.grad, f64.grad)):
        _close(got, ref.detach())


def test_rotate_with_angles_norm_weights(poison):
    """rotate_with_angles takes the norm weights too (the seam ropekit.diffusers uses)."""
    g = torch.Generator().manual_seed(22)
    fc = _polar((5, 8), g)
    q = torch.randn(5, 3, 16, generator=g)
    w = torch.randn(16, generator=g)
    out, _ = ropekit.rotate_with_angles(q, None, freqs_cis=fc, q_norm_weight=w)
    _close(out, _complex_rotate64(reference.rms_norm(q.double(), w.double()), fc))
    with pytest.raises(
        ValueError, match=r"rotate_with_angles: out_interleaved: expected None \(or interleaved\) with q_norm"
    ):
        ropekit.rotate_with_angles(q, None, freqs_cis=fc, q_norm_weight=w, out_interleaved=False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_freqs_angle_error_does_not_grow_with_position(device):
    """Angles computed in the kernel: error against float64 stays at float32 cos / sin rounding for
    positions up to 2^24 (exact in float32), where a float32 product p * f alone is off by up to
    |p * f| * 2^-24 radians (docs/vision.md has the table)."""
    f = ropekit.inv_freq(64, 10000.0)[0].to(device)
    half = f.shape[0]
    pos = torch.tensor([7, 1000, 99_991, 1_000_003, 4_000_037, 16_777_215], device=device)
    q = torch.zeros(pos.shape[0], 1, 2 * half, device=device)
    q[..., :half] = 1.0  # unit pairs (1, 0): the output is (cos, sin)
    out, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f)
    angle = pos.double()[:, None] * f.double()[None]
    want = torch.cat((angle.cos(), angle.sin()), -1)
    assert (out[:, 0].double() - want).abs().max().item() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_freqs_gpu_matches_float64(interleaved):
    """The compiled kernel (sin / cos as the GPU computes them), W14-like shape in miniature."""
    g = torch.Generator().manual_seed(30)
    axes = (22, 21, 21)
    f = ropekit.axial_inv_freq((44, 42, 42)).cuda()
    pos = _positions(axes, (2, 300), g, floats=False).cuda()
    q = torch.randn(2, 300, 40, 128, generator=g).cuda().bfloat16()
    qo, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f, axes=axes, interleaved=interleaved)
    _close(qo.cpu(), _oracle(q.cpu(), pos.cpu(), f.cpu(), axes, interleaved), torch.bfloat16)


def test_freqs_inverse_undoes_the_rotation(poison):
    g = torch.Generator().manual_seed(31)
    axes = (2, 3, 3)
    f = _freqs_for(axes, 8)
    pos = _positions(axes, (5,), g, floats=True)
    q = torch.randn(5, 2, 16, generator=g)
    qo, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f, axes=axes, interleaved=True)
    back, _ = ropekit.apply_rope(qo, None, pos, None, inv_freq=f, axes=axes, interleaved=True, inverse=True)
    torch.testing.assert_close(back, q, rtol=1e-5, atol=1e-5)
    # outputs of another dtype compose with angles from inv_freq (one rounding of the float32 result)
    low, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f, axes=axes, interleaved=True, out_dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), qo, rtol=2**-7, atol=1e-6)
