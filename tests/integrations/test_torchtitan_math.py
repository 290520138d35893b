"""The math of ropekit's torchtitan overrides (ropekit.integrations.torchtitan.caches) without torchtitan:
caches built as torchtitan builds them, q / k rotated as torchtitan's RoPE modules rotate them
(their formulas written here, in float64), forward and backward, on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch

from ropekit.integrations.torchtitan import caches

from conftest import TOL, rel_err

D, MAX_POS = 16, 40


def _freqs(dim=D, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv  # (MAX_POS, dim / 2)


def _cos_sin_cache(device):
    """CosSinRoPE's cache: rows [cos f, cos f, sin f, sin f]."""
    f = torch.cat((_freqs(), _freqs()), dim=-1)
    return torch.cat((f.cos(), f.sin()), dim=-1).float().to(device)


def _complex_cache(device):
    """ComplexRoPE's cache: e^(i f), complex64."""
    f = _freqs().float()
    return torch.polar(torch.ones_like(f), f).to(device)


def _rows(cache, positions, seq):
    """The cache rows of the tokens, (B or 1, S, 1, width), as torchtitan's _reshape_for_broadcast."""
    rows = cache[:seq] if positions is None else cache[positions]
    return rows.reshape(-1, seq, 1, cache.shape[-1])


def _cos_sin_ref(x, cache, positions):
    """CosSinRoPE.apply_rotary_emb in float64: x * cos + rotate_half(x) * sin."""
    return _rotate_half(x, _rows(cache, positions, x.shape[1]))


def _rotate_half(x, rows):
    cos, sin = rows[..., :D].double(), rows[..., D:].double()
    x = x.double()
    return x * cos + torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1) * sin


def _complex_ref(x, cache, positions):
    """ComplexRoPE.apply_rotary_emb in float64: adjacent pairs as complex numbers times e^(i f)."""
    rows = _rows(cache, positions, x.shape[1]).to(torch.complex128)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rows).flatten(3)


def _mrope_ref(x, cache, positions, h, w):
    """Qwen3.5 MRoPE._compute_mrope_cache in float64: t rows, then h / w at interleaved frequencies."""
    cos, sin = cache[:, :D].double(), cache[:, D:].double()
    mcos, msin = cos[positions[..., 0]], sin[positions[..., 0]]
    for axis, (offset, sec) in enumerate(((1, h), (2, w)), start=1):
        low = torch.arange(offset, sec * 3, 3, device=cache.device)
        cols = torch.cat([low, low + D // 2])
        mcos[..., cols] = cos[:, cols][positions[..., axis]]
        msin[..., cols] = sin[:, cols][positions[..., axis]]
    return _rotate_half(x, torch.cat([mcos, msin], dim=-1).unsqueeze(2))


def _check(out, ref_fn, q, k):
    """Outputs against the float64 formula, and gradients against autograd through that formula."""
    (q_out, k_out) = out
    q_ref, k_ref = ref_fn(q), ref_fn(k)
    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype
    assert rel_err(q_out, q_ref) < TOL[torch.float32] and rel_err(k_out, k_ref) < TOL[torch.float32]
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    grads = torch.autograd.grad((q_out * gq).sum() + (k_out * gk).sum(), (q, k))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    want = torch.autograd.grad((ref_fn(q64) * gq.double()).sum() + (ref_fn(k64) * gk.double()).sum(), (q64, k64))
    for got, ref in zip(grads, want):
        assert rel_err(got, ref) < TOL[torch.float32]


def _qk(device, batch=2, seq=5):
    q = torch.randn(batch, seq, 3, D, device=device, requires_grad=True)
    k = torch.randn(batch, seq, 2, D, device=device, requires_grad=True)
    return q, k


def _positions(kind, device, batch=2, seq=5):
    """None (torchtitan reads the first rows), per-sequence (B, S), or one (1, S) row for the batch."""
    if kind == "none":
        return None
    return torch.randint(0, MAX_POS, (batch if kind == "batch" else 1, seq), device=device)


@pytest.mark.parametrize("kind", ["none", "batch", "shared"])
def test_cos_sin_rotation_is_torchtitans(device, kind):
    torch.manual_seed(0)
    cache, (q, k), pos = _cos_sin_cache(device), _qk(device), _positions(kind, device)
    out = caches.rotate(q, k, pos, caches.cos_sin_table(cache), interleaved=False)
    _check(out, lambda x: _cos_sin_ref(x, cache, pos), q, k)


@pytest.mark.parametrize("kind", ["none", "batch", "shared"])
def test_complex_rotation_is_torchtitans(device, kind):
    torch.manual_seed(1)
    cache, (q, k), pos = _complex_cache(device), _qk(device), _positions(kind, device)
    out = caches.rotate(q, k, pos, caches.complex_table(cache), interleaved=True)
    _check(out, lambda x: _complex_ref(x, cache, pos), q, k)


@pytest.mark.parametrize("h, w", [(3, 2), (2, 1)])
def test_mrope_rotation_is_qwen3_5s(device, h, w):
    torch.manual_seed(2)
    cache, (q, k) = _cos_sin_cache(device), _qk(device)
    pos = torch.randint(0, MAX_POS, (2, 5, 3), device=device)
    out = caches.rotate(q, k, pos, caches.cos_sin_table(cache), interleaved=False, mrope_hw=(h, w))
    _check(out, lambda x: _mrope_ref(x, cache, pos, h, w), q, k)


def test_table_is_kept_and_follows_the_cache():
    cache = _cos_sin_cache("cpu")
    table = caches.Table(caches.cos_sin_table)
    first = table(cache)
    assert table(cache) is first, "one conversion per cache tensor"
    cache.mul_(0.5)  # an in-place write moves the version
    assert torch.equal(table(cache), caches.cos_sin_table(cache))
    other = _cos_sin_cache("cpu")
    assert table(other) is not first and torch.equal(table(other), first)


def test_out_of_range_position_is_refused_as_torchtitan_refuses_it():
    q, k = _qk("cpu")
    with pytest.raises(RuntimeError, match="position_ids exceed"):
        caches.rotate(q, k, torch.full((2, 5), MAX_POS), caches.cos_sin_table(_cos_sin_cache("cpu")), interleaved=False)
