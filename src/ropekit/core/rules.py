"""The argument rules of the ops, one function per group of arguments (q / k, the table, M-RoPE,
inverse frequencies, outputs, packed sequences, per-token angles, caches and slots, scales, norm
weights). ropekit.core.checks composes them into one entry per op. Shapes, strides, dtypes and
devices only: no data read, no device sync (those are ropekit.core.strict's).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from .aliasing import has_internal_overlap, inplace_aliasing
from .args import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    INDEX_DTYPES,
    NUMBERS,
    OUT_DTYPES,
    POSITION_DTYPES,
    TABLE_DTYPES,
    addresses_known,
    broadcasts_to,
    dtype_name,
    fail,
    heads_first_hint,
    tensor,
)
from .forms import full_width_angles
from .strict import int_shift
from .variant import MROPE_LAYOUTS, mrope_axes, mrope_mode


def qk_args(op, q, k, any_last_stride=False) -> tuple:
    """q and k: rank, dtype, device, unit last stride (unless any_last_stride: apply_rope reads
    other layouts through a copy), matching token dims. Returns the token shape."""
    unit = not any_last_stride
    tensor(op, "q", q, ndims=(3, 4), dtypes=FLOAT_DTYPES, shape_hint="(T, H, D) or (B, S, H, D)", last_stride_one=unit)
    token_shape = tuple(q.shape[:-2])
    if k is not None:
        tensor(
            op,
            "k",
            k,
            ndims=(q.dim(),),
            dtypes=FLOAT_DTYPES,
            device=q.device,
            shape_hint=lambda: f"with the token dims of q {token_shape}",
            last_stride_one=unit,
        )
        if tuple(k.shape[:-2]) != token_shape:
            hint = heads_first_hint(q, (k.shape[0], k.shape[2])) if k.dim() == 4 else ""
            fail(op, "k", f"token dims {token_shape} (those of q)", f"shape {tuple(k.shape)}{hint}")
        if k.dtype != q.dtype:
            fail(op, "k", f"the dtype of q ({dtype_name(q.dtype)})", dtype_name(k.dtype))
    return token_shape


class MRope(NamedTuple):
    """Validated M-RoPE arguments: the sections as given, Variant.mrope's mode, the axis map."""

    sections: Tuple[int, ...]
    mode: int
    axis_map: Tuple[int, ...]

    @property
    def rows(self) -> int:
        """Position rows: positions are (rows, *T)."""
        return len(self.sections)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def mrope_args(op, mrope_section, mrope_interleaved, half, mrope_layout=None) -> Optional[MRope]:
    """None, or the M-RoPE of N >= 1 sections summing to half laid out by mrope_layout: a preset
    name (MROPE_LAYOUTS; None: 'interleaved' with mrope_interleaved, else 'chunked') or an explicit
    map of half row indices in [0, N)."""
    if mrope_section is None:
        if mrope_interleaved:
            fail(op, "mrope_interleaved", "mrope_section to be given with it", "mrope_section=None")
        if mrope_layout is not None:
            fail(op, "mrope_layout", "mrope_section to be given with it", "mrope_section=None")
        return None
    if (
        not isinstance(mrope_section, (list, tuple))
        or len(mrope_section) < 1
        or not all(_is_int(v) and v >= 0 for v in mrope_section)
    ):
        fail(op, "mrope_section", "N >= 1 non-negative ints (pairs per position row)", mrope_section)
    sections = tuple(mrope_section)
    if sum(sections) != half:
        fail(op, "mrope_section", f"sections summing to rotary_dim // 2 = {half}", f"{sections} (sum {sum(sections)})")
    layout = mrope_layout
    if layout is None:
        layout = "interleaved" if mrope_interleaved else "chunked"
    elif mrope_interleaved and layout != "interleaved":
        fail(op, "mrope_interleaved", "False with mrope_layout (the layout names the order)", True)
    if isinstance(layout, str):
        _preset_args(op, layout, sections)
    elif isinstance(layout, (list, tuple)):
        n = len(sections)
        if len(layout) != half:
            fail(op, "mrope_layout", f"{half} row indices (one per rotary pair)", _short(layout))
        for j, a in enumerate(layout):
            if not (_is_int(a) and 0 <= a < n):
                fail(op, "mrope_layout", f"row indices in [0, {n}) (one per section)", f"mrope_layout[{j}] = {a!r}")
    else:
        fail(op, "mrope_layout", f"a preset name {MROPE_LAYOUTS} or a sequence of row indices", type(layout).__name__)
    axis_map = mrope_axes(layout, sections)
    return MRope(sections, mrope_mode(sections, axis_map), axis_map)


def _short(seq) -> str:
    items = list(seq)
    return f"{items[:8]}{' ...' if len(items) > 8 else ''} ({len(items)} entries)"


def _preset_args(op, layout: str, sections: tuple) -> None:
    """A preset's conditions on the sections."""
    if layout not in MROPE_LAYOUTS:
        fail(op, "mrope_layout", f"one of {MROPE_LAYOUTS} or a sequence of row indices", repr(layout))
    if layout in ("ernie", "bailing"):
        spatial = sections[:-1] if layout == "ernie" else sections[1:]
        if len(set(spatial)) > 1:
            order = "(s_1, ..., s_{N-1}, t)" if layout == "ernie" else "(t, s_1, ..., s_{N-1})"
            fail(op, "mrope_section", f"equal spatial sections s_a for mrope_layout={layout!r}: {order}", sections)
    if layout == "pangu" and len(sections) >= 3 and sections[0] < 1:
        fail(op, "mrope_section", "a first section >= 1 for mrope_layout='pangu' with 3 rows or more", sections)


def head_sizes(op, q, k, rotary_dim):
    for name, x in (("q", q), ("k", k)):
        if x is not None and x.shape[-1] < rotary_dim:
            fail(op, name, f"a head size >= rotary_dim ({rotary_dim})", f"head size {x.shape[-1]}")


def table_rotary_dim(op, cos_sin_cache, rotary_dim) -> int:
    """rotary_dim checked against a [cos | sin] table's width (None: the width)."""
    width = cos_sin_cache.shape[-1]
    if rotary_dim is None:
        rotary_dim = width
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"{op}: rotary_dim: expected an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2:
        fail(op, "rotary_dim", "a positive even int", rotary_dim)
    if rotary_dim != width:
        fail(op, "rotary_dim", f"the width of cos_sin_cache ({width}: [cos | sin] of rotary_dim // 2 each)", rotary_dim)
    return rotary_dim


def rope_args(
    op,
    q,
    k,
    positions,
    cos_sin_cache,
    *,
    rotary_dim,
    mrope_section,
    mrope_interleaved,
    inplace,
    mrope_layout=None,
    packed=False,
    inplace_grad=False,
    broadcast=False,
    any_last_stride=False,
    head_table=False,
):
    """Checks of apply_rope's arguments. Returns (rotary_dim, mrope) with mrope None or an MRope.
    head_table: a 3-D table (max_position, Ht, rotary_dim) is accepted too (apply_rope's per-head
    tables; `head_table_args` checks the rest).
    inplace_grad: in place is allowed while q or k requires grad (the plain rotation: its backward
    needs no input; the norm's does). broadcast: positions may have size-1 dims where the token
    dims have more (Hugging Face's (1, S) position_ids); the caller expands them. any_last_stride:
    as qk_args'."""
    token_shape = qk_args(op, q, k, any_last_stride)
    device = q.device
    tensor(
        op,
        "cos_sin_cache",
        cos_sin_cache,
        ndims=(2, 3) if head_table else (2,),
        dtypes=TABLE_DTYPES,
        device=device,
        shape_hint="(max_position, rotary_dim) or (max_position, heads, rotary_dim)"
        if head_table
        else "(max_position, rotary_dim)",
    )
    rotary_dim = table_rotary_dim(op, cos_sin_cache, rotary_dim)
    head_sizes(op, q, k, rotary_dim)
    if cos_sin_cache.shape[0] < 1:
        fail(op, "cos_sin_cache", "at least one row", f"shape {tuple(cos_sin_cache.shape)}")

    mrope = mrope_args(op, mrope_section, mrope_interleaved, rotary_dim // 2, mrope_layout)

    if positions is None:
        if not packed and token_shape[-1] > cos_sin_cache.shape[0]:
            fail(
                op,
                "positions",
                f"explicit positions: None means arange({token_shape[-1]}), "
                f"past the {cos_sin_cache.shape[0]} rows of cos_sin_cache",
                None,
            )
    else:
        want = ((mrope.rows,) + token_shape) if mrope is not None else token_shape
        tensor(
            op,
            "positions",
            positions,
            ndims=(len(want),),
            dtypes=INDEX_DTYPES,
            device=device,
            shape_hint=want,
            last_stride_one=False,
        )
        shape = tuple(positions.shape)
        if shape != want and not (broadcast and broadcasts_to(shape, want)):
            what = f"({mrope.rows}, *T) for M-RoPE" if mrope is not None else "*T, the token dims of q"
            fail(op, "positions", f"shape {want} ({what})", f"shape {shape}{heads_first_hint(q, shape[-2:])}")

    if inplace:
        read = (("positions", positions), ("cos_sin_cache", cos_sin_cache))
        inplace_args(op, q, k, read, inplace_grad=inplace_grad)
    return rotary_dim, mrope


def inplace_args(op, q, k, read, *, inplace_grad=False) -> None:
    """inplace=True: q and k without self-overlap, disjoint from each other and from the read-only
    tensors `read` ((name, tensor) pairs), and (unless inplace_grad) not requiring grad."""
    for name, x in (("q", q), ("k", k)):
        if x is not None and has_internal_overlap(x):
            fail(
                op,
                name,
                "a tensor without broadcast (stride 0) or overlapping dims when inplace=True",
                f"strides {tuple(x.stride())}",
            )
    # the in-place custom op checks its (local) tensors at run time where addresses are not known here
    if addresses_known(q):
        inplace_aliasing(op, q, k, read)
    if not inplace_grad and torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        fail(op, "inplace", "False when q or k requires grad (autograd needs the inputs)", True)


MAX_AXES = 4


def _rotary_dim_of_freqs(op, rotary_dim, half) -> int:
    rot = 2 * half
    if rotary_dim is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
            raise TypeError(f"{op}: rotary_dim: expected an int or None, got {type(rotary_dim).__name__}")
        if rotary_dim != rot:
            fail(op, "rotary_dim", f"2 * len(inv_freq) = {rot} (or None)", rotary_dim)
    return rot


def axes_arg(op, axes, half) -> tuple:
    """() without axes, else the pairs of each axis: 1 to MAX_AXES non-negative ints summing to half."""
    if axes is None:
        return ()
    if (
        not isinstance(axes, (list, tuple))
        or not 1 <= len(axes) <= MAX_AXES
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in axes)
    ):
        fail(op, "axes", f"1 to {MAX_AXES} non-negative ints (rotary pairs of each axis)", repr(axes))
    if sum(axes) != half:
        fail(op, "axes", f"pairs summing to len(inv_freq) = {half}", f"{tuple(axes)} (sum {sum(axes)})")
    return tuple(axes)


def freqs_args(op, q, k, positions, inv_freq, axes, *, rotary_dim, inplace, any_last_stride=False) -> tuple:
    """Checks of apply_rope with angles computed from positions x inv_freq. Returns
    (rotary_dim, axes) with axes () when not given."""
    token_shape = qk_args(op, q, k, any_last_stride)
    tensor(
        op,
        "inv_freq",
        inv_freq,
        ndims=(1,),
        dtypes=(torch.float32,),
        device=q.device,
        shape_hint="(rotary_dim // 2,)",
        last_stride_one=False,
    )
    half = inv_freq.shape[0]
    if half < 1:
        fail(op, "inv_freq", "at least one frequency", f"shape {tuple(inv_freq.shape)}")
    rot = _rotary_dim_of_freqs(op, rotary_dim, half)
    head_sizes(op, q, k, rot)
    axes = axes_arg(op, axes, half)
    want = ((len(axes),) if axes else ()) + token_shape
    what = "(len(axes), *T)" if axes else "*T, the token dims of q"
    if positions is None:
        fail(op, "positions", f"a tensor of shape {want} ({what}) with inv_freq", None)
    tensor(
        op,
        "positions",
        positions,
        ndims=(len(want),),
        dtypes=POSITION_DTYPES,
        device=q.device,
        shape_hint=want,
        last_stride_one=False,
    )
    if tuple(positions.shape) != want:
        fail(op, "positions", f"shape {want} ({what})", f"shape {tuple(positions.shape)}")
    if inplace:
        inplace_args(op, q, k, (("positions", positions), ("inv_freq", inv_freq)), inplace_grad=True)
        if inv_freq.requires_grad and torch.is_grad_enabled():
            fail(op, "inplace", "False when inv_freq requires grad (its gradient needs the outputs)", True)
    return rot, axes


def is_scaled(out_dtype, q_scale, k_scale) -> bool:
    """Do outputs of this dtype, with these scales, take the kernel's scaled path? (fp8 outputs
    always do: the kernel casts to fp8 from float32 only, after saturating)"""
    fp8 = out_dtype is not None and out_dtype.itemsize == 1
    return fp8 or q_scale is not None or k_scale is not None


def out_args(op, q, out_dtype, q_scale, k_scale, inverse, *, inplace, grad) -> bool:
    """Checks of apply_rope's output options (out_dtype, q_scale, k_scale, inverse). Returns
    whether the outputs are scaled (see is_scaled); inverse is a bool (checks.keyword_flags)."""
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"{op}: out_dtype: expected a torch.dtype or None, got {type(out_dtype).__name__}")
        if out_dtype not in OUT_DTYPES:
            fail(op, "out_dtype", f"None or one of ({', '.join(dtype_name(d) for d in OUT_DTYPES)})", out_dtype)
        if inplace:
            fail(op, "out_dtype", "None when inplace=True (in place writes q's own dtype)", dtype_name(out_dtype))
        if grad and out_dtype != q.dtype:
            fail(
                op,
                "out_dtype",
                "None or q's dtype while q or k requires grad (no gradient through a cast to another dtype)",
                dtype_name(out_dtype),
            )
    for name, scale in (("q_scale", q_scale), ("k_scale", k_scale)):
        if scale is None:
            continue
        if out_dtype is None:
            fail(op, name, "None without out_dtype (a scale quantizes outputs of another dtype)", "a scale")
        scale_arg(op, name, scale, q.device)
        if grad:
            fail(op, name, "None while q or k requires grad (no gradient through a quantization)", "a scale")
    return is_scaled(out_dtype, q_scale, k_scale)


def out_buffers(op, q, k, q_out, k_out, out_dtype, *, inplace, grad, parts=(None, None)) -> None:
    """Checks of apply_rope's destinations (q_out, k_out) that need no address: each None, or a
    tensor of its input's shape in the outputs' dtype on q's device, last stride 1, no element
    twice (with q_nope / k_nope, parts: the head of both parts together). Their aliasing with the
    inputs and each other is checked per call (`out_aliasing`)."""
    dtype = q.dtype if out_dtype is None else out_dtype
    for name, out, x, xname, part in (("q_out", q_out, q, "q", parts[0]), ("k_out", k_out, k, "k", parts[1])):
        if out is None:
            continue
        if inplace:
            fail(op, name, "None when inplace=True (in place writes q and k themselves)", "a tensor")
        if x is None:
            fail(op, name, f"None when {xname} is None", "a tensor")
        if grad:
            fail(
                op,
                name,
                "None while q or k requires grad (results written into given tensors are not "
                "differentiable, as with torch's out=)",
                "a tensor",
            )
        tensor(op, name, out, ndims=(x.dim(),), dtypes=(dtype,), device=q.device, shape_hint=f"of {xname}'s shape")
        want, what = tuple(x.shape), f"that of {xname}"
        if part is not None:
            want, what = (*want[:-1], want[-1] + part.shape[-1]), f"{xname}'s head and {xname}_nope's together"
        if tuple(out.shape) != want:
            fail(op, name, f"shape {want} ({what})", f"shape {tuple(out.shape)}")
        if has_internal_overlap(out):
            fail(
                op,
                name,
                "a tensor without broadcast (stride 0) or overlapping dims (it is written)",
                f"strides {tuple(out.stride())}",
            )
        if out.requires_grad and torch.is_grad_enabled():
            fail(op, name, "a tensor that does not require grad (it is written in place)", "requires_grad=True")


ROTARY_POSITIONS = ("first", "last", "halves")


def rotary_position_arg(op, rotary_position, normed=False, allowed=ROTARY_POSITIONS) -> str:
    """'first' (dims [0, rotary_dim) rotated), 'last' ([D - rotary_dim, D): DeepSeek's [nope | rope]
    head) or 'halves' (pairs (i, i + D/2), i < rotary_dim / 2: Gemma 4's p-RoPE), among the
    values `allowed` (the op's). Returns it. normed: False, or the arguments that asked for a norm
    (norm_names; True: the weights)."""
    if not isinstance(rotary_position, str):
        raise TypeError(f"{op}: rotary_position: expected a str, got {type(rotary_position).__name__}")
    if rotary_position not in allowed:
        words = [repr(p) for p in allowed]
        fail(op, "rotary_position", f"{', '.join(words[:-1])} or {words[-1]}", repr(rotary_position))
    if rotary_position == "last" and normed:
        names = normed if isinstance(normed, str) else "q_norm_weight / k_norm_weight"
        fail(op, "rotary_position", f"'first' with {names} (the fused norm covers the head from dim 0)", "'last'")
    return rotary_position


def halves_args(op, q, k, interleaved, q_name="q", k_name="k") -> None:
    """rotary_position='halves': half-split pairs (i, i + D/2) of the whole head, so interleaved is
    False, D is even, and q and k share it (the partner distance D/2 is one constant of the launch).
    rotary_dim <= D is checked with the table."""
    if interleaved:
        fail(op, "interleaved", "False with rotary_position='halves' (its pairs are (i, i + D/2))", "True")
    d = q.shape[-1]
    if d % 2:
        fail(
            op,
            q_name,
            "an even head size with rotary_position='halves' (pairs (i, i + D/2))",
            f"shape {tuple(q.shape)}",
        )
    if k is not None and k.shape[-1] != d:
        fail(
            op,
            k_name,
            f"head size {d} (that of {q_name}) with rotary_position='halves' (one partner distance, D/2)",
            f"shape {tuple(k.shape)}",
        )


def head_table_args(op, q, k, table, positions, mrope, cu_seqlens, weights, l2=False) -> None:
    """A per-head table (max_position, Ht, rotary_dim): rows picked by a positions tensor, without
    M-RoPE, packed sequences or the fused norm, and Ht dividing q's heads and k's (head j of a tensor
    of H heads reads table head j // (H / Ht): per KV head with q's heads grouped, as GQA groups
    them, or per q head when Ht is q's head count and k has as many heads)."""
    n_table = table.shape[1]
    if n_table < 1:
        fail(op, "cos_sin_cache", "at least one head in a per-head table", f"shape {tuple(table.shape)}")
    refused = (
        (cu_seqlens is not None, "cu_seqlens", "None with a per-head cos_sin_cache", "a tensor"),
        (mrope is not None, "mrope_section", "None with a per-head cos_sin_cache", getattr(mrope, "sections", mrope)),
        (positions is None, "positions", "a positions tensor with a per-head cos_sin_cache", None),
        (weights[0] is not None, "q_norm_weight", "None with a per-head cos_sin_cache", "a tensor"),
        (weights[1] is not None, "k_norm_weight", "None with a per-head cos_sin_cache", "a tensor"),
        (l2 is True, "l2_norm", "False with a per-head cos_sin_cache", True),
    )
    for hit, name, expected, got in refused:
        if hit:
            fail(op, name, expected, got)
    for name, x in (("q", q), ("k", k)):
        if x is not None and x.shape[-2] % n_table:
            fail(
                op,
                name,
                f"a head count that the per-head table's {n_table} heads divide (head j reads table head "
                f"j // (heads / {n_table}))",
                f"{x.shape[-2]} heads",
            )


def no_grad_table(op, table):
    """ropekit treats the angles as constants: a table that requires grad is refused under grad mode."""
    if table.requires_grad and torch.is_grad_enabled():
        fail(
            op,
            "cos_sin_cache",
            "a tensor that does not require grad (ropekit does not differentiate through the angles)",
            "requires_grad=True",
        )


def packed_args(op, q, positions, cu_seqlens, cp_size, cp_rank, mrope_section) -> tuple:
    """apply_rope's packed-sequence arguments: cu_seqlens (N+1,) int32/int64 on q's device with
    q (T, H, D), positions None, no M-RoPE; cp_size >= 1 and 0 <= cp_rank < cp_size (ints).
    Returns (cp_size, cp_rank). Values (cu_seqlens[0] == 0, non-decreasing, cu_seqlens[-1] == T,
    even lengths under CP) are checked only in strict mode (`packed_values`): they need a sync."""
    for name, v, low in (("cp_size", cp_size, 1), ("cp_rank", cp_rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{op}: {name}: expected an int, got {type(v).__name__}")
        if v < low:
            fail(op, name, f"an int >= {low}", v)
    if cu_seqlens is None:
        if cp_size != 1 or cp_rank != 0:
            fail(
                op,
                "cu_seqlens",
                f"a tensor when cp_size / cp_rank are given (cp_size={cp_size}, cp_rank={cp_rank})",
                None,
            )
        return 1, 0
    if cp_rank >= cp_size:
        fail(op, "cp_rank", f"an int in [0, cp_size = {cp_size})", cp_rank)
    if positions is not None:
        fail(
            op,
            "positions",
            "None when cu_seqlens is given (positions are derived from cu_seqlens)",
            f"a tensor of shape {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else positions,
        )
    if mrope_section is not None:
        fail(op, "mrope_section", "None with cu_seqlens (M-RoPE takes its (N, *T) positions explicitly)", mrope_section)
    if q.dim() != 3:
        fail(op, "q", "a (T, H, D) tensor of packed tokens when cu_seqlens is given", f"shape {tuple(q.shape)}")
    tensor(
        op,
        "cu_seqlens",
        cu_seqlens,
        ndims=(1,),
        dtypes=INDEX_DTYPES,
        device=q.device,
        shape_hint="(N+1,) cumulative sequence lengths",
        last_stride_one=False,
    )
    if cu_seqlens.shape[0] < 2:
        fail(op, "cu_seqlens", "at least two elements (N+1 for N >= 1 sequences)", f"shape {tuple(cu_seqlens.shape)}")
    return cp_size, cp_rank


def angle_args(op, q, k, cos, sin, *, mrope_section, mrope_interleaved, mrope_layout=None):
    """Checks of per-token cos/sin. Returns (cos, sin, mrope) with cos/sin broadcast to full shape
    (views; both given the same strides, which the kernel assumes)."""
    token_shape = qk_args(op, q, k)
    for name, x in (("cos", cos), ("sin", sin)):
        tensor(op, name, x, ndims=range(1, 8), dtypes=TABLE_DTYPES, device=q.device, last_stride_one=False)
        if x.requires_grad and torch.is_grad_enabled():
            fail(
                op, name, "a tensor that does not require grad (angles are constants to ropekit)", "requires_grad=True"
            )
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        fail(
            op,
            "sin",
            f"the shape and dtype of cos {tuple(cos.shape)} {dtype_name(cos.dtype)}",
            f"{tuple(sin.shape)} {dtype_name(sin.dtype)}",
        )
    half = cos.shape[-1]
    if half < 1:
        fail(op, "cos", "a last dim of rotary_dim // 2 >= 1", f"shape {tuple(cos.shape)}")
    full_width_angles(op, q, k, half)
    head_sizes(op, q, k, 2 * half)
    mrope = mrope_args(op, mrope_section, mrope_interleaved, half, mrope_layout)
    want = ((mrope.rows,) if mrope is not None else ()) + token_shape + (half,)
    try:
        cos, sin = cos.broadcast_to(want), sin.broadcast_to(want)
    except RuntimeError:
        hint = heads_first_hint(q, tuple(cos.shape[-3:-1])) if cos.dim() >= 3 else ""
        fail(op, "cos", f"a shape broadcastable to {want}", f"shape {tuple(cos.shape)}{hint}")
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, mrope


_CACHE_HINT = "(num_blocks, block_size, H, D) or (num_slots, H, D)"


def scale_arg(op, name, scale, device):
    """None, a positive finite float, or a 0-d / 1-element float32 tensor on the device of q."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            fail(op, name, "a 0-d or 1-element tensor (one per-tensor scale)", f"shape {tuple(scale.shape)}")
        if scale.dtype != torch.float32:
            fail(op, name, "dtype float32", dtype_name(scale.dtype))
        if scale.device != device:
            fail(op, name, f"a tensor on {device} (the device of q)", f"one on {scale.device}")
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(
            f"{op}: {name}: expected a float, a 1-element float32 tensor or None, got {type(scale).__name__}"
        )
    if not (math.isfinite(scale) and scale > 0):
        fail(op, name, "a finite scale > 0", scale)
    return float(scale)


def store_args(
    op,
    q,
    k,
    v,
    positions,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    rotary_dim,
    k_scale,
    v_scale,
    mrope_section=None,
    mrope_interleaved=False,
    mrope_layout=None,
    packed=False,
    k_nope=None,
    cache_scales=(None, None),
):
    """Checks of apply_rope_and_store's arguments that need no data (positions (*T), (3, *T) with
    M-RoPE sections, or None: arange, or with packed (cu_seqlens checked by `packed_args`) derived).
    k_nope: GQA / MHA's no-rope key part beside v (`nope_part`); k_cache's rows then hold k and it.
    cache_scales: (k_cache_scales, v_cache_scales), NVFP4's block scales (`nvfp4_scales`).

    Returns (rotary_dim, mrope, k_scale, v_scale): mrope None or an MRope, scales as
    given by `scale_arg`.
    """
    if k is None:
        raise TypeError(f"{op}: k: expected a torch.Tensor, got NoneType")
    if isinstance(q, torch.Tensor) and q.dim() and q.shape[-1] > 1 and q.stride(-1) != 1:
        fail(
            op,
            "q",
            "stride 1 in the last dimension (q is rotated in place; with q_out= a strided q is read)",
            f"strides {tuple(q.stride())}",
        )
    if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dim() == 3:
        fail(
            op,
            "cos_sin_cache",
            "a (max_position, rotary_dim) table: the store's kernel reads one row per token (per-head "
            "tables are apply_rope's)",
            f"a per-head table of shape {tuple(cos_sin_cache.shape)}",
        )
    rot, mrope = rope_args(
        op,
        q,
        k,
        positions,
        cos_sin_cache,
        rotary_dim=rotary_dim,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        mrope_layout=mrope_layout,
        inplace=False,
        packed=packed,
    )
    token_shape = tuple(q.shape[:-2])
    device = q.device
    tensor(
        op,
        "v",
        v,
        ndims=(q.dim(),),
        dtypes=FLOAT_DTYPES,
        device=device,
        shape_hint=lambda: f"with the token dims of q {token_shape}",
        last_stride_one=False,  # only read, through its own last-dim stride
    )
    if tuple(v.shape[:-2]) != token_shape:
        fail(op, "v", f"token dims {token_shape} (those of q)", f"shape {tuple(v.shape)}")
    tensor(
        op,
        "slot_mapping",
        slot_mapping,
        ndims=(len(token_shape),),
        dtypes=INDEX_DTYPES,
        device=device,
        shape_hint=token_shape,
        last_stride_one=False,
    )
    if tuple(slot_mapping.shape) != token_shape:
        fail(op, "slot_mapping", f"shape {token_shape} (the token dims of q)", f"shape {tuple(slot_mapping.shape)}")
    if k_nope is not None:
        nope_part(op, "k_nope", k_nope, k, rot)

    fp4 = is_nvfp4(k_cache, v_cache, cache_scales)
    for name, cache, xname, x in (("k_cache", k_cache, "k", k), ("v_cache", v_cache, "v", v)):
        dtypes = (torch.uint8,) if fp4 else OUT_DTYPES
        tensor(op, name, cache, ndims=(3, 4), dtypes=dtypes, device=device, shape_hint=_CACHE_HINT)
        want = tuple(x.shape[-2:])
        if name == "k_cache" and k_nope is not None:
            want, xname = (want[0], want[1] + k_nope.shape[-1]), "k and k_nope together"
        if fp4:
            want, xname = nvfp4_row(op, name, xname, want), f"{xname} as NVFP4 bytes (2 values a byte)"
        if tuple(cache.shape[-2:]) != want:
            fail(op, name, f"(heads, head size) {want}, those of {xname}", f"shape {tuple(cache.shape)}")
        if has_internal_overlap(cache):
            fail(
                op,
                name,
                "a tensor without broadcast (stride 0) or overlapping dims (it is written)",
                f"strides {tuple(cache.stride())}",
            )
    if v_cache.dim() != k_cache.dim() or v_cache.shape[:-2] != k_cache.shape[:-2]:
        fail(
            op,
            "v_cache",
            f"slot dims {tuple(k_cache.shape[:-2])}, those of k_cache (one slot_mapping addresses both)",
            f"shape {tuple(v_cache.shape)}",
        )
    if fp4:
        nvfp4_scales(op, k_cache, v_cache, cache_scales, device)
    if has_internal_overlap(q):
        fail(
            op,
            "q",
            "a tensor without broadcast (stride 0) or overlapping dims (it is rotated in place)",
            f"strides {tuple(q.stride())}",
        )
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
            if x.requires_grad:
                fail(
                    op,
                    name,
                    "a tensor that does not require grad (apply_rope_and_store is inference "
                    "only: it writes q and the caches in place and is not differentiable)",
                    "requires_grad=True",
                )

    k_scale = scale_arg(op, "k_scale", k_scale, device)
    v_scale = scale_arg(op, "v_scale", v_scale, device)
    return rot, mrope, k_scale, v_scale


def is_nvfp4(k_cache, v_cache, cache_scales) -> bool:
    """Is this store's output NVFP4: a uint8 cache, or block scales given? (`nvfp4_scales` then
    names whichever of the four tensors does not fit.)"""
    caches = (k_cache, v_cache)
    return any(s is not None for s in cache_scales) or any(
        isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in caches
    )


def nvfp4_row(op, name, xname, want) -> tuple:
    """(heads, bytes) of an NVFP4 cache row for heads of (H, D) values: D a multiple of 16 (one
    block scale per 16 values), D / 2 bytes of codes."""
    if want[1] % 16:
        fail(op, name, f"NVFP4 rows of a head size that is a multiple of 16 ({xname}: {want[1]})", "uint8")
    return want[0], want[1] // 2


def nvfp4_scales(op, k_cache, v_cache, cache_scales, device) -> None:
    """NVFP4's block scales beside its caches: float8_e4m3fn, the caches' slot dims and heads, one
    scale per 16 values (cache rows of D / 2 bytes: D / 16 scales), unit last stride, no overlap."""
    for name, cache, scales in (
        ("k_cache_scales", k_cache, cache_scales[0]),
        ("v_cache_scales", v_cache, cache_scales[1]),
    ):
        if scales is None:
            fail(op, name, "the cache's float8_e4m3fn block scales (its cache is uint8: NVFP4)", "None")
        tensor(op, name, scales, ndims=(cache.dim(),), dtypes=(torch.float8_e4m3fn,), device=device)
        want = (*cache.shape[:-1], cache.shape[-1] // 8)
        if tuple(scales.shape) != want:
            fail(
                op, name, f"shape {want} (one scale per 16 values of the cache's rows)", f"shape {tuple(scales.shape)}"
            )
        if has_internal_overlap(scales):
            fail(
                op,
                name,
                "a tensor without broadcast (stride 0) or overlapping dims (it is written)",
                f"strides {tuple(scales.stride())}",
            )


def nope_part(op, name, x, rope, rot, *, inference=True) -> None:
    """q_nope / k_nope: a head's no-rope part given apart from its rope part `rope` (q / k): a float
    tensor on rope's device with its token dims and heads, any strides (only read, the last one
    included); rope then holds exactly the rotary dims. inference: one that requires grad is
    refused under grad mode (the store); apply_rope's outputs carry its gradient."""
    rope_name = name[0]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor or None, got {type(x).__name__}")
    lead = tuple(rope.shape[:-1])
    tensor(
        op,
        name,
        x,
        ndims=(rope.dim(),),
        dtypes=FLOAT_DTYPES,
        device=rope.device,
        shape_hint=lambda: f"(*T, H, N) with the token dims and heads {lead} of {rope_name}",
        last_stride_one=False,
    )
    if tuple(x.shape[:-1]) != lead:
        fail(op, name, f"token dims and heads {lead} (those of {rope_name})", f"shape {tuple(x.shape)}")
    if rope.shape[-1] != rot:
        fail(
            op,
            rope_name,
            f"head size {rot} (rotary_dim: with {name} given, {rope_name} is the rope part)",
            f"shape {tuple(rope.shape)}",
        )
    if inference and torch.is_grad_enabled() and x.requires_grad:
        fail(op, name, f"a tensor that does not require grad ({op} is inference only)", "requires_grad=True")


def store_outputs(op, q, k, q_out, q_scale, write_key, q_nope=None):
    """Checks of the store's output keywords (no data): q_out like q in any float or fp8 dtype
    (with q_nope: q's head and q_nope's after it), q_scale only with q_out, write_key a bool with a
    k that can be written. Returns q_scale as `scale_arg` gives it."""
    if not isinstance(write_key, bool):
        raise TypeError(f"{op}: write_key: expected a bool, got {type(write_key).__name__}")
    if write_key and has_internal_overlap(k):
        fail(
            op,
            "k",
            "a tensor without broadcast (stride 0) or overlapping dims (it is written back: write_key=True)",
            f"strides {tuple(k.stride())}",
        )
    if q_out is None:
        if q_scale is not None:
            fail(op, "q_scale", "None without q_out (q is rotated in place, in its own dtype)", "a scale")
        return None
    want, what = tuple(q.shape), "that of q"
    if q_nope is not None:
        want, what = (*want[:-1], want[-1] + q_nope.shape[-1]), "q's head, then q_nope's"
    tensor(
        op,
        "q_out",
        q_out,
        ndims=(q.dim(),),
        dtypes=OUT_DTYPES,
        device=q.device,
        shape_hint=lambda: f"of q's shape {want}" if q_nope is None else f"of shape {want} ({what})",
    )
    if tuple(q_out.shape) != want:
        fail(op, "q_out", f"shape {want} ({what})", f"shape {tuple(q_out.shape)}")
    if has_internal_overlap(q_out):
        fail(
            op,
            "q_out",
            "a tensor without broadcast (stride 0) or overlapping dims (it is written)",
            f"strides {tuple(q_out.stride())}",
        )
    if torch.is_grad_enabled() and q_out.requires_grad:
        fail(
            op,
            "q_out",
            "a tensor that does not require grad (apply_rope_and_store is inference only)",
            "requires_grad=True",
        )
    return scale_arg(op, "q_scale", q_scale, q.device)


def _on_device(op, name, x, device) -> None:
    if isinstance(x, torch.Tensor) and x.device != device:
        fail(op, name, f"a tensor on {device} (the device of k_cache)", f"one on {x.device}")


def _slot_vector(op, name, x, n, device) -> None:
    """slots / dst_slots / delta: a (N,) int32/int64 tensor on the cache's device."""
    _on_device(op, name, x, device)
    tensor(op, name, x, ndims=(1,), dtypes=INDEX_DTYPES, shape_hint="(N,)", last_stride_one=False)
    if n is not None and x.shape[0] != n:
        fail(op, name, f"shape ({n},) (that of slots)", f"shape {tuple(x.shape)}")


def rerotate_args(
    op, k_cache, slots, delta, cos_sin_cache, *, interleaved, rotary_dim, k_scale, dst_slots, positions, to_cache
):
    """Checks of rerotate_kv_cache's arguments that need no data.

    Returns (rotary_dim, num_slots, k_scale, delta_int): k_scale as `scale_arg` gives it; delta_int the
    shift when delta is a Python int, else None.
    """
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"{op}: k_cache: expected a torch.Tensor, got {type(k_cache).__name__}")
    device = k_cache.device
    tensor(op, "k_cache", k_cache, ndims=(3, 4), dtypes=CACHE_DTYPES, shape_hint=_CACHE_HINT)
    if has_internal_overlap(k_cache):
        fail(
            op,
            "k_cache",
            "a tensor without broadcast (stride 0) or overlapping dims (it is written)",
            f"strides {tuple(k_cache.stride())}",
        )
    if torch.is_grad_enabled() and k_cache.requires_grad:
        fail(
            op,
            "k_cache",
            "a tensor that does not require grad (rerotate_kv_cache writes the cache in "
            "place and is not differentiable)",
            "requires_grad=True",
        )
    _slot_vector(op, "slots", slots, None, device)
    n = slots.shape[0]
    if dst_slots is not None:
        _slot_vector(op, "dst_slots", dst_slots, n, device)
    if isinstance(delta, torch.Tensor):
        _slot_vector(op, "delta", delta, n, device)
        delta_int = None
    elif isinstance(delta, int) and not isinstance(delta, bool):
        delta_int = int(delta)
    else:
        raise TypeError(f"{op}: delta: expected a (N,) or 0-d int32/int64 tensor or an int, got {type(delta).__name__}")

    _on_device(op, "cos_sin_cache", cos_sin_cache, device)
    tensor(op, "cos_sin_cache", cos_sin_cache, ndims=(2,), dtypes=TABLE_DTYPES, shape_hint="(max_position, rotary_dim)")
    if cos_sin_cache.shape[0] < 1:
        fail(op, "cos_sin_cache", "at least one row", f"shape {tuple(cos_sin_cache.shape)}")
    rotary_dim = table_rotary_dim(op, cos_sin_cache, rotary_dim)
    if k_cache.shape[-1] < rotary_dim:
        fail(op, "k_cache", f"a head size >= rotary_dim ({rotary_dim})", f"head size {k_cache.shape[-1]}")
    _on_device(op, "k_scale", k_scale, device)
    k_scale = scale_arg(op, "k_scale", k_scale, device)
    num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
    _two_tables(op, positions, to_cache, cos_sin_cache, n, device)
    if delta_int is not None:
        int_shift(op, delta_int, cos_sin_cache.shape[0], None if to_cache is None else to_cache.shape[0])
    return rotary_dim, num_slots, k_scale, delta_int


def _two_tables(op, positions, to_cache, cos_sin_cache, n, device) -> None:
    """A move between tables: to_cache and positions given together, positions (N,) like slots,
    to_cache a table of cos_sin_cache's width on the cache's device."""
    if to_cache is None:
        if positions is not None:
            fail(
                op,
                "positions",
                "None without to_cache (positions say where rows sit in cos_sin_cache for a move to to_cache)",
                "a tensor" if isinstance(positions, torch.Tensor) else type(positions).__name__,
            )
        return
    if positions is None:
        fail(op, "positions", "a (N,) int32/int64 tensor of each row's current position when to_cache is given", None)
    _slot_vector(op, "positions", positions, n, device)
    _on_device(op, "to_cache", to_cache, device)
    tensor(op, "to_cache", to_cache, ndims=(2,), dtypes=TABLE_DTYPES, shape_hint="(max_position, rotary_dim)")
    width = cos_sin_cache.shape[1]
    if to_cache.shape[0] < 1 or to_cache.shape[1] != width:
        fail(
            op,
            "to_cache",
            f"at least one row of width {width} (that of cos_sin_cache: both tables rotate the same dims)",
            f"shape {tuple(to_cache.shape)}",
        )
    if torch.is_grad_enabled() and to_cache.requires_grad:
        fail(
            op,
            "to_cache",
            "a tensor that does not require grad (rerotate_kv_cache is not differentiable)",
            "requires_grad=True",
        )


def norm_weights(op, q, k, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset, *, inplace=False, l2=False):
    """Checks of the q/k RMSNorm arguments (after q and k themselves are checked).

    A weight of shape (D,) normalizes each head, (H*D,) all heads of a token together; l2 (the
    op's l2_norm) normalizes each head of q and k without a weight. Returns the kernel's modes
    (q, k): 0 no norm, 1 per head, 2 across heads, 3 per head without a weight.
    """
    if not isinstance(l2, bool):
        raise TypeError(f"{op}: l2_norm: expected a bool, got {type(l2).__name__}")
    if l2:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w is not None:
                fail(op, name, "None with l2_norm=True (one norm a head: the weighted one, or l2_norm's)", "a tensor")
    modes = []
    for name, w, xname, x in (("q_norm_weight", q_norm_weight, "q", q), ("k_norm_weight", k_norm_weight, "k", k)):
        if w is None:
            modes.append(0)
            continue
        if x is None:
            fail(op, name, f"None when {xname} is None", "a tensor")
        tensor(
            op, name, w, ndims=(1,), dtypes=FLOAT_DTYPES, device=q.device, shape_hint=lambda: f"({xname}'s head size,)"
        )
        d, h = x.shape[-1], x.shape[-2]
        if w.shape[0] not in (d, h * d):
            fail(
                op,
                name,
                f"shape ({d},) (per head) or ({h * d},) (across the {h} heads of {xname})",
                f"shape {tuple(w.shape)}",
            )
        modes.append(1 if w.shape[0] == d else 2)  # one head: per head and across heads agree
        if inplace and torch.is_grad_enabled() and w.requires_grad:
            fail(op, "inplace", f"False when {name} requires grad (its gradient needs the unnormalized input)", True)
    for name, value in (("norm_eps", norm_eps), ("norm_weight_offset", norm_weight_offset)):
        if isinstance(value, bool) or not isinstance(value, NUMBERS):
            raise TypeError(f"{op}: {name}: expected a float, got {type(value).__name__}")
        # comparisons, not math.isfinite: they hold for a symbolic float (torch.compile with
        # dynamic=True turns a module's eps into one) as a guard instead of a value read
        if not -math.inf < value < math.inf:
            fail(op, name, "a finite float", value)
    if norm_eps < 0:
        fail(op, "norm_eps", "a float >= 0", norm_eps)
    if l2:
        if norm_weight_offset != 0:
            fail(op, "norm_weight_offset", "0.0 with l2_norm=True (it has no weight to offset)", norm_weight_offset)
        return 3, (0 if k is None else 3)
    return tuple(modes)


def norm_names(modes) -> str:
    """The arguments that asked for the norm of these (q, k) modes, as errors name them."""
    return "l2_norm=True" if 3 in modes else "q_norm_weight / k_norm_weight"


def norm_flags(op, *, inverse=False, inplace=False, grad=False, out_interleaved=False, names=None) -> None:
    """The flags a norm before the rotation does not compose with, each refused by name. names:
    the arguments that asked for the norm (norm_names), q_norm_weight / k_norm_weight by default."""
    names = names or "q_norm_weight / k_norm_weight"
    if inverse:
        fail(op, "inverse", f"False with {names} (a de-rotation has no norm before it)", True)
    if inplace and grad:
        fail(
            op,
            "inplace",
            f"False with {names} while autograd records the call (the norm's backward needs the unnormalized q and k)",
            True,
        )
    if out_interleaved:
        fail(op, "out_interleaved", f"None (or interleaved) with {names}", "another layout")


def no_dtensor(op: str, what: str, *named) -> None:
    """Refuse DTensor arguments of an op that has no DTensor sharding rule yet (named, before any
    write; DTensor's own error would name an internal op). named: (name, value) pairs."""
    for name, x in named:
        if hasattr(x, "device_mesh") and hasattr(x, "placements"):
            fail(
                op,
                name,
                f"a plain torch.Tensor ({what} has no DTensor sharding rule yet: pass local shards, x.to_local())",
                f"a DTensor with placements {tuple(x.placements)}",
            )
