"""Aliasing geometry: which byte ranges a call writes and reads, and whether two tensors can share
an element. A written tensor that overlaps itself or another argument is refused by name, before
any write. Exact tests (a bounded search over strides) run only where byte ranges meet.
"""

from __future__ import annotations

import torch

from . import memo
from .args import fail


def _span(x: torch.Tensor):
    """[first, last] byte addresses touched by x."""
    start = x.data_ptr()
    extent = sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride()) if n > 0)
    return start, start + (extent + 1) * x.element_size() - 1


def has_internal_overlap(x: torch.Tensor) -> bool:
    """True if two elements of x may share memory: a broadcast (stride-0) dim, or dims that do not
    nest (sorted by stride, each stride at least the extent of the dims inside it). With a unit
    last stride this is exact for every layout but exotic interleavings, which it refuses."""
    # dims by stride, sorted by insertion: torch.compile traces comparisons of symbolic sizes (as
    # guards) but cannot sort them
    dims = []
    for n, st in zip(x.shape, x.stride()):
        if n > 1:
            st = st if st >= 0 else -st
            i = len(dims)
            while i > 0 and (dims[i - 1][0] > st or (dims[i - 1][0] == st and dims[i - 1][1] > n)):
                i -= 1
            dims.insert(i, (st, n))
    reach = 1
    for st, n in dims:
        if st < reach:
            return True
        reach += st * (n - 1)
    return False


def written_vs_read(op, written, read, extents=None) -> None:
    """No written tensor may share a byte with a read-only one (positions, tables, slots, scales).

    extents: None, or the byte extents of the written tensors then of the read ones (0 for None):
    pairs whose byte ranges miss each other (the usual case) are then passed after two compares."""
    if extents is not None:
        tensors = [w for _, w in written] + [r for _, r in read]
        ptrs = [0 if x is None else x.data_ptr() for x in tensors]
        nw = len(written)
        meet = [
            (i, j)
            for i in range(nw)
            for j in range(nw, len(tensors))
            if extents[i] and extents[j] and ptrs[i] < ptrs[j] + extents[j] and ptrs[j] < ptrs[i] + extents[i]
        ]
        for i, j in meet:
            written_vs_read(op, (written[i],), (read[j - nw],))
        return
    for wname, w in written:
        if w is None:
            continue
        for rname, r in read:
            if isinstance(r, torch.Tensor) and may_alias(w, r):
                fail(op, rname, f"memory disjoint from {wname} (which is written)", f"a tensor overlapping {wname}")


def inplace_aliasing(op, q, k, read) -> None:
    """In-place rotation: q and k disjoint from each other and from every read-only input."""
    if k is not None and may_alias(q, k):
        fail(op, "k", "memory disjoint from q when inplace=True", "a tensor overlapping q")
    written_vs_read(op, (("q", q), ("k", k)), read)


def out_aliasing(op, q_out, k_out, read, extents=None) -> None:
    """q_out and k_out disjoint from each other and from every input (`read`: (name, tensor) pairs)."""
    if q_out is not None and k_out is not None and may_alias(q_out, k_out):
        fail(op, "k_out", "memory disjoint from q_out (both are written)", "a tensor overlapping q_out")
    written_vs_read(op, (("q_out", q_out), ("k_out", k_out)), read, extents)


def may_alias(a: torch.Tensor, b: torch.Tensor, budget: int = 4096) -> bool:
    """True if a and b share a byte; exact, except that a search over budget steps says True.

    In bytes, a covers a_ptr + sum(i_d * sa_d) + e (0 <= i_d < na_d, 0 <= e < a's element size)
    and b likewise from b_ptr. They meet iff b_ptr - a_ptr = sum(c_t * st_t) over the dims of both
    (a's: c in [0, n - 1]; b's: c in [-(n - 1), 0]; equal strides merged into one range, which
    makes views of one buffer with equal strides cheap). A depth-first search over those terms,
    largest stride first, pruned by what the remaining terms can reach, decides it in a few
    steps for real layouts: the k and v halves of one (num_blocks, 2, block_size, H, D) buffer,
    an MLA row [latent | rope], a fused qkv buffer, HND and NHD views.
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    if a1 < b0 or b1 < a0:
        return False
    key = (
        a.data_ptr(),
        tuple(a.shape),
        a.stride(),
        a.element_size(),
        b.data_ptr(),
        tuple(b.shape),
        b.stride(),
        b.element_size(),
        budget,
    )
    # verdicts by layout, in ropekit's one memo: KV caches are the same tensors call after call, so
    # decode pays for the search once (the key holds all the search reads)
    verdict = memo.lookup(("may_alias",) + key)
    if verdict is None:
        verdict = memo.remember(("may_alias",) + key, _may_alias_search(a, b, budget))
    return verdict


def _may_alias_search(a: torch.Tensor, b: torch.Tensor, budget: int) -> bool:
    ranges: dict = {}  # byte stride -> [lowest c, highest c]

    def add(stride, lo, hi):
        if stride < 0:
            stride, lo, hi = -stride, -hi, -lo
        if stride == 0 or lo == hi == 0:
            return
        r = ranges.setdefault(stride, [0, 0])
        r[0] += lo
        r[1] += hi

    for x, sign in ((a, 1), (b, -1)):
        es = x.element_size()
        for n, st in zip(x.shape, x.stride()):
            add(st * es, 0 if sign > 0 else -(n - 1), n - 1 if sign > 0 else 0)
        add(1, 0 if sign > 0 else -(es - 1), es - 1 if sign > 0 else 0)  # bytes within an element
    terms = sorted(((st, lo, hi) for st, (lo, hi) in ranges.items()), reverse=True)
    n = len(terms)
    reach_lo, reach_hi = [0] * (n + 1), [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        st, lo_c, hi_c = terms[i]
        reach_lo[i] = reach_lo[i + 1] + st * lo_c
        reach_hi[i] = reach_hi[i + 1] + st * hi_c
    steps = [budget]

    def reachable(i, target):
        if target > reach_hi[i] or target < reach_lo[i]:
            return False
        if i == n:
            return True  # target == 0
        st, lo_c, hi_c = terms[i]
        c_lo = max(lo_c, -((reach_hi[i + 1] - target) // st))  # ceil((target - reach_hi) / st)
        c_hi = min(hi_c, (target - reach_lo[i + 1]) // st)
        for c in range(c_lo, c_hi + 1):
            steps[0] -= 1
            if steps[0] < 0 or reachable(i + 1, target - c * st):
                return True  # out of budget: say "may overlap"
        return False

    return reachable(0, b.data_ptr() - a.data_ptr())


def extent(x) -> int:
    """Bytes from x's first element to one past its last (non-negative strides); 0 for an empty
    tensor or anything that is not a tensor."""
    if not isinstance(x, torch.Tensor) or not x.numel():
        return 0
    return (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()


def store_extents(
    q,
    k,
    v,
    k_cache,
    v_cache,
    positions=None,
    table=None,
    slot_mapping=None,
    q_out=None,
    wq=None,
    wk=None,
    qn=None,
    kn=None,
) -> tuple:
    """Bytes from the first element to one past the last of q, k_cache, v_cache, k, v (the order
    `store_aliasing` takes them in), then of positions (or cu_seqlens), table, slot_mapping, q_out,
    the norm weights of q and k, the no-rope parts q_nope and k_nope; 0 for an empty tensor or None."""
    tensors = (q, k_cache, v_cache, k, v, positions, table, slot_mapping, q_out, wq, wk, qn, kn)
    return tuple(extent(x) for x in tensors)


def store_aliasing(op, q, k, v, k_cache, v_cache, extents=None, memo=None, q_out=None, write_key=False) -> None:
    """Nothing written (q or q_out, k_cache, v_cache, and k with write_key) may share memory with
    anything else the kernel touches.

    Pairs whose byte ranges miss each other (the usual case) cost two compares; the others are
    decided by may_alias. `extents` (store_extents of these tensors) and `memo` (a dict kept per
    call signature: verdicts by pair and byte distance) let repeated calls skip the work.
    """
    if extents is None:
        extents = store_extents(q, k, v, k_cache, v_cache, q_out=q_out)
    # the written ones first (q's place taken by q_out when given, q then read last), then the read ones
    named = [
        ("q", q, extents[0]) if q_out is None else ("q_out", q_out, extents[8]),
        ("k_cache", k_cache, extents[1]),
        ("v_cache", v_cache, extents[2]),
        ("k", k, extents[3]),
        ("v", v, extents[4]),
    ]
    if q_out is not None:
        named.append(("q", q, extents[0]))
    n = len(named)
    ptrs = [x.data_ptr() for _, x, _ in named]
    for i in range(4 if write_key else 3):  # the written ones, against all that follow
        for j in range(i + 1, n):
            a, b = ptrs[i], ptrs[j]
            if not (a < b + named[j][2] and b < a + named[i][2]):
                continue
            key = (i, j, b - a)
            verdict = None if memo is None else memo.get(key)
            if verdict is None:
                verdict = may_alias(named[i][1], named[j][1])
                if memo is not None:
                    if len(memo) >= 64:
                        memo.clear()
                    memo[key] = verdict
            if verdict:
                fail(
                    op,
                    named[j][0],
                    f"memory disjoint from {named[i][0]} (which is written)",
                    f"a tensor overlapping {named[i][0]}",
                )


def rerotate_aliasing(
    op, k_cache, slots, delta, cos_sin_cache, k_scale, dst_slots, positions=None, to_cache=None, extents=None
) -> None:
    """The cache (written) shares no byte with the slots, shifts, tables, positions or scale (read).
    extents: None, or the byte extents of (k_cache, slots, dst_slots, delta, cos_sin_cache, positions,
    to_cache, k_scale) (0 for None), kept per call signature: pairs whose ranges miss each other
    cost two compares."""
    written_vs_read(
        op,
        (("k_cache", k_cache),),
        (
            ("slots", slots),
            ("dst_slots", dst_slots),
            ("delta", delta),
            ("cos_sin_cache", cos_sin_cache),
            ("positions", positions),
            ("to_cache", to_cache),
            ("k_scale", k_scale),
        ),
        extents=extents,
    )
