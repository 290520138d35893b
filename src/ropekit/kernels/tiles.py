"""Heads in and out of registers, shared by the kernels: a token's heads loaded as pair tiles
(half-split or interleaved, as one word per pair when the rows are aligned), stored back, clamped
to an fp8 output's range; and the programmatic-dependent-launch prologue.

Addressing: head indices are widened to int64 before they scale a stride (kernels/rope.py's rule).
"""

import triton
import triton.language as tl

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
