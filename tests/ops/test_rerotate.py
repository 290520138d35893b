"""rerotate_kv_cache against the float64 reference, against RoPE itself, and on bad inputs.

Every case poisons the cache's base buffer (NaN) around the view, fills the view with fresh random
values, runs the op and checks:
- every element of the base that is not a written element is bit-identical to before (padding rows,
  other rows, the source rows of a dst_slots call, the dims past rotary_dim in place, the latent half
  of an MLA joint row, the padding of a strided cache);
- the written elements match the float64 reference (NaN where |delta| is past the table).
The reference itself is checked against RoPE's definition (`test_composition_*`): a key rotated for
position p and re-rotated by delta equals the key rotated for p + delta.

On CPU the Triton kernel runs in the interpreter (conftest sets TRITON_INTERPRET=1 without CUDA);
on CUDA (marked gpu) it runs compiled. Run as a script (`python test_rerotate.py big`) this file is
the subprocess of the 64-bit test.
"""

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch

import ropekit
from ropekit.api.rerotate import rerotate_kv_cache
from ropekit.core import memo, pipeline, strict
from ropekit.tools import reference

try:
    from conftest import make_cache
except ImportError:  # run as a script: same table, local copy

    def make_cache(max_position, rotary_dim, *, base=10000.0, dtype=torch.float32, device="cpu"):
        inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        f = torch.arange(max_position, dtype=torch.float64)[:, None] * inv
        return torch.cat((f.cos(), f.sin()), dim=-1).to(dtype=dtype, device=device)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FP8 = torch.float8_e4m3fn
NAN = float("nan")
# elementwise |got - want| <= TOL * (1 + |want|): one rounding to the dtype plus float32 math
# (bf16: the interpreter truncates instead of rounding)
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------
# cache layouts: each makes a k_cache view of a base made by alloc(shape)


def nhd(alloc, NB, BS, H, D):
    return alloc((NB, BS, H, D))


def hnd(alloc, NB, BS, H, D):
    """(num_blocks, H, block_size, D) storage, passed as the permuted (num_blocks, block_size, H, D) view."""
    return alloc((NB, H, BS, D)).permute(0, 2, 1, 3)


def kv_joint(alloc, NB, BS, H, D):
    """The k half of a FlashInfer-style (num_blocks, 2, block_size, H, D) buffer."""
    return alloc((NB, 2, BS, H, D))[:, 0]


def flat(alloc, NB, BS, H, D):
    return alloc((NB * BS, H, D))


def padded(alloc, NB, BS, H, D):
    """No stride derivable from the shape: rows, heads and head dims padded."""
    return alloc((NB, BS + 1, H + 1, D + 8))[:, 1:, 1:, 4 : 4 + D]


def mla(alloc, NB, BS, H, D):
    """DeepSeek MLA: the rope part of one joint row [latent (32) | rope (D)] per slot."""
    assert H == 1
    return alloc((NB, BS, 1, 32 + D))[..., 32:]


LAYOUTS = {"nhd": nhd, "hnd": hnd, "kv_joint": kv_joint, "flat": flat, "padded": padded, "mla": mla}


class Cache:
    """A layout on a NaN-poisoned base, its view filled with fresh values; the same view over other bases."""

    def __init__(self, layout, NB, BS, H, D, dtype, device, fill=None):
        self.layout, self.args = layout, (NB, BS, H, D)
        self.base = None

        def alloc(shape):
            # fp8 via float32 (fill of float8 is not everywhere)
            self.base = torch.full(shape, NAN, dtype=torch.float32 if dtype == FP8 else dtype, device=device).to(dtype)
            return self.base

        self.k = layout(alloc, *self.args)
        values = torch.randn(self.k.shape) if fill is None else fill(self.k.shape)
        self.k.copy_(values.to(device).to(dtype) if dtype != FP8 else values.float().to(device).to(FP8))
        self.paged = self.k.dim() == 4
        self.block_size = self.k.shape[1] if self.paged else 1
        self.num_slots = self.k.shape[0] * self.block_size

    def like(self, base):
        """The same view over another base of the same shape."""
        return self.layout(lambda shape: base, *self.args)

    def row(self, slot):
        return (slot // self.block_size, slot % self.block_size) if self.paged else (slot,)


def bits(x):
    return x.view(INT_OF_SIZE[x.element_size()])


def assert_close(got, want, tol, what):
    got, want = got.double().cpu(), want.double().cpu()
    ok = (got - want).abs() <= tol * (1 + want.abs())
    ok |= torch.isnan(got) & torch.isnan(want)
    assert ok.all(), (
        f"{what}: {int((~ok).sum())} of {ok.numel()} elements off; "
        f"first got {got[~ok][:4].tolist()} want {want[~ok][:4].tolist()}"
    )


def fp8_close(got, want, what):
    """fp8 e4m3: 3 mantissa bits, so a half ulp is 2^-4 of the value (2^-10 absolute when subnormal)."""
    got, want = got.double().cpu(), want.double().cpu()
    ok = (got - want).abs() <= 2.0**-4 * want.abs() * 1.001 + 2.0**-10
    ok |= torch.isnan(got) & torch.isnan(want)
    assert ok.all(), f"{what}: {int((~ok).sum())} of {ok.numel()} elements off"


def check(
    cache,
    slots,
    delta,
    table,
    *,
    interleaved=False,
    k_scale=None,
    dst_slots=None,
    exact=False,
    rotary_dim=None,
    positions=None,
    to_cache=None,
    rotary_position="first",
):
    """Run the op once; check the written elements against the float64 reference and all others bit for bit."""
    rot = table.shape[1] if rotary_dim is None else rotary_dim
    moved = dict(positions=positions, to_cache=to_cache, rotary_position=rotary_position)
    before = cache.base.clone()
    # the oracle: the same view over a float64 copy of the (poisoned) base
    want_base = cache.base.double().cpu()
    scale = None if k_scale is None else float(k_scale)
    reference.rerotate_kv_cache(
        cache.like(want_base),
        slots.cpu(),
        delta.cpu() if isinstance(delta, torch.Tensor) else delta,
        table.double().cpu(),
        interleaved=interleaved,
        rotary_dim=rot,
        k_scale=scale,
        dst_slots=None if dst_slots is None else dst_slots.cpu(),
        positions=None if positions is None else positions.cpu(),
        to_cache=None if to_cache is None else to_cache.double().cpu(),
        rotary_position=rotary_position,
    )
    # which elements may change: the rotated dims of each valid destination row (the whole row with dst)
    written = torch.zeros(cache.base.shape, dtype=torch.bool)
    wview = cache.like(written)
    src = slots.cpu().long()
    dst = src if dst_slots is None else dst_slots.cpu().long()
    valid = (src >= 0) & (src < cache.num_slots) & (dst >= 0) & (dst < cache.num_slots)
    half, gap = rot // 2, cache.k.shape[-1] // 2
    for s in dst[valid].tolist():
        if dst_slots is None and rotary_position == "halves":
            wview[cache.row(s)][..., :half] = True
            wview[cache.row(s)][..., gap : gap + half] = True
        elif dst_slots is None:
            wview[cache.row(s)][..., :rot] = True
        else:
            wview[cache.row(s)] = True

    out = rerotate_kv_cache(
        cache.k,
        slots,
        delta,
        table,
        interleaved=interleaved,
        rotary_dim=rotary_dim,
        k_scale=k_scale,
        dst_slots=dst_slots,
        **moved,
    )
    assert out is cache.k

    got = cache.base.cpu()
    b0 = before.cpu()
    changed = bits(got)[~written] != bits(b0)[~written]
    assert not changed.any(), f"{int(changed.sum())} elements outside the written ones changed"
    if cache.base.dtype == FP8:
        if exact:
            assert torch.equal(bits(got[written]), bits(want_base[written].to(FP8))), "fp8 rows not exact"
        else:
            fp8_close(got[written], want_base[written], "fp8 rows")
    else:
        assert_close(got[written], want_base[written], TOL[cache.base.dtype], "re-rotated rows")
    return want_base


def random_case(r, num_slots, n, device, *, max_pos=64, n_pad=1, n_bad=0, dst=False, zero=1):
    """Distinct source slots (n_pad of them -1), deltas in (-max_pos, max_pos) (zero of them 0, n_bad
    past the table), and distinct dst slots disjoint from the sources when dst."""
    perm = r.sample(range(num_slots), 2 * n if dst else n)
    slots = torch.tensor(perm[:n])
    dsts = torch.tensor(perm[n:]) if dst else None
    for i in r.sample(range(n), n_pad):
        slots[i] = -1 - r.randrange(3)
    delta = torch.tensor([r.randrange(-max_pos + 1, max_pos) for _ in range(n)])
    picks = r.sample(range(n), min(n, zero + n_bad))
    for i in picks[:zero]:
        delta[i] = 0
    for i in picks[zero:]:
        delta[i] = r.choice([max_pos, -max_pos, max_pos + 7, -(2**40)])
    return (slots.to(device), delta.to(device), None if dsts is None else dsts.to(device))


# ---------------------------------------------------------------------------------------------
# the fuzz: layouts x dtypes x in place / dst x rotary_dim x interleaved x index dtypes


FUZZ = [(layout, mode) for layout in LAYOUTS for mode in ("inplace", "dst")]


@pytest.mark.parametrize("layout,mode", FUZZ, ids=[f"{a}-{b}" for a, b in FUZZ])
def test_fuzz_layouts(device, layout, mode):
    r = random.Random(f"{layout}-{mode}")
    for trial in range(2):
        dtype = r.choice([torch.float32, torch.float16, torch.bfloat16])
        H = 1 if layout == "mla" else r.choice([1, 2, 3])
        D = r.choice([32, 64]) if layout != "mla" else 64
        rot = r.choice([D, D // 2])
        NB, BS = r.choice([(3, 4), (2, 8), (5, 1)])
        cache = Cache(LAYOUTS[layout], NB, BS, H, D, dtype, device)
        n = r.randrange(1, min(6, cache.num_slots // 2) + 1)
        slots, delta, dsts = random_case(
            r, cache.num_slots, n, device, n_pad=r.randrange(2), n_bad=r.randrange(2), dst=mode == "dst"
        )
        slots = slots.to(r.choice([torch.int32, torch.int64]))
        if r.random() < 0.3:
            delta = int(delta[0])
        elif r.random() < 0.5:
            delta = delta.clamp(-(2**31) + 1, 2**31 - 1).to(torch.int32)
        table = make_cache(64, rot, device=device)
        if isinstance(delta, int) and not -64 < delta < 64:  # an int past the table: refused, nothing written
            before = cache.base.clone()
            with pytest.raises(ValueError, match="delta: expected an int in"):
                rerotate_kv_cache(cache.k, slots, delta, table, dst_slots=dsts)
            assert torch.equal(bits(cache.base), bits(before))
            continue
        check(cache, slots, delta, table, interleaved=r.random() < 0.5, dst_slots=dsts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
def test_dtypes_and_pair_layouts(device, dtype, interleaved):
    cache = Cache(nhd, 4, 4, 4, 128, dtype, device)
    r = random.Random(str(dtype) + str(interleaved))
    slots, delta, _ = random_case(r, cache.num_slots, 8, device, n_pad=2)
    check(cache, slots, delta, make_cache(64, 128, device=device), interleaved=interleaved)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block_elems, warps", [(256, 1), (8192, 8)])
def test_launch_shape_knobs(device, monkeypatch, cache_dtype, block_elems, warps):
    """A launch shape other than the default gives the same rows (a program's rows x heads x
    rotary dims is rerotate_block_elems, its warps rerotate_warps), on a cache with more heads
    than one program takes at 256."""
    from ropekit.core import tuning

    from conftest import spy_plans

    seen = spy_plans(monkeypatch, lambda meta: meta, "plan_rerotate")
    if cache_dtype == FP8:  # quarter turns: exact in e4m3, so the interpreter's casts are exact too
        fill, table = fp8_values, quarter_turn_table(64, 128, device)
        extra = {"k_scale": torch.tensor([0.5], device=device), "exact": True}
    else:
        fill, table, extra = None, make_cache(64, 128, device=device), {}
    cache = Cache(nhd, 8, 4, 8, 128, cache_dtype, device, fill=fill)
    r = random.Random(f"{cache_dtype}{block_elems}")
    slots, delta, _ = random_case(r, cache.num_slots, 24, device, n_pad=2)
    with tuning.override(rerotate_block_elems=block_elems, rerotate_warps=warps):
        check(cache, slots, delta, table, **extra)
    assert seen, "the spy saw no launch"
    for meta in seen:
        assert meta["num_warps"] == warps
        assert meta["ROWS"] * meta["BLOCK_H"] * 2 * meta["HALF_PAD"] == block_elems


@pytest.mark.parametrize("cache_dtype, warps", [(torch.float32, 4), (torch.bfloat16, 4), (FP8, 2)])
def test_default_warps_by_cache_dtype(monkeypatch, cache_dtype, warps):
    """With the knobs untouched a 2048-element program takes 4 warps on a 4- or 2-byte cache and 2 on
    an fp8 one (each thread one 16-byte vector of each pair half; PERF_LOG v56)."""
    from ropekit.core import tuning

    from conftest import spy_plans

    monkeypatch.delenv("ROPEKIT_REROTATE_WARPS", raising=False)
    monkeypatch.delenv("ROPEKIT_REROTATE_BLOCK_ELEMS", raising=False)
    seen = spy_plans(monkeypatch, lambda meta: meta, "plan_rerotate")
    assert tuning.get("rerotate_block_elems") == 2048
    kc = torch.zeros(4, 4, 8, 128).to(cache_dtype)
    scale = {"k_scale": torch.tensor([0.5])} if cache_dtype == FP8 else {}
    rerotate_kv_cache(kc, torch.tensor([1, 5]), torch.tensor([2, -3]), make_cache(16, 128), **scale)
    assert [m["num_warps"] for m in seen] == [warps]


def test_int_delta_and_negative_int_delta(device):
    cache = Cache(hnd, 2, 4, 2, 64, torch.float32, device)
    slots = torch.tensor([5, 0, -1, 7], device=device)
    check(cache, slots, 9, make_cache(32, 64, device=device))
    check(cache, slots, -31, make_cache(32, 64, device=device))


def test_zero_delta_is_the_identity(device):
    """cos 1, sin 0: every re-rotated element comes back bit for bit (the tail too, via dst)."""
    cache = Cache(nhd, 2, 4, 2, 64, torch.bfloat16, device)
    before = cache.k.clone()
    table = make_cache(8, 32, device=device)
    rerotate_kv_cache(cache.k, torch.tensor([1, 6, 3], device=device), 0, table)
    assert torch.equal(bits(cache.k), bits(before))
    rerotate_kv_cache(
        cache.k,
        torch.tensor([1, 6], device=device),
        torch.zeros(2, dtype=torch.int32, device=device),
        table,
        dst_slots=torch.tensor([0, 7], device=device),
    )
    assert torch.equal(bits(cache.k[0, 0]), bits(before[0, 1])) and torch.equal(bits(cache.k[1, 3]), bits(before[1, 2]))


@pytest.mark.parametrize("delta", [16, -16, 2**40, -(2**63) + 1, 2**70])
def test_int_delta_past_the_table_is_refused(device, delta):
    """A Python int shift is a host value: |delta| >= max_position is refused for free, in any mode,
    on every call (also after a valid int delta made the same signature), and nothing is written."""
    cache = Cache(flat, 1, 6, 2, 64, torch.float32, device)
    table = make_cache(16, 32, device=device)
    slots = torch.tensor([1, 4], device=device)
    rerotate_kv_cache(cache.k, slots, 15, table)  # the signature is validated and remembered
    before = cache.base.clone()
    with pytest.raises(ValueError, match=r"rerotate_kv_cache: delta: expected an int in \(-16, 16\)"):
        rerotate_kv_cache(cache.k, slots, delta, table)
    assert torch.equal(bits(cache.base), bits(before))


def test_tensor_delta_past_the_table_is_nan(device):
    """A tensor delta past the table rotates by NaN (no sync to check it); the tail is kept."""
    cache = Cache(flat, 1, 6, 2, 64, torch.float32, device)
    big = torch.tensor([16, -(2**31) + 1], device=device)
    check(cache, torch.tensor([1, 4], device=device), big, make_cache(16, 32, device=device))
    rows = cache.k[[1, 4]]
    assert rows[..., :32].isnan().all() and not rows[..., 32:].isnan().any()


def test_0d_delta_is_one_shift_for_every_row(device):
    """A 0-d tensor delta (as a 0-d k_scale is one scale) shifts every row, read on the device."""
    table = make_cache(32, 64, device=device)
    slots = torch.tensor([5, 0, -1, 7], device=device)
    one = Cache(hnd, 2, 4, 2, 64, torch.float32, device)
    two = Cache(hnd, 2, 4, 2, 64, torch.float32, device)
    two.base.copy_(one.base)
    before = one.base.clone()
    rerotate_kv_cache(one.k, slots, torch.tensor(-9, device=device), table)
    rerotate_kv_cache(two.k, slots, -9, table)
    assert torch.equal(bits(one.base), bits(two.base))
    assert not torch.equal(bits(one.base), bits(before)), "the 0-d shift rotated nothing"


def test_all_padding_and_empty(device):
    cache = Cache(nhd, 2, 4, 2, 64, torch.float32, device)
    before = cache.base.clone()
    table = make_cache(16, 64, device=device)
    rerotate_kv_cache(cache.k, torch.full((3,), -1, device=device), torch.tensor([1, 2, 3], device=device), table)
    rerotate_kv_cache(cache.k, torch.zeros(0, dtype=torch.long, device=device), 3, table)
    rerotate_kv_cache(
        cache.k, torch.tensor([1, 2], device=device), 3, table, dst_slots=torch.tensor([-1, -5], device=device)
    )
    assert torch.equal(bits(cache.base), bits(before))


def test_slot_past_cache_writes_nothing(device):
    cache = Cache(nhd, 2, 4, 2, 64, torch.float32, device)
    table = make_cache(16, 64, device=device)
    check(cache, torch.tensor([8, 3, 100], device=device), torch.tensor([1, 2, 3], device=device), table)
    check(cache, torch.tensor([1, 3], device=device), 2, table, dst_slots=torch.tensor([8, 5], device=device))


def test_version_counter_bumps(device):
    cache = Cache(nhd, 1, 4, 1, 32, torch.float32, device)
    v = cache.k._version
    rerotate_kv_cache(cache.k, torch.tensor([0], device=device), 1, make_cache(4, 32, device=device))
    assert cache.k._version > v


def test_strided_index_tensors(device):
    """slots, dst_slots and delta as strided views (every other element of a wider tensor)."""
    cache = Cache(padded, 2, 4, 2, 64, torch.float16, device)
    slots = torch.tensor([1, 99, 4, 99, -1, 99], device=device)[::2]
    dsts = torch.tensor([[0], [6], [7]], device=device)[:, 0]
    delta = torch.tensor([[3, 0], [-9, 0], [5, 0]], device=device)[:, 0]
    check(cache, slots, delta, make_cache(16, 64, device=device), dst_slots=dsts)


@pytest.mark.parametrize("tables", ["one", "two"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_both_cpu_paths(monkeypatch, path, tables):
    """CPU tensors run the kernel under TRITON_INTERPRET=1 (counted here), the pure-PyTorch path
    otherwise; a shift in one table, and a move between two (positions=, to_cache=)."""
    from ropekit.core import checks

    fired = []
    real_launch = pipeline.launch
    monkeypatch.setattr(pipeline, "launch", lambda *a, **kw: (fired.append(1), real_launch(*a, **kw)))
    monkeypatch.setattr(checks, "triton_runs", lambda x: path == "kernel")
    memo.clear()
    r = random.Random(path + tables)
    try:
        for layout, mode in (("padded", "dst"), ("mla", "inplace"), ("hnd", "dst")):
            cache = Cache(LAYOUTS[layout], 2, 4, 1 if layout == "mla" else 2, 64, torch.bfloat16, "cpu")
            if tables == "one":
                slots, delta, dsts = random_case(r, cache.num_slots, 3, "cpu", n_bad=1, dst=mode == "dst")
                table, moved = make_cache(64, 32), {}
            else:
                table, t = table_pair(r, 32, "cpu")
                slots, pos, delta, dsts = random_moves(
                    r, cache.num_slots, 3, "cpu", table.shape[0], t.shape[0], n_bad=1, dst=mode == "dst"
                )
                moved = dict(positions=pos, to_cache=t)
            check(cache, slots, delta, table, interleaved=layout == "mla", dst_slots=dsts, **moved)
    finally:
        memo.clear()  # drop specs made under the forced path
    assert len(fired) == (3 if path == "kernel" else 0)


# ---------------------------------------------------------------------------------------------
# RoPE's own definition: rotate(p) then re-rotate(delta) == rotate(p + delta)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
def test_composition_with_apply_rope(device, interleaved):
    """Keys stored by apply_rope_and_store at positions p, re-rotated by delta (negative too), match
    keys stored at p + delta; the reference agrees (float64, from the same raw keys)."""
    N, H, D, P = 6, 2, 64, 128
    table = make_cache(P, D, device=device)
    k_raw = torch.randn(N, H, D, device=device)
    p = torch.tensor([0, 5, 40, 63, 100, 17], device=device)
    delta = torch.tensor([3, -5, -40, 64, 27, 0], device=device)
    slots = torch.tensor([9, 2, 14, 0, 7, 11], device=device)
    cache = torch.full((4, 4, H, D), NAN, device=device)
    q = torch.randn(N, 1, D, device=device)
    ropekit.apply_rope_and_store(
        q, k_raw, k_raw, p, table, cache, torch.empty_like(cache), slots, interleaved=interleaved
    )
    rerotate_kv_cache(cache, slots, delta, table, interleaved=interleaved)
    want = torch.stack(
        [
            reference.apply_rope(
                k_raw[i : i + 1].double(), None, (p + delta)[i : i + 1], table.double(), interleaved=interleaved
            )[0][0]
            for i in range(N)
        ]
    )
    got = cache.flatten(0, 1)[slots]
    assert_close(got, want, 2e-6, "re-rotated keys vs keys rotated at p + delta")


def test_reference_float64_is_exact_composition():
    """The oracle in float64: a table in float64 too, so the composition holds to ~1e-12."""
    D, P = 32, 64
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(P, dtype=torch.float64)[:, None] * inv
    table = torch.cat((ang.cos(), ang.sin()), -1)
    k = torch.randn(3, 2, D, dtype=torch.float64)
    p, d = torch.tensor([10, 30, 50]), torch.tensor([-10, 33, -1])
    cache = reference.apply_rope(k, None, p, table)[0].clone()
    reference.rerotate_kv_cache(cache, torch.arange(3), d, table)
    want = reference.apply_rope(k, None, p + d, table)[0]
    assert (cache - want).abs().max() < 1e-12


# ---------------------------------------------------------------------------------------------
# fp8 and scales


def fp8_values(shape, scale=1.0):
    """Random normal-range e4m3 values times scale: exactly representable."""
    b = torch.randint(0x08, 0x77, shape, dtype=torch.uint8) | (torch.randint(0, 2, shape, dtype=torch.uint8) << 7)
    return b.view(FP8).float() * scale


def quarter_turn_table(P, rot, device):
    """A table whose every (cos, sin) is a multiple of a quarter turn: rotations are exact swaps and
    sign flips, so an fp8 result must equal the oracle's byte for byte (the interpreter included)."""
    turns = torch.randint(0, 4, (P, rot // 2))
    ang = turns.double() * (math.pi / 2)
    return torch.cat((ang.cos().round(), ang.sin().round()), -1).float().to(device)


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor0d", "tensor1"])
@pytest.mark.parametrize("mode", ["inplace", "dst"])
def test_fp8_exact(device, scale_kind, mode):
    ks = {
        "none": None,
        "float": 4.0,
        "tensor0d": torch.tensor(0.25, device=device),
        "tensor1": torch.tensor([2.0], device=device),
    }[scale_kind]
    cache = Cache(hnd, 2, 4, 2, 64, FP8, device, fill=fp8_values)
    r = random.Random(scale_kind + mode)
    slots, delta, dsts = random_case(r, cache.num_slots, 3, device, max_pos=16, dst=mode == "dst")
    check(cache, slots, delta, quarter_turn_table(16, 32, device), k_scale=ks, dst_slots=dsts, exact=True)


@pytest.mark.parametrize("layout", ["nhd", "mla"])
def test_fp8_random(device, layout):
    """Dequantize, rotate by real angles, quantize back: fp8 precision against float64."""
    if INTERPRETED and device == "cpu":
        pytest.skip(
            "the Triton interpreter's float32 -> float8e4nv cast is wrong when rounding carries "
            "into the exponent (1.99 -> 1.0) and flushes subnormals; test_fp8_exact covers it"
        )
    H = 2 if layout == "nhd" else 1
    cache = Cache(LAYOUTS[layout], 4, 8, H, 64, FP8, device, fill=lambda s: fp8_values(s, 1.0))
    r = random.Random(layout)
    slots, delta, dsts = random_case(r, cache.num_slots, 8, device, n_bad=1)
    check(
        cache,
        slots,
        delta,
        make_cache(64, 64, device=device),
        k_scale=torch.tensor([0.03], device=device),
        interleaved=layout == "mla",
    )


def test_scale_on_a_float_cache(device):
    """A scale with a float cache is honoured too (dequantize, rotate, quantize back)."""
    cache = Cache(nhd, 2, 4, 2, 64, torch.float32, device)
    check(
        cache,
        torch.tensor([1, 2, 6], device=device),
        torch.tensor([3, -4, 0], device=device),
        make_cache(16, 64, device=device),
        k_scale=torch.tensor(2.0, device=device),
    )


# ---------------------------------------------------------------------------------------------
# the worked example of docs/rerotate.md: attention sinks + sliding window, evicted and compacted


def _attend(q, keys, values):
    """softmax(q k^T / sqrt(D)) v per head in float64: q (H, D), keys/values (n, H, D) -> (H, D)."""
    q, keys, values = q.double(), keys.double(), values.double()
    scores = torch.einsum("hd,nhd->hn", q, keys) / math.sqrt(q.shape[-1])
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), values)


@pytest.mark.parametrize("mode", ["compact", "in_place"])
def test_worked_example_sink_and_window_eviction(device, mode):
    """24 tokens at positions 0..23 in a shuffled paged cache. Keep 4 sinks and the last 8 tokens,
    evict the 12 in between, and move the window to positions 4..11 (delta -12): into the evicted
    tokens' rows (compact, dst_slots) or where it is (in place). Attention of the next query (position
    12) over the re-rotated cache equals attention over a cache rebuilt from scratch at the new
    positions; copying the rows without re-rotating does not."""
    T, SINK, WIN, H, D = 24, 4, 8, 2, 64
    table = make_cache(64, D, device=device)
    g = torch.Generator().manual_seed(0)
    k_raw = torch.randn(T, H, D, generator=g).to(device)
    v = torch.randn(T, H, D, generator=g).to(device)
    q_raw = torch.randn(1, H, D, generator=g).to(device)
    slot_of = torch.randperm(32, generator=g)[:T].to(device)  # token -> cache slot
    k_cache = torch.full((4, 8, H, D), NAN, device=device)
    v_cache = torch.full((4, 8, H, D), NAN, device=device)
    ropekit.apply_rope_and_store(
        torch.zeros(T, 1, D, device=device), k_raw, v, torch.arange(T, device=device), table, k_cache, v_cache, slot_of
    )

    window = torch.arange(T - WIN, T, device=device)  # tokens 16..23
    shift = -(T - WIN - SINK)  # to positions 4..11
    if mode == "compact":
        dst = slot_of[SINK : SINK + WIN]  # rows of evicted tokens 4..11
        ropekit.rerotate_kv_cache(k_cache, slot_of[window], shift, table, dst_slots=dst)
        v_cache.flatten(0, 1)[dst] = v_cache.flatten(0, 1)[slot_of[window]]  # v moves unrotated
        kept_slots = torch.cat((slot_of[:SINK], dst))
    else:
        ropekit.rerotate_kv_cache(k_cache, slot_of[window], torch.full((WIN,), shift, device=device), table)
        kept_slots = torch.cat((slot_of[:SINK], slot_of[window]))

    kept = torch.cat((torch.arange(SINK), window.cpu()))  # original token ids
    new_pos = torch.arange(SINK + WIN, device=device)  # 0..11
    rebuilt_k = reference.apply_rope(k_raw[kept].double(), None, new_pos, table.double())[0]
    q = reference.apply_rope(q_raw.double(), None, torch.tensor([SINK + WIN], device=device), table.double())[0][0]
    want = _attend(q, rebuilt_k, v[kept])

    got = _attend(q, k_cache.flatten(0, 1)[kept_slots], v_cache.flatten(0, 1)[kept_slots])
    assert (got - want).abs().max().item() < 1e-5, "re-rotated cache attends like the rebuilt one"
    # the same rows without re-rotation (positions 16..23 kept) attend differently: the test can fail
    stale = reference.apply_rope(k_raw[kept].double(), None, kept.to(device), table.double())[0]
    assert (_attend(q, stale, v[kept]) - want).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------------------------
# the serving module


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_embedding_method(device, neox):
    rope = ropekit.RotaryEmbedding(64, 32, 128, 10000.0, neox, device=device)
    cache = Cache(kv_joint, 2, 4, 2, 64, torch.bfloat16, device)
    slots, delta = torch.tensor([3, -1, 5], device=device), torch.tensor([-7, 2, 100], device=device)
    dsts = torch.tensor([0, 1, 2], device=device)
    want = cache.base.clone()
    rerotate_kv_cache(
        cache.like(want), slots, delta, rope.cos_sin_cache, interleaved=not neox, rotary_dim=32, dst_slots=dsts
    )
    out = rope.rerotate_kv_cache(cache.k, slots, delta, dst_slots=dsts)
    assert out is cache.k
    assert torch.equal(bits(cache.base), bits(want))


def test_rotary_embedding_method_refuses():
    rope = ropekit.RotaryEmbedding(64, 64, 128)
    with pytest.raises(ValueError, match="k_cache: expected a head size of head_size = 64"):
        rope.rerotate_kv_cache(torch.zeros(2, 4, 1, 32), torch.tensor([0]), 1)
    long = ropekit.RotaryEmbedding(
        64,
        64,
        256,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 32,
            "long_factor": [2.0] * 32,
            "original_max_position_embeddings": 128,
        },
    )
    with pytest.raises(ValueError, match="self: expected a module with one table segment"):
        long.rerotate_kv_cache(torch.zeros(2, 4, 1, 64), torch.tensor([0]), 1)


# ---------------------------------------------------------------------------------------------
# two tables: row i moves from cos_sin_cache[positions[i]] to to_cache[positions[i] + delta[i]]


def yarn_table(P, rot, factor, device):
    """A YaRN table: its attention factor (0.1 ln(factor) + 1) folded into cos / sin."""
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 16}
    return ropekit.cos_sin_cache(rot, P, scaling=scaling, device=device)


def longrope_tables(P_short, P_long, rot, device, seed=0):
    """LongRoPE's short table (P_short rows: short factors, attention factor 1) and long table
    (P_long rows: long factors, attention factor sqrt(1 + ln(P_long / P_short) / ln(P_short)))."""
    g = torch.Generator().manual_seed(seed)
    scaling = {
        "rope_type": "longrope",
        "short_factor": (1 + 2 * torch.rand(rot // 2, generator=g, dtype=torch.float64)).tolist(),
        "long_factor": (2 + 6 * torch.rand(rot // 2, generator=g, dtype=torch.float64)).tolist(),
        "original_max_position_embeddings": P_short,
    }
    short = ropekit.cos_sin_cache(rot, P_short, scaling=scaling, device=device)
    return short, ropekit.cos_sin_cache(rot, P_long, scaling=scaling, device=device)


def magnitude(table):
    half = table.shape[1] // 2
    return float(torch.hypot(table[:, :half].double(), table[:, half:].double()).mean())


def table_pair(r, rot, device):
    """Two tables of one width whose magnitudes differ: YaRN at two factors, LongRoPE short to long,
    or long to short."""
    kind = r.choice(["yarn", "longrope", "longrope-back"])
    if kind == "yarn":
        pair = yarn_table(48, rot, 2.0, device), yarn_table(64, rot, 8.0, device)
    else:
        short, long = longrope_tables(32, 64, rot, device, seed=r.randrange(100))
        pair = (short, long) if kind == "longrope" else (long, short)
    assert abs(magnitude(pair[0]) - magnitude(pair[1])) > 0.05, kind
    return pair


def random_moves(r, num_slots, n, device, from_rows, to_rows, *, n_pad=1, n_bad=0, dst=False):
    """random_case's slots (and dst slots), positions in [0, from_rows) and shifts landing in
    [0, to_rows); one row a pure table switch (delta 0), n_bad rows outside a table (position past
    cos_sin_cache, positions + delta past either end of to_cache, shifts near the int64 limits)."""
    slots, _, dsts = random_case(r, num_slots, n, device, n_pad=n_pad, dst=dst, zero=0)
    pos = [r.randrange(from_rows) for _ in range(n)]
    delta = [r.randrange(to_rows) - p for p in pos]
    picks = r.sample(range(n), min(n, 1 + n_bad))
    pos[picks[0]], delta[picks[0]] = r.randrange(min(from_rows, to_rows)), 0
    for i in picks[1:]:
        kind = r.randrange(4)
        if kind == 0:
            pos[i] = r.choice([from_rows, -1, 2**40])
        elif kind == 1:
            delta[i] = to_rows - pos[i] + r.randrange(3)
        elif kind == 2:
            delta[i] = -pos[i] - 1 - r.randrange(3)
        else:
            delta[i] = r.choice([2**62, -(2**62), 2**63 - 1, -(2**63)])
    return slots, torch.tensor(pos, device=device), torch.tensor(delta, device=device), dsts


@pytest.mark.parametrize("layout,mode", FUZZ, ids=[f"{a}-{b}" for a, b in FUZZ])
def test_two_tables_fuzz(device, layout, mode):
    r = random.Random(f"two-{layout}-{mode}")
    dtype = r.choice([torch.float32, torch.float16, torch.bfloat16])
    H = 1 if layout == "mla" else r.choice([1, 2, 3])
    D = r.choice([32, 64]) if layout != "mla" else 64
    rot = r.choice([D, D // 2])
    NB, BS = r.choice([(3, 4), (2, 8), (5, 1)])
    cache = Cache(LAYOUTS[layout], NB, BS, H, D, dtype, device)
    f, t = table_pair(r, rot, device)
    n = r.randrange(2, min(6, cache.num_slots // 2) + 1)
    slots, pos, delta, dsts = random_moves(
        r,
        cache.num_slots,
        n,
        device,
        f.shape[0],
        t.shape[0],
        n_pad=r.randrange(2),
        n_bad=r.randrange(3),
        dst=mode == "dst",
    )
    if r.random() < 0.5:
        pos = pos.clamp(-(2**31), 2**31 - 1).to(torch.int32)
    if r.random() < 0.3:
        delta = r.choice([0, 5, -3])  # one int shift for every row
    check(cache, slots, delta, f, interleaved=r.random() < 0.5, dst_slots=dsts, positions=pos, to_cache=t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
def test_two_tables_dtypes_and_pair_layouts(device, dtype, interleaved):
    cache = Cache(nhd, 2, 4, 2, 128, dtype, device)
    r = random.Random(f"two-{dtype}-{interleaved}")
    short, long = longrope_tables(32, 64, 128, device)
    slots, pos, delta, _ = random_moves(r, cache.num_slots, 6, device, 32, 64, n_pad=1, n_bad=1)
    check(cache, slots, delta, short, interleaved=interleaved, positions=pos, to_cache=long)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_two_tables_composition_with_apply_rope(device, interleaved, kind):
    """RoPE's definition, independent of the oracle: keys stored by apply_rope_and_store at
    positions p with one table, moved with delta (0, positive, negative) to another, match keys
    stored at p + delta with that table (attention factors included): YaRN at factor 2 to factor 8,
    LongRoPE short to long (docs/rerotate.md's switch, and a shift with it)."""
    N, H, D = 6, 2, 64
    if kind == "yarn":
        f, t = yarn_table(48, D, 2.0, device), yarn_table(64, D, 8.0, device)
    else:
        f, t = longrope_tables(48, 64, D, device)
    k_raw = torch.randn(N, H, D, device=device)
    p = torch.tensor([0, 5, 40, 47, 20, 17], device=device)
    delta = torch.tensor([0, 3, -40, 16, -20, 0], device=device)
    slots = torch.tensor([9, 2, 14, 0, 7, 11], device=device)
    cache = torch.full((4, 4, H, D), NAN, device=device)
    q = torch.randn(N, 1, D, device=device)
    ropekit.apply_rope_and_store(q, k_raw, k_raw, p, f, cache, torch.empty_like(cache), slots, interleaved=interleaved)
    rerotate_kv_cache(cache, slots, delta, f, interleaved=interleaved, positions=p, to_cache=t)
    want = reference.apply_rope(k_raw.double(), None, p + delta, t.double(), interleaved=interleaved)[0]
    assert_close(cache.flatten(0, 1)[slots], want, 4e-6, "moved keys vs keys rotated with to_cache at p + delta")


def test_two_tables_out_of_range_is_nan(device):
    """A position past cos_sin_cache or a positions + delta past either end of to_cache rotates by
    NaN (nothing read out of bounds, no sync); the tail and every other row are kept."""
    cache = Cache(flat, 1, 8, 2, 64, torch.float32, device)
    f, t = yarn_table(16, 32, 2.0, device), yarn_table(32, 32, 4.0, device)
    slots = torch.tensor([1, 4, 6, 0, 2, 7], device=device)
    pos = torch.tensor([16, 3, 5, 2**40, 10, 9], device=device)
    delta = torch.tensor([0, 29, -6, 0, 2**63 - 1, 1], device=device)
    check(cache, slots, delta, f, positions=pos, to_cache=t)
    bad = cache.k[[1, 4, 6, 0, 2]]
    assert bad[..., :32].isnan().all() and not bad[..., 32:].isnan().any()
    assert not cache.k[7].isnan().any()


def test_two_tables_int_delta(device):
    """An int shift with two tables lies in (-len(cos_sin_cache), len(to_cache)): host-checked, free."""
    cache = Cache(hnd, 2, 4, 2, 64, torch.float32, device)
    f, t = yarn_table(16, 64, 2.0, device), yarn_table(32, 64, 4.0, device)
    slots, pos = torch.tensor([5, 0, -1, 7], device=device), torch.tensor([3, 15, 0, 9], device=device)
    for delta in (0, 9, -3, 31, -15):
        check(cache, slots, delta, f, positions=pos, to_cache=t)
    before = cache.base.clone()
    for delta in (32, -16):
        with pytest.raises(ValueError, match=r"delta: expected an int in \(-16, 32\)"):
            rerotate_kv_cache(cache.k, slots, delta, f, positions=pos, to_cache=t)
    assert torch.equal(bits(cache.base), bits(before))


def test_two_tables_rotary_position_halves(device):
    """Gemma 4's pairs (i, i + D/2) with a narrow table, in place and into dst slots."""
    cache = Cache(nhd, 2, 4, 2, 64, torch.bfloat16, device)
    f, t = yarn_table(32, 16, 2.0, device), yarn_table(64, 16, 4.0, device)
    r = random.Random("two-halves")
    for dst in (False, True):
        slots, pos, delta, dsts = random_moves(r, cache.num_slots, 3, device, 32, 64, n_bad=1, dst=dst)
        check(cache, slots, delta, f, dst_slots=dsts, positions=pos, to_cache=t, rotary_position="halves")


@pytest.mark.parametrize("mode", ["inplace", "dst"])
def test_two_tables_fp8_exact(device, mode):
    """Quarter-turn tables: the composed rotation is exact, so fp8 rows equal the oracle byte for byte."""
    cache = Cache(hnd, 2, 4, 2, 64, FP8, device, fill=fp8_values)
    f, t = quarter_turn_table(16, 32, device), quarter_turn_table(24, 32, device)
    r = random.Random("two-fp8" + mode)
    slots, pos, delta, dsts = random_moves(r, cache.num_slots, 3, device, 16, 24, dst=mode == "dst")
    ks = torch.tensor(0.25, device=device)
    check(cache, slots, delta, f, k_scale=ks, dst_slots=dsts, exact=True, positions=pos, to_cache=t)


@pytest.mark.parametrize("layout", ["nhd", "mla"])
def test_two_tables_fp8_scaled_tables(device, layout, monkeypatch):
    """fp8 with k_scale between YaRN / LongRoPE tables of different magnitudes, against float64.
    On CPU the PyTorch path runs it (the interpreter's fp8 cast is wrong, see test_fp8_random)."""
    from ropekit.core import checks

    if INTERPRETED and device == "cpu":
        monkeypatch.setattr(checks, "triton_runs", lambda x: False)
    memo.clear()
    H = 2 if layout == "nhd" else 1
    cache = Cache(LAYOUTS[layout], 4, 8, H, 64, FP8, device, fill=lambda s: fp8_values(s, 1.0))
    r = random.Random("two-fp8-" + layout)
    f, t = table_pair(r, 64, device)
    slots, pos, delta, dsts = random_moves(r, cache.num_slots, 8, device, f.shape[0], t.shape[0], n_bad=1)
    ks = torch.tensor([0.03], device=device)
    try:
        check(cache, slots, delta, f, k_scale=ks, interleaved=layout == "mla", positions=pos, to_cache=t)
    finally:
        memo.clear()  # drop specs made under the forced path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_two_tables_one_rounding_beats_two_calls(device, dtype):
    """Unit-magnitude tables (two bases), where two calls (back to position 0 with cos_sin_cache,
    then forward with to_cache) are the same math: the one call, rounded once, is at least as close
    to float64 on average, and within one rounding everywhere; the two calls are not better."""
    N, H, D = 64, 2, 64
    f, t = make_cache(64, D, device=device), make_cache(96, D, base=500000.0, device=device)
    cache = Cache(flat, N, 1, H, D, dtype, device)
    g = torch.Generator().manual_seed(7)
    slots = torch.arange(N, device=device)
    pos = torch.randint(0, 64, (N,), generator=g).to(device)
    delta = (torch.randint(0, 96, (N,), generator=g).to(device) - pos).to(device)
    want = cache.k.double().cpu().clone()
    reference.rerotate_kv_cache(
        want, slots.cpu(), delta.cpu(), f.double().cpu(), positions=pos.cpu(), to_cache=t.double().cpu()
    )
    one = cache.k.clone()
    rerotate_kv_cache(one, slots, delta, f, positions=pos, to_cache=t)
    two = cache.k.clone()
    rerotate_kv_cache(two, slots, -pos, f)
    rerotate_kv_cache(two, slots, pos + delta, t)
    err_one = (one.double().cpu() - want).abs()
    err_two = (two.double().cpu() - want).abs()
    assert_close(one, want, TOL[dtype], "one call")
    assert err_one.mean() < err_two.mean(), (float(err_one.mean()), float(err_two.mean()))


def _two_table_fn(cache, slots, delta, table, to_table, positions, dsts):
    """A move between tables into dst slots, then a pure table switch back in place, on an MLA view."""
    rope = cache[..., 32:]
    rerotate_kv_cache(
        rope, slots, delta, table, interleaved=True, positions=positions, to_cache=to_table, dst_slots=dsts
    )
    rerotate_kv_cache(rope, dsts, 0, to_table, interleaved=True, positions=positions + delta, to_cache=table)
    return cache.sum()


def _two_tables_compile_matches_eager(device, backend):
    torch._dynamo.reset()
    fn = torch.compile(_two_table_fn, backend=backend, fullgraph=True, dynamic=True)
    f, t = yarn_table(32, 16, 2.0, device), yarn_table(48, 16, 4.0, device)
    g = torch.Generator().manual_seed(3)
    for n in (3, 5):  # two shapes, one dynamic graph
        cache = torch.full((4, 4, 1, 32 + 16), NAN, device=device)
        cache[..., 32:] = torch.randn(4, 4, 1, 16, generator=g).to(device)
        perm = torch.randperm(16, generator=g)
        slots, dsts = perm[:n].to(device), perm[n : 2 * n].to(device)
        pos = torch.randint(0, 32, (n,), generator=g).to(device)
        delta = torch.randint(0, 32, (n,), generator=g).to(device) - pos  # positions + delta in both tables
        args = (slots, delta, f, t, pos, dsts)
        c_e = cache.clone()
        _two_table_fn(c_e, *args)
        c_c = cache.clone()
        fn(c_c, *args)
        assert torch.equal(bits(c_c), bits(c_e)), f"compiled two-table re-rotation differs from eager (n={n})"
        assert not torch.equal(bits(c_c), bits(cache))


def test_two_tables_torch_compile_fullgraph_dynamic():
    _two_tables_compile_matches_eager("cpu", "aot_eager")


@pytest.mark.gpu
def test_gpu_two_tables_torch_compile_inductor():
    _two_tables_compile_matches_eager("cuda", "inductor")


def test_two_tables_opcheck():
    from ropekit.core.variant import Variant

    codes = Variant(True, True, angles="delta", k_scaled=True, to_dst=True, two_tables=True).encode()
    f, t = yarn_table(8, 32, 2.0, "cpu"), yarn_table(12, 32, 4.0, "cpu")
    args = (
        torch.randn(2, 4, 1, 32),
        torch.tensor([1, 0, 5]),
        torch.tensor([2, -1, 3]),
        0,
        f,
        codes,
        32,
        torch.tensor([2.0]),
        torch.tensor([2, 3, -1]),
        torch.tensor([3, 7, 0]),
        t,
    )
    torch.library.opcheck(torch.ops.ropekit.rerotate_kv_cache.default, args)
    codes = Variant(angles="delta", two_tables=True).encode()
    args = (
        torch.randn(8, 2, 32),
        torch.tensor([1, 0, 5]),
        None,
        -3,
        f,
        codes,
        32,
        None,
        None,
        torch.tensor([4, 5, 7]),
        t,
    )
    torch.library.opcheck(torch.ops.ropekit.rerotate_kv_cache.default, args)


# ---------------------------------------------------------------------------------------------
# bad inputs: the rows of docs/bad_inputs.md for rerotate_kv_cache


def rr_args(**change):
    base = torch.full((2, 2, 4, 2, 64), NAN)
    base[:, 0] = torch.randn(2, 4, 2, 64)
    a = dict(
        k_cache=base[:, 0],
        slots=torch.tensor([0, 3, -1, 6]),
        delta=torch.tensor([1, -2, 3, 4]),
        cos_sin_cache=make_cache(16, 64),
    )
    for name, fn in change.items():
        a[name] = fn(a) if callable(fn) else fn
    return a


def two_args(**change):
    """rr_args moving rows between tables: positions below cos_sin_cache's 16 rows, to_cache of 32."""
    return rr_args(**{"positions": torch.tensor([2, 5, 0, 1]), "to_cache": make_cache(32, 64), **change})


class Row(NamedTuple):
    id: str
    exc: type
    fragment: str
    make: Callable[[], dict]
    strict: bool = False


_buf = torch.zeros(64)
BAD_ROWS = [
    Row("rerotate-cache-type", TypeError, "k_cache: expected a torch.Tensor, got list", lambda: rr_args(k_cache=[0.0])),
    Row(
        "rerotate-cache-rank",
        ValueError,
        "k_cache: expected a 3-D or 4-D tensor",
        lambda: rr_args(k_cache=lambda a: a["k_cache"][0, 0]),
    ),
    Row(
        "rerotate-cache-dtype",
        ValueError,
        "k_cache: expected dtype in (float16, bfloat16, float32, float8_e4m3fn), got float64",
        lambda: rr_args(k_cache=lambda a: a["k_cache"].double()),
    ),
    Row(
        "rerotate-cache-last-stride",
        ValueError,
        "k_cache: expected stride 1 in the last dimension",
        lambda: rr_args(k_cache=torch.zeros(2, 4, 2, 128)[..., ::2]),
    ),
    Row(
        "rerotate-cache-broadcast",
        ValueError,
        "k_cache: expected a tensor without broadcast",
        lambda: rr_args(k_cache=torch.zeros(2, 1, 2, 64).expand(2, 4, 2, 64)),
    ),
    Row(
        "rerotate-cache-grad",
        ValueError,
        "k_cache: expected a tensor that does not require grad",
        lambda: rr_args(k_cache=torch.zeros(2, 4, 2, 64, requires_grad=True)),
    ),
    Row(
        "rerotate-head-too-small",
        ValueError,
        "k_cache: expected a head size >= rotary_dim (64), got head size 32",
        lambda: rr_args(k_cache=torch.zeros(2, 4, 2, 32)),
    ),
    Row(
        "rerotate-slots-dtype",
        ValueError,
        "slots: expected dtype in (int32, int64), got float32",
        lambda: rr_args(slots=torch.zeros(4)),
    ),
    Row(
        "rerotate-slots-rank",
        ValueError,
        "slots: expected a 1-D tensor (N,), got shape (2, 2)",
        lambda: rr_args(slots=torch.zeros(2, 2, dtype=torch.long)),
    ),
    Row(
        "rerotate-slots-device",
        ValueError,
        "slots: expected a tensor on cpu (the device of k_cache), got one on meta",
        lambda: rr_args(slots=torch.zeros(4, dtype=torch.long, device="meta")),
    ),
    Row(
        "rerotate-dst-shape",
        ValueError,
        "dst_slots: expected shape (4,) (that of slots), got shape (3,)",
        lambda: rr_args(dst_slots=torch.tensor([1, 2, 4])),
    ),
    Row(
        "rerotate-delta-type",
        TypeError,
        "delta: expected a (N,) or 0-d int32/int64 tensor or an int, got float",
        lambda: rr_args(delta=1.0),
    ),
    Row(
        "rerotate-delta-dtype",
        ValueError,
        "delta: expected dtype in (int32, int64), got float32",
        lambda: rr_args(delta=torch.ones(4)),
    ),
    Row(
        "rerotate-delta-int-range",
        ValueError,
        "delta: expected an int in (-16, 16) (the rows of cos_sin_cache), got 16",
        lambda: rr_args(delta=16),
    ),
    Row(
        "rerotate-delta-shape",
        ValueError,
        "delta: expected shape (4,) (that of slots), got shape (1,)",
        lambda: rr_args(delta=torch.tensor([1])),
    ),
    Row(
        "rerotate-table-dtype",
        ValueError,
        "cos_sin_cache: expected dtype in (float32, bfloat16, float16), got float64",
        lambda: rr_args(cos_sin_cache=make_cache(16, 64, dtype=torch.float64)),
    ),
    Row(
        "rerotate-rotary-vs-table",
        ValueError,
        "rotary_dim: expected the width of cos_sin_cache (64",
        lambda: rr_args(rotary_dim=32),
    ),
    Row(
        "rerotate-scale-value",
        ValueError,
        "k_scale: expected a finite scale > 0, got 0.0",
        lambda: rr_args(k_scale=0.0),
    ),
    Row(
        "rerotate-scale-device",
        ValueError,
        "k_scale: expected a tensor on cpu (the device of k_cache)",
        lambda: rr_args(k_scale=torch.ones(1, device="meta")),
    ),
    Row(
        "rerotate-table-in-cache",
        ValueError,
        "cos_sin_cache: expected memory disjoint from k_cache (which is written)",
        lambda: rr_args(cos_sin_cache=lambda a: a["k_cache"][0, 0]),
    ),
    Row(
        "rerotate-slot-strict",
        ValueError,
        "slots: expected values < 8 (num_blocks * block_size of k_cache; < 0 skips a row), got slots[2] = 8",
        lambda: rr_args(slots=torch.tensor([0, 3, 8, 6])),
        strict=True,
    ),
    Row(
        "rerotate-dst-strict",
        ValueError,
        "dst_slots: expected values < 8",
        lambda: rr_args(dst_slots=torch.tensor([1, 2, 4, 9])),
        strict=True,
    ),
    Row(
        "rerotate-delta-strict",
        ValueError,
        "delta: expected values in (-16, 16) (the rows of cos_sin_cache) where slots >= 0, got delta[1] = -16",
        lambda: rr_args(delta=torch.tensor([1, -16, 99, 4])),
        strict=True,
    ),
    Row(
        "rerotate-positions-without-to-cache",
        ValueError,
        "positions: expected None without to_cache",
        lambda: rr_args(positions=torch.tensor([2, 5, 0, 1])),
    ),
    Row(
        "rerotate-to-cache-without-positions",
        ValueError,
        "positions: expected a (N,) int32/int64 tensor of each row's current position when to_cache is given, got None",
        lambda: rr_args(to_cache=make_cache(32, 64)),
    ),
    Row(
        "rerotate-positions-type",
        TypeError,
        "positions: expected a torch.Tensor, got list",
        lambda: two_args(positions=[2, 5, 0, 1]),
    ),
    Row(
        "rerotate-positions-dtype",
        ValueError,
        "positions: expected dtype in (int32, int64), got float32",
        lambda: two_args(positions=torch.zeros(4)),
    ),
    Row(
        "rerotate-positions-shape",
        ValueError,
        "positions: expected shape (4,) (that of slots), got shape (3,)",
        lambda: two_args(positions=torch.tensor([2, 5, 0])),
    ),
    Row(
        "rerotate-positions-device",
        ValueError,
        "positions: expected a tensor on cpu (the device of k_cache), got one on meta",
        lambda: two_args(positions=torch.zeros(4, dtype=torch.long, device="meta")),
    ),
    Row(
        "rerotate-to-cache-type",
        TypeError,
        "to_cache: expected a torch.Tensor, got list",
        lambda: two_args(to_cache=[[1.0, 0.0]]),
    ),
    Row(
        "rerotate-to-cache-dtype",
        ValueError,
        "to_cache: expected dtype in (float32, bfloat16, float16), got float64",
        lambda: two_args(to_cache=make_cache(32, 64, dtype=torch.float64)),
    ),
    Row(
        "rerotate-to-cache-device",
        ValueError,
        "to_cache: expected a tensor on cpu (the device of k_cache), got one on meta",
        lambda: two_args(to_cache=torch.zeros(32, 64, device="meta")),
    ),
    Row(
        "rerotate-to-cache-width",
        ValueError,
        "to_cache: expected at least one row of width 64 (that of cos_sin_cache: both tables rotate the same dims), "
        "got shape (32, 32)",
        lambda: two_args(to_cache=make_cache(32, 32)),
    ),
    Row(
        "rerotate-to-cache-grad",
        ValueError,
        "to_cache: expected a tensor that does not require grad (rerotate_kv_cache is not differentiable)",
        lambda: two_args(to_cache=make_cache(32, 64).requires_grad_()),
    ),
    Row(
        "rerotate-to-cache-in-cache",
        ValueError,
        "to_cache: expected memory disjoint from k_cache (which is written)",
        lambda: two_args(to_cache=lambda a: a["k_cache"][0, 0]),
    ),
    Row(
        "rerotate-positions-in-cache",
        ValueError,
        "positions: expected memory disjoint from k_cache (which is written)",
        lambda: two_args(positions=lambda a: a["k_cache"][0, 0, 0, :4].view(torch.int32)),
    ),
    Row(
        "rerotate-two-tables-int-delta-range",
        ValueError,
        "delta: expected an int in (-16, 32) (positions are rows of cos_sin_cache, positions + delta rows of to_cache), "
        "got 32",
        lambda: two_args(delta=32),
    ),
    Row(
        "rerotate-positions-strict",
        ValueError,
        "positions: expected values in [0, 16) (the rows of cos_sin_cache) where slots >= 0, got positions[1] = 16",
        lambda: two_args(positions=torch.tensor([2, 16, 99, 1])),
        strict=True,
    ),
    Row(
        "rerotate-to-position-strict",
        ValueError,
        "delta: expected positions + delta in [0, 32) (the rows of to_cache) where slots >= 0, got delta[3] = 31 at "
        "positions[3] = 1",
        lambda: two_args(delta=torch.tensor([1, -5, 99, 31])),
        strict=True,
    ),
    Row(
        "rerotate-dst-is-source-strict",
        ValueError,
        "dst_slots: expected rows that are not source rows (slots) of the same call, got dst_slots[1] = 0",
        lambda: rr_args(dst_slots=torch.tensor([1, 0, 2, 5])),
        strict=True,
    ),
]


def _snapshot(args):
    return {
        n: bits(v.detach()).clone() for n, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"
    }


@pytest.mark.parametrize("row", BAD_ROWS, ids=[r.id for r in BAD_ROWS])
def test_bad_input(row):
    args = row.make()
    before = _snapshot(args)
    with strict.strict(row.strict):
        with pytest.raises(row.exc) as info:
            rerotate_kv_cache(**args)
    message = str(info.value)
    assert row.fragment in message, message
    assert message.startswith("rerotate_kv_cache: "), message
    for name, b in _snapshot(args).items():
        assert torch.equal(b, before[name]), f"{name} was written before the error"


def test_strict_mode_int_delta_and_scale():
    args = rr_args(delta=-16)
    with strict.strict(), pytest.raises(ValueError, match=r"delta: expected an int in \(-16, 16\)"):
        rerotate_kv_cache(**args)
    args = rr_args(k_scale=torch.tensor([float("inf")]))
    with strict.strict(), pytest.raises(ValueError, match="k_scale: expected a finite scale > 0, got inf"):
        rerotate_kv_cache(**args)
    # strict mode accepts what is valid, padding rows' deltas included
    args = rr_args(delta=torch.tensor([1, -2, 999, 4]))
    with strict.strict():
        rerotate_kv_cache(**args)
    # two tables: int shifts bounded per row, padding rows' positions and shifts not checked
    args = two_args(positions=torch.tensor([2, 15, -7, 1]), delta=torch.tensor([29, -15, 2**62, 30]))
    with strict.strict():
        rerotate_kv_cache(**args)
    with strict.strict(), pytest.raises(ValueError, match=r"got delta\[1\] = 17 at positions\[1\] = 15"):
        rerotate_kv_cache(**two_args(positions=torch.tensor([2, 15, 0, 1]), delta=17))


def test_handled_rows():
    """The doc's 'handled without an error' rows for rerotate_kv_cache (default mode)."""
    table = make_cache(16, 32)
    # ok-rerotate-delta-out-of-range: NaN in the rotated dims, tail and other rows untouched
    a = rr_args(cos_sin_cache=table, delta=torch.tensor([16, 1, 2, -40]))
    before = a["k_cache"].clone()
    rerotate_kv_cache(**a)
    k = a["k_cache"].flatten(0, 1)
    assert k[[0, 6], :, :32].isnan().all() and torch.equal(k[[0, 6], :, 32:], before.flatten(0, 1)[[0, 6], :, 32:])
    assert not k[3].isnan().any()
    # ok-rerotate-slot-padding and ok-rerotate-slot-past-cache: nothing written for those rows
    for slots, dsts in (
        (torch.tensor([-1, -7, 8, 99]), None),
        (torch.tensor([0, 3, 8, 6]), torch.tensor([-1, 8, 1, 9])),
    ):
        a = rr_args(slots=slots, dst_slots=dsts)
        base = a["k_cache"]._base.clone()
        rerotate_kv_cache(**a)
        assert torch.equal(bits(a["k_cache"]._base), bits(base))
    # ok-rerotate-dst-is-source: accepted without strict mode (result in those rows unspecified)
    rerotate_kv_cache(**rr_args(dst_slots=torch.tensor([1, 0, 2, 5])))
    # ok-rerotate-two-tables-out-of-range: a position past cos_sin_cache, positions + delta past
    # either end of to_cache: NaN in the rotated dims, the rest untouched
    a = two_args(positions=torch.tensor([16, 5, 0, 3]), delta=torch.tensor([0, 27, 3, -4]))
    base = a["k_cache"]._base.clone()
    rerotate_kv_cache(**a)
    k, others = a["k_cache"].flatten(0, 1), [1, 2, 4, 5, 7]
    assert k[[0, 3, 6]].isnan().all()
    assert torch.equal(bits(k[others]), bits(base[:, 0].flatten(0, 1)[others]))
    assert torch.equal(bits(a["k_cache"]._base[:, 1]), bits(base[:, 1]))


DOC = Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md"
HANDLED_IDS = [
    "ok-rerotate-delta-out-of-range",
    "ok-rerotate-slot-padding",
    "ok-rerotate-slot-past-cache",
    "ok-rerotate-dst-is-source",
    "ok-rerotate-two-tables-out-of-range",
]
DOC_IDS = [r.id for r in BAD_ROWS] + HANDLED_IDS


def test_doc_rows_match():
    """docs/bad_inputs.md lists every rerotate row with this file's exception and fragment."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\|\s*`([a-z0-9-]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [c.strip().strip("`") for c in m.group(2).split("|")]
    assert sorted(i for i in rows if "rerotate" in i) == sorted(DOC_IDS)
    for row in BAD_ROWS:
        op, exc, fragment = rows[row.id][0], rows[row.id][3], rows[row.id][4]
        assert (op, exc, fragment) == ("rerotate_kv_cache", row.exc.__name__, row.fragment), row.id


# ---------------------------------------------------------------------------------------------
# torch.compile and torch.library


def _mla_fn(cache, slots, delta, table, dsts):
    rerotate_kv_cache(cache[..., 32:], slots, delta, table, interleaved=True, k_scale=2.0, dst_slots=dsts)
    rerotate_kv_cache(cache[..., 32:], dsts, -3, table, interleaved=True)
    return cache.sum()


def _compile_matches_eager(device, backend):
    cache = torch.full((3, 4, 1, 32 + 16), NAN, device=device)
    cache[..., 32:] = torch.randn(3, 4, 1, 16, device=device)
    args = (
        torch.tensor([3, 7, -1, 9], device=device),
        torch.tensor([2, -5, 1, 40], device=device),
        make_cache(32, 16, device=device),
        torch.tensor([0, 1, 2, 4], device=device),
    )
    c_e = cache.clone()
    _mla_fn(c_e, *args)
    torch._dynamo.reset()
    fn = torch.compile(_mla_fn, backend=backend, fullgraph=True)
    c_c = cache.clone()
    fn(c_c, *args)
    assert torch.equal(bits(c_c), bits(c_e)), "compiled re-rotation differs from eager"
    assert not torch.equal(bits(c_c), bits(cache))


def test_torch_compile_fullgraph_mla_views():
    _compile_matches_eager("cpu", "aot_eager")


def test_opcheck():
    from ropekit.core.variant import Variant

    args = (
        torch.randn(2, 4, 1, 32),
        torch.tensor([1, 0, 5]),
        torch.tensor([2, -1, 3]),
        0,
        make_cache(8, 32),
        Variant(angles="delta", k_scaled=True, to_dst=True).encode(),
        32,
        torch.tensor([2.0]),
        torch.tensor([2, 3, -1]),
    )
    torch.library.opcheck(torch.ops.ropekit.rerotate_kv_cache.default, args)
    interleaved = Variant(True, True, angles="delta").encode()
    args = (torch.randn(8, 2, 32), torch.tensor([1, 0, 5]), None, -3, make_cache(8, 32), interleaved, 32, None, None)
    torch.library.opcheck(torch.ops.ropekit.rerotate_kv_cache.default, args)
    halves = Variant(angles="delta", rope_halves=True).encode()  # rotary_position='halves': pairs (i, i + 16)
    args = (torch.randn(8, 2, 32), torch.tensor([1, 0, 5]), None, 2, make_cache(8, 8), halves, 8, None, None)
    torch.library.opcheck(torch.ops.ropekit.rerotate_kv_cache.default, args)


# ---------------------------------------------------------------------------------------------
# benchmark workload W12: inputs, oracle and peers agree (CPU, quick sizes)


@pytest.mark.parametrize("wid", ["W12", "W12-fp8", "W12-mla", "W12-2T"])
def test_bench_w12_peers_pass_the_check(monkeypatch, wid):
    from ropekit.tools.bench import peers as P
    from ropekit.tools.bench import runner, workloads

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU paths: a check, not a timing
    wl = workloads.BY_ID[wid]
    s = wl.sizes(True)
    table = workloads.make_table(wl, s, "cpu")
    base = workloads.make_inputs(wl, s, table, "cpu", 0)
    exp = workloads.expected(wl, base, workloads.Oracle())
    nbytes = workloads.min_bytes(wl, base)
    row = 64 if wid == "W12-mla" else 8 * 128
    assert nbytes == 2 * s["N"] * row * base["k_cache"].element_size() + 16 * s["N"]
    cfg = runner.Config(workloads=[wl], device="cpu", progress=False, rep_ms=1.0)
    for peer in (P.Ropekit(), P.Reference(), P.TorchEager()):
        rec = runner.run_one(peer, wl, base, exp, [], nbytes, 10.0, "cpu", cfg)
        assert rec["status"] == "ok", rec
        assert rec["rel_err"]["k_cache[other]"] == 0.0
    rec = runner.run_one(P.Liger(), wl, base, exp, [], nbytes, 10.0, "cpu", cfg)
    assert rec["status"] == "n/a", rec


# ---------------------------------------------------------------------------------------------
# 64-bit addressing


def big_cases():
    """Caches whose rows sit past element 2^31, on untouched torch.empty pages (the subprocess).

    A paged cache with a block stride of 2^30 elements (block 2 starts at 2^31) and a flat cache of
    2^24 + 4 slots of 128 elements (slot 2^24 starts at 2^31): a kernel that multiplies a slot or
    block index by a stride in int32 wraps and reads or writes the wrong address.
    """
    H, D = 2, 64
    table = make_cache(32, D)

    def run(kc, slots, delta, dsts, poison):
        for view in poison:
            view.fill_(NAN)
        src_rows = []
        paged = kc.dim() == 4

        def at(slot):
            return (slot // kc.shape[1], slot % kc.shape[1]) if paged else (slot,)

        for s in slots.tolist():
            kc[at(s)] = torch.randn(H, D).to(kc.dtype)
            src_rows.append(kc[at(s)].double().clone())
        x = torch.stack(src_rows).unsqueeze(1)  # (N, 1, H, D) flat "cache"
        want = x.clone()
        reference.rerotate_kv_cache(want, torch.arange(len(src_rows)), delta, table.double())
        rerotate_kv_cache(kc, slots, delta, table, dst_slots=dsts)
        out = slots if dsts is None else dsts
        for i, s in enumerate(out.tolist()):
            got = kc[at(s)].double()
            assert ((got - want[i, 0]).abs() <= 1.6e-2 * (1 + want[i, 0].abs())).all(), f"row of slot {s}"
        if dsts is not None:
            for i, s in enumerate(slots.tolist()):
                assert torch.equal(kc[at(s)].double(), x[i, 0]), f"source row of slot {s} changed"
        written = sum(int((~torch.isnan(view)).sum()) for view in poison)
        n = len(src_rows) * (1 if dsts is None else 2)
        assert written == n * H * D, f"{written} elements written"

    # paged, block stride 2^30: blocks 0 and 2 are the pages used
    BS = 4
    buf = torch.empty(2 * 2**30 + BS * H * D, dtype=torch.bfloat16)
    kc = buf.as_strided((3, BS, H, D), (2**30, H * D, D, 1))
    assert kc[2].storage_offset() + kc[2].numel() > 2**31
    run(kc, torch.tensor([2 * BS + 1, 3], dtype=torch.int32), torch.tensor([5, -7]), None, [kc[0], kc[2]])
    run(kc, torch.tensor([2 * BS + 3, 1]), 9, torch.tensor([0, 2 * BS], dtype=torch.int32), [kc[0], kc[2]])
    del buf, kc
    # flat, 2^24 + 4 slots of 2 x 64: slot 2^24 starts at element 2^31
    NS = 2**24 + 4
    kc = torch.empty(NS, H, D, dtype=torch.bfloat16)
    assert kc.numel() > 2**31
    run(
        kc,
        torch.tensor([NS - 1, 2**24, 5], dtype=torch.int32),
        torch.tensor([1, -2, 3]),
        None,
        [kc[:8], kc[2**24 - 2 :]],
    )
    run(kc, torch.tensor([2**24 + 1, 6]), -4, torch.tensor([3, NS - 2]), [kc[:8], kc[2**24 - 2 :]])
    print("OK")


@pytest.mark.skipif(sys.platform != "linux", reason="relies on untouched pages of torch.empty (Linux overcommit)")
def test_cache_offsets_past_2_31():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(
        [sys.executable, str(Path(__file__)), "big"], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["nhd", "hnd", "mla"])
@pytest.mark.parametrize("mode", ["inplace", "dst"])
def test_gpu_w12_shape(layout, cache_dtype, mode):
    """W12's heads (8 x 128; MLA 1 x 64 of a 576-wide row), block_size 16, random rows and deltas."""
    H, D = (8, 128) if layout != "mla" else (1, 64)
    fill = fp8_values if cache_dtype == FP8 else None
    cache = Cache(LAYOUTS[layout], 128, 16, H, D, cache_dtype, "cuda", fill=fill)
    r = random.Random(layout + str(cache_dtype) + mode)
    slots, delta, dsts = random_case(
        r, cache.num_slots, 512, "cuda", max_pos=4096, n_pad=7, n_bad=3, dst=mode == "dst", zero=5
    )
    scale = {"k_scale": torch.tensor([0.05], device="cuda")} if cache_dtype == FP8 else {}
    check(cache, slots, delta, make_cache(4096, D, device="cuda"), interleaved=layout == "mla", dst_slots=dsts, **scale)


@pytest.mark.gpu
def test_gpu_torch_compile_inductor():
    _compile_matches_eager("cuda", "inductor")


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Captured once, replayed on new slots and deltas (tensors read on the device at replay)."""
    dev = "cuda"
    table = make_cache(64, 64, device=dev)
    kc = torch.randn(4, 16, 2, 64, device=dev).to(torch.bfloat16)
    slots = torch.tensor([3, 9, -1, 40], device=dev)
    delta = torch.tensor([1, -2, 3, 4], device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        rerotate_kv_cache(kc.clone(), slots, delta, table)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    work = kc.clone()
    with torch.cuda.graph(g):
        rerotate_kv_cache(work, slots, delta, table)
    slots.copy_(torch.tensor([7, -1, 12, 63], device=dev))
    delta.copy_(torch.tensor([-9, 5, 30, -1], device=dev))
    want = kc.clone()
    rerotate_kv_cache(want, slots, delta, table)
    work.copy_(kc)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(work), bits(want))


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("layout", ["flat", "hnd"])
def test_bigmem_cuda_cache_past_2_31_elements(layout):
    """A real bf16 cache above 2^31 elements (4.3 GB), rows re-rotated at both ends, in place and into dst."""
    H, D = 8, 128
    NB, BS = (2**21 + 64, 1) if layout == "flat" else (2**17 + 4, 16)
    k = (
        torch.empty(NB * BS, H, D, dtype=torch.bfloat16, device="cuda")
        if layout == "flat"
        else torch.empty(NB, H, BS, D, dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3)
    )
    k.fill_(NAN)
    assert k.numel() > 2**31
    n = NB * BS

    def at(s):
        return (s // BS, s % BS) if layout == "hnd" else (s,)

    slots = torch.tensor([n - 1, 2**21 + 1, 0, n - 17, -1, 5], device="cuda")
    dsts = torch.tensor([2**21 + 3, n - 2, 7, 1, 2, n - 40], device="cuda")
    delta = torch.tensor([5, -9, 100, -4095, 3, 0], device="cuda")
    table = make_cache(4096, D, device="cuda")
    rows = {}
    for s in slots.tolist():
        if s >= 0:
            k[at(s)] = torch.randn(H, D, device="cuda").to(torch.bfloat16)
            rows[s] = k[at(s)].double().cpu()
    for dst in (None, dsts):
        src_vals = torch.stack([rows.get(s, torch.zeros(H, D, dtype=torch.float64)) for s in slots.tolist()])
        want = src_vals.unsqueeze(1).clone()
        reference.rerotate_kv_cache(want, torch.arange(len(slots)), delta.cpu(), table.double().cpu())
        rerotate_kv_cache(k, slots, delta, table, dst_slots=dst)
        torch.cuda.synchronize()
        out = slots if dst is None else dst
        for i, (s, o) in enumerate(zip(slots.tolist(), out.tolist())):
            if s < 0:
                continue
            assert_close(k[at(o)], want[i, 0], TOL[torch.bfloat16], f"row {o}")
            rows[s] = k[at(s)].double().cpu()
    n_rows = int((slots >= 0).sum()) * 2
    assert int((~torch.isnan(k)).sum()) == n_rows * H * D, "elements written outside the rows"


if __name__ == "__main__":
    {"big": big_cases}[sys.argv[1]]()
