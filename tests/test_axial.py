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
