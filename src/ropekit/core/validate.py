"""Every argument check in one place, run before anything is written.

Each failed check raises ValueError (TypeError for a wrong type) whose message names the op, the
argument, what was expected and what was given. Checks read only shapes, strides, dtypes and
devices, so they cost no device sync; the one data-dependent check (positions in range) runs only
in strict mode, see `strict()`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from typing import Sequence

import torch

from . import memo

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


class _State(threading.local):
    """Per-thread strict mode. The class attribute is the default a new thread sees: a missing
    attribute of a thread-local costs a raised and caught AttributeError on every check."""

    strict = None


_state = _State()


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Within this context, positions (and slots) are checked against their bounds before launch.

    Costs one device sync per call; the default (off) makes a bad position's output NaN instead.
    `ROPEKIT_STRICT=1` in the environment turns it on globally.
    """
    previous = _state.strict
    _state.strict = enabled
    try:
        yield
    finally:
        _state.strict = previous


def is_strict() -> bool:
    """Strict mode on? (the `strict()` context of this thread, else ROPEKIT_STRICT as read at import)"""
    value = _state.strict
    return _ENV_STRICT if value is None else value


# the environment is read once: every call asks, and os.environ costs more than the rest of a check
_ENV_STRICT = os.environ.get("ROPEKIT_STRICT", "0") not in ("", "0", "false", "False")


def fail(op: str, name: str, expected: str, given) -> None:
    raise ValueError(f"{op}: {name}: expected {expected}, got {given}")


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def tensor(
    op: str,
    name: str,
    x,
    *,
    ndims: Sequence[int],
    dtypes,
    device=None,
    shape_hint="",
    last_stride_one: bool = True,
) -> None:
    """The common checks of one tensor argument: type, rank, dtype, device, unit last stride.

    shape_hint: a str, a shape (a tuple, formatted when raising) or a function returning a str:
    never formatted unless the check fails, since under torch.compile with dynamic shapes a
    shape holds symbolic sizes that only a failing check may turn into text."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ndims:
        hint = shape_hint() if callable(shape_hint) else str(shape_hint)
        fail(
            op,
            name,
            f"a {' or '.join(f'{n}-D' for n in ndims)} tensor {hint}".rstrip(),
            f"shape {tuple(x.shape)}",
        )
    if x.dtype not in dtypes:
        fail(op, name, f"dtype in ({', '.join(_dtype_name(d) for d in dtypes)})", _dtype_name(x.dtype))
    if device is not None and x.device != device:
        fail(op, name, f"a tensor on {device} (the device of q)", f"one on {x.device}")
    if last_stride_one and x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        fail(op, name, "stride 1 in the last dimension", f"strides {tuple(x.stride())}")


def _span(x: torch.Tensor):
    """[first, last] byte addresses touched by x."""
    start = x.data_ptr()
    extent = sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride()) if n > 0)
    return start, start + (extent + 1) * x.element_size() - 1


def has_internal_overlap(x: torch.Tensor) -> bool:
    """True if two elements of x may share memory: a broadcast (stride-0) dim, or dims that do not
    nest (sorted by stride, each stride at least the extent of the dims inside it). With a unit
    last stride this is exact for every layout but exotic interleavings, which it refuses."""
    # dims by stride, sorted by insertion: torch.compile traces comparisons of symbolic sizes (as
    # guards) but cannot sort them
    dims = []
    for n, st in zip(x.shape, x.stride()):
        if n > 1:
            st = st if st >= 0 else -st
            i = len(dims)
            while i > 0 and (dims[i - 1][0] > st or (dims[i - 1][0] == st and dims[i - 1][1] > n)):
                i -= 1
            dims.insert(i, (st, n))
    reach = 1
    for st, n in dims:
        if st < reach:
            return True
        reach += st * (n - 1)
    return False


def written_vs_read(op, written, read, extents=None) -> None:
    """No written tensor may share a byte with a read-only one (positions, tables, slots, scales).

    extents: None, or the byte extents of the written tensors then of the read ones (0 for None):
    pairs whose byte ranges miss each other (the usual case) are then passed after two compares."""
    if extents is not None:
        tensors = [w for _, w in written] + [r for _, r in read]
        ptrs = [0 if x is None else x.data_ptr() for x in tensors]
        nw = len(written)
        meet = [
            (i, j)
            for i in range(nw)
            for j in range(nw, len(tensors))
            if extents[i] and extents[j] and ptrs[i] < ptrs[j] + extents[j] and ptrs[j] < ptrs[i] + extents[i]
        ]
        for i, j in meet:
            written_vs_read(op, (written[i],), (read[j - nw],))
        return
    for wname, w in written:
        if w is None:
            continue
        for rname, r in read:
            if isinstance(r, torch.Tensor) and may_alias(w, r):
                fail(op, rname, f"memory disjoint from {wname} (which is written)", f"a tensor overlapping {wname}")


def inplace_aliasing(op, q, k, read) -> None:
    """In-place rotation: q and k disjoint from each other and from every read-only input."""
    if k is not None and may_alias(q, k):
        fail(op, "k", "memory disjoint from q when inplace=True", "a tensor overlapping q")
    written_vs_read(op, (("q", q), ("k", k)), read)


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
            fail(op, "k", f"the dtype of q ({_dtype_name(q.dtype)})", _dtype_name(k.dtype))
    return token_shape


def mrope_args(op, mrope_section, mrope_interleaved, half):
    """None, or the (t, h, w) sections as a tuple summing to half."""
    if mrope_section is None:
        if mrope_interleaved:
            fail(op, "mrope_interleaved", "mrope_section to be given with it", "mrope_section=None")
        return None
    if (
        not isinstance(mrope_section, (list, tuple))
        or len(mrope_section) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in mrope_section)
    ):
        fail(op, "mrope_section", "3 non-negative ints (t, h, w) in frequency units", mrope_section)
    if sum(mrope_section) != half:
        fail(
            op,
            "mrope_section",
            f"sections summing to rotary_dim // 2 = {half}",
            f"{tuple(mrope_section)} (sum {sum(mrope_section)})",
        )
    return tuple(mrope_section)


def head_sizes(op, q, k, rotary_dim):
    for name, x in (("q", q), ("k", k)):
        if x is not None and x.shape[-1] < rotary_dim:
            fail(op, name, f"a head size >= rotary_dim ({rotary_dim})", f"head size {x.shape[-1]}")


def table_rotary_dim(op, cos_sin_cache, rotary_dim) -> int:
    """rotary_dim checked against a [cos | sin] table's width (None: the width)."""
    width = cos_sin_cache.shape[1]
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
    packed=False,
    inplace_grad=False,
    broadcast=False,
    any_last_stride=False,
):
    """Checks of apply_rope's arguments. Returns (rotary_dim, mrope) with mrope None or (t, h, w).
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
        ndims=(2,),
        dtypes=TABLE_DTYPES,
        device=device,
        shape_hint="(max_position, rotary_dim)",
    )
    rotary_dim = table_rotary_dim(op, cos_sin_cache, rotary_dim)
    head_sizes(op, q, k, rotary_dim)
    if cos_sin_cache.shape[0] < 1:
        fail(op, "cos_sin_cache", "at least one row", f"shape {tuple(cos_sin_cache.shape)}")

    mrope = mrope_args(op, mrope_section, mrope_interleaved, rotary_dim // 2)

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
        want = ((3,) + token_shape) if mrope is not None else token_shape
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
            what = "(3, *T) for M-RoPE" if mrope is not None else "*T, the token dims of q"
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


# angles computed from positions x inverse frequencies: positions may be integers or floats
POSITION_DTYPES = INDEX_DTYPES + (torch.float32, torch.float64)
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


def positions_finite(op: str, positions: torch.Tensor) -> None:
    """Strict mode, float positions: name the first that is not finite (one device sync)."""
    if positions.is_floating_point():
        bad = ~torch.isfinite(positions)
        if bool(bad.any()):
            index = first_index(bad)
            fail(op, "positions", "finite values", f"positions{list(index)} = {float(positions[index])}")


OUT_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)


def is_scaled(out_dtype, q_scale, k_scale) -> bool:
    """Do outputs of this dtype, with these scales, take the kernel's scaled path? (fp8 outputs
    always do: the kernel casts to fp8 from float32 only, after saturating)"""
    fp8 = out_dtype is not None and out_dtype.itemsize == 1
    return fp8 or q_scale is not None or k_scale is not None


def out_args(op, q, out_dtype, q_scale, k_scale, inverse, *, inplace, grad) -> bool:
    """Checks of apply_rope's output options (out_dtype, q_scale, k_scale, inverse). Returns
    whether the outputs are scaled (see is_scaled)."""
    if not isinstance(inverse, bool):
        raise TypeError(f"{op}: inverse: expected a bool, got {type(inverse).__name__}")
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"{op}: out_dtype: expected a torch.dtype or None, got {type(out_dtype).__name__}")
        if out_dtype not in OUT_DTYPES:
            fail(op, "out_dtype", f"None or one of ({', '.join(_dtype_name(d) for d in OUT_DTYPES)})", out_dtype)
        if inplace:
            fail(op, "out_dtype", "None when inplace=True (in place writes q's own dtype)", _dtype_name(out_dtype))
        if grad and out_dtype != q.dtype:
            fail(
                op,
                "out_dtype",
                "None or q's dtype while q or k requires grad (no gradient through a cast to another dtype)",
                _dtype_name(out_dtype),
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


def out_aliasing(op, q_out, k_out, read, extents=None) -> None:
    """q_out and k_out disjoint from each other and from every input (`read`: (name, tensor) pairs)."""
    if q_out is not None and k_out is not None and may_alias(q_out, k_out):
        fail(op, "k_out", "memory disjoint from q_out (both are written)", "a tensor overlapping q_out")
    written_vs_read(op, (("q_out", q_out), ("k_out", k_out)), read, extents)


ROTARY_POSITIONS = ("first", "last", "halves")


def rotary_position_arg(op, rotary_position, normed=False, allowed=ROTARY_POSITIONS) -> str:
    """'first' (dims [0, rotary_dim) rotated), 'last' ([D - rotary_dim, D): DeepSeek's [nope | rope]
    head) or 'halves' (pairs (i, i + D/2), i < rotary_dim / 2: Gemma 4's p-RoPE), among the
    values `allowed` (the op's). Returns it."""
    if not isinstance(rotary_position, str):
        raise TypeError(f"{op}: rotary_position: expected a str, got {type(rotary_position).__name__}")
    if rotary_position not in allowed:
        words = [repr(p) for p in allowed]
        fail(op, "rotary_position", f"{', '.join(words[:-1])} or {words[-1]}", repr(rotary_position))
    if rotary_position == "last" and normed:
        fail(
            op,
            "rotary_position",
            "'first' with q_norm_weight / k_norm_weight (the fused norm covers the head from dim 0)",
            "'last'",
        )
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
        fail(op, "mrope_section", "None with cu_seqlens (M-RoPE takes its (3, *T) positions explicitly)", mrope_section)
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


def packed_values(op, cu_seqlens, n_tokens, cp_size) -> None:
    """Strict mode: cu_seqlens starts at 0, never decreases, ends at the token count, and has even
    lengths under context parallelism (one device sync)."""
    vals = cu_seqlens.tolist()
    if vals[0] != 0:
        fail(op, "cu_seqlens", "cu_seqlens[0] == 0", f"cu_seqlens[0] = {vals[0]}")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            fail(
                op,
                "cu_seqlens",
                "non-decreasing values (cumulative lengths)",
                f"cu_seqlens[{i}] = {vals[i]} < cu_seqlens[{i - 1}] = {vals[i - 1]}",
            )
        if cp_size > 1 and (vals[i] - vals[i - 1]) % 2:
            fail(
                op,
                "cu_seqlens",
                f"even local lengths when cp_size = {cp_size} > 1",
                f"length {vals[i] - vals[i - 1]} for sequence {i - 1}",
            )
    if vals[-1] != n_tokens:
        fail(op, "cu_seqlens", f"cu_seqlens[-1] == {n_tokens} (the tokens of q)", f"cu_seqlens[-1] = {vals[-1]}")


def first_index(bad: torch.Tensor) -> tuple:
    """The index of the first True element of a bool tensor (row-major order)."""
    flat = int(bad.flatten().nonzero()[0, 0])
    return tuple(int(v) for v in torch.unravel_index(torch.tensor(flat), tuple(bad.shape)))


def positions_in_range(op: str, positions: torch.Tensor, max_position: int) -> None:
    """Strict mode: name the first out-of-range position (one device sync)."""
    bad = (positions < 0) | (positions >= max_position)
    if bool(bad.any()):
        index = first_index(bad)
        value = int(positions[index])
        fail(
            op,
            "positions",
            f"values in [0, {max_position}) (the rows of cos_sin_cache)",
            f"positions{list(index)} = {value}",
        )


def angle_args(op, q, k, cos, sin, *, mrope_section, mrope_interleaved):
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
            f"the shape and dtype of cos {tuple(cos.shape)} {_dtype_name(cos.dtype)}",
            f"{tuple(sin.shape)} {_dtype_name(sin.dtype)}",
        )
    half = cos.shape[-1]
    if half < 1:
        fail(op, "cos", "a last dim of rotary_dim // 2 >= 1", f"shape {tuple(cos.shape)}")
    full_width_angles(op, q, k, half)
    head_sizes(op, q, k, 2 * half)
    mrope = mrope_args(op, mrope_section, mrope_interleaved, half)
    want = ((3,) if mrope is not None else ()) + token_shape + (half,)
    try:
        cos, sin = cos.broadcast_to(want), sin.broadcast_to(want)
    except RuntimeError:
        hint = heads_first_hint(q, tuple(cos.shape[-3:-1])) if cos.dim() >= 3 else ""
        fail(op, "cos", f"a shape broadcastable to {want}", f"shape {tuple(cos.shape)}{hint}")
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, mrope


# --- habits from Hugging Face ---
# Calls that HF's conventions would make silently wrong are told apart here, at validation (once per
# call signature) or once per table: HF's (B, H, S, D) layout, HF's cos given as a [cos | sin]
# table, HF's full-width [f, f] cos / sin, and HF's (1, S) position_ids.

LAYOUTS = ("thd", "bshd", "bhsd", "sbhd")


class LayoutWarning(UserWarning):
    """A 4-D q whose layout reads both as (B, S, H, D) and as Hugging Face's (B, H, S, D)."""


def layout_arg(op, layout, q, sbhd=False) -> bool:
    """layout: None or 'thd' / 'bshd' (tokens first: (T, H, D) / (B, S, H, D)) or 'bhsd' (Hugging
    Face's (B, H, S, D)); with sbhd also 'sbhd' (Transformer Engine's (S, B, H, D), apply_rope's).
    Returns True for 'bhsd' (the pipeline's heads_first)."""
    if layout is None:
        return False
    if not isinstance(layout, str):
        raise TypeError(f"{op}: layout: expected a str or None, got {type(layout).__name__}")
    if layout not in LAYOUTS or (layout == "sbhd" and not sbhd):
        te = ", 'sbhd' (Transformer Engine's (S, B, H, D))" if sbhd else ""
        fail(
            op,
            "layout",
            f"'thd' or 'bshd' (tokens first), 'bhsd' (Hugging Face's (B, H, S, D)){te} or None",
            repr(layout),
        )
    rank = 3 if layout == "thd" else 4
    if isinstance(q, torch.Tensor) and q.dim() != rank:
        fail(op, "q", f"a {rank}-D tensor with layout={layout!r}", f"shape {tuple(q.shape)}")
    return layout == "bhsd"


def sbhd_args(op, q, k, positions, mrope: bool) -> None:
    """layout='sbhd': k's token dims and positions' shape in the caller's (S, B) terms (the rest is
    checked on the (B, S, H, D) views)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return
    tokens = tuple(q.shape[:2])
    if isinstance(k, torch.Tensor) and k.dim() == 4 and tuple(k.shape[:2]) != tokens:
        fail(op, "k", f"token dims {tokens} ((S, B), those of q)", f"shape {tuple(k.shape)}")
    if isinstance(positions, torch.Tensor):
        want = ((3,) if mrope else ()) + tokens
        if not broadcasts_to(tuple(positions.shape), want):
            fail(
                op,
                "positions",
                f"shape {want} ({'(3, S, B)' if mrope else '(S, B)'} with layout='sbhd'; size-1 dims broadcast)",
                f"shape {tuple(positions.shape)}",
            )


def broadcasts_to(shape, want) -> bool:
    """shape has want's rank and each dim is want's or 1 (an expand view reaches want)."""
    return len(shape) == len(want) and all(s == w or s == 1 for s, w in zip(shape, want))


def heads_first_hint(q, tokens) -> str:
    """A note for a shape error: `tokens` (the token dims an argument has) would fit q read as
    Hugging Face's (B, H, S, D), i.e. (B, S)."""
    if isinstance(q, torch.Tensor) and q.dim() == 4 and broadcasts_to(tuple(tokens), (q.shape[0], q.shape[2])):
        return " (they fit q read as Hugging Face's (B, H, S, D): pass layout='bhsd')"
    return ""


def looks_heads_first(q) -> bool:
    """A 4-D q whose dim 1 lies inside dim 2 in memory (stride(1) < stride(2)): how HF's (B, H, S, D)
    views of (B, S, H, D) projections look, and equally how (B, S, H, D) views of head-major
    buffers look (the strides are the same), so this can only warn, never refuse."""
    return q.dim() == 4 and q.shape[1] > 1 and q.shape[2] > 1 and q.stride(1) < q.stride(2)


def warn_ambiguous_layout(op, q, positions_none: bool, stacklevel: int = 4) -> None:
    """layout not given: warn (once per signature, from validation) when a q laid out like HF's
    (B, H, S, D) view would be read as (B, S, H, D) with angles that fit either reading."""
    if not looks_heads_first(q):
        return
    if positions_none:
        why = "positions=None is arange over dim 1"
    elif q.shape[1] == q.shape[2]:
        why = f"dims 1 and 2 are both {q.shape[1]}, so the angles fit either reading"
    else:
        return
    warnings.warn(
        f"{op}: q: shape {tuple(q.shape)} with strides {tuple(q.stride())} is read as (B, S, H, D), "
        f"and {why}; it is laid out as Hugging Face's (B, H, S, D) views are: pass layout='bhsd' if "
        "it is (B, H, S, D), or layout='bshd' to say it is (B, S, H, D) (and silence this warning)",
        LayoutWarning,
        stacklevel=stacklevel,  # the caller of the public op
    )


def addresses_known(x) -> bool:
    """Can a check compare x's data pointers? Not while tracing, through a tensor subclass (DTensor)
    or on meta (every meta tensor's address is 0: nothing is written, so no overlap matters)."""
    return type(x) is torch.Tensor and x.device.type != "meta" and not torch.compiler.is_compiling()


def data_readable(x) -> bool:
    """Can a check read x's values now? (not while tracing, capturing a CUDA graph, on meta or
    through a tensor subclass)"""
    if type(x) is not torch.Tensor or x.numel() == 0 or x.device.type == "meta":
        return False
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def halves_repeat(x: torch.Tensor) -> bool:
    """x's last dim is [a, a] (one device sync)."""
    n = x.shape[-1]
    return n % 2 == 0 and torch.equal(x[..., : n // 2], x[..., n // 2 :])


# tables whose values were read, while they live (by identity: an address can be reused by a new tensor)
_READ_TABLES: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def read_new_table(spec, op, table) -> None:
    """A table that is not the last one this call signature's spec read (the caller tests that by
    identity on every call: a known signature can come with a new tensor): table_not_hf_cos, then
    remember it (weakly)."""
    table_not_hf_cos(op, table)
    spec.table = weakref.ref(table)


def table_not_hf_cos(op, table) -> None:
    """Refuse HF's cos (or sin) given as a [cos | sin] table: their rows are [f, f], while row 0 of a
    table is [cos 0 | sin 0] = [1 | 0] (times the attention factor). Reads a table once while it
    lives: one device sync, row 0 settling it for every real table."""
    if not data_readable(table) or table.dim() != 2 or table.shape[-1] % 2 or _READ_TABLES.get(id(table)) is table:
        return
    if halves_repeat(table[0]) and halves_repeat(table) and bool(table.any()):
        fail(
            op,
            "cos_sin_cache",
            "a [cos | sin] table (row p = [cos(p*f) | sin(p*f)], as ropekit.cos_sin_cache builds it)",
            f"a {tuple(table.shape)} tensor whose rows are [f, f], as Hugging Face's cos (and sin) are; build "
            "the table with ropekit.cos_sin_cache, or pass HF's cos and sin to "
            "ropekit.rotate_with_angles(q, k, cos, sin, layout='bhsd')",
        )
    _READ_TABLES[id(table)] = table


def full_width_angles(op, q, k, half) -> None:
    """cos / sin of width `half` too wide for the heads but fitting them as Hugging Face's full-width
    [f, f] form: say what to pass (a head-size error otherwise)."""
    for name, x in (("q", q), ("k", k)):
        if x is not None and half % 2 == 0 and half <= x.shape[-1] < 2 * half:
            fail(
                op,
                name,
                f"a head size >= rotary_dim ({2 * half})",
                f"head size {x.shape[-1]} (cos and sin are rotary_dim // 2 = {half} wide; Hugging Face's "
                f"hold [f, f] over rotary_dim: pass rotary_dim={half}, or cos[..., :{half // 2}] and "
                f"sin[..., :{half // 2}])",
            )


def angle_rotary_dim(op, cos, rotary_dim) -> int:
    """rotate_with_angles' rotary_dim: the number of cos / sin columns to read (rotary_dim // 2);
    cos may be rotary_dim // 2 wide or rotary_dim wide with halves [f, f] (HF's form)."""
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"{op}: rotary_dim: expected an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2:
        fail(op, "rotary_dim", "a positive even int", rotary_dim)
    width = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() > 0 else None
    if width not in (rotary_dim, rotary_dim // 2):
        fail(
            op,
            "rotary_dim",
            f"the width of cos ({width}: rotary_dim // 2, or rotary_dim for HF's [f, f] form) or twice it",
            rotary_dim,
        )
    return rotary_dim // 2


def duplicated_angles(cos, sin):
    """Are cos and sin (readable: see data_readable) HF's [f, f] form? True / False, or None when
    all angles are zero (both readings then rotate by nothing). One device sync."""
    if cos.shape != sin.shape or cos.dim() == 0 or cos.shape[-1] % 2:
        return False
    if cos.dtype not in TABLE_DTYPES or sin.dtype != cos.dtype or sin.device != cos.device:
        return False
    if not bool(sin.any()):
        return None if halves_repeat(cos) else False
    return halves_repeat(cos) and halves_repeat(sin)


# --- fused store ---
# Checks of apply_rope_and_store (ropekit.api.store). Shapes, dtypes, devices and strides are checked
# up front (they work on fake tensors under torch.compile); checks that need data pointers or data
# (aliasing, and in strict mode slots / positions / scales) run just before the launch.

import math  # noqa: E402  (kept in this section so the section stands alone)

FP8_DTYPES = (torch.float8_e4m3fn,)
# Python numbers, and the symbolic ones torch.compile passes for them under dynamic shapes
NUMBERS = (int, float, torch.SymInt, torch.SymFloat)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
_CACHE_HINT = "(num_blocks, block_size, H, D) or (num_slots, H, D)"


def scale_arg(op, name, scale, device):
    """None, a positive finite float, or a 0-d / 1-element float32 tensor on the device of q."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            fail(op, name, "a 0-d or 1-element tensor (one per-tensor scale)", f"shape {tuple(scale.shape)}")
        if scale.dtype != torch.float32:
            fail(op, name, "dtype float32", _dtype_name(scale.dtype))
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
    packed=False,
    k_nope=None,
):
    """Checks of apply_rope_and_store's arguments that need no data (positions (*T), (3, *T) with
    M-RoPE sections, or None: arange, or with packed (cu_seqlens checked by `packed_args`) derived).
    k_nope: GQA / MHA's no-rope key part beside v (`nope_part`); k_cache's rows then hold k and it.

    Returns (rotary_dim, mrope, k_scale, v_scale): mrope None or the (t, h, w) sections, scales as
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
    rot, mrope = rope_args(
        op,
        q,
        k,
        positions,
        cos_sin_cache,
        rotary_dim=rotary_dim,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
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

    for name, cache, xname, x in (("k_cache", k_cache, "k", k), ("v_cache", v_cache, "v", v)):
        tensor(op, name, cache, ndims=(3, 4), dtypes=OUT_DTYPES, device=device, shape_hint=_CACHE_HINT)
        want = tuple(x.shape[-2:])
        if name == "k_cache" and k_nope is not None:
            want, xname = (want[0], want[1] + k_nope.shape[-1]), "k and k_nope together"
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


def may_alias(a: torch.Tensor, b: torch.Tensor, budget: int = 4096) -> bool:
    """True if a and b share a byte; exact, except that a search over budget steps says True.

    In bytes, a covers a_ptr + sum(i_d * sa_d) + e (0 <= i_d < na_d, 0 <= e < a's element size)
    and b likewise from b_ptr. They meet iff b_ptr - a_ptr = sum(c_t * st_t) over the dims of both
    (a's: c in [0, n - 1]; b's: c in [-(n - 1), 0]; equal strides merged into one range, which
    makes views of one buffer with equal strides cheap). A depth-first search over those terms,
    largest stride first, pruned by what the remaining terms can reach, decides it in a few
    steps for real layouts: the k and v halves of one (num_blocks, 2, block_size, H, D) buffer,
    an MLA row [latent | rope], a fused qkv buffer, HND and NHD views.
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    if a1 < b0 or b1 < a0:
        return False
    key = (
        a.data_ptr(),
        tuple(a.shape),
        a.stride(),
        a.element_size(),
        b.data_ptr(),
        tuple(b.shape),
        b.stride(),
        b.element_size(),
        budget,
    )
    # verdicts by layout, in ropekit's one memo: KV caches are the same tensors call after call, so
    # decode pays for the search once (the key holds all the search reads)
    verdict = memo.lookup(("may_alias",) + key)
    if verdict is None:
        verdict = memo.remember(("may_alias",) + key, _may_alias_search(a, b, budget))
    return verdict


def _may_alias_search(a: torch.Tensor, b: torch.Tensor, budget: int) -> bool:
    ranges: dict = {}  # byte stride -> [lowest c, highest c]

    def add(stride, lo, hi):
        if stride < 0:
            stride, lo, hi = -stride, -hi, -lo
        if stride == 0 or lo == hi == 0:
            return
        r = ranges.setdefault(stride, [0, 0])
        r[0] += lo
        r[1] += hi

    for x, sign in ((a, 1), (b, -1)):
        es = x.element_size()
        for n, st in zip(x.shape, x.stride()):
            add(st * es, 0 if sign > 0 else -(n - 1), n - 1 if sign > 0 else 0)
        add(1, 0 if sign > 0 else -(es - 1), es - 1 if sign > 0 else 0)  # bytes within an element
    terms = sorted(((st, lo, hi) for st, (lo, hi) in ranges.items()), reverse=True)
    n = len(terms)
    reach_lo, reach_hi = [0] * (n + 1), [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        st, lo_c, hi_c = terms[i]
        reach_lo[i] = reach_lo[i + 1] + st * lo_c
        reach_hi[i] = reach_hi[i + 1] + st * hi_c
    steps = [budget]

    def reachable(i, target):
        if target > reach_hi[i] or target < reach_lo[i]:
            return False
        if i == n:
            return True  # target == 0
        st, lo_c, hi_c = terms[i]
        c_lo = max(lo_c, -((reach_hi[i + 1] - target) // st))  # ceil((target - reach_hi) / st)
        c_hi = min(hi_c, (target - reach_lo[i + 1]) // st)
        for c in range(c_lo, c_hi + 1):
            steps[0] -= 1
            if steps[0] < 0 or reachable(i + 1, target - c * st):
                return True  # out of budget: say "may overlap"
        return False

    return reachable(0, b.data_ptr() - a.data_ptr())


def extent(x) -> int:
    """Bytes from x's first element to one past its last (non-negative strides); 0 for an empty
    tensor or None."""
    if x is None or not x.numel():
        return 0
    return (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()


def store_extents(
    q,
    k,
    v,
    k_cache,
    v_cache,
    positions=None,
    table=None,
    slot_mapping=None,
    q_out=None,
    wq=None,
    wk=None,
    q_nope=None,
    k_nope=None,
) -> tuple:
    """Bytes from the first element to one past the last of q, k_cache, v_cache, k, v (the order
    `store_aliasing` takes them in), then of positions (or cu_seqlens), table, slot_mapping, q_out,
    the norm weights of q and k, the no-rope parts q_nope and k_nope; 0 for an empty tensor or None."""
    tensors = (q, k_cache, v_cache, k, v, positions, table, slot_mapping, q_out, wq, wk, q_nope, k_nope)
    return tuple(extent(x) for x in tensors)


def store_aliasing(op, q, k, v, k_cache, v_cache, extents=None, memo=None, q_out=None, write_key=False) -> None:
    """Nothing written (q or q_out, k_cache, v_cache, and k with write_key) may share memory with
    anything else the kernel touches.

    Pairs whose byte ranges miss each other (the usual case) cost two compares; the others are
    decided by may_alias. `extents` (store_extents of these tensors) and `memo` (a dict kept per
    call signature: verdicts by pair and byte distance) let repeated calls skip the work.
    """
    if extents is None:
        extents = store_extents(q, k, v, k_cache, v_cache, q_out=q_out)
    # the written ones first (q's place taken by q_out when given, q then read last), then the read ones
    named = [
        ("q", q, extents[0]) if q_out is None else ("q_out", q_out, extents[8]),
        ("k_cache", k_cache, extents[1]),
        ("v_cache", v_cache, extents[2]),
        ("k", k, extents[3]),
        ("v", v, extents[4]),
    ]
    if q_out is not None:
        named.append(("q", q, extents[0]))
    n = len(named)
    ptrs = [x.data_ptr() for _, x, _ in named]
    for i in range(4 if write_key else 3):  # the written ones, against all that follow
        for j in range(i + 1, n):
            a, b = ptrs[i], ptrs[j]
            if not (a < b + named[j][2] and b < a + named[i][2]):
                continue
            key = (i, j, b - a)
            verdict = None if memo is None else memo.get(key)
            if verdict is None:
                verdict = may_alias(named[i][1], named[j][1])
                if memo is not None:
                    if len(memo) >= 64:
                        memo.clear()
                    memo[key] = verdict
            if verdict:
                fail(
                    op,
                    named[j][0],
                    f"memory disjoint from {named[i][0]} (which is written)",
                    f"a tensor overlapping {named[i][0]}",
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


def slots_in_range(op: str, slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Strict mode: name the first slot past the cache (one device sync). Negative slots are padding."""
    bad = slot_mapping >= num_slots
    if bool(bad.any()):
        flat = int(bad.flatten().nonzero()[0, 0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(slot_mapping.shape)))
        fail(
            op,
            "slot_mapping",
            f"values < {num_slots} (num_blocks * block_size of the caches; < 0 skips a token)",
            f"slot_mapping{list(index)} = {int(slot_mapping[index])}",
        )


def scale_value(op: str, name: str, scale: torch.Tensor) -> None:
    """Strict mode: a tensor scale must be finite and > 0 (one device sync)."""
    value = float(scale.reshape(()))
    if not (math.isfinite(value) and value > 0):
        fail(op, name, "a finite scale > 0", value)


# --- re-rotation of cached keys ---
# Checks of rerotate_kv_cache (ropekit.api.rerotate). The device is the cache's; messages say so.
# As for the store: shapes, dtypes, devices and strides up front (fake tensors under torch.compile),
# addresses just before the launch, data (slots, shifts, scale) only in strict mode.


def _on_device(op, name, x, device) -> None:
    if isinstance(x, torch.Tensor) and x.device != device:
        fail(op, name, f"a tensor on {device} (the device of k_cache)", f"one on {x.device}")


def _slot_vector(op, name, x, n, device) -> None:
    """slots / dst_slots / delta: a (N,) int32/int64 tensor on the cache's device."""
    _on_device(op, name, x, device)
    tensor(op, name, x, ndims=(1,), dtypes=INDEX_DTYPES, shape_hint="(N,)", last_stride_one=False)
    if n is not None and x.shape[0] != n:
        fail(op, name, f"shape ({n},) (that of slots)", f"shape {tuple(x.shape)}")


def rerotate_args(op, k_cache, slots, delta, cos_sin_cache, *, interleaved, rotary_dim, k_scale, dst_slots):
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
    if delta_int is not None:
        int_shift(op, delta_int, cos_sin_cache.shape[0])
    return rotary_dim, num_slots, k_scale, delta_int


def int_shift(op, delta: int, max_position: int) -> None:
    """A Python int delta is a host value: |delta| < max_position is checked for free, every call."""
    if not -max_position < delta < max_position:
        fail(op, "delta", f"an int in (-{max_position}, {max_position}) (the rows of cos_sin_cache)", delta)


def rerotate_aliasing(op, k_cache, slots, delta, cos_sin_cache, k_scale, dst_slots, extents=None) -> None:
    """The cache (written) shares no byte with the slots, shifts, table or scale (read).
    extents: None, or the byte extents of (k_cache, slots, dst_slots, delta, cos_sin_cache, k_scale)
    (0 for None), kept per call signature: pairs whose ranges miss each other cost two compares."""
    written_vs_read(
        op,
        (("k_cache", k_cache),),
        (
            ("slots", slots),
            ("dst_slots", dst_slots),
            ("delta", delta),
            ("cos_sin_cache", cos_sin_cache),
            ("k_scale", k_scale),
        ),
        extents=extents,
    )


def _first(op, name, bad, values, expected) -> None:
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        fail(op, name, expected, f"{name}[{i}] = {int(values[i])}")


def rerotate_values(op, slots, delta, dst_slots, num_slots, max_position) -> None:
    """Strict mode (one device sync): slots and dst_slots below num_slots, |delta| below the table's rows
    for every row that is not padding, and no destination row that is also a source row."""
    _first(
        op,
        "slots",
        slots >= num_slots,
        slots,
        f"values < {num_slots} (num_blocks * block_size of k_cache; < 0 skips a row)",
    )
    live = slots >= 0
    if dst_slots is not None:
        _first(
            op,
            "dst_slots",
            dst_slots >= num_slots,
            dst_slots,
            f"values < {num_slots} (num_blocks * block_size of k_cache; < 0 skips a row)",
        )
        live = live & (dst_slots >= 0)
    if isinstance(delta, torch.Tensor):
        # no abs(): it wraps at the most negative int
        _first(
            op,
            "delta",
            live & ((delta >= max_position) | (delta <= -max_position)),
            delta,
            f"values in (-{max_position}, {max_position}) (the rows of cos_sin_cache) where slots >= 0",
        )
    else:
        int_shift(op, delta, max_position)
    if dst_slots is not None:
        sources = slots[live]
        _first(
            op,
            "dst_slots",
            live & torch.isin(dst_slots, sources),
            dst_slots,
            "rows that are not source rows (slots) of the same call",
        )


def norm_weights(op, q, k, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset, *, inplace=False):
    """Checks of the q/k RMSNorm arguments (after q and k themselves are checked).

    A weight of shape (D,) normalizes each head, (H*D,) all heads of a token together. Returns the
    kernel's modes (q, k): 0 no norm, 1 per head, 2 across heads.
    """
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
    return tuple(modes)


def norm_flags(op, *, inverse=False, inplace=False, grad=False, out_interleaved=False) -> None:
    """The flags a norm before the rotation does not compose with, each refused by name."""
    if inverse:
        fail(op, "inverse", "False with q_norm_weight / k_norm_weight (a de-rotation has no norm before it)", True)
    if inplace and grad:
        fail(
            op,
            "inplace",
            "False with q_norm_weight / k_norm_weight while autograd records the call (the norm's "
            "backward needs the unnormalized q and k)",
            True,
        )
    if out_interleaved:
        fail(op, "out_interleaved", "None (or interleaved) with q_norm_weight / k_norm_weight", "another layout")


def slots_unique(op: str, slot_mapping: torch.Tensor) -> None:
    """Strict mode: no two tokens may name one slot (the k and v rows of a slot could come from
    different tokens). Names the first duplicated slot and two tokens holding it (one device sync).
    Negative slots are padding and may repeat."""
    flat = slot_mapping.reshape(-1).long()
    if flat.numel() < 2:
        return
    order = torch.sort(flat, stable=True)
    ranks, values = order.indices, order.values
    dup = (values[1:] == values[:-1]) & (values[1:] >= 0)
    if not bool(dup.any()):
        return
    hits = dup.nonzero().flatten()
    # among duplicated pairs, the one whose second token comes first in token order
    second = ranks[hits + 1]
    j = int(second.argmin())
    first_tok, second_tok = int(ranks[hits[j]]), int(second[j])
    shape = tuple(slot_mapping.shape)
    a = [int(i) for i in torch.unravel_index(torch.tensor(first_tok), shape)]
    b = [int(i) for i in torch.unravel_index(torch.tensor(second_tok), shape)]
    fail(
        op,
        "slot_mapping",
        "distinct slots (each cache row written by one token; < 0 skips a token)",
        f"slot {int(flat[second_tok])} at slot_mapping{a} and slot_mapping{b}",
    )


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
