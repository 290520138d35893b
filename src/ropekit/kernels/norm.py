"""RMSNorm of q and k before RoPE: jit helpers of the one kernel family (no entry points here).

    y = x * rsqrt(mean(x^2) + eps) * (w + offset)      float32, then the rotation

The norm group is one head (mode 1: weight (D,), Qwen3 / Gemma 3; mode 3: no weight, Llama 4's
L2 norm) or all heads of one token (mode 2: weight (H*D,), OLMo 2, Wan 2.1). The kernels already
hold x1, x2, the two members of each rotated pair, for BLOCK_H heads of one token; these helpers
add the tail past the rotary dims, so the whole head is normalized, and scale everything before
the rotation.

Across heads, three schemes. Whole heads (rope_kernel's WHOLE): a head block is all of a tensor's
heads of one token, held in up to three power-of-two tiles (the binary decomposition of H: 40 =
32 + 8, no padded rows), every tile's loads issued before any reduction; tiles_inv_rms sums them in
registers, nothing is read twice. Small blocks with a head loop (one program walks all head blocks
of a token): a pre-pass over the tensor's head blocks (group_inv_rms) sums the squares first; the
block pass then reads the heads again, from cache, and scales by that inverse rms. One padded block
(the fused store): inv_rms sums it (a block of 64 padded heads of 128 spilled in rope_kernel).

Modes are runtime values here: q and k share one code path in rope_kernel (a scalar select), so a
block of q may be normalized while a block of k is not. Mode 0 leaves x unchanged.
"""

import triton
import triton.language as tl

from ..language import column_offset, head_mask, head_rows, load_tail, pair_columns, tail_at


@triton.jit
def inv_rms(
    x1,
    x2,
    t,
    n_heads,
    head0,
    tail_len,
    mode,
    eps,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    r_group,
    GROUP_GIVEN: tl.constexpr,
):
    """rsqrt(mean(x^2) + eps) per head row ((BLOCK_H,) float32) over the head (mode 1) or over all
    heads of the block (mode 2), or, GROUP_GIVEN, mode 2 takes r_group (the token's value computed
    by group_inv_rms over all its head blocks); 1.0 in mode 0. Masked lanes (loaded without
    `other`) count as 0."""
    h = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)[None, :]
    m = (h[:, None] < n_heads) & (i < HALF)
    sq = tl.where(m, x1 * x1 + x2 * x2, 0.0)
    ss = tl.sum(sq, axis=1)
    if TAIL_PAD > 0:
        ss += tl.sum(t * t, axis=1)  # t is 0 where masked (load_tail)
    d = 2 * HALF + tail_len
    mode_v = tl.zeros([BLOCK_H], tl.int32) + mode  # a vector: scalar-and-vector selects trip the interpreter
    if GROUP_GIVEN:
        r = tl.where(mode_v == 2, r_group, 1.0 / tl.sqrt(ss / d + eps))
    else:
        total = tl.zeros([BLOCK_H], tl.float32) + tl.sum(ss, axis=0)
        ss = tl.where(mode_v == 2, total, ss)
        count = tl.where(mode_v == 2, n_heads * d, d).to(tl.float32)
        r = 1.0 / tl.sqrt(ss / count + eps)
    return tl.where(mode_v == 0, 1.0, r)


@triton.jit
def _sum_squares(
    x_base,
    stride_x_head,
    n_heads,
    head0,
    tail_len,
    ROT_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROT: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    GAP: tl.constexpr,
    stride_col=1,
):
    """Sum of x^2 (float32 scalar) over heads [head0, head0 + BLOCK_H) of one token, all their dims:
    the ROT rotated ones read as one row per head (their pair layout does not matter to a sum; with
    partners GAP = D/2 apart, as the two runs of the pairs' members), then the tail. stride_col:
    x's column stride (ropekit.language.column_offset)."""
    if GAP == ROT // 2:
        j = tl.arange(0, ROT_PAD)[None, :]
        m = head_mask(n_heads, head0, BLOCK_H) & (j < ROT)
        rows = head_rows(x_base, stride_x_head, head0, BLOCK_H)
        x = tl.load(rows + column_offset(j, stride_col), mask=m, other=0.0).to(tl.float32)
        ss = tl.sum(tl.sum(x * x, axis=1), axis=0)
    else:
        row = head_rows(x_base, stride_x_head, head0, BLOCK_H)
        j = tl.arange(0, ROT_PAD // 2)[None, :]
        m = head_mask(n_heads, head0, BLOCK_H) & (j < ROT // 2)
        x1 = tl.load(row + column_offset(j, stride_col), mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row + column_offset(GAP, stride_col) + column_offset(j, stride_col), mask=m, other=0.0)
        x2 = x2.to(tl.float32)
        ss = tl.sum(tl.sum(x1 * x1 + x2 * x2, axis=1), axis=0)
    if TAIL_PAD > 0:
        t = load_tail(x_base, stride_x_head, n_heads, head0, tail_len, ROT // 2, BLOCK_H, TAIL_PAD, GAP, stride_col)
        ss += tl.sum(tl.sum(t * t, axis=1), axis=0)
    return ss


@triton.jit
def group_inv_rms(
    x_base,
    stride_x_head,
    n_heads,
    tail_len,
    eps,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    GAP: tl.constexpr,
    stride_col=1,
):
    """Mode 2's inverse rms of one token (float32 scalar): rsqrt(mean(x^2) + eps) over all n_heads
    heads of x (x_base: the token's first element; stride_col its column stride), walked BLOCK_H
    heads at a time. The caller reads the same heads again right after, so these loads leave them
    in cache."""
    ss = tl.zeros([], tl.float32)
    # two blocks a trip: their loads go out together (two in flight, not one), and the sums are
    # reduced as soon as they land, so the registers are held only briefly
    for head0 in tl.range(0, n_heads, 2 * BLOCK_H):
        ss += _sum_squares(
            x_base, stride_x_head, n_heads, head0, tail_len, 2 * HALF_PAD, BLOCK_H, 2 * HALF, TAIL_PAD, GAP, stride_col
        )
        head1 = head0 + BLOCK_H
        ss += _sum_squares(
            x_base, stride_x_head, n_heads, head1, tail_len, 2 * HALF_PAD, BLOCK_H, 2 * HALF, TAIL_PAD, GAP, stride_col
        )
    count = (n_heads * (2 * HALF + tail_len)).to(tl.float32)
    return 1.0 / tl.sqrt(ss / count + eps)


@triton.jit
def tile_sum_squares(
    x1,
    x2,
    t,
    n_heads,
    head0,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
):
    """Sum of x^2 (float32 scalar) over heads [head0, head0 + BLOCK_H) of one token held in registers:
    the rotated pairs' members x1, x2 (masked lanes, loaded without `other`, left out) and the tail t
    (0 where masked, load_tail; unused when TAIL_PAD is 0)."""
    h = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)[None, :]
    m = (h[:, None] < n_heads) & (i < HALF)
    ss = tl.sum(tl.sum(tl.where(m, x1 * x1 + x2 * x2, 0.0), axis=1), axis=0)
    if TAIL_PAD > 0:
        ss += tl.sum(tl.sum(t * t, axis=1), axis=0)
    return ss


@triton.jit
def _tile_sum_squares_at(
    x_base,
    stride_x_head,
    n_heads,
    head0,
    tail_len,
    x1,
    x2,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    GAP: tl.constexpr,
    stride_col=1,
):
    """tile_sum_squares with the tile's tail read here (the norm reads it again, from cache)."""
    t = x1
    if TAIL_PAD > 0:
        t = load_tail(x_base, stride_x_head, n_heads, head0, tail_len, HALF, BLOCK_H, TAIL_PAD, GAP, stride_col)
    return tile_sum_squares(x1, x2, t, n_heads, head0, HALF, HALF_PAD, BLOCK_H, TAIL_PAD)


@triton.jit
def tiles_inv_rms(
    at,
    eps,
    tiles,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_H2: tl.constexpr,
    BLOCK_H3: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    GAP: tl.constexpr,
    stride_col=1,
):
    """Mode 2's inverse rms of one token (float32 scalar) from all its heads held in up to three
    tiles, tiles = (x1, x2, y1, y2, z1, z2) as load_tiles returns them: (x1, x2) of BLOCK_H heads
    from head0, (y1, y2) of BLOCK_H2 after them, (z1, z2) of BLOCK_H3 after those (a tile of 0
    heads is absent). at: (x_base, stride_x_head, n_heads, head0, tail_len), the token's first
    element, its head stride, heads, the block's first head and the tail. No head is read again
    (only the tails, from cache). The pairs' layout (GAP) and stride_col (x's column stride) matter
    only to the tails' columns."""
    x_base, stride_x_head, n_heads, head0, tail_len = at
    x1, x2, y1, y2, z1, z2 = tiles
    ss = _tile_sum_squares_at(
        x_base, stride_x_head, n_heads, head0, tail_len, x1, x2, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, GAP, stride_col
    )
    if BLOCK_H2 > 0:
        head2 = head0 + BLOCK_H
        ss += _tile_sum_squares_at(
            x_base, stride_x_head, n_heads, head2, tail_len, y1, y2, HALF, HALF_PAD, BLOCK_H2, TAIL_PAD, GAP, stride_col
        )
    if BLOCK_H3 > 0:
        head3 = head0 + BLOCK_H + BLOCK_H2
        ss += _tile_sum_squares_at(
            x_base, stride_x_head, n_heads, head3, tail_len, z1, z2, HALF, HALF_PAD, BLOCK_H3, TAIL_PAD, GAP, stride_col
        )
    count = (n_heads * (2 * HALF + tail_len)).to(tl.float32)
    return 1.0 / tl.sqrt(ss / count + eps)


@triton.jit
def _weight_words(w_row, i, m):
    """Interleaved weight columns (2i, 2i+1) of rows w_row ((R, 1) pointers, word-aligned), one word
    per pair (16-bit weights: 32-bit words, 32-bit weights: 64-bit words): float32 (R, .) tiles."""
    ty = w_row.dtype.element_ty
    if tl.constexpr(ty.primitive_bitwidth) == 16:
        word = tl.load(w_row.to(tl.pointer_type(tl.uint32)) + i, mask=m, other=0, eviction_policy="evict_last")
        lo = word.to(tl.uint16)
        hi = (word >> 16).to(tl.uint16)
    else:
        word = tl.load(w_row.to(tl.pointer_type(tl.uint64)) + i, mask=m, other=0, eviction_policy="evict_last")
        lo = word.to(tl.uint32)
        hi = (word >> 32).to(tl.uint32)
    return lo.to(ty, bitcast=True).to(tl.float32), hi.to(ty, bitcast=True).to(tl.float32)


@triton.jit
def load_norm_weights(
    w_ptr,
    n_heads,
    head0,
    tail_len,
    mode,
    offset,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    SHARED_ROW: tl.constexpr,
    W_PAIRS: tl.constexpr,
    GAP: tl.constexpr,
):
    """(w + offset) at x1's, x2's and the tail's columns, float32 tiles; 1.0 in modes 0 and 3 (no
    weight: the weight is then never read). Mode 2 weights are (H*D,): head h starts at h * D, (BLOCK_H, .) tiles.
    SHARED_ROW (no mode 2 in the launch): every head has the same (D,) row, read once as (1, .)
    tiles that broadcast over the heads, not once per head. W_PAIRS (interleaved columns, the
    weight's base 16-byte aligned): each pair (2i, 2i+1) read as one word, vectorized. Every token
    reads the same weight: kept in cache before the streamed q and k (evict_last)."""
    d = 2 * HALF + tail_len
    if SHARED_ROW:
        mode_v = tl.zeros([1, 1], tl.int32) + mode
        row = tl.zeros([1, 1], tl.int64)
        live = (mode_v == 1) | (mode_v == 2)
    else:
        h = head0 + tl.arange(0, BLOCK_H)
        mode_v = tl.zeros([BLOCK_H, 1], tl.int32) + mode
        row = tl.where(mode_v == 2, h.to(tl.int64)[:, None] * d, 0)  # int64: h * D scaled below 2^63
        live = ((mode_v == 1) | (mode_v == 2)) & (h[:, None] < n_heads)
    on = (mode_v == 1) | (mode_v == 2)
    i = tl.arange(0, HALF_PAD)[None, :]
    m = live & (i < HALF)
    if INTERLEAVED and W_PAIRS:
        w1, w2 = _weight_words(w_ptr + row, i, m)
    else:
        c1, c2 = pair_columns(i, INTERLEAVED, GAP)
        w1 = tl.load(w_ptr + row + c1, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
        w2 = tl.load(w_ptr + row + c2, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
    w1 = tl.where(on, w1 + offset, 1.0)
    w2 = tl.where(on, w2 + offset, 1.0)
    wt = w1
    if TAIL_PAD > 0:
        j = tl.arange(0, TAIL_PAD)[None, :]
        wt = tl.load(
            tail_at(w_ptr + row, j, HALF, GAP), mask=live & (j < tail_len), other=0.0, eviction_policy="evict_last"
        )
        wt = wt.to(tl.float32)
        wt = tl.where(on, wt + offset, 1.0)
    return w1, w2, wt


@triton.jit
def norm_heads(
    at,
    xs,
    weight,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    GAP: tl.constexpr,
):
    """Normalize heads [head0, head0 + BLOCK_H) of one token: returns y1, y2 (the rotated pairs'
    members) and the normalized tail (float32, (BLOCK_H, TAIL_PAD); x1 itself when TAIL_PAD is 0).
    at: (x_base, stride_x_head, n_heads, head0, tail_len), x_base the token's first element (the
    tail is read from there); xs: the loaded pairs (x1, x2); weight: (w_ptr, mode, eps, offset).
    Mode 2 sums over the block's heads: the block must hold all of them."""
    return norm_heads_given(
        at, xs, weight, 1.0, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, False, False, False, GAP
    )


@triton.jit
def norm_heads_given(
    at,
    xs,
    weight,
    r_group,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    GROUP_GIVEN: tl.constexpr,
    SHARED_ROW: tl.constexpr,
    W_PAIRS: tl.constexpr,
    GAP: tl.constexpr,
    stride_col=1,
):
    """norm_heads, where with GROUP_GIVEN mode 2 scales by r_group, the token's inverse rms over all
    its heads (group_inv_rms or tiles_inv_rms), so the block may hold a few of them; SHARED_ROW and
    W_PAIRS: how the weight is read (load_norm_weights); stride_col: x's column stride (its tail)."""
    x_base, stride_x_head, n_heads, head0, tail_len = at
    x1, x2 = xs
    w_ptr, mode, eps, offset = weight
    t = x1
    if TAIL_PAD > 0:
        t = load_tail(x_base, stride_x_head, n_heads, head0, tail_len, HALF, BLOCK_H, TAIL_PAD, GAP, stride_col)
    r = inv_rms(
        x1, x2, t, n_heads, head0, tail_len, mode, eps, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, r_group, GROUP_GIVEN
    )[:, None]
    w1, w2, wt = load_norm_weights(
        w_ptr,
        n_heads,
        head0,
        tail_len,
        mode,
        offset,
        HALF,
        HALF_PAD,
        BLOCK_H,
        TAIL_PAD,
        INTERLEAVED,
        SHARED_ROW,
        W_PAIRS,
        GAP,
    )
    y1 = x1 * r * w1
    y2 = x2 * r * w2
    if TAIL_PAD > 0:
        t = t * r * wt
    return y1, y2, t


@triton.jit
def norm_backward(
    terms,
    heads,
    r,
    mode,
    mean_group,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
):
    """Backward of y = n * w', n = x * r over the norm group, given gz = dL/dy (float32 tiles):
    gx = r * (gz*w' - n * mean(gz*w'*n)); also returns the weight-gradient terms gz * n.
    terms: (x1, x2, xt, gz1, gz2, gzt, w1, w2, wt), x, gz and the weight w' at the rotated pairs'
    members and the tail; heads: (n_heads, head0, tail_len). r: (BLOCK_H, 1) inverse rms; w' = 1
    and r = 1 in mode 0 (then gx = gz). Mode 2 takes mean_group, the token's mean over all its
    heads (from group_sums), for r's group."""
    x1, x2, xt, gz1, gz2, gzt, w1, w2, wt = terms
    n_heads, head0, tail_len = heads
    h = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)[None, :]
    m = (h[:, None] < n_heads) & (i < HALF)
    n1 = tl.where(m, x1 * r, 0.0)
    n2 = tl.where(m, x2 * r, 0.0)
    a1 = tl.where(m, gz1 * w1, 0.0)
    a2 = tl.where(m, gz2 * w2, 0.0)
    dot = tl.sum(a1 * n1 + a2 * n2, axis=1)
    nt = xt
    at = xt
    if TAIL_PAD > 0:
        j = tl.arange(0, TAIL_PAD)[None, :]
        mt = (h[:, None] < n_heads) & (j < tail_len)
        nt = tl.where(mt, xt * r, 0.0)
        at = tl.where(mt, gzt * wt, 0.0)
        dot += tl.sum(at * nt, axis=1)
    d = 2 * HALF + tail_len
    mode_v = tl.zeros([BLOCK_H], tl.int32) + mode
    mean = tl.where(mode_v == 2, mean_group, dot / d)
    mean = tl.where(mode_v == 0, 0.0, mean)[:, None]
    gx1 = r * (a1 - n1 * mean)
    gx2 = r * (a2 - n2 * mean)
    gxt = at
    if TAIL_PAD > 0:
        gxt = r * (at - nt * mean)
    # gz is NaN in padded lanes (the angle loads' masked value): masked before any sum
    dw1 = tl.where(m, gz1 * n1, 0.0)
    dw2 = tl.where(m, gz2 * n2, 0.0)
    dwt = at
    if TAIL_PAD > 0:
        dwt = tl.where(mt, gzt * nt, 0.0)
    return gx1, gx2, gxt, dw1, dw2, dwt


@triton.jit
def group_sums(
    terms,
    heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
):
    """One head block's share of mode 2's per-token sums (float32 scalars): sum(x^2), and
    sum(gz * w' * x) (r times that is the sum of gz*w'*n the backward's mean needs). terms and
    heads as norm_backward takes them; padded lanes (gz may be NaN there) are masked off."""
    x1, x2, xt, gz1, gz2, gzt, w1, w2, wt = terms
    n_heads, head0, tail_len = heads
    h = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)[None, :]
    m = (h[:, None] < n_heads) & (i < HALF)
    ss = tile_sum_squares(x1, x2, xt, n_heads, head0, HALF, HALF_PAD, BLOCK_H, TAIL_PAD)  # xt: 0 where masked
    gd = tl.sum(tl.sum(tl.where(m, gz1 * w1 * x1 + gz2 * w2 * x2, 0.0), axis=1), axis=0)
    if TAIL_PAD > 0:
        j = tl.arange(0, TAIL_PAD)[None, :]
        mt = (h[:, None] < n_heads) & (j < tail_len)
        gd += tl.sum(tl.sum(tl.where(mt, gzt * wt * xt, 0.0), axis=1), axis=0)
    return ss, gd
