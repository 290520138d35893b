"""The oracle: RoPE written for clarity, in plain PyTorch, that the tests compare every path against.

Written to be obviously correct, not fast; nothing in the package runs it (the CPU path users get
is ropekit.core.cpu). Every function computes in float32 (float64 when given float64 inputs, which is
how tests use it) and returns tensors in the input dtype.

Conventions shared with the kernels:
- a cos/sin table row holds `rotary_dim // 2` frequencies; the cache is `[cos | sin]` per row;
- half-split rotation pairs dims (i, i + half); interleaved pairs (2i, 2i + 1); with
  rotary_position='halves' (Gemma 4's p-RoPE) the pairs are (i, i + D/2), i < half, of the whole head;
- a position outside `[0, max_position)` makes that token's rotated dims NaN (the tail is kept).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def mrope_sections_of_frequencies(
    half: int, mrope_section: Sequence[int], interleaved: bool, layout=None
) -> torch.Tensor:
    """For each of `half` frequencies, the index of the position row that drives it (int64). layout:
    apply_rope's mrope_layout (None: 'interleaved' if interleaved, else 'chunked')."""
    secs = [int(v) for v in mrope_section]
    n = len(secs)
    if layout is None:
        layout = "interleaved" if interleaved else "chunked"
    if not isinstance(layout, str):
        rows = [int(a) for a in layout]
    elif layout == "chunked":  # Qwen2-VL: section 0's pairs first, then section 1's, ...
        rows = sum(([a] * c for a, c in enumerate(secs)), [])
    elif layout == "interleaved":  # Qwen3-VL: row r at pairs r, r + n, r + 2n, ... (r > 0), up to n * secs[r]
        rows = [0] * half
        for r in range(1, n):
            for j in range(r, min(half, n * secs[r]), n):
                rows[j] = r
    elif layout in ("ernie", "bailing"):
        # ERNIE 4.5-VL sections (h, w, t), Bailing (t, h, w): spatial rows 1.. alternate, t last
        spatial = secs[:-1] if layout == "ernie" else secs[1:]
        rows = [1 + j % len(spatial) for j in range(sum(spatial))] if spatial else []
        rows += [0] * (half - len(rows))
    elif layout == "pangu":
        rows = _pangu_rows(secs)
    else:
        raise ValueError(f"unknown M-RoPE layout {layout!r}")
    assert len(rows) == half, (layout, secs, len(rows))
    return torch.tensor(rows, dtype=torch.long)


def _pangu_rows(secs):
    """openPangu's row order (vLLM's MRotaryEmbeddingInterleaved.get_mrope_interleaved_id_list, as
    it is called for 2 or 3 sections and extended to N): with 3 or more rows, row 0 keeps its last
    pair for the very end; otherwise, pair by pair, among rows with pairs left (not the previous
    pair's row unless no other has any), the lowest share placed / total, ties to the lower row."""
    total = list(secs)
    if len(secs) >= 3:
        total[0] -= 1
    placed = [0] * len(secs)
    rows, prev = [], -1
    while sum(placed) < sum(total):
        open_rows = [r for r in range(len(secs)) if placed[r] < total[r]]
        pick_from = [r for r in open_rows if r != prev] or open_rows
        r = min(pick_from, key=lambda r: (placed[r] / total[r], r))
        rows.append(r)
        placed[r] += 1
        prev = r
    return rows + ([0] if len(secs) >= 3 else [])


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    out_interleaved: Optional[bool] = None,
    inverse: bool = False,
    rotary_position: str = "first",
    eager_rounding: bool = False,
) -> torch.Tensor:
    """Rotate the first `2 * cos.shape[-1]` dims of every head of x.

    x: (*T, H, D). cos, sin: broadcastable to (*T, half). Returns a new tensor in x's dtype.
    `out_interleaved` (default: `interleaved`) picks the layout the rotated pairs are written in;
    `inverse` rotates by the negative angle (the backward of the forward rotation);
    rotary_position='halves' rotates the pairs (i, i + D/2), i < half, instead (half-split only),
    every other dim kept; 'last' the last 2 * half dims, the first ones kept. eager_rounding: cos
    and sin, each product and each sum rounded to x's dtype (ties to even), the value eager
    `x * cos + rotate_half(x) * sin` gives in that dtype.
    """
    if out_interleaved is None:
        out_interleaved = interleaved
    ct = compute_dtype(x)
    half = cos.shape[-1]
    rot = 2 * half
    if rotary_position == "last":  # the last rot dims rotated, the first ones kept
        how = dict(interleaved=interleaved, out_interleaved=out_interleaved, eager_rounding=eager_rounding)
        tail = rotate(x[..., x.shape[-1] - rot :], cos, sin, inverse=inverse, **how)
        return torch.cat((x[..., : x.shape[-1] - rot], tail), dim=-1)

    def rnd(t):
        # a product of two 16-bit values is exact in float32, and a float32 sum of two of them
        # rounds to the same 16-bit value as their exact sum: one rounding, as eager's op makes
        return t.to(x.dtype).to(ct) if eager_rounding else t

    c, s = rnd(cos.to(ct)).unsqueeze(-2), rnd(sin.to(ct)).unsqueeze(-2)
    if inverse:
        s = -s
    if rotary_position == "halves":
        gap = x.shape[-1] // 2
        x1, x2 = x[..., :half].to(ct), x[..., gap : gap + half].to(ct)
        out = x.clone()
        out[..., :half] = rnd(rnd(x1 * c) - rnd(x2 * s)).to(x.dtype)
        out[..., gap : gap + half] = rnd(rnd(x2 * c) + rnd(x1 * s)).to(x.dtype)
        return out
    xr = x[..., :rot].to(ct)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    o1 = rnd(rnd(x1 * c) - rnd(x2 * s))
    o2 = rnd(rnd(x2 * c) + rnd(x1 * s))
    if out_interleaved:
        o = torch.stack((o1, o2), dim=-1).flatten(-2)
    else:
        o = torch.cat((o1, o2), dim=-1)
    return torch.cat((o.to(x.dtype), x[..., rot:]), dim=-1)


def angles_from_table(
    cos_sin_cache: torch.Tensor,
    positions: Optional[torch.Tensor],
    token_shape: Sequence[int],
    *,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    mrope_layout=None,
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
        mrope_layout=mrope_layout,
    )


def gather_angles(
    cos_table, sin_table, positions, token_shape, *, mrope_section=None, mrope_interleaved=False, mrope_layout=None
):
    """Rows of (max_position, half) cos and sin tables at positions (*T), or (N, *T) for M-RoPE.

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
    if positions.dim() == len(token_shape) + 1:  # M-RoPE: (N, *T)
        sec = mrope_sections_of_frequencies(half, mrope_section, mrope_interleaved, mrope_layout)
        sec = sec.to(cos_table.device)
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
    mrope_layout=None,
    inplace: bool = False,
    rotary_position: str = "first",
    inverse: bool = False,
    q_temperature: Optional[Sequence[float]] = None,
    eager_rounding: bool = False,
):
    """Same contract as `ropekit.apply_rope` (no validation: the public op validates); inverse
    rotates by -angle; q_temperature (floor_scale, attn_scale): q's outputs times
    log(floor((positions + 1) / floor_scale) + 1) * attn_scale + 1 of their token (float64);
    eager_rounding: `rotate`'s. A per-head table (max_position, Ht, rotary_dim): `rotate_by_head_table`."""
    token_shape = q.shape[:-2]
    if cos_sin_cache.dim() == 3:
        q_out, k_out = (
            None
            if x is None
            else rotate_by_head_table(
                x, positions, cos_sin_cache, interleaved, inverse, rotary_position, eager_rounding
            )
            for x in (q, k)
        )
    else:
        cos, sin = angles_from_table(
            cos_sin_cache,
            positions,
            token_shape,
            rotary_dim=rotary_dim,
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            mrope_layout=mrope_layout,
        )
        if inverse:
            sin = -sin
        how = dict(interleaved=interleaved, rotary_position=rotary_position, eager_rounding=eager_rounding)
        q_out = rotate(q, cos, sin, **how)
        k_out = None if k is None else rotate(k, cos, sin, **how)
    if q_temperature is not None:
        floor_scale, attn_scale = q_temperature
        p = torch.broadcast_to(positions, token_shape).double()
        factor = torch.log(torch.floor((p + 1) / floor_scale) + 1) * attn_scale + 1
        q_out = (q_out.double() * factor[..., None, None]).to(q_out.dtype)
    if inplace:
        q.copy_(q_out)
        if k is not None:
            k.copy_(k_out)
        return q, k
    return q_out, k_out


def rotate_by_head_table(
    x, positions, table, interleaved=False, inverse=False, rotary_position="first", eager_rounding=False
):
    """x (*T, H, D) rotated by a per-head [cos | sin] table (max_position, Ht, rotary_dim): head j
    reads table head j // (H / Ht), its row at the token's position (NaN rows outside the table).
    rotary_position 'last' rotates the last rotary_dim dims, keeping the first ones."""
    max_pos, n_table, rot = table.shape
    half = rot // 2
    n_heads = x.shape[-2]
    head_of = torch.arange(n_heads, device=table.device) // (n_heads // n_table)
    p = torch.broadcast_to(positions, x.shape[:-2]).long()
    valid = ((p >= 0) & (p < max_pos))[..., None, None]
    rows = table[p.clamp(0, max_pos - 1)][..., head_of, :]  # (*T, H, rot)
    rows = torch.where(valid, rows, torch.tensor(float("nan"), dtype=table.dtype, device=table.device))
    cos, sin = rows[..., :half], rows[..., half:]
    if inverse:
        sin = -sin
    # each head as a token of one head: rotate()'s cos / sin broadcast over that one head
    if rotary_position == "last":
        keep = x.shape[-1] - rot
        part = rotate(x[..., keep:].unsqueeze(-2), cos, sin, interleaved=interleaved, eager_rounding=eager_rounding)
        return torch.cat((x[..., :keep], part.squeeze(-2)), dim=-1)
    out = rotate(
        x.unsqueeze(-2),
        cos,
        sin,
        interleaved=interleaved,
        rotary_position=rotary_position,
        eager_rounding=eager_rounding,
    )
    return out.squeeze(-2)


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
    mrope_section=None,
    mrope_interleaved=False,
    mrope_layout=None,
    q_norm_weight=None,
    k_norm_weight=None,
    norm_eps=1e-6,
    norm_weight_offset=0.0,
    rotary_position="first",
    l2_norm=False,
):
    """Oracle for the fused store: rotate q in place, rotate k, write k and v rows at their slots.

    k_cache / v_cache: (num_blocks, block_size, Hk, D) or (num_slots, Hk, D). Slots < 0 are skipped.
    fp8 caches store value / scale. positions (N, *T) with mrope_section (mrope_layout as apply_rope's); norm
    weights: q / k RMS-normalized first (whole heads), as `rms_norm_rope`, or with l2_norm after the rotation.
    Packed sequences: pass the positions
    `ropekit.positions_from_cu_seqlens` gives.
    """
    q_rot, k_rot = rms_norm_rope(
        q,
        k,
        positions,
        cos_sin_cache,
        interleaved=interleaved,
        rotary_dim=rotary_dim,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        mrope_layout=mrope_layout,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        norm_eps=norm_eps,
        norm_weight_offset=norm_weight_offset,
        rotary_position=rotary_position,
        l2_norm=l2_norm,
    )
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
    k_cache,
    slots,
    delta,
    cos_sin_cache,
    *,
    interleaved=False,
    rotary_dim=None,
    k_scale=None,
    dst_slots=None,
    rotary_position="first",
    positions=None,
    to_cache=None,
):
    """Oracle of `ropekit.rerotate_kv_cache`: re-rotate cache rows by a position shift.

    k_cache: (num_blocks, block_size, H, D) or (num_slots, H, D), written in place (float64 caches
    compute in float64, others in float32). slots (N,): rows to re-rotate; delta (N,) or an int. The
    row at slots[i] (stored for position p) is rotated by the angle of delta[i] (inverse rotation by
    |delta[i]| when negative), so it holds the key for p + delta[i], and written to dst_slots[i] (or
    back to slots[i]). Rows with a negative slot or dst slot, or one >= num_slots, are skipped; a
    |delta| outside the table makes the row's rotated dims NaN. k_scale: the cache holds value /
    k_scale. With dst_slots the dims past rotary_dim are copied unchanged. rotary_position='halves':
    the rotated pairs are (i, i + D/2), the other dims kept likewise. to_cache (with positions
    (N,), each row's stored position): the row, rotated for positions[i] by cos_sin_cache, is
    de-rotated exactly (divided by that row's complex value, magnitude included) and rotated by
    to_cache row positions[i] + delta[i]; NaN where either row is outside its table. Returns k_cache.
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
    p = None if positions is None else positions.long().to(k_cache.device)[keep]

    def rows(idx):
        return (idx // block_size, idx % block_size) if k_cache.dim() == 4 else (idx,)

    ct = compute_dtype(k_cache)
    row = k_cache[rows(src)]  # a gathered copy: (n, H, D)
    # the rotated dims, gathered into the first-rot layout (rotary_position='halves': two runs)
    gap = k_cache.shape[-1] // 2 if rotary_position == "halves" else half
    cols = torch.cat((torch.arange(half), torch.arange(gap, gap + half))).to(k_cache.device)
    x = row[..., cols].to(ct)
    scale = None if k_scale is None else float(k_scale.reshape(()) if isinstance(k_scale, torch.Tensor) else k_scale)
    if scale is not None:
        x = x * scale
    if to_cache is None:
        mag = d.abs()
        cos, sin = gather_angles(
            cos_sin_cache[:, :half].to(ct), cos_sin_cache[:, half:rot].to(ct), mag, (mag.shape[0],)
        )
        sin = torch.where((d < 0).unsqueeze(-1), -sin, sin)
    else:
        # complex arithmetic: to_row / from_row, each row c + i s (an attention factor is its modulus)
        def row_at(table, idx):
            inside = (idx >= 0) & (idx < table.shape[0])
            z = torch.complex(table[:, :half].double(), table[:, half:rot].double())[idx.clamp(0, table.shape[0] - 1)]
            return torch.where(inside.unsqueeze(-1), z, torch.full_like(z, complex(math.nan, math.nan)))

        # positions + d in Python ints (no int64 wrap for any delta); -1 outside the table
        rows_to = to_cache.shape[0]
        to_idx = [a + b if 0 <= a + b < rows_to else -1 for a, b in zip(p.tolist(), d.tolist())]
        to_idx = torch.tensor(to_idx, dtype=torch.long, device=k_cache.device)
        z = row_at(to_cache, to_idx) / row_at(cos_sin_cache, p)
        cos, sin = z.real.to(ct), z.imag.to(ct)
    out = rotate(x, cos, sin, interleaved=interleaved)
    if scale is not None:
        out = out / scale
    # the whole row back: its other dims unchanged in place (src is dst), copied with dst_slots
    row[..., cols] = out.to(k_cache.dtype)
    k_cache[rows(dst)] = row
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
    mrope_layout=None,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
    rotary_position: str = "first",
    l2_norm: bool = False,
):
    """Oracle of apply_rope with q/k RMSNorm: each of q and k normalized (when its weight is given;
    the whole head, tail included) then rotated; one rounding to the input dtype. l2_norm (Llama
    4's order, as its attention applies it): each head of q and k rotated first, then divided by
    sqrt(mean(head^2) + norm_eps), no weight. Differentiable (autograd through it is the backward
    oracle); float64 inputs compute in float64."""
    cos, sin = angles_from_table(
        cos_sin_cache,
        positions,
        q.shape[:-2],
        rotary_dim=rotary_dim,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        mrope_layout=mrope_layout,
    )
    outs = []
    for x, w in ((q, q_norm_weight), (k, k_norm_weight)):
        if x is None:
            outs.append(None)
            continue
        if l2_norm:
            xc = x.to(compute_dtype(x))
            y = rotate(xc, cos, sin, interleaved=interleaved, rotary_position=rotary_position)
            ms = y.pow(2).mean(-1, keepdim=True)
            # a position outside the table makes the rotated dims NaN (the ops' contract), not the
            # whole head: the mean square of such a head is x's (a rotation keeps it)
            ms = torch.where(
                torch.isnan(cos).any(-1)[..., None, None].expand_as(ms), xc.pow(2).mean(-1, keepdim=True), ms
            )
            y = y / torch.sqrt(ms + norm_eps)
            outs.append(y.to(x.dtype))
            continue
        y = x if w is None else rms_norm(x, w, eps=norm_eps, offset=norm_weight_offset)
        outs.append(rotate(y, cos, sin, interleaved=interleaved, rotary_position=rotary_position).to(x.dtype))
    return outs[0], outs[1]


# ---------------------------------------------------------------------------------------------
# NVFP4: e2m1 values two to a byte, one e4m3 scale per 16 values, a per-tensor global scale

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the e2m1 magnitudes, by code 0..7


def round_to_grid(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Indices into grid (ascending, >= 0) of |x| rounded to nearest, ties to the even index,
    saturated at the last point; NaN gives index 0 (the caller keeps NaN apart)."""
    m = x.abs().nan_to_num(nan=0.0).clamp(max=float(grid[-1]))
    hi = torch.searchsorted(grid, m).clamp(max=grid.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = m - grid[lo], grid[hi] - m
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def e4m3_grid(device=None) -> torch.Tensor:
    """float8_e4m3fn's finite non-negative values, ascending, in float64 (codes 0..126)."""
    return torch.arange(127, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).double()


def nvfp4_quantize(x: torch.Tensor, global_scale: float = 1.0):
    """NVFP4 of x (..., D), D a multiple of 16, in float64: (e2m1 values (..., D) as signed floats
    of E2M1_GRID, block scales (..., D / 16) as float64 e4m3 values). Per block of 16 consecutive
    values: scale = amax / 6 / global_scale rounded to nearest even onto e4m3 (saturated at 448,
    NaN stays NaN); value = x / (scale * global_scale) rounded to nearest even onto the grid
    (saturated at 6), 0 where the scale is 0."""
    x = x.double()
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    amax = blocks.abs().amax(-1)
    grid = e4m3_grid(x.device)
    raw = amax / 6.0 / float(global_scale)
    scale = grid[round_to_grid(raw, grid)]
    scale = torch.where(torch.isnan(raw), float("nan"), scale)
    den = (scale * float(global_scale))[..., None]
    m = torch.where(den > 0, blocks / torch.where(den > 0, den, 1.0), 0.0)
    e2m1 = torch.tensor(E2M1_GRID, dtype=torch.float64, device=x.device)
    vals = e2m1[round_to_grid(m, e2m1)] * torch.where(m < 0, -1.0, 1.0)
    return vals.reshape(x.shape), scale


def nvfp4_dequantize(values: torch.Tensor, scales: torch.Tensor, global_scale: float = 1.0) -> torch.Tensor:
    """values (..., D) * their block's scale (..., D / 16) * global_scale, float64."""
    blocks = values.double().reshape(*values.shape[:-1], values.shape[-1] // 16, 16)
    return (blocks * scales.double()[..., None] * float(global_scale)).reshape(values.shape)


def nvfp4_unpack(data: torch.Tensor, scales: torch.Tensor, global_scale: float = 1.0) -> torch.Tensor:
    """The float64 values of NVFP4 rows: data (..., D / 2) uint8, element 2j in the low nibble of
    byte j and 2j + 1 in the high one (bit 3 of a nibble the sign, bits 0-2 the index into
    E2M1_GRID); scales (..., D / 16) float8_e4m3fn."""
    e2m1 = torch.tensor(E2M1_GRID, dtype=torch.float64, device=data.device)
    b = data.long()
    nibbles = torch.stack((b & 0xF, b >> 4), -1).reshape(*data.shape[:-1], 2 * data.shape[-1])
    vals = e2m1[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0)
    return nvfp4_dequantize(vals, scales.double(), global_scale)
