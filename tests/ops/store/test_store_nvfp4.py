"""apply_rope_and_store into NVFP4 caches (k_cache_scales / v_cache_scales) against the float64 oracle.

Every case poisons the caches first (code bytes 0xFF, block scales NaN), runs the op on fresh random
inputs and checks that the rows no slot names keep their poison bit for bit and that the written
rows, unpacked (reference.nvfp4_unpack), equal the oracle's quantize-dequantize of its rotated k and
of v exactly. The angles are random multiples of 90 degrees (cos, sin in {0, 1, -1}), so the rotation
is exact in any precision, and the global scales powers of two: then no quotient of the rule lands
near a rounding boundary without being on it (bf16 / fp16 values have few significant bits), and
float32 and float64 quantize alike. q is checked against the oracle as in test_store.py.
"""

import pytest
import torch

from ropekit.api.store import apply_rope_and_store
from ropekit.tools import reference

NB, BS = 3, 4  # a paged cache of 12 slots


def right_angles(max_pos, rot, device):
    """A [cos | sin] table whose angles are random multiples of 90 degrees (exact rotations)."""
    turns = torch.randint(0, 4, (max_pos, rot // 2))
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0])[turns]
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0])[turns]
    return torch.cat((cos, sin), -1).to(device)


def nvfp4_caches(H, D, device, layout="nhd"):
    """Poisoned NVFP4 cache pairs (codes, scales) for k and v: (NB, BS, H, D/2) uint8 filled with
    0xFF and (NB, BS, H, D/16) float8_e4m3fn NaN; 'hnd' gives permuted views of head-major storage,
    'flat' (NB * BS, H, ...)."""

    def alloc(width, dtype, fill):
        if layout == "hnd":
            x = torch.empty(NB, H, BS, width, dtype=torch.uint8, device=device).permute(0, 2, 1, 3)
        else:
            x = torch.empty(NB, BS, H, width, dtype=torch.uint8, device=device)
        x.fill_(fill)
        x = x.view(dtype)
        return x.flatten(0, 1) if layout == "flat" else x

    return [(alloc(D // 2, torch.uint8, 0xFF), alloc(D // 16, torch.float8_e4m3fn, 0x7F)) for _ in "kv"]


def rows_of(cache, slots):
    """The rows of the (valid) slots of a paged or flat cache."""
    if cache.dim() == 4:
        return cache[slots // cache.shape[1], slots % cache.shape[1]]
    return cache[slots]


def check_nvfp4(q, k, v, pos, table, caches, slots, *, k_scale=None, v_scale=None, interleaved=False, **kw):
    """Run the op into the poisoned caches and compare every cache element and q with the oracle."""
    (kd, ksf), (vd, vsf) = caches
    before = [x.clone() for x in (kd, ksf.view(torch.uint8), vd, vsf.view(torch.uint8))]
    q_rot, k_rot = reference.rms_norm_rope(
        q.double(), k.double(), pos, table.double(), interleaved=interleaved, rotary_dim=kw.get("rotary_dim")
    )
    apply_rope_and_store(
        q,
        k,
        v,
        pos,
        table,
        kd,
        vd,
        slots,
        interleaved=interleaved,
        k_scale=k_scale,
        v_scale=v_scale,
        k_cache_scales=ksf,
        v_cache_scales=vsf,
        **kw,
    )
    num_slots = kd.shape[:-2].numel()
    keep = (slots >= 0) & (slots < num_slots)
    written = slots[keep].long()
    q_rot[slots >= num_slots, :, : table.shape[-1]] = float("nan")  # a slot past the cache flags q
    for (data, sf, old_data, old_sf), x, g in (
        ((kd, ksf, before[0], before[1]), k_rot, k_scale),
        ((vd, vsf, before[2], before[3]), v, v_scale),
    ):
        # the global scale the op uses: float32 (a Python float is rounded to it)
        g = 1.0 if g is None else float(torch.as_tensor(g, dtype=torch.float32).reshape(()))
        vals, scales = reference.nvfp4_quantize(x[keep].double(), g)
        want = reference.nvfp4_dequantize(vals, scales, g)
        got = reference.nvfp4_unpack(rows_of(data, written).cpu(), rows_of(sf, written).cpu(), g)
        assert torch.equal(got.isnan(), want.cpu().isnan()), "NaN where the oracle has none (or the reverse)"
        assert torch.equal(got.nan_to_num(), want.cpu().nan_to_num()), (got - want.cpu()).abs().max()
        # every row no slot names keeps its poison, bit for bit
        untouched = torch.ones(data.shape[:-2].numel(), dtype=torch.bool, device=data.device)
        untouched[written] = False
        shape = (-1, *data.shape[-2:])
        assert torch.equal(data.reshape(shape)[untouched], old_data.reshape(shape)[untouched])
        shape = (-1, *sf.shape[-2:])
        assert torch.equal(sf.view(torch.uint8).reshape(shape)[untouched], old_sf.reshape(shape)[untouched])
    torch.testing.assert_close(q.double(), q_rot.to(q.dtype).double(), rtol=0, atol=0, equal_nan=True)


def make(T, Hq, Hk, D, rot, dtype, device, max_pos=16):
    q = torch.randn(T, Hq, D, dtype=dtype, device=device)
    k = torch.randn(T, Hk, D, dtype=dtype, device=device) * 4
    v = torch.randn(Hk, T, D, dtype=dtype, device=device).movedim(0, 1)  # a strided v
    pos = torch.randint(0, max_pos, (T,), device=device)
    return q, k, v, pos, right_angles(max_pos, rot, device)


@pytest.fixture(params=[False, True], ids=["block-programs", "token-programs"])
def programs(request):
    """The store kernel's two grids (a program per head block, or one per token walking its
    blocks): the launcher picks by call size, tests force each."""
    from ropekit.core import tuning

    with tuning.override(store_head_loop=request.param):
        yield request.param


def slots_of(T, device, n_pad=1):
    s = torch.randperm(NB * BS)[:T]
    s[-n_pad:] = -1
    return s.to(device)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("layout", ["nhd", "hnd", "flat"])
def test_random_rows(device, interleaved, layout, programs):
    q, k, v, pos, table = make(5, 4, 2, 32, 32, torch.bfloat16, device)
    caches = nvfp4_caches(2, 32, device, layout)
    g = torch.tensor([0.25], device=device)
    check_nvfp4(q, k, v, pos, table, caches, slots_of(5, device), k_scale=g, v_scale=2.0, interleaved=interleaved)


@pytest.mark.parametrize(
    "interleaved, D, rot", [(False, 64, 32), (False, 128, 96), (True, 64, 32), (True, 64, 48)], ids=str
)
def test_partial_rotary_tail(device, interleaved, D, rot, programs):
    """A partial rotary_dim: the tail's blocks are quantized after the rotated ones; 96 and 48 leave
    padding lanes in the pair tiles (whole padding blocks, never stored)."""
    q, k, v, pos, table = make(3, 2, 1, D, rot, torch.float16, device)
    caches = nvfp4_caches(1, D, device)
    check_nvfp4(q, k, v, pos, table, caches, slots_of(3, device), interleaved=interleaved, rotary_dim=rot)


def test_ties_saturation_and_zero_blocks(device):
    """Rows built to hit every rounding tie (to even), values past 6 x scale, block scales past 448
    and below e4m3's normal range, and blocks of zeros; position 0 (no rotation) for k."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    row = torch.cat(
        (
            torch.cat((ties, -ties)),  # scale 1 with g 1: every tie
            torch.cat((ties, -ties)) * 1024,  # amax 6144: scale 1024 saturates to 448, values to 6
            torch.zeros(16),  # a zero block: scale 0, codes 0
            torch.cat((ties, -ties)) * 2**-10,  # a scale below 2^-6 (e4m3 subnormal)
        )
    )
    T, H, D = 3, 2, 64
    x = row.expand(T, H, D).clone()
    x[1] *= -1
    x[2, 1] = torch.linspace(-7, 7, D)  # values between the ties
    q = torch.randn(T, 1, D, device=device)
    k, v = x.to(device), (x * 0.5).to(device)
    pos = torch.zeros(T, dtype=torch.long, device=device)
    table = right_angles(4, D, device)
    caches = nvfp4_caches(H, D, device)
    check_nvfp4(q, k, v, pos, table, caches, torch.tensor([5, 0, 11], device=device), v_scale=0.5)


def boundary_rows(g: float, D: int = 64) -> torch.Tensor:
    """A float32 row of D values in blocks of 16, each block led by the value that makes its scale
    exactly 1 under global scale g (amax = 6 g), then the float32 neighbours of every e2m1 decision
    boundary b * g (the largest float below, the nearest float, the smallest above); the second
    half is the first negated."""
    g32 = float(torch.tensor(g, dtype=torch.float32))
    lead = torch.tensor(6 * g32, dtype=torch.float32)
    vals = []
    for b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        near = torch.tensor(b * g32, dtype=torch.float64).float()
        vals += [torch.nextafter(near, torch.tensor(0.0)), near, torch.nextafter(near, torch.tensor(9.0))]
    body = torch.zeros(D // 32, 15)
    body.view(-1)[: len(vals)] = torch.stack(vals)
    half = torch.cat((lead.expand(D // 32, 1), body), -1).reshape(-1)
    return torch.cat((half, -half))


def test_boundary_neighbours_any_global_scale(device):
    """Values an ulp either side of every e2m1 decision boundary (and on it where it is a float32),
    with global scales that are not powers of two: each code is the float64 oracle's exactly (the
    codes come from exact comparisons, not from a rounded quotient)."""
    T, H, D = 2, 2, 64
    k = boundary_rows(0.3, D).expand(T, H, D).clone().to(device)
    v = boundary_rows(0.07, D).expand(T, H, D).clone().to(device)
    q = torch.randn(T, 1, D, device=device)
    pos = torch.zeros(T, dtype=torch.long, device=device)
    table = torch.cat((torch.ones(1, D // 2), torch.zeros(1, D // 2)), -1).to(device)  # angle 0: k as given
    caches = nvfp4_caches(H, D, device)
    check_nvfp4(q, k, v, pos, table, caches, torch.tensor([1, 6], device=device), k_scale=0.3, v_scale=0.07)


def test_nan_row_on_bad_position(device):
    """A position past the table makes k's rotated dims NaN: their blocks' scales are NaN (the
    values unpack to NaN), the tail's and v's blocks are finite."""
    q, k, v, pos, table = make(2, 1, 1, 32, 16, torch.bfloat16, device)
    pos[0] = 99
    caches = nvfp4_caches(1, 32, device)
    check_nvfp4(q, k, v, pos, table, caches, torch.tensor([3, 7], device=device), interleaved=True, rotary_dim=16)
    assert caches[0][1][0, 3, 0, 0].float().isnan() and not caches[0][1][0, 3, 0, 1].float().isnan()


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_both_cpu_paths(monkeypatch, path):
    """CPU tensors run the kernel under TRITON_INTERPRET=1 (its launches counted), the PyTorch path
    (ropekit.core.cpu.nvfp4_rows) otherwise: the same rows either way, a slot past the cache, a bad
    position and the rounding edge cases included."""
    from ropekit.core import checks, memo, pipeline

    fired = []
    real_launch = pipeline.launch
    monkeypatch.setattr(pipeline, "launch", lambda *a, **kw: (fired.append(1), real_launch(*a, **kw)))
    monkeypatch.setattr(checks, "triton_runs", lambda x: path == "kernel")
    memo.clear()
    try:
        for layout, interleaved, rot in (("nhd", False, 32), ("flat", True, 16), ("hnd", False, 64)):
            q, k, v, pos, table = make(4, 2, 2, 64, rot, torch.bfloat16, "cpu")
            pos[1] = 99
            slots = torch.tensor([2, 5, 50, -1])
            kw = dict(k_scale=0.5, v_scale=torch.tensor(4.0), interleaved=interleaved, rotary_dim=rot)
            check_nvfp4(q, k, v, pos, table, nvfp4_caches(2, 64, "cpu", layout), slots, **kw)
            assert q[2, :, :rot].isnan().all()  # the slot past the cache flags its token's q
        test_ties_saturation_and_zero_blocks("cpu")  # every tie, saturation, e4m3 subnormal scales
        test_boundary_neighbours_any_global_scale("cpu")  # an ulp either side of every boundary
    finally:
        memo.clear()
    assert bool(fired) == (path == "kernel")


def test_bench_row_check_and_bytes(monkeypatch):
    """W7-NVFP4's ropekit call passes its float64 check (the oracle's quantize-dequantize, on the
    pure-PyTorch CPU path as the bench's CPU mode runs); its bytes count the packed rows (half a byte
    a value, a scale byte per 16 values); other peers are n/a."""
    from test_bench import ropekit_row_passes

    from ropekit.tools.bench import peers, workloads

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = workloads.BY_ID["W7-NVFP4"]
    base = ropekit_row_passes(w, dict(w.sizes(True), T=16))
    nb = lambda x: x.numel() * x.element_size()  # noqa: E731
    q, k, v = base["q"], base["k"], base["v"]
    packed = (k.numel() + v.numel()) // 2 + (k.numel() + v.numel()) // 16
    assert nb(base["k_cache"]) + nb(base["k_cache_scales"]) == base["k_cache"].numel() * 18 // 16
    assert workloads.min_bytes(w, base) == 2 * nb(q) + nb(k) + nb(v) + packed
    with pytest.raises(peers.PeerSkip):
        peers.forms_only_ropekit(peers.RopekitUnfused(), w)


def test_k_nope_and_write_key(device):
    """GQA's key in two parts (k the rope part, k_nope beside v) with write_key: each k cache row
    is [rotated k | k_nope] quantized as one row; k receives rotated k unquantized."""
    T, H, R, N = 3, 2, 32, 32
    q, k, v, pos, table = make(T, 2, H, R, R, torch.bfloat16, device)
    v = torch.randn(T, H, R + N, dtype=torch.bfloat16, device=device)
    k_nope = torch.randn(T, H, N + 8, dtype=torch.bfloat16, device=device)[..., 8:]  # a strided part
    (kd, ksf), (vd, vsf) = nvfp4_caches(H, R + N, device)
    _, k_rot = reference.rms_norm_rope(q.double(), k.double(), pos, table.double())
    slots = torch.tensor([4, -1, 9], device=device)
    apply_rope_and_store(
        q, k, v, pos, table, kd, vd, slots, k_nope=k_nope, write_key=True, k_cache_scales=ksf, v_cache_scales=vsf
    )
    assert torch.equal(k.double(), k_rot.to(torch.bfloat16).double())
    rows = torch.tensor([0, 2], device=device)
    for data, sf, x in ((kd, ksf, torch.cat((k_rot, k_nope.double()), -1)), (vd, vsf, v.double())):
        want = reference.nvfp4_dequantize(*reference.nvfp4_quantize(x[rows]))
        got = reference.nvfp4_unpack(rows_of(data, slots[rows].long()), rows_of(sf, slots[rows].long()))
        assert torch.equal(got.cpu(), want.cpu())


def test_real_angles_any_global_scale(device):
    """A table of real angles and global scales that are not powers of two: the float32 rotation
    and quotients differ from float64 by an ulp, so a value within an ulp of a rounding boundary
    may land one code step from the oracle's; all others (nearly all) are equal."""
    from conftest import make_cache

    T, H, D = 8, 4, 64
    q, k, v = (torch.randn(T, H, D, dtype=torch.bfloat16, device=device) for _ in range(3))
    pos = torch.randint(0, 64, (T,), device=device)
    table = make_cache(64, D, device=device)
    (kd, ksf), (vd, vsf) = nvfp4_caches(H, D, device)
    slots = torch.randperm(NB * BS)[:T].to(device)
    g = (0.3, 0.07)
    apply_rope_and_store(
        q, k, v, pos, table, kd, vd, slots, k_scale=g[0], v_scale=torch.tensor([g[1]], device=device),
        k_cache_scales=ksf, v_cache_scales=vsf,
    )  # fmt: skip
    _, k_rot = reference.rms_norm_rope(q.double(), k.double(), pos, table.double())
    for data, sf, x, gs in ((kd, ksf, k_rot, g[0]), (vd, vsf, v.double(), g[1])):
        vals, scales = reference.nvfp4_quantize(x, gs)
        want = reference.nvfp4_dequantize(vals, scales, gs).cpu()
        got = reference.nvfp4_unpack(rows_of(data, slots.long()), rows_of(sf, slots.long()), gs).cpu()
        off = got != want
        assert off.sum() <= 2, f"{int(off.sum())} of {off.numel()} values differ"
        # one e2m1 step at most (2 x the block's scale at the top of the grid)
        step = 2 * scales.cpu().repeat_interleave(16, -1) * gs
        assert ((got - want).abs() <= step).all()
