"""Re-rotation of cached keys by a position shift: the third entry point of the one kernel family.

RoPE rotations compose: a key rotated for position p, rotated again by the angle of `delta`, is the
key rotated for position p + delta. A negative delta is the inverse rotation by the angle of
|delta| (sin negated, as `INVERSE` does for the backward pass). So one table row per cache row is
enough, whatever the (unknown) stored position p.

The rotation math, the table lookup and the head loads/stores are the helpers of .rope
(`_angle_row`, `_load_heads`, `_rotate_store`); the slot addressing is the store kernel's: a slot s
names row (s // block_size, s % block_size) of a paged cache (num_blocks, block_size, H, D) with any
strides (a flat cache is block_size 1 with a zero in-block stride). Slots are widened to int64 when
loaded, so block * stride cannot wrap on caches past 2^31 elements.

Grid: axis 0 walks the N rows to re-rotate, axis 1 the head blocks of a row.
"""

import triton
import triton.language as tl

from .rope import _angle_row, _load_heads, _rotate_store


@triton.jit
def _slot_offset(slot, block_size, stride_block, stride_offset):
    """Element offset (int64) of the cache row a slot names; slot is int64."""
    cache_block = slot // block_size
    return cache_block * stride_block + (slot - cache_block * block_size) * stride_offset


# delta_value changes from call to call: not specialized, so a new shift never recompiles
@triton.jit(do_not_specialize=["delta_value"])
def rerotate_kernel(
    # pointers
    k_cache_ptr,            # the cache (or a view of it: MLA's rope part); read and written
    slots_ptr,              # (N,) int32/int64 source slots; < 0 = padding
    dst_slots_ptr,          # (N,) destination slots (read only when HAS_DST)
    delta_ptr,              # (N,) int32/int64 shifts (read only when not DELTA_SCALAR)
    table_ptr,              # [cos | sin] table, (max_position, rotary_dim); sin at table_ptr + sin_offset
    k_scale_ptr,            # float32 per-tensor scale (read only when SCALED)
    # sizes
    delta_value,            # the shift of every row when DELTA_SCALAR (a Python int; int64 when large)
    n_heads,                # H of the cache
    tail_len,               # head size - rotary_dim (copied to the destination when HAS_DST)
    max_position,           # rows of the table: |delta| must be below it
    sin_offset,             # element offset of the sin half from table_ptr
    block_size,             # slots per cache block (1 for a flat cache)
    num_slots,              # num_blocks * block_size: slots at or past it are skipped
    # strides (elements)
    stride_slots, stride_dst_slots, stride_delta,
    stride_table_row, stride_table_col,
    stride_k_cache_block,   # between cache blocks (between slots of a flat cache)
    stride_k_cache_offset,  # between slots of one block (0 for a flat cache)
    stride_k_cache_head,    # between heads of one slot
    # meta
    HALF: tl.constexpr,         # rotary_dim // 2
    HALF_PAD: tl.constexpr,     # HALF rounded up to a power of two
    BLOCK_H: tl.constexpr,      # heads per program
    TAIL_PAD: tl.constexpr,     # tail length rounded up to a power of two; 0 when nothing is copied
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i+1) instead of halves (i, i + HALF)
    HAS_DST: tl.constexpr,      # write into dst slots (the source rows stay untouched)
    DELTA_SCALAR: tl.constexpr, # one shift for all rows (delta_value) instead of a tensor
    SCALED: tl.constexpr,       # the cache holds value / k_scale (fp8): dequantize, rotate, quantize
    PACK: tl.constexpr,         # _load_heads / _rotate_store's PACK (0: element path)
):
    """Program (r, j): row r, heads [j * BLOCK_H, (j + 1) * BLOCK_H)."""
    r = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H  # int32-ok: a head index (< 65536 blocks), widened in the helpers
    # int64 before any arithmetic: slot * stride is the offset that passes 2^31 on big caches
    src = tl.load(slots_ptr + r * stride_slots).to(tl.int64)
    if HAS_DST:
        dst = tl.load(dst_slots_ptr + r * stride_dst_slots).to(tl.int64)
    else:
        dst = src
    # padding (< 0) and slots past the cache (an error the strict mode reports) write nothing
    if (src >= 0) & (src < num_slots) & (dst >= 0) & (dst < num_slots):
        # the row of |delta|, as a vector (all lanes one value): scalar-and-vector masks trip the
        # interpreter. A |delta| past the table reads nothing and rotates by NaN (loud, no sync).
        if DELTA_SCALAR:
            d = tl.zeros([HALF_PAD], tl.int64) + delta_value
        else:
            d = tl.zeros([HALF_PAD], tl.int64) + tl.load(delta_ptr + r * stride_delta).to(tl.int64)
        mag = tl.where(d < 0, -d, d)
        i = tl.arange(0, HALF_PAD)
        col = i.to(tl.int64) * stride_table_col
        ok = (i < HALF) & (mag >= 0) & (mag < max_position)     # mag < 0 only for -2^63
        c, sn = _angle_row(table_ptr, table_ptr + sin_offset, mag * stride_table_row, col, ok, float("nan"))
        # a negative shift is the inverse rotation: angle(-a) = (cos a, -sin a)
        sn = tl.where(d < 0, -sn, sn)

        src_base = k_cache_ptr + _slot_offset(src, block_size, stride_k_cache_block, stride_k_cache_offset)
        dst_base = k_cache_ptr + _slot_offset(dst, block_size, stride_k_cache_block, stride_k_cache_offset)
        x1, x2 = _load_heads(src_base, stride_k_cache_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H,
                             INTERLEAVED, PACK, "evict_first")
        if SCALED:
            # dequantize; _rotate_store divides by the same scale before its cast
            scale = tl.load(k_scale_ptr).to(tl.float32)
            x1 = x1 * scale
            x2 = x2 * scale
        # the tail goes through the raw copy below, not _rotate_store's (which would rescale it)
        _rotate_store(
            src_base, dst_base, stride_k_cache_head, stride_k_cache_head, n_heads, head0, 0,
            x1, x2, c, sn, k_scale_ptr,
            HALF, HALF_PAD, BLOCK_H, 0, INTERLEAVED, False, SCALED, PACK, x1, False,
        )
        if TAIL_PAD > 0:
            # into another row: the dims past rotary_dim move unchanged (same dtype: a bit copy)
            h = head0 + tl.arange(0, BLOCK_H)
            h_off = h.to(tl.int64)[:, None] * stride_k_cache_head + 2 * HALF
            j = tl.arange(0, TAIL_PAD)[None, :]
            m = (h[:, None] < n_heads) & (j < tail_len)
            t = tl.load(src_base + h_off + j, mask=m)
            tl.store(dst_base + h_off + j, t, mask=m)
