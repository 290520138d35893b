"""Fused RoPE + KV-cache store: the second entry point of the one kernel family.

One launch rotates q in place, rotates k straight into its cache row and copies v into its cache
row, so k never makes a round trip through memory. It reuses `_load_angles` and `_rotate_heads`
from .rope: the rotation math, the angle lookup and the int64 addressing are the same code as
`rope_kernel`; only the output address of k (a cache row picked by the token's slot) is new.

Grid: axis 0 walks tokens, axis 1 walks head blocks of q, then of k, then of v.

Cache addressing: a slot s names row (s // block_size, s % block_size) of a paged cache
(num_blocks, block_size, H, D), any strides, so NHD and HND (a permuted view) are one case; a flat
cache (num_slots, H, D) is block_size 1 with a zero in-block stride. The slot is widened to int64
when loaded, so block * stride cannot wrap whatever the cache size (caches of tens of GB pass 2^31
elements). Slots < 0 (padding) write nothing; slots >= num_slots write nothing either and make the
token's rotated q dims NaN, the same loud, sync-free signal a bad position gives (see ropekit.store).
"""

import triton
import triton.language as tl

from .rope import _load_angles, _pdl_prologue, _rotate_heads


@triton.jit
def _copy_heads(
    x_ptr,
    o_ptr,
    x_tok,
    o_tok,
    stride_x_head,
    stride_o_head,
    n_heads,
    head0,
    d,
    o_scale_ptr,
    BLOCK_H: tl.constexpr,
    D_PAD: tl.constexpr,
    SCALED: tl.constexpr,
):
    """Copy heads [head0, head0 + BLOCK_H) of one token (d elements each); x_tok / o_tok are int64.

    SCALED: values are divided by the float32 scalar at o_scale_ptr before the cast (fp8 caches).
    """
    h = head0 + tl.arange(0, BLOCK_H)
    h64 = h.to(tl.int64)
    j = tl.arange(0, D_PAD)[None, :]
    m = (h[:, None] < n_heads) & (j < d)
    # through float32 (exact for fp16/bf16/fp32): fp8 casts are only ever made from float32
    x = tl.load(x_ptr + x_tok + h64[:, None] * stride_x_head + j, mask=m).to(tl.float32)
    if SCALED:
        x = x / tl.load(o_scale_ptr).to(tl.float32)
    tl.store(o_ptr + o_tok + h64[:, None] * stride_o_head + j, x.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _store_angles(
    tab_ptr,
    sin_off,
    pos_ptr,
    b,
    s,
    max_pos,
    stride_pos_batch,
    stride_pos_token,
    stride_angle_token,
    stride_angle_col,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_POS: tl.constexpr,
):
    """cos and sin of token (b, s): _load_angles with the store's one angle source (a table row
    picked by a position, or row s)."""
    return _load_angles(
        tab_ptr,
        tab_ptr + sin_off,
        pos_ptr,
        b,
        s,
        max_pos,
        0,
        stride_pos_batch,
        stride_pos_token,
        0,
        0,
        stride_angle_token,
        stride_angle_col,
        0,
        0,
        0,
        0,
        1,
        0,
        HALF,
        HALF_PAD,
        HAS_POS,
        0,
        False,
        1,
        1,
        False,
    )


@triton.jit
def _store_block(
    blk,
    b,
    s,
    c,
    sn,
    slot,
    q_ptr,
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    tab_ptr,
    n_q_heads,
    n_k_heads,
    n_v_heads,
    k_tail,
    d_v,
    block_size,
    num_slots,
    n_q_blocks,
    n_k_blocks,
    stride_q_batch,
    stride_q_token,
    stride_q_head,
    stride_k_batch,
    stride_k_token,
    stride_k_head,
    stride_v_batch,
    stride_v_token,
    stride_v_head,
    stride_k_cache_block,
    stride_k_cache_slot,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_slot,
    stride_v_cache_head,
    q_tail,
    wq_ptr,
    wk_ptr,
    norm_eps,
    norm_offset,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
    PACK_Q: tl.constexpr,
    PACK_K: tl.constexpr,
    NORM_Q: tl.constexpr,
    NORM_K: tl.constexpr,
    TAIL_PAD_Q: tl.constexpr,
):
    """Head block blk of token (b, s): q's blocks (rotated in place), then k's (rotated into the
    slot's cache row), then v's (copied into it). c, sn: the token's angles (unused for v)."""
    # int64 before any arithmetic: block * stride is the offset that passes 2^31 on big caches
    store = (slot >= 0) & (slot < num_slots)
    cache_blk = slot // block_size
    cache_off = slot - cache_blk * block_size
    if blk < n_q_blocks:
        # a slot past the cache is an error nothing can be written for: flag it in q (NaN),
        # as a bad position does. A vector compare: scalar-and-vector masks trip the interpreter.
        bad = (tl.zeros([HALF_PAD], tl.int64) + slot) >= num_slots
        c = tl.where(bad, float("nan"), c)
        # in place: the tail past rotary_dim is already where it belongs (TAIL_PAD_Q 0) unless
        # it is normalized
        q_tok = b * stride_q_batch + s * stride_q_token
        _rotate_heads(
            q_ptr,
            q_ptr,
            q_tok,
            q_tok,
            stride_q_head,
            stride_q_head,
            n_q_heads,
            blk * BLOCK_HQ,
            q_tail,
            c,
            sn,
            tab_ptr,
            HALF,
            HALF_PAD,
            BLOCK_HQ,
            TAIL_PAD_Q,
            INTERLEAVED,
            INTERLEAVED,
            False,
            False,
            PACK_Q,
            wq_ptr,
            norm_eps,
            norm_offset,
            NORM_Q,
        )
    elif blk < n_q_blocks + n_k_blocks:
        if store:
            _rotate_heads(
                k_ptr,
                kc_ptr,
                b * stride_k_batch + s * stride_k_token,
                cache_blk * stride_k_cache_block + cache_off * stride_k_cache_slot,
                stride_k_head,
                stride_k_cache_head,
                n_k_heads,
                (blk - n_q_blocks) * BLOCK_HK,
                k_tail,
                c,
                sn,
                k_scale_ptr,
                HALF,
                HALF_PAD,
                BLOCK_HK,
                TAIL_PAD,
                INTERLEAVED,
                INTERLEAVED,
                False,
                K_SCALED,
                PACK_K,
                wk_ptr,
                norm_eps,
                norm_offset,
                NORM_K,
            )
    elif store:
        _copy_heads(
            v_ptr,
            vc_ptr,
            b * stride_v_batch + s * stride_v_token,
            cache_blk * stride_v_cache_block + cache_off * stride_v_cache_slot,
            stride_v_head,
            stride_v_cache_head,
            n_v_heads,
            (blk - n_q_blocks - n_k_blocks) * BLOCK_HV,
            d_v,
            v_scale_ptr,
            BLOCK_HV,
            DV_PAD,
            V_SCALED,
        )


@triton.jit
def rope_store_kernel(
    q_ptr,  # q, (*T, Hq, D): rotated in place
    k_ptr,  # k, (*T, Hk, Dk): read
    v_ptr,  # v, (*T, Hv, Dv): read
    pos_ptr,  # positions (*T) (the table again when HAS_POS is off: never read then)
    tab_ptr,  # the [cos | sin] table (max_pos, 2 * HALF) with sin at tab_ptr + sin_off
    slot_ptr,  # slot of each token (*T); < 0 skips the token
    kc_ptr,  # k cache, paged (num_blocks, block_size, Hk, Dk) any strides, or flat (num_slots, Hk, Dk)
    vc_ptr,  # v cache likewise
    k_scale_ptr,  # K_SCALED: the float32 scale k is divided by (fp8 cache)
    v_scale_ptr,  # V_SCALED: v's scale
    S,  # size of the last token dim: token t is (b, s) = (t // S, t % S)
    n_q_heads,  # Hq
    n_k_heads,  # Hk
    n_v_heads,  # Hv
    k_tail,  # Dk - rotary_dim: k's dims copied unrotated into the cache
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
    stride_pos_batch,  # positions' stride of b
    stride_pos_token,  # positions' stride of s
    stride_angle_token,  # table row stride
    stride_angle_col,  # stride between frequencies
    stride_slot_batch,  # slots' stride of b
    stride_slot_token,  # slots' stride of s
    stride_k_cache_block,  # k cache's stride between blocks
    stride_k_cache_slot,  # ... between slots of a block (0 for a flat cache)
    stride_k_cache_head,  # ... between heads
    stride_v_cache_block,  # v cache's strides likewise
    stride_v_cache_slot,
    stride_v_cache_head,
    q_tail,  # Dq - rotary_dim: normalized and written in place when NORM_Q (TAIL_PAD_Q > 0)
    wq_ptr,  # NORM_Q: q's RMSNorm weight, (D,) or (H*D,), unit stride
    wk_ptr,  # NORM_K: k's RMSNorm weight
    norm_eps,  # RMSNorm epsilon
    norm_offset,  # added to the weights (1.0: Gemma's (1 + w))
    HALF: tl.constexpr,  # rotary_dim // 2: rotated pairs per head
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    BLOCK_HQ: tl.constexpr,  # heads of q per head block
    BLOCK_HK: tl.constexpr,  # heads of k per head block
    BLOCK_HV: tl.constexpr,  # heads of v per head block
    TAIL_PAD: tl.constexpr,  # k's tail tile width (0: none)
    DV_PAD: tl.constexpr,  # Dv rounded up to a power of two
    HAS_POS: tl.constexpr,  # angles from table rows picked by positions (else row s)
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i+1) instead of halves (i, i + HALF)
    K_SCALED: tl.constexpr,  # k cache written divided by k's scale
    V_SCALED: tl.constexpr,  # v cache likewise
    PACK_Q: tl.constexpr,  # 0, or the bits of one pair of q moved as a word (aligned rows)
    PACK_K: tl.constexpr,  # likewise for k and its cache
    NORM_Q: tl.constexpr,  # q's RMSNorm: 0 none, 1 per head, 2 across heads (one block holds them)
    NORM_K: tl.constexpr,  # k's RMSNorm likewise
    TAIL_PAD_Q: tl.constexpr,  # q's normalized tail tile width (0: the tail stays as it is)
    HEAD_LOOP: tl.constexpr,  # one program per token walks all n_blocks head blocks
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the previous kernel first
):
    """Program (t, j): token t; head block j of q (rotated in place), then of k (rotated into its
    cache row), then of v (copied into its cache row). With HEAD_LOOP program t walks all of the
    token's blocks itself: its slot and angles are loaded once instead of once per block.

    HAS_POS False: token (b, s) takes row s of the table (positions = arange over the last token dim).
    """
    _pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = t // S
    s = t - b * S
    # int64 when loaded: the slot scales a cache stride
    slot = tl.load(slot_ptr + b * stride_slot_batch + s * stride_slot_token).to(tl.int64)
    if HEAD_LOOP:
        c, sn = _store_angles(
            tab_ptr,
            sin_off,
            pos_ptr,
            b,
            s,
            max_pos,
            stride_pos_batch,
            stride_pos_token,
            stride_angle_token,
            stride_angle_col,
            HALF,
            HALF_PAD,
            HAS_POS,
        )
        n_iter = n_blocks
    else:
        n_iter = 1
        blk = tl.program_id(1)  # int32-ok: a head-block index (< 65536), scaled only by constexpr block sizes
        if blk < n_q_blocks + n_k_blocks:
            c, sn = _store_angles(
                tab_ptr,
                sin_off,
                pos_ptr,
                b,
                s,
                max_pos,
                stride_pos_batch,
                stride_pos_token,
                stride_angle_token,
                stride_angle_col,
                HALF,
                HALF_PAD,
                HAS_POS,
            )
        else:
            c = tl.zeros([HALF_PAD], tl.float32)  # v's block: no angles
            sn = c
    for i in tl.range(0, n_iter):
        if HEAD_LOOP:
            blk = i
        else:
            blk = tl.program_id(1)  # int32-ok: as above
        _store_block(
            blk,
            b,
            s,
            c,
            sn,
            slot,
            q_ptr,
            k_ptr,
            v_ptr,
            kc_ptr,
            vc_ptr,
            k_scale_ptr,
            v_scale_ptr,
            tab_ptr,
            n_q_heads,
            n_k_heads,
            n_v_heads,
            k_tail,
            d_v,
            block_size,
            num_slots,
            n_q_blocks,
            n_k_blocks,
            stride_q_batch,
            stride_q_token,
            stride_q_head,
            stride_k_batch,
            stride_k_token,
            stride_k_head,
            stride_v_batch,
            stride_v_token,
            stride_v_head,
            stride_k_cache_block,
            stride_k_cache_slot,
            stride_k_cache_head,
            stride_v_cache_block,
            stride_v_cache_slot,
            stride_v_cache_head,
            q_tail,
            wq_ptr,
            wk_ptr,
            norm_eps,
            norm_offset,
            HALF,
            HALF_PAD,
            BLOCK_HQ,
            BLOCK_HK,
            BLOCK_HV,
            TAIL_PAD,
            DV_PAD,
            INTERLEAVED,
            K_SCALED,
            V_SCALED,
            PACK_Q,
            PACK_K,
            NORM_Q,
            NORM_K,
            TAIL_PAD_Q,
        )
