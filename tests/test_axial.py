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
