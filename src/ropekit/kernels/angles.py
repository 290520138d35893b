"""A token's rotation angles, read or computed inside the kernels (rope_kernel, its norm backward
and the fused store share `load_angles`).

Where they come from: rows of a (max_position, .) table picked by the token's position (M-RoPE:
each frequency's section picks the row), per-token cos / sin rows, or (FREQS) positions x inverse
frequencies computed here, one axis per section (axial N-D RoPE, float positions).

`packed_position` is the in-kernel twin of `ropekit.positions_from_cu_seqlens`: the token's
sequence is found by a two-level search of cu_seqlens (two dependent vector loads of one small,
cached array, so the grid stays linear in tokens however many sequences there are), then its
position restarts at 0 in that sequence, mapped through the dual-chunk layout of context
parallelism.

Addressing: positions are widened to int64 before they scale a stride (kernels/rope.py's rule).
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


@triton.jit
def _section_of(i, SEC_T, SEC_H, SEC_W, MROPE: tl.constexpr):
    """M-RoPE: which position row (0 temporal, 1 height, 2 width) drives frequency i."""
    if MROPE == 1:
        # chunked: [0, t) temporal, [t, t+h) height, [t+h, t+h+w) width
        sec = (i >= SEC_T).to(tl.int32) + (i >= SEC_T + SEC_H).to(tl.int32)
    else:
        # interleaved (Qwen3-VL): frequencies 1, 4, 7, ... < 3h use height, 2, 5, 8, ... < 3w width
        sec = tl.where((i % 3 == 1) & (i < 3 * SEC_H), 1, tl.where((i % 3 == 2) & (i < 3 * SEC_W), 2, 0))
    return sec


@triton.jit
def _angle_row(cos_ptr, sin_ptr, row, col, m, other):
    """cos and sin at one table row (float32 vectors); masked-off lanes read nothing."""
    c = tl.load(cos_ptr + row + col, mask=m, other=other, eviction_policy="evict_last").to(tl.float32)
    sn = tl.load(sin_ptr + row + col, mask=m, other=other, eviction_policy="evict_last").to(tl.float32)
    return c, sn


@triton.jit
def _axis_of(i, SEC_T, SEC_H, SEC_W):
    """Axial RoPE: the axis (0 to 3) whose position drives frequency i; the first three axes hold
    SEC_T, SEC_H, SEC_W frequencies, the fourth the rest (sections of an absent axis are 0)."""
    return (i >= SEC_T).to(tl.int64) + (i >= SEC_T + SEC_H).to(tl.int64) + (i >= SEC_T + SEC_H + SEC_W).to(tl.int64)


@triton.jit
def _cos_sin(p, f):
    """cos and sin of the angle p * f (float32 vectors) without the product's rounding error: with
    a = fl(p * f), e = fma(p, f, -a) is exact (p * f == a + e), and cos / sin of a + e follow from
    those of a and of the small e by the angle-sum formulas. The result is then as accurate as
    float32 cos / sin themselves at any |p * f| (a float32 product alone is off by up to
    |p * f| * 2^-24 radians: 0.03 at a million)."""
    a = p * f
    e = tl.fma(p, f, -a)
    ca = tl.cos(a)
    sa = tl.sin(a)
    ce = tl.cos(e)
    se = tl.sin(e)
    return ca * ce - sa * se, sa * ce + ca * se


@triton.jit
def _freq_angles(freq_ptr, pos_tok, stride_pos_row, col, fmask, SEC_T, SEC_H, SEC_W, HALF_PAD: tl.constexpr):
    """cos and sin of one token computed from positions (int or float, any of up to four axis rows
    at pos_tok) and float32 inverse frequencies (at freq_ptr, element stride in col)."""
    i = tl.arange(0, HALF_PAD)
    axis = _axis_of(i, SEC_T, SEC_H, SEC_W)
    p = tl.load(pos_tok + axis * stride_pos_row, mask=fmask, other=0).to(tl.float32)
    f = tl.load(freq_ptr + col, mask=fmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return _cos_sin(p, f)


@triton.jit
def load_angles(
    src,
    b,
    s,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_POS: tl.constexpr,
    MROPE: tl.constexpr,
    PACKED: tl.constexpr,
    SEARCH_STRIDE: tl.constexpr,
    SEARCH_COARSE: tl.constexpr,
    FREQS: tl.constexpr,
):
    """cos and sin of token (b, s), float32 vectors of HALF_PAD (NaN where the position is out of range).

    src: the kernel's angle arguments as one group, ((pos_ptr, stride_pos_row, stride_pos_batch,
    stride_pos_token), (cos_ptr, sin_ptr, max_pos), (stride_angle_row, stride_angle_batch,
    stride_angle_token, stride_angle_col), (SEC_T, SEC_H, SEC_W, n_seqs, cp_size, cp_rank)).

    FREQS: computed from positions (stride_pos_row apart per axis) and the inverse frequencies at
    cos_ptr, SEC_T / SEC_H / SEC_W the axis sections (_freq_angles).

    M-RoPE reads, from each of the three positions' rows, only the frequencies of that row's
    section (masked vector loads: a third of the table traffic of whole rows) and merges them with
    selects: a per-frequency gather would not vectorize.
    """
    pos, tab, strides, rows = src
    pos_ptr, stride_pos_row, stride_pos_batch, stride_pos_token = pos
    cos_ptr, sin_ptr, max_pos = tab
    stride_angle_row, stride_angle_batch, stride_angle_token, stride_angle_col = strides
    SEC_T, SEC_H, SEC_W, n_seqs, cp_size, cp_rank = rows
    i = tl.arange(0, HALF_PAD)
    fmask = i < HALF
    col = i.to(tl.int64) * stride_angle_col
    nan = float("nan")
    if MROPE != 0:
        sec = _section_of(i, SEC_T, SEC_H, SEC_W, MROPE)
        m0, m1, m2 = fmask & (sec == 0), fmask & (sec == 1), fmask & (sec == 2)
    else:
        m0, m1, m2 = fmask, fmask, fmask
    if FREQS:
        pos_tok = pos_ptr + b * stride_pos_batch + s * stride_pos_token  # b, s are int64
        c, sn = _freq_angles(cos_ptr, pos_tok, stride_pos_row, col, fmask, SEC_T, SEC_H, SEC_W, HALF_PAD)
    elif HAS_POS:
        pos_tok = pos_ptr + b * stride_pos_batch + s * stride_pos_token  # b, s are int64
        # positions as vectors (all lanes one value): scalar-and-vector masks trip the interpreter.
        # A bad position must never address memory: its loads are masked off and yield NaN.
        if PACKED:
            # packed tokens (T,): s is the token index into cu_seqlens' tokens
            p0 = packed_position(pos_ptr, n_seqs, s, cp_size, cp_rank, SEARCH_STRIDE, SEARCH_COARSE) + tl.zeros(
                [HALF_PAD], tl.int64
            )
        else:
            p0 = tl.load(pos_tok).to(tl.int64) + tl.zeros([HALF_PAD], tl.int64)
        c, sn = _angle_row(cos_ptr, sin_ptr, p0 * stride_angle_token, col, m0 & (p0 >= 0) & (p0 < max_pos), nan)
        if MROPE != 0:
            p1 = tl.load(pos_tok + stride_pos_row).to(tl.int64) + tl.zeros([HALF_PAD], tl.int64)
            p2 = tl.load(pos_tok + 2 * stride_pos_row).to(tl.int64) + tl.zeros([HALF_PAD], tl.int64)
            c1, s1 = _angle_row(cos_ptr, sin_ptr, p1 * stride_angle_token, col, m1 & (p1 >= 0) & (p1 < max_pos), nan)
            c2, s2 = _angle_row(cos_ptr, sin_ptr, p2 * stride_angle_token, col, m2 & (p2 >= 0) & (p2 < max_pos), nan)
            c = tl.where(sec == 0, c, tl.where(sec == 1, c1, c2))
            sn = tl.where(sec == 0, sn, tl.where(sec == 1, s1, s2))
    else:
        row = b * stride_angle_batch + s * stride_angle_token
        c, sn = _angle_row(cos_ptr, sin_ptr, row, col, m0, 0.0)
        if MROPE != 0:
            c1, s1 = _angle_row(cos_ptr, sin_ptr, row + stride_angle_row, col, m1, 0.0)
            c2, s2 = _angle_row(cos_ptr, sin_ptr, row + 2 * stride_angle_row, col, m2, 0.0)
            c = tl.where(sec == 0, c, tl.where(sec == 1, c1, c2))
            sn = tl.where(sec == 0, sn, tl.where(sec == 1, s1, s2))
    return c, sn
