"""The one RoPE kernel family.

Every variant is the same program with different compile-time flags:

    rotation layout   INTERLEAVED / OUT_INTERLEAVED   half-split (Llama/NeoX) or pairs (2i, 2i+1);
                      half-split pairs are (i, GAP + i): GAP is HALF, or D/2 for rotary_position=
                      'halves' (Gemma 4's p-RoPE: the pairs (i, i + D/2), i < HALF, of the whole head)
    partial rotary    HALF < head size / 2; the tail is written when TAIL_PAD > 0 (its tile width: the
                      launcher sets it out of place, where the tail is copied, and with a norm); tail
                      element j is at norm.tail_at(row, j): column 2 * HALF + j, or around the pairs
                      when GAP is D/2
    angle source      HAS_POS: rows of a (max_position, .) table picked by a positions tensor;
                      FREQS: computed here, positions x inverse frequencies (axial N-D RoPE,
                      float positions, no table); otherwise per-token cos/sin rows addressed by
                      their own strides
    M-RoPE            MROPE: 0 none, 1 chunked sections (Qwen2-VL), 2 interleaved (Qwen3-VL)
    inverse           INVERSE: rotate by -angle (the backward pass)
    q/k RMSNorm       NORM_Q / NORM_K: 0 none, 1 per head, 2 across the token's heads, applied
                      before the rotation (helpers in .norm); the backward is its own entry point,
                      rope_norm_backward_kernel, with the same angle sources

Grid: axis 0 walks tokens (one program each, up to 2^31 - 1), axis 1 walks head blocks of q then
of k, so q and k are rotated by one launch (with HEAD_LOOP one program walks all of a token's blocks).
Positions come from a positions tensor, or (PACKED) are derived from cu_seqlens in the kernel
(packed sequences and context parallelism: .positions).

Addressing rule (the reason this file exists): every offset that scales a program id, a head index
or a position by a stride is computed in int64. Tokens, heads and positions are widened with
`.to(tl.int64)` *before* any multiplication, so no product can wrap at 2^31 whatever the tensor
size. Only in-block column offsets (`tl.arange` up to the head size) stay int32.
"""

import triton
import triton.language as tl

from .norm import (
    group_inv_rms,
    group_sums,
    inv_rms,
    load_norm_weights,
    load_tail,
    norm_backward,
    norm_heads_given,
    tail_at,
    tiles_inv_rms,
    weight_cols,
)
from .positions import packed_position

try:  # programmatic dependent launch (Hopper and later); older Tritons lack the intrinsics
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - the launcher never sets PDL there

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL), this kernel's programs may start while the
    previous kernel on the stream still runs: wait for it (and its writes) before touching memory,
    then let the next kernel start launching. Without PDL: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


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


@triton.jit
def _load_pairs(row_ptr, i, m, ELEM: tl.constexpr, PACK: tl.constexpr, EVICT: tl.constexpr):
    """Pairs (2i, 2i+1) read as one PACK-bit word each: a contiguous, vectorized load, then split
    with bit operations (low half = the even element on little-endian GPUs and CPUs)."""
    if PACK == 32:
        w = tl.load(row_ptr.to(tl.pointer_type(tl.uint32)) + i, mask=m, eviction_policy=EVICT)
        lo = w.to(tl.uint16)
        hi = (w >> 16).to(tl.uint16)
    else:
        w = tl.load(row_ptr.to(tl.pointer_type(tl.uint64)) + i, mask=m, eviction_policy=EVICT)
        lo = w.to(tl.uint32)
        hi = (w >> 32).to(tl.uint32)
    return lo.to(ELEM, bitcast=True).to(tl.float32), hi.to(ELEM, bitcast=True).to(tl.float32)


@triton.jit
def _store_pairs(row_ptr, i, m, o1, o2, ELEM: tl.constexpr, PACK: tl.constexpr):
    """The inverse of _load_pairs: (o1[i], o2[i]) packed into one word and stored."""
    if PACK == 32:
        lo = o1.to(ELEM).to(tl.uint16, bitcast=True).to(tl.uint32)
        hi = o2.to(ELEM).to(tl.uint16, bitcast=True).to(tl.uint32)
        tl.store(row_ptr.to(tl.pointer_type(tl.uint32)) + i, lo | (hi << 16), mask=m)
    else:
        lo = o1.to(ELEM).to(tl.uint32, bitcast=True).to(tl.uint64)
        hi = o2.to(ELEM).to(tl.uint32, bitcast=True).to(tl.uint64)
        tl.store(row_ptr.to(tl.pointer_type(tl.uint64)) + i, lo | (hi << 32), mask=m)


@triton.jit
def load_heads(
    x_base,
    stride_x_head,
    n_heads,
    head0,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACK: tl.constexpr,
    EVICT: tl.constexpr,
    GAP: tl.constexpr,
):
    """x1, x2 (float32, (BLOCK_H, HALF_PAD)): the two members of each rotated pair of heads
    [head0, head0 + BLOCK_H) of one token; x_base points at the token's first element. Half-split
    pairs are (i, GAP + i): GAP is HALF, or D/2 with rotary_position='halves'."""
    h = head0 + tl.arange(0, BLOCK_H)
    x_row = x_base + h.to(tl.int64)[:, None] * stride_x_head  # (BLOCK_H, 1) pointers
    i = tl.arange(0, HALF_PAD)[None, :]
    m = (h[:, None] < n_heads) & (i < HALF)
    if INTERLEAVED and PACK != 0:
        x1, x2 = _load_pairs(x_row, i, m, x_base.dtype.element_ty, PACK, EVICT)
    elif INTERLEAVED:
        # pairs (2i, 2i+1): one contiguous (BLOCK_H, HALF, 2) load, split into even and odd lanes
        pair = tl.arange(0, 2)[None, None, :]
        x = tl.load(x_row[:, :, None] + 2 * i[:, :, None] + pair, mask=m[:, :, None]).to(tl.float32)
        x1, x2 = tl.split(x)
    else:
        x1 = tl.load(x_row + i, mask=m, eviction_policy=EVICT).to(tl.float32)
        x2 = tl.load(x_row + GAP + i, mask=m, eviction_policy=EVICT).to(tl.float32)
    return x1, x2


@triton.jit
def load_tiles(
    at,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_H2: tl.constexpr,
    BLOCK_H3: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACK: tl.constexpr,
    GAP: tl.constexpr,
):
    """load_heads of a head block held in up to three tiles, every load issued before any is used:
    (x1, x2) of BLOCK_H heads from head0, (y1, y2) of BLOCK_H2 heads after them, (z1, z2) of BLOCK_H3
    after those. A tile of 0 heads is absent: its pair is (x1, x2) again, never used.
    at: (x_base, stride_x_head, n_heads, head0), the token's first element, the head stride, the
    heads and the block's first head."""
    x_base, stride_x_head, n_heads, head0 = at
    x1, x2 = load_heads(x_base, stride_x_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, PACK, "", GAP)
    y1, y2 = x1, x2
    z1, z2 = x1, x2
    if BLOCK_H2 > 0:
        y1, y2 = load_heads(
            x_base, stride_x_head, n_heads, head0 + BLOCK_H, HALF, HALF_PAD, BLOCK_H2, INTERLEAVED, PACK, "", GAP
        )
    if BLOCK_H3 > 0:
        z1, z2 = load_heads(
            x_base,
            stride_x_head,
            n_heads,
            head0 + BLOCK_H + BLOCK_H2,
            HALF,
            HALF_PAD,
            BLOCK_H3,
            INTERLEAVED,
            PACK,
            "",
            GAP,
        )
    return x1, x2, y1, y2, z1, z2


@triton.jit
def store_heads(
    o_base,
    stride_o_head,
    n_heads,
    head0,
    o1,
    o2,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    OUT_INTERLEAVED: tl.constexpr,
    PACK: tl.constexpr,
    GAP: tl.constexpr,
):
    """Store o1, o2 (float32, (BLOCK_H, HALF_PAD)) as the rotated dims of heads [head0, head0 +
    BLOCK_H) of one token, in o's dtype; o_base points at the token's first element. Half-split
    pairs are (i, GAP + i), as load_heads reads them."""
    h = head0 + tl.arange(0, BLOCK_H)
    o_row = o_base + h.to(tl.int64)[:, None] * stride_o_head
    i = tl.arange(0, HALF_PAD)[None, :]
    m = (h[:, None] < n_heads) & (i < HALF)
    out_ty = o_base.dtype.element_ty
    if OUT_INTERLEAVED and PACK != 0:
        _store_pairs(o_row, i, m, o1, o2, out_ty, PACK)
    elif OUT_INTERLEAVED:
        pair = tl.arange(0, 2)[None, None, :]
        o = tl.join(o1, o2).to(out_ty)
        tl.store(o_row[:, :, None] + 2 * i[:, :, None] + pair, o, mask=m[:, :, None])
    else:
        tl.store(o_row + i, o1.to(out_ty), mask=m)
        tl.store(o_row + GAP + i, o2.to(out_ty), mask=m)


@triton.jit
def saturate(x, out_ty: tl.constexpr):
    """x (float32) clamped to the finite range of an fp8 output type, so that a scaled value past
    it stores the largest finite value instead of what the backend's cast makes of it (NaN for
    e4m3fn, inf for e5m2); other output types: x unchanged. NaN stays NaN (an out-of-range position)."""
    if out_ty == tl.float8e4nv:
        x = tl.where(x > 448.0, 448.0, tl.where(x < -448.0, -448.0, x))
    elif out_ty == tl.float8e5:
        x = tl.where(x > 57344.0, 57344.0, tl.where(x < -57344.0, -57344.0, x))
    return x


@triton.jit
def _rotate_store(
    x_base,
    o_base,
    stride_x_head,
    stride_o_head,
    n_heads,
    head0,
    tail_len,
    x1,
    x2,
    c,
    sn,
    o_scale_ptr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    OUT_INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
    SCALED: tl.constexpr,
    PACK: tl.constexpr,
    t_given,
    TAIL_GIVEN: tl.constexpr,
    GAP: tl.constexpr,
):
    """Rotate (x1, x2) by (c, sn) and store them, plus the unrotated tail when TAIL_PAD > 0: read
    from x, or (TAIL_GIVEN) the float32 tile t_given (the normalized tail; written in place too).
    Pairs (i, GAP + i) and the tail's columns: load_heads' and tail_at's layout."""
    h = head0 + tl.arange(0, BLOCK_H)
    h64 = h.to(tl.int64)
    o_row = o_base + h64[:, None] * stride_o_head

    cb = c[None, :]
    sb = sn[None, :]
    if INVERSE:
        sb = -sb
    o1 = x1 * cb - x2 * sb
    o2 = x2 * cb + x1 * sb
    if SCALED:
        inv = 1.0 / tl.load(o_scale_ptr).to(tl.float32)
        o1 = saturate(o1 * inv, o_base.dtype.element_ty)
        o2 = saturate(o2 * inv, o_base.dtype.element_ty)
    store_heads(o_base, stride_o_head, n_heads, head0, o1, o2, HALF, HALF_PAD, BLOCK_H, OUT_INTERLEAVED, PACK, GAP)

    if TAIL_PAD > 0:
        # partial rotary, out of place: the dims no pair holds are copied unchanged
        out_ty = o_base.dtype.element_ty
        x_row = x_base + h64[:, None] * stride_x_head
        j = tl.arange(0, TAIL_PAD)[None, :]
        mt = (h[:, None] < n_heads) & (j < tail_len)
        if TAIL_GIVEN:
            t = t_given
        else:
            t = tl.load(tail_at(x_row, j, HALF, GAP), mask=mt)
        if SCALED:
            t = saturate(t.to(tl.float32) / tl.load(o_scale_ptr).to(tl.float32), out_ty)
        tl.store(tail_at(o_row, j, HALF, GAP), t.to(out_ty), mask=mt)


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
        is_q, q_ptr + (b * stride_q_batch + s * stride_q_token), k_ptr + (b * stride_k_batch + s * stride_k_token)
    )
    o_base = tl.where(
        is_q, qo_ptr + (b * stride_qo_batch + s * stride_qo_token), ko_ptr + (b * stride_ko_batch + s * stride_ko_token)
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
):
    """norm_heads for head block blk of q (blocks < n_q_blocks) or of k: the mode and weight are
    selected like _select's pointers (scalar selects, one code path for q and k). GROUP_GIVEN:
    mode 2 scales by r_group, the token's inverse rms over all of this tensor's heads. Without a
    norm across heads in the launch, a weight is one row shared by the heads (read once a tile).
    block, xs, params: _tile_out's."""
    blk, n_q_blocks, x_base, _, stride_x_head, _, n_heads, tail = block
    x1, x2 = xs
    _, _, wq_ptr, wk_ptr, norm_eps, norm_offset = params
    is_q = blk < n_q_blocks
    mode = tl.where(is_q, NORM_Q, NORM_K)
    w_ptr = tl.where(is_q, wq_ptr, wk_ptr)
    return norm_heads_given(
        x_base,
        stride_x_head,
        n_heads,
        head0,
        tail,
        x1,
        x2,
        w_ptr,
        mode,
        norm_eps,
        norm_offset,
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
    )


@triton.jit
def _tile_out(
    block,
    head0,
    xs,
    cs,
    params,
    r_group,
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
):
    """Heads [head0, head0 + BLOCK_H) of a head block, loaded as xs = (x1, x2): normalized (with a
    norm), rotated by cs = (c, sn) and stored, the tail too (_rotate_store). block: the block as the
    kernel selected it (blk, n_q_blocks, x_base, o_base, stride_x_head, stride_o_head, n_heads,
    tail); params: the kernel's (q_scale_ptr, k_scale_ptr, wq_ptr, wk_ptr, norm_eps, norm_offset)."""
    blk, n_q_blocks, x_base, o_base, stride_x_head, stride_o_head, n_heads, tail = block
    x1, x2 = xs
    c, sn = cs
    q_scale_ptr, k_scale_ptr, wq_ptr, wk_ptr, norm_eps, norm_offset = params
    t_norm = x1
    if NORM_Q != 0 or NORM_K != 0:
        x1, x2, t_norm = _norm_select(
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
        )
    _rotate_store(
        x_base,
        o_base,
        stride_x_head,
        stride_o_head,
        n_heads,
        head0,
        tail,
        x1,
        x2,
        c,
        sn,
        tl.where(blk < n_q_blocks, q_scale_ptr, k_scale_ptr),
        HALF,
        HALF_PAD,
        BLOCK_H,
        TAIL_PAD,
        OUT_INTERLEAVED,
        INVERSE,
        SCALED,
        PACK,
        t_norm,
        NORM_Q != 0 or NORM_K != 0,
        GAP,
    )


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
    stride_pos_row,  # positions' stride between M-RoPE rows (t, h, w) or FREQS axes
    stride_pos_batch,  # positions' stride of b
    stride_pos_token,  # positions' stride of s
    stride_angle_row,  # per-token angles' stride between M-RoPE rows
    stride_angle_batch,  # per-token angles' stride of b
    stride_angle_token,  # table row stride, or per-token angles' stride of s
    stride_angle_col,  # stride between frequencies (2 for Llama 4's complex view)
    SEC_T,  # M-RoPE sections: frequencies driven by the temporal row (FREQS: by axis 0)
    SEC_H,  # ... by the height row (FREQS: axis 1)
    SEC_W,  # ... by the width row (FREQS: axis 2; axis 3 takes the rest)
    n_seqs,  # PACKED: sequences in cu_seqlens (at pos_ptr)
    cp_size,  # PACKED: context-parallel size (1: none)
    cp_rank,  # PACKED: this rank
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
    MROPE: tl.constexpr,  # 0 none, 1 chunked sections (Qwen2-VL), 2 interleaved (Qwen3-VL)
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
    PACKED: pos_ptr is cu_seqlens and each token's position is derived from it (.positions).
    """
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)  # one program per token: up to 2^31 - 1 tokens
    b = t // S
    s = t - b * S
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
    x1, x2, y1, y2, z1, z2 = load_tiles(
        (x_base, stride_x_head, n_heads, head0), HALF, HALF_PAD, BLOCK_H, BLOCK_H2, BLOCK_H3, INTERLEAVED, PACK, GAP
    )
    # where the token's angles come from, as load_angles takes them (positions, table or inverse
    # frequencies, M-RoPE sections or axes, packed sequences)
    angles = (
        (pos_ptr, stride_pos_row, stride_pos_batch, stride_pos_token),
        (cos_ptr, sin_ptr + sin_off, max_pos),
        (stride_angle_row, stride_angle_batch, stride_angle_token, stride_angle_col),
        (SEC_T, SEC_H, SEC_W, n_seqs, cp_size, cp_rank),
    )
    c, sn = load_angles(angles, b, s, HALF, HALF_PAD, HAS_POS, MROPE, PACKED, SEARCH_STRIDE, SEARCH_COARSE, FREQS)
    # one loop body for both layouts: with HEAD_LOOP it walks every head block, next block's loads
    # in flight; otherwise it runs once for this program's block (a one-trip loop the compiler drops)
    if HEAD_LOOP:
        n_iter = n_blocks
    else:
        n_iter = 1
    params = (q_scale_ptr, k_scale_ptr, wq_ptr, wk_ptr, norm_eps, norm_offset)  # as _tile_out takes them
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
                )
        else:
            blk = blk0
        if WHOLE and (NORM_Q == 2 or NORM_K == 2):
            # the block is the tensor's every head, in registers: the group's sum needs no second read
            r_group = tiles_inv_rms(
                x_base,
                stride_x_head,
                n_heads,
                head0,
                tail,
                norm_eps,
                x1,
                x2,
                y1,
                y2,
                z1,
                z2,
                HALF,
                HALF_PAD,
                BLOCK_H,
                BLOCK_H2,
                BLOCK_H3,
                TAIL_PAD,
                GAP,
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
                    x_base, stride_x_head, n_heads, tail, norm_eps, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, GAP
                )
        group_given = (HEAD_LOOP or WHOLE) and (NORM_Q == 2 or NORM_K == 2)
        block = (blk, n_q_blocks, x_base, o_base, stride_x_head, stride_o_head, n_heads, tail)
        _tile_out(
            block,
            head0,
            (x1, x2),
            (c, sn),
            params,
            r_group,
            HALF,
            HALF_PAD,
            BLOCK_H,
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
        )
        if BLOCK_H2 > 0:
            _tile_out(
                block,
                head0 + BLOCK_H,
                (y1, y2),
                (c, sn),
                params,
                r_group,
                HALF,
                HALF_PAD,
                BLOCK_H2,
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
            )
        if BLOCK_H3 > 0:
            _tile_out(
                block,
                head0 + BLOCK_H + BLOCK_H2,
                (z1, z2),
                (c, sn),
                params,
                r_group,
                HALF,
                HALF_PAD,
                BLOCK_H3,
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


@triton.jit
def _unrotate(
    g_base,
    stride_g_head,
    n_heads,
    head0,
    tail,
    g1,
    g2,
    c,
    sn,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INVERSE: tl.constexpr,
    GAP: tl.constexpr,
):
    """gz, the gradient before the forward's rotation, from g's rotated pairs (g1, g2) of heads
    [head0, head0 + BLOCK_H) (the transpose of the rotation), and g's tail (read; float32 tiles)."""
    cb = c[None, :]
    sb = sn[None, :]
    if INVERSE:
        sb = -sb
    gz1 = g1 * cb + g2 * sb
    gz2 = g2 * cb - g1 * sb
    gzt = gz1
    if TAIL_PAD > 0:
        gzt = load_tail(g_base, stride_g_head, n_heads, head0, tail, HALF, BLOCK_H, TAIL_PAD, GAP)
    return gz1, gz2, gzt


@triton.jit
def _load_x(
    x_base,
    stride_x_head,
    n_heads,
    head0,
    tail,
    placeholder,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACK: tl.constexpr,
    GAP: tl.constexpr,
):
    """x1, x2 and the tail of heads [head0, head0 + BLOCK_H) of one token (float32 tiles; the tail
    is `placeholder` when TAIL_PAD is 0)."""
    x1, x2 = load_heads(x_base, stride_x_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, PACK, "", GAP)
    xt = placeholder
    if TAIL_PAD > 0:
        xt = load_tail(x_base, stride_x_head, n_heads, head0, tail, HALF, BLOCK_H, TAIL_PAD, GAP)
    return x1, x2, xt


@triton.jit
def _store_grad(
    gx_base,
    stride_gx_head,
    n_heads,
    head0,
    tail,
    gx1,
    gx2,
    gxt,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACK: tl.constexpr,
    GAP: tl.constexpr,
):
    """Store the input gradient of heads [head0, head0 + BLOCK_H) of one token, tail included."""
    store_heads(gx_base, stride_gx_head, n_heads, head0, gx1, gx2, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, PACK, GAP)
    if TAIL_PAD > 0:
        h = head0 + tl.arange(0, BLOCK_H)
        jt = tl.arange(0, TAIL_PAD)[None, :]
        mt = (h[:, None] < n_heads) & (jt < tail)
        ptr = tail_at(gx_base + h.to(tl.int64)[:, None] * stride_gx_head, jt, HALF, GAP)
        tl.store(ptr, gxt.to(gx_base.dtype.element_ty), mask=mt)


@triton.jit
def _put_dw_heads(
    row,
    n_heads,
    head0,
    tail,
    d1,
    d2,
    dt,
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
    what the row holds (ACCUMULATE) or stored (the row's start)."""
    h = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)[None, :]
    m = (h[:, None] < n_heads) & (i < HALF)
    c1, c2 = weight_cols(i, HALF, INTERLEAVED, GAP)
    hrow = row + h.to(tl.int64)[:, None] * (2 * HALF + tail)
    if ACCUMULATE:
        d1 += tl.load(hrow + c1, mask=m, other=0.0)
        d2 += tl.load(hrow + c2, mask=m, other=0.0)
    tl.store(hrow + c1, d1, mask=m)
    tl.store(hrow + c2, d2, mask=m)
    if TAIL_PAD > 0:
        jt = tl.arange(0, TAIL_PAD)[None, :]
        mt = (h[:, None] < n_heads) & (jt < tail)
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
):
    """What a norm's backward needs of heads [head0, head0 + BLOCK_H) of one token, given their
    loaded pairs of x (x1, x2) and of g (g1, g2): x, gz (the unrotated output gradient) and the
    weight (w + offset) at the same columns, float32 tiles (rotated pairs' members, then the tail;
    the tails are read here), as one group `terms` (x1, x2, xt, gz1, gz2, gzt, w1, w2, wt). Per
    head (NORM 1) the weight is a (1, .) row shared by the heads. tok: the token's group (x, g, gx
    first elements, weight, their head strides, heads, tail, eps, offset); cs: its angles."""
    x_base, g_base, _, w_ptr, stride_x_head, stride_g_head, _, n_heads, tail, _, norm_offset = tok
    c, sn = cs
    gz1, gz2, gzt = _unrotate(
        g_base, stride_g_head, n_heads, head0, tail, g1, g2, c, sn, HALF, BLOCK_H, TAIL_PAD, INVERSE, GAP
    )
    xt = gz1
    if TAIL_PAD > 0:
        xt = load_tail(x_base, stride_x_head, n_heads, head0, tail, HALF, BLOCK_H, TAIL_PAD, GAP)
    w1, w2, wt = load_norm_weights(
        w_ptr,
        n_heads,
        head0,
        tail,
        NORM,
        norm_offset,
        HALF,
        HALF_PAD,
        BLOCK_H,
        TAIL_PAD,
        INTERLEAVED,
        NORM == 1,
        W_PAIRS,
        GAP,
    )
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
):
    """_tile_terms of heads [head0, head0 + BLOCK_H) of one token across heads (NORM 2), their x
    and g read here."""
    x_base, g_base, stride_x_head, stride_g_head, n_heads = tok[0], tok[1], tok[4], tok[5], tok[7]
    g1, g2 = load_heads(g_base, stride_g_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, OUT_INTERLEAVED, PACK, "", GAP)
    x1, x2 = load_heads(x_base, stride_x_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, PACK, "", GAP)
    return _tile_terms(
        tok, cs, head0, x1, x2, g1, g2, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, INVERSE, 2, W_PAIRS, GAP
    )


@triton.jit
def _tile_sums(
    terms,
    n_heads,
    head0,
    tail,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
):
    """group_sums (.norm) of a tile's terms (_tile_terms' group)."""
    x1, x2, xt, gz1, gz2, gzt, w1, w2, wt = terms
    return group_sums(x1, x2, xt, gz1, gz2, gzt, n_heads, head0, tail, w1, w2, wt, HALF, HALF_PAD, BLOCK_H, TAIL_PAD)


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
):
    """The norm's backward of heads [head0, head0 + BLOCK_H) of one token (terms as _tile_terms
    returns them): gx stored, the weight-gradient terms gz * n returned. Per head (NORM 1) each head
    has its own inverse rms; across heads (NORM 2) the token's r_group and mean_group (from the
    group's sums) are given."""
    gx_base, stride_gx_head, n_heads, tail, norm_eps = tok[2], tok[6], tok[7], tok[8], tok[9]
    x1, x2, xt, gz1, gz2, gzt, w1, w2, wt = terms
    if NORM == 2:
        r = tl.zeros([BLOCK_H, 1], tl.float32) + r_group
    else:
        r = inv_rms(x1, x2, xt, n_heads, head0, tail, NORM, norm_eps, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, 1.0, False)[
            :, None
        ]
    gx1, gx2, gxt, d1, d2, dt = norm_backward(
        x1,
        x2,
        xt,
        gz1,
        gz2,
        gzt,
        n_heads,
        head0,
        tail,
        w1,
        w2,
        wt,
        r,
        NORM,
        mean_group,
        HALF,
        HALF_PAD,
        BLOCK_H,
        TAIL_PAD,
    )
    _store_grad(
        gx_base,
        stride_gx_head,
        n_heads,
        head0,
        tail,
        gx1,
        gx2,
        gxt,
        HALF,
        HALF_PAD,
        BLOCK_H,
        TAIL_PAD,
        INTERLEAVED,
        PACK,
        GAP,
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
            tok, cs, head0, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, OUT_INTERLEAVED, INVERSE, PACK, W_PAIRS, GAP
        )
        bss, bgd = _tile_sums(terms, n_heads, head0, tail, HALF, HALF_PAD, BLOCK_H, TAIL_PAD)
        ss += bss
        gd += bgd
    count = (n_heads * (2 * HALF + tail)).to(tl.float32)
    r = 1.0 / tl.sqrt(ss / count + norm_eps)
    mean = r * gd / count  # mean(gz * w' * n), n = x * r
    for head0 in tl.range(0, n_heads, BLOCK_H):
        terms = _block_terms(
            tok, cs, head0, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, OUT_INTERLEAVED, INVERSE, PACK, W_PAIRS, GAP
        )
        d1, d2, dt = _tile_grads(
            tok, head0, terms, r, mean, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, PACK, 2, GAP
        )
        _put_dw_heads(row, n_heads, head0, tail, d1, d2, dt, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, True, GAP)
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
        tok, cs, 0, xa1, xa2, ga1, ga2, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, INVERSE, NORM, W_PAIRS, GAP
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
        )
    r = tl.zeros([], tl.float32) + 1.0
    mean = tl.zeros([], tl.float32)
    if NORM == 2:
        ss, gd = _tile_sums(ta, n_heads, 0, tail, HALF, HALF_PAD, BLOCK_H, TAIL_PAD)
        if BLOCK_H2 > 0:
            bss, bgd = _tile_sums(tb, n_heads, b0, tail, HALF, HALF_PAD, BLOCK_H2, TAIL_PAD)
            ss += bss
            gd += bgd
        if BLOCK_H3 > 0:
            css, cgd = _tile_sums(tc, n_heads, c0, tail, HALF, HALF_PAD, BLOCK_H3, TAIL_PAD)
            ss += css
            gd += cgd
        count = (n_heads * (2 * HALF + tail)).to(tl.float32)
        r = 1.0 / tl.sqrt(ss / count + norm_eps)
        mean = r * gd / count  # mean(gz * w' * n), n = x * r
    da1, da2, dat = _tile_grads(tok, 0, ta, r, mean, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, PACK, NORM, GAP)
    db1, db2, dbt = da1, da2, dat
    dc1, dc2, dct = da1, da2, dat
    if BLOCK_H2 > 0:
        db1, db2, dbt = _tile_grads(
            tok, b0, tb, r, mean, HALF, HALF_PAD, BLOCK_H2, TAIL_PAD, INTERLEAVED, PACK, NORM, GAP
        )
    if BLOCK_H3 > 0:
        dc1, dc2, dct = _tile_grads(
            tok, c0, tc, r, mean, HALF, HALF_PAD, BLOCK_H3, TAIL_PAD, INTERLEAVED, PACK, NORM, GAP
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
    stride_pos_row,  # positions' stride between M-RoPE rows (t, h, w) or FREQS axes
    stride_pos_batch,  # positions' stride of b
    stride_pos_token,  # positions' stride of s
    stride_angle_row,  # per-token angles' stride between M-RoPE rows
    stride_angle_batch,  # per-token angles' stride of b
    stride_angle_token,  # table row stride, or per-token angles' stride of s
    stride_angle_col,  # stride between frequencies
    SEC_T,  # M-RoPE sections: frequencies driven by the temporal row (FREQS: by axis 0)
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
    MROPE: tl.constexpr,  # 0 none, 1 chunked sections (Qwen2-VL), 2 interleaved (Qwen3-VL)
    INTERLEAVED: tl.constexpr,  # x and gx hold pairs (2i, 2i+1); else halves (i, i + HALF)
    OUT_INTERLEAVED: tl.constexpr,  # g holds pairs
    INVERSE: tl.constexpr,  # the forward rotated by -angle
    NORM: tl.constexpr,  # the forward's RMSNorm: 0 none, 1 per head, 2 across heads
    PACKED: tl.constexpr,  # positions derived from cu_seqlens (packed sequences, context parallelism)
    SEARCH_STRIDE: tl.constexpr,  # PACKED: cu_seqlens entries per block of the two-level search
    SEARCH_COARSE: tl.constexpr,  # PACKED: blocks (a power of two covering n_seqs + 1 entries)
    FREQS: tl.constexpr,  # angles computed from positions (any axis rows) x inverse frequencies at cos_ptr
    PACK: tl.constexpr,  # 0, or bits of a (2i, 2i+1) pair moved as one word (x, g and gx pair-aligned)
    WHOLE: tl.constexpr,  # NORM 1 or 2: a token's every head in registers, tiles of BLOCK_H, BLOCK_H2, BLOCK_H3
    BLOCK_H2: tl.constexpr,  # WHOLE: heads of the second tile, after BLOCK_H (0: none)
    BLOCK_H3: tl.constexpr,  # WHOLE: heads of the third tile, after BLOCK_H + BLOCK_H2 (0: none)
    W_PAIRS: tl.constexpr,  # interleaved weight read as one word per pair (16-byte aligned)
):
    """Backward of RMSNorm + rotation for one tensor (q or k): program (p, j) takes tokens
    [p * tokens_per_program, (p + 1) * tokens_per_program) of head block j.

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
                row, n_heads, hz, tail, acc1, acc2, acc_t, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, False, GAP
            )
        tl.debug_barrier()
    if NORM == 1 and not WHOLE:
        w1, w2, wt = load_norm_weights(
            w_ptr,
            n_heads,
            head0,
            tail,
            NORM,
            norm_offset,
            HALF,
            HALF_PAD,
            BLOCK_H,
            TAIL_PAD,
            INTERLEAVED,
            True,
            W_PAIRS,
            GAP,
        )
    else:
        w1, w2, wt = zero + 1.0, zero + 1.0, acc_t + 1.0
    t_first = p * tokens_per_program
    for j in range(tokens_per_program):
        t = t_first + j
        if t < n_tokens:
            b = t // S
            s = t - b * S
            x_base = x_ptr + (b * stride_x_batch + s * stride_x_token)
            g_base = g_ptr + (b * stride_g_batch + s * stride_g_token)
            gx_base = gx_ptr + (b * stride_gx_batch + s * stride_gx_token)
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
                )
            else:
                g1, g2 = load_heads(
                    g_base, stride_g_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, OUT_INTERLEAVED, PACK, "", GAP
                )
            angles = (  # where the token's angles come from, as load_angles takes them
                (pos_ptr, stride_pos_row, stride_pos_batch, stride_pos_token),
                (cos_ptr, sin_ptr + sin_off, max_pos),
                (stride_angle_row, stride_angle_batch, stride_angle_token, stride_angle_col),
                (SEC_T, SEC_H, SEC_W, n_seqs, cp_size, cp_rank),
            )
            c, sn = load_angles(
                angles, b, s, HALF, HALF_PAD, HAS_POS, MROPE, PACKED, SEARCH_STRIDE, SEARCH_COARSE, FREQS
            )
            # the token's group as the backward's helpers take it
            tok = (x_base, g_base, gx_base, w_ptr, stride_x_head, stride_g_head, stride_gx_head, n_heads)
            tok += (tail, norm_eps, norm_offset)
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
                )
            else:
                gz1, gz2, gzt = _unrotate(
                    g_base, stride_g_head, n_heads, head0, tail, g1, g2, c, sn, HALF, BLOCK_H, TAIL_PAD, INVERSE, GAP
                )
                if NORM == 1:
                    x1, x2, xt = _load_x(
                        x_base,
                        stride_x_head,
                        n_heads,
                        head0,
                        tail,
                        gz1,
                        HALF,
                        HALF_PAD,
                        BLOCK_H,
                        TAIL_PAD,
                        INTERLEAVED,
                        PACK,
                        GAP,
                    )
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
                    )
                    acc1 += d1
                    acc2 += d2
                    if TAIL_PAD > 0:
                        acc_t += dt
                else:
                    _store_grad(
                        gx_base,
                        stride_gx_head,
                        n_heads,
                        head0,
                        tail,
                        gz1,
                        gz2,
                        gzt,
                        HALF,
                        HALF_PAD,
                        BLOCK_H,
                        TAIL_PAD,
                        INTERLEAVED,
                        PACK,
                        GAP,
                    )
    if NORM == 2 and WHOLE:
        # the program's sums of every head, kept in registers over its tokens: stored once
        row = dw_ptr + p * dw_row
        _put_dw_heads(
            row, n_heads, 0, tail, acc1, acc2, acc_t, HALF, HALF_PAD, BLOCK_H, TAIL_PAD, INTERLEAVED, False, GAP
        )
        if BLOCK_H2 > 0:
            _put_dw_heads(
                row,
                n_heads,
                BLOCK_H,
                tail,
                accb1,
                accb2,
                accb_t,
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
                n_heads,
                BLOCK_H + BLOCK_H2,
                tail,
                accc1,
                accc2,
                accc_t,
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
        c1, c2 = weight_cols(i, HALF, INTERLEAVED, GAP)
        tl.store(row + c1.reshape([HALF_PAD]), s1, mask=fm)
        tl.store(row + c2.reshape([HALF_PAD]), s2, mask=fm)
        if TAIL_PAD > 0:
            jt = tl.arange(0, TAIL_PAD)
            tl.store(tail_at(row, jt, HALF, GAP), st, mask=jt < tail)
