"""Positions derived inside the kernel: packed sequences (THD) and context parallelism.

`_packed_position` is the in-kernel twin of `ropekit.positions_from_cu_seqlens`: the token's
sequence is found by a binary search of cu_seqlens (a few dependent loads of one small, cached
array, so the grid stays linear in tokens however many sequences there are), then its position
restarts at 0 in that sequence, mapped through the dual-chunk layout of context parallelism.
"""

import triton
import triton.language as tl


@triton.jit
def _packed_position(cu_ptr, n_seqs, n_steps, t, cp_size, cp_rank):
    """Position of token t (int64) of a rank's packed tokens; cu_ptr: (n_seqs + 1,) cumulative
    local lengths. n_steps = bit_length(n_seqs) halvings find the last sequence starting at or before
    t (empty sequences start where the next one does, so they are skipped). With cp_size > 1 a local
    sequence of length L holds chunks cp_rank and 2 * cp_size - 1 - cp_rank of its global sequence:
        s <  L/2: s + cp_rank * L/2
        s >= L/2: s + L * cp_size - (cp_rank + 1) * L/2 - L/2
    Returns an int64 position, as ropekit.positions_from_cu_seqlens gives it: -1 (out of the table:
    NaN) for a token of an odd-length sequence under context parallelism, 0 for a token past
    cu_seqlens[-1] (padding at the end of the buffer)."""
    lo = t * 0                                # int64 zeros: the search runs in t's type
    hi = lo + n_seqs
    for _ in range(n_steps):
        mid = (lo + hi) // 2
        start = tl.load(cu_ptr + mid).to(tl.int64)
        go_right = start <= t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    start = tl.load(cu_ptr + lo).to(tl.int64)
    end = tl.load(cu_ptr + lo + 1).to(tl.int64)
    s = t - start
    length = end - start
    half = length // 2
    pos = tl.where(s < half, s + cp_rank * half, s + length * cp_size - (cp_rank + 1) * half - half)
    pos = tl.where(cp_size > 1, tl.where(length % 2 == 0, pos, -1), s)
    return tl.where(t < end, pos, 0)
