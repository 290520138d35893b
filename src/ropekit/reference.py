"""Pure-PyTorch RoPE: the CPU path and the test oracle.

Written for clarity, not speed. Every function computes in float32 (float64 when given float64
inputs, which is how tests use it as an oracle) and returns tensors in the input dtype.

Conventions shared with the kernels:
- a cos/sin table row holds `rotary_dim // 2` frequencies; the cache is `[cos | sin]` per row;
- half-split rotation pairs dims (i, i + half); interleaved pairs (2i, 2i + 1);
- a position outside `[0, max_position)` makes that token's rotated dims NaN (the tail is kept).
"""

from __future__ import annotations

import math
import threading
from typing import Optional, Sequence

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def mrope_sections_of_frequencies(half: int, mrope_section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """For each of `half` frequencies, the index (0 t, 1 h, 2 w) of the position row that drives it."""
    t, h, w = (int(v) for v in mrope_section)
    i = torch.arange(half)
    if not interleaved:
        return (i >= t).long() + (i >= t + h).long()
    sec = torch.zeros(half, dtype=torch.long)
    sec[(i % 3 == 1) & (i < 3 * h)] = 1
    sec[(i % 3 == 2) & (i < 3 * w)] = 2
    return sec


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    out_interleaved: Optional[bool] = None,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate the first `2 * cos.shape[-1]` dims of every head of x.

    x: (*T, H, D). cos, sin: broadcastable to (*T, half). Returns a new tensor in x's dtype.
    `out_interleaved` (default: `interleaved`) picks the layout the rotated pairs are written in;
    `inverse` rotates by the negative angle (the backward of the forward rotation).
    """
    if out_interleaved is None:
        out_interleaved = interleaved
    ct = compute_dtype(x)
    half = cos.shape[-1]
    rot = 2 * half
    xr = x[..., :rot].to(ct)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    c = cos.to(ct).unsqueeze(-2)
    s = sin.to(ct).unsqueeze(-2)
    if inverse:
        s = -s
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if out_interleaved:
        o = torch.stack((o1, o2), dim=-1).flatten(-2)
    else:
        o = torch.cat((o1, o2), dim=-1)
    return torch.cat((o.to(x.dtype), x[..., rot:]), dim=-1)


_workspace = threading.local()


def _scratch(shape, dtype, slot: int) -> torch.Tensor:
    """A per-thread float scratch tensor of `shape`, reused across calls (large CPU allocations
    are fresh pages each time: reuse saves their page faults). slot picks one of two buffers."""
    n = math.prod(shape)
    bufs = getattr(_workspace, "bufs", None)
    if bufs is None:
        bufs = _workspace.bufs = {}
    b = bufs.get((slot, dtype))
    if b is None or b.numel() < n:
        b = bufs[(slot, dtype)] = torch.empty(max(n, 1), dtype=dtype)
    return b[:n].view(shape)


_BLOCK_ELEMS = 1 << 18  # elements of one scratch block (1 MB in float32): half a core's L2


def _blocks(lead, rows):
    """Index tuples that cut the leading dims into blocks of at most ~rows rows (whole inner dims,
    a slice of one dim, every index of the dims outside it)."""
    import itertools

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


def _rotate_block(x, out, c, s, xs, ts, half, interleaved, out_interleaved):
    """One block of rotate_into: xs / ts are compute-dtype scratch for x's rotated dims and the
    results (None: read x and write out directly)."""
    rot = 2 * half
    xr = x[..., :rot] if xs is None else xs.copy_(x[..., :rot])
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    target = out[..., :rot] if ts is None else ts
    t1, t2 = (target[..., 0::2], target[..., 1::2]) if out_interleaved else (target[..., :half], target[..., half:])
    torch.mul(x1, c, out=t1)
    t1.addcmul_(x2, s, value=-1.0)  # x1 cos - x2 sin
    torch.mul(x2, c, out=t2)
    t2.addcmul_(x1, s)  # x2 cos + x1 sin
    if ts is not None:
        out[..., :rot].copy_(ts)


def rotate_into(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    out_interleaved: Optional[bool] = None,
    inverse: bool = False,
) -> torch.Tensor:
    """The fast CPU rotation: `rotate` written into `out`, without intermediate tensors of x's size.

    x: (*T, H, D) fp16/bf16/fp32 (float64 computes in float64). out: x's shape and dtype; it may
    be x itself (in place) but must not partially overlap it. cos, sin: broadcastable to
    (*T, half), any float dtype; half = cos.shape[-1], the first 2 * half dims are rotated. When
    out is not x, dims past 2 * half are copied from x. Math in float32: each output half is one
    multiply into a float32 scratch buffer plus one fused multiply-add (addcmul), then one cast
    into out. Returns out.

    On CPU tensors the scratch buffers are kept per thread between calls.
    """
    if out_interleaved is None:
        out_interleaved = interleaved
    result = out
    ct = compute_dtype(x)
    half = cos.shape[-1]
    rot = 2 * half
    c = cos.to(ct).unsqueeze(-2)
    s = sin.to(ct).unsqueeze(-2)
    if inverse:
        s = -s
    same = out.data_ptr() == x.data_ptr()
    cpu = x.device.type == "cpu"
    # walk the leading dims in x's memory order (HF's (B, S, H, D) views of (B, H, S, D) storage):
    # every pass then streams through memory instead of striding across it
    nd = x.dim() - 1
    perm = sorted(range(nd), key=lambda d: -x.stride(d))
    if perm != list(range(nd)):
        full = tuple(x.shape[:-1]) + (half,)
        c, s = c.expand(full).permute(*perm, nd), s.expand(full).permute(*perm, nd)
        x, out = x.permute(*perm, nd), out.permute(*perm, nd)
    lead = tuple(x.shape[:-1])
    direct = out.dtype == ct and not same and x.dtype == ct
    if direct:  # float32 out of place: results go straight into out, no scratch, one block
        _rotate_block(x, out, c, s, None, None, half, interleaved, out_interleaved)
    elif x.numel() <= _BLOCK_ELEMS * 2 * half // max(x.shape[-1], 1):
        # small enough for one block: no slicing (decode calls pay for every view)
        xs = (
            None
            if x.dtype == ct
            else (_scratch(lead + (rot,), ct, 0) if cpu else torch.empty(lead + (rot,), dtype=ct, device=x.device))
        )
        ts = _scratch(lead + (rot,), ct, 1) if cpu else torch.empty(lead + (rot,), dtype=ct, device=x.device)
        _rotate_block(x, out, c, s, xs, ts, half, interleaved, out_interleaved)
    else:
        # through scratch, in blocks of the leading dims small enough to stay in cache between the
        # passes (cast in, two multiplies, two multiply-adds, cast out)
        full = lead + (half,)
        c, s = c.expand(full), s.expand(full)
        for index in _blocks(lead, _BLOCK_ELEMS // max(rot, 1)):
            xb, ob = x[index], out[index]
            shape = tuple(xb.shape[:-1]) + (rot,)
            xs = (
                None
                if x.dtype == ct
                else (_scratch(shape, ct, 0) if cpu else torch.empty(shape, dtype=ct, device=x.device))
            )
            ts = _scratch(shape, ct, 1) if cpu else torch.empty(shape, dtype=ct, device=x.device)
            _rotate_block(xb, ob, c[index], s[index], xs, ts, half, interleaved, out_interleaved)
    if not same and x.shape[-1] > rot:
        out[..., rot:].copy_(x[..., rot:])
    return result


def angles_from_table(
    cos_sin_cache: torch.Tensor,
    positions: Optional[torch.Tensor],
    token_shape: Sequence[int],
    *,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
):
    """cos, sin of shape (*token_shape, rotary_dim // 2) gathered from a [cos | sin] table."""
    rot = cos_sin_cache.shape[-1] if rotary_dim is None else rotary_dim
    half = rot // 2
    return gather_angles(
        cos_sin_cache[:, :half],
        cos_sin_cache[:, half:rot],
        positions,
        token_shape,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
    )


def gather_angles(cos_table, sin_table, positions, token_shape, *, mrope_section=None, mrope_interleaved=False):
    """Rows of (max_position, half) cos and sin tables at positions (*T), or (3, *T) for M-RoPE.

    None means arange over the last token dim. An out-of-range position gives NaN rows."""
    max_pos, half = cos_table.shape
    if positions is None:
        positions = torch.arange(token_shape[-1], device=cos_table.device).expand(*token_shape)
    positions = positions.long()
    valid = (positions >= 0) & (positions < max_pos)
    rows = positions.clamp(0, max_pos - 1)
    nan = torch.tensor(float("nan"), dtype=cos_table.dtype, device=cos_table.device)
    cos = torch.where(valid.unsqueeze(-1), cos_table[rows], nan)
    sin = torch.where(valid.unsqueeze(-1), sin_table[rows], nan)
    if positions.dim() == len(token_shape) + 1:  # M-RoPE: (3, *T)
        sec = mrope_sections_of_frequencies(half, mrope_section, mrope_interleaved).to(cos_table.device)
        pick = sec.view(1, *([1] * len(token_shape)), half).expand(1, *cos.shape[1:])
        cos = cos.gather(0, pick).squeeze(0)
        sin = sin.gather(0, pick).squeeze(0)
    return cos, sin


def pair_positions(positions: torch.Tensor, axes: Sequence[int], half: int) -> torch.Tensor:
    """(*T, half): the position that drives each rotary pair. positions (*T) drives every pair
    (axes empty); with axes (pairs per axis), row a of positions (len(axes), *T) drives axis a's pairs."""
    if not axes:
        return positions.unsqueeze(-1).expand(*positions.shape, half)
    rows = torch.repeat_interleave(torch.arange(len(axes)), torch.tensor(axes)).to(positions.device)
    return positions[rows].movedim(0, -1)


def angles_from_freqs(positions, inv_freq, axes: Sequence[int] = (), dtype=torch.float32):
    """cos, sin (*T, half) of the angles positions x inv_freq (axial: `pair_positions`), computed
    in float64 and rounded once to dtype."""
    angle = pair_positions(positions, axes, inv_freq.shape[0]).double() * inv_freq.double()
    return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rope(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    inplace: bool = False,
):
    """Same contract as `ropekit.apply_rope` (no validation: the public op validates)."""
    token_shape = q.shape[:-2]
    cos, sin = angles_from_table(
        cos_sin_cache,
        positions,
        token_shape,
        rotary_dim=rotary_dim,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
    )
    q_out = rotate(q, cos, sin, interleaved=interleaved)
    k_out = None if k is None else rotate(k, cos, sin, interleaved=interleaved)
    if inplace:
        q.copy_(q_out)
        if k is not None:
            k.copy_(k_out)
        return q, k
    return q_out, k_out


def store_rows(
    q,
    k,
    v,
    positions,
    cos_sin_cache,
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
):
    """The fused store's CPU path, with the kernel's semantics: float32 math, one rounding into the
    cache dtype (no detour through k's dtype), fp8 outputs saturated, slots past the cache skipped
    and flagged in q (NaN). k_scale / v_scale / q_scale: None or 1-element float32 tensors. q_out:
    None (q rotated in place) or where rotated q / q_scale goes; write_key: rotated k back into k."""
    n_tok = q.dim() - 2
    block_size = k_cache.shape[1] if k_cache.dim() == 4 else 1
    slots = slot_mapping.long()
    bad = slots >= k_cache.shape[0] * block_size
    keep = (slots >= 0) & ~bad
    rot = rotary_dim
    cos, sin = angles_from_table(cos_sin_cache, positions, tuple(q.shape[:n_tok]), rotary_dim=rot)
    q_rot = rotate(q.float(), cos, sin, interleaved=interleaved)
    if bool(bad.any()):
        q_rot[..., :rot][bad] = float("nan")
    (q if q_out is None else q_out).copy_(_scaled_for(q_rot, q_scale, q if q_out is None else q_out))
    idx = slots[keep]
    k_rot = rotate(k.float(), cos, sin, interleaved=interleaved)
    if write_key:
        k[..., :rot] = k_rot[..., :rot].to(k.dtype)
    for cache, rows, scale in ((k_cache, k_rot, k_scale), (v_cache, v.float(), v_scale)):
        vals = _scaled_for(rows[keep], scale, cache)
        if cache.dim() == 4:
            cache[idx // block_size, idx % block_size] = vals
        else:
            cache[idx] = vals


def _scaled_for(vals, scale, out):
    """float32 values divided by scale (None: 1) and rounded once into out's dtype, saturated to
    the fp8 range (NaN kept) when out is fp8."""
    if scale is not None:
        vals = vals / scale.reshape(()).float()
    if out.element_size() == 1:
        limit = torch.finfo(out.dtype).max
        vals = vals.clamp(-limit, limit)
    return vals.to(out.dtype)


def apply_rope_and_store(
    q,
    k,
    v,
    positions,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    interleaved=False,
    rotary_dim=None,
    k_scale=None,
    v_scale=None,
):
    """Oracle for the fused store: rotate q in place, rotate k, write k and v rows at their slots.

    k_cache / v_cache: (num_blocks, block_size, Hk, D) or (num_slots, Hk, D). Slots < 0 are skipped.
    fp8 caches store value / scale.
    """
    q_rot, k_rot = apply_rope(q, k, positions, cos_sin_cache, interleaved=interleaved, rotary_dim=rotary_dim)
    q.copy_(q_rot)
    slots = slot_mapping.long()
    slots = slots[slots >= 0]
    keep = slot_mapping.long() >= 0
    for cache, rows, scale in ((k_cache, k_rot, k_scale), (v_cache, v, v_scale)):
        vals = rows[keep].float()
        if scale is not None:
            vals = vals / float(scale)
        vals = vals.to(cache.dtype)
        if cache.dim() == 4:  # paged: (num_blocks, block_size, Hk, D)
            block_size = cache.shape[1]
            cache[slots // block_size, slots % block_size] = vals
        else:  # flat: (num_slots, Hk, D)
            cache[slots] = vals
    return q


def rerotate_kv_cache(
    k_cache, slots, delta, cos_sin_cache, *, interleaved=False, rotary_dim=None, k_scale=None, dst_slots=None
):
    """Oracle and CPU path of `ropekit.rerotate_kv_cache`: re-rotate cache rows by a position shift.

    k_cache: (num_blocks, block_size, H, D) or (num_slots, H, D), written in place (float64 caches
    compute in float64, others in float32). slots (N,): rows to re-rotate; delta (N,) or an int. The
    row at slots[i] (stored for position p) is rotated by the angle of delta[i] (inverse rotation by
    |delta[i]| when negative), so it holds the key for p + delta[i], and written to dst_slots[i] (or
    back to slots[i]). Rows with a negative slot or dst slot, or one >= num_slots, are skipped; a
    |delta| outside the table makes the row's rotated dims NaN. k_scale: the cache holds value /
    k_scale. With dst_slots the dims past rotary_dim are copied unchanged. Returns k_cache.
    """
    rot = cos_sin_cache.shape[-1] if rotary_dim is None else rotary_dim
    half = rot // 2
    n = slots.shape[0]
    block_size = k_cache.shape[1] if k_cache.dim() == 4 else 1
    num_slots = k_cache.shape[0] * block_size
    src = slots.long().to(k_cache.device)
    dst = src if dst_slots is None else dst_slots.long().to(k_cache.device)
    if isinstance(delta, torch.Tensor):
        d = delta.long().to(k_cache.device)
    else:
        d = torch.full((n,), int(delta), dtype=torch.long, device=k_cache.device)
    keep = (src >= 0) & (src < num_slots) & (dst >= 0) & (dst < num_slots)
    src, dst, d = src[keep], dst[keep], d[keep]

    def rows(idx):
        return (idx // block_size, idx % block_size) if k_cache.dim() == 4 else (idx,)

    ct = compute_dtype(k_cache)
    x = k_cache[rows(src)]  # a gathered copy: (n, H, D)
    tail = x[..., rot:].clone()
    x = x[..., :rot].to(ct)
    scale = None if k_scale is None else float(k_scale.reshape(()) if isinstance(k_scale, torch.Tensor) else k_scale)
    if scale is not None:
        x = x * scale
    mag = d.abs()
    cos, sin = gather_angles(cos_sin_cache[:, :half].to(ct), cos_sin_cache[:, half:rot].to(ct), mag, (mag.shape[0],))
    sin = torch.where((d < 0).unsqueeze(-1), -sin, sin)
    out = rotate(x, cos, sin, interleaved=interleaved)
    if scale is not None:
        out = out / scale
    view = k_cache[..., :rot]
    view[rows(dst)] = out.to(k_cache.dtype)
    if dst_slots is not None and rot < k_cache.shape[-1]:
        k_cache[..., rot:][rows(dst)] = tail
    return k_cache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of x (*T, H, D) over each head (weight (D,)) or over all heads of a token (weight
    (H*D,)): x * rsqrt(mean(x^2) + eps) * (weight + offset), returned UNROUNDED in the compute dtype
    (float32, float64 for float64 x) so that the rotation after it rounds once, as the kernel does."""
    ct = compute_dtype(x)
    xc = x.to(ct)
    w = weight.to(ct) + offset
    if weight.shape[-1] == x.shape[-1]:
        r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        return xc * r * w
    flat = xc.flatten(-2)
    r = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    return (flat * r * w).view(xc.shape)


def rms_norm_rope(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
):
    """Oracle of apply_rope with q/k RMSNorm: each of q and k normalized (when its weight is given;
    the whole head, tail included) then rotated; one rounding to the input dtype. Differentiable
    (autograd through it is the backward oracle); float64 inputs compute in float64."""
    cos, sin = angles_from_table(
        cos_sin_cache,
        positions,
        q.shape[:-2],
        rotary_dim=rotary_dim,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
    )
    outs = []
    for x, w in ((q, q_norm_weight), (k, k_norm_weight)):
        if x is None:
            outs.append(None)
            continue
        y = x if w is None else rms_norm(x, w, eps=norm_eps, offset=norm_weight_offset)
        outs.append(rotate(y, cos, sin, interleaved=interleaved).to(x.dtype))
    return outs[0], outs[1]
