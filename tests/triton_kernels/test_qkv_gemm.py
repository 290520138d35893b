"""rope_qkv_projection: the QKV projection GEMM whose epilogue normalizes and rotates (kernels/qkv_gemm.py).

Against a float64 reference built from torch ops here (projection, per-head RMSNorm, rotation),
forward and backward (the reference differentiated by autograd), on fresh random inputs, with fresh
outputs poisoned (NaN). On CPU the fused kernel runs in the Triton interpreter (conftest sets
TRITON_INTERPRET=1 without CUDA): small shapes there; the tests marked gpu run bf16 at larger
shapes on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

import ropekit
from ropekit.api import qkv as qkv_api
from ropekit.kernels import qkv_gemm
from ropekit.kernels.qkv_gemm import qkv_rope_gemm, tma_ok
from ropekit.tools.reference import apply_rope_and_store as reference_store

from conftest import make_cache, rel_err

NAN = float("nan")
MAX_POS = 96


def need_kernel(device):
    """The fused kernel runs on CUDA, and on CPU tensors under the interpreter only (a CUDA machine
    runs these tests on its GPU: the cuda parameter)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors take the fused kernel under TRITON_INTERPRET=1 only")


def reference(x, w, positions, cache, hq, hk, d, rot, interleaved, wq=None, wk=None, eps=1e-6):
    """(q, k, v) in float64 from torch ops (differentiable in x, w, wq, wk)."""
    x, w, cache = x.double(), w.double(), cache.double()
    y = (x @ w.T).unflatten(-1, (hq + 2 * hk, d))
    q, k, v = y.split((hq, hk, hk), dim=-2)

    def norm(t, nw):
        if nw is None:
            return t
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * nw.double()

    half = rot // 2
    row = cache[positions.long()]
    cos, sin = row[..., None, :half], row[..., None, half:]

    def rotate(t):
        if interleaved:
            a, b = t[..., 0:rot:2], t[..., 1:rot:2]
        else:
            a, b = t[..., :half], t[..., half:rot]
        r1, r2 = a * cos - b * sin, b * cos + a * sin
        pairs = torch.stack((r1, r2), -1).flatten(-2) if interleaved else torch.cat((r1, r2), -1)
        return torch.cat((pairs, t[..., rot:]), -1)

    return rotate(norm(q, wq)), rotate(norm(k, wk)), v


def inputs(T, hidden, hq, hk, d, rot, *, dtype=torch.float32, norm=None, device="cpu", seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn((hq + 2 * hk) * d, hidden, generator=g) / hidden**0.5).to(device=device, dtype=dtype)
    positions = torch.randint(0, MAX_POS, (T,), generator=g).to(device)
    cache = make_cache(MAX_POS, rot, device=device)
    wq = (1 + 0.5 * torch.randn(d, generator=g)).to(device) if norm in ("q", "qk") else None
    wk = (1 + 0.5 * torch.randn(d, generator=g)).to(device) if norm in ("k", "qk") else None
    if grad:
        for t in (x, w, wq, wk):
            if t is not None:
                t.requires_grad_(True)
    return x, w, positions, cache, wq, wk


def call(x, w, positions, cache, wq, wk, hq, hk, d, rot, interleaved, impl="fused", **kw):
    return ropekit.rope_qkv_projection(
        x, w, positions, cache, num_q_heads=hq, num_kv_heads=hk, head_dim=d, rotary_dim=rot,
        interleaved=interleaved, q_norm_weight=wq, k_norm_weight=wk, impl=impl, **kw,
    )  # fmt: skip


# (T, hidden, Hq, Hk, D, rotary_dim): odd T (row masking), GQA, partial rotary, a head size whose
# tail (and a rotary half) are not powers of two, hidden not a multiple of the k block
CASES = [
    (17, 64, 4, 2, 32, 32),
    (33, 96, 4, 1, 32, 16),
    (20, 40, 2, 2, 24, 16),
    (9, 64, 3, 3, 40, 24),
]


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-h{c[1]}-{c[2]}x{c[3]}-D{c[4]}-r{c[5]}" for c in CASES])
@pytest.mark.parametrize("norm", [None, "qk", "k"])
def test_forward_matches_reference(case, interleaved, norm, poison, device):
    need_kernel(device)
    T, hidden, hq, hk, d, rot = case
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm=norm, device=device)
    got = call(x, w, pos, cache, wq, wk, hq, hk, d, rot, interleaved)
    want = reference(x, w, pos, cache, hq, hk, d, rot, interleaved, wq, wk)
    for g, r, shape in zip(got, want, ((T, hq, d), (T, hk, d), (T, hk, d))):
        assert g.shape == shape and g.dtype == x.dtype and g.stride(-1) == 1
        assert rel_err(g, r) < 2e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype, poison, device):
    need_kernel(device)
    T, hidden, hq, hk, d, rot = 17, 64, 4, 2, 32, 32
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, dtype=dtype, norm="qk", device=device)
    got = call(x, w, pos, cache, wq, wk, hq, hk, d, rot, False)
    want = reference(x, w, pos, cache, hq, hk, d, rot, False, wq, wk)
    for g, r in zip(got, want):
        assert g.dtype == dtype
        assert rel_err(g, r) < (8e-3 if dtype == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("norm", [None, "qk"])
def test_two_heads_per_program(interleaved, norm, device):
    """The GPU tiling (G = 2 heads per program, gathered columns) in the interpreter, through the
    launcher with an explicit config; persistent (programs striding over the tiles) with the norm."""
    need_kernel(device)
    T, hidden, hq, hk, d, rot = 19, 64, 4, 2, 32, 16
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm=norm, device=device)
    out = torch.full((T, hq + 2 * hk, d), NAN, device=device)
    pre = torch.full((T, hq + hk, d), NAN, device=device)
    cfg = dict(G=2, BLOCK_M=16 if device == "cpu" else 64, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    cfg["PERSISTENT"] = norm is not None
    qkv_rope_gemm(
        x, w, pos, cache, out, pre, n_q_heads=hq, n_k_heads=hk, head_dim=d, rotary_dim=rot,
        interleaved=interleaved, q_norm_weight=wq, k_norm_weight=wk, config=cfg,
    )  # fmt: skip
    want = torch.cat(reference(x, w, pos, cache, hq, hk, d, rot, interleaved, wq, wk), 1)
    assert rel_err(out, want) < 2e-6
    projected = (x.double() @ w.double().T).unflatten(-1, (hq + 2 * hk, d))[:, : hq + hk]
    assert rel_err(pre, projected) < 2e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-h{c[1]}-{c[2]}x{c[3]}-D{c[4]}-r{c[5]}" for c in CASES])
def test_tma_path(case, dtype, device):
    """The TMA path (tensor descriptors; one head per program) through the launcher: padded halves
    and tails read W's next rows, which must not reach the outputs or the norm."""
    need_kernel(device)
    T, hidden, hq, hk, d, rot = case
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, dtype=dtype, norm="qk", device=device)
    if device == "cuda" and not tma_ok(x, w, False):
        pytest.skip("no TMA on this card")
    assert tma_ok(x, w, False) and not tma_ok(x, w, True) and not tma_ok(x.float(), w.float(), False)
    out = torch.full((T, hq + 2 * hk, d), NAN, device=device, dtype=dtype)
    pre = torch.full((T, hq + hk, d), NAN, device=device, dtype=dtype)
    cfg = dict(G=1, BLOCK_M=16 if device == "cpu" else 64, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2, TMA=True)
    qkv_rope_gemm(
        x, w, pos, cache, out, pre, n_q_heads=hq, n_k_heads=hk, head_dim=d, rotary_dim=rot,
        interleaved=False, q_norm_weight=wq, k_norm_weight=wk, config=cfg,
    )  # fmt: skip
    want = torch.cat(reference(x, w, pos, cache, hq, hk, d, rot, False, wq, wk), 1)
    assert rel_err(out, want) < (8e-3 if dtype == torch.bfloat16 else 1e-3)
    projected = (x.double() @ w.double().T).unflatten(-1, (hq + 2 * hk, d))[:, : hq + hk]
    assert rel_err(pre, projected) < (8e-3 if dtype == torch.bfloat16 else 1e-3)


# the packed path (PACKED: one TMA box of G * D rows of the pair-ordered weight copy, one dot)
PACKED_CASES = [
    # T, hidden, Hq, Hk, D, G, interleaved, norm, dtype
    (19, 64, 4, 2, 32, 2, False, "qk", torch.bfloat16),
    (17, 96, 4, 2, 32, 1, True, None, torch.float16),
    (21, 64, 2, 1, 32, 1, False, "k", torch.float16),
    (9, 64, 4, 2, 32, 2, True, "q", torch.bfloat16),
]


def spy_packing(monkeypatch) -> list:
    """Records each packed_weight call (so a test fails if the launcher fell back to another path)."""
    calls = []
    real = qkv_gemm.packed_weight
    monkeypatch.setattr(qkv_gemm, "packed_weight", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize(
    "case", PACKED_CASES, ids=[f"T{c[0]}-{c[2]}x{c[3]}-D{c[4]}-G{c[5]}-il{int(c[6])}-{c[7]}" for c in PACKED_CASES]
)
@pytest.mark.parametrize("cached", [False, True], ids=["out", "kv_cache"])
def test_packed_path(case, cached, device, monkeypatch):
    """The packed path through the launcher, outputs (and pre, and the caches) NaN-poisoned: every
    column of every head lands where the pair order says, rotated, normed, v unrotated. The
    first two cases run persistent (a few programs striding over the tiles)."""
    need_kernel(device)
    T, hidden, hq, hk, d, g, interleaved, norm, dtype = case
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, d, dtype=dtype, norm=norm, device=device)
    if device == "cuda" and not qkv_gemm.packed_ok(x, d, d, g):
        pytest.skip("no TMA on this card")
    calls = spy_packing(monkeypatch)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    cfg = dict(
        G=g, BLOCK_M=16 if device == "cpu" else 64, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2, PACKED=True
    )
    cfg["PERSISTENT"] = case in PACKED_CASES[:2]
    kw = dict(n_q_heads=hq, n_k_heads=hk, head_dim=d, rotary_dim=d, interleaved=interleaved, config=cfg)
    if cached:
        kc, vc = caches("paged", hk, d, device, dtype)
        slots = torch.tensor(
            [15, 0, 2, -1, 4, 8, 9, 10, 11, -5, 3, 6, 1, 5, 7, 12, 13, 14, -1, -2, -3][:T], device=device
        )
        want = cache_reference(x, w, pos, cache, hq, hk, d, d, interleaved, wq, wk, kc, vc, slots)
        out = torch.full((T, hq, d), NAN, device=device, dtype=dtype)
        qkv_rope_gemm(x, w, pos, cache, out, None, q_norm_weight=wq, k_norm_weight=wk, k_cache=kc, v_cache=vc,
                      slot_mapping=slots, **kw)  # fmt: skip
        assert rel_err(out, want[0]) < tol
        same_with_nan(kc, want[1], tol)
        same_with_nan(vc, want[2], tol)
    else:
        out = torch.full((T, hq + 2 * hk, d), NAN, device=device, dtype=dtype)
        pre = torch.full((T, hq + hk, d), NAN, device=device, dtype=dtype)
        qkv_rope_gemm(x, w, pos, cache, out, pre, q_norm_weight=wq, k_norm_weight=wk, **kw)
        want = torch.cat(reference(x, w, pos, cache, hq, hk, d, d, interleaved, wq, wk), 1)
        assert rel_err(out, want) < tol
        projected = (x.double() @ w.double().T).unflatten(-1, (hq + 2 * hk, d))[:, : hq + hk]
        assert rel_err(pre, projected) < tol
    assert calls  # the packed path ran


def test_packed_weight_order_and_cache(device):
    """The pair order of the packed copy (half-split: row i, then HALF + i per head; interleaved:
    as it is), and the cache: the same copy while the weight is unchanged, a new one after an
    in-place write, none kept once the weight is gone."""
    hq, hk, d, hidden = 2, 1, 8, 16
    w = torch.randn((hq + 2 * hk) * d, hidden, device=device, dtype=torch.float16)
    got = qkv_gemm.packed_weight(w, d, False)
    heads = w.view(-1, d, hidden)
    want = torch.stack((heads[:, : d // 2], heads[:, d // 2 :]), 2).reshape(w.shape)
    assert got.is_contiguous() and torch.equal(got, want)
    assert qkv_gemm.packed_weight(w, d, False) is got  # cached
    with torch.no_grad():
        w.mul_(2)
    again = qkv_gemm.packed_weight(w, d, False)
    assert again is not got and torch.equal(again, 2 * want)
    wt = w.t().contiguous().t()  # any strides: read as they are
    assert torch.equal(qkv_gemm.packed_weight(wt, d, True), w) and qkv_gemm.packed_weight(wt, d, True).is_contiguous()
    ids = (id(w), id(wt))
    assert all(i in qkv_gemm._PACKED for i in ids)
    del w, wt, heads  # (heads, a view, holds w)
    assert not any(i in qkv_gemm._PACKED for i in ids)


def test_packed_path_through_the_op_forward_backward(device, poison, monkeypatch):
    """ROPEKIT_QKV_PATH=packed through rope_qkv_projection: forward and backward against the
    oracle; then an in-place weight update (an optimizer step) and the same again: a stale packed
    copy would give the old weight's outputs."""
    need_kernel(device)
    monkeypatch.setenv("ROPEKIT_QKV_PATH", "packed")
    calls = spy_packing(monkeypatch)
    T, hidden, hq, hk, d = 13, 64, 4, 2, 32
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, d, dtype=torch.float16, norm="qk", device=device)
    leaves = [t.requires_grad_(True) for t in (x, w, wq, wk)]
    for step in range(2):
        outs = call(x, w, pos, cache, wq, wk, hq, hk, d, d, False)
        refs = reference(x, w, pos, cache, hq, hk, d, d, False, wq, wk)
        for o, r in zip(outs, refs):
            assert rel_err(o, r) < 1e-3, step
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(o.shape, generator=gen).to(device, o.dtype) for o in outs]
        got = torch.autograd.grad(outs, leaves, grads)
        want = torch.autograd.grad(refs, leaves, [gr.double() for gr in grads])
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-2, step
        with torch.no_grad():  # an optimizer step: in place, the same tensor
            w.add_(torch.randn(w.shape, generator=gen).to(device, w.dtype), alpha=0.5)
    assert len(calls) == 2


def test_packed_falls_back_and_knobs(monkeypatch):
    """Heads the packed path cannot hold (a tail, a head size not a power of two, fp32) keep the
    other paths' configs; the ROPEKIT_QKV_* knobs override tile_config's entries."""
    monkeypatch.setenv("ROPEKIT_QKV_PATH", "packed")
    assert qkv_gemm.tile_config(4096, 4096, 128, 128, 32, 8, True) == dict(
        G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=32, num_warps=8, num_stages=3, PACKED=True
    )
    assert qkv_gemm.tile_config(4096, 4096, 128, 128, 5, 1, True)["G"] == 1  # odd heads
    for d, rot, itemsize in ((128, 64, 2), (80, 80, 2), (128, 128, 4), (16, 16, 2)):
        assert "PACKED" not in qkv_gemm.tile_config(4096, 4096, d, rot, 32, 8, True, itemsize)
    assert not qkv_gemm.packed_shape_ok(256, 256, 2) and qkv_gemm.packed_shape_ok(256, 256, 1)
    for env, value in (("ROPEKIT_QKV_BLOCK_M", 64), ("ROPEKIT_QKV_STAGES", 5), ("ROPEKIT_QKV_G", 1)):
        monkeypatch.setenv(env, str(value))
    cfg = qkv_gemm.tile_config(4096, 4096, 128, 128, 32, 8, True)
    assert (cfg["BLOCK_M"], cfg["num_stages"], cfg["G"], cfg["PACKED"]) == (64, 5, 1, True)
    monkeypatch.setenv("ROPEKIT_QKV_WARP_SPEC", "1")
    monkeypatch.setenv("ROPEKIT_QKV_PERSISTENT", "1")
    cfg = qkv_gemm.tile_config(4096, 4096, 128, 128, 32, 8, True)
    assert cfg["WARP_SPEC"] is True and cfg["PERSISTENT"] is True
    monkeypatch.setenv("ROPEKIT_QKV_PATH", "tma")
    assert qkv_gemm.tile_config(4096, 4096, 128, 128, 32, 8, True)["TMA"]
    monkeypatch.setenv("ROPEKIT_QKV_WARPS", "eight")
    with pytest.raises(ValueError, match="ROPEKIT_QKV_WARPS: expected an int, got 'eight'"):
        qkv_gemm.tile_config(4096, 4096, 128, 128, 32, 8, True)
    monkeypatch.setenv("ROPEKIT_QKV_PATH", "wide")
    with pytest.raises(ValueError, match="ROPEKIT_QKV_PATH: expected one of pointer, tma, packed, got 'wide'"):
        qkv_gemm.tile_config(4096, 4096, 128, 128, 32, 8, True)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("norm", [None, "qk", "q"])
@pytest.mark.parametrize("rot", [32, 16])
def test_backward_matches_reference(interleaved, norm, rot, poison, device):
    need_kernel(device)
    T, hidden, hq, hk, d = 13, 48, 4, 2, 32
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm=norm, grad=True, device=device)
    outs = call(x, w, pos, cache, wq, wk, hq, hk, d, rot, interleaved)
    refs = reference(x, w, pos, cache, hq, hk, d, rot, interleaved, wq, wk)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=g).to(device) for o in outs]
    leaves = [t for t in (x, w, wq, wk) if t is not None]
    got = torch.autograd.grad(outs, leaves, grads)
    want = torch.autograd.grad(refs, leaves, [gr.double() for gr in grads])
    for name, a, b in zip(("x", "weight", "norm weight", "norm weight"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert rel_err(a, b) < 1e-5, name


def test_backward_with_unused_outputs(poison, device):
    """Gradients of q alone (k and v unused): autograd fills the rest with zeros."""
    need_kernel(device)
    T, hidden, hq, hk, d, rot = 11, 32, 2, 1, 16, 16
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm="qk", grad=True, device=device)
    q, _, _ = call(x, w, pos, cache, wq, wk, hq, hk, d, rot, False)
    rq, _, _ = reference(x, w, pos, cache, hq, hk, d, rot, False, wq, wk)
    got = torch.autograd.grad(q.sum(), (x, w, wq, wk), allow_unused=True)
    want = torch.autograd.grad(rq.sum(), (x, w, wq, wk), allow_unused=True)
    assert want[3] is None and (got[3] is None or not got[3].any())  # k unused: no gradient, or zeros
    for a, b in zip(got[:3], want[:3]):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("norm", [None, "qk"])
def test_fused_and_unfused_agree(interleaved, norm, poison, device):
    need_kernel(device)
    T, hidden, hq, hk, d, rot = 21, 64, 4, 2, 32, 16
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm=norm, grad=True, device=device)
    fused = call(x, w, pos, cache, wq, wk, hq, hk, d, rot, interleaved, impl="fused")
    unfused = call(x, w, pos, cache, wq, wk, hq, hk, d, rot, interleaved, impl="unfused")
    for a, b in zip(fused, unfused):
        assert a.shape == b.shape and rel_err(a, b) < 2e-6
    leaves = [t for t in (x, w, wq, wk) if t is not None]
    grads = [torch.randn_like(o) for o in fused]
    for a, b in zip(torch.autograd.grad(fused, leaves, grads), torch.autograd.grad(unfused, leaves, grads)):
        assert rel_err(a, b) < 1e-5


def test_auto_is_unfused_on_cpu(monkeypatch):
    called = []
    monkeypatch.setattr(qkv_gemm, "qkv_rope_gemm", lambda *a, **k: called.append(1))
    x, w, pos, cache, _, _ = inputs(8, 32, 2, 1, 16, 16)
    q, k, v = call(x, w, pos, cache, None, None, 2, 1, 16, 16, False, impl="auto")
    assert not called
    want = reference(x, w, pos, cache, 2, 1, 16, 16, False)
    assert rel_err(q, want[0]) < 2e-6 and rel_err(v, want[2]) < 2e-6


def test_two_token_dims_and_positions_none(poison, device):
    need_kernel(device)
    B, S, hidden, hq, hk, d, rot = 2, 9, 32, 2, 1, 16, 16
    x, w, _, cache, _, _ = inputs(B * S, hidden, hq, hk, d, rot, device=device)
    x = x.view(B, S, hidden)
    pos = torch.arange(S, device=device).expand(B, S)
    for impl in ("fused", "unfused"):
        got = call(x, w, None, cache, None, None, hq, hk, d, rot, False, impl=impl)
        want = reference(x, w, pos, cache, hq, hk, d, rot, False)
        for g, r in zip(got, want):
            assert g.shape == r.shape and g.shape[:2] == (B, S)
            assert rel_err(g, r) < 2e-6, impl


def test_strided_inputs(poison, device):
    """x a column slice, weight a transposed view: any strides are read as they are."""
    need_kernel(device)
    T, hidden, hq, hk, d, rot = 10, 32, 2, 1, 16, 16
    x, w, pos, cache, _, _ = inputs(T, 2 * hidden, hq, hk, d, rot, device=device)
    x = x[:, ::2]
    w = w[:, :hidden].t().contiguous().t()
    got = call(x, w, pos, cache, None, None, hq, hk, d, rot, True)
    want = reference(x, w, pos, cache, hq, hk, d, rot, True)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 2e-6


def test_out_of_range_position_is_nan_and_strict_raises(poison, device):
    need_kernel(device)
    T, hidden, hq, hk, d, rot = 6, 32, 2, 1, 16, 8
    x, w, pos, cache, _, _ = inputs(T, hidden, hq, hk, d, rot, device=device)
    pos[2], pos[4] = -1, MAX_POS
    q, k, v = call(x, w, pos, cache, None, None, hq, hk, d, rot, False)
    for t in (q, k):
        assert torch.isnan(t[[2, 4], :, :rot]).all()
        assert not torch.isnan(t[[2, 4], :, rot:]).any()
        assert not torch.isnan(t[[0, 1, 3, 5]]).any()
    assert not torch.isnan(v).any()
    with ropekit.strict(), pytest.raises(ValueError, match=r"rope_qkv_projection: positions: .*positions\[2\] = -1"):
        call(x, w, pos, cache, None, None, hq, hk, d, rot, False)


def test_zero_tokens(device):
    need_kernel(device)
    x, w, pos, cache, wq, wk = inputs(0, 32, 2, 1, 16, 16, norm="qk", grad=True, device=device)
    q, k, v = call(x, w, pos, cache, wq, wk, 2, 1, 16, 16, False)
    assert q.shape == (0, 2, 16) and k.shape == v.shape == (0, 1, 16)
    (q.sum() + k.sum()).backward()
    assert x.grad.shape == x.shape and w.grad.abs().sum() == 0


# ---------------------------------------------------------------------------------------------
# torch.compile and the custom ops (ropekit::qkv_rope, ropekit::qkv_rope_backward)

COMPILE_SIZES = (6, 10, 13)  # token counts: the first compiles, the others must reuse its graph


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("norm", [None, "qk"])
def test_compile_fullgraph_dynamic(norm, grad, poison, device):
    """fullgraph=True (a graph break fails) with dynamic=True (a recompile fails) over three token
    counts, forward and backward against the float64 reference. Without grad: x (B, S, hidden)
    and positions None (arange inside the traced function)."""
    need_kernel(device)
    hidden, hq, hk, d, rot = 32, 2, 1, 16, 8

    def f(x, w, pos, cache, wq, wk):
        return call(x, w, pos, cache, wq, wk, hq, hk, d, rot, True)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    torch._dynamo.reset()
    for i, T in enumerate(COMPILE_SIZES):
        x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm=norm, device=device, seed=T, grad=grad)
        if not grad:
            x, pos = x.view(1, T, hidden), None
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            outs = compiled(x, w, pos, cache, wq, wk)
        ref_pos = torch.arange(T, device=device)[None] if pos is None else pos
        refs = reference(x, w, ref_pos, cache, hq, hk, d, rot, True, wq, wk)
        for o, r in zip(outs, refs):
            assert o.shape == r.shape and rel_err(o, r) < 2e-6
        if grad:
            gen = torch.Generator().manual_seed(T)
            grads = [torch.randn(o.shape, generator=gen).to(device) for o in outs]
            leaves = [t for t in (x, w, wq, wk) if t is not None]
            got = torch.autograd.grad(outs, leaves, grads)
            want = torch.autograd.grad(refs, leaves, [gr.double() for gr in grads])
            for a, b in zip(got, want):
                assert a.shape == b.shape and rel_err(a, b) < 1e-5


def test_meta_tensors_take_the_fake():
    """Meta tensors go through the custom op's fake: shapes and dtypes, nothing launched."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("impl='fused' on non-CUDA tensors needs the interpreter")
    x, w, pos, cache, wq, wk = (
        t.to("meta") if t is not None else None for t in inputs(7, 32, 2, 1, 16, 16, norm="k", dtype=torch.bfloat16)
    )
    q, k, v = call(x, w, pos, cache, wq, wk, 2, 1, 16, 16, False)
    assert (q.shape, k.shape, v.shape) == ((7, 2, 16), (7, 1, 16), (7, 1, 16))
    assert q.device.type == "meta" and q.dtype == torch.bfloat16


@pytest.mark.parametrize("norm", [None, "q"])
def test_opcheck(norm):
    """torch.library.opcheck of both ops (schema, fake, autograd registration) on tiny shapes."""
    need_kernel("cpu")
    T, hidden, hq, hk, d, rot = 5, 32, 2, 1, 16, 8
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm=norm, grad=True)
    sizes = [hq, hk, d, rot, 1]
    torch.library.opcheck(torch.ops.ropekit.qkv_rope.default, (x, w, pos, cache, wq, wk, sizes, 1e-6, norm is not None))
    g = torch.randn(T, hq + 2 * hk, d)
    pre = torch.randn(T, hq + hk, d) if norm else None
    wq = None if wq is None else wq.detach()
    needs = [True, False, wq is not None, False]
    args = (g, x.detach(), w.detach(), pos, cache, wq, None, pre, sizes, 1e-6, needs)
    torch.library.opcheck(torch.ops.ropekit.qkv_rope_backward.default, args)


# ---------------------------------------------------------------------------------------------
# the paged-cache write (k_cache, v_cache, slot_mapping): against ropekit.tools.reference's store


def cache_reference(x, w, pos, table, hq, hk, d, rot, interleaved, wq, wk, k_cache, v_cache, slots):
    """(q, k_cache, v_cache) in float64: the projection, then the oracle's apply_rope_and_store
    on copies of the (poisoned) caches."""
    y = (x.double() @ w.double().T).unflatten(-1, (hq + 2 * hk, d))
    q, k, v = y.split((hq, hk, hk), dim=-2)
    q, kc, vc = q.clone(), k_cache.double().clone(), v_cache.double().clone()
    wq, wk = (None if t is None else t.double() for t in (wq, wk))
    reference_store(
        q, k, v, pos, table.double(), kc, vc, slots, interleaved=interleaved, rotary_dim=rot,
        q_norm_weight=wq, k_norm_weight=wk,
    )  # fmt: skip
    return q, kc, vc


def caches(layout, hk, d, device, dtype=torch.float32):
    """NaN-poisoned k and v caches of 16 slots: paged (4, 4, Hk, D), flat (16, Hk, D), or HND
    (paged NHD views of (4, Hk, 4, D) buffers)."""
    if layout == "flat":
        shape = (16, hk, d)
    elif layout == "hnd":
        return [torch.full((4, hk, 4, d), NAN, device=device, dtype=dtype).permute(0, 2, 1, 3) for _ in range(2)]
    else:
        shape = (4, 4, hk, d)
    return [torch.full(shape, NAN, device=device, dtype=dtype) for _ in range(2)]


def same_with_nan(got, want, tol):
    """NaN exactly where want has NaN (rows no slot names stay poisoned), close elsewhere."""
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert rel_err(got.nan_to_num(), want.nan_to_num()) < tol


SLOTS = [0, 5, -1, 7, 12, 3, 14, 1, 9]  # padding (-1), blocks out of order, unnamed rows left


@pytest.mark.parametrize("impl", ["fused", "unfused"])
@pytest.mark.parametrize(
    "layout,interleaved,norm",
    [("paged", False, None), ("flat", True, "qk"), ("hnd", False, "k"), ("paged", True, "q")],
    ids=["paged-half", "flat-interleaved-qk", "hnd-half-k", "paged-interleaved-q"],
)
def test_kv_cache_write_matches_reference(impl, layout, interleaved, norm, poison, device):
    need_kernel(device)
    T, hidden, hq, hk, d, rot = len(SLOTS), 40, 4, 2, 24, 16
    x, w, pos, table, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm=norm, device=device)
    kc, vc = caches(layout, hk, d, device)
    slots = torch.tensor(SLOTS, device=device, dtype=torch.int32)
    want_q, want_k, want_v = cache_reference(x, w, pos, table, hq, hk, d, rot, interleaved, wq, wk, kc, vc, slots)
    q = call(
        x, w, pos, table, wq, wk, hq, hk, d, rot, interleaved, impl=impl, k_cache=kc, v_cache=vc, slot_mapping=slots
    )
    assert q.shape == (T, hq, d) and q.dtype == x.dtype
    assert rel_err(q, want_q) < 2e-6
    same_with_nan(kc, want_k, 2e-6)
    same_with_nan(vc, want_v, 2e-6)


def test_kv_cache_two_heads_per_program_and_bf16(poison, device):
    """The GPU tiling (G = 2) through the launcher with the caches, bf16, (B, S) tokens."""
    need_kernel(device)
    T, hidden, hq, hk, d, rot = 12, 64, 4, 2, 32, 32
    x, w, pos, table, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm="qk", device=device, dtype=torch.bfloat16)
    kc, vc = caches("paged", hk, d, device, torch.bfloat16)
    slots = torch.tensor([15, 0, 2, -1, 4, 8, 9, 10, 11, -5, 3, 6], device=device)
    want_q, want_k, want_v = cache_reference(x, w, pos, table, hq, hk, d, rot, False, wq, wk, kc, vc, slots)
    out = torch.full((T, hq, d), NAN, device=device, dtype=torch.bfloat16)
    cfg = dict(G=2, BLOCK_M=16 if device == "cpu" else 64, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    qkv_rope_gemm(
        x, w, pos, table, out, None, n_q_heads=hq, n_k_heads=hk, head_dim=d, rotary_dim=rot, interleaved=False,
        q_norm_weight=wq, k_norm_weight=wk, config=cfg, k_cache=kc, v_cache=vc, slot_mapping=slots,
    )  # fmt: skip
    assert rel_err(out, want_q) < 8e-3
    same_with_nan(kc, want_k, 8e-3)
    same_with_nan(vc, want_v, 8e-3)
    # the public op on (B, S) tokens: the same rows
    kc2, vc2 = caches("paged", hk, d, device, torch.bfloat16)
    q = call(x.view(2, 6, hidden), w, pos.view(2, 6), table, wq, wk, hq, hk, d, rot, False,
             k_cache=kc2, v_cache=vc2, slot_mapping=slots.view(2, 6))  # fmt: skip
    assert q.shape == (2, 6, hq, d) and torch.equal(q.view(T, hq, d), out)
    assert torch.equal(kc2.nan_to_num(), kc.nan_to_num()) and torch.equal(vc2.nan_to_num(), vc.nan_to_num())


@pytest.mark.parametrize("impl", ["fused", "unfused"])
def test_kv_cache_slot_past_the_cache(impl, poison, device):
    """A slot >= num_slots stores nothing and makes its token's rotated q dims NaN (the store's
    rule); strict mode raises first, as for duplicate slots."""
    need_kernel(device)
    T, hidden, hq, hk, d, rot = 5, 32, 2, 1, 16, 8
    x, w, pos, table, _, _ = inputs(T, hidden, hq, hk, d, rot, device=device)
    kc, vc = caches("paged", hk, d, device)
    slots = torch.tensor([0, 16, 2, 3, 4], device=device)
    q = call(x, w, pos, table, None, None, hq, hk, d, rot, False, impl=impl, k_cache=kc, v_cache=vc, slot_mapping=slots)
    assert torch.isnan(q[1, :, :rot]).all() and not torch.isnan(q[1, :, rot:]).any()
    assert not torch.isnan(q[[0, 2, 3, 4]]).any()
    named = torch.zeros(16, dtype=torch.bool)
    named[[0, 2, 3, 4]] = True
    for c in (kc, vc):
        flat = c.reshape(16, -1).cpu()
        assert not torch.isnan(flat[named]).any() and torch.isnan(flat[~named]).all()
    args = dict(impl=impl, k_cache=kc, v_cache=vc)
    before = kc.clone()
    with ropekit.strict(), pytest.raises(ValueError, match=r"rope_qkv_projection: slot_mapping: expected values < 16"):
        call(x, w, pos, table, None, None, hq, hk, d, rot, False, slot_mapping=slots, **args)
    with ropekit.strict(), pytest.raises(ValueError, match=r"rope_qkv_projection: slot_mapping: .*slot"):
        call(x, w, pos, table, None, None, hq, hk, d, rot, False, slot_mapping=slots.clamp(max=2), **args)
    assert torch.equal(kc.nan_to_num(), before.nan_to_num())


def test_kv_cache_under_compile(poison, device):
    """The fused cache write as ropekit::qkv_rope_store (mutating the caches) under fullgraph,
    dynamic compilation: two token counts, one graph, against the oracle."""
    need_kernel(device)
    hidden, hq, hk, d, rot = 32, 2, 1, 16, 16

    def f(x, w, pos, table, kc, vc, slots):
        return call(x, w, pos, table, None, None, hq, hk, d, rot, False, k_cache=kc, v_cache=vc, slot_mapping=slots)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    torch._dynamo.reset()
    for i, T in enumerate((6, 9)):
        x, w, pos, table, _, _ = inputs(T, hidden, hq, hk, d, rot, device=device, seed=T)
        kc, vc = caches("paged", hk, d, device)
        slots = torch.randperm(16)[:T].to(device)
        want = cache_reference(x, w, pos, table, hq, hk, d, rot, False, None, None, kc, vc, slots)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            q = compiled(x, w, pos, table, kc, vc, slots)
        assert rel_err(q, want[0]) < 2e-6
        same_with_nan(kc, want[1], 2e-6)
        same_with_nan(vc, want[2], 2e-6)


def test_kv_cache_opcheck():
    need_kernel("cpu")
    T, hidden, hq, hk, d, rot = 5, 32, 2, 1, 16, 16
    x, w, pos, table, wq, _ = inputs(T, hidden, hq, hk, d, rot, norm="q")
    kc, vc = torch.zeros(4, 2, hk, d), torch.zeros(8, hk, d)[:, :, :].view(4, 2, hk, d)
    slots = torch.tensor([1, 0, 7, -1, 4])
    args = (x, w, pos, table, wq, None, kc, vc, slots, [hq, hk, d, rot, 0], 1e-6)
    torch.library.opcheck(torch.ops.ropekit.qkv_rope_store.default, args)


def _bad(**changes):
    T, hidden, hq, hk, d = 4, 32, 2, 1, 16
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, 16, norm="qk")
    args = dict(
        x=x, weight=w, positions=pos, cos_sin_cache=cache, num_q_heads=hq, num_kv_heads=hk, head_dim=d,
        rotary_dim=None, interleaved=False, q_norm_weight=wq, k_norm_weight=wk, norm_eps=1e-6, impl="fused",
    )  # fmt: skip
    for key, fn in changes.items():
        args[key] = fn(args[key]) if callable(fn) else fn
    return args


BAD = [
    ("x", TypeError, "x: expected a torch.Tensor", dict(x=lambda x: x.tolist())),
    ("x", ValueError, "x: expected a 2-D or 3-D tensor", dict(x=lambda x: x[0])),
    ("x", ValueError, "x: expected dtype in", dict(x=lambda x: x.double())),
    ("weight", ValueError, "weight: expected dtype float32 (x's), got bfloat16", dict(weight=lambda w: w.bfloat16())),
    ("weight", ValueError, "weight: expected shape (64, 32)", dict(weight=lambda w: w.t())),
    ("weight", ValueError, "weight: expected shape (96, 32)", dict(num_kv_heads=2)),
    (
        "positions",
        ValueError,
        "positions: expected dtype in (int32, int64), got float32",
        dict(positions=lambda p: p.float()),
    ),
    ("positions", ValueError, "positions: expected shape (4,)", dict(positions=lambda p: p[:3])),
    ("positions", ValueError, "positions: expected a 1-D tensor", dict(positions=lambda p: p[None])),
    ("cos_sin_cache", ValueError, "cos_sin_cache: expected a 2-D tensor", dict(cos_sin_cache=lambda c: c[0])),
    (
        "cos_sin_cache",
        ValueError,
        "cos_sin_cache: expected stride 1",
        dict(cos_sin_cache=lambda c: c.t().contiguous().t()),
    ),
    ("cos_sin_cache", ValueError, "cos_sin_cache: expected width 8 (rotary_dim)", dict(rotary_dim=8)),
    ("rotary_dim", ValueError, "rotary_dim: expected an even int in [2, head_dim=16], got 15", dict(rotary_dim=15)),
    ("rotary_dim", ValueError, "rotary_dim: expected an even int in [2, head_dim=16], got 18", dict(rotary_dim=18)),
    ("rotary_dim", ValueError, "rotary_dim: expected an int or None, got 16.0", dict(rotary_dim=16.0)),
    ("num_q_heads", ValueError, "num_q_heads: expected an int >= 1, got 0", dict(num_q_heads=0)),
    ("num_kv_heads", ValueError, "num_kv_heads: expected an int >= 1, got 1.5", dict(num_kv_heads=1.5)),
    ("head_dim", ValueError, "head_dim: expected an int >= 1, got -16", dict(head_dim=-16)),
    ("interleaved", TypeError, "interleaved: expected a bool, got int", dict(interleaved=1)),
    ("q_norm_weight", ValueError, "q_norm_weight: expected shape (16,)", dict(q_norm_weight=lambda t: t[:8])),
    ("k_norm_weight", ValueError, "k_norm_weight: expected a 1-D tensor", dict(k_norm_weight=lambda t: t[None])),
    ("k_norm_weight", ValueError, "k_norm_weight: expected dtype in", dict(k_norm_weight=lambda t: t.long())),
    ("norm_eps", ValueError, "norm_eps: expected a number >= 0, got -1.0", dict(norm_eps=-1.0)),
    ("impl", ValueError, "impl: expected one of 'auto', 'fused', 'unfused', got 'triton'", dict(impl="triton")),
]


@pytest.mark.parametrize("name,exc,message,changes", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs(name, exc, message, changes):
    args = _bad(**changes)
    with pytest.raises(exc) as info:
        ropekit.rope_qkv_projection(**args)
    text = str(info.value)
    assert text.startswith(f"rope_qkv_projection: {name}: "), text
    assert message in text, text


def test_bad_device_is_named():
    args = _bad(positions=lambda p: p.to("meta"))
    with pytest.raises(ValueError, match="rope_qkv_projection: positions: expected a tensor on cpu"):
        ropekit.rope_qkv_projection(**args)


def test_fused_needs_triton_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = _bad()
    if torch.cuda.is_available() and args["x"].is_cuda:
        pytest.skip("CPU tensors only")
    with pytest.raises(ValueError, match="rope_qkv_projection: impl: expected 'auto' or 'unfused' for CPU tensors"):
        ropekit.rope_qkv_projection(**args)
    args["impl"] = "unfused"  # the CPU path of apply_rope
    q, k, v = ropekit.rope_qkv_projection(**args)
    want = reference(args["x"], args["weight"], args["positions"], args["cos_sin_cache"], 2, 1, 16, 16, False,
                     args["q_norm_weight"], args["k_norm_weight"])  # fmt: skip
    assert rel_err(q, want[0]) < 2e-6


# ---------------------------------------------------------------------------------------------
# CUDA: bf16 at larger shapes (the tiles the GPU runs: two heads per program, 128-row blocks)

GPU_CASES = [
    # T, hidden, Hq, Hk, D, rot, interleaved, norm
    (1000, 1024, 8, 2, 128, 128, False, None),  # Llama-like
    (777, 1024, 8, 2, 128, 128, False, "qk"),  # Qwen3-like
    (513, 512, 6, 2, 128, 64, True, None),  # partial, interleaved
    (300, 768, 5, 1, 64, 64, False, "qk"),  # odd head counts: one head per program
    (257, 512, 4, 2, 80, 80, False, None),  # head size 80
]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["pointer", "tma", "packed"], ids=["pointers", "tma", "packed"])
@pytest.mark.parametrize(
    "case", GPU_CASES, ids=[f"T{c[0]}-{c[2]}x{c[4]}-r{c[5]}-il{int(c[6])}-{c[7]}" for c in GPU_CASES]
)
def test_gpu_bf16_forward_backward(case, path, poison, monkeypatch):
    """Each path at the GPU tiles (a shape a path cannot hold takes the pointer path's)."""
    monkeypatch.setattr(qkv_gemm, "PATH", path)
    T, hidden, hq, hk, d, rot, interleaved, norm = case
    x, w, pos, cache, wq, wk = inputs(
        T, hidden, hq, hk, d, rot, dtype=torch.bfloat16, norm=norm, device="cuda", grad=True
    )
    outs = call(x, w, pos, cache, wq, wk, hq, hk, d, rot, interleaved, impl="fused")
    refs = reference(x, w, pos, cache, hq, hk, d, rot, interleaved, wq, wk)
    for o, r in zip(outs, refs):
        assert o.dtype == torch.bfloat16 and rel_err(o, r) < 8e-3
    unfused = call(x, w, pos, cache, wq, wk, hq, hk, d, rot, interleaved, impl="unfused")
    for a, b in zip(outs, unfused):
        assert rel_err(a, b) < 1e-2
    leaves = [t for t in (x, w, wq, wk) if t is not None]
    grads = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, leaves, grads)
    want = torch.autograd.grad(refs, leaves, [g.double() for g in grads])
    for a, b in zip(got, want):
        assert rel_err(a, b) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("norm", [None, "qk"])
def test_gpu_packed_path_runs(interleaved, norm, poison, monkeypatch):
    """The packed path at its default GPU tile (G 2, 128 x 256 x 64) where it applies, forward and
    backward against the oracle; the launch must pack the weight (no silent fallback)."""
    monkeypatch.setattr(qkv_gemm, "PATH", "packed")
    calls = spy_packing(monkeypatch)
    T, hidden, hq, hk, d = 1000, 1024, 8, 2, 128
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, d, dtype=torch.bfloat16, norm=norm, device="cuda")
    if not qkv_gemm.packed_ok(x, d, d, 2):
        pytest.skip("no TMA on this card")
    leaves = [t.requires_grad_(True) for t in (x, w, wq, wk) if t is not None]
    outs = call(x, w, pos, cache, wq, wk, hq, hk, d, d, interleaved, impl="fused")
    refs = reference(x, w, pos, cache, hq, hk, d, d, interleaved, wq, wk)
    for o, r in zip(outs, refs):
        assert rel_err(o, r) < 8e-3
    grads = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, leaves, grads)
    want = torch.autograd.grad(refs, leaves, [g.double() for g in grads])
    for a, b in zip(got, want):
        assert rel_err(a, b) < 2e-2
    assert calls


@pytest.mark.gpu
def test_gpu_fp32_is_ieee(poison):
    T, hidden, hq, hk, d, rot = 300, 512, 4, 2, 128, 128
    x, w, pos, cache, wq, wk = inputs(T, hidden, hq, hk, d, rot, norm="qk", device="cuda")
    outs = call(x, w, pos, cache, wq, wk, hq, hk, d, rot, False)
    refs = reference(x, w, pos, cache, hq, hk, d, rot, False, wq, wk)
    for o, r in zip(outs, refs):
        assert rel_err(o, r) < 1e-5


@pytest.mark.gpu
def test_gpu_auto_follows_the_table(monkeypatch):
    called = []
    real = qkv_gemm.qkv_rope_gemm  # the op imports it from the kernel module on each launch
    monkeypatch.setattr(qkv_gemm, "qkv_rope_gemm", lambda *a, **k: called.append(1) or real(*a, **k))
    T, hidden, hq, hk, d = 4096, 256, 4, 2, 64
    x, w, pos, cache, _, _ = inputs(T, hidden, hq, hk, d, d, dtype=torch.bfloat16, device="cuda")
    call(x, w, pos, cache, None, None, hq, hk, d, d, False, impl="auto")
    assert not called  # not in the table: unfused
    key = (qkv_api.device_kind(x.device), qkv_api.shape_class(T, hidden, hq, hk, d, False, False))
    monkeypatch.setitem(qkv_api.AUTO_TABLE, key, "fused")
    call(x, w, pos, cache, None, None, hq, hk, d, d, False, impl="auto")
    assert called


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["pointer", "tma", "packed"], ids=["pointers", "tma", "packed"])
@pytest.mark.parametrize(
    "case", GPU_CASES, ids=[f"T{c[0]}-{c[2]}x{c[4]}-r{c[5]}-il{int(c[6])}-{c[7]}" for c in GPU_CASES]
)
def test_gpu_bf16_kv_cache(case, path, poison, monkeypatch):
    """The paged-cache write at the GPU tiles (G = 2 where the heads allow, the TMA and packed
    paths), bf16, against the oracle's store, a NaN-poisoned cache of more slots than tokens."""
    monkeypatch.setattr(qkv_gemm, "PATH", path)
    T, hidden, hq, hk, d, rot, interleaved, norm = case
    x, w, pos, table, wq, wk = inputs(T, hidden, hq, hk, d, rot, dtype=torch.bfloat16, norm=norm, device="cuda")
    block = 16
    n_blocks = (2 * T + block - 1) // block
    kc = torch.full((n_blocks, block, hk, d), NAN, device="cuda", dtype=torch.bfloat16)
    vc = torch.full_like(kc, NAN)
    slots = torch.randperm(n_blocks * block, device="cuda")[:T]
    slots[::7] = -1
    want = cache_reference(x, w, pos, table, hq, hk, d, rot, interleaved, wq, wk, kc, vc, slots)
    with torch.no_grad():
        q = call(x, w, pos, table, wq, wk, hq, hk, d, rot, interleaved, k_cache=kc, v_cache=vc, slot_mapping=slots)
    assert rel_err(q, want[0]) < 8e-3
    same_with_nan(kc, want[1], 8e-3)
    same_with_nan(vc, want[2], 8e-3)
