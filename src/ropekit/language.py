"""ropekit.language: the device functions ropekit's kernels are built from, for kernels of your own.

Every public name here is a `@triton.jit` function, called from inside a Triton kernel (or another
jit function). ropekit's own kernels (`ropekit.kernels`) are written with exactly these functions,
so every test of ropekit exercises them. What they cover:

    angles        load_angles (a token's cos / sin from any of ropekit's sources), table_angles (one
                  row of a [cos | sin] table), freq_cos_sin / freq_angles (positions x inverse
                  frequencies, computed in float32), mrope_section / axial_axis (which position row
                  drives frequency i), packed_position (a token's position from cu_seqlens),
                  compose_angles (the rotation from one angle to another, magnitudes folded in)
    rotation      rotate (a pair tile by an angle, or by minus it)
    pair layouts  load_pairs / store_pairs (rows in registers: half-split (i, GAP + i), interleaved
                  (2i, 2i+1)), load_heads / store_heads / load_tiles (a token's heads), pair_columns,
                  tail_at / load_tail / store_tail (the kept dims of a partial rotary), saturate
    offsets       split_token / program_token / token_offset / head_rows / head_mask / split_slot /
                  slot_offset: every offset that scales an index by a stride, computed in int64;
                  column_offset (columns of a head of any last-dim stride, the pair and tail
                  helpers' trailing stride_col)
    launch        pdl_prologue (programmatic dependent launch)

Conventions. A *pair tile* is two float32 register tiles (x1, x2) of the same shape, usually
(BLOCK_H, HALF_PAD): row r is a head, column i the i-th rotated pair, x1 its first member and x2
its second. HALF is the number of rotated pairs (rotary_dim // 2), HALF_PAD HALF rounded up to a
power of two (lanes i >= HALF are masked off). Pair layouts: half-split, pairs (i, GAP + i) with
GAP = HALF (Llama / NeoX) or GAP = D/2 (Gemma 4's p-RoPE: the pairs (i, i + D/2), i < HALF, of a
whole head); interleaved, pairs (2i, 2i+1) (GPT-J, Llama 4, DeepSeek). The dims no pair holds
(the *tail* of a partial rotary) are found by tail_at. Angles (c, sn) are float32 vectors of
HALF_PAD: cos and sin of frequency i. All arithmetic is float32 whatever the tensors' dtype;
values are converted once, when loaded and when stored.

64-bit rule: every offset that scales a program id, a token, a head, a slot or a position by a
stride is computed in int64. The helpers widen their indices with `.to(tl.int64)` before any
product, so no offset can wrap at 2^31 whatever the tensor size; only in-block column offsets
(`tl.arange` up to the head size) stay int32 at a unit column stride; at any other column stride
column_offset widens them before the product. Keep to this in your own code: a token index from
split_token / program_token is int64 already. `python -m ropekit.audit FILE` checks a kernel file
statically.

Stability: the public names (those above, the module's __all__) and the order and meaning of their arguments are stable. Changes are
additions only: new functions, and new trailing arguments with a default; a function is never
renamed or removed and its existing arguments keep their order and meaning. Names with a leading
underscore are not part of the module's interface.
"""

import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper and later); older Tritons lack the intrinsics
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - the launcher never sets PDL there

    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch_dependents():
        pass


__all__ = [
    "axial_axis",
    "column_offset",
    "compose_angles",
    "freq_angles",
    "freq_cos_sin",
    "head_mask",
    "head_rows",
    "load_angles",
    "load_heads",
    "load_pairs",
    "load_tail",
    "load_tiles",
    "mrope_axis_rows",
    "mrope_section",
    "packed_position",
    "pair_columns",
    "pdl_prologue",
    "program_token",
    "rotate",
    "saturate",
    "slot_offset",
    "split_slot",
    "split_token",
    "store_heads",
    "store_pairs",
    "store_tail",
    "table_angles",
    "tail_at",
    "token_offset",
]


# --- offsets (int64) ---------------------------------------------------------------------------


@triton.jit
def split_token(t, S):
    """(b, s) of flat token t over token dims (B, S): b = t // S, s = t - b * S. t: an int64 scalar
    (from program_token, or `tl.program_id(0).to(tl.int64)`); b and s are int64 too, ready to scale
    strides. With one token dim (T,), S = T: b = 0, s = t."""
    b = t // S
    s = t - b * S
    return b, s


@triton.jit
def program_token(S):
    """(t, b, s): the token of a one-token-per-program grid (axis 0 walks tokens, up to 2^31 - 1),
    widened to int64 before anything scales it, and its (b, s) (split_token)."""
    t = tl.program_id(0).to(tl.int64)
    b, s = split_token(t, S)
    return t, b, s


@triton.jit
def token_offset(b, s, stride_batch, stride_token):
    """Element offset of token (b, s): b * stride_batch + s * stride_token. b, s: int64 (split_token),
    so the offset is int64; stride_batch is 0 with one token dim. Add it to a tensor's pointer in one
    group, `x_ptr + token_offset(...)`, to get the token's first element."""
    return b * stride_batch + s * stride_token


@triton.jit
def head_rows(x_base, stride_head, head0, BLOCK_H: tl.constexpr):
    """Heads [head0, head0 + BLOCK_H) of one token: the (BLOCK_H, 1) pointers to each head's first
    element (x_base: the token's first element, a pointer or an int64 offset), head indices widened
    to int64 before they scale the stride. head_mask gives which of them exist."""
    h = head0 + tl.arange(0, BLOCK_H)
    return x_base + h.to(tl.int64)[:, None] * stride_head


@triton.jit
def column_offset(c, stride_col=1):
    """Element offset of in-head columns c (int32 tiles, e.g. tl.arange(0, HALF_PAD)[None, :], or a
    constexpr) in a head whose columns are stride_col elements apart (the tensor's last-dim
    stride). stride_col a constexpr 1 (the default, a literal 1, or an int kernel argument equal to
    1, which Triton specializes to a constexpr): c itself, the unit-stride code. Any other stride
    (a runtime scalar): c times the stride widened to int64 first, an int64 offset (a column index
    times a large stride can pass 2^31). Add a sum of columns term by term, `row +
    column_offset(GAP, s) + column_offset(i, s)`: at unit stride that is `row + GAP + i`, the same
    code as without it. The pair and tail helpers take it as their trailing stride_col."""
    if isinstance(stride_col, tl.tensor):
        return stride_col.to(tl.int64) * c
    elif stride_col == 1:
        return c
    else:
        return tl.full([], stride_col, tl.int64) * c


@triton.jit
def head_mask(n_heads, head0, BLOCK_H: tl.constexpr):
    """The (BLOCK_H, 1) mask of heads [head0, head0 + BLOCK_H) below n_heads (head_rows' rows)."""
    h = head0 + tl.arange(0, BLOCK_H)
    return h[:, None] < n_heads


@triton.jit
def split_slot(slot, block_size):
    """(block, row): where cache slot `slot` (int64, e.g. a slot mapping's entry loaded and widened
    with .to(tl.int64)) sits in a paged cache (num_blocks, block_size, ...): block slot //
    block_size, row slot % block_size of that block (int64 both). A flat cache (num_slots, ...) is
    block_size 1."""
    cache_block = slot // block_size
    return cache_block, slot - cache_block * block_size


@triton.jit
def slot_offset(slot, block_size, stride_block, stride_slot):
    """Element offset (int64) of the row that cache slot `slot` (int64) names in a paged cache with
    strides stride_block between blocks and stride_slot between a block's rows (split_slot); a flat
    cache is block_size 1 with stride_slot 0."""
    cache_block = slot // block_size
    return cache_block * stride_block + (slot - cache_block * block_size) * stride_slot


# --- angles ------------------------------------------------------------------------------------


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
def mrope_section(i, SEC_T, SEC_H, SEC_W, MROPE: tl.constexpr):
    """M-RoPE: which position row (0 temporal, 1 height, 2 width) drives frequency i (an int32
    vector, e.g. tl.arange(0, HALF_PAD)). MROPE 1: chunked sections (Qwen2-VL), frequencies [0,
    SEC_T) temporal, [SEC_T, SEC_T + SEC_H) height, the rest width. MROPE 2: interleaved (Qwen3-VL),
    frequencies 1, 4, 7, ... < 3 * SEC_H height, 2, 5, 8, ... < 3 * SEC_W width, the rest temporal."""
    if MROPE == 1:
        sec = (i >= SEC_T).to(tl.int32) + (i >= SEC_T + SEC_H).to(tl.int32)
    else:
        sec = tl.where((i % 3 == 1) & (i < 3 * SEC_H), 1, tl.where((i % 3 == 2) & (i < 3 * SEC_W), 2, 0))
    return sec


@triton.jit
def axial_axis(i, SEC_T, SEC_H, SEC_W):
    """Axial N-D RoPE: the axis (0 to 3, int64) whose position drives frequency i (an int32 vector):
    the first three axes hold SEC_T, SEC_H, SEC_W frequencies, the fourth the rest (the section of
    an absent axis is 0)."""
    return (i >= SEC_T).to(tl.int64) + (i >= SEC_T + SEC_H).to(tl.int64) + (i >= SEC_T + SEC_H + SEC_W).to(tl.int64)


@triton.jit
def table_angles(cos_ptr, sin_ptr, row, col, mask, other):
    """cos and sin at one table row, float32 vectors shaped like col: cos at cos_ptr + row + col,
    sin at sin_ptr + row + col (row: the row's int64 element offset, e.g. position * row stride;
    col: the frequencies' offsets in the row). Lanes off `mask` read nothing and give `other` (NaN
    for a position out of the table). A [cos | sin] table of rotary_dim columns is
    sin_ptr = cos_ptr + rotary_dim // 2. The table's values are used as they are: an attention
    factor (YaRN's, LongRoPE's mscale) folded into the table scales the rotation."""
    c = tl.load(cos_ptr + row + col, mask=mask, other=other, eviction_policy="evict_last").to(tl.float32)
    sn = tl.load(sin_ptr + row + col, mask=mask, other=other, eviction_policy="evict_last").to(tl.float32)
    return c, sn


@triton.jit
def freq_cos_sin(p, f):
    """cos and sin of the angle p * f, float32 vectors from float32 vectors p (positions) and f
    (inverse frequencies, scaling already applied to them), without the product's rounding error:
    with a = fl(p * f), e = fma(p, f, -a) is exact (p * f == a + e), and cos / sin of a + e follow
    from those of a and of the small e by the angle-sum formulas. The result is then as accurate as
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
def freq_angles(freq_ptr, pos_tok, stride_pos_row, col, fmask, SEC_T, SEC_H, SEC_W, HALF_PAD: tl.constexpr):
    """cos and sin (float32 vectors of HALF_PAD) of one token computed in float32 from its
    positions and the inverse frequencies: frequency i takes the position of axis axial_axis(i) at
    pos_tok + axis * stride_pos_row (int or float positions, converted to float32; one axis: SEC_T
    = HALF, the others 0) and the inverse frequency at freq_ptr + col[i] (float32); lanes off fmask
    read nothing (angle 0). freq_cos_sin computes the angles."""
    i = tl.arange(0, HALF_PAD)
    axis = axial_axis(i, SEC_T, SEC_H, SEC_W)
    p = tl.load(pos_tok + axis * stride_pos_row, mask=fmask, other=0).to(tl.float32)
    f = tl.load(freq_ptr + col, mask=fmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return freq_cos_sin(p, f)


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
    """cos and sin of token (b, s) (int64), float32 vectors of HALF_PAD (NaN where the position is
    out of the table).

    src: the angle operands as one group, ((pos_ptr, stride_pos_row, stride_pos_batch,
    stride_pos_token), (cos_ptr, sin_ptr, max_pos), (stride_angle_row, stride_angle_batch,
    stride_angle_token, stride_angle_col), (SEC_T, SEC_H, SEC_W, n_seqs, cp_size, cp_rank)); unused
    members may be any value of their kind (0, or a pointer never read).

    Sources: HAS_POS, rows of a (max_pos, .) table (cos at cos_ptr, sin at sin_ptr, row stride
    stride_angle_token, column stride stride_angle_col) picked by the token's position at
    pos_ptr + b * stride_pos_batch + s * stride_pos_token (PACKED: derived from cu_seqlens at
    pos_ptr, packed_position); a position outside [0, max_pos) reads nothing and gives NaN.
    FREQS: computed from positions and the inverse frequencies at cos_ptr (freq_angles; SEC_T /
    SEC_H / SEC_W the axis sections). Neither: per-token cos / sin rows at b * stride_angle_batch +
    s * stride_angle_token. MROPE 1 or 2: three position rows (stride_pos_row, or stride_angle_row
    for per-token rows apart), frequency i from row mrope_section(i). MROPE 3: any number of
    position rows, frequency i from row axis_map[i], the int32 map at SEC_T (mrope_axis_rows).

    M-RoPE 1 / 2 reads, from each of the three positions' rows, only the frequencies of that row's
    section (masked vector loads: a third of the table traffic of whole rows) and merges them with
    selects: a per-frequency gather would not vectorize. MROPE 3 gathers (one table row per
    frequency): its rows are not known at compile time.
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
    if MROPE == 1 or MROPE == 2:
        sec = mrope_section(i, SEC_T, SEC_H, SEC_W, MROPE)
        m0, m1, m2 = fmask & (sec == 0), fmask & (sec == 1), fmask & (sec == 2)
    else:
        m0, m1, m2 = fmask, fmask, fmask
    if MROPE == 3:
        c, sn = mrope_axis_rows(src, b, s, i, col, fmask, HAS_POS)
    elif FREQS:
        pos_tok = pos_ptr + token_offset(b, s, stride_pos_batch, stride_pos_token)
        c, sn = freq_angles(cos_ptr, pos_tok, stride_pos_row, col, fmask, SEC_T, SEC_H, SEC_W, HALF_PAD)
    elif HAS_POS:
        pos_tok = pos_ptr + token_offset(b, s, stride_pos_batch, stride_pos_token)
        # positions as vectors (all lanes one value): scalar-and-vector masks trip the interpreter.
        # A bad position must never address memory: its loads are masked off and yield NaN.
        if PACKED:
            # packed tokens (T,): s is the token index into cu_seqlens' tokens
            p0 = packed_position(pos_ptr, n_seqs, s, cp_size, cp_rank, SEARCH_STRIDE, SEARCH_COARSE) + tl.zeros(
                [HALF_PAD], tl.int64
            )
        else:
            p0 = tl.load(pos_tok).to(tl.int64) + tl.zeros([HALF_PAD], tl.int64)
        c, sn = table_angles(cos_ptr, sin_ptr, p0 * stride_angle_token, col, m0 & (p0 >= 0) & (p0 < max_pos), nan)
        if MROPE == 1 or MROPE == 2:
            p1 = tl.load(pos_tok + stride_pos_row).to(tl.int64) + tl.zeros([HALF_PAD], tl.int64)
            p2 = tl.load(pos_tok + 2 * stride_pos_row).to(tl.int64) + tl.zeros([HALF_PAD], tl.int64)
            c1, s1 = table_angles(cos_ptr, sin_ptr, p1 * stride_angle_token, col, m1 & (p1 >= 0) & (p1 < max_pos), nan)
            c2, s2 = table_angles(cos_ptr, sin_ptr, p2 * stride_angle_token, col, m2 & (p2 >= 0) & (p2 < max_pos), nan)
            c = tl.where(sec == 0, c, tl.where(sec == 1, c1, c2))
            sn = tl.where(sec == 0, sn, tl.where(sec == 1, s1, s2))
    else:
        row = token_offset(b, s, stride_angle_batch, stride_angle_token)
        c, sn = table_angles(cos_ptr, sin_ptr, row, col, m0, 0.0)
        if MROPE == 1 or MROPE == 2:
            c1, s1 = table_angles(cos_ptr, sin_ptr, row + stride_angle_row, col, m1, 0.0)
            c2, s2 = table_angles(cos_ptr, sin_ptr, row + 2 * stride_angle_row, col, m2, 0.0)
            c = tl.where(sec == 0, c, tl.where(sec == 1, c1, c2))
            sn = tl.where(sec == 0, sn, tl.where(sec == 1, s1, s2))
    return c, sn


@triton.jit
def mrope_axis_rows(src, b, s, i, col, fmask, HAS_POS: tl.constexpr):
    """M-RoPE by an axis map (load_angles' MROPE 3): cos and sin of token (b, s), float32 vectors
    like i (the frequencies, tl.arange(0, HALF_PAD)), frequency i from position row axis_map[i]
    (int32 at SEC_T, one entry per frequency; any number of rows). HAS_POS: table rows at each
    frequency's position (NaN off the table); else per-token rows, row a at stride_angle_row * a.
    src, col, fmask as load_angles has them."""
    pos, tab, strides, rows = src
    pos_ptr, stride_pos_row, stride_pos_batch, stride_pos_token = pos
    cos_ptr, sin_ptr, max_pos = tab
    stride_angle_row, stride_angle_batch, stride_angle_token, stride_angle_col = strides
    axis = tl.load(rows[0] + i, mask=fmask, other=0).to(tl.int64)
    if HAS_POS:
        pos_tok = pos_ptr + token_offset(b, s, stride_pos_batch, stride_pos_token)
        p = tl.load(pos_tok + axis * stride_pos_row, mask=fmask, other=0).to(tl.int64)
        c, sn = table_angles(
            cos_ptr, sin_ptr, p * stride_angle_token, col, fmask & (p >= 0) & (p < max_pos), float("nan")
        )
    else:
        row = token_offset(b, s, stride_angle_batch, stride_angle_token) + axis * stride_angle_row
        c, sn = table_angles(cos_ptr, sin_ptr, row, col, fmask, 0.0)
    return c, sn


@triton.jit
def compose_angles(c_from, s_from, c_to, s_to):
    """(c, sn), the one rotation that takes a vector rotated by the angle (c_from, s_from) to the
    same vector rotated by (c_to, s_to) (float32 tiles or vectors, any matching shapes): the angle
    to - from, scaled by |to| / |from|, so that tables which fold an attention factor into cos / sin
    (YaRN, LongRoPE) move a vector from one scale to the other too. Applied with rotate, the vector
    is rounded once instead of once per table. One division a pair: the reciprocal of |from|^2."""
    inv = 1.0 / (c_from * c_from + s_from * s_from)
    c = (c_to * c_from + s_to * s_from) * inv
    sn = (s_to * c_from - c_to * s_from) * inv
    return c, sn


# --- rotation ----------------------------------------------------------------------------------


@triton.jit
def rotate(x1, x2, c, sn, INVERSE: tl.constexpr):
    """The pair tile (x1, x2) rotated by the angles (c, sn), float32 tiles:
    (x1 * c - x2 * sn, x2 * c + x1 * sn). INVERSE: rotated by minus the angles (the transpose,
    RoPE's backward), (x1 * c + x2 * sn, x2 * c - x1 * sn). c and sn broadcast against x1: a
    (HALF_PAD,) angle vector becomes (1, HALF_PAD) with c[None, :] for a (BLOCK_H, HALF_PAD) tile.
    The pair layout does not matter here: it is how the tile was loaded (load_pairs)."""
    if INVERSE:
        return x1 * c + x2 * sn, x2 * c - x1 * sn
    else:
        return x1 * c - x2 * sn, x2 * c + x1 * sn


# --- pair layouts: rows in and out of registers -----------------------------------------------


@triton.jit
def pair_columns(i, INTERLEAVED: tl.constexpr, GAP: tl.constexpr):
    """Columns (within a head) of the first and second members of pair i: (2i, 2i + 1) interleaved,
    (i, GAP + i) half-split (GAP: HALF, or D/2 for p-RoPE's halves)."""
    if INTERLEAVED:
        return 2 * i, 2 * i + 1
    else:
        return i, GAP + i


@triton.jit
def tail_at(row, j, HALF: tl.constexpr, GAP: tl.constexpr, stride_col=1):
    """Where tail element j (the j-th dim no rotated pair holds, a partial rotary's kept dims) of
    the head at `row` (a pointer, or an offset) sits. Partners HALF apart: past the pairs, row +
    2 * HALF + j. Partners GAP = D/2 apart (p-RoPE's halves): [HALF, GAP), then [GAP + HALF, 2 * GAP).
    stride_col: the head's column stride (column_offset; default 1, unit stride)."""
    if GAP == HALF:
        return row + column_offset(2 * HALF, stride_col) + column_offset(j, stride_col)
    else:
        at = row + column_offset(HALF, stride_col) + column_offset(j, stride_col)
        return at + column_offset(tl.where(j >= GAP - HALF, HALF, 0), stride_col)


@triton.jit
def _load_words(row_ptr, i, m, ELEM: tl.constexpr, PACK: tl.constexpr, EVICT: tl.constexpr):
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
def _store_words(row_ptr, i, m, o1, o2, ELEM: tl.constexpr, PACK: tl.constexpr):
    """The inverse of _load_words: (o1[i], o2[i]) packed into one word and stored."""
    if PACK == 32:
        lo = o1.to(ELEM).to(tl.uint16, bitcast=True).to(tl.uint32)
        hi = o2.to(ELEM).to(tl.uint16, bitcast=True).to(tl.uint32)
        tl.store(row_ptr.to(tl.pointer_type(tl.uint32)) + i, lo | (hi << 16), mask=m)
    else:
        lo = o1.to(ELEM).to(tl.uint32, bitcast=True).to(tl.uint64)
        hi = o2.to(ELEM).to(tl.uint32, bitcast=True).to(tl.uint64)
        tl.store(row_ptr.to(tl.pointer_type(tl.uint64)) + i, lo | (hi << 32), mask=m)


@triton.jit
def load_pairs(
    rows, i, m, INTERLEAVED: tl.constexpr, PACK: tl.constexpr, EVICT: tl.constexpr, GAP: tl.constexpr, stride_col=1
):
    """The pair tile (x1, x2) of some rows, float32 tiles of m's shape. rows: (R, 1) pointers to
    each row's first element (head_rows); i: the (1, HALF_PAD) pair indices, tl.arange(0,
    HALF_PAD)[None, :]; m: the (R, HALF_PAD) mask (live rows, i < HALF). INTERLEAVED: pairs (2i,
    2i+1), read as one contiguous (R, HALF_PAD, 2) load split in registers, or with PACK (32 for
    16-bit, 64 for 32-bit elements; rows 4- or 8-byte aligned) as one word per pair; else pairs
    (i, GAP + i). EVICT: the loads' eviction policy ("" for none). stride_col: the rows' column
    stride (column_offset; default 1): another stride reads element by element (PACK must be 0)."""
    if INTERLEAVED and PACK != 0:
        x1, x2 = _load_words(rows, i, m, rows.dtype.element_ty, PACK, EVICT)
    elif INTERLEAVED:
        pair = tl.arange(0, 2)[None, None, :]
        at = rows[:, :, None] + column_offset(2 * i[:, :, None], stride_col) + column_offset(pair, stride_col)
        x = tl.load(at, mask=m[:, :, None]).to(tl.float32)
        x1, x2 = tl.split(x)
    else:
        cols = column_offset(i, stride_col)
        x1 = tl.load(rows + cols, mask=m, eviction_policy=EVICT).to(tl.float32)
        x2 = tl.load(rows + column_offset(GAP, stride_col) + cols, mask=m, eviction_policy=EVICT).to(tl.float32)
    return x1, x2


@triton.jit
def store_pairs(rows, i, m, o1, o2, INTERLEAVED: tl.constexpr, PACK: tl.constexpr, GAP: tl.constexpr, stride_col=1):
    """Store the pair tile (o1, o2) (float32) into some rows, in their element type: the inverse of
    load_pairs, the same rows, i, m, layout, PACK and stride_col."""
    out_ty = rows.dtype.element_ty
    if INTERLEAVED and PACK != 0:
        _store_words(rows, i, m, o1, o2, out_ty, PACK)
    elif INTERLEAVED:
        pair = tl.arange(0, 2)[None, None, :]
        o = tl.join(o1, o2).to(out_ty)
        at = rows[:, :, None] + column_offset(2 * i[:, :, None], stride_col) + column_offset(pair, stride_col)
        tl.store(at, o, mask=m[:, :, None])
    else:
        cols = column_offset(i, stride_col)
        tl.store(rows + cols, o1.to(out_ty), mask=m)
        tl.store(rows + column_offset(GAP, stride_col) + cols, o2.to(out_ty), mask=m)


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
    stride_col=1,
):
    """x1, x2 (float32, (BLOCK_H, HALF_PAD)): the pair tile of heads [head0, head0 + BLOCK_H) of
    one token (x_base: its first element; heads at or past n_heads, and lanes i >= HALF, masked
    off). Layout, PACK, EVICT and stride_col: load_pairs'."""
    rows = head_rows(x_base, stride_x_head, head0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)[None, :]
    m = head_mask(n_heads, head0, BLOCK_H) & (i < HALF)
    return load_pairs(rows, i, m, INTERLEAVED, PACK, EVICT, GAP, stride_col)


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
    stride_col=1,
):
    """load_heads of a head block held in up to three tiles, every load issued before any is used:
    (x1, x2) of BLOCK_H heads from head0, (y1, y2) of BLOCK_H2 heads after them, (z1, z2) of BLOCK_H3
    after those. A tile of 0 heads is absent: its pair is (x1, x2) again, never used.
    at: (x_base, stride_x_head, n_heads, head0), the token's first element, the head stride, the
    heads and the block's first head. stride_col: the column stride (load_pairs')."""
    x_base, stride_x_head, n_heads, head0 = at
    x1, x2 = load_heads(
        x_base, stride_x_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, PACK, "", GAP, stride_col
    )
    y1, y2 = x1, x2
    z1, z2 = x1, x2
    if BLOCK_H2 > 0:
        head2 = head0 + BLOCK_H
        y1, y2 = load_heads(
            x_base, stride_x_head, n_heads, head2, HALF, HALF_PAD, BLOCK_H2, INTERLEAVED, PACK, "", GAP, stride_col
        )
    if BLOCK_H3 > 0:
        head3 = head0 + BLOCK_H + BLOCK_H2
        z1, z2 = load_heads(
            x_base, stride_x_head, n_heads, head3, HALF, HALF_PAD, BLOCK_H3, INTERLEAVED, PACK, "", GAP, stride_col
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
    stride_col=1,
):
    """Store the pair tile (o1, o2) (float32, (BLOCK_H, HALF_PAD)) as the rotated dims of heads
    [head0, head0 + BLOCK_H) of one token, in o's element type (o_base: the token's first
    element). Layout, PACK and stride_col: store_pairs'."""
    rows = head_rows(o_base, stride_o_head, head0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)[None, :]
    m = head_mask(n_heads, head0, BLOCK_H) & (i < HALF)
    store_pairs(rows, i, m, o1, o2, OUT_INTERLEAVED, PACK, GAP, stride_col)


@triton.jit
def load_tail(
    x_base,
    stride_x_head,
    n_heads,
    head0,
    tail_len,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    GAP: tl.constexpr,
    stride_col=1,
):
    """The tail_len dims no rotated pair holds (tail_at) of heads [head0, head0 + BLOCK_H) of one
    token: a float32 (BLOCK_H, TAIL_PAD) tile, 0 where masked (TAIL_PAD: tail_len rounded up to a
    power of two). stride_col: the column stride (tail_at's)."""
    live = head_mask(n_heads, head0, BLOCK_H)
    j = tl.arange(0, TAIL_PAD)[None, :]
    mt = live & (j < tail_len)
    rows = head_rows(x_base, stride_x_head, head0, BLOCK_H)
    return tl.load(tail_at(rows, j, HALF, GAP, stride_col), mask=mt, other=0.0).to(tl.float32)


@triton.jit
def store_tail(
    o_base,
    stride_o_head,
    n_heads,
    head0,
    tail_len,
    t,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    GAP: tl.constexpr,
    stride_col=1,
):
    """Store the (BLOCK_H, TAIL_PAD) tile t as the tail (tail_at) of heads [head0, head0 + BLOCK_H)
    of one token, in o's element type: the inverse of load_tail (the same stride_col). A partial
    rotary writing out of place copies its tail with load_tail (or a plain load) and store_tail."""
    live = head_mask(n_heads, head0, BLOCK_H)
    j = tl.arange(0, TAIL_PAD)[None, :]
    mt = live & (j < tail_len)
    rows = head_rows(o_base, stride_o_head, head0, BLOCK_H)
    tl.store(tail_at(rows, j, HALF, GAP, stride_col), t.to(o_base.dtype.element_ty), mask=mt)


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


# --- launch --------------------------------------------------------------------------------------


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL), this kernel's programs may start while the
    previous kernel on the stream still runs: wait for it (and its writes) before touching memory,
    then let the next kernel start launching. Without PDL: nothing. Call it first in the kernel."""
    if PDL:
        _gdc_wait()
        _gdc_launch_dependents()
