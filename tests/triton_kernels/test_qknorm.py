"""q/k RMSNorm fused with RoPE (apply_rope / apply_rope_and_store / RotaryEmbedding with norm weights).

Every case runs on fresh random inputs against reference.rms_norm_rope in float64, with fresh
outputs poisoned (NaN) so an element the kernel skips fails; backward cases compare dq, dk and both
weight gradients with float64 autograd through the reference. On CPU the kernels run in the Triton
interpreter (conftest sets TRITON_INTERPRET=1); the same tests run compiled on CUDA (marked gpu).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ropekit
from ropekit.api.modules import RotaryEmbedding
from ropekit.api.store import apply_rope_and_store
from ropekit.core import checks, memo, plans, tuning, variant
from ropekit.tools import reference

from conftest import make_cache

NAN = float("nan")
# relative (norm) error bounds: rounding to the output dtype plus float32 math
RTOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got).any(), "NaN in output (an element was not written)"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def weights(x, across, dtype=torch.float32, device="cpu"):
    """A norm weight for x (*T, H, D): (D,) per head, (H*D,) across heads; values around 1."""
    n = x.shape[-1] * (x.shape[-2] if across else 1)
    return (1 + 0.5 * torch.randn(n, dtype=torch.float64)).to(dtype=dtype, device=device)


def oracle(q, k, positions, cache, **kw):
    """The float64 reference (inputs copied, so in-place calls can be checked afterwards)."""

    def d(x):
        return None if x is None else x.detach().double().cpu()

    kw = {n: (d(v) if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
    return reference.rms_norm_rope(d(q), d(k), None if positions is None else positions.cpu(), d(cache), **kw)


def inputs(T=(5,), Hq=4, Hk=2, D=64, dtype=torch.float32, device="cpu"):
    q = torch.randn(*T, Hq, D, dtype=dtype, device=device)
    k = torch.randn(*T, Hk, D, dtype=dtype, device=device)
    return q, k


WHICH = ["q", "k", "both"]
MODES = ["per_head", "across"]


def norm_kw(q, k, which, mode, offset, wdtype=torch.float32, device="cpu"):
    across = mode == "across"
    return dict(
        q_norm_weight=weights(q, across, wdtype, device) if which in ("q", "both") else None,
        k_norm_weight=weights(k, across, wdtype, device) if which in ("k", "both") else None,
        norm_eps=1e-6,
        norm_weight_offset=offset,
    )


# ---------------------------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("rot", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("mode", MODES)
def test_forward_matches_reference(mode, which, offset, interleaved, rot, poison, device):
    q, k = inputs(device=device)
    cache = make_cache(32, rot, device=device)
    pos = torch.randint(0, 32, (5,), device=device)
    kw = norm_kw(q, k, which, mode, offset, device=device)
    rq, rk = oracle(q, k, pos, cache, interleaved=interleaved, **kw)
    q0, k0 = q.clone(), k.clone()
    qo, ko = ropekit.apply_rope(q, k, pos, cache, interleaved=interleaved, **kw)
    assert rel(qo, rq) < RTOL[q.dtype] and rel(ko, rk) < RTOL[q.dtype]
    assert torch.equal(q, q0) and torch.equal(k, k0), "out of place must leave the inputs alone"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_forward_dtypes(dtype, wdtype, mode, poison, device):
    q, k = inputs(dtype=dtype, device=device)
    cache = make_cache(32, 64, device=device)
    pos = torch.randint(0, 32, (5,), device=device)
    kw = norm_kw(q, k, "both", mode, 0.0, wdtype, device)
    rq, rk = oracle(q, k, pos, cache, **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
    assert qo.dtype == dtype and ko.dtype == dtype
    assert rel(qo, rq) < RTOL[dtype] and rel(ko, rk) < RTOL[dtype]


@pytest.mark.parametrize("rot", [64, 48], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("mode", MODES)
def test_inplace_writes_norm_and_rope_tail_included(mode, which, interleaved, rot, device):
    q, k = inputs(device=device)
    cache = make_cache(32, rot, device=device)
    pos = torch.randint(0, 32, (5,), device=device)
    kw = norm_kw(q, k, which, mode, 1.0, device=device)
    rq, rk = oracle(q, k, pos, cache, interleaved=interleaved, **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, interleaved=interleaved, inplace=True, **kw)
    assert qo is q and ko is k
    assert rel(q, rq) < RTOL[q.dtype] and rel(k, rk) < RTOL[q.dtype]


@pytest.mark.parametrize("interleaved_sections", [False, True], ids=["chunked", "interleaved"])
@pytest.mark.parametrize("mode", MODES)
def test_mrope(interleaved_sections, mode, poison, device):
    q, k = inputs(device=device)
    cache = make_cache(32, 64, device=device)
    pos = torch.randint(0, 32, (3, 5), device=device)
    section = [8, 12, 12] if not interleaved_sections else [12, 10, 10]
    kw = norm_kw(q, k, "both", mode, 0.0, device=device)
    rq, rk = oracle(q, k, pos, cache, mrope_section=section, mrope_interleaved=interleaved_sections, **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, mrope_section=section, mrope_interleaved=interleaved_sections, **kw)
    assert rel(qo, rq) < RTOL[q.dtype] and rel(ko, rk) < RTOL[q.dtype]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_strided_views_of_fused_qkv_two_token_dims(mode, inplace, poison, device):
    B, S, Hq, Hk, D = 2, 3, 4, 2, 64
    qkv = torch.randn(B, S, (Hq + 2 * Hk) * D + 16, device=device)  # padded rows: strides not dense
    q = qkv[..., : Hq * D].view(B, S, Hq, D)
    k = qkv[..., Hq * D : (Hq + Hk) * D].view(B, S, Hk, D)
    before = qkv.clone()
    cache = make_cache(16, 32, device=device)
    pos = torch.randint(0, 16, (B, S), device=device)
    kw = norm_kw(q, k, "both", mode, 0.0, device=device)
    rq, rk = oracle(q, k, pos, cache, **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, inplace=inplace, **kw)
    assert rel(qo, rq) < RTOL[q.dtype] and rel(ko, rk) < RTOL[q.dtype]
    v_and_pad = slice((Hq + Hk) * D, None)
    assert torch.equal(qkv[..., v_and_pad], before[..., v_and_pad]), "v or the row padding was written"
    if not inplace:
        assert torch.equal(qkv, before)


@pytest.mark.parametrize("mode", MODES)
def test_positions_none_is_arange(mode, poison, device):
    q, k = inputs(T=(2, 3), device=device)
    cache = make_cache(8, 64, device=device)
    kw = norm_kw(q, k, "both", mode, 0.0, device=device)
    rq, rk = oracle(q, k, None, cache, **kw)
    qo, ko = ropekit.apply_rope(q, k, None, cache, **kw)
    assert rel(qo, rq) < RTOL[q.dtype] and rel(ko, rk) < RTOL[q.dtype]


@pytest.mark.parametrize("mode", MODES)
def test_head_loop_path(mode, poison, request, device):
    """rope_kernel's one-program-per-token path (picked for >= 1024 tokens), forced on a small call."""
    from ropekit.core import tuning

    knobs = tuning.override(head_loop=True)
    knobs.__enter__()
    request.addfinalizer(lambda: knobs.__exit__(None, None, None))
    q, k = inputs(T=(6,), Hq=8, Hk=2, D=32, device=device)
    cache = make_cache(16, 16, device=device)
    pos = torch.randint(0, 16, (6,), device=device)
    kw = norm_kw(q, k, "both", mode, 1.0, device=device)
    rq, rk = oracle(q, k, pos, cache, **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
    assert rel(qo, rq) < RTOL[q.dtype] and rel(ko, rk) < RTOL[q.dtype]


def test_many_head_blocks_per_head_norm(poison, device):
    """More heads than one head block holds: the per-head norm must not mix blocks."""
    q, k = inputs(T=(3,), Hq=40, Hk=8, D=128, device=device)
    cache = make_cache(16, 128, device=device)
    pos = torch.randint(0, 16, (3,), device=device)
    kw = norm_kw(q, k, "both", "per_head", 0.0, device=device)
    rq, rk = oracle(q, k, pos, cache, **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
    assert rel(qo, rq) < RTOL[q.dtype] and rel(ko, rk) < RTOL[q.dtype]


@pytest.mark.parametrize("rot", [16, 8], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("modes", [("across", "across"), ("across", "per_head"), ("per_head", "across")], ids=str)
def test_across_heads_in_small_blocks(modes, interleaved, rot, poison, device):
    """Across-heads norm with the head loop and blocks of 2 heads (block_elems 16 / rotary_dim):
    the kernel's pre-pass sums each tensor's squares over all its blocks (40 heads of q, 6 of k)
    before scaling any block; a per-head tensor next to it stays per head."""
    from ropekit.core import tuning

    q, k = inputs(T=(2, 3), Hq=40, Hk=6, D=16, device=device)
    cache = make_cache(16, rot, device=device)
    pos = torch.randint(0, 16, (2, 3), device=device)
    kw = dict(
        q_norm_weight=weights(q, modes[0] == "across", device=device),
        k_norm_weight=weights(k, modes[1] == "across", device=device),
        norm_eps=1e-6,
        norm_weight_offset=0.5,
    )
    rq, rk = oracle(q, k, pos, cache, interleaved=interleaved, **kw)
    with tuning.override(head_loop=True, block_elems=2 * rot, across_block_elems=2 * rot, decode_block_elems=2 * rot):
        qo, ko = ropekit.apply_rope(q, k, pos, cache, interleaved=interleaved, **kw)
        grads = backward_case(q, k, pos, cache, kw, interleaved)
    assert rel(qo, rq) < RTOL[q.dtype] and rel(ko, rk) < RTOL[q.dtype]
    for name, got, want in grads:
        assert rel(got, want) < GRAD_RTOL[torch.float32], name


@pytest.mark.gpu
def test_across_heads_wan_sized_on_gpu():
    """Wan 2.1 14B's shape with the default tiles: q and k of 40 heads of 128 in blocks of 16, the
    head loop's pre-pass over three blocks a tensor; forward and backward in bf16."""
    q, k = inputs(T=(2048,), Hq=40, Hk=40, D=128, dtype=torch.bfloat16, device="cuda")
    cache = make_cache(4096, 128, device="cuda")
    pos = torch.randint(0, 4096, (2048,), device="cuda")
    kw = norm_kw(q, k, "both", "across", 0.0, device="cuda")
    rq, rk = oracle(q, k, pos, cache, **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
    assert rel(qo, rq) < RTOL[q.dtype] and rel(ko, rk) < RTOL[q.dtype]
    for name, got, want in backward_case(q, k, pos, cache, kw):
        assert rel(got, want) < GRAD_RTOL[torch.bfloat16], name


def test_across_heads_plan_blocks():
    """The launcher's across-heads forward: by default one block of all of a tensor's heads in
    power-of-two tiles (40 = 32 + 8), q's block then k's; with whole_heads off and the head loop on,
    the per-head block size (a pre-pass sums the group); without the head loop (decode-sized calls),
    whole heads whatever the knob (the norm group must be one block)."""
    from ropekit.core import tuning

    q, k = inputs(T=(4,), Hq=40, Hk=6, D=16)
    cache = make_cache(16, 16)
    rec = variant.Variant(norm_q=2, norm_k=1)
    angles = plans.angle_layout(rec, 16, torch.arange(4), cache, None)
    with tuning.override(decode_block_elems=32, head_loop=True):
        plan = plans.plan_rotate(q, k, q, k, angles, rec)
        tiles = (plan.meta["BLOCK_H"], plan.meta["BLOCK_H2"], plan.meta["BLOCK_H3"])
        assert plan.meta["WHOLE"] and tiles == (32, 8, 0) and plan.args[8] == 2 and plan.grid == (4, 1)
    with tuning.override(decode_block_elems=32, head_loop=True, whole_heads=False):
        plan = plans.plan_rotate(q, k, q, k, angles, rec)
        assert not plan.meta["WHOLE"] and plan.meta["BLOCK_H"] == 2 and plan.args[8] == 20 + 3
    for whole in (None, False):
        with tuning.override(decode_block_elems=32, head_loop=False, whole_heads=whole):
            plan = plans.plan_rotate(q, k, q, k, angles, rec)
            assert plan.meta["WHOLE"] and plan.meta["BLOCK_H"] == 32 and plan.meta["BLOCK_H2"] == 8
            assert plan.grid == (4, 2)


def test_bad_position_is_nan_in_rotated_dims_only(device):
    q, k = inputs(T=(3,), device=device)
    cache = make_cache(8, 32, device=device)
    pos = torch.tensor([1, 99, 2], device=device)
    kw = norm_kw(q, k, "both", "per_head", 0.0, device=device)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
    assert torch.isnan(qo[1, :, :32]).all() and torch.isnan(ko[1, :, :32]).all()
    good = torch.tensor([1, 0, 2], device=device)
    rq, _ = oracle(q, k, good, cache, **kw)
    assert rel(qo[1, :, 32:], rq[1, :, 32:]) < 1e-5, "the tail is normalized whatever the position"
    assert rel(qo[[0, 2]], rq[[0, 2]]) < 1e-5
    with ropekit.strict(), pytest.raises(ValueError, match=r"positions\[1\] = 99"):
        ropekit.apply_rope(q, k, pos, cache, **kw)


def test_rotary_embedding_module_passes_the_norm(device):
    emb = RotaryEmbedding(64, 32, 16, 10000.0, True, dtype=torch.float32).to(device)
    q = torch.randn(5, 4 * 64, device=device)
    k = torch.randn(5, 2 * 64, device=device)
    pos = torch.randint(0, 16, (5,), device=device)
    wq, wk = torch.rand(64, device=device) + 0.5, torch.rand(64, device=device) + 0.5
    rq, rk = oracle(
        q.view(5, 4, 64),
        k.view(5, 2, 64),
        pos,
        emb._table_for(q),
        q_norm_weight=wq,
        k_norm_weight=wk,
        norm_eps=1e-5,
        rotary_dim=32,
    )
    qo, ko = emb(pos, q.clone(), k.clone(), q_norm_weight=wq, k_norm_weight=wk, norm_eps=1e-5)
    assert rel(qo.view(5, 4, 64), rq) < 1e-5 and rel(ko.view(5, 2, 64), rk) < 1e-5


# ---------------------------------------------------------------------------------------------
# backward


def backward_case(q, k, pos, cache, kw, interleaved=False, **extra):
    """(got, want): gradients of q, k, q_norm_weight, k_norm_weight from ropekit and float64 autograd."""
    leaves = {"q": q, "k": k, "wq": kw["q_norm_weight"], "wk": kw["k_norm_weight"]}
    mine = {n: (None if t is None else t.detach().clone().requires_grad_(True)) for n, t in leaves.items()}
    ref = {n: (None if t is None else t.detach().double().cpu().requires_grad_(True)) for n, t in leaves.items()}
    qo, ko = ropekit.apply_rope(
        mine["q"],
        mine["k"],
        pos,
        cache,
        interleaved=interleaved,
        q_norm_weight=mine["wq"],
        k_norm_weight=mine["wk"],
        norm_eps=kw["norm_eps"],
        norm_weight_offset=kw["norm_weight_offset"],
        **extra,
    )
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    ((qo.float() * gq.float()).sum() + (ko.float() * gk.float()).sum()).backward()
    rq, rk = reference.rms_norm_rope(
        ref["q"],
        ref["k"],
        None if pos is None else pos.cpu(),
        cache.double().cpu(),
        interleaved=interleaved,
        q_norm_weight=ref["wq"],
        k_norm_weight=ref["wk"],
        norm_eps=kw["norm_eps"],
        norm_weight_offset=kw["norm_weight_offset"],
        **extra,
    )
    ((rq * gq.double().cpu()).sum() + (rk * gk.double().cpu()).sum()).backward()
    return [(n, mine[n].grad, ref[n].grad) for n in leaves if mine[n] is not None]


@pytest.mark.parametrize("rot", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("mode", MODES)
def test_backward_matches_float64_autograd(mode, which, interleaved, rot, device):
    q, k = inputs(device=device)
    cache = make_cache(32, rot, device=device)
    pos = torch.randint(0, 32, (5,), device=device)
    kw = norm_kw(q, k, which, mode, 1.0 if which == "both" else 0.0, device=device)
    for name, got, want in backward_case(q, k, pos, cache, kw, interleaved):
        assert got is not None, name
        assert rel(got, want) < GRAD_RTOL[torch.float32], name


@pytest.mark.parametrize("interleaved_sections", [False, True], ids=["chunked", "interleaved"])
@pytest.mark.parametrize("mode", MODES)
def test_backward_mrope_two_token_dims(mode, interleaved_sections, device):
    q, k = inputs(T=(2, 3), device=device)
    cache = make_cache(16, 64, device=device)
    pos = torch.randint(0, 16, (3, 2, 3), device=device)
    kw = norm_kw(q, k, "both", mode, 0.0, device=device)
    for name, got, want in backward_case(
        q, k, pos, cache, kw, mrope_section=[8, 12, 12], mrope_interleaved=interleaved_sections
    ):
        assert rel(got, want) < GRAD_RTOL[torch.float32], name


# M-RoPE of N rows and any layout (tests/triton_kernels/test_mrope_layouts.py has the plain rotation)
MROPE_LAYOUTS = {
    "n1": ((32,), "chunked"),
    "n2-pangu": ((12, 20), "pangu"),
    "n4-ernie": ((8, 8, 8, 8), "ernie"),
    "n3-map": ((10, 10, 12), [j % 3 for j in range(32)]),
}


@pytest.mark.parametrize("layout", list(MROPE_LAYOUTS))
@pytest.mark.parametrize("mode", MODES)
def test_mrope_layouts_forward_and_backward(mode, layout, poison, device):
    sections, order = MROPE_LAYOUTS[layout]
    q, k = inputs(T=(3,), device=device)
    cache = make_cache(16, 64, device=device)
    pos = torch.randint(0, 16, (len(sections), 3), device=device)
    kw = norm_kw(q, k, "both", mode, 0.0, device=device)
    extra = dict(mrope_section=sections, mrope_layout=order)
    rq, rk = oracle(q, k, pos, cache, **extra, **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, **extra, **kw)
    assert rel(qo, rq) < RTOL[q.dtype] and rel(ko, rk) < RTOL[q.dtype]
    for name, got, want in backward_case(q, k, pos, cache, kw, **extra):
        assert rel(got, want) < GRAD_RTOL[torch.float32], name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_low_precision_weights_and_inputs(dtype, device):
    q, k = inputs(dtype=dtype, device=device)
    cache = make_cache(32, 64, device=device)
    pos = torch.randint(0, 32, (5,), device=device)
    kw = norm_kw(q, k, "both", "per_head", 0.0, dtype, device)
    for name, got, want in backward_case(q, k, pos, cache, kw):
        assert got.dtype == dtype, name
        assert rel(got, want) < GRAD_RTOL[dtype], name


@pytest.mark.parametrize("whole", [False, True], ids=["blocks", "whole"])
@pytest.mark.parametrize(
    "wdtypes",
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16)],
    ids=str,
)
@pytest.mark.parametrize("mode", MODES)
def test_weights_of_two_dtypes(mode, wdtypes, whole, poison, device):
    """q's and k's norm weights in different dtypes (an fp32 q weight beside a bf16 k weight): the
    forward kernel reads both through one pointer select, so the launcher gives it both as float32
    (exact); forward and the gradients of q, k and both weights (each in its weight's dtype)
    against float64, through the whole-heads tiles and the small blocks."""
    q, k = inputs(dtype=torch.bfloat16, device=device)
    cache = make_cache(32, 48, device=device)  # partial rotary: the normalized tail too
    pos = torch.randint(0, 32, (5,), device=device)
    across = mode == "across"
    kw = dict(
        q_norm_weight=weights(q, across, wdtypes[0], device),
        k_norm_weight=weights(k, across, wdtypes[1], device),
        norm_eps=1e-6,
        norm_weight_offset=1.0,
    )
    rq, rk = oracle(q, k, pos, cache, **kw)
    with tuning.override(whole_heads=whole, head_loop=True, block_elems=128, across_block_elems=128):
        qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
        assert rel(qo, rq) < RTOL[torch.bfloat16] and rel(ko, rk) < RTOL[torch.bfloat16]
        grads = backward_case(q, k, pos, cache, kw)
    dtypes = {"q": torch.bfloat16, "k": torch.bfloat16, "wq": wdtypes[0], "wk": wdtypes[1]}
    for name, got, want in grads:
        assert got.dtype == dtypes[name], name
        assert rel(got, want) < GRAD_RTOL[torch.bfloat16], name


def test_backward_weight_only_and_unused_output(device):
    """Only the weights require grad; k's output takes no part in the loss (its gradient is None)."""
    q, k = inputs(device=device)
    cache = make_cache(32, 64, device=device)
    pos = torch.randint(0, 32, (5,), device=device)
    wq = weights(q, False, device=device).requires_grad_(True)
    wk = weights(k, True, device=device).requires_grad_(True)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, q_norm_weight=wq, k_norm_weight=wk)
    g = torch.randn_like(qo)
    (qo * g).sum().backward()
    wq64 = wq.detach().double().requires_grad_(True)
    rq, _ = reference.rms_norm_rope(q.double().cpu(), None, pos.cpu(), cache.double().cpu(), q_norm_weight=wq64.cpu())
    (rq * g.double().cpu()).sum().backward()
    assert rel(wq.grad, wq64.grad) < 1e-5
    assert wk.grad is not None and float(wk.grad.abs().max()) == 0.0


def test_backward_directional_finite_difference():
    """gradcheck-style: <grad, v> against (f(x + h v) - f(x - h v)) / 2h of the kernel's own forward."""
    torch.manual_seed(1)
    q, k = inputs(T=(3,), Hq=2, Hk=2, D=32)
    cache = make_cache(8, 16)
    pos = torch.randint(0, 8, (3,))
    wq, wk = weights(q, False), weights(k, True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def loss(q_, k_, wq_, wk_):
        qo, ko = ropekit.apply_rope(q_, k_, pos, cache, q_norm_weight=wq_, k_norm_weight=wk_, norm_weight_offset=1.0)
        return (qo.double() * gq).sum() + (ko.double() * gk).sum()

    xs = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    loss(*xs).backward()
    vs = [torch.randn_like(t) for t in xs]
    h = 1e-2
    with torch.no_grad():
        plus = loss(*[t + h * v for t, v in zip(xs, vs)])
        minus = loss(*[t - h * v for t, v in zip(xs, vs)])
    numeric = float((plus - minus) / (2 * h))
    analytic = float(sum((t.grad.double() * v).sum() for t, v in zip(xs, vs)))
    assert abs(numeric - analytic) <= 2e-3 * (1 + abs(analytic)), (numeric, analytic)


# ---------------------------------------------------------------------------------------------
# the fused store


@pytest.mark.parametrize("rot", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("token_programs", [False, True], ids=["block-programs", "token-programs"])
def test_store_with_norm_bf16_cache(mode, which, interleaved, rot, device, token_programs, request):
    from ropekit.core import tuning

    knobs = tuning.override(store_head_loop=token_programs)  # the launcher picks by size: force each
    knobs.__enter__()
    request.addfinalizer(lambda: knobs.__exit__(None, None, None))
    T, Hq, Hk, D, NB, BS = 5, 4, 2, 64, 4, 4
    q, k = inputs(T=(T,), Hq=Hq, Hk=Hk, D=D, device=device)
    v = torch.randn(T, Hk, D, device=device)
    cache = make_cache(32, rot, device=device)
    pos = torch.randint(0, 32, (T,), device=device)
    slots = torch.tensor([3, -1, 9, 0, 14], device=device)
    k_cache = torch.full((NB, BS, Hk, D), NAN, dtype=torch.bfloat16, device=device)
    v_cache = torch.full((NB, BS, Hk, D), NAN, dtype=torch.bfloat16, device=device)
    kw = norm_kw(q, k, which, mode, 1.0, device=device)
    rq, rk = oracle(q, k, pos, cache, interleaved=interleaved, **kw)
    out = apply_rope_and_store(q, k, v, pos, cache, k_cache, v_cache, slots, interleaved=interleaved, **kw)
    assert out is q
    assert rel(q, rq) < RTOL[torch.float32]
    keep = slots >= 0
    s = slots[keep].long()
    assert rel(k_cache[s // BS, s % BS], rk[keep.cpu()]) < RTOL[torch.bfloat16]
    assert rel(v_cache[s // BS, s % BS], v[keep]) < RTOL[torch.bfloat16]  # (the interpreter truncates)
    written = torch.zeros(NB * BS, dtype=torch.bool)
    written[s.cpu()] = True
    assert torch.isnan(k_cache.view(NB * BS, -1)[~written.to(device)].float()).all(), "a row no slot names was written"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_store_with_norm_fp8_cache_cuda(mode):
    T, Hq, Hk, D = 16, 8, 2, 128
    q, k = inputs(T=(T,), Hq=Hq, Hk=Hk, D=D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(T, Hk, D, dtype=torch.bfloat16, device="cuda")
    cache = make_cache(64, D, device="cuda")
    pos = torch.randint(0, 64, (T,), device="cuda")
    slots = torch.randperm(32, device="cuda")[:T]
    k_cache = torch.zeros(32, Hk, D, dtype=torch.float8_e4m3fn, device="cuda")
    v_cache = torch.zeros(32, Hk, D, dtype=torch.float8_e4m3fn, device="cuda")
    kw = norm_kw(q, k, "both", mode, 0.0, torch.bfloat16, "cuda")
    rq, rk = oracle(q, k, pos, cache, **kw)
    apply_rope_and_store(q, k, v, pos, cache, k_cache, v_cache, slots, k_scale=0.5, **kw)
    assert rel(q, rq) < RTOL[torch.bfloat16]
    got = k_cache[slots].float().cpu() * 0.5
    assert rel(got, rk) < 0.04  # e4m3: 3 mantissa bits


def test_store_module_forward_and_store_passes_the_norm():
    emb = RotaryEmbedding(64, 64, 16, 10000.0, True, dtype=torch.float32)
    q, k = torch.randn(3, 2 * 64), torch.randn(3, 64)
    v = torch.randn(3, 64)
    pos = torch.tensor([0, 5, 9])
    wq, wk = torch.rand(64) + 0.5, torch.rand(64) + 0.5
    k_cache, v_cache = torch.zeros(8, 1, 64), torch.zeros(8, 1, 64)
    rq, rk = oracle(q.view(3, 2, 64), k.view(3, 1, 64), pos, emb._table_for(q), q_norm_weight=wq, k_norm_weight=wk)
    emb.forward_and_store(pos, q, k, v, k_cache, v_cache, torch.tensor([1, 2, 3]), q_norm_weight=wq, k_norm_weight=wk)
    assert rel(q.view(3, 2, 64), rq) < 1e-5 and rel(k_cache[1:4], rk) < 1e-5


# ---------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("mode", MODES)
def test_compile_fullgraph_forward_backward(mode, device):
    torch._dynamo.reset()
    q, k = inputs(device=device)
    cache = make_cache(32, 32, device=device)
    pos = torch.randint(0, 32, (5,), device=device)
    kw = norm_kw(q, k, "both", mode, 1.0, device=device)

    def f(q_, k_, wq_, wk_):
        qo, ko = ropekit.apply_rope(q_, k_, pos, cache, q_norm_weight=wq_, k_norm_weight=wk_, norm_weight_offset=1.0)
        return (qo * qo).sum() + (ko * 2).sum()

    xs = [t.clone().requires_grad_(True) for t in (q, k, kw["q_norm_weight"], kw["k_norm_weight"])]
    ys = [t.detach().clone().requires_grad_(True) for t in xs]
    torch.compile(f, fullgraph=True, backend="aot_eager")(*xs).backward()
    f(*ys).backward()
    for a, b in zip(xs, ys):
        assert rel(a.grad, b.grad) < 1e-6


def test_compile_fullgraph_inplace_and_store(device):
    torch._dynamo.reset()
    q, k = inputs(device=device)
    v = torch.randn_like(k)
    cache = make_cache(32, 64, device=device)
    pos = torch.randint(0, 32, (5,), device=device)
    kw = norm_kw(q, k, "both", "per_head", 0.0, device=device)
    rq, rk = oracle(q, k, pos, cache, **kw)

    def f(q_, k_, k_cache, v_cache):
        ropekit.apply_rope(q_, k_, pos, cache, inplace=True, **kw)
        q2 = q_.clone()
        apply_rope_and_store(
            q2, k_, v, pos, cache, k_cache, v_cache, torch.arange(5, device=device), q_norm_weight=kw["q_norm_weight"]
        )
        return q2

    q1, k1 = q.clone(), k.clone()
    kc, vc = torch.zeros(8, 2, 64, device=device), torch.zeros(8, 2, 64, device=device)
    torch.compile(f, fullgraph=True, backend="aot_eager")(q1, k1, kc, vc)
    assert rel(q1, rq) < 1e-5 and rel(k1, rk) < 1e-5
    assert (
        rel(
            kc[:5],
            reference.rotate(k1.double().cpu(), *reference.angles_from_table(cache.double().cpu(), pos.cpu(), (5,))),
        )
        < 1e-5
    )


# ---------------------------------------------------------------------------------------------
# bad inputs: one test per class; nothing is written when a call raises


def _call(which="q", inplace=True, **over):
    q, k = inputs()
    cache = make_cache(32, 64)
    pos = torch.randint(0, 32, (5,))
    kw = dict(q_norm_weight=torch.ones(64), k_norm_weight=torch.ones(64))
    kw.update(over)
    q0, k0 = q.clone(), k.clone()
    try:
        ropekit.apply_rope(q, k, pos, cache, inplace=inplace, **kw)
    finally:
        assert torch.equal(q, q0) and torch.equal(k, k0), "written before raising"


def test_bad_weight_shape():
    with pytest.raises(ValueError, match=r"apply_rope: q_norm_weight: expected shape \(64,\) .* or \(256,\)"):
        _call(q_norm_weight=torch.ones(32))


def test_bad_weight_rank():
    with pytest.raises(ValueError, match="k_norm_weight: expected a 1-D tensor"):
        _call(k_norm_weight=torch.ones(2, 64))


def test_bad_weight_dtype():
    with pytest.raises(ValueError, match=r"q_norm_weight: expected dtype in \(float16, bfloat16, float32\)"):
        _call(q_norm_weight=torch.ones(64, dtype=torch.float64))


def test_bad_weight_type():
    with pytest.raises(TypeError, match="k_norm_weight: expected a torch.Tensor, got list"):
        _call(k_norm_weight=[1.0] * 64)


def test_bad_weight_device():
    with pytest.raises(ValueError, match="q_norm_weight: expected a tensor on cpu"):
        _call(q_norm_weight=torch.ones(64, device="meta"))


def test_bad_weight_stride():
    with pytest.raises(ValueError, match=r"q_norm_weight: expected stride 1 in the last dimension, got strides \(2,\)"):
        _call(q_norm_weight=torch.ones(128)[::2])


def test_k_weight_without_k():
    q = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="k_norm_weight: expected None when k is None"):
        ropekit.apply_rope(q, None, torch.arange(3), make_cache(8, 64), k_norm_weight=torch.ones(64))


@pytest.mark.parametrize("eps", [-1.0, float("nan")])
def test_bad_eps_value(eps):
    with pytest.raises(ValueError, match="norm_eps: expected"):
        _call(norm_eps=eps)


def test_bad_eps_type():
    with pytest.raises(TypeError, match="norm_eps: expected a float, got str"):
        _call(norm_eps="1e-6")


def test_bad_offset():
    with pytest.raises(ValueError, match="norm_weight_offset: expected a finite float"):
        _call(norm_weight_offset=float("inf"))


def test_inplace_with_weight_requiring_grad():
    with pytest.raises(ValueError, match="inplace: expected False when q_norm_weight requires grad"):
        _call(q_norm_weight=torch.ones(64, requires_grad=True))


def test_inplace_weight_overlapping_q():
    q, k = inputs()
    q0 = q.clone()
    with pytest.raises(ValueError, match="q_norm_weight: expected memory disjoint from q"):
        ropekit.apply_rope(q, k, torch.arange(5), make_cache(8, 64), inplace=True, q_norm_weight=q[0, 0])
    assert torch.equal(q, q0)


def test_store_weight_requiring_grad():
    q, k = inputs(T=(2,))
    with pytest.raises(ValueError, match="apply_rope_and_store: k_norm_weight: expected a tensor that does not"):
        apply_rope_and_store(
            q,
            k,
            k.clone(),
            torch.arange(2),
            make_cache(8, 64),
            torch.zeros(4, 2, 64),
            torch.zeros(4, 2, 64),
            torch.arange(2),
            k_norm_weight=torch.ones(64, requires_grad=True),
        )


# ---------------------------------------------------------------------------------------------
# 64-bit addressing: views whose elements sit past 2^31 (helpers/big_offsets.py, a subprocess)


@pytest.mark.skipif(sys.platform != "linux", reason="relies on untouched pages of torch.empty (Linux overcommit)")
def test_norm_offsets_past_2_31_are_right():
    script = Path(__file__).resolve().parents[1] / "helpers" / "big_offsets.py"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, str(script), "norm"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


@pytest.mark.gpu
@pytest.mark.bigmem
def test_bigmem_cuda_norm_past_2_31_elements():
    """A real q above 2^31 elements on the GPU with the per-head norm, forward and backward."""
    T, H, D = 262_145, 64, 128
    q = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(T, 8, D, dtype=torch.bfloat16, device="cuda")
    cache = make_cache(T, D, device="cuda")
    pos = torch.arange(T, device="cuda")
    wq = torch.rand(D, device="cuda") + 0.5
    wk = torch.rand(8 * D, device="cuda") + 0.5
    tail = slice(T - 3, T)
    rq, rk = oracle(q[tail], k[tail], pos[tail], cache, q_norm_weight=wq, k_norm_weight=wk)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, q_norm_weight=wq, k_norm_weight=wk)
    assert rel(qo[tail], rq) < 1e-2 and rel(ko[tail], rk) < 1e-2
    del qo, ko
    q.requires_grad_(True)
    wq.requires_grad_(True)
    qo, _ = ropekit.apply_rope(q, None, pos, cache, q_norm_weight=wq)
    qo.backward(torch.ones_like(qo))
    del qo
    gx, dw = q.grad, wq.grad
    qd = q[tail].detach().double().cpu().requires_grad_(True)
    y, _ = reference.rms_norm_rope(qd, None, pos[tail].cpu(), cache.double().cpu(), q_norm_weight=wq.double().cpu())
    y.sum().backward()
    assert rel(gx[tail], qd.grad) < 2e-2
    assert torch.isfinite(dw).all()


def test_cpu_reference_path_without_triton(monkeypatch, request):
    """Plain CPU (no TRITON_INTERPRET): the pure-PyTorch path, forward, backward and store."""
    monkeypatch.setattr(checks, "triton_runs", lambda x: False)  # the specs record their path
    memo.clear()
    request.addfinalizer(memo.clear)
    q, k = inputs()
    cache = make_cache(32, 32)
    pos = torch.randint(0, 32, (5,))
    wq, wk = weights(q, False).requires_grad_(True), weights(k, True).requires_grad_(True)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, q_norm_weight=wq, k_norm_weight=wk, norm_weight_offset=1.0)
    rq, rk = oracle(q, k, pos, cache, q_norm_weight=wq, k_norm_weight=wk, norm_weight_offset=1.0)
    assert rel(qo, rq) < 1e-6 and rel(ko, rk) < 1e-6
    (qo.sum() + ko.sum()).backward()
    assert wq.grad is not None and wk.grad is not None
    kc, vc = torch.zeros(8, 2, 64), torch.zeros(8, 2, 64)
    q2 = q.clone()
    with torch.no_grad():
        apply_rope_and_store(
            q2, k, k, pos, cache, kc, vc, torch.arange(5), q_norm_weight=wq, k_norm_weight=wk, norm_weight_offset=1.0
        )
    assert rel(q2, rq) < 1e-6 and rel(kc[:5], rk) < 1e-6
