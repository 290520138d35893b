"""Fused RoPE + KV-cache store: the second entry point of the one kernel family.

One launch rotates q (in place, or into a separate q_out such as an fp8 attention input), rotates
k straight into its cache row (and, with WRITE_KEY, back into k too) and copies v into its cache row,
so k never makes a round trip through memory. It is built from ropekit.language (`load_angles`,
`load_heads`, `rotate`, `store_heads`) and the norm helpers (.norm): the rotation math, the angle lookup and
the int64 addressing are the same code as `rope_kernel`; only the output addresses (a cache row
picked by the token's slot, a second destination) are new.

Grid: axis 0 walks tokens, axis 1 walks head blocks of q, then of k, then of v.

Cache addressing: a slot s names row (s // block_size, s % block_size) of a paged cache
(num_blocks, block_size, H, D), any strides, so NHD and HND (a permuted view) are one case; a flat
cache (num_slots, H, D) is block_size 1 with a zero in-block stride. The slot is widened to int64
when loaded, so block * stride cannot wrap whatever the cache size (caches of tens of GB pass 2^31
elements). Slots < 0 (padding) write nothing; slots >= num_slots write nothing either and make the
token's rotated q dims NaN, the same loud, sync-free signal a bad position gives (see ropekit.api.store).

fp8 outputs (caches, q_out; e4m3 or e5m2): the float32 value is divided by its scale, saturated to
the format's largest finite value (448 for e4m3, 57344 for e5m2; NaN stays NaN:
ropekit.language's `saturate`, by the output pointer's type) and cast once, so the result does not depend on how a
backend's cast treats values out of range.

NVFP4 caches (FP4): k and v rows go to two tensors per cache, the e2m1 codes two to a byte (the
even element of a pair in the low nibble) and one float8_e4m3fn scale per 16 consecutive values of a
head row. A block's scale is amax / 6 / g rounded to nearest even onto e4m3 (saturated at 448), g the
per-tensor global scale (k_scale / v_scale, 1 when absent); each value |x| / (scale * g) is rounded
to nearest even onto the e2m1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (saturated at 6), a zero scale
stores zeros. The scale is rounded in float32 arithmetic (IEEE divisions, `_e4m3_round`); each
code is found by exact comparisons of |x| with the decision boundaries times scale * g
(`_e2m1_code`, no division), the float64 oracle's rule for any g. Codes and scales are stored as
their bits, so nothing depends on a backend's fp8 cast (the Triton interpreter's truncates
instead of rounding). The
rotated pairs and the tail are quantized as they are held (pairs (2i, 2i+1); or each half of a
half-split head, cut into its (2j, 2j+1) pairs): validation makes every 16-value block fall inside
one of them.

Heads in two parts (FlashInfer's rope / no-rope inputs): with NOPE_K, k holds the rotary dims only
and the cache row's dims past them are read from k_nope, a tensor with its own strides, beside v;
with NOPE_Q, q holds the rotary dims only and q_out's dims past them come from q_nope. The row and
q_out are laid out as one head would be: the rotated dims first, then the no-rope ones.
"""

import triton
import triton.language as tl

from ..language import (
    head_mask,
    head_rows,
    load_angles,
    load_heads,
    load_tail,
    pdl_prologue,
    program_token,
    rotate,
    saturate,
    split_slot,
    store_heads,
    store_tail,
    token_offset,
)
from .norm import norm_heads


@triton.jit
def _copy_heads(
    src,
    dst,
    heads,
    o_scale_ptr,
    BLOCK_H: tl.constexpr,
    D_PAD: tl.constexpr,
    SCALED: tl.constexpr,
):
    """Copy heads [head0, head0 + BLOCK_H) of one token (d elements each). src: (x_ptr, x_tok,
    stride_x_head, stride_x_dim), the tensor, the token's element offset (int64) and its strides;
    dst: (o_ptr, o_tok, stride_o_head), the row it goes to likewise (unit last stride); heads:
    (n_heads, head0, d).

    stride_x_dim: x's last-dim stride (Triton specializes the usual 1, so a unit stride costs
    nothing). SCALED: values are divided by the float32 scalar at o_scale_ptr before the cast
    (fp8 caches); fp8 outputs saturate (ropekit.language's saturate).
    """
    x_ptr, x_tok, stride_x_head, stride_x_dim = src
    o_ptr, o_tok, stride_o_head = dst
    n_heads, head0, d = heads
    live = head_mask(n_heads, head0, BLOCK_H)
    j = tl.arange(0, D_PAD)[None, :]
    m = live & (j < d)
    # through float32 (exact for fp16/bf16/fp32): fp8 casts are only ever made from float32
    x_rows = head_rows(x_ptr + x_tok, stride_x_head, head0, BLOCK_H)
    x = tl.load(x_rows + j.to(tl.int64) * stride_x_dim, mask=m).to(tl.float32)
    if SCALED:
        x = x / tl.load(o_scale_ptr).to(tl.float32)
    out_ty = o_ptr.dtype.element_ty
    tl.store(head_rows(o_ptr + o_tok, stride_o_head, head0, BLOCK_H) + j, saturate(x, out_ty).to(out_ty), mask=m)


@triton.jit
def _load_nope(
    t_base, stride_t_head, stride_t_dim, n_heads, head0, tail_len, BLOCK_H: tl.constexpr, TAIL_PAD: tl.constexpr
):
    """The tail of heads [head0, head0 + BLOCK_H) from a tensor of its own (q_nope, k_nope: t_base
    is the token's first element), float32, 0 where masked. stride_t_dim: its last-dim stride (Triton
    specializes the usual 1)."""
    live = head_mask(n_heads, head0, BLOCK_H)
    j = tl.arange(0, TAIL_PAD)[None, :]
    mt = live & (j < tail_len)
    at = head_rows(t_base, stride_t_head, head0, BLOCK_H) + j.to(tl.int64) * stride_t_dim
    return tl.load(at, mask=mt, other=0.0).to(tl.float32)


@triton.jit
def _e4m3_round(s):
    """s (float32, >= 0, inf or NaN) rounded to nearest even onto float8_e4m3fn's values, saturated
    at 448 (inf too; NaN stays NaN): (the value as a float32, its e4m3 bits as an int32). The
    quantum is 2^-9 below 2^-6 (subnormals), else 2^(e - 3) for s in [2^e, 2^(e + 1)): built from
    s's exponent bits, so y = s / quantum is an exact power-of-two scaling and the rounded y, r in
    [8, 16] (normal) or [0, 8] (subnormal), is the code's low bits: (e + 7) * 8 + (r - 8), or r.
    The bits are stored, not a cast value: the interpreter's cast to fp8 mishandles NaN and rounding."""
    s = tl.where(s > 448.0, 448.0, s)
    biased = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    normal = s >= 0.015625
    # 2^(e - 3) and its inverse 2^(3 - e) from the biased exponent e + 127
    quantum = tl.where(normal, ((biased - 3) << 23).to(tl.float32, bitcast=True), 0.001953125)
    inv = tl.where(normal, ((257 - biased) << 23).to(tl.float32, bitcast=True), 512.0)
    y = s * inv
    f = tl.floor(y)
    d = y - f
    odd = (f.to(tl.int32) & 1) == 1
    up = (d > 0.5) | ((d == 0.5) & odd)
    r = tl.where(up, f + 1.0, f)
    code = tl.where(normal, (biased - 127 + 6) * 8 + r.to(tl.int32), r.to(tl.int32))
    return r * quantum, tl.where(s != s, 0x7F, code)


@triton.jit
def _e2m1_code(x, sc, g):
    """The e2m1 code (4 bits, sign 8) of x / (sc * g) rounded to nearest even onto {0, 0.5, 1, 1.5,
    2, 3, 4, 6}, saturated at 6: the number of decision boundaries b (0.25, 0.75, 1.25, 1.75, 2.5,
    3.5, 5) that |x| passes, found in three steps of a binary search (1.75; 0.75 or 3.5; the one
    between), a tie (|x| == b * sc * g) going to the even code: boundaries 0.75, 1.75 and 3.5 count
    when reached, the others when passed. Each step compares |x| with b * sc * g exactly, with no
    division: b * sc is exact in float32 (3 and 4 significant bits), and the sign of
    fma(b * sc, g, -|x|), one rounding of the exact difference, is the exact comparison's. sc 0
    gives code 0; NaN (x, or a NaN block scale) gives 0."""
    a = tl.abs(x)
    up = tl.fma(1.75 * sc, g, -a) <= 0.0
    b = tl.where(up, 3.5, 0.75)
    up2 = tl.fma(b * sc, g, -a) <= 0.0
    b = tl.where(up, tl.where(up2, 5.0, 2.5), tl.where(up2, 1.25, 0.25))
    up3 = tl.fma(b * sc, g, -a) < 0.0
    c = up.to(tl.int32) * 4 + up2.to(tl.int32) * 2 + up3.to(tl.int32)
    c = tl.where(sc == 0.0, 0, c)
    return tl.where(x < 0.0, c + 8, c)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fp4_put(lo, hi, rows, first, n_pairs, g, P: tl.constexpr, BLOCK_H: tl.constexpr):
    """NVFP4 store of value pairs (lo[:, p], hi[:, p]) = elements (first + 2p, first + 2p + 1) of
    heads' rows, p < n_pairs (float32 tiles (BLOCK_H, P), P a power of two >= 8; first a multiple
    of 16 and n_pairs of 8, so 8 pairs are one block). rows: (data, scales, live): the (BLOCK_H, 1)
    pointers to each head row's first byte and first scale, and the mask of live heads. g: the
    float32 global scale."""
    data, scales, live = rows
    B: tl.constexpr = P // 8
    # a NaN in a block makes its scale NaN: maxima that keep NaN (the hardware's max drops it)
    a = tl.maximum(tl.abs(lo), tl.abs(hi), propagate_nan=tl.PropagateNan.ALL)
    amax = tl.reduce(tl.reshape(a, (BLOCK_H, B, 8)), 2, _max_nan)
    # IEEE divisions (div_rn): a quotient that is exactly a rounding tie stays one
    one = tl.full((BLOCK_H, B), 1.0, tl.float32)
    sc, bits = _e4m3_round(tl.math.div_rn(tl.math.div_rn(amax, 6.0 * one), g * one))
    scb = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_H, B, 8)), (BLOCK_H, P))
    byte = _e2m1_code(lo, scb, g) | (_e2m1_code(hi, scb, g) << 4)
    p = tl.arange(0, P)[None, :]
    tl.store(data + (first // 2 + p), byte.to(tl.uint8), mask=live & (p < n_pairs))
    j = tl.arange(0, B)[None, :]
    at = scales.to(tl.pointer_type(tl.uint8), bitcast=True) + (first // 16 + j)
    tl.store(at, bits.to(tl.uint8), mask=live & (j * 8 < n_pairs))


@triton.jit
def _fp4_split(x, W: tl.constexpr, BLOCK_H: tl.constexpr):
    """A (BLOCK_H, W) tile of consecutive elements as its (2j, 2j + 1) pairs: two (BLOCK_H, W // 2) tiles."""
    return tl.split(tl.reshape(x, (BLOCK_H, W // 2, 2)))


@triton.jit
def _fp4_heads(
    rows,
    o1,
    o2,
    t,
    dims,
    g,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """_rope_heads' tiles into NVFP4 rows (_fp4_put): the rotated pairs, then the tail when
    TAIL_PAD > 0. dims: (HALF, tail_len)."""
    half, tail_len = dims
    if INTERLEAVED:
        _fp4_put(o1, o2, rows, 0, half, g, HALF_PAD, BLOCK_H)
    else:
        lo, hi = _fp4_split(o1, HALF_PAD, BLOCK_H)
        _fp4_put(lo, hi, rows, 0, half // 2, g, HALF_PAD // 2, BLOCK_H)
        lo, hi = _fp4_split(o2, HALF_PAD, BLOCK_H)
        _fp4_put(lo, hi, rows, half, half // 2, g, HALF_PAD // 2, BLOCK_H)
    if TAIL_PAD > 0:
        lo, hi = _fp4_split(t, TAIL_PAD, BLOCK_H)
        _fp4_put(lo, hi, rows, 2 * half, tail_len // 2, g, TAIL_PAD // 2, BLOCK_H)


@triton.jit
def _rope_heads(
    heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACK: tl.constexpr,
    NORM: tl.constexpr,
    NOPE: tl.constexpr,
    GAP: tl.constexpr,
):
    """Heads [head0, head0 + BLOCK_H) of one token, RMS-normalized when NORM != 0 (1 per head, 2
    across the block's heads) and rotated by (c, sn): float32 tiles o1, o2 (the rotated pairs'
    members) and t, the tail past the rotary dims (TAIL_PAD > 0: normalized with the head;
    otherwise a placeholder). heads: (src, nope, head0, c, sn, w_ptr, norm); src: (x_base,
    stride_x_head, n_heads, tail_len), x_base the token's first element; w_ptr: the norm's weight;
    norm: (eps, offset). NOPE: x holds the rotary dims only and the tail is read
    from its own tensor, nope = (its token's first element, stride per head, stride per dim);
    never with NORM (validation refuses the norm of a head given in two parts)."""
    src, nope, head0, c, sn, w_ptr, norm = heads
    x_base, stride_x_head, n_heads, tail_len = src
    # the evict_first hint was measured on this kernel: its inputs are read once
    x1, x2 = load_heads(
        x_base, stride_x_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, PACK, "evict_first", GAP
    )
    t = x1
    if NORM != 0:
        eps, offset = norm
        x1, x2, t = norm_heads(
            (x_base, stride_x_head, n_heads, head0, tail_len),
            (x1, x2),
            (w_ptr, NORM, eps, offset),
            HALF,
            HALF_PAD,
            BLOCK_H,
            TAIL_PAD,
            INTERLEAVED,
            GAP,
        )
    elif NOPE and TAIL_PAD > 0:
        t_base, stride_t_head, stride_t_dim = nope
        t = _load_nope(t_base, stride_t_head, stride_t_dim, n_heads, head0, tail_len, BLOCK_H, TAIL_PAD)
    elif TAIL_PAD > 0:
        t = load_tail(x_base, stride_x_head, n_heads, head0, tail_len, HALF, BLOCK_H, TAIL_PAD, GAP)
    o1, o2 = rotate(x1, x2, c[None, :], sn[None, :], False)
    return o1, o2, t


@triton.jit
def _put_heads(
    dst,
    head0,
    o1,
    o2,
    t,
    o_scale_ptr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PACK: tl.constexpr,
    SCALED: tl.constexpr,
    GAP: tl.constexpr,
):
    """Store _rope_heads' tiles in o's dtype: the rotated pairs, and the tail t when TAIL_PAD > 0.
    dst: (o_base, stride_o_head, n_heads, tail_len), o_base a token's first element (or a cache
    row's). SCALED: divided by the float32 scalar at o_scale_ptr first; an fp8 output saturates."""
    o_base, stride_o_head, n_heads, tail_len = dst
    if SCALED:
        inv = 1.0 / tl.load(o_scale_ptr).to(tl.float32)
        o1 = o1 * inv
        o2 = o2 * inv
        t = t * inv
    out_ty = o_base.dtype.element_ty
    o1 = saturate(o1, out_ty)
    o2 = saturate(o2, out_ty)
    store_heads(o_base, stride_o_head, n_heads, head0, o1, o2, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, PACK, GAP)
    if TAIL_PAD > 0:
        store_tail(o_base, stride_o_head, n_heads, head0, tail_len, saturate(t, out_ty), HALF, BLOCK_H, TAIL_PAD, GAP)


@triton.jit
def rope_store_kernel(
    q_ptr,  # q, (*T, Hq, D): rotated in place unless Q_OUT
    k_ptr,  # k, (*T, Hk, Dk): read (and written with WRITE_KEY)
    v_ptr,  # v, (*T, Hv, Dv): read (MLA: the non-rope part of the key)
    pos_ptr,  # positions (*T) (the table again when HAS_POS is off: never read then)
    tab_ptr,  # the [cos | sin] table (max_pos, 2 * HALF) with sin at tab_ptr + sin_off
    slot_ptr,  # slot of each token (*T); < 0 skips the token
    kc_ptr,  # k cache, paged (num_blocks, block_size, Hk, Dk) any strides, or flat (num_slots, Hk, Dk)
    vc_ptr,  # v cache likewise
    k_scale_ptr,  # K_SCALED: the float32 scale k is divided by (fp8 cache)
    v_scale_ptr,  # V_SCALED: v's scale
    qo_ptr,  # where rotated q goes: q itself (in place), or a separate q_out (*T, Hq, D)
    q_scale_ptr,  # SCALED: the float32 scale q_out's values are divided by
    wq_ptr,  # NORM_Q: q's RMSNorm weight, (D,) or (H*D,), unit stride (the table when unread)
    wk_ptr,  # NORM_K: k's RMSNorm weight likewise
    qn_ptr,  # NOPE_Q: q_nope (*T, Hq, N), q's dims past the rotary ones (the table when unread)
    kn_ptr,  # NOPE_K: k_nope (*T, Hk, N), k's dims past the rotary ones, beside v (the table when unread)
    kcs_ptr,  # FP4: the k cache's block scales (..., Hk, Dk / 16) float8_e4m3fn (kc_ptr: its codes, Dk / 2 bytes)
    vcs_ptr,  # FP4: the v cache's likewise (the table when unread)
    S,  # size of the last token dim: token t is (b, s) = (t // S, t % S)
    n_q_heads,  # Hq
    n_k_heads,  # Hk
    n_v_heads,  # Hv
    k_tail,  # Dk - rotary_dim (k_nope's width with NOPE_K): k's dims copied unrotated into the cache
    d_v,  # Dv
    max_pos,  # table rows: positions outside [0, max_pos) read nothing and give NaN
    sin_off,  # elements from tab_ptr to sin's first column
    block_size,  # cache slots per block (1 for a flat cache)
    num_slots,  # slots in the cache: slots >= num_slots write nothing and NaN q
    n_q_blocks,  # head blocks of q; blocks n_q_blocks.. are k's, then v's
    n_k_blocks,  # head blocks of k
    n_blocks,  # head blocks of q, k and v (HEAD_LOOP walks them all)
    stride_q_batch,  # q's stride of b (0 with one token dim), in elements
    stride_q_token,  # q's stride of s
    stride_q_head,  # q's stride between heads
    stride_k_batch,  # k's strides likewise
    stride_k_token,
    stride_k_head,
    stride_v_batch,  # v's strides likewise
    stride_v_token,
    stride_v_head,
    stride_pos_row,  # MROPE: stride between the position rows (t, h, w, ...)
    stride_pos_batch,  # positions' stride of b
    stride_pos_token,  # positions' stride of s (PACKED: 1, the token index into cu_seqlens' tokens)
    stride_angle_token,  # table row stride
    stride_angle_col,  # stride between frequencies
    sec_t,  # MROPE: frequencies taken from the t row (MROPE 3: the int32 axis map, load_angles)
    sec_h,  # ... from the h row
    sec_w,  # ... from the w row
    n_seqs,  # PACKED: sequences in cu_seqlens (its length - 1)
    cp_size,  # PACKED: context-parallel world size (1: none)
    cp_rank,  # PACKED: this rank
    stride_slot_batch,  # slots' stride of b
    stride_slot_token,  # slots' stride of s
    stride_k_cache_block,  # k cache's stride between blocks
    stride_k_cache_slot,  # ... between slots of a block (0 for a flat cache)
    stride_k_cache_head,  # ... between heads
    stride_v_cache_block,  # v cache's strides likewise
    stride_v_cache_slot,
    stride_v_cache_head,
    stride_qo_batch,  # q_out's strides (q's when in place) likewise
    stride_qo_token,
    stride_qo_head,
    stride_v_dim,  # v's last-dim stride (1 as a rule: Triton specializes it; any value is read right)
    q_tail,  # Dq - rotary_dim (N with NOPE_Q): written when TAIL_PAD_Q > 0 (q normalized, or a separate q_out)
    stride_qn_batch,  # NOPE_Q: q_nope's stride of b (0 with one token dim)
    stride_qn_token,  # ... of s
    stride_qn_head,  # ... between heads
    stride_qn_dim,  # ... of its last dim (any: it is only read)
    stride_kn_batch,  # NOPE_K: k_nope's strides likewise
    stride_kn_token,
    stride_kn_head,
    stride_kn_dim,
    stride_kcs_block,  # FP4: the k scales' strides between blocks, slots of a block (0 flat) and heads
    stride_kcs_slot,
    stride_kcs_head,
    stride_vcs_block,  # FP4: the v scales' likewise
    stride_vcs_slot,
    stride_vcs_head,
    norm_eps,  # RMSNorm epsilon
    norm_offset,  # added to the weights (1.0: Gemma's (1 + w))
    HALF: tl.constexpr,  # rotary_dim // 2: rotated pairs per head
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    GAP: tl.constexpr,  # columns from a half-split pair's first member to its second: HALF, or D/2 (halves)
    BLOCK_HQ: tl.constexpr,  # heads of q per head block
    BLOCK_HK: tl.constexpr,  # heads of k per head block
    BLOCK_HV: tl.constexpr,  # heads of v per head block
    TAIL_PAD: tl.constexpr,  # k's tail tile width (0: none)
    DV_PAD: tl.constexpr,  # Dv rounded up to a power of two
    HAS_POS: tl.constexpr,  # angles from table rows picked by positions (else row s)
    MROPE: tl.constexpr,  # 0, or M-RoPE's frequency layout (1 chunked, 2 interleaved, 3 axis map): positions (N, *T)
    PACKED: tl.constexpr,  # pos_ptr is cu_seqlens: each token's position is derived from it
    SEARCH_STRIDE: tl.constexpr,  # PACKED: the two-level search's stride over cu_seqlens
    SEARCH_COARSE: tl.constexpr,  # PACKED: ... and its number of coarse entries
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i+1) instead of halves (i, i + HALF)
    K_SCALED: tl.constexpr,  # k cache written divided by k's scale
    V_SCALED: tl.constexpr,  # v cache likewise
    PACK_Q: tl.constexpr,  # 0, or the bits of one pair of q (and q_out) moved as a word (aligned rows)
    PACK_K: tl.constexpr,  # likewise for k and its cache
    NORM_Q: tl.constexpr,  # q's RMSNorm: 0 none, 1 per head, 2 across heads (one block holds them)
    NORM_K: tl.constexpr,  # k's RMSNorm likewise
    TAIL_PAD_Q: tl.constexpr,  # q's tail tile width when written (0: the tail stays as it is)
    SCALED: tl.constexpr,  # q_out written divided by q's scale (Variant.scaled)
    WRITE_KEY: tl.constexpr,  # rotated (normalized) k written back into k, every token
    NOPE_Q: tl.constexpr,  # q is the rope part: q_out's dims past the rotated ones come from q_nope
    NOPE_K: tl.constexpr,  # k is the rope part: the cache row's dims past the rotated ones come from k_nope
    FP4: tl.constexpr,  # NVFP4 caches: e2m1 codes (kc_ptr, vc_ptr) and e4m3 block scales (kcs_ptr, vcs_ptr)
    HEAD_LOOP: tl.constexpr,  # one program per token walks all n_blocks head blocks
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the previous kernel first
):
    """Program (t, j): token t; head block j of q (rotated in place or into q_out), then of k
    (rotated into its cache row, and into k with WRITE_KEY), then of v (copied into its cache row).
    With HEAD_LOOP program t walks all of the token's blocks itself: its slot and angles are
    loaded once instead of once per block.

    HAS_POS False: token (b, s) takes row s of the table (positions = arange over the last token dim).
    PACKED: tokens are (T,) packed sequences, pos_ptr cu_seqlens (positions restart in each sequence).
    """
    pdl_prologue(PDL)
    _, b, s = program_token(S)
    # int64 when loaded: the slot scales a cache stride
    slot = tl.load(slot_ptr + b * stride_slot_batch + s * stride_slot_token).to(tl.int64)
    if HEAD_LOOP:
        n_iter = n_blocks
    else:
        n_iter = 1
    # q's and k's head blocks need the token's angles, v's do not. With HEAD_LOOP the grid is one
    # block wide: program 0 of axis 1 walks every block, so it loads them.
    if tl.program_id(1) < n_q_blocks + n_k_blocks:  # int32-ok: a head-block index (< 65536)
        # where the token's angles come from, as load_angles takes them (table rows only: no
        # per-token angles, no computed ones)
        angles = (
            (pos_ptr, stride_pos_row, stride_pos_batch, stride_pos_token),
            (tab_ptr, tab_ptr + sin_off, max_pos),
            (0, 0, stride_angle_token, stride_angle_col),
            (sec_t, sec_h, sec_w, n_seqs, cp_size, cp_rank),
        )
        c, sn = load_angles(angles, b, s, HALF, HALF_PAD, HAS_POS, MROPE, PACKED, SEARCH_STRIDE, SEARCH_COARSE, False)
    else:
        c = tl.zeros([HALF_PAD], tl.float32)  # v's block: no angles
        sn = c
    norm = (norm_eps, norm_offset)
    for i in tl.range(0, n_iter):
        if HEAD_LOOP:
            blk = i
        else:
            blk = tl.program_id(1)  # int32-ok: as above
        # the slot's cache row; int64 before any arithmetic: block * stride passes 2^31 on big caches
        store = (slot >= 0) & (slot < num_slots)
        cache_blk, cache_off = split_slot(slot, block_size)
        # each tensor's heads at this token as the helpers take them, (first element, head stride,
        # heads, tail), and the no-rope parts, (first element, head stride, dim stride)
        if blk < n_q_blocks:
            # a slot past the cache is an error nothing can be written for: flag it in q (NaN),
            # as a bad position does. A vector compare: scalar-and-vector masks trip the interpreter.
            bad = (tl.zeros([HALF_PAD], tl.int64) + slot) >= num_slots
            cq = tl.where(bad, float("nan"), c)
            head0 = blk * BLOCK_HQ
            q_src = (q_ptr + token_offset(b, s, stride_q_batch, stride_q_token), stride_q_head, n_q_heads, q_tail)
            q_nope = (qn_ptr + token_offset(b, s, stride_qn_batch, stride_qn_token), stride_qn_head, stride_qn_dim)
            q_heads = (q_src, q_nope, head0, cq, sn, wq_ptr, norm)
            o1, o2, kept = _rope_heads(
                q_heads, HALF, HALF_PAD, BLOCK_HQ, TAIL_PAD_Q, INTERLEAVED, PACK_Q, NORM_Q, NOPE_Q, GAP
            )
            # q_dst is q itself when rotating in place; its tail is then written only when normalized
            # (TAIL_PAD_Q 0 otherwise: it already is where it belongs)
            q_dst = (qo_ptr + token_offset(b, s, stride_qo_batch, stride_qo_token), stride_qo_head, n_q_heads, q_tail)
            _put_heads(
                q_dst,
                head0,
                o1,
                o2,
                kept,
                q_scale_ptr,
                HALF,
                HALF_PAD,
                BLOCK_HQ,
                TAIL_PAD_Q,
                INTERLEAVED,
                PACK_Q,
                SCALED,
                GAP,
            )
        elif blk < n_q_blocks + n_k_blocks:
            if store or WRITE_KEY:
                head0 = (blk - n_q_blocks) * BLOCK_HK
                k_src = (k_ptr + token_offset(b, s, stride_k_batch, stride_k_token), stride_k_head, n_k_heads, k_tail)
                k_nope = (kn_ptr + token_offset(b, s, stride_kn_batch, stride_kn_token), stride_kn_head, stride_kn_dim)
                k_heads = (k_src, k_nope, head0, c, sn, wk_ptr, norm)
                o1, o2, kept = _rope_heads(
                    k_heads, HALF, HALF_PAD, BLOCK_HK, TAIL_PAD, INTERLEAVED, PACK_K, NORM_K, NOPE_K, GAP
                )
                if store and FP4:
                    k_row = kc_ptr + (cache_blk * stride_k_cache_block + cache_off * stride_k_cache_slot)
                    ks_row = kcs_ptr + (cache_blk * stride_kcs_block + cache_off * stride_kcs_slot)
                    rows = (
                        head_rows(k_row, stride_k_cache_head, head0, BLOCK_HK),
                        head_rows(ks_row, stride_kcs_head, head0, BLOCK_HK),
                        head_mask(n_k_heads, head0, BLOCK_HK),
                    )
                    g = 1.0
                    if K_SCALED:
                        g = tl.load(k_scale_ptr).to(tl.float32)
                    _fp4_heads(rows, o1, o2, kept, (HALF, k_tail), g, HALF_PAD, BLOCK_HK, TAIL_PAD, INTERLEAVED)
                elif store:
                    k_row = kc_ptr + (cache_blk * stride_k_cache_block + cache_off * stride_k_cache_slot)
                    _put_heads(
                        (k_row, stride_k_cache_head, n_k_heads, k_tail),
                        head0,
                        o1,
                        o2,
                        kept,
                        k_scale_ptr,
                        HALF,
                        HALF_PAD,
                        BLOCK_HK,
                        TAIL_PAD,
                        INTERLEAVED,
                        PACK_K,
                        K_SCALED,
                        GAP,
                    )
                if WRITE_KEY:
                    # after the cache row: the row's tail was read from k. k's own tail changes only
                    # when normalized (in place, like q's)
                    _put_heads(
                        k_src,
                        head0,
                        o1,
                        o2,
                        kept,
                        k_scale_ptr,
                        HALF,
                        HALF_PAD,
                        BLOCK_HK,
                        TAIL_PAD if NORM_K != 0 else 0,
                        INTERLEAVED,
                        PACK_K,
                        False,
                        GAP,
                    )
        elif store and FP4:
            head0 = (blk - n_q_blocks - n_k_blocks) * BLOCK_HV
            v_rows = head_rows(
                v_ptr + token_offset(b, s, stride_v_batch, stride_v_token), stride_v_head, head0, BLOCK_HV
            )
            live = head_mask(n_v_heads, head0, BLOCK_HV)
            j = tl.arange(0, DV_PAD)[None, :]
            x = tl.load(v_rows + j.to(tl.int64) * stride_v_dim, mask=live & (j < d_v), other=0.0).to(tl.float32)
            v_row = vc_ptr + (cache_blk * stride_v_cache_block + cache_off * stride_v_cache_slot)
            vs_row = vcs_ptr + (cache_blk * stride_vcs_block + cache_off * stride_vcs_slot)
            rows = (
                head_rows(v_row, stride_v_cache_head, head0, BLOCK_HV),
                head_rows(vs_row, stride_vcs_head, head0, BLOCK_HV),
                live,
            )
            g = 1.0
            if V_SCALED:
                g = tl.load(v_scale_ptr).to(tl.float32)
            lo, hi = _fp4_split(x, DV_PAD, BLOCK_HV)
            _fp4_put(lo, hi, rows, 0, d_v // 2, g, DV_PAD // 2, BLOCK_HV)
        elif store:
            _copy_heads(
                (v_ptr, token_offset(b, s, stride_v_batch, stride_v_token), stride_v_head, stride_v_dim),
                (vc_ptr, cache_blk * stride_v_cache_block + cache_off * stride_v_cache_slot, stride_v_cache_head),
                (n_v_heads, (blk - n_q_blocks - n_k_blocks) * BLOCK_HV, d_v),
                v_scale_ptr,
                BLOCK_HV,
                DV_PAD,
                V_SCALED,
            )
