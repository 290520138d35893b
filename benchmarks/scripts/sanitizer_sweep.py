#!/usr/bin/env python3
"""Usage: compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/scripts/sanitizer_sweep.py [-n N]

Memory-checking sweep: every ropekit op over N seeded random configurations, checked against the
float64 reference. Meant to run under CUDA's memcheck (the line above) and to end with
`sweep: N configs, M ops, 0 failures` and memcheck's `ERROR SUMMARY: 0 errors`.
Dry run without a GPU (the Triton kernels in the interpreter, on CPU tensors):

    python3 benchmarks/scripts/sanitizer_sweep.py --device cpu -n 40

What a configuration covers (drawn with random.Random(seed)):
- apply_rope: half-split and interleaved pairs, partial rotary, Dk != Dq, M-RoPE chunked and
  interleaved with (3, *T) positions, (T,) and (B, S) token dims, q/k exact allocations, padded
  views, transposed (head-major) storage, fused-qkv views, MLA q_pe slices; fp16/bf16/fp32 inputs,
  fp32/bf16/fp16 tables (exact or a column slice of a wider buffer); int32/int64 positions
  (contiguous or strided), None, and out-of-range ones (negative, == max_position, the int32 / int64
  extremes): their rows must come back NaN, never an out-of-bounds read; in place and out of
  place (out of place then in place on the same inputs), k None; some with requires_grad and a
  backward (the custom-op path and the inverse rotation); rotary_position='halves' (Gemma 4's
  p-RoPE: the pairs (i, i + D/2), the other dims kept) now and then, with the norm and the store
  too. The conventions on the same inputs: layout='sbhd' ((S, B, H, D) views, (S, B) positions),
  destinations q_out= / k_out= (slices of NaN buffers, fp8 with scales too),
  rotary_position='last', q and k of last stride 2 (the documented copy, out of place and in
  place), q and k as rope parts with q_nope / k_nope.
- rotate_with_angles: per-token cos/sin, broadcast over the batch, views of Hugging Face's
  duplicated halves, M-RoPE (3, *T, half) angles, out_interleaved != interleaved.
- apply_rope_and_store: paged NHD and HND caches, flat, joint k/v buffers, padded caches, MLA
  views of one joint row; fp16/bf16/fp32/fp8 (e4m3 and e5m2) caches, float and tensor scales;
  slot_mapping with padding (< 0) and slots past the cache; bad positions; the serving-engine
  forms: write_key (k written back), q_out in bf16/fp32/e4m3/e5m2 with q_scale, MLA's k_nope
  (into views of the row, or the joint row split by the op), FlashInfer's heads in two parts
  (k as its rope part with k_nope beside v, q with q_nope into q_out), last dims that are not
  contiguous (v, k_nope and q_nope read through their strides, k and q with q_out through a copy).
- rerotate_kv_cache: the same cache layouts and dtypes, in place and into dst slots, int32/int64
  slots (strided too), tensor and int shifts with ones past the table (extremes included), padding
  and slots past the cache, float and tensor scales; rotary_position='halves' now and then.
- refusals: overlapping in-place q/k, overlapping caches, a cache overlapping k: must raise
  ValueError with nothing written (the address checks, on device tensors).

Every tensor is either its own allocation or a view with a known place in a bigger buffer (its
base). After each op every base is compared with the oracle: written elements within tolerance
(NaN exactly where the reference has NaN), everything else bit-identical. Outputs of out-of-place
calls are allocated NaN-filled (run.empty_like is swapped), so an element the kernel skips fails.

PYTORCH_NO_CUDA_MEMORY_CACHING=1 is set before torch loads: each tensor is then its own cudaMalloc,
so memcheck sees the exact bounds of every exactly-allocated tensor (the caching allocator would
hide an overrun inside its 2 MB segments). Shapes are tiny (10-100 KB a configuration) and head
sizes come from a short list, so few kernel variants are compiled: the run is dominated by memcheck's
per-launch cost. `--variants-only` counts the kernel specializations a run would compile without
running anything (fast on CPU).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--n", type=int, default=320, help="number of configurations (default 320)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: dry run, the kernels in the Triton interpreter (about a minute for 320)",
    )
    p.add_argument("--only", default=None, help="comma-separated kinds: rope,angles,store,refuse,rerotate,norm")
    p.add_argument(
        "--pool",
        type=int,
        default=32,
        help="kernel-shaping templates for apply_rope (half as many for the other ops): what "
        "bounds the number of compiled kernel variants (default 32)",
    )
    p.add_argument(
        "--variants-only",
        action="store_true",
        help="record the kernel specializations the run would compile; run nothing",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="one line per configuration")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

import ropekit  # noqa: E402
from ropekit.api.store import apply_rope_and_store  # noqa: E402
from ropekit.core import run, tuning  # noqa: E402
from ropekit.tools import reference  # noqa: E402

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8S = (FP8, E5M2)
NAN = float("nan")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# elementwise |got - want| <= TOL * (1 + |want|): one rounding to the dtype plus float32 math
TOL = {F32: 2e-6, F16: 2e-3, BF16: 1.6e-2}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Failure(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# tensors with a known place in a buffer


class Buf:
    """A contiguous CPU buffer (the base) copied to the device, and views of it by (shape, stride, offset)."""

    def __init__(self, name, base: torch.Tensor, device):
        self.name = name
        self.cpu = base.contiguous()
        self.dev = self.cpu.to(device)
        self.written = torch.zeros(self.cpu.shape, dtype=torch.bool)
        self.want = None  # float64 oracle of the base, made on first write

    def view(self, x: torch.Tensor):
        """The spec of a view x of self.cpu, and the same view of the device copy."""
        spec = (tuple(x.shape), tuple(x.stride()), x.storage_offset())
        return spec, self.dev.as_strided(*spec)

    def expect(self, spec, values: torch.Tensor, cols=None):
        """The oracle says the view `spec` (its last-dim columns `cols`) holds values (float64)."""
        if self.want is None:
            self.want = self.cpu.double()
        w = self.want.as_strided(*spec)
        m = self.written.as_strided(*spec)
        if cols is not None:
            w, m, values = w[..., cols], m[..., cols], values[..., cols]
        w.copy_(values)
        m.fill_(True)

    def check(self):
        got = self.dev.cpu()
        bits = INT_OF_SIZE[got.element_size()]
        untouched = ~self.written
        if not torch.equal(got.view(bits)[untouched], self.cpu.view(bits)[untouched]):
            n = int((got.view(bits) != self.cpu.view(bits))[untouched].sum())
            raise Failure(f"{self.name}: {n} elements outside the written ones changed")
        if self.written.any():
            close(got[self.written], self.want[self.written], got.dtype, self.name)


def close(got, want, dtype, what):
    """Elementwise within tolerance, NaN exactly where want is NaN."""
    got, want = got.double().cpu(), want.double().cpu()
    if dtype in FP8S and INTERPRETED:
        # the Triton interpreter's float32 -> fp8 cast is wrong when rounding carries into the
        # exponent (1.99 -> 1.0) and flushes subnormals (see tests/ops/store/test_store.py): a dry run checks
        # fp8 rows loosely (and its NaN -> e4m3 cast gives 384); on the GPU they are held to half an ulp
        ok = ((got - want).abs() <= 0.5 * want.abs() + 2.0**-6) | want.isnan()
    elif dtype == FP8:  # e4m3: 3 mantissa bits, half an ulp is 2^-4 of the value (2^-10 when subnormal)
        ok = (got - want).abs() <= 2.0**-4 * want.abs() * 1.001 + 2.0**-10
    elif dtype == E5M2:  # e5m2: 2 mantissa bits, half an ulp is 2^-3 of the value (2^-17 when subnormal)
        ok = (got - want).abs() <= 2.0**-3 * want.abs() * 1.001 + 2.0**-17
    else:
        ok = (got - want).abs() <= TOL[dtype] * (1 + want.abs())
    ok |= got.isnan() & want.isnan()
    if not bool(ok.all()):
        bad = ~ok
        raise Failure(
            f"{what}: {int(bad.sum())} of {ok.numel()} elements off; first got "
            f"{got[bad][:3].tolist()} want {want[bad][:3].tolist()}"
        )
    finite = ~want.isnan()
    err = ((got[finite] - want[finite]).norm() / want[finite].norm().clamp_min(1e-30)).item() if finite.any() else 0.0
    STATS["max_rel_err"][dtype] = max(STATS["max_rel_err"].get(dtype, 0.0), err)


STATS = {"max_rel_err": {}, "nan_rows": 0}


def dev(x, device):
    """x on the device with its strides and offset: its base copied, then the same view of the copy
    (Tensor.to would make a non-dense view contiguous, losing the layout under test)."""
    base = x if x._base is None else x._base
    assert base.is_contiguous()
    return base.to(device).as_strided(x.shape, x.stride(), x.storage_offset())


def randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def make_table(max_pos, rot, dtype):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.cat((f.cos(), f.sin()), dim=-1).to(dtype)


def heads_view(r, gen, name, lead, H, D, dtype, device, style):
    """A (*lead, H, D) tensor in the given storage style, as (Buf, spec, device view)."""
    shape = (*lead, H, D)
    if style == "exact":  # its own allocation: memcheck sees its bounds
        buf = Buf(name, randn(shape, dtype, gen), device)
        x = buf.cpu
    elif style == "padded":  # slack in every dim, a nonzero offset
        odd = r.random() < 0.15  # rows off the 16-byte grid now and then
        # pads and offsets keep 16-byte alignment (Triton compiles a variant per alignment pattern)
        # except now and then, when rows and the base pointer go off the 16-byte grid
        pads = [r.choice((0, 1, 2)) for _ in lead] + [r.choice((0, 1)), r.choice((3, 5)) if odd else r.choice((0, 16))]
        base = randn(tuple(n + p for n, p in zip(shape, pads)), dtype, gen)
        buf = Buf(name, base, device)
        offs = [r.randint(0, p) for p in pads[:-1]] + [r.choice((0, pads[-1]))]
        x = buf.cpu[tuple(slice(o, o + n) for n, o in zip(shape, offs))]
    elif style == "transposed":  # head-major storage (H, *lead, D), or (S, B, H, D)
        if len(lead) == 2 and r.random() < 0.5:
            base = randn((lead[1], lead[0], H, D), dtype, gen)
            buf = Buf(name, base, device)
            x = buf.cpu.transpose(0, 1)
        else:
            base = randn((H, *lead, D), dtype, gen)
            buf = Buf(name, base, device)
            x = buf.cpu.movedim(0, -2)
    else:
        raise ValueError(style)
    spec, xd = buf.view(x)
    return buf, spec, xd


POS_LAYOUTS = ("contig", "contig", "strided", "transposed")


def positions_tensor(r, gen, lead, max_pos, mrope, dtype, bad, how="contig"):
    """(*lead) or (3, *lead) positions, some out of range when bad; contiguous or a strided view."""
    shape = ((3,) if mrope else ()) + tuple(lead)
    p = torch.randint(0, max_pos, shape, generator=gen, dtype=torch.int64)
    if bad:
        extremes = [-1, max_pos, max_pos + 7, -(2**31)]
        extremes += [2**31 - 1] if dtype == torch.int32 else [2**40, -(2**62)]
        flat = p.view(-1)
        for _ in range(r.randint(1, 2)):
            flat[r.randrange(flat.numel())] = r.choice(extremes)
    p = p.to(dtype)
    if how == "strided":  # every other element of a wider buffer
        wide = torch.full((*shape[:-1], 2 * shape[-1]), -5, dtype=dtype)
        wide[..., ::2] = p
        return wide[..., ::2]
    if how == "transposed" and p.dim() >= 2:
        return p.transpose(-1, -2).contiguous().transpose(-1, -2)
    return p


def rotated_cols(rot, D, halves):
    """The columns of a head a rotation writes: [0, rot), or with rotary_position='halves' the two
    runs of its pairs (i, i + D/2), [0, rot/2) and [D/2, D/2 + rot/2)."""
    return (slice(0, rot // 2), slice(D // 2, D // 2 + rot // 2)) if halves else (slice(0, rot),)


def table_view(r, max_pos, rot, dtype):
    t = make_table(max_pos, rot, dtype)
    if r.random() < 0.35:  # a column slice of a wider buffer
        off = r.choice((0, 8))
        wide = torch.zeros(max_pos, rot + 16, dtype=dtype)
        wide[:, off : off + rot] = t
        return wide[:, off : off + rot]
    return t


# ---------------------------------------------------------------------------------------------
# configurations

# (Dq, Dk, rotary_dim): full, partial, Dk != Dq; a short list keeps the compiled variants few
HEADS = [(64, 64, 64), (128, 128, 128), (128, 128, 64), (64, 64, 32), (80, 80, 80), (128, 64, 64), (32, 32, 32)]
MROPE = {128: [(16, 24, 24), (24, 20, 20)], 64: [(8, 12, 12), (12, 10, 10)], 32: [(4, 6, 6)]}
DTYPES = (F16, BF16, F32)


# token dims: their form is part of a template, because Triton specializes int arguments equal to 1
# (a single token, S == 1) and divisible by 16, and a single token dim has a zero batch stride
TOKEN_FORMS = ("T1", "T", "T", "BS", "BS1")


def token_shape(r, form):
    if form == "T1":  # decode, one sequence
        return (1,)
    if form == "T":
        return (r.randint(2, 8),)
    if form == "BS1":  # decode, a batch of sequences
        return (r.randint(2, 3), 1)
    return (r.randint(2, 3), r.randint(2, 5))


def describe(cfg):
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def heads_of_row(base, start, H, D):
    """(*T, H, D) heads at [start, start + H * D) of each row of a (*T, row) buffer, every token dim
    with the buffer's stride (`unflatten` would give a size-1 token dim its own stride, and
    the overlap check must accept such fused q/k views: a false refusal would be reported)."""
    return base.as_strided((*base.shape[:-1], H, D), (*base.stride()[:-1], D, 1), base.storage_offset() + start)


def pick_qk(r, gen, lead, Hq, Hk, Dq, Dk, dtype, device, allow_fused=True):
    """q and k (k None when Hk == 0) in one of the storage styles; returns bufs, specs, views, style."""
    styles = (
        ["exact", "exact", "padded", "transposed"]
        + (["fused"] if allow_fused and Hk and Dq == Dk else [])
        + (["mla"] if Dq == Dk and Dq <= 64 else [])
    )
    style = r.choice(styles)
    if style == "fused":  # views of one (*lead, (Hq + 2 Hk) * D) projection
        D = Dq
        base = randn((*lead, (Hq + 2 * Hk) * D), dtype, gen)
        buf = Buf("qkv", base, device)
        q = heads_of_row(buf.cpu, 0, Hq, D)
        k = heads_of_row(buf.cpu, Hq * D, Hk, D)
        (qs, qd), (ks, kd) = buf.view(q), buf.view(k)
        return [buf], (buf, qs, qd), (buf, ks, kd), style
    if style == "mla":  # q_pe: the last Dq of a (nope + Dq)-wide head
        nope = 128
        base = randn((*lead, Hq, nope + Dq), dtype, gen)
        buf = Buf("q_full", base, device)
        qs, qd = buf.view(buf.cpu[..., nope:])
        kb, ks, kd = heads_view(r, gen, "k_pe", lead, Hk, Dk, dtype, device, "exact") if Hk else (None, None, None)
        return [b for b in (buf, kb) if b is not None], (buf, qs, qd), (kb, ks, kd), style
    qb, qs, qd = heads_view(r, gen, "q", lead, Hq, Dq, dtype, device, style)
    kst = style if r.random() < 0.6 else r.choice(("exact", "padded", "transposed"))
    kb, ks, kd = heads_view(r, gen, "k", lead, Hk, Dk, dtype, device, kst) if Hk else (None, None, None)
    return [b for b in (qb, kb) if b is not None], (qb, qs, qd), (kb, ks, kd), style


class Pool:
    """Kernel-shaping choices (head sizes, head counts, dtypes, flags: what Triton compiles a variant
    for) drawn once per kind as a pool of templates; each configuration takes one template and
    randomizes everything else (token dims, views and strides, positions and slots, bad values).
    Under memcheck compiling is the cost that grows with variety, launching is cheap."""

    def __init__(self, seed, make, size):
        r = random.Random(seed)
        self.items = [make(r) for _ in range(size)]

    def pick(self, r):
        return dict(r.choice(self.items))


def _rope_template(r):
    Dq, Dk, rot = r.choice(HEADS)
    Hq = r.choice((1, 3, 8))
    mrope = r.choice(MROPE[rot]) if rot in MROPE and r.random() < 0.25 else None
    il = r.random() < 0.5
    return dict(
        form=r.choice(TOKEN_FORMS),
        pos_layout=r.choice(POS_LAYOUTS),
        Dq=Dq,
        Dk=Dk,
        rot=rot,
        Hq=Hq,
        Hk=r.choice((0, 1, 2, Hq)),
        dtype=r.choice(DTYPES),
        il=il,
        mrope=mrope,
        mrope_il=mrope is not None and r.random() < 0.5,
        tdtype=r.choice((F32, F32, F32, BF16, F16)),
        pdtype=r.choice((torch.int32, torch.int64)),
        grad=r.random() < 0.2,
        # rotary_position='halves': half-split pairs of one head size, a partial rotation
        halves=not il and Dq == Dk and rot < Dq and r.random() < 0.6,
    )


def run_rope(r, gen, device, cfg):
    """apply_rope out of place, then in place on the same inputs (or with grad and a backward)."""
    t = POOLS["rope"].pick(r)
    lead = token_shape(r, t["form"])
    Dq, Dk, rot, Hq, Hk, dtype, il = (t[n] for n in ("Dq", "Dk", "rot", "Hq", "Hk", "dtype", "il"))
    mrope, mrope_il, tdtype, pdtype = t["mrope"], t["mrope_il"], t["tdtype"], t["pdtype"]
    max_pos = r.choice((16, 32, 64, 64))
    bad = r.random() < 0.35
    use_none = mrope is None and not bad and lead[-1] <= max_pos and r.random() < 0.2
    grad = t["grad"] and r.random() < 0.5
    bufs, (qb, qs, q), (kb, ks, k), style = pick_qk(r, gen, lead, Hq, Hk, Dq, Dk, dtype, device)
    table = table_view(r, max_pos, rot, tdtype)
    pos = None if use_none else positions_tensor(r, gen, lead, max_pos, mrope, pdtype, bad, t["pos_layout"])
    cfg.update(
        T=lead,
        Hq=Hq,
        Hk=Hk,
        Dq=Dq,
        Dk=Dk,
        rot=rot,
        dtype=str(dtype)[6:],
        il=int(il),
        mrope=mrope,
        mrope_il=int(mrope_il),
        max_pos=max_pos,
        table=str(tdtype)[6:],
        pos=None if pos is None else f"{str(pdtype)[6:]}{'!' if bad else ''}",
        style=style,
        grad=int(grad),
        halves=int(t["halves"]),
    )
    position = "halves" if t["halves"] else "first"
    kw = dict(interleaved=il, rotary_dim=rot, mrope_section=mrope, mrope_interleaved=mrope_il, rotary_position=position)

    q64 = q.detach().cpu().double()
    k64 = None if k is None else k.detach().cpu().double()
    tab64 = table.double()
    rq, rk = reference.apply_rope(q64, k64, pos, tab64, **kw)
    if bad:
        STATS["nan_rows"] += int(rq.isnan().any(-1).any(-1).sum())
    pos_d = None if pos is None else dev(pos, device)
    table_d = dev(table, device)
    n_ops = 0

    if grad:
        qg = q.detach().clone().requires_grad_()
        kg = None if k is None else k.detach().clone().requires_grad_()
        qo, ko = ropekit.apply_rope(qg, kg, pos_d, table_d, **kw)
        gq = randn(qo.shape, dtype, gen)
        gk = None if ko is None else randn(ko.shape, dtype, gen)
        torch.autograd.backward(
            [x for x in (qo, ko) if x is not None], [g.to(device) for g in (gq, gk) if g is not None]
        )
        sync(device)
        n_ops += 2
        close(qo.detach(), rq, dtype, "q_out (grad)")
        c, s = reference.angles_from_table(
            tab64, pos, lead, rotary_dim=rot, mrope_section=mrope, mrope_interleaved=mrope_il
        )
        back = dict(interleaved=il, inverse=True, rotary_position=position)
        close(qg.grad, reference.rotate(gq.double(), c, s, **back), dtype, "q.grad")
        if k is not None:
            close(ko.detach(), rk, dtype, "k_out (grad)")
            close(kg.grad, reference.rotate(gk.double(), c, s, **back), dtype, "k.grad")
        for b in bufs:
            b.check()
        return n_ops

    # out of place: outputs NaN-filled before the kernel; inputs untouched
    qo, ko = ropekit.apply_rope(q, k, pos_d, table_d, **kw)
    sync(device)
    n_ops += 1
    close(qo, rq, dtype, "q_out")
    if k is None:
        if ko is not None:
            raise Failure("k_out is not None for k None")
    else:
        close(ko, rk, dtype, "k_out")
    for b in bufs:
        b.check()
    if qo.data_ptr() == q.data_ptr():
        raise Failure("out of place returned q itself")
    if r.random() < 0.3:
        n_ops += run_rope_outputs(r, q, k, q64, k64, pos, tab64, pos_d, table_d, rq, rk, lead, dtype, device, cfg, kw)
        for b in bufs:
            b.check()
    if r.random() < 0.4:
        n_ops += run_rope_conventions(
            r, q, k, q64, k64, pos, tab64, pos_d, table_d, rq, rk, lead, dtype, device, cfg, kw
        )
        for b in bufs:
            b.check()

    # in place on the same inputs: the rotated dims change, the tails and all else stay
    for cols in rotated_cols(rot, Dq, t["halves"]):
        qb.expect(qs, rq, cols=cols)
        if k is not None:
            kb.expect(ks, rk, cols=cols)
    out = ropekit.apply_rope(q, k, pos_d, table_d, inplace=True, **kw)
    sync(device)
    n_ops += 1
    if out[0] is not q or out[1] is not k:
        raise Failure("in place did not return q and k")
    for b in bufs:
        b.check()
    return n_ops


def run_rope_outputs(r, q, k, q64, k64, pos, tab64, pos_d, table_d, rq, rk, lead, dtype, device, cfg, kw):
    """The core's output flags on the same inputs: inverse=True, or fp8 outputs with scales."""
    if r.random() < 0.5:
        cfg.update(extra="inverse")
        qi, ki = ropekit.apply_rope(q, k, pos_d, table_d, inverse=True, **kw)
        sync(device)
        c, s = reference.angles_from_table(
            tab64,
            pos,
            lead,
            rotary_dim=kw["rotary_dim"],
            mrope_section=kw["mrope_section"],
            mrope_interleaved=kw["mrope_interleaved"],
        )
        back = dict(interleaved=kw["interleaved"], inverse=True, rotary_position=kw["rotary_position"])
        close(qi, reference.rotate(q64, c, s, **back), dtype, "q_out (inverse)")
        if k is not None:
            close(ki, reference.rotate(k64, c, s, **back), dtype, "k_out (inverse)")
        return 1
    f8 = r.choice(FP8S)
    qs, kscale = r.choice((0.25, 1.0, 3.0)), r.choice((0.5, 2.0))
    cfg.update(extra=f"{str(f8)[6:]} q_scale {qs} k_scale {kscale}")
    big = torch.finfo(f8).max
    q8, k8 = ropekit.apply_rope(
        q, k, pos_d, table_d, out_dtype=f8, q_scale=qs, k_scale=torch.tensor([kscale], device=device), **kw
    )
    sync(device)
    close(q8, (rq / qs).clamp(-big, big), f8, "q_out (fp8)")
    if k is not None:
        close(k8, (rk / kscale).clamp(-big, big), f8, "k_out (fp8)")
    return 1


def run_rope_conventions(r, q, k, q64, k64, pos, tab64, pos_d, table_d, rq, rk, lead, dtype, device, cfg, kw):
    """Issue #33's conventions of apply_rope on the same inputs: layout='sbhd' (two token dims),
    destinations (views of NaN buffers, fp8 ones too: nothing around them written),
    rotary_position='last', and q / k with last stride 2 (the documented copy, out of place then
    in place: the copy is written back, nothing else of their buffers)."""
    rot, halves = kw["rotary_dim"], kw["rotary_position"] == "halves"
    forms = ("dest", "strided") + (("sbhd",) if len(lead) == 2 else ())
    if not halves:  # these place the rotated dims themselves
        forms += ("last",) + (("parts",) if q.shape[-1] > rot else ())
    form = r.choice(forms)
    cfg.update(conv=form)
    if form == "parts":  # q (and k where wider than rot) as rope parts with their no-rope parts apart
        kk, kn = (k[..., :rot], k[..., rot:]) if k is not None and k.shape[-1] > rot else (k, None)
        qo, ko = ropekit.apply_rope(q[..., :rot], kk, pos_d, table_d, q_nope=q[..., rot:], k_nope=kn, **kw)  # first
        sync(device)
        close(qo, rq, dtype, "q_out (parts)")
        if k is not None:
            close(ko, rk, dtype, "k_out (parts)")
        return 1
    if form == "sbhd":  # (S, B, H, D) views and (S, B) positions ((3, S, B) with M-RoPE)
        seq = lambda x: None if x is None else x.transpose(0, 1)  # noqa: E731
        p = None if pos_d is None else pos_d.transpose(-1, -2)
        qo, ko = ropekit.apply_rope(seq(q), seq(k), p, table_d, layout="sbhd", **kw)
        sync(device)
        close(seq(qo), rq, dtype, "q_out (sbhd)")
        if k is not None:
            close(seq(ko), rk, dtype, "k_out (sbhd)")
        return 1
    if form == "last":  # the rotated dims at the end of each head, the leading ones copied

        def want(x64):
            n = x64.shape[-1] - rot
            return torch.cat((x64[..., :n], reference.apply_rope(x64[..., n:], None, pos, tab64, **kw)[0]), -1)

        qo, ko = ropekit.apply_rope(q, k, pos_d, table_d, **dict(kw, rotary_position="last"))
        sync(device)
        close(qo, want(q64), dtype, "q_out (rope last)")
        if k is not None:
            close(ko, want(k64), dtype, "k_out (rope last)")
        return 1
    bufs = []
    if form == "dest":  # the caller's buffers: slices of wider NaN buffers, in the outputs' dtype
        f8 = r.choice(FP8S) if r.random() < 0.3 else None
        qsc, ksc = (r.choice((0.5, 2.0)), r.choice((0.25, 1.0))) if f8 is not None else (None, None)
        outs = []
        for name, x, want, sc in (("q_out", q, rq, qsc), ("k_out", k, rk, ksc)):
            if x is None:
                outs.append(None)
                continue
            pad = r.choice((0, 8))
            b = Buf(name, torch.full((*x.shape[:-1], x.shape[-1] + pad), NAN).to(f8 or dtype), device)
            bufs.append(b)
            spec, view = b.view(b.cpu[..., pad:] if r.random() < 0.5 else b.cpu[..., : x.shape[-1]])
            if f8 is not None:
                big = torch.finfo(f8).max
                want = (want / sc).clamp(-big, big)
            b.expect(spec, want)
            outs.append(view)
        scaled = {} if f8 is None else dict(out_dtype=f8, q_scale=qsc, k_scale=ksc)
        got = ropekit.apply_rope(q, k, pos_d, table_d, q_out=outs[0], k_out=outs[1], **scaled, **kw)
        sync(device)
        if got[0] is not outs[0] or got[1] is not outs[1]:
            raise Failure("apply_rope did not return its destinations")
        cfg.update(conv=f"dest {str(f8)[6:] if f8 is not None else ''}".strip())
    else:  # "strided": q and k every other element of buffers of their own
        views = []
        for x in (q, k):
            views.append(None if x is None else dim_strided("q" if x is q else "k", bufs, x, device))
        qo, ko = ropekit.apply_rope(views[0], views[1], pos_d, table_d, **kw)
        sync(device)
        close(qo, rq, dtype, "q_out (strided)")
        if k is not None:
            close(ko, rk, dtype, "k_out (strided)")
        for b, want in zip(bufs, (rq, rk)):
            spec = b.view(b.cpu[..., 0])[0]
            for cols in rotated_cols(rot, want.shape[-1], halves):
                b.expect(spec, want, cols=cols)
        ropekit.apply_rope(views[0], views[1], pos_d, table_d, inplace=True, **kw)
        sync(device)
    for b in bufs:
        b.check()
    return 1 if form == "dest" else 2


def _angles_template(r):
    Dq, Dk, rot = r.choice(HEADS)
    dtype = r.choice(DTYPES)
    il = r.random() < 0.5
    mrope = r.choice(MROPE[rot]) if rot in MROPE and r.random() < 0.25 else None
    return dict(
        form=r.choice(TOKEN_FORMS),
        pos_layout=r.choice(POS_LAYOUTS),
        Dq=Dq,
        Dk=Dk,
        rot=rot,
        Hq=r.choice((1, 3, 4)),
        Hk=r.choice((0, 1, 2)),
        dtype=dtype,
        cdtype=r.choice((F32, dtype)),
        il=il,
        oil=il if r.random() < 0.6 else not il,
        mrope=mrope,
        mrope_il=mrope is not None and r.random() < 0.5,
    )


def run_angles(r, gen, device, cfg):
    """rotate_with_angles with per-token, broadcast, HF-duplicated and M-RoPE angles."""
    t = POOLS["angles"].pick(r)
    lead = token_shape(r, t["form"])
    Dq, Dk, rot, Hq, Hk, dtype, cdtype = (t[n] for n in ("Dq", "Dk", "rot", "Hq", "Hk", "dtype", "cdtype"))
    il, oil, mrope, mrope_il = t["il"], t["oil"], t["mrope"], t["mrope_il"]
    half = rot // 2
    form = r.choice(("full", "hf_dup", "broadcast"))
    bufs, (qb, qs, q), (kb, ks, k), style = pick_qk(r, gen, lead, Hq, Hk, Dq, Dk, dtype, device)
    sec = (3,) if mrope else ()
    ang = torch.rand((*sec, *lead, half), generator=gen, dtype=torch.float64) * 6.3 - 3.15
    if form == "broadcast":  # one row shared by the first token dim
        ang = ang.narrow(len(sec), 0, 1)
    cos, sin = ang.cos().to(cdtype), ang.sin().to(cdtype)
    if form == "hf_dup":  # HF's (.., rot) duplicated halves, sliced
        cos = torch.cat((cos, cos), -1)[..., :half]
        sin = torch.cat((sin, sin), -1)[..., :half]
    cfg.update(
        T=lead,
        Hq=Hq,
        Hk=Hk,
        Dq=Dq,
        Dk=Dk,
        rot=rot,
        dtype=str(dtype)[6:],
        cos=str(cdtype)[6:],
        il=int(il),
        oil=int(oil),
        mrope=mrope,
        mrope_il=int(mrope_il),
        form=form,
        style=style,
    )

    want = (*sec, *lead, half)
    c64, s64 = cos.double().broadcast_to(want), sin.double().broadcast_to(want)
    if mrope:
        pick = reference.mrope_sections_of_frequencies(half, mrope, mrope_il)
        pick = pick.view(1, *([1] * len(lead)), half).expand(1, *lead, half)
        c64, s64 = c64.gather(0, pick).squeeze(0), s64.gather(0, pick).squeeze(0)
    qo, ko = ropekit.rotate_with_angles(
        q,
        k,
        dev(cos, device),
        dev(sin, device),
        interleaved=il,
        out_interleaved=oil,
        mrope_section=mrope,
        mrope_interleaved=mrope_il,
    )
    sync(device)
    close(qo, reference.rotate(q.cpu().double(), c64, s64, interleaved=il, out_interleaved=oil), dtype, "q_out")
    if k is not None:
        close(ko, reference.rotate(k.cpu().double(), c64, s64, interleaved=il, out_interleaved=oil), dtype, "k_out")
    for b in bufs:
        b.check()
    return 1


# cache layouts: (k_cache, v_cache) views of bases, given (NB, BS, H, Dk, Dv)
def _nhd(alloc, NB, BS, H, Dk, Dv):
    return alloc("k_cache", (NB, BS, H, Dk)), alloc("v_cache", (NB, BS, H, Dv))


def _hnd(alloc, NB, BS, H, Dk, Dv):
    return alloc("k_cache", (NB, H, BS, Dk)).permute(0, 2, 1, 3), alloc("v_cache", (NB, H, BS, Dv)).permute(0, 2, 1, 3)


def _flat(alloc, NB, BS, H, Dk, Dv):
    return alloc("k_cache", (NB * BS, H, Dk)), alloc("v_cache", (NB * BS, H, Dv))


def _joint(alloc, NB, BS, H, Dk, Dv):
    base = alloc("kv_cache", (NB, 2, BS, H, Dk))
    return base[:, 0], base[:, 1]


def _padded(alloc, NB, BS, H, Dk, Dv):
    k = alloc("k_cache", (NB, BS + 1, H + 1, Dk + 8))[:, 1:, 1:, 4 : 4 + Dk]
    v = alloc("v_cache", (NB, BS + 2, H + 2, Dv + 16))[:, :BS, :H, :Dv]
    return k, v


def _mla(alloc, NB, BS, H, Dk, Dv):
    base = alloc("mla_cache", (NB, BS, 1, Dv + Dk))
    return base[..., Dv:], base[..., :Dv]


CACHES = {"nhd": _nhd, "hnd": _hnd, "flat": _flat, "joint": _joint, "padded": _padded, "mla": _mla}


def _store_template(r):
    layout = r.choice(list(CACHES))
    dtype = r.choice(DTYPES)
    cdtype = r.choice((dtype, dtype, F32, BF16, FP8, E5M2))
    if layout == "mla":
        Hq, Hk, rot, Dq, Dk, Dv = r.choice((1, 4, 8)), 1, 64, 64, 64, 256
    else:
        Dq, Dk, rot = r.choice(HEADS)
        Hq, Hk = r.choice((1, 3, 8)), r.choice((1, 2))
        Dv = Dk if layout == "joint" or r.random() < 0.7 else r.choice((64, 128))
    scaled = cdtype != BF16 or r.random() < 0.3
    return dict(
        form=r.choice(TOKEN_FORMS),
        pos_layout=r.choice(POS_LAYOUTS),
        layout=layout,
        dtype=dtype,
        cdtype=cdtype,
        il=r.random() < 0.5,
        Hq=Hq,
        Hk=Hk,
        rot=rot,
        Dq=Dq,
        Dk=Dk,
        Dv=Dv,
        NB_BS=r.choice(((2, 4), (3, 8), (4, 16), (1, 16))),
        pdtype=r.choice((torch.int32, torch.int64)),
        sdtype=r.choice((torch.int32, torch.int64)),
        tdtype=r.choice((F32, F32, BF16)),
        scale_kind=r.choice(("none", "none", "float", "tensor")) if scaled else "none",
        # the serving-engine forms: k written back, q into a separate (fp8) q_out, MLA's split key
        write_key=r.random() < 0.3,
        q_out=r.choice((None, None, None, BF16, F32, FP8, E5M2)),
        k_nope=layout == "mla" and r.random() < 0.6,
        # FlashInfer's heads in two parts (views of the whole heads): k as rope part + k_nope beside
        # v where k has dims past rotary_dim, and q + q_nope into q_out likewise
        parts=layout != "mla" and r.random() < 0.4,
    )


def run_store(r, gen, device, cfg):
    """apply_rope_and_store: q in place, rotated k and v into the cache rows of their slots."""
    t = POOLS["store"].pick(r)
    layout, dtype, cdtype, il = t["layout"], t["dtype"], t["cdtype"], t["il"]
    Hq, Hk, rot, Dq, Dk, Dv = (t[n] for n in ("Hq", "Hk", "rot", "Dq", "Dk", "Dv"))
    (NB, BS), pdtype, sdtype, scale_kind = t["NB_BS"], t["pdtype"], t["sdtype"], t["scale_kind"]
    lead = token_shape(r, t["form"])
    n_tok = 1
    for n in lead:
        n_tok *= n
    num_slots = NB * BS
    max_pos = r.choice((16, 64))
    bad_pos = r.random() < 0.25
    bad_slot = r.random() < 0.3

    # q, k, v: q in any style (MLA's q_pe slice included); k, v exact or padded or transposed
    qstyle = "mla" if layout == "mla" and r.random() < 0.7 else r.choice(("exact", "padded", "transposed", "fused"))
    bufs = []
    if qstyle == "fused" and Dq == Dk == Dv:
        base = randn((*lead, (Hq + 2 * Hk) * Dq), dtype, gen)
        b = Buf("qkv", base, device)
        bufs.append(b)
        (qs, q) = b.view(heads_of_row(b.cpu, 0, Hq, Dq))
        (kspec, k) = b.view(heads_of_row(b.cpu, Hq * Dq, Hk, Dq))
        kb = b
        (_, v) = b.view(heads_of_row(b.cpu, (Hq + Hk) * Dq, Hk, Dq))
        qb = b
    else:
        if qstyle == "fused":
            qstyle = "padded"
        if qstyle == "mla":
            qb = Buf("q_full", randn((*lead, Hq, 128 + Dq), dtype, gen), device)
            qs, q = qb.view(qb.cpu[..., 128:])
        else:
            qb, qs, q = heads_view(r, gen, "q", lead, Hq, Dq, dtype, device, qstyle)
        kb, kspec, k = heads_view(r, gen, "k", lead, Hk, Dk, dtype, device, r.choice(("exact", "padded", "transposed")))
        vb, _, v = heads_view(r, gen, "v", lead, Hk, Dv, dtype, device, r.choice(("exact", "padded", "transposed")))
        bufs += [qb, kb, vb]
    # last dims that are not contiguous: v read through its stride; k (unless written back) and q
    # (when only read, with q_out) through one copy
    v = dim_strided("v", bufs, v, device) if r.random() < 0.2 else v
    if not t["write_key"] and r.random() < 0.15:
        k = dim_strided("k", bufs, k, device)

    cache_bufs = []

    def alloc(name, shape):
        base = torch.full(shape, NAN, dtype=torch.float32).to(cdtype)
        b = Buf(name, base, device)
        cache_bufs.append(b)
        return b.cpu

    kc_cpu, vc_cpu = CACHES[layout](alloc, NB, BS, Hk, Dk, Dv)
    bufs += cache_bufs
    owner = {}
    for x in (kc_cpu, vc_cpu):
        for b in cache_bufs:
            if x.untyped_storage().data_ptr() == b.cpu.untyped_storage().data_ptr():
                owner[id(x)] = b
    kcb, vcb = owner[id(kc_cpu)], owner[id(vc_cpu)]
    kcs, kc = kcb.view(kc_cpu)
    vcs, vc = vcb.view(vc_cpu)

    # slots: distinct, some padding (< 0), some past the cache when bad_slot
    perm = torch.randperm(num_slots, generator=gen)
    slots = torch.full((n_tok,), -1, dtype=torch.int64)
    n_real = min(n_tok, num_slots)
    slots[:n_real] = perm[:n_real]
    for _ in range(r.randint(0, 2)):
        slots[r.randrange(n_tok)] = r.choice((-1, -7, -(2**31)))
    if bad_slot:
        extremes = [num_slots, num_slots + 5, 2**31 - 1] + ([2**40] if sdtype == torch.int64 else [])
        slots[r.randrange(n_tok)] = r.choice(extremes)
    slots = slots.to(sdtype).view(lead)
    if len(lead) == 2 and r.random() < 0.5:  # its own strides: a transposed (S, B) buffer
        slots = slots.t().contiguous().t()
    table = table_view(r, max_pos, rot, t["tdtype"])
    pos = None  # None: arange over the last token dim
    if bad_pos or lead[-1] > max_pos or r.random() < 0.85:
        pos = positions_tensor(r, gen, lead, max_pos, False, pdtype, bad_pos, t["pos_layout"])
    scales = [None, None]
    for i in range(2):
        if scale_kind == "float":
            scales[i] = r.choice((0.5, 1.0, 2.0, 0.25))
        elif scale_kind == "tensor":
            scales[i] = torch.tensor(r.choice((0.5, 1.0, 4.0)), dtype=torch.float32).reshape(r.choice(((), (1,))))
    cfg.update(
        layout=layout,
        T=lead,
        Hq=Hq,
        Hk=Hk,
        Dq=Dq,
        Dk=Dk,
        Dv=Dv,
        rot=rot,
        dtype=str(dtype)[6:],
        cache=str(cdtype)[6:],
        NB=NB,
        BS=BS,
        il=int(il),
        qstyle=qstyle,
        pos=None if pos is None else f"{str(pdtype)[6:]}{'!' if bad_pos else ''}",
        slots=f"{str(sdtype)[6:]}{'!' if bad_slot else ''}",
        scale=scale_kind,
    )

    q_out_dtype = t["q_out"]
    if q_out_dtype is not None and r.random() < 0.2:
        q = dim_strided("q", bufs, q, device)  # only read when q_out is given
    qsc = r.choice((None, 0.5, 2.0, "tensor")) if q_out_dtype is not None else None
    if qsc == "tensor":
        qsc = torch.tensor([0.25], dtype=torch.float32)
    cfg.update(write_key=int(t["write_key"]), q_out=q_out_dtype and str(q_out_dtype)[6:], k_nope=int(t["k_nope"]))
    cfg.update(strides=(q.stride(-1), k.stride(-1), v.stride(-1)))

    # the oracle, in float64 on CPU
    q64 = q.cpu().double()
    k64, v64 = k.cpu().double(), v.cpu().double()
    tab64 = table.double()
    s = slots.long()
    valid = (s >= 0) & (s < num_slots)
    kc_want = torch.full(kc.shape, NAN, dtype=torch.float64)
    vc_want = torch.full(vc.shape, NAN, dtype=torch.float64)
    fscales = [None if x is None else float(x) for x in scales]
    _, k_rot = reference.apply_rope(k64, k64, pos, tab64, interleaved=il, rotary_dim=rot)
    reference.apply_rope_and_store(
        q64,
        k64,
        v64,
        pos,
        tab64,
        kc_want,
        vc_want,
        torch.where(valid, s, -1),
        interleaved=il,
        rotary_dim=rot,
        k_scale=fscales[0],
        v_scale=fscales[1],
    )
    q64[..., :rot][s >= num_slots] = NAN
    q_out = None
    if q_out_dtype is None:
        qb.expect(qs, q64, cols=slice(0, rot))
    else:
        qob = Buf("q_out", torch.full(q.shape, NAN).to(q_out_dtype), device)
        bufs.append(qob)
        qos, q_out = qob.view(qob.cpu)
        qob.expect(qos, q64 / (1.0 if qsc is None else float(qsc)))
    if t["write_key"]:
        kb.expect(kspec, k_rot, cols=slice(0, rot))
    rows = s[valid].tolist()
    for b, spec, want in ((kcb, kcs, kc_want), (vcb, vcs, vc_want)):
        if b.want is None:
            b.want = b.cpu.double()
        w = b.want.as_strided(*spec)
        m = b.written.as_strided(*spec)
        for slot in rows:
            idx = (slot // BS, slot % BS) if len(spec[0]) == 4 else (slot,)
            w[idx] = want[idx]
            m[idx] = True

    ks, vs = (x.to(device) if isinstance(x, torch.Tensor) else x for x in scales)
    kw = dict(interleaved=il, k_scale=ks, v_scale=vs)
    if t["write_key"]:
        kw["write_key"] = True
    if q_out is not None:
        kw.update(q_out=q_out, q_scale=qsc.to(device) if isinstance(qsc, torch.Tensor) else qsc)
    if t["k_nope"]:  # MLA's split key: v passed as k_nope, into the nope part (or the joint row split)
        kw["k_nope"], v = v, None
        if r.random() < 0.5:
            kc, vc = kcb.dev, None
    if t["parts"] and k.shape[-1] > rot:  # the rows [rotated k | k_nope]: the same bytes as whole k
        k, kw["k_nope"] = k[..., :rot], k[..., rot:]
        cfg.update(parts="k")
    if t["parts"] and q_out is not None and q.shape[-1] > rot:  # q_out [rotated q | q_nope]
        q, kw["q_nope"] = q[..., :rot], q[..., rot:]
        cfg.update(parts=cfg.get("parts", "") + "q")
    out = apply_rope_and_store(
        q,
        k,
        v,
        None if pos is None else dev(pos, device),
        dev(table, device),
        kc,
        vc,
        dev(slots, device),
        **kw,
    )
    sync(device)
    if out is not (q if q_out is None else q_out):
        raise Failure("apply_rope_and_store did not return q (q_out when given)")
    for b in bufs:
        b.check()
    return 1


def dim_strided(name, bufs, x, device):
    """x's values in a view whose last dim has stride 2 (every other element of a buffer of its
    own, registered in bufs: it must stay unwritten)."""
    base = torch.full((*x.shape, 2), NAN, dtype=x.dtype)
    base[..., 0] = x.cpu()
    b = Buf(name + "_dim_strided", base, device)
    bufs.append(b)
    return b.view(b.cpu[..., 0])[1]


def run_refuse(r, gen, device, cfg):
    """Calls that must be refused by the address checks: ValueError, nothing written."""
    case = r.choice(("qk_inplace", "caches_overlap", "kcache_is_k", "q_in_cache", "v_in_cache"))
    cfg.update(case=case)
    T, H, D = r.randint(1, 6), 2, 64
    table = make_table(16, D, F32).to(device)
    pos = torch.randint(0, 16, (T,), generator=gen).to(device)
    before = []

    def keep(*xs):
        for x in xs:
            before.append((x, x.clone()))

    if case == "qk_inplace":
        q = randn((T, 2 * H, D), F32, gen).to(device)
        k = q[:, r.randint(0, H) :][:, :H]
        keep(q)
        fn = lambda: ropekit.apply_rope(q, k, pos, table, inplace=True)  # noqa: E731
    else:
        q = randn((T, H, D), F32, gen).to(device)
        k = randn((T, H, D), F32, gen).to(device)
        v = randn((T, H, D), F32, gen).to(device)
        kc = torch.zeros((2, 4, H, D), device=device)
        vc = torch.zeros((2, 4, H, D), device=device)
        if case == "caches_overlap":
            vc = kc[:, :, :, :]
        elif case == "kcache_is_k":
            k = kc[0, :T] if T <= 4 else kc.view(8, H, D)[:T]
        elif case == "q_in_cache":
            q = kc.view(8, H, D)[:T]
        elif case == "v_in_cache":
            v = vc.view(8, H, D)[:T]
        slots = torch.arange(T, device=device)
        keep(q, k, v, kc, vc)
        fn = lambda: apply_rope_and_store(q, k, v, pos, table, kc, vc, slots)  # noqa: E731
    try:
        fn()
    except ValueError as e:
        if "disjoint" not in str(e):
            raise Failure(f"refused with an unexpected message: {e}")
    else:
        raise Failure("not refused")
    sync(device)
    for x, b in before:
        if not torch.equal(x, b):
            raise Failure("written before the error")
    return 1


# ---------------------------------------------------------------------------------------------
# rerotate_kv_cache


def run_rerotate(r, gen, device, cfg):
    """rerotate_kv_cache: cache rows re-rotated by shifts, in place or into dst slots; padding, slots
    past the cache and shifts past the table (extremes included) among them."""
    from ropekit import rerotate_kv_cache

    layout = r.choice(list(CACHES))
    cdtype = r.choice((F16, BF16, F32, FP8))
    if layout == "mla":
        H, D, Dv, rot = 1, 64, 256, 64
    else:
        _, D, rot = r.choice(HEADS)
        H, Dv = r.choice((1, 2, 8)), D
    NB, BS = r.choice(((2, 4), (3, 8), (4, 16), (1, 16)))
    num_slots = NB * BS
    max_pos = r.choice((16, 64))
    il, to_dst = r.random() < 0.5, r.random() < 0.5
    halves = not il and rot < D and r.random() < 0.3  # rotary_position='halves'
    position = "halves" if halves else "first"
    bases = []

    def alloc(name, shape):
        bases.append((name, torch.full(shape, NAN, dtype=torch.float32).to(cdtype)))
        return bases[-1][1]

    k_cpu, _ = CACHES[layout](alloc, NB, BS, H, D, Dv)
    values = randn(k_cpu.shape, F32, gen)
    k_cpu.copy_(values.to(cdtype) if cdtype != FP8 else (values * 8).to(FP8))
    bufs = [Buf(name, base, device) for name, base in bases]
    kb = next(b for b in bufs if b.cpu.untyped_storage().data_ptr() == k_cpu.untyped_storage().data_ptr())
    spec, kc = kb.view(k_cpu)

    n = r.randint(1, max(1, num_slots // 2))
    perm = torch.randperm(num_slots, generator=gen)
    sdtype = r.choice((torch.int32, torch.int64))
    slots = perm[:n].clone()
    dst = perm[n : 2 * n].clone() if to_dst else None
    for x in (slots, dst):
        if x is None:
            continue
        for _ in range(r.randint(0, 2)):
            x[r.randrange(n)] = r.choice((-1, -7, -(2**31)))
        if r.random() < 0.3:
            x[r.randrange(n)] = r.choice((num_slots, num_slots + 5, 2**31 - 1))
    ddtype = r.choice((torch.int32, torch.int64))
    delta = torch.randint(-max_pos + 1, max_pos, (n,), generator=gen)
    if r.random() < 0.3:
        extremes = [max_pos, -max_pos, 2**31 - 1, -(2**31) + 1]
        extremes += [-(2**63) + 1] if ddtype == torch.int64 else []
        delta[r.randrange(n)] = r.choice(extremes)
    if r.random() < 0.8:
        delta = delta.to(ddtype)
    else:  # one int shift for every row: one past the table is refused by name (not this sweep's subject)
        delta = int(delta[0]) if -max_pos < int(delta[0]) < max_pos else max_pos - 1
    slots = slots.to(sdtype)
    if r.random() < 0.3:  # a strided slots view
        slots = torch.stack((slots, slots), 1)[:, 0]
    table = table_view(r, max_pos, rot, r.choice((F32, F32, BF16)))
    scale = None
    if cdtype == FP8 or r.random() < 0.2:
        scale = r.choice((None, 0.5, 2.0, torch.tensor([0.25])))
    cfg.update(
        layout=layout,
        H=H,
        D=D,
        rot=rot,
        cache=str(cdtype)[6:],
        NB=NB,
        BS=BS,
        il=int(il),
        n=n,
        dst=int(to_dst),
        delta="int" if isinstance(delta, int) else str(ddtype)[6:],
        scale=type(scale).__name__,
        halves=int(halves),
    )

    # the oracle, in float64 on CPU, over the same view of the base
    kb.want = kb.cpu.double()
    reference.rerotate_kv_cache(
        kb.want.as_strided(*spec),
        slots,
        delta,
        table.double(),
        interleaved=il,
        rotary_dim=rot,
        k_scale=None if scale is None else float(scale),
        dst_slots=dst,
        rotary_position=position,
    )
    src = slots.long()
    out = src if dst is None else dst.long()
    ok = (src >= 0) & (src < num_slots) & (out >= 0) & (out < num_slots)
    m = kb.written.as_strided(*spec)
    for slot in out[ok].tolist():
        idx = (slot // BS, slot % BS) if len(spec[0]) == 4 else (slot,)
        if dst is None:
            for cols in rotated_cols(rot, D, halves):
                m[idx][..., cols] = True
        else:
            m[idx] = True

    res = rerotate_kv_cache(
        kc,
        dev(slots, device),
        delta if isinstance(delta, int) else delta.to(device),
        dev(table, device),
        interleaved=il,
        rotary_dim=rot,
        k_scale=scale.to(device) if isinstance(scale, torch.Tensor) else scale,
        dst_slots=None if dst is None else dst.to(sdtype).to(device),
        rotary_position=position,
    )
    sync(device)
    if res is not kc:
        raise Failure("rerotate_kv_cache did not return k_cache")
    for b in bufs:
        b.check()
    return 1


# q/k RMSNorm + RoPE (through apply_rope / apply_rope_and_store)


def _norm_template(r):
    t = _rope_template(r)
    t.update(
        norm_q=r.choice((0, 1, 1, 2)),
        norm_k=r.choice((0, 1, 2)),
        offset=r.choice((0.0, 1.0)),
        wdtype=r.choice(DTYPES),
        store=r.random() < 0.3,
    )
    if not t["norm_q"] and not t["norm_k"]:
        t["norm_q"] = 1
    return t


def _norm_weight(mode, x, dtype, gen, device):
    if not mode or x is None:
        return None
    n = x.shape[-1] * (x.shape[-2] if mode == 2 else 1)
    return (1 + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype).to(device)


def run_norm(r, gen, device, cfg):
    """apply_rope with q/k norm weights out of place, then in place (or with grad and a backward);
    sometimes apply_rope_and_store with the norm into a paged cache."""
    t = POOLS["norm"].pick(r)
    lead = token_shape(r, t["form"])
    Dq, Dk, rot, Hq, Hk, dtype, il = (t[n] for n in ("Dq", "Dk", "rot", "Hq", "Hk", "dtype", "il"))
    mrope, mrope_il, tdtype, pdtype = t["mrope"], t["mrope_il"], t["tdtype"], t["pdtype"]
    max_pos = r.choice((16, 32, 64))
    bad = r.random() < 0.3
    grad = t["grad"] and r.random() < 0.5
    if t["store"]:
        return _run_norm_store(r, gen, device, cfg, t, lead, max_pos, bad)
    bufs, (qb, qs, q), (kb, ks, k), style = pick_qk(r, gen, lead, Hq, Hk, Dq, Dk, dtype, device)
    wq = _norm_weight(t["norm_q"], q, t["wdtype"], gen, device)
    wk = _norm_weight(t["norm_k"], k, t["wdtype"], gen, device)
    if wq is None and wk is None:
        wq = _norm_weight(1, q, t["wdtype"], gen, device)
    table = table_view(r, max_pos, rot, tdtype)
    pos = positions_tensor(r, gen, lead, max_pos, mrope, pdtype, bad, t["pos_layout"])
    cfg.update(
        T=lead,
        Hq=Hq,
        Hk=Hk,
        Dq=Dq,
        Dk=Dk,
        rot=rot,
        dtype=str(dtype)[6:],
        il=int(il),
        mrope=mrope,
        norm=(0 if wq is None else t["norm_q"] or 1, 0 if wk is None else t["norm_k"]),
        offset=t["offset"],
        style=style,
        grad=int(grad),
        bad=int(bad),
        halves=int(t["halves"]),
    )
    kw = dict(
        interleaved=il,
        rotary_dim=rot,
        mrope_section=mrope,
        mrope_interleaved=mrope_il,
        norm_weight_offset=t["offset"],
        rotary_position="halves" if t["halves"] else "first",
    )
    # Llama 4's unweighted norm (l2_norm=True) instead of the weights; with float32 tables only: the
    # oracle rotates first, the kernel normalizes first, and the two agree when the rows' cos^2 +
    # sin^2 is 1 (a bf16 row is within 2^-8 of it: docs/qknorm.md)
    l2 = tdtype == torch.float32 and r.random() < 0.25
    if l2:
        wq = wk = None
        kw.update(l2_norm=True, norm_weight_offset=0.0)
        cfg.update(norm="l2", offset=0.0)
    d64 = lambda x: None if x is None else x.detach().cpu().double()  # noqa: E731
    rq, rk = reference.rms_norm_rope(
        d64(q), d64(k), pos, table.double(), q_norm_weight=d64(wq), k_norm_weight=d64(wk), **kw
    )
    pos_d, table_d = dev(pos, device), dev(table, device)
    if grad:
        qg = q.detach().clone().requires_grad_()
        kg = None if k is None else k.detach().clone().requires_grad_()
        wqg = None if wq is None else wq.detach().clone().requires_grad_()
        wkg = None if wk is None else wk.detach().clone().requires_grad_()
        qo, ko = ropekit.apply_rope(qg, kg, pos_d, table_d, q_norm_weight=wqg, k_norm_weight=wkg, **kw)
        outs = [x for x in (qo, ko) if x is not None]
        gs = [randn(x.shape, dtype, gen) for x in outs]
        torch.autograd.backward(outs, [g.to(device) for g in gs])
        sync(device)
        leaves = [x for x in (d64(q), d64(k), d64(wq), d64(wk)) if x is not None]
        for x in leaves:
            x.requires_grad_()
        it = iter(leaves)
        q64, k64 = next(it), (next(it) if k is not None else None)
        w64q, w64k = (next(it) if wq is not None else None), (next(it) if wk is not None else None)
        yq, yk = reference.rms_norm_rope(q64, k64, pos, table.double(), q_norm_weight=w64q, k_norm_weight=w64k, **kw)
        finite = [(y, g.double()) for y, g in zip((yq, yk), gs) if y is not None]
        # rows of bad positions are NaN: their gradients too (compare the others)
        torch.autograd.backward([y.nan_to_num(0.0) for y, _ in finite], [g for _, g in finite])
        for got, ref, what in (
            (qg, q64, "q.grad"),
            (kg, k64, "k.grad"),
            (wqg, w64q, "wq.grad"),
            (wkg, w64k, "wk.grad"),
        ):
            if got is None or bad:
                continue
            close(got.grad, ref.grad, got.dtype, what)
        for b in bufs:
            b.check()
        return 2
    qo, ko = ropekit.apply_rope(q, k, pos_d, table_d, q_norm_weight=wq, k_norm_weight=wk, **kw)
    sync(device)
    close(qo, rq, dtype, "q_out (norm)")
    if k is not None:
        close(ko, rk, dtype, "k_out (norm)")
    for b in bufs:
        b.check()
    # in place: a normalized tensor changes in every column (tail included), a plain one in the rotated ones
    for cols in rotated_cols(rot, Dq, t["halves"]):
        qb.expect(qs, rq, cols=None if wq is not None or l2 else cols)
        if k is not None:
            kb.expect(ks, rk, cols=None if wk is not None or l2 else cols)
    ropekit.apply_rope(q, k, pos_d, table_d, inplace=True, q_norm_weight=wq, k_norm_weight=wk, **kw)
    sync(device)
    for b in bufs:
        b.check()
    return 2


def _run_norm_store(r, gen, device, cfg, t, lead, max_pos, bad):
    """apply_rope_and_store with the norm: q in place, k into a paged cache (bf16/fp16/fp32/fp8)."""
    Dq, Dk, rot, Hq, dtype, il = (t[n] for n in ("Dq", "Dk", "rot", "Hq", "dtype", "il"))
    Hk = t["Hk"] or 1
    q = randn((*lead, Hq, Dq), dtype, gen)
    k = randn((*lead, Hk, Dk), dtype, gen)
    v = randn((*lead, Hk, Dk), dtype, gen)
    n_tok = q.shape[:-2].numel()
    BS = r.choice((1, 4, 16))
    NB = -(-n_tok // BS) + 2
    cdtype = r.choice((dtype, dtype, FP8))
    slots = torch.randperm(NB * BS, generator=gen)[:n_tok].view(lead)
    slots.view(-1)[0] = -1 if n_tok > 1 else slots.view(-1)[0]
    wq = _norm_weight(t["norm_q"], q, t["wdtype"], gen, "cpu")
    wk = _norm_weight(t["norm_k"], k, t["wdtype"], gen, "cpu")
    if wq is None and wk is None:
        wk = _norm_weight(1, k, t["wdtype"], gen, "cpu")
    table = table_view(r, max_pos, rot, t["tdtype"])
    pos = positions_tensor(r, gen, lead, max_pos, None, t["pdtype"], bad)
    cfg.update(
        T=lead,
        Hq=Hq,
        Hk=Hk,
        Dq=Dq,
        Dk=Dk,
        rot=rot,
        dtype=str(dtype)[6:],
        il=int(il),
        store=1,
        cache=str(cdtype)[6:],
        norm=(0 if wq is None else 1, 0 if wk is None else 1),
        bad=int(bad),
        halves=int(t["halves"]),
    )
    position = "halves" if t["halves"] else "first"
    d64 = lambda x: None if x is None else x.double()  # noqa: E731
    rq, rk = reference.rms_norm_rope(
        q.double(),
        k.double(),
        pos,
        table.double(),
        interleaved=il,
        rotary_dim=rot,
        q_norm_weight=d64(wq),
        k_norm_weight=d64(wk),
        norm_weight_offset=t["offset"],
        rotary_position=position,
    )
    k_cache = randn((NB, BS, Hk, Dk), F32, gen).to(cdtype)
    v_cache = randn((NB, BS, Hk, Dk), F32, gen).to(cdtype)
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    qd, kcd, vcd = q.to(device), k_cache.to(device), v_cache.to(device)
    ropekit.apply_rope_and_store(
        qd,
        k.to(device),
        v.to(device),
        dev(pos, device),
        dev(table, device),
        kcd,
        vcd,
        slots.to(device),
        interleaved=il,
        rotary_dim=rot,
        q_norm_weight=None if wq is None else wq.to(device),
        k_norm_weight=None if wk is None else wk.to(device),
        norm_weight_offset=t["offset"],
        rotary_position=position,
    )
    sync(device)
    close(qd, rq, dtype, "q (norm, store)")
    flat = slots.view(-1).long()
    keep = flat >= 0
    s = flat[keep]
    got_k, got_v = kcd.cpu().flatten(0, 1), vcd.cpu().flatten(0, 1)
    close(got_k[s], rk.reshape(-1, Hk, Dk)[keep], cdtype, "k_cache rows (norm)")
    close(got_v[s], v.reshape(-1, Hk, Dk)[keep].double(), cdtype, "v_cache rows (norm)")
    other = torch.ones(NB * BS, dtype=torch.bool)
    other[s] = False
    bits = INT_OF_SIZE[k_cache.element_size()]
    for got, before, what in ((got_k, kc0, "k_cache"), (got_v, vc0, "v_cache")):
        if not torch.equal(got.view(bits)[other], before.flatten(0, 1).view(bits)[other]):
            raise Failure(f"{what}: rows no slot names changed (norm store)")
    return 1


POOLS = {}
# kind: (runner, share of the configurations)
KINDS = {
    "rope": (run_rope, 0.45),
    "angles": (run_angles, 0.18),
    "store": (run_store, 0.32),
    "refuse": (run_refuse, 0.05),
    "norm": (run_norm, 0.15),
}
KINDS["rerotate"] = (run_rerotate, 0.15)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# --variants-only: what the run would compile


class _Recorder:
    """Stands in for a Triton kernel: records the specialization key of each launch, runs nothing.

    The key approximates Triton's: constexprs, pointer dtypes and 16-byte alignment, and for ints
    whether they are 1, divisible by 16, or beyond int32."""

    def __init__(self, name, kernel):
        self.name, self.kernel, self.keys = name, kernel, set()
        self.params = getattr(kernel, "params", ())

    def __getitem__(self, grid):
        def launch(*args, **meta):
            key = []
            for a in args:
                if isinstance(a, torch.Tensor):
                    key.append((str(a.dtype), a.data_ptr() % 16 == 0))
                elif isinstance(a, bool) or not isinstance(a, int):
                    key.append(a)
                else:
                    key.append((a == 1, a % 16 == 0, not -(2**31) <= a < 2**31))
            self.keys.add((tuple(key), tuple(sorted(meta.items()))))
            return None

        return launch


def install_recorders():
    from ropekit.kernels import backward as kbackward
    from ropekit.kernels import rope as krope
    from ropekit.kernels import store as kstore

    recs = [
        _Recorder("rope_kernel", krope.rope_kernel),
        _Recorder("rope_store_kernel", kstore.rope_store_kernel),
        _Recorder("rope_norm_backward_kernel", kbackward.rope_norm_backward_kernel),
    ]
    krope.rope_kernel, kstore.rope_store_kernel, kbackward.rope_norm_backward_kernel = recs
    from ropekit.kernels import rerotate as krerotate

    recs.append(_Recorder("rerotate_kernel", krerotate.rerotate_kernel))
    krerotate.rerotate_kernel = recs[-1]
    return recs


# ---------------------------------------------------------------------------------------------


def main():
    device = ARGS.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu for a dry run")
    kinds = list(KINDS) if ARGS.only is None else ARGS.only.split(",")
    weights = [KINDS[k][1] for k in kinds]
    recs = install_recorders() if ARGS.variants_only else None
    pools = (
        ("rope", _rope_template, ARGS.pool),
        ("angles", _angles_template, ARGS.pool // 2),
        ("store", _store_template, ARGS.pool // 2),
        ("norm", _norm_template, ARGS.pool // 2),
    )
    for i, (kind, make, size) in enumerate(pools):
        POOLS[kind] = Pool(ARGS.seed * 1000 + i, make, max(1, size))

    def poisoned_empty_like(x, *a, **kw):
        return torch.empty_like(x, *a, **kw).fill_(NAN)

    run.empty_like = poisoned_empty_like

    rng = random.Random(ARGS.seed)
    n_ops = 0
    failures = []
    counts = {k: 0 for k in kinds}
    t0 = time.perf_counter()
    for i in range(ARGS.n):
        kind = rng.choices(kinds, weights)[0]
        counts[kind] += 1
        r = random.Random(rng.getrandbits(64))
        gen = torch.Generator().manual_seed(r.getrandbits(62))
        cfg = {"i": i, "kind": kind}
        if i and i % 40 == 0:
            print(
                f"... {i} configs, {n_ops} ops, {len(failures)} failures, {time.perf_counter() - t0:.0f} s", flush=True
            )
        # the launcher picks the program layout by call size (these are all decode-sized): force the
        # per-token head loops of rope_kernel and the store on a third of the configurations, and
        # the per-block layout without programmatic dependent launch on another third
        layout = r.choice(("planned", "token-programs", "block-programs-no-pdl"))
        cfg["layout"] = layout
        knobs = {
            "planned": {},
            "token-programs": dict(head_loop=True, store_head_loop=True),
            "block-programs-no-pdl": dict(head_loop=False, store_head_loop=False, pdl=False),
        }[layout]
        try:
            with tuning.override(**knobs):
                n_ops += KINDS[kind][0](r, gen, device, cfg)
            if ARGS.verbose:
                print("ok  ", describe(cfg), flush=True)
        except Exception as e:  # noqa: BLE001 - a failing configuration is reported, the sweep goes on
            if ARGS.variants_only and isinstance(e, Failure):
                continue
            failures.append((cfg, e))
            print(f"FAIL {describe(cfg)}\n     {type(e).__name__}: {e}", flush=True)
            if not isinstance(e, Failure):
                traceback.print_exc()
            if device == "cuda":
                try:
                    torch.cuda.synchronize()
                except RuntimeError:  # a sticky CUDA error: nothing further can run
                    print("CUDA context lost; stopping", flush=True)
                    break
    dt = time.perf_counter() - t0
    print("configs by kind: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if recs:
        print("kernel variants: " + ", ".join(f"{x.name} {len(x.keys)}" for x in recs))
        return 0
    errs = ", ".join(f"{str(d)[6:]} {e:.1e}" for d, e in STATS["max_rel_err"].items())
    print(f"max relative error by dtype: {errs}; NaN rows expected and found: {STATS['nan_rows']}")
    print(f"time: {dt:.1f} s on {device}")
    print(f"sweep: {ARGS.n} configs, {n_ops} ops, {len(failures)} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
