"""apply_rope_and_store's angle sources and its QK-RMSNorm: fields of the one spec's Variant.

    cu_seqlens=, cp_size=, cp_rank=     packed sequences (THD): positions derived in the kernel
    mrope_section=, mrope_interleaved=  M-RoPE: positions (N, *T) (mrope_layout=: the rows' order)
    q_norm_weight=, k_norm_weight=      RMSNorm of q / k first, per head (D,) or across heads (H*D,)

Each alone and composed (with each other, fp8 caches, q_out, write_key, torch.compile) against the
float64 oracle (ropekit.tools.reference; packed positions from ropekit.positions_from_cu_seqlens), on
caches poisoned with NaN whose untouched elements must keep their bits (test_store.check_store).
Bad inputs are refused by name before anything is written; the eager call's host path is one
memo lookup (no second validation or launch plan).
"""

from __future__ import annotations

import pytest
import torch
from test_store import (
    INTERPRETED,
    NAN,
    Caches,
    bits,
    check_store,
    flat,
    fp8_values,
    hnd,
    inputs,
    nhd,
    shuffled_slots,
)
from test_store import good as store_good

import ropekit
from ropekit.api.store import apply_rope_and_store
from ropekit.core import checks, plans, strict, tuning
from ropekit.tools import reference

from conftest import make_cache

E4M3 = torch.float8_e4m3fn


@pytest.fixture(params=[False, True], ids=["block-programs", "token-programs"])
def programs(request):
    """The store kernel's two grids (a program per head block, or per token): tests force each."""
    with tuning.override(store_head_loop=request.param):
        yield request.param


def weight(n, seed, dtype=torch.float32, device="cpu"):
    """A norm weight of n values around 1."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) + 0.5).to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# packed sequences


# (cu_seqlens, cp_size, cp_rank, tokens): the last case has a padding token past cu_seqlens[-1]
PACKED = {
    "two-seqs": ((0, 3, 7), 1, 0, 7),
    "empty-seq-and-padding": ((0, 2, 2, 6), 1, 0, 7),
    "cp2-rank1": ((0, 2, 6), 2, 1, 6),
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("case", list(PACKED))
def test_packed(device, case, interleaved, programs):
    cu, cp_size, cp_rank, T = PACKED[case]
    q, k, v, _, table = inputs(T, 4, 2, 64, 64, 64, 64, torch.float32, device)
    caches = Caches(hnd, 3, 4, 2, 64, 64, torch.float32, device)
    cu = torch.tensor(cu, dtype=torch.int32, device=device)
    want_pos = ropekit.positions_from_cu_seqlens(cu.cpu(), cp_size=cp_size, cp_rank=cp_rank, total_tokens=T)
    slots = shuffled_slots(T, caches.num_slots, device)
    extra = dict(cp_size=cp_size, cp_rank=cp_rank) if cp_size > 1 else {}
    check_store(
        q, k, v, None, table, caches, slots, interleaved=interleaved, oracle_positions=want_pos, cu_seqlens=cu, **extra
    )


def test_packed_many_sequences_two_level_search(device):
    """More sequences than one search block holds: the kernel's two-level search over cu_seqlens."""
    lengths = [0, 1, 3, 0, 2, 1, 1, 0, 2, 1, 2]  # 11 sequences: search blocks of 4
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=device)
    T = int(cu[-1])
    q, k, v, _, table = inputs(T, 2, 1, 32, 32, 32, 32, torch.float32, device)
    caches = Caches(flat, 4, 8, 1, 32, 32, torch.float32, device)
    want_pos = ropekit.positions_from_cu_seqlens(cu.cpu())
    check_store(q, k, v, None, table, caches, shuffled_slots(T, 32, device), oracle_positions=want_pos, cu_seqlens=cu)


# ---------------------------------------------------------------------------------------------
# M-RoPE


@pytest.mark.parametrize("token_shape", [(6,), (2, 3)], ids=["thd", "bshd"])
@pytest.mark.parametrize("il_sections", [False, True], ids=["chunked", "interleaved"])
def test_mrope(device, il_sections, token_shape, programs):
    T = 6
    q, k, v, _, table = inputs(T, 4, 2, 64, 64, 64, 32, torch.float32, device, token_shape=token_shape)
    caches = Caches(nhd, 3, 4, 2, 64, 64, torch.float32, device)
    pos = torch.randint(0, 64, (3, *token_shape), device=device)
    slots = shuffled_slots(T, caches.num_slots, device).view(token_shape)
    check_store(
        q, k, v, pos, table, caches, slots, mrope_section=(6, 5, 5), mrope_interleaved=il_sections
    )  # rotary 32 of 64: the tails stay


@pytest.mark.parametrize(
    "sections, layout",
    [((16,), "chunked"), ((6, 10), "pangu"), ((4, 4, 4, 4), "ernie"), ((4, 6, 6), "bailing"), ((8, 8), [1, 0] * 8)],
    ids=["n1", "n2-pangu", "n4-ernie", "n3-bailing", "n2-map"],
)
def test_mrope_layouts(device, sections, layout):
    """N position rows laid over the pairs by mrope_layout, plain and with the fused norm."""
    T = 4
    q, k, v, _, table = inputs(T, 2, 1, 32, 32, 32, 32, torch.float32, device)
    caches = Caches(nhd, 2, 4, 1, 32, 32, torch.float32, device)
    pos = torch.randint(0, 64, (len(sections), T), device=device)
    slots = shuffled_slots(T, caches.num_slots, device)
    check_store(q, k, v, pos, table, caches, slots, mrope_section=sections, mrope_layout=layout)
    q, k, v, _, table = inputs(T, 2, 1, 32, 32, 32, 32, torch.float32, device)
    caches = Caches(nhd, 2, 4, 1, 32, 32, torch.float32, device)
    norm = dict(q_norm_weight=torch.rand(32, device=device) + 0.5, k_norm_weight=torch.rand(32, device=device) + 0.5)
    check_store(q, k, v, pos, table, caches, slots, mrope_section=sections, mrope_layout=layout, **norm)


def test_mrope_bad_position_row_is_nan_in_its_section_only(device):
    """A bad position in the h row poisons only the h section's frequencies of that token."""
    q, k, v, _, table = inputs(3, 2, 1, 32, 32, 32, 32, torch.float32, device, max_pos=16)
    caches = Caches(flat, 1, 4, 1, 32, 32, torch.float32, device)
    pos = torch.tensor([[1, 2, 3], [4, 99, 6], [7, 8, 9]], device=device)
    apply_rope_and_store(
        q, k, v, pos, table, caches.k, caches.v, torch.arange(3, device=device), mrope_section=(8, 4, 4)
    )
    bad = torch.isnan(q[1].cpu())
    assert bad[:, 8:12].all() and bad[:, 24:28].all(), "the h section of both halves"
    assert bad.sum() == 2 * 2 * 4, "nothing else of token 1"
    assert not torch.isnan(q[[0, 2]]).any()


# ---------------------------------------------------------------------------------------------
# the norm, alone and composed


@pytest.mark.parametrize("angles", ["positions", "packed", "mrope"], ids=["positions", "packed", "mrope"])
@pytest.mark.parametrize("across", [False, True], ids=["per-head", "across-heads"])
def test_norm_composes_with_angle_sources(device, across, angles, programs):
    T, Hq, Hk, D, rot = 6, 4, 2, 64, 32
    q, k, v, pos, table = inputs(T, Hq, Hk, D, D, D, rot, torch.float32, device)
    caches = Caches(nhd, 3, 4, Hk, D, D, torch.float32, device)
    kw = dict(
        q_norm_weight=weight(Hq * D if across else D, 1, device=device),
        k_norm_weight=weight(Hk * D if across else D, 2, device=device),
        norm_eps=1e-5,
        norm_weight_offset=0.5,
    )
    oracle_pos = None
    if angles == "packed":
        cu = torch.tensor([0, 4, 6], device=device)
        kw["cu_seqlens"], pos, oracle_pos = cu, None, ropekit.positions_from_cu_seqlens(cu.cpu())
    elif angles == "mrope":
        pos = torch.randint(0, 64, (3, T), device=device)
        kw["mrope_section"] = (8, 4, 4)
    check_store(
        q, k, v, pos, table, caches, shuffled_slots(T, caches.num_slots, device), oracle_positions=oracle_pos, **kw
    )


def test_norm_packed_q_out_and_write_key(device):
    """q normalized into q_out (bf16), k normalized back into k (its tail too), packed, k only across heads."""
    T, Hq, Hk, D, rot = 5, 2, 2, 64, 32
    q, k, v, _, table = inputs(T, Hq, Hk, D, D, D, rot, torch.float32, device)
    k = k.contiguous()
    cu = torch.tensor([0, 2, 5], device=device)
    pos = ropekit.positions_from_cu_seqlens(cu.cpu())
    wq, wk = weight(D, 3, device=device), weight(Hk * D, 4, device=device)
    kc, vc = (torch.full((8, Hk, D), NAN, device=device) for _ in range(2))
    q_out = torch.full((T, Hq, D), NAN, dtype=torch.bfloat16, device=device)
    slots = torch.tensor([6, 0, -1, 3, 1], device=device)
    rq, rk = reference.rms_norm_rope(
        q.double().cpu(), k.double().cpu(), pos, table.double().cpu(), q_norm_weight=wq.double().cpu(),
        k_norm_weight=wk.double().cpu(),
    )  # fmt: skip
    q0 = q.clone()
    out = apply_rope_and_store(
        q, k, v, None, table, kc, vc, slots, cu_seqlens=cu, q_norm_weight=wq, k_norm_weight=wk, q_out=q_out,
        write_key=True,
    )  # fmt: skip
    assert out is q_out and torch.equal(bits(q), bits(q0)), "q is only read with q_out"
    torch.testing.assert_close(q_out.double().cpu(), rq, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(k.double().cpu(), rk, rtol=1e-5, atol=1e-5)
    keep = slots.cpu() >= 0
    torch.testing.assert_close(kc[slots[keep]].double().cpu(), rk[keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(vc[slots[keep]], v[keep.to(device)])
    unused = torch.ones(8, dtype=torch.bool)
    unused[slots[keep].cpu()] = False
    assert torch.isnan(kc.cpu()[unused]).all() and torch.isnan(vc.cpu()[unused]).all()


def test_packed_fp8_cache_exact(device):
    """Packed sequences of one token each (every position 0: cos 1, sin 0) into an e4m3 cache with
    a power-of-two scale: every stored byte is exact, in the interpreter too."""
    T, H, D = 4, 2, 32
    k, v = fp8_values((T, H, D), 2.0, device), fp8_values((T, H, D), 0.5, device)
    q = torch.randn(T, H, D, device=device)
    table = make_cache(8, D, device=device)
    kc, vc = (torch.full((6, H, D), NAN, device=device).to(E4M3) for _ in range(2))
    slots = torch.tensor([5, -1, 0, 2], device=device)
    cu = torch.arange(T + 1, device=device)
    apply_rope_and_store(q, k, v, None, table, kc, vc, slots, cu_seqlens=cu, k_scale=2.0, v_scale=0.5)
    keep = slots >= 0
    assert torch.equal(bits(kc[slots[keep]]), bits((k[keep] / 2).to(E4M3)))
    assert torch.equal(bits(vc[slots[keep]]), bits((v[keep] / 0.5).to(E4M3)))
    assert torch.isnan(kc[[1, 3, 4]].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("angles", ["packed", "mrope"])
def test_gpu_norm_fp8_cache(angles):
    """Random bf16 inputs, the norm across heads for k, an e4m3 cache and fp8 q_out."""
    T, Hq, Hk, D = 64, 8, 2, 128
    q = torch.randn(T, Hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(T, Hk, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(T, Hk, D, dtype=torch.bfloat16, device="cuda")
    table = make_cache(256, D, device="cuda")
    wq, wk = weight(D, 1, torch.bfloat16, "cuda"), weight(Hk * D, 2, torch.bfloat16, "cuda")
    kw = dict(q_norm_weight=wq, k_norm_weight=wk)
    if angles == "packed":
        cu = torch.tensor([0, 10, 40, 64], device="cuda")
        pos, oracle_pos, kw["cu_seqlens"] = None, ropekit.positions_from_cu_seqlens(cu.cpu()), cu
    else:
        pos = oracle_pos = torch.randint(0, 256, (3, T), device="cuda")
        kw["mrope_section"] = (24, 20, 20)
    kc, vc = (torch.zeros(128, Hk, D, device="cuda").to(E4M3) for _ in range(2))
    q_out = torch.empty(T, Hq, D, dtype=E4M3, device="cuda")
    slots = torch.randperm(128, device="cuda")[:T]
    rq, rk = reference.rms_norm_rope(
        q.double().cpu(), k.double().cpu(), oracle_pos.cpu(), table.double().cpu(), q_norm_weight=wq.double().cpu(),
        k_norm_weight=wk.double().cpu(), mrope_section=kw.get("mrope_section"),
    )  # fmt: skip
    apply_rope_and_store(q, k, v, pos, table, kc, vc, slots, k_scale=0.5, q_out=q_out, q_scale=0.25, **kw)
    torch.testing.assert_close(q_out.double().cpu() * 0.25, rq, rtol=0.07, atol=0.02)
    torch.testing.assert_close(kc[slots].double().cpu() * 0.5, rk, rtol=0.07, atol=0.02)


def test_compile_fullgraph_packed_norm(device):
    torch._dynamo.reset()
    T, D = 5, 32
    q, k, v, _, table = inputs(T, 2, 1, D, D, D, D, torch.float32, device)
    cu = torch.tensor([0, 3, 5], device=device)
    wk = weight(D, 7, device=device)
    kc, vc = (torch.full((8, 1, D), NAN, device=device) for _ in range(2))
    slots = torch.tensor([1, 2, 3, 4, 5], device=device)

    def f(q, k, v, kc, vc):
        apply_rope_and_store(q, k, v, None, table, kc, vc, slots, cu_seqlens=cu, k_norm_weight=wk)

    rq, rk = reference.rms_norm_rope(
        q.double().cpu(), k.double().cpu(), ropekit.positions_from_cu_seqlens(cu.cpu()), table.double().cpu(),
        k_norm_weight=wk.double().cpu(),
    )  # fmt: skip
    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, kc, vc)
    torch.testing.assert_close(q.double().cpu(), rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc[1:6].double().cpu(), rk, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# host path: one memo lookup, then the launch


def test_eager_repeat_call_builds_no_spec_or_plan(monkeypatch):
    T, D = 4, 32
    q, k, v, _, table = inputs(T, 2, 1, D, D, D, D, torch.float32, "cpu")
    cu, wq = torch.tensor([0, 1, 4]), weight(D, 8)
    kc, vc = torch.zeros(8, 1, D), torch.zeros(8, 1, D)
    call = lambda: apply_rope_and_store(  # noqa: E731
        q, k, v, None, table, kc, vc, torch.arange(T), cu_seqlens=cu, q_norm_weight=wq, norm_eps=1e-5
    )
    call()
    counts = {"spec": 0, "plan": 0}
    spec_fn, plan_fn = checks.store, plans.plan_store
    monkeypatch.setattr(checks, "store", lambda *a, **kw: (counts.__setitem__("spec", 1), spec_fn(*a, **kw))[1])
    monkeypatch.setattr(plans, "plan_store", lambda *a, **kw: (counts.__setitem__("plan", 1), plan_fn(*a, **kw))[1])
    call()
    assert counts == {"spec": 0, "plan": 0}
    # another eps is another signature: validated again
    apply_rope_and_store(q, k, v, None, table, kc, vc, torch.arange(T), cu_seqlens=cu, q_norm_weight=wq, norm_eps=1e-4)
    assert counts == {"spec": 1, "plan": 1}


# ---------------------------------------------------------------------------------------------
# bad inputs: refused by name, nothing written

T_, HQ_, HK_, D_ = 4, 3, 2, 64  # test_store.good()'s call, positions None


def good():
    args = store_good()
    args["positions"] = None
    return args


CU = torch.tensor([0, 1, 4])
OP = "apply_rope_and_store: "

BAD = [
    # (id, argument changes, keywords, exception, message start after the op's name)
    ("cu-with-positions", dict(positions=torch.arange(T_)), dict(cu_seqlens=CU), ValueError,
     "positions: expected None when cu_seqlens is given"),
    ("cu-with-mrope", {}, dict(cu_seqlens=CU, mrope_section=(16, 8, 8)), ValueError,
     "mrope_section: expected None with cu_seqlens"),
    ("cu-two-token-dims", dict(q=torch.randn(1, T_, HQ_, D_)), dict(cu_seqlens=CU), ValueError,
     "q: expected a (T, H, D) tensor of packed tokens when cu_seqlens is given"),
    ("cu-float", {}, dict(cu_seqlens=CU.float()), ValueError, "cu_seqlens: expected dtype"),
    ("cu-one-element", {}, dict(cu_seqlens=torch.tensor([0])), ValueError,
     "cu_seqlens: expected at least two elements"),
    ("cp-rank-past-size", {}, dict(cu_seqlens=CU, cp_size=2, cp_rank=2), ValueError,
     "cp_rank: expected an int in [0, cp_size = 2)"),
    ("cp-without-cu", {}, dict(cp_size=2), ValueError, "cu_seqlens: expected a tensor when cp_size / cp_rank"),
    ("cp-size-float", {}, dict(cu_seqlens=CU, cp_size=2.0), TypeError, "cp_size: expected an int"),
    ("mrope-1d-positions", dict(positions=torch.arange(T_)), dict(mrope_section=(16, 8, 8)), ValueError,
     "positions: expected a 2-D tensor (3, 4)"),
    ("mrope-sum", dict(positions=torch.zeros(3, T_, dtype=torch.long)), dict(mrope_section=(16, 8, 7)), ValueError,
     "mrope_section: expected sections summing to rotary_dim // 2 = 32"),
    ("mrope-interleaved-alone", dict(positions=torch.arange(T_)), dict(mrope_interleaved=True), ValueError,
     "mrope_interleaved: expected mrope_section to be given with it"),
    ("norm-weight-shape", dict(positions=torch.arange(T_)), dict(k_norm_weight=torch.ones(3 * D_)), ValueError,
     f"k_norm_weight: expected shape ({D_},) (per head) or ({HK_ * D_},) (across the {HK_} heads of k)"),
    ("norm-eps", dict(positions=torch.arange(T_)), dict(q_norm_weight=torch.ones(D_), norm_eps=-1.0), ValueError,
     "norm_eps: expected a float >= 0"),
    ("norm-weight-grad", dict(positions=torch.arange(T_)), dict(q_norm_weight=torch.ones(D_, requires_grad=True)),
     ValueError, "q_norm_weight: expected a tensor that does not require grad"),
    ("per-token-angles", dict(positions=torch.arange(T_)), dict(cos=torch.ones(T_, 32)), TypeError, "cos"),
]  # fmt: skip


@pytest.mark.parametrize("change,kw,exc,msg", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_refused_by_name_nothing_written(change, kw, exc, msg):
    args = dict(good(), **change)
    before = {n: bits(x.clone()) for n, x in args.items() if isinstance(x, torch.Tensor)}
    with pytest.raises(exc) as info:
        apply_rope_and_store(*args.values(), **kw)
    text = str(info.value)
    if exc is ValueError or "cos" not in kw:
        assert text.startswith(OP + msg), text
    else:  # per-token angles: not a keyword of the store (Python names it)
        assert "unexpected keyword argument 'cos'" in text, text
    for n, b in before.items():
        assert torch.equal(bits(args[n]), b), f"{n} written before the refusal"


def test_norm_weight_overlapping_q_is_refused():
    args = good()
    args["positions"] = torch.arange(T_)
    q0 = args["q"].clone()
    with pytest.raises(ValueError) as info:
        apply_rope_and_store(*args.values(), q_norm_weight=args["q"][0, 0])
    assert str(info.value).startswith(OP + "q_norm_weight: expected memory disjoint from q (which is written)")
    assert torch.equal(args["q"], q0)


@pytest.mark.parametrize(
    "cu,kw,msg",
    [
        ((0, 1, 3), {}, r"cu_seqlens: expected cu_seqlens\[-1\] == 4 \(the tokens of q\), got cu_seqlens\[-1\] = 3"),
        ((0, 3, 1, 4), {}, r"cu_seqlens: expected non-decreasing values"),
        ((0, 1, 4), dict(cp_size=2), r"cu_seqlens: expected even local lengths when cp_size > 1 \(cp_size = 2"),
    ],
    ids=["short", "decreasing", "odd-under-cp"],
)
def test_strict_packed_values_refused_before_writing(cu, kw, msg):
    args = good()
    q0 = args["q"].clone()
    with strict.strict():
        with pytest.raises(ValueError, match="^" + OP + msg):
            apply_rope_and_store(*args.values(), cu_seqlens=torch.tensor(cu), **kw)
    assert torch.equal(args["q"], q0) and torch.isnan(args["k_cache"]).all()


def test_strict_mrope_position_out_of_range():
    args = good()
    args["positions"] = torch.tensor([[0, 1, 2, 3], [0, 1, 16, 3], [0, 0, 0, 0]])
    q0 = args["q"].clone()
    with strict.strict():
        with pytest.raises(ValueError, match=r"positions\[1, 2\] = 16"):
            apply_rope_and_store(*args.values(), mrope_section=(16, 8, 8))
    assert torch.equal(args["q"], q0) and torch.isnan(args["k_cache"]).all()


def test_unchecked_bad_packed_values_never_read_out_of_bounds(device):
    """Without strict mode an odd-length sequence under CP is a caller error the kernel cannot
    place: its tokens get position -1, NaN rotated dims (no read outside the table); the others
    rotate. (Plain CPU tensors check cu_seqlens' values always: they are on the host.)"""
    if device == "cpu" and not INTERPRETED:
        pytest.skip("the CPU path checks cu_seqlens on the host")
    args = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in good().items()}
    args["positions"] = None
    q0 = args["q"].clone()
    cu = torch.tensor([0, 2, 3, 4], device=device)
    apply_rope_and_store(*args.values(), cu_seqlens=cu, cp_size=2, cp_rank=1)
    nan = torch.isnan(args["q"].cpu()).flatten(1)
    assert nan[2:].all() and not nan[:2].any()
    want = reference.apply_rope(
        q0.double().cpu()[:2], None, torch.tensor([1, 2]), args["cos_sin_cache"].double().cpu()
    )[0]
    torch.testing.assert_close(args["q"][:2].double().cpu(), want, rtol=1e-5, atol=1e-5)
