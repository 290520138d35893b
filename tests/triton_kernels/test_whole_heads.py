"""Whole heads: the q/k RMSNorm + RoPE kernels holding all of a tensor's heads of a token in up to
three power-of-two tiles (rope_kernel's and rope_norm_backward_kernel's WHOLE, BLOCK_H2, BLOCK_H3),
the launcher's choice of them, and the interleaved weights read as pair words (W_PAIRS).

Every case runs on fresh random inputs against a float64 reference (norm, then rotation), outputs
poisoned with NaN (and the backward's weight-gradient partial sums started at NaN), so an element a
tile skips fails. Head counts cover one tile (32), two (40 = 32 + 8, 24 = 16 + 8, 5 = 4 + 1, 3 =
2 + 1), three (7 = 4 + 2 + 1) and a padded third tile (15 = 8 + 4 + 4); each path is forced with the
tuning knobs and compared with the small-block path it replaces. On CPU the kernels run in the
Triton interpreter (conftest); sizes stay small.
"""

from __future__ import annotations

import pytest
import torch
from test_norm_backward import backward, freqs_case, reference_grads, strided, table_case

import ropekit
from ropekit.core import freqs, plans, tuning
from ropekit.core.variant import Variant
from ropekit.tools import reference

from conftest import make_cache

EPS = 1e-6
RTOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}

# the program layouts of a normed forward: whole heads with the head loop (k's tiles prefetched
# during q's norm, or not: the default), a program per tensor (no head loop), and the small blocks they replace
PATHS = {
    "whole-loop": dict(whole_heads=True, head_loop=True),
    "whole-loop-prefetch": dict(whole_heads=True, head_loop=True, prefetch=True),
    "whole-per-tensor": dict(whole_heads=True, head_loop=False),
    "blocks": dict(whole_heads=False, head_loop=True, block_elems=64, across_block_elems=64),
}


def rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got).any(), "NaN in output (an element was not written)"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def weight(n, dtype=torch.float32, misalign=False):
    """A norm weight of n values around 1; misalign: a view one element off the 16-byte grid."""
    w = (1 + 0.4 * torch.randn(n + 1, dtype=torch.float64)).to(dtype)
    return w[1:] if misalign else w[:n].clone()


def forward_ref(q, k, cos, sin, wq, wk, interleaved, offset=0.0):
    """float64 norm (each head, or all heads for (H*D,) weights; the whole head), then rotation."""
    outs = []
    for x, w in ((q, wq), (k, wk)):
        y = reference.rms_norm(x.double(), w.double(), eps=EPS, offset=offset)
        outs.append(reference.rotate(y, cos, sin, interleaved=interleaved))
    return outs


def test_head_tiles():
    tiles = {n: plans.head_tiles(n) for n in (1, 2, 3, 5, 7, 15, 24, 32, 40, 64, 100)}
    assert tiles == {
        1: (1, 0, 0),
        2: (2, 0, 0),
        3: (2, 1, 0),
        5: (4, 1, 0),
        7: (4, 2, 1),
        15: (8, 4, 4),
        24: (16, 8, 0),
        32: (32, 0, 0),
        40: (32, 8, 0),
        64: (64, 0, 0),
        100: (64, 32, 4),
    }


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("heads, dim", [(40, 16), (24, 32), (5, 64), (3, 128), (7, 16), (15, 16)], ids=str)
@pytest.mark.parametrize("mode", ["across", "per_head"])
def test_forward_table_angles(mode, heads, dim, path, poison):
    """Both norms through every program layout, half-split, fp32 (table angles, full rotary)."""
    torch.manual_seed(heads * 7 + dim)
    T = 3
    q, k = torch.randn(T, heads, dim), torch.randn(T, heads, dim)
    n = dim * (heads if mode == "across" else 1)
    wq, wk = weight(n), weight(n)
    cache = make_cache(16, dim)
    pos = torch.randint(0, 16, (T,))
    cos, sin = reference.angles_from_table(cache.double(), pos, (T,))
    want = forward_ref(q, k, cos, sin, wq, wk, False)
    with tuning.override(**PATHS[path]):
        got = ropekit.apply_rope(q, k, pos, cache, q_norm_weight=wq, k_norm_weight=wk, norm_eps=EPS)
    for g, w in zip(got, want):
        assert rel(g, w) < RTOL[torch.float32]


def axial(T, heads, dim, dtype, seed):
    """q, k (T, heads, dim), 3-axis integer positions (3, T), their inverse frequencies, the float64
    per-token cos / sin, and the axes' pairs (Wan's split of a head into time, height and width)."""
    g = torch.Generator().manual_seed(seed)
    axes_dim = (dim - 2 * (dim // 3 // 2 * 2), dim // 3 // 2 * 2, dim // 3 // 2 * 2)
    inv = freqs.axial_inv_freq(axes_dim)
    pos = torch.randint(0, 50, (3, T), generator=g)
    axes = tuple(d // 2 for d in axes_dim)
    cos, sin = reference.angles_from_freqs(pos, inv, axes, dtype=torch.float64)
    q = torch.randn(T, heads, dim, generator=g).to(dtype)
    k = torch.randn(T, heads, dim, generator=g).to(dtype)
    return q, k, pos, inv, cos, sin, axes


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads, dim", [(40, 128), (24, 64), (3, 64)], ids=str)
@pytest.mark.parametrize("mode", ["across", "per_head"])
def test_forward_axial_pairs(mode, heads, dim, dtype, path, poison):
    """The DiT prologue's form: angles from 3-axis positions x inverse frequencies, interleaved
    pairs (q, k and bf16 weights moved as pair words), bf16 and fp32."""
    q, k, pos, inv, cos, sin, axes = axial(3, heads, dim, dtype, seed=heads + dim)
    n = dim * (heads if mode == "across" else 1)
    wq, wk = weight(n, dtype), weight(n, dtype)
    want = forward_ref(q, k, cos, sin, wq, wk, True)
    with tuning.override(**PATHS[path]):
        got = ropekit.apply_rope(
            q, k, pos, None, inv_freq=inv, axes=axes, interleaved=True, q_norm_weight=wq, k_norm_weight=wk, norm_eps=EPS
        )
    for g, w in zip(got, want):
        assert g.dtype == dtype and rel(g, w) < RTOL[dtype]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("modes", [("across", "across"), ("across", "per_head"), ("per_head", "across")], ids=str)
def test_forward_partial_rotary_mixed_modes_and_heads(modes, interleaved, inplace, poison):
    """Whole heads with a tail past the rotary dims (normalized, its squares in the group's sum), q
    and k with different head counts (5 and 3: k's tiles partly masked) and different modes."""
    torch.manual_seed(11)
    T, Hq, Hk, D, rot = 3, 5, 3, 32, 16
    q, k = torch.randn(T, Hq, D), torch.randn(T, Hk, D)
    wq = weight(D * (Hq if modes[0] == "across" else 1))
    wk = weight(D * (Hk if modes[1] == "across" else 1))
    cache = make_cache(16, rot)
    pos = torch.randint(0, 16, (T,))
    cos, sin = reference.angles_from_table(cache.double(), pos, (T,))
    want = forward_ref(q, k, cos, sin, wq, wk, interleaved, offset=1.0)
    for path in ("whole-loop", "whole-per-tensor"):
        qi, ki = q.clone(), k.clone()
        with tuning.override(**PATHS[path]):
            got = ropekit.apply_rope(
                qi,
                ki,
                pos,
                cache,
                interleaved=interleaved,
                inplace=inplace,
                q_norm_weight=wq,
                k_norm_weight=wk,
                norm_eps=EPS,
                norm_weight_offset=1.0,
            )
        for g, w in zip(got, want):
            assert rel(g, w) < RTOL[torch.float32], path


@pytest.mark.parametrize("pairs", [True, False])
@pytest.mark.parametrize("misalign", [False, True])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_pair_words(wdtype, misalign, pairs, poison):
    """Interleaved weights read as one word per pair, or (a weight off the 16-byte grid, or the knob
    off) by element: the same outputs; fp32 weights with bf16 inputs take 64-bit words."""
    torch.manual_seed(12)
    q, k, pos, inv, cos, sin, axes = axial(2, 5, 32, torch.bfloat16, seed=3)
    for mode in ("across", "per_head"):
        n = 32 * (5 if mode == "across" else 1)
        wq, wk = weight(n, wdtype, misalign), weight(n, wdtype)
        assert (wq.data_ptr() % 16 != 0) == misalign
        want = forward_ref(q, k, cos, sin, wq, wk, True)
        with tuning.override(weight_pairs=pairs, whole_heads=True, head_loop=True):
            got = ropekit.apply_rope(
                q, k, pos, None, inv_freq=inv, axes=axes, interleaved=True, q_norm_weight=wq, k_norm_weight=wk
            )
        for g, w in zip(got, want):
            assert rel(g, w) < RTOL[torch.bfloat16], mode


def test_plans_default_rule():
    """Defaults: across heads, whole heads (k's tiles not prefetched, 2 warps up to 8192 elements, 8
    past); per head, whole only when
    q and k share a head count that the per-head blocks would pad (Flux's 24 in blocks of 16), else
    the blocks (Qwen3's 32 and 8 heads); the backward whole across heads only."""
    t = 2048  # past decode-sized: the head loop

    def plan(hq, hk, mode, d=128):
        q, k = torch.empty(t, hq, d, dtype=torch.bfloat16), torch.empty(t, hk, d, dtype=torch.bfloat16)
        variant = Variant(True, True, 0, (), "freqs", norm_q=mode, norm_k=mode)
        angles = plans.angle_layout(variant, d, torch.zeros(t, dtype=torch.long), torch.ones(d // 2), None)
        fwd = plans.plan_rotate(q, k, q, k, angles, variant)
        w = torch.empty(d * (hq if mode == 2 else 1))
        bwd = plans.plan_norm_backward(q, q, q, w, angles, variant, mode)
        return fwd.meta, bwd.meta

    wan, wan_b = plan(40, 40, 2)
    assert (wan["WHOLE"], wan["BLOCK_H"], wan["BLOCK_H2"], wan["PREFETCH"], wan["num_warps"]) == (True, 32, 8, False, 2)
    assert plans.norm_warps(64, 64, 0, whole=True) == 2 and plans.norm_warps(128, 64, 0, whole=True) == 8
    assert wan["W_PAIRS"] and wan_b["WHOLE"] and wan_b["PACK"] == 32 and wan_b["num_warps"] == 4
    flux, flux_b = plan(24, 24, 1)
    assert flux["WHOLE"] and (flux["BLOCK_H"], flux["BLOCK_H2"]) == (16, 8) and not flux_b["WHOLE"]
    qwen, _ = plan(32, 8, 1)
    assert not qwen["WHOLE"] and qwen["BLOCK_H"] == 16 and qwen["BLOCK_H2"] == 0
    with tuning.override(whole_heads=False):
        old, old_b = plan(40, 40, 2)
        assert not old["WHOLE"] and not old_b["WHOLE"] and old["BLOCK_H"] == 4
    with tuning.override(norm_warps=16, norm_bwd_warps=2, weight_pairs=False):
        forced, forced_b = plan(40, 40, 2)
        assert forced["num_warps"] == 16 and forced_b["num_warps"] == 2 and not forced["W_PAIRS"]


def test_prefetch_rule():
    """The head loop prefetches the next head block only for table angles without a norm (W1, W2,
    W6: about 1% faster with it); computed angles (W15), a norm (W13, W14: two of six programs an SM
    lost to it) and M-RoPE do not; the knob forces it either way (PERF_LOG v27, v28)."""
    t, d = 2048, 128

    def prefetch(angles, mode=0, mrope=()):
        q, k = torch.empty(t, 16, d, dtype=torch.bfloat16), torch.empty(t, 4, d, dtype=torch.bfloat16)
        sections = mrope or ((0, 0, 0) if angles == "table" else ())
        variant = Variant(True, True, 1 if mrope else 0, sections, angles, norm_q=mode, norm_k=mode)
        pos = torch.zeros(3, t, dtype=torch.long) if mrope else torch.zeros(t, dtype=torch.long)
        source = torch.ones(d // 2) if angles == "freqs" else torch.ones(4096, d)
        plan = plans.plan_rotate(q, k, q, k, plans.angle_layout(variant, d, pos, source, None), variant)
        assert plan.meta["HEAD_LOOP"]
        return plan.meta["PREFETCH"]

    assert prefetch("table")
    assert not prefetch("freqs") and not prefetch("table", mode=1) and not prefetch("freqs", mode=2)
    assert not prefetch("table", mrope=(16, 24, 24))
    with tuning.override(prefetch=True):
        assert prefetch("freqs") and prefetch("table", mode=1)
    with tuning.override(prefetch=False):
        assert not prefetch("table")


# ---------------------------------------------------------------------------------------------
# backward (plans.plan_norm_backward / fire_norm_backward, as tests/triton_kernels/test_norm_backward.py)


def check_backward(case, variant, mode, dtype=torch.float32, programs=2, whole=True, wdtype=None):
    x = strided(*case.shape, dtype=dtype)
    g = strided(*case.shape, dtype=dtype)
    h, d = case.shape[-2], case.shape[-1]
    w = weight(d * (h if mode == 2 else 1), wdtype or dtype)
    with tuning.override(whole_heads=whole, norm_bwd_programs=programs):
        gx, gw = backward(case, variant, x, g, w, mode)
    want_gx, want_gw = reference_grads(case, variant, x, g, w)
    assert gx.dtype == dtype and rel(gx, want_gx) < GRAD_RTOL[dtype]
    # the weight's gradient is summed in float32 and returned in the weight's dtype
    assert gw.shape == w.shape and rel(gw, want_gw) < RTOL[gw.dtype] * 5


@pytest.mark.parametrize("layout", [(False, False), (True, True), (True, False)], ids=str)
@pytest.mark.parametrize("heads", [40, 24, 5, 3, 7, 15])
@pytest.mark.parametrize("mode", [1, 2])
def test_backward_whole_heads(mode, heads, layout, poison):
    """Every tile count, both norms, pairs in and out (word loads and stores of x, g and gx):
    gradients of x and of the weight (its row summed in registers over each program's tokens, two
    programs, the last with fewer tokens) against float64 autograd."""
    torch.manual_seed(heads)
    case = table_case(torch.tensor([3, 0, 15, 7, 9]), heads, 16, 12)  # a tail of 4 dims
    check_backward(case, case.variant(*layout), mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads, dim", [(40, 128), (24, 64)], ids=str)
@pytest.mark.parametrize("mode", [1, 2])
def test_backward_axial_pairs(mode, heads, dim, dtype, poison):
    """The DiT backward's form: 3-axis angles from inverse frequencies, interleaved, bf16 and fp32
    (pair words of 32 and 64 bits), one program for all tokens and one program per token."""
    pos = torch.randint(0, 40, (3, 2, 2))
    axes_dim = (dim - 2 * (dim // 3 // 2 * 2), dim // 3 // 2 * 2, dim // 3 // 2 * 2)
    case = freqs_case(pos, axes_dim, heads, dim)
    for programs in (1, 1024):
        check_backward(case, case.variant(True, True), mode, dtype, programs)


def test_backward_small_blocks_with_pair_words(poison):
    """The blocks the whole heads replace, now with x, g and gx moved as pair words: same gradients."""
    torch.manual_seed(13)
    case = table_case(torch.tensor([[1, 4, 2], [9, 0, 5]]), 6, 16, 16)
    for mode in (1, 2):
        with tuning.override(block_elems=32, across_block_elems=32):
            check_backward(case, case.variant(True, True), mode, whole=False)


def test_backward_misaligned_pairs_fall_back(poison):
    """x one element off the pair-word grid (and a weight off the 16-byte grid): the element path."""
    torch.manual_seed(14)
    case = table_case(torch.tensor([2, 5, 1]), 5, 16, 16)
    variant = case.variant(True, True)
    x = torch.randn(3 * 5 * 16 + 1)[1:].view(3, 5, 16)
    g = torch.randn(3, 5, 16)
    w = weight(5 * 16, misalign=True)
    with tuning.override(whole_heads=True):
        angles = plans.angle_layout(variant, 16, case.a, case.b, None)
        assert plans.plan_norm_backward(x, g, g, w, angles, variant, 2).meta["PACK"] == 64
        gx, gw = backward(case, variant, x, g, w, 2)
    want_gx, want_gw = reference_grads(case, variant, x, g, w)
    assert rel(gx, want_gx) < 1e-5 and rel(gw, want_gw) < 1e-5


def autograd_case(q, k, pos, inv, cos, sin, axes, wq, wk, knobs):
    """apply_rope with inverse frequencies and norm weights through autograd under the knobs, and
    float64 autograd through the reference: ((q_out, k_out), (q_ref, k_ref), [(name, grad, want)])."""
    mine = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
    ref = [t.double().requires_grad_(True) for t in (q, k, wq, wk)]
    with tuning.override(**knobs):
        qo, ko = ropekit.apply_rope(
            *mine[:2],
            pos,
            None,
            inv_freq=inv,
            axes=axes,
            interleaved=True,
            q_norm_weight=mine[2],
            k_norm_weight=mine[3],
        )
        gq, gk = torch.randn_like(qo), torch.randn_like(ko)
        torch.autograd.backward((qo, ko), (gq, gk))
    rq, rk = forward_ref(ref[0], ref[1], cos, sin, ref[2], ref[3], True)
    torch.autograd.backward((rq, rk), (gq.double(), gk.double()))
    return (qo, ko), (rq, rk), [(n, a.grad, b.grad) for n, a, b in zip(("q", "k", "wq", "wk"), mine, ref)]


@pytest.mark.parametrize("mode", ["across", "per_head"])
def test_autograd_through_apply_rope(mode):
    """Forward and backward through apply_rope's autograd (the bench's W13 / W14-FB path) with
    whole heads: gradients of q, k and both weights against float64 autograd."""
    torch.manual_seed(15)
    q, k, pos, inv, cos, sin, axes = axial(3, 24, 64, torch.float32, seed=15)
    n = 64 * (24 if mode == "across" else 1)
    _, _, grads = autograd_case(q, k, pos, inv, cos, sin, axes, weight(n), weight(n), PATHS["whole-loop"])
    for name, got, want in grads:
        assert rel(got, want) < GRAD_RTOL[torch.float32], name


@pytest.mark.gpu
@pytest.mark.parametrize("path", sorted(PATHS))
def test_wan_and_flux_sized_on_gpu(path, poison):
    """Wan's 40 heads of 128 across heads and Flux's 24 per head, 3-axis angles, bf16, through
    every program layout: forward and backward against float64."""
    for heads, mode in ((40, "across"), (24, "per_head")):
        q, k, pos, inv, cos, sin, axes = axial(1536, heads, 128, torch.bfloat16, seed=heads)
        n = 128 * (heads if mode == "across" else 1)
        wq, wk = weight(n, torch.bfloat16), weight(n, torch.bfloat16)
        cuda = [t.cuda() for t in (q, k, pos, inv, cos, sin)]
        outs, refs, grads = autograd_case(*cuda, axes, wq.cuda(), wk.cuda(), PATHS[path])
        for got, want in zip(outs, refs):
            assert rel(got, want) < RTOL[torch.bfloat16], heads
        for name, got, want in grads:
            assert rel(got, want) < 2e-2, (heads, name)
