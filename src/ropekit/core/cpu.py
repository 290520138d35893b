"""The CPU fast path: what the ops run on CPU tensors when Triton does not (no TRITON_INTERPRET).

    rope(q, k, q_out, k_out, a, b, *, rot, table, variant)                every rotation op
    table_angles(cos_sin_cache, positions, token_shape, rot, axis_map) -> (cos, sin)
    angles_at(cos_table, sin_table, positions, token_shape, axis_map) -> (cos, sin)
    pick_sections(cos, sin, axis_map) -> (cos, sin)                      per-token M-RoPE angles
    rotate(x, out, cos, sin, *, interleaved, out_interleaved, inverse, halves) -> out
    store_rows(q, k, v, positions, table, k_cache, v_cache, slot_mapping, ...)   the fused store
    rerotate_rows(k_cache, slots, delta, table, ...)                        re-rotation of cache rows
    norm_rotate(x, weight, cos, sin, *, interleaved, eps, offset)          RMSNorm then rotation
    rms_norm(x, weight, *, eps, offset)                                     the norm alone (float32)
    scratch(shape, dtype, slot), forget_scratch(), block_elems()           memory and blocking

Semantics are the kernels': float32 math (float64 for float64 inputs), one rounding into the
output dtype, a position outside the table gives NaN in that token's rotated dims. Written for
speed with PyTorch's own CPU ops, where per-op overhead and passes over memory are the cost:
float32 out of place is three passes per tensor written straight into the output (one multiply
by [cos | cos], one multiply-add of sin into each half); in place or other dtypes, q's and k's
heads are staged side by side in one float32 scratch (a copy in per tensor, the same passes once
for both, a copy out: the one rounding); interleaved pairs rotate as one complex multiply; angles
are prepared once per call and kept between calls with the same table or cos / sin tensors
(checked by identity and version counter; a write through `.data` is not seen); large tensors go
through in blocks of tokens sized for the cache. Scratch memory is per thread and usable inside
and outside inference mode. ropekit.tools.reference is the float64 oracle this module is tested
against; nothing here imports it.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from typing import Optional, Sequence, Tuple

import torch

from .freqs import pair_positions


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 tensors, float32 for every other float dtype."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# scratch buffers


_local = threading.local()
_VIEWS_PER_THREAD = 64  # scratch views kept by shape: a model's few call shapes, each looked up once


def _views() -> dict:
    """This thread's scratch views by key (made with its buffers on first use)."""
    views = getattr(_local, "views", None)
    if views is None:
        views = _local.views = {}
        _local.bufs = {}
    return views


def scratch(shape, dtype: torch.dtype, slot: int) -> torch.Tensor:
    """A per-thread float scratch tensor of `shape`, reused across calls: large CPU allocations
    are fresh pages every time, and reuse saves their page faults. slot picks one of two buffers;
    views are kept by shape, so a repeated call costs one dict lookup.

    Buffers are made outside inference mode whatever the caller's mode: an inference tensor
    cannot be written outside inference mode, while a normal tensor can be written inside it, so
    one buffer serves calls made in either mode."""
    views = _views()
    key = (slot, dtype, shape)
    v = views.get(key)
    if v is not None:
        return v
    n = 1
    for d in shape:
        n *= d
    bufs = _local.bufs
    b = bufs.get((slot, dtype))
    if b is None or b.numel() < n:
        with torch.inference_mode(False):
            b = bufs[(slot, dtype)] = torch.empty(max(n, 1), dtype=dtype)
        views.clear()  # views of the old buffer would keep its memory alive
    if len(views) >= _VIEWS_PER_THREAD:
        views.clear()
    v = views[key] = b[:n].view(shape)
    return v


def forget_scratch() -> None:
    """Drop this thread's scratch buffers and prepared angles (their memory returns to the allocator)."""
    _local.views = None
    _local.angles = None


# ---------------------------------------------------------------------------------------------
# angles


@functools.lru_cache(maxsize=64)
def _axis_index(axis_map: Tuple[int, ...]) -> torch.Tensor:
    """(half,) int64 of an M-RoPE axis map (Variant.axis_map: the position row of each pair)."""
    return torch.tensor(axis_map, dtype=torch.long)


def pick_sections(cos, sin, axis_map: Sequence[int]):
    """(N, *T, half) per-row angles -> (*T, half): pair j's from row axis_map[j]."""
    idx = _axis_index(tuple(int(v) for v in axis_map)).to(cos.device)
    pick = idx.expand(1, *cos.shape[1:])
    return cos.gather(0, pick).squeeze(0), sin.gather(0, pick).squeeze(0)


def _rows_at(table, flat, inside: bool):
    """Rows of table (max_position, half) at flat positions (N,); NaN rows for positions outside
    the table unless inside (all are in range)."""
    if inside:
        return table.index_select(0, flat)
    max_pos = table.shape[0]
    rows = table.index_select(0, flat.clamp(0, max_pos - 1))
    return rows.masked_fill_(((flat < 0) | (flat >= max_pos)).unsqueeze(-1), float("nan"))


def angles_at(cos_table, sin_table, positions, token_shape, axis_map=None):
    """cos, sin (*token_shape, half) at positions (*T) of (max_position, half) tables, or at (N, *T)
    M-RoPE positions, pair j's from row axis_map[j]; a position outside the tables gives NaN."""
    flat = positions.reshape(-1)
    if flat.dtype != torch.long:
        flat = flat.long()
    inside = True
    if flat.numel():
        lo, hi = torch.aminmax(flat)
        inside = int(lo) >= 0 and int(hi) < cos_table.shape[0]
    shape = (*positions.shape, cos_table.shape[-1])
    cos = _rows_at(cos_table, flat, inside).view(shape)
    sin = _rows_at(sin_table, flat, inside).view(shape)
    if positions.dim() == len(token_shape) + 1:
        cos, sin = pick_sections(cos, sin, axis_map)
    return cos, sin


def table_angles(cos_sin_cache, positions, token_shape, rot: int, axis_map=None):
    """cos, sin (*token_shape, rot // 2) from a [cos | sin] table (max_position, >= rot): rows at
    positions as `angles_at` takes them; None: rows 0..S-1 for the last token dim (views of the
    table when it is long enough)."""
    half = rot // 2
    cos_table, sin_table = cos_sin_cache[:, :half], cos_sin_cache[:, half:rot]
    if positions is None:
        n = token_shape[-1]
        if n <= cos_table.shape[0]:
            return cos_table[:n], sin_table[:n]
        positions = torch.arange(n, device=cos_table.device)
        token_shape = (n,)
    return angles_at(cos_table, sin_table, positions, token_shape, axis_map)


# ---------------------------------------------------------------------------------------------
# the rotation


BLOCK_ELEMS = 1 << 18  # elements of one block per thread (1 MB in float32): a core's L2
PARALLEL_BLOCK_ELEMS = 1 << 20  # the smallest block when several threads share the passes


class _Angles:
    """cos / sin of one call, ready for every tensor it rotates: compute dtype, a broadcast head
    dim, sin negated for the inverse; the complex factor and the [cos | cos] row made on first use."""

    __slots__ = ("c", "s", "ct", "_cc", "_e")

    def __init__(self, c, s, ct):
        self.c, self.s, self.ct = c, s, ct
        self._cc = self._e = None

    def doubled_cos(self):
        if self._cc is None:
            self._cc = torch.cat((self.c, self.c), -1)
        return self._cc

    def complex_factor(self):
        if self._e is None:
            self._e = torch.complex(self.c, self.s)
        return self._e


_ANGLE_ENTRIES = 8  # prepared angles kept per thread: a model's tables and one forward's cos / sin


def _cached_angles(srcs, key, make) -> _Angles:
    """The prepared angles of srcs (the tensors they are read from) under key, made again when
    one of them is another tensor or was written in place (its version counter). The entry holds
    srcs, so their ids in the key cannot be reused while it lives. Inference tensors have no
    version counter: their angles are made per call."""
    if any(t.is_inference() for t in srcs):
        return make()
    store = getattr(_local, "angles", None)
    if store is None:
        store = _local.angles = {}
    versions = tuple(t._version for t in srcs)
    entry = store.get(key)
    if entry is not None and entry[1] == versions and all(x is y for x, y in zip(entry[0], srcs)):
        return entry[2]
    ang = make()
    if len(store) >= _ANGLE_ENTRIES:
        store.clear()
    store[key] = (srcs, versions, ang)
    return ang


def _prepare(cos, sin, ct, inverse: bool, heads_dim: int) -> _Angles:
    if cos.dtype != ct or sin.dtype != ct:
        cos, sin = cos.to(ct), sin.to(ct)
    if inverse:
        sin = -sin
    return _Angles(cos.unsqueeze(heads_dim), sin.unsqueeze(heads_dim), ct)


def _as_complex(x):
    """x (*, 2h) as a complex (*, h) view of its (2i, 2i+1) pairs, or None when its strides or
    offset do not allow one (a last stride other than 1 among them)."""
    if x.stride(-1) != 1 or x.storage_offset() % 2 or any(st % 2 for st in x.stride()[:-1]):
        return None
    return torch.view_as_complex(x.unflatten(-1, (x.shape[-1] // 2, 2)))


def _rotate_block(x, out, ang: _Angles, interleaved: bool, out_interleaved: bool, same: bool) -> None:
    """Rotate every dim of x (*, 2h) into out (x itself when same). Reads x in the compute dtype
    (a scratch copy otherwise) and writes out directly when it has the compute dtype and is not
    x, else through a scratch result copied (rounded once) into out."""
    ct = ang.ct
    if interleaved and out_interleaved:
        e = ang.complex_factor()
        if x.dtype == ct and out.dtype == ct:
            xc, oc = _as_complex(x), _as_complex(out)
            if xc is not None and oc is not None:
                torch.mul(xc, e, out=oc)
                return
        z = scratch(x.shape, ct, 0).copy_(x)
        zc = torch.view_as_complex(z.unflatten(-1, (z.shape[-1] // 2, 2)))
        zc.mul_(e)
        out.copy_(z)
        return
    src = x if x.dtype == ct else scratch(x.shape, ct, 0).copy_(x)
    direct = out.dtype == ct and not same
    dst = out if direct else scratch(x.shape, ct, 1)
    c, s = ang.c, ang.s
    x1, x2 = (src[..., 0::2], src[..., 1::2]) if interleaved else src.chunk(2, -1)
    if not interleaved and not out_interleaved:
        # one pass for both cos terms, then the two sin terms into each half
        d1, d2 = dst.chunk(2, -1)
        torch.mul(src, ang.doubled_cos(), out=dst)
    else:
        d1, d2 = (dst[..., 0::2], dst[..., 1::2]) if out_interleaved else dst.chunk(2, -1)
        torch.mul(x1, c, out=d1)
        torch.mul(x2, c, out=d2)
    d1.addcmul_(x2, s, value=-1.0)  # x1 cos - x2 sin
    d2.addcmul_(x1, s)  # x2 cos + x1 sin
    if not direct:
        out.copy_(dst)


def _blocks(lead, rows):
    """Index tuples that cut the leading dims into blocks of at most ~rows rows (whole inner dims,
    a slice of one dim, every index of the dims outside it)."""
    inner, k = 1, len(lead)
    while k > 0 and inner * lead[k - 1] <= rows:
        inner *= lead[k - 1]
        k -= 1
    if k == 0:
        yield (Ellipsis,)
        return
    step = max(1, rows // inner)
    for outer in itertools.product(*(range(n) for n in lead[: k - 1])):
        for start in range(0, lead[k - 1], step):
            yield outer + (slice(start, start + step),)


def _rotate_blocked(x, out, ang: _Angles, interleaved, out_interleaved, same) -> None:
    """Large tensors: blocks of the leading dims small enough that the passes of one block stay in
    cache, walked in x's memory order (HF's (B, S, H, D) views of (B, H, S, D) storage then stream)."""
    nd = x.dim() - 1
    full = tuple(x.shape[:-1]) + (ang.c.shape[-1],)
    c, s = ang.c.expand(full), ang.s.expand(full)
    perm = sorted(range(nd), key=lambda d: -x.stride(d))
    if perm != list(range(nd)):
        x, out = x.permute(*perm, nd), out.permute(*perm, nd)
        c, s = c.permute(*perm, nd), s.permute(*perm, nd)
    rows = block_elems() // max(x.shape[-1], 1)
    for index in _blocks(tuple(x.shape[:-1]), rows):
        _rotate_block(x[index], out[index], _Angles(c[index], s[index], ang.ct), interleaved, out_interleaved, same)


def _staging(token_shape, heads, rot: int, ct) -> tuple:
    """Scratch for rotating several tensors together: y (*T, sum(heads), rot) holding each
    tensor's heads side by side, the result r of y's shape, and both cut per tensor. Kept per
    thread by shapes, so a repeated call makes no view."""
    key = ("staging", token_shape, heads, rot, ct)
    views = _views()
    got = views.get(key)
    if got is None:
        shape = (*token_shape, sum(heads), rot)
        y, r = scratch(shape, ct, 0), scratch(shape, ct, 1)
        edges = list(itertools.accumulate(heads, initial=0))
        y_parts = tuple(y[..., a:b, :] for a, b in zip(edges, edges[1:]))
        r_parts = tuple(r[..., a:b, :] for a, b in zip(edges, edges[1:]))
        got = views[key] = (y, r, y_parts, r_parts, y.chunk(2, -1), r.chunk(2, -1))
    return got


def _stage_block(pairs, ang: _Angles, rot: int, interleaved: bool) -> None:
    """One block of _rotate_staged: every pair's heads copied side by side into a compute-dtype
    scratch, two passes (one complex multiply when interleaved), a copy out per pair."""
    x0 = pairs[0][0]
    y, r, y_parts, r_parts, (y1, y2), (r1, r2) = _staging(
        tuple(x0.shape[:-2]), tuple(x.shape[-2] for x, _ in pairs), rot, ang.ct
    )
    for (x, _), part in zip(pairs, y_parts):
        part.copy_(x)
    if interleaved:
        torch.view_as_complex(y.unflatten(-1, (rot // 2, 2))).mul_(ang.complex_factor())
        r_parts = y_parts
    else:
        torch.mul(y, ang.doubled_cos(), out=r)
        r1.addcmul_(y2, ang.s, value=-1.0)  # x1 cos - x2 sin
        r2.addcmul_(y1, ang.s)  # x2 cos + x1 sin
    for (_, out), part in zip(pairs, r_parts):
        out.copy_(part)


def block_elems() -> int:
    """Elements of one block. One thread: about its core's L2, so that the passes over a block
    stay in cache. More threads: each pass is a parallel region whose threads wait for each other,
    so blocks are larger (fewer regions; a busy host deschedules one of them less often)."""
    threads = torch.get_num_threads()
    return BLOCK_ELEMS if threads == 1 else max(BLOCK_ELEMS * threads, PARALLEL_BLOCK_ELEMS)


def _rotate_staged(pairs, ang: _Angles, rot: int, interleaved: bool) -> None:
    """Rotate (x, out) pairs of one token shape, in place or of a dtype other than the compute
    dtype, through one compute-dtype copy of all their heads (copies in, two passes, copies out:
    the one rounding), in blocks of tokens when they are large."""
    token_shape = tuple(pairs[0][0].shape[:-2])
    per_token = rot * sum(x.shape[-2] for x, _ in pairs)
    rows = max(1, block_elems() // per_token)
    if math.prod(token_shape) <= rows:
        _stage_block(pairs, ang, rot, interleaved)
        return
    full = (*token_shape, ang.c.shape[-2], rot // 2)  # one row for every head, or a row per head
    c, s = ang.c.expand(full), ang.s.expand(full)
    for index in _blocks(token_shape, rows):
        block = [(x[index], out[index]) for x, out in pairs]
        _stage_block(block, _Angles(c[index], s[index], ang.ct), rot, interleaved)


def rotated_dims(x: torch.Tensor, rot: int, halves: bool = False) -> tuple:
    """Views of the dims of x (*, D) a rotation of rot dims writes: [0, rot), or with halves
    (rotary_position='halves', pairs (i, i + D/2)) [0, rot/2) and [D/2, D/2 + rot/2)."""
    if not halves:
        return (x[..., :rot],)
    half, gap = rot // 2, x.shape[-1] // 2
    return x[..., :half], x[..., gap : gap + half]


def _rotate_halves(x, out, ang: _Angles, half: int) -> None:
    """rotary_position='halves': the pairs (i, D/2 + i), i < half, of x (*T, H, D) rotated into out
    (x itself: in place, only the pairs written); out of place the other dims are copied."""
    gap = x.shape[-1] // 2
    x1, x2 = (p.to(ang.ct) for p in rotated_dims(x, 2 * half, True))
    o1 = x1 * ang.c - x2 * ang.s
    o2 = x2 * ang.c + x1 * ang.s
    if out.data_ptr() != x.data_ptr():
        out[..., half:gap].copy_(x[..., half:gap])
        out[..., gap + half :].copy_(x[..., gap + half :])
    out[..., :half].copy_(o1)
    out[..., gap : gap + half].copy_(o2)


def _pair_views(x, rot: int, interleaved: bool, halves: bool) -> tuple:
    """The two members of every rotated pair of x (*, D), as views: (2i, 2i + 1) interleaved,
    (i, i + D/2) with halves (rotary_position='halves'), (i, i + rot/2) otherwise."""
    half = rot // 2
    if interleaved:
        return x[..., 0:rot:2], x[..., 1:rot:2]
    gap = x.shape[-1] // 2 if halves else half
    return x[..., :half], x[..., gap : gap + half]


def _rotate_eager(pairs, ang: _Angles, rot: int, interleaved: bool, out_interleaved: bool, halves: bool) -> None:
    """eager_rounding: each pair rotated by ops in x's dtype (ang holds cos / sin rounded to it), so
    torch rounds every product and sum as eager `q * cos + rotate_half(q) * sin` does; the other
    dims copied when out is not x."""
    for x, out in pairs:
        x1, x2 = _pair_views(x, rot, interleaved, halves)
        o1 = x1 * ang.c - x2 * ang.s
        o2 = x2 * ang.c + x1 * ang.s
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        d1, d2 = _pair_views(out, rot, out_interleaved, halves)
        d1.copy_(o1)
        d2.copy_(o2)


def _rotate_all(
    pairs, ang: _Angles, rot: int, interleaved: bool, out_interleaved: bool, halves: bool = False, eager: bool = False
) -> None:
    """Rotate the first rot dims of each (x, out) pair (tensors (*T, H, D) of one token shape; out
    may be x), copying the tail when out is not x. Small tensors with one layout in and out that
    need a scratch copy (in place, or not in the compute dtype) are staged together; float32 out of
    place writes out directly; large tensors go through in blocks. halves: the pairs (i, i + D/2)
    instead (rotary_position='halves', `_rotate_halves`). eager: rounded as eager ops in x's dtype
    (`_rotate_eager`). Empty tensors (no heads, no tokens) are skipped: nothing to write."""
    pairs = [(x, out) for x, out in pairs if x.numel()]
    if eager:
        _rotate_eager(pairs, ang, rot, interleaved, out_interleaved, halves)
        return
    if halves:
        for x, out in pairs:
            _rotate_halves(x, out, ang, rot // 2)
        return
    ct = ang.ct
    staged = []
    for x, out in pairs:
        same = out.data_ptr() == x.data_ptr()
        full = x.shape[-1] == rot
        xr, outr = (x, out) if full else (x[..., :rot], out[..., :rot])
        if interleaved == out_interleaved and (same or x.dtype != ct or out.dtype != ct):
            staged.append((xr, outr))
        elif x.numel() > block_elems():
            _rotate_blocked(xr, outr, ang, interleaved, out_interleaved, same)
        else:
            _rotate_block(xr, outr, ang, interleaved, out_interleaved, same)
        if not same and not full:
            out[..., rot:].copy_(x[..., rot:])
    if staged:
        _rotate_staged(staged, ang, rot, interleaved)


def rotate(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    out_interleaved: Optional[bool] = None,
    inverse: bool = False,
    halves: bool = False,
) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of every head of x into out (with halves the pairs
    (i, i + D/2), i < cos.shape[-1]: rotary_position='halves'). Returns out.

    x: (*T, H, D) fp16/bf16/fp32/fp64. out: x's shape, any float dtype (x itself: in place; no
    partial overlap). cos, sin: broadcastable to (*T, half), any float dtype; the first 2 * half
    dims are rotated, the rest copied when out is not x. interleaved: pairs (2i, 2i + 1), else
    halves (i, i + half); out_interleaved (default interleaved): the layout written; inverse:
    rotate by the negative angle. Math in float32 (float64 for float64 x), one rounding into out.
    """
    out_il = interleaved if out_interleaved is None else out_interleaved
    ang = _prepare(cos, sin, compute_dtype(x), inverse, -2)
    _rotate_all(((x, out),), ang, 2 * cos.shape[-1], interleaved, out_il, halves)
    return out


def freqs_angles(positions: torch.Tensor, inv_freq: torch.Tensor, axes=()):
    """cos, sin (*T, half) float32 of the angles positions x inv_freq, formed in float64 (as
    accurate as the kernel's corrected float32 angle). positions: (*T) driving every pair, or with
    axes (pairs per axis) (len(axes), *T), row a driving axis a's pairs."""
    f = inv_freq.detach().double()
    angle = pair_positions(positions, axes, f.shape[0]).double() * f
    return angle.cos().float(), angle.sin().float()


def rope(q, k, q_out, k_out, a, b, *, rot: int, table: bool, variant) -> None:
    """Every rotation op's CPU run step: q -> q_out and k -> k_out (k may be None; outputs may be
    the inputs: in place).

    table: (a, b) are (positions (*T), (N, *T) with an M-RoPE axis map, or None; [cos | sin] table);
    otherwise (cos, sin) per token, broadcast to (*T, ·) ((N, *T, ·) with an axis map), of which the
    first rot // 2 columns are read. q, k: (*T, H, D), or (B, H, S, D) with variant.heads_first.
    rot: rotated dims. variant: the call's flag record (ropekit.core.variant.Variant), read as it is:
    interleaved / out_interleaved pair layouts, inverse, mrope with its axis_map (the position row
    of each pair), heads_first, rope_halves (pairs (i, i + D/2)).
    """
    interleaved, out_interleaved, inverse = variant.interleaved, variant.out_interleaved, variant.inverse
    axis_map = variant.pair_rows()
    heads_first = variant.heads_first
    if heads_first:  # work on (B, S, H, D) views: the tensors' memory order, heads next to D
        q, k, q_out, k_out = (None if x is None else x.transpose(1, 2) for x in (q, k, q_out, k_out))
    token_shape = tuple(q.shape[:-2])
    if 0 in token_shape:
        return
    # eager_rounding: the angles in q's own dtype, every op of the rotation in it (_rotate_eager)
    ct = q.dtype if variant.eager_rounding else compute_dtype(q)
    if variant.head_table:
        _rotate_head_table(((q, q_out), (k, k_out)), a, b, token_shape, rot, ct, variant)
        return
    if table:
        srcs = (b,) if a is None else None  # rows 0..S-1: the same angles while the table is unchanged
        key = ("arange", id(b), token_shape[-1], rot, inverse, ct)
    else:
        srcs = (a, b)  # a model passes one forward's cos / sin to every layer
        key = ("tokens", id(a), id(b), rot, inverse, ct, axis_map)

    def make():
        if table:
            cos, sin = table_angles(b, a, token_shape, rot, axis_map)
        else:
            half = rot // 2
            cos, sin = (a, b) if a.shape[-1] == half else (a[..., :half], b[..., :half])
            if axis_map is not None:
                cos, sin = pick_sections(cos, sin, axis_map)
        return _prepare(cos, sin, ct, inverse, -2)

    ang = make() if srcs is None else _cached_angles(srcs, key, make)
    pairs = ((q, q_out),) if k is None else ((q, q_out), (k, k_out))
    _rotate_all(pairs, ang, rot, interleaved, out_interleaved, variant.rope_halves, variant.eager_rounding)


def head_table_angles(table, positions, token_shape, rot: int, n_heads: int):
    """cos, sin (*token_shape, n_heads, rot // 2) from a per-head [cos | sin] table (max_position,
    Ht, >= rot) at positions (*T): head j reads table head j // (n_heads / Ht); NaN rows for a
    position outside the table."""
    half = rot // 2
    n_table = table.shape[1]
    flat = table[..., :rot].reshape(table.shape[0], n_table * rot)  # a row per position, every head
    rows = angles_at(flat, flat, positions, token_shape)[0].unflatten(-1, (n_table, rot))
    if n_heads != n_table:
        rows = rows.repeat_interleave(n_heads // n_table, dim=-2)
    return rows[..., :half], rows[..., half:]


def _rotate_head_table(pairs, positions, table, token_shape, rot: int, ct, variant) -> None:
    """The rotation with a per-head table: each tensor of the pairs rotated by its own heads' rows."""
    for x, out in pairs:
        if x is None or not x.numel():
            continue
        cos, sin = head_table_angles(table, positions, token_shape, rot, x.shape[-2])
        cos, sin = cos.to(ct), sin.to(ct)
        ang = _Angles(cos, -sin if variant.inverse else sin, ct)
        _rotate_all(
            ((x, out),),
            ang,
            rot,
            variant.interleaved,
            variant.out_interleaved,
            variant.rope_halves,
            variant.eager_rounding,
        )


# ---------------------------------------------------------------------------------------------
# the fused store and re-rotation


def _cache_rows(cache, slots):
    """Index of cache rows at slots: (block, offset) for paged caches, (slot,) for flat ones."""
    if cache.dim() == 4:
        return slots // cache.shape[1], slots % cache.shape[1]
    return (slots,)


def _rounded_into(vals, scale, dtype):
    """float32 vals divided by scale (None: 1), rounded once to dtype; saturated to the finite range
    of a 1-byte (fp8) dtype, NaN kept."""
    if scale is not None:
        vals = vals / scale.reshape(()).float()
    if dtype.itemsize == 1:
        big = torch.finfo(dtype).max
        vals = vals.clamp(-big, big)
    return vals.to(dtype)


# e2m1's decision boundaries between neighbouring magnitudes, and whether a value must pass the
# boundary (True) or only reach it (False) to take the upper one: a tie goes to the even code
_E2M1_BOUNDARIES = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True))


def nvfp4_rows(x: torch.Tensor, global_scale=None):
    """NVFP4 of float32 rows x (..., D), D a multiple of 16: (codes (..., D / 2) uint8, element 2j
    in the low nibble of byte j; block scales (..., D / 16) float8_e4m3fn). The rule of
    rope_store_kernel's FP4 output: scale = amax / 6 / g in float32 rounded to nearest even onto
    e4m3 (saturated at 448, NaN kept); code of the exact x / (scale * g) rounded to nearest even
    onto {0, 0.5, 1, 1.5, 2, 3, 4, 6} (saturated at 6), sign bit 8; a zero (or NaN) scale gives
    magnitude 0. global_scale: None (1) or a 1-element float32 tensor."""
    g = torch.ones((), dtype=torch.float32) if global_scale is None else global_scale.float().reshape(())
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    amax = blocks.abs().amax(-1)
    scale = (amax / 6.0 / g).clamp(max=448.0).to(torch.float8_e4m3fn)  # torch's cast rounds to nearest even
    # |x| against each decision boundary b * scale * g, exactly: the float64 product of a 3-, a 4-
    # and a 24-bit significand is exact (the kernel: the sign of one fused multiply-add)
    den = (scale.double() * g.double())[..., None]
    a = blocks.abs().double()
    code = sum((a > b * den if strict else a >= b * den).int() for b, strict in _E2M1_BOUNDARIES)
    code = torch.where(den > 0, code, 0) + 8 * (blocks < 0).int()
    code = code.reshape(x.shape)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), scale


def store_rows(
    q,
    k,
    v,
    positions,
    table,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    interleaved,
    rotary_dim,
    k_scale,
    v_scale,
    q_out=None,
    q_scale=None,
    write_key=False,
    axis_map=None,
    norm=None,
    halves=False,
) -> None:
    """The fused store: rotated q into q_out (None: q, in place), divided by q_scale; rotated k and
    v (divided by their scale) rounded once into their cache rows, fp8 saturated; with write_key
    rotated k's dims also back into k. Slots < 0 are skipped; a slot past the cache is skipped and
    flags its token's rotated dims of q with NaN. Scales: None or 1-element float32 tensors.
    q, k, v: (*T, H, D); caches (num_blocks, block_size, Hk, D) or (num_slots, Hk, D); positions
    (*T), (N, *T) with an M-RoPE axis map, or None (arange). norm: None, or (q's weight or None, k's
    weight or None, eps, offset): RMSNorm of q / k (their whole heads) first (tails included).
    halves: the rotated pairs are (i, i + D/2) (rotary_position='halves')."""
    if norm is not None:
        _normed_store(
            q,
            k,
            v,
            positions,
            table,
            k_cache,
            v_cache,
            slot_mapping,
            dict(
                interleaved=interleaved,
                rotary_dim=rotary_dim,
                k_scale=k_scale,
                v_scale=v_scale,
                q_out=q_out,
                q_scale=q_scale,
                write_key=write_key,
                axis_map=axis_map,
                halves=halves,
            ),
            norm,
        )
        return
    rot = rotary_dim
    token_shape = tuple(q.shape[:-2])
    num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
    slots = slot_mapping.long().reshape(token_shape)
    cos, sin = table_angles(table, positions, token_shape, rot, axis_map)
    ang = _prepare(cos, sin, torch.float32, False, -2)
    bad = slots >= num_slots
    flagged = bool(bad.any())
    target = q if q_out is None else q_out
    if q_scale is None and target.dtype.itemsize > 1:  # straight into q (or q_out)
        _rotate_all(((q, target),), ang, rot, interleaved, interleaved, halves)
        if flagged:
            for part in rotated_dims(target, rot, halves):
                part[bad] = float("nan")
    else:
        wide = torch.empty(q.shape, dtype=torch.float32)
        _rotate_all(((q, wide),), ang, rot, interleaved, interleaved, halves)
        if flagged:
            for part in rotated_dims(wide, rot, halves):
                part[bad] = float("nan")
        target.copy_(_rounded_into(wide, q_scale, target.dtype))
    k_rot = torch.empty(k.shape, dtype=torch.float32)
    _rotate_all(((k, k_rot),), ang, rot, interleaved, interleaved, halves)
    if write_key:
        for dst, src in zip(rotated_dims(k, rot, halves), rotated_dims(k_rot, rot, halves)):
            dst.copy_(src)
    keep = (slots >= 0) & ~bad
    idx = slots[keep]
    for cache, rows, scale in ((k_cache, k_rot, k_scale), (v_cache, v, v_scale)):
        cache[_cache_rows(cache, idx)] = _rounded_into(rows[keep].float(), scale, cache.dtype)


def _normed_store(q, k, v, positions, table, k_cache, v_cache, slot_mapping, kw, norm) -> None:
    """store_rows with RMSNorm of q and / or k first: normalized in float32 (unrounded), then
    rotated and rounded once; q's tail (in place) and with write_key k's tail come back normalized."""
    wq, wk, eps, offset = norm
    qn = q if wq is None else rms_norm(q, wq, eps=eps, offset=offset)
    kn = k if wk is None else rms_norm(k, wk, eps=eps, offset=offset)
    store_rows(qn, kn, v, positions, table, k_cache, v_cache, slot_mapping, **kw)
    if kw["q_out"] is None and qn is not q:
        q.copy_(qn)
    if kw["write_key"] and kn is not k:
        k.copy_(kn)


def rerotate_rows(
    k_cache,
    slots,
    delta,
    table,
    *,
    interleaved,
    rotary_dim,
    k_scale,
    dst_slots,
    halves=False,
    positions=None,
    to_table=None,
) -> None:
    """Re-rotation: the row at slots[i] rotated by the angle of delta[i] (the inverse angle of
    |delta[i]| when negative), written to dst_slots[i] (or back to slots[i]); with dst_slots the
    dims past rotary_dim are copied. Rows with a slot or dst slot outside [0, num_slots) are
    skipped; |delta| past the table gives NaN rotated dims. k_cache: (num_blocks, block_size, H, D)
    or (num_slots, H, D), written in place; slots (N,); delta (N,) tensor or int; k_scale: the cache
    holds value / k_scale; halves: the rotated pairs are (i, i + D/2) (rotary_position='halves').
    to_table: rotate instead from table row positions[i] to to_table row positions[i] + delta[i]
    (`two_table_angles`), NaN where either row is outside its table."""
    rot = rotary_dim
    n = slots.shape[0]
    num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
    src = slots.long()
    dst = src if dst_slots is None else dst_slots.long()
    d = delta.long() if isinstance(delta, torch.Tensor) else torch.full((n,), int(delta), dtype=torch.long)
    p = None if positions is None else positions.long()
    keep = (src >= 0) & (src < num_slots) & (dst >= 0) & (dst < num_slots)
    if not bool(keep.all()):
        src, dst, d = src[keep], dst[keep], d[keep]
        p = None if p is None else p[keep]
    ct = compute_dtype(k_cache)
    x = k_cache[_cache_rows(k_cache, src)].to(ct)  # a gathered copy: (n, H, D)
    scale = None if k_scale is None else torch.as_tensor(k_scale, dtype=ct).reshape(())
    if scale is not None:
        for part in rotated_dims(x, rot, halves):
            part *= scale
    if to_table is None:
        cos, sin = table_angles(table, d.abs(), (d.shape[0],), rot)
        sin = torch.where((d < 0).unsqueeze(-1), -sin, sin)
    else:
        cos, sin = two_table_angles(table, to_table, p, d, rot)
    rotate(x, x, cos, sin, interleaved=interleaved, halves=halves)
    if scale is not None:  # by the reciprocal, as the kernel does
        inv = 1.0 / scale
        for part in rotated_dims(x, rot, halves):
            part *= inv
    rows = _cache_rows(k_cache, dst)
    if dst_slots is not None:  # another row: the kept dims move too
        k_cache[rows] = x.to(k_cache.dtype)
        return
    for view, part in zip(rotated_dims(k_cache, rot, halves), rotated_dims(x, rot, halves)):
        view[rows] = part.to(k_cache.dtype)


def two_table_angles(table, to_table, positions, delta, rot: int):
    """cos, sin (N, rot // 2) in float32 of the rotation from table row positions to to_table row
    positions + delta: the conjugate of the from-row over its squared magnitude, then the to-row
    (one rotation by angle(to) - angle(from), scaled by |to| / |from|, for tables that fold an
    attention factor in). NaN where either row is outside its table (p + d bounded without
    forming it: no int64 wrap)."""
    ok = (positions >= 0) & (positions < table.shape[0]) & (delta >= -positions)
    ok &= delta < to_table.shape[0] - positions
    p = torch.where(ok, positions, 0)
    n = (p.shape[0],)
    cf, sf = (a.float() for a in table_angles(table, p, n, rot))
    ct, st = (a.float() for a in table_angles(to_table, p + torch.where(ok, delta, 0), n, rot))
    inv = 1.0 / (cf * cf + sf * sf)  # the kernel's float32 steps (ropekit.language.compose_angles)
    cos, sin = (ct * cf + st * sf) * inv, (st * cf - ct * sf) * inv
    bad = ~ok.unsqueeze(-1)
    return cos.masked_fill(bad, float("nan")), sin.masked_fill(bad, float("nan"))


# ---------------------------------------------------------------------------------------------
# RMSNorm then rotation (differentiable: autograd through it is the CPU backward)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float) -> torch.Tensor:
    """x (*T, H, D) normalized over each head (weight (D,)) or over all heads of a token (weight
    (H * D,)), times (weight + offset); returned in float32 (float64 for float64 x), unrounded."""
    ct = compute_dtype(x)
    w = weight.to(ct) + offset if offset else weight.to(ct)
    if weight.shape[-1] == x.shape[-1]:
        return torch.nn.functional.rms_norm(x.to(ct), (x.shape[-1],), w, eps)
    flat = x.to(ct).flatten(-2)
    return torch.nn.functional.rms_norm(flat, (flat.shape[-1],), w, eps).view(x.shape)


def _rotated(y, cos, sin, interleaved: bool):
    """y (*T, H, rot) rotated by cos / sin (*T, half), differentiable, in y's dtype."""
    c, s = cos.to(y.dtype).unsqueeze(-2), sin.to(y.dtype).unsqueeze(-2)
    if interleaved:
        e = torch.complex(c, s)
        z = torch.view_as_complex(y.unflatten(-1, (y.shape[-1] // 2, 2)).contiguous()) * e
        return torch.view_as_real(z).flatten(-2)
    y1, y2 = y.chunk(2, -1)
    return y * torch.cat((c, c), -1) + torch.cat((-y2, y1), -1) * torch.cat((s, s), -1)


def _turned(y, cos, sin, interleaved: bool, halves: bool):
    """y (*T, H, D) with its rotated dims (the first 2 * cos.shape[-1], or with halves the pairs
    (i, i + D/2)) rotated by cos / sin (*T, half), the other dims as they are; differentiable."""
    rot = 2 * cos.shape[-1]
    if halves:
        half, gap = rot // 2, y.shape[-1] // 2
        c, s = cos.to(y.dtype).unsqueeze(-2), sin.to(y.dtype).unsqueeze(-2)
        y1, y2 = rotated_dims(y, rot, True)
        return torch.cat((y1 * c - y2 * s, y[..., half:gap], y2 * c + y1 * s, y[..., gap + half :]), -1)
    r = _rotated(y[..., :rot], cos, sin, interleaved)
    return r if rot == y.shape[-1] else torch.cat((r, y[..., rot:]), -1)


def norm_rotate(
    x, weight, cos, sin, *, interleaved: bool, eps: float, offset: float, out_dtype=None, halves: bool = False
) -> torch.Tensor:
    """x (*T, H, D) RMS-normalized (when weight is given: the whole head, tail included), then its
    first 2 * cos.shape[-1] dims rotated (halves: the pairs (i, i + D/2), rotary_position='halves');
    math in float32, one rounding to out_dtype (None: x's). Built from differentiable ops: autograd
    through it gives the gradients of x and of the weight."""
    y = x.to(compute_dtype(x)) if weight is None else rms_norm(x, weight, eps=eps, offset=offset)
    return _turned(y, cos, sin, interleaved, halves).to(out_dtype or x.dtype)


def norm_rotate_backward(x, g, weight, cos, sin, *, interleaved: bool, eps: float, offset: float, halves=False):
    """(gradient of x, of weight) of norm_rotate given its output gradient g, by the formulas (no
    autograd: custom ops run this below autograd). With n = x * r, r = rsqrt(mean(x^2) + eps) over
    the norm group and gz = the transposed rotation of g: gx = r * (gz w' - n mean(gz w' n)),
    dw = sum of gz * n over tokens (and heads, per-head weights). Math in float32 (float64)."""
    ct = compute_dtype(x)
    gz = _turned(g.to(ct), cos, -sin, interleaved, halves)  # the transpose of a rotation: by -angle
    if weight is None:
        return gz.to(x.dtype), None
    per_head = weight.shape[-1] == x.shape[-1]
    xf = x.to(ct) if per_head else x.to(ct).flatten(-2)
    gzf = gz if per_head else gz.flatten(-2)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    n = xf * r
    w = weight.to(ct) + offset
    gn = gzf * w
    gx = r * (gn - n * (gn * n).mean(-1, keepdim=True))
    dw = (gzf * n).reshape(-1, weight.shape[-1]).sum(0)
    return gx.view(x.shape).to(x.dtype), dw.to(weight.dtype)
