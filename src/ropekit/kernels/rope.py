"""The one RoPE kernel family.

Every variant is the same program with different compile-time flags:

    rotation layout   INTERLEAVED / OUT_INTERLEAVED   half-split (Llama/NeoX) or pairs (2i, 2i+1);
                      half-split pairs are (i, GAP + i): GAP is HALF, or D/2 for rotary_position=
                      'halves' (Gemma 4's p-RoPE: the pairs (i, i + D/2), i < HALF, of the whole head)
    partial rotary    HALF < head size / 2; the tail is written when TAIL_PAD > 0 (its tile width: the
                      launcher sets it out of place, where the tail is copied, and with a norm); tail
                      element j is at tail_at(row, j): column 2 * HALF + j, or around the pairs
                      when GAP is D/2
    angle source      HAS_POS: rows of a (max_position, .) table picked by a positions tensor;
                      FREQS: computed here, positions x inverse frequencies (axial N-D RoPE,
                      float positions, no table); otherwise per-token cos/sin rows addressed by
                      their own strides
    M-RoPE            MROPE: 0 none, 1 chunked sections (Qwen2-VL), 2 interleaved (Qwen3-VL), 3 any
                      rows by an int32 axis map (passed as SEC_T)
    inverse           INVERSE: rotate by -angle (the backward pass)
    q/k RMSNorm       NORM_Q / NORM_K: 0 none, 1 per head, 2 across the token's heads, applied
                      before the rotation (helpers in .norm); the backward is its own entry point,
                      .backward's rope_norm_backward_kernel, with the same angle sources

Grid: axis 0 walks tokens (one program each, up to 2^31 - 1), axis 1 walks head blocks of q then
of k, so q and k are rotated by one launch (with HEAD_LOOP one program walks all of a token's blocks).
Positions come from a positions tensor, or (PACKED) are derived from cu_seqlens in the kernel
(packed sequences and context parallelism: packed_position).

The family is built from ropekit.language's public device functions (a token's angles, pair tiles
in and out of registers, the rotation, the int64 offsets, the launch prologue) and .norm (RMSNorm
and its backward). rope_kernel and rope_norm_backward_kernel share their prologue, token_prologue:
the token (b, s) in int64 and its angle operands as one group ((positions), (table), (angle
strides), (sections, packed sequences)); each then issues its head loads and calls load_angles.

Addressing rule (every kernel file follows it): every offset that scales a program id, a head index
or a position by a stride is computed in int64. Tokens, heads and positions are widened with
`.to(tl.int64)` *before* any multiplication, so no product can wrap at 2^31 whatever the tensor
size. Only in-block column offsets (`tl.arange` up to the head size) stay int32, at a unit
column stride; a last-dim stride other than 1 (STRIDED_IN / STRIDED_OUT) scales them in int64
(ropekit.language.column_offset).
"""

import triton
import triton.language as tl

from ..language import (
    head_mask,
    head_rows,
    load_angles,
    load_tiles,
    pdl_prologue,
    rotate,
    saturate,
    store_heads,
    table_angles,
    tail_at,
    token_offset,
)
from .norm import group_inv_rms, norm_heads_given, tiles_inv_rms
from .prologue import token_prologue

# Triton's interpreter runs these kernels (it decides when a kernel is decorated, as read here):
# _round_as rounds bfloat16 by the bits there, since the interpreter's cast truncates
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def _select(blk, n_q_blocks, b, s, q_io, k_io, BLOCK_H: tl.constexpr):
    """Head block blk (q's blocks, then k's) of token (b, s): its input and output token pointers,
    head strides, head count, first head and tail length. Scalar selects, no branch: q and k
    (one dtype) take one code path. q_io, k_io: a tensor and its output as the kernel groups them,
    (x_ptr, o_ptr, heads, tail, (x's b, s, head strides), (the output's b, s, head strides))."""
    q_ptr, qo_ptr, n_q_heads, q_tail, q_strides, qo_strides = q_io
    k_ptr, ko_ptr, n_k_heads, k_tail, k_strides, ko_strides = k_io
    stride_q_batch, stride_q_token, stride_q_head = q_strides
    stride_qo_batch, stride_qo_token, stride_qo_head = qo_strides
    stride_k_batch, stride_k_token, stride_k_head = k_strides
    stride_ko_batch, stride_ko_token, stride_ko_head = ko_strides
    is_q = blk < n_q_blocks
    head0 = tl.where(is_q, blk, blk - n_q_blocks) * BLOCK_H
    x_base = tl.where(
        is_q,
        q_ptr + token_offset(b, s, stride_q_batch, stride_q_token),
        k_ptr + token_offset(b, s, stride_k_batch, stride_k_token),
    )
    o_base = tl.where(
        is_q,
        qo_ptr + token_offset(b, s, stride_qo_batch, stride_qo_token),
        ko_ptr + token_offset(b, s, stride_ko_batch, stride_ko_token),
    )
    return (
        x_base,
        o_base,
        tl.where(is_q, stride_q_head, stride_k_head),
        tl.where(is_q, stride_qo_head, stride_ko_head),
        tl.where(is_q, n_q_heads, n_k_heads),
        head0,
        tl.where(is_q, q_tail, k_tail),
    )


@triton.jit
def _col_stride(blk, n_q_blocks, q_col, k_col, STRIDED: tl.constexpr):
    """The column stride of head block blk's tensor (q's blocks, then k's), for the pair and tail
    helpers' stride_col: with STRIDED (a tensor of the launch has a last stride other than 1) the
    runtime value, selected like _select's strides; else the constexpr 1, whose code is the
    unit-stride code (ropekit.language.column_offset). Passed straight into a call: a name assigned
    a constexpr becomes a tensor."""
    if STRIDED:
        return tl.where(blk < n_q_blocks, q_col, k_col)
    else:
        return 1


@triton.jit
def _norm_select(
    block,
    head0,
    xs,
    params,
    r_group,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    NORM_Q: tl.constexpr,
    NORM_K: tl.constexpr,
    GROUP_GIVEN: tl.constexpr,
    W_PAIRS: tl.constexpr,
    GAP: tl.constexpr,
    cols,
    STRIDED_IN: tl.constexpr,
):
    """norm_heads for head block blk of q (blocks < n_q_blocks) or of k: the mode and weight are
    selected like _select's pointers (scalar selects, one code path for q and k). GROUP_GIVEN:
    mode 2 scales by r_group, the token's inverse rms over all of this tensor's heads. Without a
    norm across heads in the launch, a weight is one row shared by the heads (read once a tile).
    block, xs, params, cols, STRIDED_IN: _tile_out's."""
    blk, n_q_blocks, x_base, _, stride_x_head, _, n_heads, tail = block
    _, _, wq_ptr, wk_ptr, norm_eps, norm_offset = params
    is_q = blk < n_q_blocks
    mode = tl.where(is_q, NORM_Q, NORM_K)
    w_ptr = tl.where(is_q, wq_ptr, wk_ptr)
    return norm_heads_given(
        (x_base, stride_x_head, n_heads, head0, tail),
        xs,
        (w_ptr, mode, norm_eps, norm_offset),
        r_group,
        HALF,
        HALF_PAD,
        BLOCK_H,
        TAIL_PAD,
        INTERLEAVED,
        GROUP_GIVEN,
        not (NORM_Q == 2 or NORM_K == 2),
        W_PAIRS,
        GAP,
        _col_stride(blk, n_q_blocks, cols[0], cols[1], STRIDED_IN),
    )


@triton.jit
def _head_angles(
    rows, blk, n_q_blocks, head0, n_heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr
):
    """HEAD_TABLE: cos and sin, float32 (BLOCK_H, HALF_PAD), of heads [head0, head0 + BLOCK_H) of a
    head block, each from its own table head's row at the token's position (NaN where the position
    is out of the table). rows: (cos_ptr, sin_ptr, pos, max_pos, stride_row, stride_head, stride_col,
    q_group, k_group): head h of q (of k) reads table head h // q_group (h // k_group)."""
    cos_ptr, sin_ptr, pos, max_pos, stride_row, stride_head, stride_col, q_group, k_group = rows
    group = tl.where(blk < n_q_blocks, q_group, k_group)
    h = head0 + tl.arange(0, BLOCK_H)
    table_head = (h // group).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    # the position as a tile (all lanes one value): scalar-and-tile masks trip the interpreter
    p = pos + tl.zeros([BLOCK_H, HALF_PAD], tl.int64)
    m = (h < n_heads)[:, None] & (i < HALF)[None, :] & (p >= 0) & (p < max_pos)
    row = p * stride_row + table_head[:, None] * stride_head
    return table_angles(cos_ptr, sin_ptr, row, (i.to(tl.int64) * stride_col)[None, :], m, float("nan"))


@triton.jit
def _round_as(x, ty: tl.constexpr):
    """x (float32) rounded to the nearest value of the float type ty (ties to even), kept in
    float32: what an eager PyTorch op in ty stores. A cast there and back, but for bfloat16 in
    Triton's interpreter, whose float32 -> bfloat16 cast truncates: there by the bits. float32 as
    it is. NaN stays NaN; a value past ty's range becomes inf, as the cast does."""
    if ty == tl.bfloat16 and _INTERPRETED:
        bits = x.to(tl.int32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif ty == tl.float16 or ty == tl.bfloat16:
        return x.to(ty).to(tl.float32)
    else:
        return x


@triton.jit
def _product(a, b, ty: tl.constexpr):
    """a * b rounded to ty on its own, never fused with the sum after it. A float32 multiply that
    feeds an add may be contracted into one FMA (one rounding, not eager's two); with float16 a
    plain multiply, rounded and widened back, still gave 1-ulp differences from eager on an H100
    (a float16 multiply and add fused likewise, most likely). An FMA with a zero addend is the
    float32 product rounded once (exact for two 16-bit values) and is not fused again. (A zero
    product is then +0 where eager may give -0: equal values.)"""
    return _round_as(tl.fma(a, b, 0.0), ty)


@triton.jit
def _eager_rotate(x1, x2, c, sn, ty: tl.constexpr):
    """The pair tile (x1, x2) rotated by (c, sn) as eager PyTorch computes x * cos + rotate_half(x)
    * sin in ty: the angles rounded to ty, each product rounded, their sum rounded (the kernel's
    store of the result is then exact, so the interpreter's truncating cast cannot change it)."""
    c = _round_as(c, ty)
    sn = _round_as(sn, ty)
    o1 = _round_as(_product(x1, c, ty) - _product(x2, sn, ty), ty)
    o2 = _round_as(_product(x2, c, ty) + _product(x1, sn, ty), ty)
    return o1, o2


@triton.jit
def _tile_out(
    block,
    head0,
    xs,
    cs,
    params,
    r_group,
    q_temp,
    head_rows_of,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    OUT_INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
    SCALED: tl.constexpr,
    PACK: tl.constexpr,
    NORM_Q: tl.constexpr,
    NORM_K: tl.constexpr,
    GROUP_GIVEN: tl.constexpr,
    W_PAIRS: tl.constexpr,
    GAP: tl.constexpr,
    Q_TEMPERATURE: tl.constexpr,
    HEAD_TABLE: tl.constexpr,
    EAGER_ROUNDING: tl.constexpr,
    cols,
    STRIDED_IN: tl.constexpr,
    STRIDED_OUT: tl.constexpr,
):
    """Heads [head0, head0 + BLOCK_H) of a head block, loaded as xs = (x1, x2): normalized (with a
    norm), rotated by cs = (c, sn) and stored, plus the unrotated tail when TAIL_PAD > 0: read from
    x, or with a norm the normalized tail (written in place too). block: the block as the kernel
    selected it (blk, n_q_blocks, x_base, o_base, stride_x_head, stride_o_head, n_heads, tail);
    params: the kernel's (q_scale_ptr, k_scale_ptr, wq_ptr, wk_ptr, norm_eps, norm_offset).
    Q_TEMPERATURE: q's blocks (rotated dims and tail) times q_temp, the token's float32 factor.
    HEAD_TABLE: cs is unused; each head's cos / sin come from its table head's row (_head_angles,
    head_rows_of its operands), a (BLOCK_H, HALF_PAD) tile instead of one row for every head.
    EAGER_ROUNDING: the rotation rounds as eager PyTorch does in the input's dtype (_eager_rotate).
    cols: the column strides (q's, k's, q output's, k output's), read with STRIDED_IN (inputs) /
    STRIDED_OUT (outputs) only (_col_stride)."""
    blk, n_q_blocks, x_base, o_base, stride_x_head, stride_o_head, n_heads, tail = block
    x1, x2 = xs
    c, sn = cs
    q_scale_ptr, k_scale_ptr, _, _, _, _ = params
    t = x1
    if NORM_Q != 0 or NORM_K != 0:
        x1, x2, t = _norm_select(
            block,
            head0,
            (x1, x2),
            params,
            r_group,
            HALF,
            HALF_PAD,
            BLOCK_H,
            TAIL_PAD,
            INTERLEAVED,
            NORM_Q,
            NORM_K,
            GROUP_GIVEN,
            W_PAIRS,
            GAP,
            cols,
            STRIDED_IN,
        )
    o_scale_ptr = tl.where(blk < n_q_blocks, q_scale_ptr, k_scale_ptr)
    o_rows = head_rows(o_base, stride_o_head, head0, BLOCK_H)
    if HEAD_TABLE:
        cb, sb = _head_angles(head_rows_of, blk, n_q_blocks, head0, n_heads, HALF, HALF_PAD, BLOCK_H)
    else:
        cb, sb = c[None, :], sn[None, :]
    # INVERSE: by -angle, sin negated once for the token's vector (the block's tile per head)
    if INVERSE:
        sb = -sb
    if EAGER_ROUNDING:
        o1, o2 = _eager_rotate(x1, x2, cb, sb, x_base.dtype.element_ty)
    else:
        o1, o2 = rotate(x1, x2, cb, sb, False)
    temp = tl.where(blk < n_q_blocks, q_temp, 1.0)  # k's blocks: 1
    if Q_TEMPERATURE:
        o1 = o1 * temp
        o2 = o2 * temp
    if SCALED:
        inv = 1.0 / tl.load(o_scale_ptr).to(tl.float32)
        o1 = saturate(o1 * inv, o_base.dtype.element_ty)
        o2 = saturate(o2 * inv, o_base.dtype.element_ty)
    store_heads(
        o_base,
        stride_o_head,
        n_heads,
        head0,
        o1,
        o2,
        HALF,
        HALF_PAD,
        BLOCK_H,
        OUT_INTERLEAVED,
        PACK,
        GAP,
        _col_stride(blk, n_q_blocks, cols[2], cols[3], STRIDED_OUT),
    )
    if TAIL_PAD > 0:
        # partial rotary, out of place (or normalized): the dims no pair holds, unrotated
        out_ty = o_base.dtype.element_ty
        x_rows = head_rows(x_base, stride_x_head, head0, BLOCK_H)
        j = tl.arange(0, TAIL_PAD)[None, :]
        mt = head_mask(n_heads, head0, BLOCK_H) & (j < tail)
        if NORM_Q == 0 and NORM_K == 0:
            t = tl.load(
                tail_at(x_rows, j, HALF, GAP, _col_stride(blk, n_q_blocks, cols[0], cols[1], STRIDED_IN)), mask=mt
            )
        if Q_TEMPERATURE:
            t = t.to(tl.float32) * temp
        if SCALED:
            t = saturate(t.to(tl.float32) / tl.load(o_scale_ptr).to(tl.float32), out_ty)
        o_tail = tail_at(o_rows, j, HALF, GAP, _col_stride(blk, n_q_blocks, cols[2], cols[3], STRIDED_OUT))
        tl.store(o_tail, t.to(out_ty), mask=mt)


# Sizes that change with the batch or the sequence length are not specialized on (Triton would
# otherwise compile again when one becomes 1 or a multiple of 16): a variant compiles at most twice
# whatever the token count, once decode-sized and once large (docs/core.md, "Compilations").
# Strides stay specialized: their divisibility by 16 is what lets rows move in 16-byte accesses.
@triton.jit(do_not_specialize=["n_tokens", "S", "max_pos", "n_seqs"])
def rope_kernel(
    q_ptr,  # q, (*T, Hq, Dq): read
    k_ptr,  # k, (*T, Hk, Dk): read (q_ptr again when there is no k: never read then)
    qo_ptr,  # q's output (q_ptr in place)
    ko_ptr,  # k's output (k_ptr in place)
    pos_ptr,  # positions (*T) or (3, *T); (axes, *T) int or float when FREQS; cu_seqlens when PACKED
    cos_ptr,  # cos rows: a [cos | sin] table, or per-token cos; the inverse frequencies when FREQS
    sin_ptr,  # sin rows: the table again (sin at sin_off), or per-token sin
    q_scale_ptr,  # SCALED: float32 scalar q's outputs are divided by (fp8 outputs); else unused
    k_scale_ptr,  # SCALED: k's likewise
    n_tokens,  # tokens in *T (the grid's first axis)
    S,  # size of the last token dim: token t is (b, s) = (t // S, t % S)
    n_q_heads,  # Hq
    n_k_heads,  # Hk (0 without k)
    q_tail,  # Dq - rotary_dim: dims copied unrotated (out of place) or normalized
    k_tail,  # Dk - rotary_dim
    max_pos,  # table rows: positions outside [0, max_pos) read nothing and give NaN
    n_q_blocks,  # head blocks of q; blocks n_q_blocks.. are k's
    n_blocks,  # head blocks of q and k
    sin_off,  # elements from sin_ptr to sin's first column
    stride_q_batch,  # q's stride of b (0 with one token dim), in elements
    stride_q_token,  # q's stride of s
    stride_q_head,  # q's stride between heads
    stride_k_batch,  # k's strides likewise
    stride_k_token,
    stride_k_head,
    stride_qo_batch,  # q output's strides
    stride_qo_token,
    stride_qo_head,
    stride_ko_batch,  # k output's strides
    stride_ko_token,
    stride_ko_head,
    stride_q_col,  # q's last-dim stride (1: Triton makes it a constexpr, and STRIDED_IN is off)
    stride_k_col,  # k's
    stride_qo_col,  # q output's
    stride_ko_col,  # k output's
    stride_pos_row,  # positions' stride between M-RoPE rows (t, h, w, ...) or FREQS axes
    stride_pos_batch,  # positions' stride of b
    stride_pos_token,  # positions' stride of s
    stride_angle_row,  # per-token angles' stride between M-RoPE rows
    stride_angle_batch,  # per-token angles' stride of b
    stride_angle_token,  # table row stride, or per-token angles' stride of s
    stride_angle_col,  # stride between frequencies (2 for Llama 4's complex view)
    SEC_T,  # M-RoPE sections: frequencies driven by the temporal row (FREQS: by axis 0; MROPE 3: the axis map)
    SEC_H,  # ... by the height row (FREQS: axis 1)
    SEC_W,  # ... by the width row (FREQS: axis 2; axis 3 takes the rest)
    n_seqs,  # PACKED: sequences in cu_seqlens (at pos_ptr)
    cp_size,  # PACKED: context-parallel size (1: none)
    cp_rank,  # PACKED: this rank
    stride_table_head,  # HEAD_TABLE: the table's stride between heads
    q_group,  # HEAD_TABLE: q's heads per table head (q head h reads table head h // q_group)
    k_group,  # HEAD_TABLE: k's heads per table head
    temp_floor,  # Q_TEMPERATURE: floor_scale
    temp_attn,  # Q_TEMPERATURE: attn_scale
    wq_ptr,  # NORM_Q: q's RMSNorm weight, (D,) or (H*D,), unit stride
    wk_ptr,  # NORM_K: k's RMSNorm weight
    norm_eps,  # RMSNorm epsilon
    norm_offset,  # added to the weights (1.0: Gemma's (1 + w))
    HALF: tl.constexpr,  # rotary_dim // 2: rotated pairs per head
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two (tile width)
    GAP: tl.constexpr,  # columns from a half-split pair's first member to its second: HALF, or D/2 (halves)
    BLOCK_H: tl.constexpr,  # heads per head block
    TAIL_PAD: tl.constexpr,  # tail tile width (0: no tail to write)
    HAS_POS: tl.constexpr,  # angles from table rows picked by positions (else per-token or arange)
    MROPE: tl.constexpr,  # 0 none, 1 chunked sections (Qwen2-VL), 2 interleaved (Qwen3-VL), 3 axis map
    INTERLEAVED: tl.constexpr,  # inputs hold pairs (2i, 2i+1); else halves (i, i + HALF)
    OUT_INTERLEAVED: tl.constexpr,  # outputs written as pairs
    INVERSE: tl.constexpr,  # rotate by -angle (the backward, or a de-rotation)
    SCALED: tl.constexpr,  # outputs divided by their scale and saturated to an fp8 output's range
    PACK: tl.constexpr,  # 0, or bits of a (2i, 2i+1) pair moved as one word (aligned rows)
    HEAD_LOOP: tl.constexpr,  # one program per token walks all head blocks (angles read once)
    PREFETCH: tl.constexpr,  # with HEAD_LOOP: next block's loads before this block's stores
    NORM_Q: tl.constexpr,  # q's RMSNorm: 0 none, 1 per head, 2 across heads
    NORM_K: tl.constexpr,  # k's RMSNorm likewise
    PACKED: tl.constexpr,  # positions derived from cu_seqlens (packed sequences, context parallelism)
    SEARCH_STRIDE: tl.constexpr,  # PACKED: cu_seqlens entries per block of the two-level search
    SEARCH_COARSE: tl.constexpr,  # PACKED: blocks (a power of two covering n_seqs + 1 entries)
    FREQS: tl.constexpr,  # angles computed from positions (any axis rows) x inverse frequencies at cos_ptr
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the previous kernel first
    WHOLE: tl.constexpr,  # a head block is all of a tensor's heads (q's block, then k's), in up to three tiles
    BLOCK_H2: tl.constexpr,  # WHOLE: heads of the block's second tile, after BLOCK_H (0: none)
    BLOCK_H3: tl.constexpr,  # WHOLE: heads of its third tile, after BLOCK_H + BLOCK_H2 (0: none)
    W_PAIRS: tl.constexpr,  # interleaved norm weights read as one word per pair (both 16-byte aligned)
    Q_TEMPERATURE: tl.constexpr,  # q's outputs times log(floor((pos + 1) / temp_floor) + 1) * temp_attn + 1
    HEAD_TABLE: tl.constexpr,  # a (max_pos, Ht, rotary_dim) table: each head reads its table head's row
    EAGER_ROUNDING: tl.constexpr,  # round as eager PyTorch's q * cos + rotate_half(q) * sin in q's dtype
    STRIDED_IN: tl.constexpr,  # q or k has a last stride other than 1: columns at int64 col * stride
    STRIDED_OUT: tl.constexpr,  # an output has one (in place: the inputs' own strides)
):
    """Program (i, j): token i, head block j (q blocks, then k's);
    with HEAD_LOOP, program i walks all n_blocks head blocks itself and reads each token's angles
    once instead of once per block; PREFETCH then issues each block's loads before the previous
    block's stores.

    Without HEAD_LOOP the head loads are issued before the dependent position -> cos/sin loads,
    so their latencies overlap.
    NORM_Q / NORM_K: RMSNorm of q's / k's heads before the rotation (0 none, 1 per head, 2 across
    heads); with either on, TAIL_PAD covers the tail in place too (it is normalized). WHOLE: a block
    is all of a tensor's heads of the token, in tiles of BLOCK_H, BLOCK_H2 and BLOCK_H3 heads (the
    binary decomposition of the head count: no padded rows), every tile loaded before any is
    reduced; across heads, .norm.tiles_inv_rms sums the tiles in registers. Across heads with
    HEAD_LOOP and without WHOLE, blocks are as small as per head: before a tensor's first block the
    program sums the squares over all that tensor's heads of its token (a pre-pass,
    .norm.group_inv_rms, the blocks then read again from cache). Without HEAD_LOOP, a norm across
    heads needs WHOLE (the launcher sets it).
    sin_off: sin's element offset from sin_ptr (a [cos | sin] table is passed once, as both).
    PACKED: pos_ptr is cu_seqlens and each token's position is derived from it (packed_position).
    HEAD_TABLE: the table has a row per (position, head); the token's position is read once and
    each head tile reads its heads' rows (_head_angles) instead of one row for every head; program
    i then takes token (i mod B) * S + i div B (position-major order).
    STRIDED_IN / STRIDED_OUT: a last-dim stride other than 1 among the inputs / the outputs; every
    column is then addressed through its tensor's stride (ropekit.language.column_offset, int64),
    so a strided q or k is read, and in place written back, where it lies (no copy). Off, the
    column strides are 1 and the code is the unit-stride code.
    """
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)  # one program per token: up to 2^31 - 1 tokens
    if HEAD_TABLE:
        # position-major order: the B tokens of one position (batch rows that share positions read
        # the same table rows, Ht * rotary_dim floats a position) run side by side, so a row read
        # from DRAM serves them all from L2 (in (b, s) order a whole batch row runs in between)
        n_b = tl.num_programs(0).to(tl.int64) // S
        t = (t % n_b) * S + t // n_b
    b, s, angles = token_prologue(
        t,
        S,
        (pos_ptr, stride_pos_row, stride_pos_batch, stride_pos_token),
        (cos_ptr, sin_ptr, sin_off, max_pos),
        (stride_angle_row, stride_angle_batch, stride_angle_token, stride_angle_col),
        (SEC_T, SEC_H, SEC_W, n_seqs, cp_size, cp_rank),
    )
    # the first head block of this program (with HEAD_LOOP every program starts at block 0 and walks
    # them all): its loads go out before the dependent position -> table-row loads
    if HEAD_LOOP:
        blk0 = 0
    else:
        blk0 = tl.program_id(1)  # int32-ok: a head-block index (< 65536), scaled by a constexpr block size
    # q and k with their outputs, as _select takes them: (x, o, heads, tail, x's (b, s, head)
    # strides, o's (b, s, head) strides)
    q_strides = (stride_q_batch, stride_q_token, stride_q_head)
    qo_strides = (stride_qo_batch, stride_qo_token, stride_qo_head)
    k_strides = (stride_k_batch, stride_k_token, stride_k_head)
    ko_strides = (stride_ko_batch, stride_ko_token, stride_ko_head)
    q_io = (q_ptr, qo_ptr, n_q_heads, q_tail, q_strides, qo_strides)
    k_io = (k_ptr, ko_ptr, n_k_heads, k_tail, k_strides, ko_strides)
    x_base, o_base, stride_x_head, stride_o_head, n_heads, head0, tail = _select(
        blk0, n_q_blocks, b, s, q_io, k_io, BLOCK_H
    )
    cols = (stride_q_col, stride_k_col, stride_qo_col, stride_ko_col)  # as _tile_out takes them
    x1, x2, y1, y2, z1, z2 = load_tiles(
        (x_base, stride_x_head, n_heads, head0),
        HALF,
        HALF_PAD,
        BLOCK_H,
        BLOCK_H2,
        BLOCK_H3,
        INTERLEAVED,
        PACK,
        GAP,
        _col_stride(blk0, n_q_blocks, stride_q_col, stride_k_col, STRIDED_IN),
    )
    # the token's angles, after its head loads (token_prologue); per head tile with HEAD_TABLE
    if HEAD_TABLE:
        c = tl.zeros([HALF_PAD], tl.float32)
        sn = c
        pos = tl.load(pos_ptr + b * stride_pos_batch + s * stride_pos_token).to(tl.int64)
    else:
        c, sn = load_angles(angles, b, s, HALF, HALF_PAD, HAS_POS, MROPE, PACKED, SEARCH_STRIDE, SEARCH_COARSE, FREQS)
        pos = tl.zeros([], tl.int64)
    head_rows_of = (
        cos_ptr,
        sin_ptr + sin_off,
        pos,
        max_pos,
        stride_angle_token,
        stride_table_head,
        stride_angle_col,
        q_group,
        k_group,
    )
    # one loop body for both layouts: with HEAD_LOOP it walks every head block, next block's loads
    # in flight; otherwise it runs once for this program's block (a one-trip loop the compiler drops)
    if HEAD_LOOP:
        n_iter = n_blocks
    else:
        n_iter = 1
    params = (q_scale_ptr, k_scale_ptr, wq_ptr, wk_ptr, norm_eps, norm_offset)  # as _tile_out takes them
    q_temp = tl.zeros([], tl.float32) + 1.0  # Q_TEMPERATURE: the token's factor (table angles: a position)
    if Q_TEMPERATURE:
        pos = tl.load(pos_ptr + b * stride_pos_batch + s * stride_pos_token).to(tl.int64)
        q_temp = tl.log(tl.floor((pos + 1).to(tl.float32) / temp_floor) + 1.0) * temp_attn + 1.0
    r_group = tl.zeros([], tl.float32) + 1.0  # across heads with HEAD_LOOP: the current tensor's inverse rms
    for i in tl.range(0, n_iter):
        if HEAD_LOOP:
            blk = i
            # the next block (past the last one: every lane masked, nothing read)
            nx_base, no_base, next_stride_x_head, next_stride_o_head, n_n_heads, n_head0, n_tail = _select(
                blk + 1, n_q_blocks, b, s, q_io, k_io, BLOCK_H
            )
            if PREFETCH:
                # its loads go out before this block's stores: two blocks in flight. Safe in
                # place too: blocks are disjoint and validation refuses partial overlaps.
                n1, n2, ny1, ny2, nz1, nz2 = load_tiles(
                    (nx_base, next_stride_x_head, n_n_heads, n_head0),
                    HALF,
                    HALF_PAD,
                    BLOCK_H,
                    BLOCK_H2,
                    BLOCK_H3,
                    INTERLEAVED,
                    PACK,
                    GAP,
                    _col_stride(blk + 1, n_q_blocks, stride_q_col, stride_k_col, STRIDED_IN),
                )
        else:
            blk = blk0
        if WHOLE and (NORM_Q == 2 or NORM_K == 2):
            # the block is the tensor's every head, in registers: the group's sum needs no second read
            r_group = tiles_inv_rms(
                (x_base, stride_x_head, n_heads, head0, tail),
                norm_eps,
                (x1, x2, y1, y2, z1, z2),
                HALF,
                HALF_PAD,
                BLOCK_H,
                BLOCK_H2,
                BLOCK_H3,
                TAIL_PAD,
                GAP,
                _col_stride(blk, n_q_blocks, stride_q_col, stride_k_col, STRIDED_IN),
            )
        elif HEAD_LOOP and (NORM_Q == 2 or NORM_K == 2):
            # across heads with small blocks: before a tensor's first block, its inverse rms over
            # all the token's heads (a pre-pass; the blocks then read those heads again, cached)
            if NORM_Q == 2 and NORM_K == 2:
                first = (blk == 0) | (blk == n_q_blocks)
            elif NORM_Q == 2:
                first = blk == 0
            else:
                first = blk == n_q_blocks
            if first:
                r_group = group_inv_rms(
                    x_base,
                    stride_x_head,
                    n_heads,
                    tail,
                    norm_eps,
                    HALF,
                    HALF_PAD,
                    BLOCK_H,
                    TAIL_PAD,
                    GAP,
                    _col_stride(blk, n_q_blocks, stride_q_col, stride_k_col, STRIDED_IN),
                )
        group_given = (HEAD_LOOP or WHOLE) and (NORM_Q == 2 or NORM_K == 2)
        block = (blk, n_q_blocks, x_base, o_base, stride_x_head, stride_o_head, n_heads, tail)
        # the block's up to three tiles (BLOCK_H, BLOCK_H2, BLOCK_H3 heads; 0: no tile), one call
        # each, unrolled: tile k's size and first head are sums of constexprs times (k == j) terms,
        # written in place because a name assigned in a jit function is no longer a constexpr
        for k in tl.static_range(3):
            if BLOCK_H * (k == 0) + BLOCK_H2 * (k == 1) + BLOCK_H3 * (k == 2) > 0:
                _tile_out(
                    block,
                    head0 + BLOCK_H * (k >= 1) + BLOCK_H2 * (k >= 2),
                    (x1, x2) if k == 0 else ((y1, y2) if k == 1 else (z1, z2)),
                    (c, sn),
                    params,
                    r_group,
                    q_temp,
                    head_rows_of,
                    HALF,
                    HALF_PAD,
                    BLOCK_H * (k == 0) + BLOCK_H2 * (k == 1) + BLOCK_H3 * (k == 2),
                    TAIL_PAD,
                    INTERLEAVED,
                    OUT_INTERLEAVED,
                    INVERSE,
                    SCALED,
                    PACK,
                    NORM_Q,
                    NORM_K,
                    group_given,
                    W_PAIRS,
                    GAP,
                    Q_TEMPERATURE,
                    HEAD_TABLE,
                    EAGER_ROUNDING,
                    cols,
                    STRIDED_IN,
                    STRIDED_OUT,
                )
        if HEAD_LOOP:
            if not PREFETCH:
                n1, n2, ny1, ny2, nz1, nz2 = load_tiles(
                    (nx_base, next_stride_x_head, n_n_heads, n_head0),
                    HALF,
                    HALF_PAD,
                    BLOCK_H,
                    BLOCK_H2,
                    BLOCK_H3,
                    INTERLEAVED,
                    PACK,
                    GAP,
                    _col_stride(blk + 1, n_q_blocks, stride_q_col, stride_k_col, STRIDED_IN),
                )
            x_base, o_base, stride_x_head, stride_o_head, n_heads, head0, tail = (
                nx_base,
                no_base,
                next_stride_x_head,
                next_stride_o_head,
                n_n_heads,
                n_head0,
                n_tail,
            )
            x1, x2, y1, y2, z1, z2 = n1, n2, ny1, ny2, nz1, nz2
