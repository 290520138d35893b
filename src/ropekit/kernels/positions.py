"""Positions derived inside the kernel: packed sequences (THD) and context parallelism.

`packed_position` is the in-kernel twin of `ropekit.positions_from_cu_seqlens`: the token's
sequence is found by a two-level search of cu_seqlens (two dependent vector loads of one small,
cached array, so the grid stays linear in tokens however many sequences there are), then its
position restarts at 0 in that sequence, mapped through the dual-chunk layout of context
parallelism.
"""

import triton
import triton.language as tl


@triton.jit
def packed_position(cu_ptr, n_seqs, t, cp_size, cp_rank, STRIDE: tl.constexpr, COARSE: tl.constexpr):
    """Position of token t (int64) of a rank's packed tokens; cu_ptr: (n_seqs + 1,) cumulative
    local lengths. Two dependent vector loads find the last sequence starting at or before t
    (empty sequences start where the next one does, so they are skipped): every STRIDE-th entry
    (COARSE of them cover the array), then the STRIDE entries of the block found. A scalar binary
    search would be ~log2(n_seqs) dependent loads before the table row can be read.
    With cp_size > 1 a local sequence of length L holds chunks cp_rank and 2 * cp_size - 1 - cp_rank
    of its global sequence:
        s <  L/2: s + cp_rank * L/2
        s >= L/2: s + L * cp_size - (cp_rank + 1) * L/2 - L/2
    Returns an int64 position, as ropekit.positions_from_cu_seqlens gives it: -1 (out of the table:
    NaN) for a token of an odd-length sequence under context parallelism, 0 for a token past
    cu_seqlens[-1] (padding at the end of the buffer)."""
    # indices past the array are clamped to its last entry (always there) and their lanes dropped:
    # unmasked loads of the index array
    j = tl.arange(0, COARSE).to(tl.int64) * STRIDE
    v = tl.load(cu_ptr + tl.minimum(j, n_seqs)).to(tl.int64)
    block = tl.sum(((v <= t) & (j <= n_seqs)).to(tl.int32), axis=0) - 1
    base = tl.maximum(block, 0).to(tl.int64) * STRIDE
    k = base + tl.arange(0, STRIDE).to(tl.int64)
    w = tl.load(cu_ptr + tl.minimum(k, n_seqs)).to(tl.int64)
    seq = base + tl.sum(((w <= t) & (k <= n_seqs)).to(tl.int32), axis=0) - 1
    seq = tl.minimum(tl.maximum(seq, 0), n_seqs - 1)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    s = t - start
    length = end - start
    half = length // 2
    pos = tl.where(s < half, s + cp_rank * half, s + length * cp_size - (cp_rank + 1) * half - half)
    pos = tl.where(cp_size > 1, tl.where(length % 2 == 0, pos, -1), s)
    return tl.where(t < end, pos, 0)
