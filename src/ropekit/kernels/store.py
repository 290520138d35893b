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

from .rope import _load_angles, _rotate_heads


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
def rope_store_kernel(
    # pointers; tab_ptr is the [cos | sin] table (sin at tab_ptr + sin_off)
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    tab_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    # sizes
    S,
    n_q_heads,
    n_k_heads,
    n_v_heads,
    k_tail,
    d_v,
    max_pos,
    sin_off,
    block_size,
    num_slots,
    n_q_blocks,
    n_k_blocks,
    # strides (elements); token dims are (b, s); b's stride is 0 for a single token dim
    stride_q_batch,
    stride_q_token,
    stride_q_head,
    stride_k_batch,
    stride_k_token,
    stride_k_head,
    stride_v_batch,
    stride_v_token,
    stride_v_head,
    stride_pos_batch,
    stride_pos_token,
    stride_angle_token,
    stride_angle_col,
    stride_slot_batch,
    stride_slot_token,
    stride_k_cache_block,
    stride_k_cache_slot,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_slot,
    stride_v_cache_head,
    # q/k RMSNorm (read only when NORM_Q / NORM_K): q's tail length (normalized and written in place),
    # the weights (D,) or (H*D,), unit stride; eps; the constant added to the weight (Gemma: 1.0)
    q_tail,
    wq_ptr,
    wk_ptr,
    norm_eps,
    norm_offset,
    # meta
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
    PACK_Q: tl.constexpr,
    PACK_K: tl.constexpr,
    NORM_Q: tl.constexpr,
    NORM_K: tl.constexpr,
    TAIL_PAD_Q: tl.constexpr,
):
    """Program (t, j): token t; head block j of q (rotated in place), then of k (rotated into its
    cache row), then of v (copied into its cache row).

    HAS_POS False: token (b, s) takes row s of the table (positions = arange over the last token dim).
    PACK_Q / PACK_K: _rotate_heads' PACK for q, and for k and its cache (0: element path).
    NORM_Q / NORM_K: RMSNorm of q / k before the rotation (0 none, 1 per head, 2 across heads, when
    BLOCK_HQ / BLOCK_HK cover all heads); TAIL_PAD_Q > 0 then rewrites q's normalized tail in place.
    """
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)  # int32-ok: a head-block index (< 65536), scaled only by constexpr block sizes
    b = t // S
    s = t - b * S
    # int64 before any arithmetic: block * stride is the offset that passes 2^31 on big caches
    slot = tl.load(slot_ptr + b * stride_slot_batch + s * stride_slot_token).to(tl.int64)
    store = (slot >= 0) & (slot < num_slots)
    cache_blk = slot // block_size
    cache_off = slot - cache_blk * block_size

    if blk < n_q_blocks + n_k_blocks:
        c, sn = _load_angles(
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
        )
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
        elif store:
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
