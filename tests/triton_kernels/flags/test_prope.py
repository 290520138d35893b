"""Gemma 4's p-RoPE ("proportional" rope type) as a pair layout of the kernel family:
rotary_position='halves' rotates the pairs (i, i + D/2), i < R/2, of the whole head with a table of
width R, and keeps the other dims, in every op path (forward out of place and in place, the
backward, the fused norm and its backward, fp8 outputs, destinations, the fused store,
re-rotation, the CPU path, inverse frequencies).

The reference here is written from Hugging Face's semantics, independently of ropekit's oracle:
inverse frequencies over the whole head with zeros past the rotated count, cos / sin tables [f, f]
and `x * cos + rotate_half(x) * sin` over the whole head, in float64. The last tests compare
RotaryEmbedding.from_hf_config on a tiny Gemma 4 text config with transformers' own rotary
embedding and apply_rotary_pos_emb.

On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1 without CUDA);
tests taking the `device` fixture also run compiled on CUDA (marked gpu).
"""

from __future__ import annotations

import pytest
import torch

# Triton loaded while conftest's TRITON_INTERPRET=1 is set (the CPU-path test removes it)
import triton.language  # noqa: F401

import ropekit
from ropekit.core import memo, tuning
from ropekit.integrations.hf_config import hf_rope_args
from ropekit.tools import reference

from conftest import TOL, fp8_close, rel_err

BASE = 10000.0
NAN = float("nan")
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# elementwise |got - want| <= tol * (1 + |want|): one rounding to the dtype plus float32 math
# (bf16: the interpreter truncates instead of rounding)
ELEM_TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


# ---------------------------------------------------------------------------------------------
# Hugging Face's semantics in float64, and the narrow table


def hf_inv_freq(D: int, R: int) -> torch.Tensor:
    """transformers' _compute_proportional_rope_parameters in float64: base ** (-2i / D) for i < R/2,
    0 for the rest of the D/2 pairs."""
    inv = torch.zeros(D // 2, dtype=torch.float64)
    inv[: R // 2] = 1.0 / BASE ** (torch.arange(0, R, 2, dtype=torch.float64) / D)
    return inv


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def hf_rope(x: torch.Tensor, positions: torch.Tensor, R: int, *, inverse=False) -> torch.Tensor:
    """x (*T, H, D) rotated as HF's Gemma 4 attention does, in float64 (differentiable)."""
    D = x.shape[-1]
    f = positions.double()[..., None] * hf_inv_freq(D, R).to(x.device)
    emb = torch.cat((f, f), -1).unsqueeze(-2)
    sin = -emb.sin() if inverse else emb.sin()
    return x.double() * emb.cos() + rotate_half(x.double()) * sin


def hf_norm(x, w, offset=0.0, eps=1e-6):
    """RMSNorm over the head (w (D,)) or all heads of a token (w (H*D,)), float64."""
    x = x.double()
    w = w.double() + offset
    if w.shape[-1] == x.shape[-1]:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w
    flat = x.flatten(-2)
    return (flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps) * w).view(x.shape)


def table(D, R, max_pos=64, dtype=torch.float32, device="cpu"):
    """The narrow [cos | sin] table (max_pos, R) ropekit builds for p-RoPE."""
    scaling = {"rope_type": "proportional", "partial_rotary_factor": R / D}
    return ropekit.cos_sin_cache(D, max_pos, BASE, scaling, dtype=dtype, device=device, rotated_only=True)


def kept(x: torch.Tensor, R: int) -> torch.Tensor:
    """The dims rotary_position='halves' keeps, side by side: [R/2, D/2) and [D/2 + R/2, D)."""
    half, gap = R // 2, x.shape[-1] // 2
    return torch.cat((x[..., half:gap], x[..., gap + half :]), -1)


def bits(x):
    return x.contiguous().view(INT_OF_SIZE[x.element_size()])


def rnd(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def close(got, want, dtype):
    """Elementwise within one rounding to dtype (float32 math), no NaN."""
    got, want = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got).any(), "NaN in the output"
    tol = ELEM_TOL[dtype]
    bad = (got - want).abs() > tol * (1 + want.abs())
    assert not bad.any(), f"{int(bad.sum())} elements off, e.g. {got[bad][:4]} vs {want[bad][:4]}"


# ---------------------------------------------------------------------------------------------
# the table


def test_narrow_table_is_the_rotated_columns_of_hf_table():
    D, R = 32, 8
    full = ropekit.cos_sin_cache(D, 16, BASE, {"rope_type": "proportional", "partial_rotary_factor": 0.25})
    narrow = table(D, R, 16)
    assert full.shape == (16, D) and narrow.shape == (16, R)
    assert torch.equal(narrow[:, : R // 2], full[:, : R // 2])  # cos of the rotated pairs
    assert torch.equal(narrow[:, R // 2 :], full[:, D // 2 : D // 2 + R // 2])  # their sin
    f = torch.arange(16, dtype=torch.float64)[:, None] * hf_inv_freq(D, R)[: R // 2]
    torch.testing.assert_close(narrow.double(), torch.cat((f.cos(), f.sin()), -1), rtol=0, atol=1e-7)
    # every other rope type turns all its pairs: the same table with or without rotated_only
    for scaling in (None, {"rope_type": "linear", "factor": 2.0}):
        plain = ropekit.cos_sin_cache(R, 16, BASE, scaling)
        assert torch.equal(ropekit.cos_sin_cache(R, 16, BASE, scaling, rotated_only=True), plain)
    meta = ropekit.cos_sin_cache(
        D, 16, BASE, {"rope_type": "proportional", "partial_rotary_factor": 0.25}, device="meta", rotated_only=True
    )
    assert meta.shape == (16, R)
    with pytest.raises(TypeError, match=r"cos_sin_cache: rotated_only: expected a bool, got int"):
        ropekit.cos_sin_cache(D, 16, rotated_only=1)


# ---------------------------------------------------------------------------------------------
# apply_rope: forward, in place, layouts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["out", "inplace"])
@pytest.mark.parametrize("shape", ["T", "BS"])
def test_forward_matches_hf(device, poison, dtype, where, shape):
    D, R, Hq, Hk = 32, 8, 3, 2
    lead = (7,) if shape == "T" else (2, 5)
    q = rnd(*lead, Hq, D, dtype=dtype, device=device, seed=1)
    k = rnd(*lead, Hk, D, dtype=dtype, device=device, seed=2)
    pos = torch.randint(0, 64, lead, generator=torch.Generator().manual_seed(3)).to(device)
    want_q, want_k = hf_rope(q.cpu(), pos.cpu(), R), hf_rope(k.cpu(), pos.cpu(), R)
    q0, k0 = q.clone(), k.clone()
    tab = table(D, R, device=device)
    if where == "inplace":
        out = ropekit.apply_rope(q, k, pos, tab, rotary_position="halves", inplace=True)
        assert out[0] is q and out[1] is k
        got_q, got_k = q, k
    else:
        got_q, got_k = ropekit.apply_rope(q, k, pos, tab, rotary_position="halves")
        assert torch.equal(bits(q), bits(q0)) and torch.equal(bits(k), bits(k0)), "inputs written"
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)
    # the kept dims: bit for bit (copied out of place, never rewritten in place)
    assert torch.equal(bits(kept(got_q, R)), bits(kept(q0, R)))
    assert torch.equal(bits(kept(got_k, R)), bits(kept(k0, R)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_in_place_leaves_kept_dims_untouched(device, dtype):
    """Sentinels (NaN bit patterns a float32 round trip may change) in the kept dims stay bit for bit."""
    D, R = 32, 8
    q = rnd(5, 2, D, dtype=dtype, device=device, seed=4)
    k = rnd(5, 1, D, dtype=dtype, device=device, seed=5)
    ints = INT_OF_SIZE[q.element_size()]
    pattern = {2: 0x7D5A, 4: 0x7FA5A5A5}[q.element_size()]  # a signaling NaN with a payload
    for x in (q, k):
        for part in (x[..., R // 2 : D // 2], x[..., D // 2 + R // 2 :]):
            part.view(ints).fill_(pattern)
    pos = torch.arange(5, device=device)
    ropekit.apply_rope(q, k, pos, table(D, R, device=device), rotary_position="halves", inplace=True)
    for x in (q, k):
        assert (kept(x, R).view(ints) == pattern).all(), "a kept dim was rewritten in place"
        assert not x[..., : R // 2].isnan().any() and not x[..., D // 2 : D // 2 + R // 2].isnan().any()


def test_layouts_and_k_none(device, poison):
    """HF's (B, H, S, D) views, Transformer Engine's (S, B, H, D), k None, a destination."""
    D, R = 16, 4
    tab = table(D, R, device=device)
    x = rnd(2, 3, 5, D, device=device, seed=6)  # (B, H, S, D)
    pos = torch.arange(5, device=device)[None]
    got, none = ropekit.apply_rope(x, None, pos, tab, layout="bhsd", rotary_position="halves")
    assert none is None
    close(got, hf_rope(x.cpu().transpose(1, 2), torch.arange(5)[None], R).transpose(1, 2), torch.float32)
    y = rnd(5, 2, 3, D, device=device, seed=7)  # (S, B, H, D)
    got, _ = ropekit.apply_rope(y, None, None, tab, layout="sbhd", rotary_position="halves")
    close(got, hf_rope(y.cpu(), torch.arange(5)[:, None].expand(5, 2), R), torch.float32)
    q = rnd(4, 3, D, device=device, seed=8)
    k = rnd(4, 1, D, device=device, seed=9)
    pos = torch.tensor([0, 3, 9, 2], device=device)
    q_out = torch.full((4, 3, 2 * D), NAN, device=device)[..., D // 2 : D // 2 + D]  # strided destination
    got_q, got_k = ropekit.apply_rope(q, k, pos, tab, rotary_position="halves", q_out=q_out)
    assert got_q is q_out
    close(q_out, hf_rope(q.cpu(), pos.cpu(), R), torch.float32)
    close(got_k, hf_rope(k.cpu(), pos.cpu(), R), torch.float32)


def test_full_width_is_the_usual_variant(device):
    """rotary_dim == D: every pair turns; 'halves' and 'first' are one rotation and one variant."""
    D = 16
    q = rnd(3, 2, D, device=device, seed=10)
    tab = ropekit.cos_sin_cache(D, 8, BASE)
    tab = tab.to(device)
    pos = torch.tensor([1, 4, 7], device=device)
    a, _ = ropekit.apply_rope(q, None, pos, tab, rotary_position="halves")
    b, _ = ropekit.apply_rope(q, None, pos, tab)
    assert torch.equal(a, b)


def test_mrope_sections_with_halves(device, poison):
    D, R = 32, 16
    q = rnd(6, 2, D, device=device, seed=11)
    pos = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(12)).to(device)
    tab = table(D, R, device=device)
    got, _ = ropekit.apply_rope(q, None, pos, tab, mrope_section=(2, 3, 3), rotary_position="halves")
    want, _ = reference.apply_rope(
        q.cpu().double(), None, pos.cpu(), tab.cpu().double(), mrope_section=(2, 3, 3), rotary_position="halves"
    )
    close(got, want, torch.float32)


# ---------------------------------------------------------------------------------------------
# backward, fp8 outputs, inverse frequencies


@pytest.mark.parametrize("inplace", [False, True])
def test_backward_matches_hf_autograd(device, poison, inplace):
    D, R = 32, 8
    q0 = rnd(2, 5, 3, D, device=device, seed=13)
    k0 = rnd(2, 5, 2, D, device=device, seed=14)
    pos = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(15)).to(device)
    gq, gk = rnd(2, 5, 3, D, device=device, seed=16), rnd(2, 5, 2, D, device=device, seed=17)
    q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    tab = table(D, R, device=device)
    if inplace:  # in place under autograd: non-leaf inputs, marked dirty
        qi, ki = q * 1, k * 1
        ropekit.apply_rope(qi, ki, pos, tab, rotary_position="halves", inplace=True)
        out_q, out_k = qi, ki
    else:
        out_q, out_k = ropekit.apply_rope(q, k, pos, tab, rotary_position="halves")
    ((out_q * gq).sum() + (out_k * gk).sum()).backward()
    q64, k64 = q0.cpu().double().requires_grad_(), k0.cpu().double().requires_grad_()
    (
        (hf_rope(q64, pos.cpu(), R) * gq.cpu().double()).sum() + (hf_rope(k64, pos.cpu(), R) * gk.cpu().double()).sum()
    ).backward()
    assert rel_err(q.grad, q64.grad) < TOL[torch.float32]
    assert rel_err(k.grad, k64.grad) < TOL[torch.float32]
    # the kept dims pass their gradient through unchanged
    assert torch.equal(kept(q.grad, R), kept(gq, R))


def test_inverse_undoes_and_matches(device, poison):
    D, R = 16, 4
    q = rnd(5, 2, D, device=device, seed=18)
    pos = torch.arange(5, device=device) * 3
    tab = table(D, R, device=device)
    inv, _ = ropekit.apply_rope(q, None, pos, tab, rotary_position="halves", inverse=True)
    close(inv, hf_rope(q.cpu(), pos.cpu(), R, inverse=True), torch.float32)
    back, _ = ropekit.apply_rope(inv, None, pos, tab, rotary_position="halves")
    close(back, q.cpu().double(), torch.float32)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_outputs_scale_every_dim(device, fp8):
    D, R = 32, 8
    q = rnd(6, 2, D, device=device, seed=19) * 4
    k = rnd(6, 1, D, device=device, seed=20) * 4
    pos = torch.arange(6, device=device) + 10
    q8, k8 = ropekit.apply_rope(
        q, k, pos, table(D, R, device=device), rotary_position="halves", out_dtype=fp8, q_scale=0.5, k_scale=2.0
    )
    big = torch.finfo(fp8).max
    fp8_close(q8.cpu(), (hf_rope(q.cpu(), pos.cpu(), R) / 0.5).clamp(-big, big).to(fp8).double(), fp8)
    fp8_close(k8.cpu(), (hf_rope(k.cpu(), pos.cpu(), R) / 2.0).clamp(-big, big).to(fp8).double(), fp8)


def test_inverse_frequencies_and_their_gradient(device, poison):
    """Angles from positions x inverse frequencies (no table), the frequencies learnable: the
    gradient of inv_freq reads the pairs (i, i + D/2) of the outputs."""
    D, R = 32, 8
    inv = hf_inv_freq(D, R)[: R // 2].float().to(device)
    q0 = rnd(6, 2, D, device=device, seed=21)
    pos = torch.arange(6, device=device).float() * 2.5
    g = rnd(6, 2, D, device=device, seed=22)
    f = inv.clone().requires_grad_()
    q = q0.clone().requires_grad_()
    out, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f, rotary_position="halves")
    (out * g).sum().backward()
    f64 = inv.cpu().double().requires_grad_()
    q64 = q0.cpu().double().requires_grad_()
    full = torch.cat((f64, torch.zeros(D // 2 - R // 2, dtype=torch.float64)))
    ang = pos.cpu().double()[:, None] * full
    emb = torch.cat((ang, ang), -1).unsqueeze(-2)
    want = q64 * emb.cos() + rotate_half(q64) * emb.sin()
    (want * g.cpu().double()).sum().backward()
    close(out.detach(), want.detach(), torch.float32)
    assert rel_err(q.grad, q64.grad) < TOL[torch.float32]
    assert rel_err(f.grad, f64.grad) < 1e-5


# ---------------------------------------------------------------------------------------------
# the fused QK-RMSNorm: per head and across heads, forward and backward


# the normed programs' layouts: the launcher's own choice; one program per token walking head blocks
# of 2 heads (the across-heads pre-pass and prefetch) with whole heads off; whole heads (a tensor's
# heads of a token in up to three tiles, the group summed in registers; the backward too) with the
# head loop and with a program per tensor; one program per head block (whole heads by the rule)
NORM_KNOBS = {
    "planned": {},
    "head_loop": dict(
        whole_heads=False, head_loop=True, block_elems=2 * 8, across_block_elems=2 * 8, decode_block_elems=2 * 8
    ),
    "whole_loop": dict(whole_heads=True, head_loop=True),
    "whole_per_tensor": dict(whole_heads=True, head_loop=False),
    "block_programs": dict(head_loop=False),
}


@pytest.mark.parametrize("mode", ["head", "across"])
@pytest.mark.parametrize("knobs", sorted(NORM_KNOBS))
@pytest.mark.parametrize("Hq, Hk", [(4, 2), (7, 3)], ids=str)  # 7 = 4 + 2 + 1 tiles, k's partly masked
def test_norm_forward_and_backward(device, poison, mode, knobs, Hq, Hk):
    """Both norms through every program layout, whole heads on and off: the kept dims (both runs,
    [R/2, D/2) and [D/2 + R/2, D)) normalized with the rotated ones; gradients of q, k and weights."""
    D, R = 32, 8
    over = NORM_KNOBS[knobs]
    q0 = rnd(5, Hq, D, device=device, seed=23)
    k0 = rnd(5, Hk, D, device=device, seed=24)
    n_q, n_k = (D, D) if mode == "head" else (Hq * D, Hk * D)
    wq0 = (1 + 0.3 * rnd(n_q, seed=25)).to(device)
    wk0 = (1 + 0.3 * rnd(n_k, seed=26)).to(device)
    pos = torch.tensor([0, 5, 17, 3, 40], device=device)
    gq, gk = rnd(5, Hq, D, device=device, seed=27), rnd(5, Hk, D, device=device, seed=28)
    q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    wq, wk = wq0.clone().requires_grad_(), wk0.clone().requires_grad_()
    tab = table(D, R, device=device)
    with tuning.override(**over):
        out_q, out_k = ropekit.apply_rope(
            q, k, pos, tab, q_norm_weight=wq, k_norm_weight=wk, norm_weight_offset=1.0, rotary_position="halves"
        )
        ((out_q * gq).sum() + (out_k * gk).sum()).backward()
    leaves = [x.detach().cpu().double().requires_grad_() for x in (q0, k0, wq0, wk0)]
    yq = hf_rope(hf_norm(leaves[0], leaves[2], 1.0), pos.cpu(), R)
    yk = hf_rope(hf_norm(leaves[1], leaves[3], 1.0), pos.cpu(), R)
    ((yq * gq.cpu().double()).sum() + (yk * gk.cpu().double()).sum()).backward()
    close(out_q.detach(), yq.detach(), torch.float32)
    close(out_k.detach(), yk.detach(), torch.float32)
    for got, want in zip((q, k, wq, wk), leaves):
        assert rel_err(got.grad, want.grad) < 1e-5


@pytest.mark.parametrize("mode", ["head", "across"])
@pytest.mark.parametrize("whole", [False, True])
def test_norm_in_place_normalizes_the_kept_dims(device, mode, whole):
    D, R, H = 32, 8, 3
    q = rnd(4, H, D, device=device, seed=29)
    w = (1 + 0.3 * rnd(D * (H if mode == "across" else 1), seed=30)).to(device)
    want = hf_rope(hf_norm(q.cpu(), w.cpu()), torch.arange(4), R)
    with tuning.override(whole_heads=whole, head_loop=True, block_elems=2 * 8, across_block_elems=2 * 8):
        ropekit.apply_rope(
            q, None, None, table(D, R, device=device), q_norm_weight=w, inplace=True, rotary_position="halves"
        )
    close(q, want, torch.float32)


# ---------------------------------------------------------------------------------------------
# the fused store


def _store_inputs(device, D=32, Hq=3, Hk=2, T=6, dtype=torch.float32, seed=31):
    q = rnd(T, Hq, D, dtype=dtype, device=device, seed=seed)
    k = rnd(T, Hk, D, dtype=dtype, device=device, seed=seed + 1)
    v = rnd(T, Hk, D, dtype=dtype, device=device, seed=seed + 2)
    base = torch.full((3, 2, 4, Hk, D), NAN, dtype=dtype, device=device)  # k and v halves of one buffer
    slots = torch.tensor([0, 7, -1, 3, 11, 5], device=device)[:T]
    pos = torch.tensor([0, 9, 4, 33, 2, 60], device=device)[:T]
    return q, k, v, base, slots, pos


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_loop", [False, True])
def test_store_rows(device, dtype, head_loop):
    D, R = 32, 8
    q, k, v, base, slots, pos = _store_inputs(device, dtype=dtype)
    q0, k0 = q.clone(), k.clone()
    k_cache, v_cache = base[:, 0], base[:, 1]
    with tuning.override(store_head_loop=head_loop):
        ropekit.apply_rope_and_store(
            q, k, v, pos, table(D, R, device=device), k_cache, v_cache, slots, rotary_position="halves"
        )
    close(q, hf_rope(q0.cpu(), pos.cpu(), R), dtype)
    assert torch.equal(bits(kept(q, R)), bits(kept(q0, R))), "q's kept dims rewritten in place"
    assert torch.equal(bits(k), bits(k0)), "k written without write_key"
    rk = hf_rope(k0.cpu(), pos.cpu(), R)
    flat_k, flat_v = k_cache.flatten(0, 1).cpu(), v_cache.flatten(0, 1).cpu()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        close(flat_k[s], rk[t], dtype)
        assert torch.equal(bits(kept(flat_k[s], R)), bits(kept(k0[t].cpu(), R))), "kept dims of k's row"
        assert torch.equal(bits(flat_v[s]), bits(v[t].cpu()))
    named = [s for s in slots.tolist() if s >= 0]
    others = [i for i in range(flat_k.shape[0]) if i not in named]
    assert flat_k[others].isnan().all() and flat_v[others].isnan().all(), "rows no slot names"


def test_store_forms_norm_q_out_write_key(device):
    D, R = 32, 8
    q, k, v, base, slots, pos = _store_inputs(device)
    q0, k0 = q.clone(), k.clone()
    k_cache, v_cache = base[:, 0], base[:, 1]
    wq = (1 + 0.3 * rnd(D, seed=40)).to(device)
    wk = (1 + 0.3 * rnd(2 * D, seed=41)).to(device)  # across k's two heads
    q_out = torch.full(q.shape, NAN, dtype=torch.float8_e4m3fn, device=device)
    ropekit.apply_rope_and_store(
        q,
        k,
        v,
        pos,
        table(D, R, device=device),
        k_cache,
        v_cache,
        slots,
        q_norm_weight=wq,
        k_norm_weight=wk,
        q_out=q_out,
        q_scale=0.5,
        write_key=True,
        rotary_position="halves",
    )
    assert torch.equal(q, q0), "q read only with q_out"
    want_q = hf_rope(hf_norm(q0.cpu(), wq.cpu()), pos.cpu(), R)
    fp8_close(q_out.cpu(), (want_q / 0.5).to(torch.float8_e4m3fn).double(), torch.float8_e4m3fn)
    want_k = hf_rope(hf_norm(k0.cpu(), wk.cpu()), pos.cpu(), R)
    close(k, want_k, torch.float32)  # written back, kept dims normalized
    flat_k = k_cache.flatten(0, 1).cpu()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            close(flat_k[s], want_k[t], torch.float32)


# ---------------------------------------------------------------------------------------------
# re-rotation


@pytest.mark.parametrize("dst", [False, True])
def test_rerotate_composes(device, dst):
    """A key rotated for p and re-rotated by delta is the key rotated for p + delta; the kept dims
    stay (in place) or move with the row (dst_slots)."""
    D, R, H = 32, 8, 2
    keys = rnd(6, H, D, device=device, seed=50)
    p = torch.tensor([3, 10, 0, 20, 7, 15])
    delta = torch.tensor([5, -3, 0, 11, -7, 2])
    k_cache = torch.full((4, 4, H, D), NAN, device=device)
    slots = torch.tensor([1, 4, 6, 9, 12, 14])
    flat = k_cache.view(16, H, D)
    flat[slots] = hf_rope(keys.cpu(), p, R).float().to(device)
    before = k_cache.clone()
    dst_slots = torch.tensor([0, 2, 3, 5, 7, 8]) if dst else None
    ropekit.rerotate_kv_cache(
        k_cache,
        slots.to(device),
        delta.to(device),
        table(D, R, device=device),
        dst_slots=None if dst_slots is None else dst_slots.to(device),
        rotary_position="halves",
    )
    rows = dst_slots if dst else slots
    got = k_cache.view(16, H, D)[rows.to(device)].cpu()
    close(got, hf_rope(keys.cpu(), p + delta, R), torch.float32)
    src_rows = before.view(16, H, D)[slots.to(device)].cpu()
    assert torch.equal(bits(kept(got, R)), bits(kept(src_rows, R)))
    untouched = [i for i in range(16) if i not in rows.tolist()]
    if dst:
        assert torch.equal(bits(k_cache.view(16, H, D)[slots]), bits(before.view(16, H, D)[slots])), "sources"
    assert torch.equal(bits(k_cache.view(16, H, D)[untouched]), bits(before.view(16, H, D)[untouched]))


def test_rerotate_matches_oracle_fp8(device):
    D, R, H = 32, 8, 2
    values = rnd(8, H, D, device=device, seed=51)
    k_cache = (values / 0.25).to(torch.float8_e4m3fn).view(2, 4, H, D)
    want = k_cache.cpu().clone()
    slots, delta = torch.tensor([0, 3, 5, 6]), torch.tensor([4, -2, 9, 1])
    tab = table(D, R)
    reference.rerotate_kv_cache(want, slots, delta, tab, k_scale=0.25, rotary_position="halves")
    ropekit.rerotate_kv_cache(
        k_cache, slots.to(device), delta.to(device), tab.to(device), k_scale=0.25, rotary_position="halves"
    )
    fp8_close(k_cache.cpu().view(8, H, D)[slots], want.view(8, H, D)[slots].double(), torch.float8_e4m3fn)
    assert torch.equal(bits(kept(k_cache.cpu(), R)), bits(kept(want, R)))


# ---------------------------------------------------------------------------------------------
# the CPU path against the interpreted kernels


@pytest.fixture
def interpreted_and_cpu(monkeypatch):
    """run(fn): fn() with the Triton kernels interpreted, then on ropekit.core.cpu's path."""

    def run(fn):
        results = []
        for interpret in ("1", None):
            if interpret is None:
                monkeypatch.delenv("TRITON_INTERPRET", raising=False)
            else:
                monkeypatch.setenv("TRITON_INTERPRET", interpret)
            memo.clear()
            results.append(fn())
        memo.clear()
        return results

    yield run
    memo.clear()


def _same(a, b, R=None):
    for x, y in zip(a, b):
        if x is None:
            assert y is None
            continue
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
        if R is not None:
            assert torch.equal(bits(kept(x, R)), bits(kept(y, R)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no CUDA")
def test_cpu_path_equals_interpreter(interpreted_and_cpu, poison):
    D, R = 32, 8
    tab = table(D, R)
    pos = torch.tensor([0, 5, 17, 3, 40])
    w = 1 + 0.3 * rnd(D, seed=60)
    wa = 1 + 0.3 * rnd(2 * D, seed=61)

    def rotations():
        q, k = rnd(5, 3, D, seed=62), rnd(5, 2, D, dtype=torch.bfloat16, seed=63).float()
        out = ropekit.apply_rope(q, k, pos, tab, rotary_position="halves")
        q8 = ropekit.apply_rope(q, k, pos, tab, rotary_position="halves", out_dtype=torch.float8_e4m3fn, q_scale=0.5)
        qi, ki = q.clone(), k.clone()
        ropekit.apply_rope(qi, ki, pos, tab, rotary_position="halves", inplace=True)
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        wg, wag = w.clone().requires_grad_(), wa.clone().requires_grad_()
        nq, nk = ropekit.apply_rope(qg, kg, pos, tab, q_norm_weight=wg, k_norm_weight=wag, rotary_position="halves")
        (nq.square().sum() + (nk * 3).sum()).backward()
        return (*out, qi, ki, nq.detach(), nk.detach(), qg.grad, kg.grad, wg.grad, wag.grad), tuple(q8)

    (plain_i, fp8_i), (plain_c, fp8_c) = interpreted_and_cpu(rotations)
    _same(plain_i[:4], plain_c[:4], R)
    for x, y in zip(plain_i[4:], plain_c[4:]):  # the norm and gradients: sums in another order
        assert rel_err(x, y) < 1e-6
    for x, y in zip(fp8_i, fp8_c):  # the interpreter's fp8 cast truncates: within an ulp
        fp8_close(x, y.double(), torch.float8_e4m3fn)

    def store_and_rerotate():
        q, k, v, base, slots, p = _store_inputs("cpu")
        k_cache, v_cache = base[:, 0], base[:, 1]
        ropekit.apply_rope_and_store(q, k, v, p, tab, k_cache, v_cache, slots, rotary_position="halves", write_key=True)
        shifted = k_cache.clone()
        ropekit.rerotate_kv_cache(shifted, slots[slots >= 0], 3, tab, rotary_position="halves")
        moved = k_cache.clone()
        ropekit.rerotate_kv_cache(
            moved,
            torch.tensor([0, 3]),
            torch.tensor([-4, 2]),
            tab,
            dst_slots=torch.tensor([1, 2]),
            rotary_position="halves",
        )
        return q, k, k_cache.nan_to_num(7.0), v_cache.nan_to_num(7.0), shifted.nan_to_num(7.0), moved.nan_to_num(7.0)

    interp, cpu = interpreted_and_cpu(store_and_rerotate)
    _same(interp, cpu, R)


# ---------------------------------------------------------------------------------------------
# refusals (the rows of docs/bad_inputs.md are in test_bad_inputs.py)


def test_refusals_of_the_other_ops():
    D, R = 32, 8
    tab = table(D, R)
    cache = torch.zeros(4, 2, D)
    with pytest.raises(ValueError, match=r"rerotate_kv_cache: interleaved: expected False with rotary_position="):
        ropekit.rerotate_kv_cache(cache, torch.tensor([0]), 1, tab, interleaved=True, rotary_position="halves")
    with pytest.raises(ValueError, match=r"rerotate_kv_cache: k_cache: expected an even head size"):
        ropekit.rerotate_kv_cache(torch.zeros(4, 2, 33), torch.tensor([0]), 1, tab, rotary_position="halves")
    with pytest.raises(
        ValueError, match=r"rerotate_kv_cache: rotary_position: expected 'first' or 'halves', got 'last'"
    ):
        ropekit.rerotate_kv_cache(cache, torch.tensor([0]), 1, tab, rotary_position="last")
    with pytest.raises(ValueError, match=r"RotaryEmbedding: is_neox_style: expected True with rotary_position="):
        ropekit.RotaryEmbedding(D, R, 16, BASE, False, rotary_position="halves")
    with pytest.raises(ValueError, match=r"RotaryEmbedding: rotary_dim: expected 2 \* int\(partial_rotary_factor"):
        ropekit.RotaryEmbedding(
            D,
            D,
            16,
            rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
            rotary_position="halves",
        )


# ---------------------------------------------------------------------------------------------
# RotaryEmbedding.from_hf_config against transformers' Gemma 4


def _gemma4_config():
    gemma4 = pytest.importorskip("transformers.models.gemma4.configuration_gemma4")
    return gemma4.Gemma4TextConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
    )


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_from_hf_config_matches_transformers_gemma4(device, layer_type):
    mg = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    config = _gemma4_config()
    D = config.per_layer_config[layer_type].head_dim
    rope = ropekit.RotaryEmbedding.from_hf_config(config, layer_type=layer_type, inplace=False, device=device)
    assert rope.head_size == D
    if layer_type == "full_attention":  # p-RoPE: a quarter of the pairs, the narrow table
        assert (rope.rotary_dim, rope.rotary_position) == (D // 4, "halves")
        assert rope.cos_sin_cache.shape == (256, D // 4)
    T, H = 6, 2
    positions = torch.tensor([0, 1, 2, 30, 100, 200])
    q, k = rnd(T, H, D, seed=70), rnd(T, 1, D, seed=71)
    hf_rotary = mg.Gemma4TextRotaryEmbedding(config)
    cos, sin = hf_rotary(q, positions[None], layer_type)
    want_q = mg.apply_rotary_pos_emb(q.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    want_k = mg.apply_rotary_pos_emb(k.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    got_q, got_k = rope(positions.to(device), q.flatten(1).to(device), k.flatten(1).to(device))
    # HF's float32 angles: off by ~|p * f| * 2^-24 at position p
    torch.testing.assert_close(got_q.view(T, H, D).cpu(), want_q, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_k.view(T, 1, D).cpu(), want_k, rtol=2e-5, atol=2e-5)
    # the module's store and re-rotation take the same layout
    if layer_type == "full_attention":
        cache = torch.full((8, 1, D), NAN, device=device)
        query = q.flatten(1).to(device).clone()
        rope.forward_and_store(
            positions.to(device),
            query,
            k.flatten(1).to(device),
            k.flatten(1).to(device),
            cache,
            cache.clone(),
            torch.arange(6, device=device),
        )
        torch.testing.assert_close(cache[:6].cpu(), want_k, rtol=2e-5, atol=2e-5)
        rope.rerotate_kv_cache(cache, torch.arange(6, device=device), 0)
        torch.testing.assert_close(cache[:6].cpu(), want_k, rtol=2e-5, atol=2e-5)


def test_from_hf_config_dict_forms():
    config = _gemma4_config()
    d = config.to_dict()
    args = hf_rope_args(d, layer_type="full_attention")
    assert (args["head_size"], args["rotary_dim"], args["rotary_position"]) == (64, 16, "halves")
    raw = {k: v for k, v in d.items() if k != "per_layer_config"}
    raw["global_head_dim"] = 64  # a config.json as Gemma 4's checkpoints write it
    assert hf_rope_args(raw, layer_type="full_attention")["head_size"] == 64
    assert hf_rope_args(d, layer_type="sliding_attention")["head_size"] == 32
    # every pair turns: the usual layout, a full-width table
    whole = dict(d, rope_parameters={"rope_type": "proportional", "partial_rotary_factor": 1.0, "rope_theta": 1e4})
    args = hf_rope_args(whole)
    assert (args["rotary_dim"], args["rotary_position"]) == (32, "first")
