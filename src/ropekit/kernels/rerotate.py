"""Re-rotation of cached keys by a position shift: the third entry point of the one kernel family.

RoPE rotations compose: a key rotated for position p, rotated again by the angle of `delta`, is the
key rotated for position p + delta. A negative delta is the inverse rotation by the angle of
|delta| (sin negated, as `INVERSE` does for the backward pass). So one table row per cache row is
enough, whatever the (unknown) stored position p.

TWO_TABLES moves a row between tables (LongRoPE's short to long factors, a YaRN factor change):
the stored position p is given, and the row goes from the angle of table row p to that of
to_table row p + delta. Both rows are read and composed into one rotation, by angle(to) -
angle(from), its magnitude |to| / |from| (tables may fold an attention factor into cos / sin), so
the key is rounded once instead of once per table.

The slot addressing is the store kernel's: a slot s names row (s // block_size, s % block_size) of
a paged cache (num_blocks, block_size, H, D) with any strides (a flat cache is block_size 1 with a
zero in-block stride). Slots are widened to int64 when loaded, so block * stride cannot wrap on
caches past 2^31 elements.

Grid: axis 0 walks the N rows to re-rotate, ROWS at a time; axis 1 the head blocks of a row. A
program's ROWS x BLOCK_H (row, head) pairs are one flat tile: every row's slot, shift, table row
and cache row are loaded as vectors, so the four dependent loads of a row overlap with those of
the other rows (one row per program left W12's MLA case, 64 dims a row, latency-bound).
"""

import triton
import triton.language as tl

from ..language import compose_angles, load_pairs, rotate, slot_offset, store_pairs, tail_at


# delta_value changes from call to call: not specialized, so a new shift never recompiles
@triton.jit(do_not_specialize=["delta_value"])
def rerotate_kernel(
    # pointers
    k_cache_ptr,  # the cache (or a view of it: MLA's rope part); read and written
    slots_ptr,  # (N,) int32/int64 source slots; < 0 = padding
    dst_slots_ptr,  # (N,) destination slots (read only when TO_DST)
    delta_ptr,  # (N,) int32/int64 shifts (read only when not DELTA_SCALAR)
    table_ptr,  # [cos | sin] table, (max_position, rotary_dim); sin at table_ptr + sin_offset
    k_scale_ptr,  # float32 per-tensor scale (read only when K_SCALED)
    positions_ptr,  # (N,) int32/int64 stored positions: rows of table_ptr (read only when TWO_TABLES)
    to_table_ptr,  # [cos | sin] table the rows move to (read only when TWO_TABLES)
    # sizes
    delta_value,  # the shift of every row when DELTA_SCALAR (a Python int; int64 when large)
    n_heads,  # H of the cache
    tail_len,  # head size - rotary_dim (copied to the destination when TO_DST)
    max_position,  # rows of the table: |delta| (TWO_TABLES: the position) must be below it
    sin_offset,  # element offset of the sin half from table_ptr
    to_max_position,  # rows of to_table: position + delta must be below it (TWO_TABLES)
    to_sin_offset,  # element offset of the sin half from to_table_ptr
    block_size,  # slots per cache block (1 for a flat cache)
    num_slots,  # num_blocks * block_size: slots at or past it are skipped
    n_rows,  # N, the rows to re-rotate
    # strides (elements)
    stride_slots,  # between entries of slots
    stride_dst_slots,  # between entries of dst_slots
    stride_delta,  # between entries of delta
    stride_positions,  # between entries of positions
    stride_table_row,  # between table rows
    stride_table_col,  # between table columns
    stride_to_table_row,  # between to_table rows
    stride_to_table_col,  # between to_table columns
    stride_k_cache_block,  # between cache blocks (between slots of a flat cache)
    stride_k_cache_offset,  # between slots of one block (0 for a flat cache)
    stride_k_cache_head,  # between heads of one slot
    # meta
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    GAP: tl.constexpr,  # columns from a half-split pair's first member to its second: HALF, or D/2 (halves)
    BLOCK_H: tl.constexpr,  # heads per program
    ROWS: tl.constexpr,  # rows per program
    TAIL_PAD: tl.constexpr,  # tail length rounded up to a power of two; 0 when nothing is copied
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i+1) instead of halves (i, i + HALF)
    TO_DST: tl.constexpr,  # write into dst slots (the source rows stay untouched)
    DELTA_SCALAR: tl.constexpr,  # one shift for all rows (delta_value) instead of a tensor
    K_SCALED: tl.constexpr,  # the cache holds value / k_scale (fp8): dequantize, rotate, quantize
    TWO_TABLES: tl.constexpr,  # from table row positions[i] to to_table row positions[i] + delta[i]
):
    """Program (p, j): rows [p * ROWS, (p + 1) * ROWS), heads [j * BLOCK_H, (j + 1) * BLOCK_H)."""
    m = tl.arange(0, ROWS * BLOCK_H)  # a flat tile of (row, head) pairs
    # int64 before any arithmetic: row and slot products with strides pass 2^31 on big caches
    row = tl.program_id(0).to(tl.int64) * ROWS + m // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + m % BLOCK_H  # int32-ok: a head index, widened before its stride
    in_rows = row < n_rows
    # index loads without masks: lanes past the last row read row 0 (always there) and are dropped
    safe_row = tl.where(in_rows, row, 0)
    src = tl.where(in_rows, tl.load(slots_ptr + safe_row * stride_slots).to(tl.int64), -1)
    if TO_DST:
        dst = tl.where(in_rows, tl.load(dst_slots_ptr + safe_row * stride_dst_slots).to(tl.int64), -1)
    else:
        dst = src
    # padding (< 0) and slots past the cache (an error the strict mode reports) write nothing
    live = in_rows & (head < n_heads) & (src >= 0) & (src < num_slots) & (dst >= 0) & (dst < num_slots)
    if DELTA_SCALAR:
        d = tl.zeros([ROWS * BLOCK_H], tl.int64) + delta_value
    else:
        # dead lanes keep row 0's shift: every use of d below is masked by live
        d = tl.load(delta_ptr + safe_row * stride_delta).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    fmask = live[:, None] & (i < HALF)
    col = i.to(tl.int64)
    if TWO_TABLES:
        # dead lanes read row 0's position: every use below is masked by live
        p = tl.load(positions_ptr + safe_row * stride_positions).to(tl.int64)
        # p + d bounded without forming it first (no int64 wrap); a row outside either table
        # reads nothing and rotates by NaN (loud, no sync)
        row_ok = live & (p >= 0) & (p < max_position) & (d >= -p) & (d < to_max_position - p)
        amask = row_ok[:, None] & (i < HALF)
        f_row = table_ptr + (p * stride_table_row)[:, None] + col * stride_table_col
        t_row = to_table_ptr + ((p + d) * stride_to_table_row)[:, None] + col * stride_to_table_col
        cf = tl.load(f_row, mask=amask, other=float("nan"), eviction_policy="evict_last").to(tl.float32)
        sf = tl.load(f_row + sin_offset, mask=amask, other=float("nan"), eviction_policy="evict_last").to(tl.float32)
        ct = tl.load(t_row, mask=amask, other=float("nan"), eviction_policy="evict_last").to(tl.float32)
        st = tl.load(t_row + to_sin_offset, mask=amask, other=float("nan"), eviction_policy="evict_last").to(tl.float32)
        # undo the from-row (its conjugate over its squared magnitude), then the to-row: one
        # rotation by angle(to) - angle(from), scaled by |to| / |from|
        c, sn = compose_angles(cf, sf, ct, st)
    else:
        mag = tl.where(d < 0, -d, d)
        # a |delta| past the table reads nothing and rotates by NaN (loud, no sync); mag < 0 only for -2^63
        row_ok = live & (mag >= 0) & (mag < max_position)
        amask = row_ok[:, None] & (i < HALF)
        t_row = table_ptr + (mag * stride_table_row)[:, None] + col * stride_table_col
        c = tl.load(t_row, mask=amask, other=float("nan"), eviction_policy="evict_last").to(tl.float32)
        sn = tl.load(t_row + sin_offset, mask=amask, other=float("nan"), eviction_policy="evict_last").to(tl.float32)
        # a negative shift is the inverse rotation: angle(-a) = (cos a, -sin a)
        sn = tl.where((d < 0)[:, None], -sn, sn)

    head_off = head.to(tl.int64) * stride_k_cache_head
    src_row = k_cache_ptr + (slot_offset(src, block_size, stride_k_cache_block, stride_k_cache_offset) + head_off)
    dst_row = k_cache_ptr + (slot_offset(dst, block_size, stride_k_cache_block, stride_k_cache_offset) + head_off)
    src_row = tl.where(live, src_row, k_cache_ptr)[:, None]  # masked-off lanes point at the base (never read)
    dst_row = tl.where(live, dst_row, k_cache_ptr)[:, None]
    x1, x2 = load_pairs(src_row, i, fmask, INTERLEAVED, 0, "", GAP)
    if K_SCALED:
        # dequantize, rotate in float32, quantize back with the same scale: times its reciprocal,
        # one division a program instead of one an element (the store's fp8 path does the same)
        scale = tl.load(k_scale_ptr).to(tl.float32)
        x1 = x1 * scale
        x2 = x2 * scale
    o1, o2 = rotate(x1, x2, c, sn, False)
    if K_SCALED:
        inv = 1.0 / scale
        o1 = o1 * inv
        o2 = o2 * inv
    store_pairs(dst_row, i, fmask, o1, o2, INTERLEAVED, 0, GAP)
    if TAIL_PAD > 0:
        # into another row: the dims no pair holds move unchanged (same dtype: a bit copy)
        j = tl.arange(0, TAIL_PAD)[None, :]
        mt = live[:, None] & (j < tail_len)
        t = tl.load(tail_at(src_row, j, HALF, GAP), mask=mt)
        tl.store(tail_at(dst_row, j, HALF, GAP), t, mask=mt)
