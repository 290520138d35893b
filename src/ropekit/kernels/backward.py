"""The backward of the normed rotation: rope_norm_backward_kernel, the second entry point of the
family's rotation (the plain rotation's backward is rope_kernel with INVERSE).

For y = rotate(rmsnorm(x) * (w + offset)) per head or across a token's heads, it un-rotates the
output gradient by the same angles as the forward (load_angles), then applies the norm's backward
(.norm) and writes gx and, with a weight, float32 partial sums of dw per program.

Built from ropekit.language like rope_kernel; addressing: its rule (tokens, heads and positions
widened to int64 before any product with a stride).
"""

import triton
import triton.language as tl

from ..language import (
    head_mask,
    head_rows,
    load_angles,
    load_heads,
    load_tail,
    load_tiles,
    pair_columns,
    rotate,
    store_heads,
    store_tail,
    tail_at,
    token_offset,
)
from .norm import group_sums, inv_rms, load_norm_weights, norm_backward
from .prologue import token_prologue


@triton.jit
def _col(stride, STRIDED: tl.constexpr):
    """A tensor's column stride for the pair and tail helpers' stride_col: the runtime value with
    STRIDED (x, g or gx has a last stride other than 1), else the constexpr 1, whose code is the
    unit-stride code (ropekit.language.column_offset). Passed straight into a call: a name assigned
    a constexpr becomes a tensor."""
    if STRIDED:
        return stride
    else:
        return 1


@triton.jit
def _unrotate(
    at,
    gs,
    cs,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INVERSE: tl.constexpr,
    GAP: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """gz, the gradient before the forward's rotation, from g's rotated pairs gs = (g1, g2) of heads
    [head0, head0 + BLOCK_H) (rotated by minus the forward's angles cs = (c, sn)), and g's tail
    (read; float32 tiles). at: (g_base, stride_g_head, n_heads, head0, tail, g's column stride),
    g's token (the column stride read with STRIDED only)."""
    g_base, stride_g_head, n_heads, head0, tail, g_col = at
    g1, g2 = gs
    c, sn = cs
    gz1, gz2 = rotate(g1, g2, c[None, :], sn[None, :], not INVERSE)
    gzt = gz1
    if TAIL_PAD > 0:
        gzt = load_tail(g_base, stride_g_head, n_heads, head0, tail, HALF, BLOCK_H, TAIL_PAD, GAP, _col(g_col, STRIDED))
    return gz1, gz2, gzt


@triton.jit
def _store_grad(
    at,
    grads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACK: tl.constexpr,
    GAP: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """Store the input gradient grads = (gx1, gx2, gxt) of heads [head0, head0 + BLOCK_H) of one
    token, tail included. at: (gx_base, stride_gx_head, n_heads, head0, tail, gx's column stride)."""
    gx_base, stride_gx_head, n_heads, head0, tail, gx_col = at
    gx1, gx2, gxt = grads
    store_heads(
        gx_base,
        stride_gx_head,
        n_heads,
        head0,
        gx1,
        gx2,
        HALF,
        HALF_PAD,
        BLOCK_H,
        INTERLEAVED,
        PACK,
        GAP,
        _col(gx_col, STRIDED),
    )
    if TAIL_PAD > 0:
        store_tail(
            gx_base, stride_gx_head, n_heads, head0, tail, gxt, HALF, BLOCK_H, TAIL_PAD, GAP, _col(gx_col, STRIDED)
        )


@triton.jit
def _put_dw_heads(
    row,
    heads,
    ds,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    GAP: tl.constexpr,
):
    """Across-heads weight-gradient terms of heads [head0, head0 + BLOCK_H) (float32 tiles as
    norm_backward returns them) into a partial-sum row of H*D floats, head h at h * D: added to
    what the row holds (ACCUMULATE) or stored (the row's start). heads: (n_heads, head0, tail);
    ds: the terms (d1, d2, dt)."""
    n_heads, head0, tail = heads
    d1, d2, dt = ds
    live = head_mask(n_heads, head0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)[None, :]
    m = live & (i < HALF)
    c1, c2 = pair_columns(i, INTERLEAVED, GAP)
    hrow = head_rows(row, 2 * HALF + tail, head0, BLOCK_H)
    if ACCUMULATE:
        d1 += tl.load(hrow + c1, mask=m, other=0.0)
        d2 += tl.load(hrow + c2, mask=m, other=0.0)
    tl.store(hrow + c1, d1, mask=m)
    tl.store(hrow + c2, d2, mask=m)
    if TAIL_PAD > 0:
        jt = tl.arange(0, TAIL_PAD)[None, :]
        mt = live & (jt < tail)
        if ACCUMULATE:
            dt += tl.load(tail_at(hrow, jt, HALF, GAP), mask=mt, other=0.0)
        tl.store(tail_at(hrow, jt, HALF, GAP), dt, mask=mt)


@triton.jit
def _tile_terms(
    tok,
    cs,
    head0,
    x1,
    x2,
    g1,
    g2,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
    NORM: tl.constexpr,
    W_PAIRS: tl.constexpr,
    GAP: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """What a norm's backward needs of heads [head0, head0 + BLOCK_H) of one token, given their
    loaded pairs of x (x1, x2) and of g (g1, g2): x, gz (the unrotated output gradient) and the
    weight (w + offset) at the same columns, float32 tiles (rotated pairs' members, then the tail;
    the tails are read here), as one group `terms` (x1, x2, xt, gz1, gz2, gzt, w1, w2, wt). Per
    head (NORM 1) the weight is a (1, .) row shared by the heads. tok: the token's group (x, g, gx
    first elements, weight, their head strides, heads, tail, eps, offset, then x's, g's and gx's
    column strides, read with STRIDED only); cs: its angles."""
    x_base, g_base, _, w_ptr, stride_x_head, stride_g_head, _, n_heads, tail, _, norm_offset, x_col, g_col, _ = tok
    c, sn = cs
    gz1, gz2, gzt = _unrotate(
        (g_base, stride_g_head, n_heads, head0, tail, g_col),
        (g1, g2),
        (c, sn),
        HALF,
        BLOCK_H,
        TAIL_PAD,
        INVERSE,
        GAP,
        STRIDED,
    )
    xt = gz1
    if TAIL_PAD > 0:
        xt = load_tail(x_base, stride_x_head, n_heads, head0, tail, HALF, BLOCK_H, TAIL_PAD, GAP, _col(x_col, STRIDED))
    w1, w2, wt = load_norm_weights(
        w_ptr, n_heads, head0, tail, NORM, norm_offset, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED,
        NORM == 1, W_PAIRS, GAP,
    )  # fmt: skip
    return x1, x2, xt, gz1, gz2, gzt, w1, w2, wt


@triton.jit
def _block_terms(
    tok,
    cs,
    head0,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    OUT_INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
    PACK: tl.constexpr,
    W_PAIRS: tl.constexpr,
    GAP: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """_tile_terms of heads [head0, head0 + BLOCK_H) of one token across heads (NORM 2), their x
    and g read here."""
    x_base, g_base, stride_x_head, stride_g_head, n_heads = tok[0], tok[1], tok[4], tok[5], tok[7]
    g1, g2 = load_heads(
        g_base, stride_g_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, OUT_INTERLEAVED, PACK, "", GAP,
        _col(tok[12], STRIDED),
    )  # fmt: skip
    x1, x2 = load_heads(
        x_base,
        stride_x_head,
        n_heads,
        head0,
        HALF,
        HALF_PAD,
        BLOCK_H,
        INTERLEAVED,
        PACK,
        "",
        GAP,
        _col(tok[11], STRIDED),
    )
    return _tile_terms(
        tok,
        cs,
        head0,
        x1,
        x2,
        g1,
        g2,
        HALF,
        HALF_PAD,
        BLOCK_H,
        TAIL_PAD,
        INTERLEAVED,
        INVERSE,
        2,
        W_PAIRS,
        GAP,
        STRIDED,
    )


@triton.jit
def _tile_grads(
    tok,
    head0,
    terms,
    r_group,
    mean_group,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACK: tl.constexpr,
    NORM: tl.constexpr,
    GAP: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """The norm's backward of heads [head0, head0 + BLOCK_H) of one token (terms as _tile_terms
    returns them): gx stored, the weight-gradient terms gz * n returned. Per head (NORM 1) each head
    has its own inverse rms; across heads (NORM 2) the token's r_group and mean_group (from the
    group's sums) are given."""
    gx_base, stride_gx_head, n_heads, tail, norm_eps = tok[2], tok[6], tok[7], tok[8], tok[9]
    x1, x2, xt = terms[0], terms[1], terms[2]
    if NORM == 2:
        r = tl.zeros([BLOCK_H, 1], tl.float32) + r_group
    else:
        r = inv_rms(x1, x2, xt, n_heads, head0, tail, NORM, norm_eps, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, 1.0, False)[
            :, None
        ]
    gx1, gx2, gxt, d1, d2, dt = norm_backward(
        terms, (n_heads, head0, tail), r, NORM, mean_group, HALF, HALF_PAD, BLOCK_H, TAIL_PAD
    )
    _store_grad(
        (gx_base, stride_gx_head, n_heads, head0, tail, tok[13]),
        (gx1, gx2, gxt),
        HALF,
        HALF_PAD,
        BLOCK_H,
        TAIL_PAD,
        INTERLEAVED,
        PACK,
        GAP,
        STRIDED,
    )
    return d1, d2, dt


@triton.jit
def _across_backward_token(
    tok,
    cs,
    row,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    OUT_INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
    PACK: tl.constexpr,
    W_PAIRS: tl.constexpr,
    GAP: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """The across-heads (mode 2) backward of one token (tok, cs: _tile_terms'), its heads walked
    BLOCK_H at a time: a pre-pass sums x^2 and gz*w'*x over all heads (the inverse rms and the mean
    term every head's gradient needs), then a pass writes gx and adds gz*n to the weight-gradient
    row (in memory: a row of all H*D columns would not stay in registers at this block size). The
    second pass re-reads the token's heads right after the first, from cache."""
    n_heads, tail, norm_eps = tok[7], tok[8], tok[9]
    ss = tl.zeros([], tl.float32)
    gd = tl.zeros([], tl.float32)
    for head0 in tl.range(0, n_heads, BLOCK_H):
        terms = _block_terms(
            tok, cs, head0, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, OUT_INTERLEAVED, INVERSE, PACK, W_PAIRS,
            GAP, STRIDED,
        )  # fmt: skip
        bss, bgd = group_sums(terms, (n_heads, head0, tail), HALF, HALF_PAD, BLOCK_H, TAIL_PAD)
        ss += bss
        gd += bgd
    count = (n_heads * (2 * HALF + tail)).to(tl.float32)
    r = 1.0 / tl.sqrt(ss / count + norm_eps)
    mean = r * gd / count  # mean(gz * w' * n), n = x * r
    for head0 in tl.range(0, n_heads, BLOCK_H):
        terms = _block_terms(
            tok, cs, head0, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, OUT_INTERLEAVED, INVERSE, PACK, W_PAIRS,
            GAP, STRIDED,
        )  # fmt: skip
        d1, d2, dt = _tile_grads(
            tok, head0, terms, r, mean, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, PACK, 2, GAP, STRIDED
        )
        _put_dw_heads(
            row, (n_heads, head0, tail), (d1, d2, dt), HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, True, GAP
        )
    # the next token adds to the row elements written here, maybe by other threads of the program
    tl.debug_barrier()


@triton.jit
def _whole_backward_token(
    tok,
    cs,
    x_tiles,
    g_tiles,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_H2: tl.constexpr,
    BLOCK_H3: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
    PACK: tl.constexpr,
    NORM: tl.constexpr,
    W_PAIRS: tl.constexpr,
    GAP: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """The norm's backward of one token whose every head is in registers: x's and g's pairs in up to
    three tiles (a: BLOCK_H heads from 0, b: BLOCK_H2 after them, c: BLOCK_H3 after those; an absent
    tile repeats a). Across heads (NORM 2) the group's sums run over the tiles, then each tile's gx
    is stored; nothing is read twice. Returns each tile's weight-gradient terms (d1, d2, dt) for the
    caller to sum over its tokens in registers (an absent tile's are a's, never used). tok, cs: the
    token's group and angles (_tile_terms'); x_tiles / g_tiles: x's and g's pairs, tile by tile."""
    n_heads, tail, norm_eps = tok[7], tok[8], tok[9]
    xa1, xa2, xb1, xb2, xc1, xc2 = x_tiles
    ga1, ga2, gb1, gb2, gc1, gc2 = g_tiles
    b0 = BLOCK_H
    c0 = BLOCK_H + BLOCK_H2
    ta = _tile_terms(
        tok,
        cs,
        0,
        xa1,
        xa2,
        ga1,
        ga2,
        HALF,
        HALF_PAD,
        BLOCK_H,
        TAIL_PAD,
        INTERLEAVED,
        INVERSE,
        NORM,
        W_PAIRS,
        GAP,
        STRIDED,
    )
    tb = ta
    tc = ta
    if BLOCK_H2 > 0:
        tb = _tile_terms(
            tok,
            cs,
            b0,
            xb1,
            xb2,
            gb1,
            gb2,
            HALF,
            HALF_PAD,
            BLOCK_H2,
            TAIL_PAD,
            INTERLEAVED,
            INVERSE,
            NORM,
            W_PAIRS,
            GAP,
            STRIDED,
        )
    if BLOCK_H3 > 0:
        tc = _tile_terms(
            tok,
            cs,
            c0,
            xc1,
            xc2,
            gc1,
            gc2,
            HALF,
            HALF_PAD,
            BLOCK_H3,
            TAIL_PAD,
            INTERLEAVED,
            INVERSE,
            NORM,
            W_PAIRS,
            GAP,
            STRIDED,
        )
    r = tl.zeros([], tl.float32) + 1.0
    mean = tl.zeros([], tl.float32)
    if NORM == 2:
        ss, gd = group_sums(ta, (n_heads, 0, tail), HALF, HALF_PAD, BLOCK_H, TAIL_PAD)
        if BLOCK_H2 > 0:
            bss, bgd = group_sums(tb, (n_heads, b0, tail), HALF, HALF_PAD, BLOCK_H2, TAIL_PAD)
            ss += bss
            gd += bgd
        if BLOCK_H3 > 0:
            css, cgd = group_sums(tc, (n_heads, c0, tail), HALF, HALF_PAD, BLOCK_H3, TAIL_PAD)
            ss += css
            gd += cgd
        count = (n_heads * (2 * HALF + tail)).to(tl.float32)
        r = 1.0 / tl.sqrt(ss / count + norm_eps)
        mean = r * gd / count  # mean(gz * w' * n), n = x * r
    da1, da2, dat = _tile_grads(
        tok, 0, ta, r, mean, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, PACK, NORM, GAP, STRIDED
    )
    db1, db2, dbt = da1, da2, dat
    dc1, dc2, dct = da1, da2, dat
    if BLOCK_H2 > 0:
        db1, db2, dbt = _tile_grads(
            tok, b0, tb, r, mean, HALF, HALF_PAD, BLOCK_H2, TAIL_PAD, INTERLEAVED, PACK, NORM, GAP, STRIDED
        )
    if BLOCK_H3 > 0:
        dc1, dc2, dct = _tile_grads(
            tok, c0, tc, r, mean, HALF, HALF_PAD, BLOCK_H3, TAIL_PAD, INTERLEAVED, PACK, NORM, GAP, STRIDED
        )
    return da1, da2, dat, db1, db2, dbt, dc1, dc2, dct


@triton.jit
def _row_sums(acc1, acc2, acc_t, TAIL_PAD: tl.constexpr):
    """Per-head weight-gradient terms of a tile summed over its heads: (HALF_PAD,) and (TAIL_PAD,)."""
    s1 = tl.sum(acc1, axis=0)
    st = s1
    if TAIL_PAD > 0:
        st = tl.sum(acc_t, axis=0)
    return s1, tl.sum(acc2, axis=0), st


@triton.jit(do_not_specialize=["n_tokens", "S", "max_pos", "n_seqs", "tokens_per_program"])
def rope_norm_backward_kernel(
    x_ptr,  # the forward's input (q or k), (*T, H, D) in the INTERLEAVED layout: read when NORM
    g_ptr,  # the output gradient, (*T, H, D) in the OUT_INTERLEAVED layout: read
    gx_ptr,  # the input gradient, (*T, H, D) in x's layout: written
    w_ptr,  # NORM: the RMSNorm weight, (D,) or (H*D,), unit stride; else never read
    dw_ptr,  # NORM: float32 weight-gradient partial sums, a row of dw_row per program (NORM 2 adds in place)
    pos_ptr,  # positions (*T) or (3, *T); (axes, *T) int or float when FREQS; cu_seqlens when PACKED
    cos_ptr,  # cos rows: a [cos | sin] table, or per-token cos; the inverse frequencies when FREQS
    sin_ptr,  # sin rows: the table again (sin at sin_off), or per-token sin
    n_tokens,  # tokens in *T
    S,  # size of the last token dim: token t is (b, s) = (t // S, t % S)
    n_heads,  # H
    tail,  # D - rotary_dim: dims past the rotated ones (normalized, or copied)
    max_pos,  # table rows: positions outside [0, max_pos) read nothing and give NaN
    n_blocks,  # head blocks (the grid's second axis; 1 when NORM is 2 or WHOLE: each program walks them all)
    sin_off,  # elements from sin_ptr to sin's first column
    tokens_per_program,  # tokens each program walks (the grid's first axis covers n_tokens)
    dw_row,  # elements per partial-sum row: D per head (NORM 1), H*D across heads (NORM 2)
    stride_x_batch,  # x's stride of b (0 with one token dim), in elements
    stride_x_token,  # x's stride of s
    stride_x_head,  # x's stride between heads
    stride_g_batch,  # g's strides likewise
    stride_g_token,
    stride_g_head,
    stride_gx_batch,  # gx's strides likewise
    stride_gx_token,
    stride_gx_head,
    stride_x_col,  # x's last-dim stride (1: Triton makes it a constexpr, and STRIDED is off)
    stride_g_col,  # g's
    stride_gx_col,  # gx's
    stride_pos_row,  # positions' stride between M-RoPE rows (t, h, w, ...) or FREQS axes
    stride_pos_batch,  # positions' stride of b
    stride_pos_token,  # positions' stride of s
    stride_angle_row,  # per-token angles' stride between M-RoPE rows
    stride_angle_batch,  # per-token angles' stride of b
    stride_angle_token,  # table row stride, or per-token angles' stride of s
    stride_angle_col,  # stride between frequencies
    SEC_T,  # M-RoPE sections: frequencies driven by the temporal row (FREQS: by axis 0; MROPE 3: the axis map)
    SEC_H,  # ... by the height row (FREQS: axis 1)
    SEC_W,  # ... by the width row (FREQS: axis 2; axis 3 takes the rest)
    n_seqs,  # PACKED: sequences in cu_seqlens (at pos_ptr)
    cp_size,  # PACKED: context-parallel size (1: none)
    cp_rank,  # PACKED: this rank
    norm_eps,  # RMSNorm epsilon
    norm_offset,  # added to the weight (1.0: Gemma's (1 + w))
    HALF: tl.constexpr,  # rotary_dim // 2: rotated pairs per head
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two (tile width)
    GAP: tl.constexpr,  # columns from a half-split pair's first member to its second: HALF, or D/2 (halves)
    BLOCK_H: tl.constexpr,  # heads per head block (NORM 2: a program walks all blocks of its tokens)
    TAIL_PAD: tl.constexpr,  # tail tile width (0: no tail)
    HAS_POS: tl.constexpr,  # angles from table rows picked by positions (else per-token or arange)
    MROPE: tl.constexpr,  # 0 none, 1 chunked sections (Qwen2-VL), 2 interleaved (Qwen3-VL), 3 axis map
    INTERLEAVED: tl.constexpr,  # x and gx hold pairs (2i, 2i+1); else halves (i, i + HALF)
    OUT_INTERLEAVED: tl.constexpr,  # g holds pairs
    INVERSE: tl.constexpr,  # the forward rotated by -angle
    NORM: tl.constexpr,  # the forward's RMSNorm: 0 none, 1 per head, 2 across heads, 3 per head unweighted
    PACKED: tl.constexpr,  # positions derived from cu_seqlens (packed sequences, context parallelism)
    SEARCH_STRIDE: tl.constexpr,  # PACKED: cu_seqlens entries per block of the two-level search
    SEARCH_COARSE: tl.constexpr,  # PACKED: blocks (a power of two covering n_seqs + 1 entries)
    FREQS: tl.constexpr,  # angles computed from positions (any axis rows) x inverse frequencies at cos_ptr
    PACK: tl.constexpr,  # 0, or bits of a (2i, 2i+1) pair moved as one word (x, g and gx pair-aligned)
    WHOLE: tl.constexpr,  # NORM 1 or 2: a token's every head in registers, tiles of BLOCK_H, BLOCK_H2, BLOCK_H3
    BLOCK_H2: tl.constexpr,  # WHOLE: heads of the second tile, after BLOCK_H (0: none)
    BLOCK_H3: tl.constexpr,  # WHOLE: heads of the third tile, after BLOCK_H + BLOCK_H2 (0: none)
    W_PAIRS: tl.constexpr,  # interleaved weight read as one word per pair (16-byte aligned)
    STRIDED: tl.constexpr,  # x, g or gx has a last stride other than 1: columns at int64 col * stride
):
    """Backward of RMSNorm + rotation for one tensor (q or k): program (p, j) takes tokens
    [p * tokens_per_program, (p + 1) * tokens_per_program) of head block j. STRIDED: x, g and gx
    are addressed through their column strides (rope_kernel's STRIDED_IN / STRIDED_OUT); off, the
    unit-stride code.

    gz = inverse rotation of g (read in the forward's output layout); n = x * r;
    gx = r * (gz*w' - n * mean(gz*w'*n)) over the norm group, written in the input layout.
    NORM 0 makes this the plain inverse rotation (the gradient of an unnormalized q or k).
    Angles come from every source rope_kernel takes (load_angles), so any forward has its backward.
    Weight gradient: each program sums gz * n over its tokens (and its heads, per-head weights)
    in registers and writes one float32 row of dw_ptr (row p * n_blocks + j); the launcher sums the
    rows with torch. No atomics: the result is deterministic and the rows are few (one per program).
    WHOLE: one block, a token's every head in up to three tiles (x's and g's loads all issued before
    the angles); across heads the row of H*D sums then stays in registers too. Across heads without
    WHOLE, the heads are walked in blocks twice a token and the row is added to in memory.
    """
    p = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)  # int32-ok: a head-block index (< 65536), scaled by a constexpr block size
    head0 = blk * BLOCK_H
    i = tl.arange(0, HALF_PAD)[None, :]
    zero = tl.zeros([BLOCK_H, HALF_PAD], tl.float32)
    acc1, acc2 = zero, zero
    acc_t = zero
    if TAIL_PAD > 0:
        acc_t = tl.zeros([BLOCK_H, TAIL_PAD], tl.float32)
    # WHOLE: the second and third tiles' sums (absent tiles: placeholders, never used)
    accb1, accb2, accb_t = acc1, acc2, acc_t
    accc1, accc2, accc_t = acc1, acc2, acc_t
    if BLOCK_H2 > 0:
        accb1 = tl.zeros([BLOCK_H2, HALF_PAD], tl.float32)
        accb2 = accb1
        accb_t = accb1
        if TAIL_PAD > 0:
            accb_t = tl.zeros([BLOCK_H2, TAIL_PAD], tl.float32)
    if BLOCK_H3 > 0:
        accc1 = tl.zeros([BLOCK_H3, HALF_PAD], tl.float32)
        accc2 = accc1
        accc_t = accc1
        if TAIL_PAD > 0:
            accc_t = tl.zeros([BLOCK_H3, TAIL_PAD], tl.float32)
    if NORM == 2 and not WHOLE:
        row = dw_ptr + p * dw_row  # this program's weight-gradient partial sums (one program along heads)
        # the row is accumulated in memory, block by block, token by token: start it at zero
        for hz in tl.range(0, n_heads, BLOCK_H):
            _put_dw_heads(
                row,
                (n_heads, hz, tail),
                (acc1, acc2, acc_t),
                HALF,
                HALF_PAD,
                BLOCK_H,
                TAIL_PAD,
                INTERLEAVED,
                False,
                GAP,
            )
        tl.debug_barrier()
    if NORM == 1 and not WHOLE:
        w1, w2, wt = load_norm_weights(
            w_ptr, n_heads, head0, tail, NORM, norm_offset, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED,
            True, W_PAIRS, GAP,
        )  # fmt: skip
    else:
        w1, w2, wt = zero + 1.0, zero + 1.0, acc_t + 1.0
    t_first = p * tokens_per_program
    for j in range(tokens_per_program):
        t = t_first + j
        if t < n_tokens:
            b, s, angles = token_prologue(
                t,
                S,
                (pos_ptr, stride_pos_row, stride_pos_batch, stride_pos_token),
                (cos_ptr, sin_ptr, sin_off, max_pos),
                (stride_angle_row, stride_angle_batch, stride_angle_token, stride_angle_col),
                (SEC_T, SEC_H, SEC_W, n_seqs, cp_size, cp_rank),
            )
            x_base = x_ptr + token_offset(b, s, stride_x_batch, stride_x_token)
            g_base = g_ptr + token_offset(b, s, stride_g_batch, stride_g_token)
            gx_base = gx_ptr + token_offset(b, s, stride_gx_batch, stride_gx_token)
            if WHOLE:
                # every head of g and x in flight before the angles
                ga1, ga2, gb1, gb2, gc1, gc2 = load_tiles(
                    (g_base, stride_g_head, n_heads, 0),
                    HALF,
                    HALF_PAD,
                    BLOCK_H,
                    BLOCK_H2,
                    BLOCK_H3,
                    OUT_INTERLEAVED,
                    PACK,
                    GAP,
                    _col(stride_g_col, STRIDED),
                )
                xa1, xa2, xb1, xb2, xc1, xc2 = load_tiles(
                    (x_base, stride_x_head, n_heads, 0),
                    HALF,
                    HALF_PAD,
                    BLOCK_H,
                    BLOCK_H2,
                    BLOCK_H3,
                    INTERLEAVED,
                    PACK,
                    GAP,
                    _col(stride_x_col, STRIDED),
                )
            else:
                g1, g2 = load_heads(
                    g_base,
                    stride_g_head,
                    n_heads,
                    head0,
                    HALF,
                    HALF_PAD,
                    BLOCK_H,
                    OUT_INTERLEAVED,
                    PACK,
                    "",
                    GAP,
                    _col(stride_g_col, STRIDED),
                )
            c, sn = load_angles(  # after the head loads (token_prologue)
                angles, b, s, HALF, HALF_PAD, HAS_POS, MROPE, PACKED, SEARCH_STRIDE, SEARCH_COARSE, FREQS
            )
            # the token's group as the backward's helpers take it
            tok = (x_base, g_base, gx_base, w_ptr, stride_x_head, stride_g_head, stride_gx_head, n_heads)
            tok += (tail, norm_eps, norm_offset, stride_x_col, stride_g_col, stride_gx_col)
            if WHOLE:
                da1, da2, dat, db1, db2, dbt, dc1, dc2, dct = _whole_backward_token(
                    tok,
                    (c, sn),
                    (xa1, xa2, xb1, xb2, xc1, xc2),
                    (ga1, ga2, gb1, gb2, gc1, gc2),
                    HALF,
                    HALF_PAD,
                    BLOCK_H,
                    BLOCK_H2,
                    BLOCK_H3,
                    TAIL_PAD,
                    INTERLEAVED,
                    INVERSE,
                    PACK,
                    NORM,
                    W_PAIRS,
                    GAP,
                    STRIDED,
                )
                acc1 += da1
                acc2 += da2
                if TAIL_PAD > 0:
                    acc_t += dat
                if BLOCK_H2 > 0:
                    accb1 += db1
                    accb2 += db2
                    if TAIL_PAD > 0:
                        accb_t += dbt
                if BLOCK_H3 > 0:
                    accc1 += dc1
                    accc2 += dc2
                    if TAIL_PAD > 0:
                        accc_t += dct
            elif NORM == 2:
                _across_backward_token(
                    tok,
                    (c, sn),
                    row,
                    HALF,
                    HALF_PAD,
                    BLOCK_H,
                    TAIL_PAD,
                    INTERLEAVED,
                    OUT_INTERLEAVED,
                    INVERSE,
                    PACK,
                    W_PAIRS,
                    GAP,
                    STRIDED,
                )
            else:
                gz1, gz2, gzt = _unrotate(
                    (g_base, stride_g_head, n_heads, head0, tail, stride_g_col),
                    (g1, g2),
                    (c, sn),
                    HALF,
                    BLOCK_H,
                    TAIL_PAD,
                    INVERSE,
                    GAP,
                    STRIDED,
                )
                if NORM == 1 or NORM == 3:  # per head, weighted or not (w1, w2, wt are then 1)
                    x1, x2 = load_heads(
                        x_base, stride_x_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, PACK, "", GAP,
                        _col(stride_x_col, STRIDED),
                    )  # fmt: skip
                    xt = gz1  # the tail's tile when TAIL_PAD is 0 (never read)
                    if TAIL_PAD > 0:
                        xt = load_tail(
                            x_base, stride_x_head, n_heads, head0, tail, HALF, BLOCK_H, TAIL_PAD, GAP,
                            _col(stride_x_col, STRIDED),
                        )  # fmt: skip
                    d1, d2, dt = _tile_grads(
                        tok,
                        head0,
                        (x1, x2, xt, gz1, gz2, gzt, w1, w2, wt),
                        1.0,
                        0.0,
                        HALF,
                        HALF_PAD,
                        BLOCK_H,
                        TAIL_PAD,
                        INTERLEAVED,
                        PACK,
                        NORM,
                        GAP,
                        STRIDED,
                    )
                    acc1 += d1
                    acc2 += d2
                    if TAIL_PAD > 0:
                        acc_t += dt
                else:
                    _store_grad(
                        (gx_base, stride_gx_head, n_heads, head0, tail, stride_gx_col),
                        (gz1, gz2, gzt),
                        HALF,
                        HALF_PAD,
                        BLOCK_H,
                        TAIL_PAD,
                        INTERLEAVED,
                        PACK,
                        GAP,
                        STRIDED,
                    )
    if NORM == 2 and WHOLE:
        # the program's sums of every head, kept in registers over its tokens: stored once
        row = dw_ptr + p * dw_row
        _put_dw_heads(
            row, (n_heads, 0, tail), (acc1, acc2, acc_t), HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, False, GAP
        )
        if BLOCK_H2 > 0:
            _put_dw_heads(
                row,
                (n_heads, BLOCK_H, tail),
                (accb1, accb2, accb_t),
                HALF,
                HALF_PAD,
                BLOCK_H2,
                TAIL_PAD,
                INTERLEAVED,
                False,
                GAP,
            )
        if BLOCK_H3 > 0:
            _put_dw_heads(
                row,
                (n_heads, BLOCK_H + BLOCK_H2, tail),
                (accc1, accc2, accc_t),
                HALF,
                HALF_PAD,
                BLOCK_H3,
                TAIL_PAD,
                INTERLEAVED,
                False,
                GAP,
            )
    if NORM == 1:
        # one partial row per program and head block: per-head weights sum their heads too (and, WHOLE,
        # every tile's)
        row = dw_ptr + (p * n_blocks + blk) * dw_row
        s1, s2, st = _row_sums(acc1, acc2, acc_t, TAIL_PAD)
        if BLOCK_H2 > 0:
            b1, b2, bt = _row_sums(accb1, accb2, accb_t, TAIL_PAD)
            s1, s2, st = s1 + b1, s2 + b2, st + bt
        if BLOCK_H3 > 0:
            e1, e2, et = _row_sums(accc1, accc2, accc_t, TAIL_PAD)
            s1, s2, st = s1 + e1, s2 + e2, st + et
        fm = tl.arange(0, HALF_PAD) < HALF
        c1, c2 = pair_columns(i, INTERLEAVED, GAP)
        tl.store(row + c1.reshape([HALF_PAD]), s1, mask=fm)
        tl.store(row + c2.reshape([HALF_PAD]), s2, mask=fm)
        if TAIL_PAD > 0:
            jt = tl.arange(0, TAIL_PAD)
            tl.store(tail_at(row, jt, HALF, GAP), st, mask=jt < tail)
