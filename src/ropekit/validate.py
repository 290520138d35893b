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
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

_state = threading.local()


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Within this context, positions (and slots) are checked against their bounds before launch.

    Costs one device sync per call; the default (off) makes a bad position's output NaN instead.
    `ROPEKIT_STRICT=1` in the environment turns it on globally.
    """
    previous = getattr(_state, "strict", None)
    _state.strict = enabled
    try:
        yield
    finally:
        _state.strict = previous


def is_strict() -> bool:
    value = getattr(_state, "strict", None)
    if value is None:
        return os.environ.get("ROPEKIT_STRICT", "0") not in ("", "0", "false", "False")
    return value


def fail(op: str, name: str, expected: str, given) -> None:
    raise ValueError(f"{op}: {name}: expected {expected}, got {given}")


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def tensor(op: str, name: str, x, *, ndims: Sequence[int], dtypes, device=None, shape_hint: str = "",
           last_stride_one: bool = True) -> None:
    """The common checks of one tensor argument: type, rank, dtype, device, unit last stride."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ndims:
        fail(op, name, f"a {' or '.join(f'{n}-D' for n in ndims)} tensor {shape_hint}".rstrip(),
             f"shape {tuple(x.shape)}")
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


def may_overlap(a: torch.Tensor, b: torch.Tensor, n_token_dims: int) -> bool:
    """True if a and b could share an element.

    Exact for the layouts that matter: disjoint address ranges, or views of one buffer (fused qkv)
    that share token strides and occupy disjoint byte ranges within each token's row.
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    if a1 < b0 or b1 < a0:
        return False
    if n_token_dims and a.shape[:n_token_dims] == b.shape[:n_token_dims] \
            and a.stride()[:n_token_dims] == b.stride()[:n_token_dims]:
        row_a = a[(0,) * n_token_dims]
        row_b = b[(0,) * n_token_dims]
        ra0, ra1 = _span(row_a)
        rb0, rb1 = _span(row_b)
        row_bytes = min(abs(st) for st, n in zip(a.stride()[:n_token_dims], a.shape) if n > 1) \
            * a.element_size() if any(n > 1 for n in a.shape[:n_token_dims]) else None
        disjoint_rows = ra1 < rb0 or rb1 < ra0
        fits = row_bytes is None or (max(ra1, rb1) - min(ra0, rb0) < row_bytes)
        if disjoint_rows and fits:
            return False
    return True


def has_internal_overlap(x: torch.Tensor) -> bool:
    """A broadcast (stride-0) dimension means two elements share memory: unsafe to write."""
    return any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride()))


def qk_args(op, q, k) -> tuple:
    """q and k: rank, dtype, device, unit last stride, matching token dims. Returns the token shape."""
    tensor(op, "q", q, ndims=(3, 4), dtypes=FLOAT_DTYPES, shape_hint="(T, H, D) or (B, S, H, D)")
    token_shape = tuple(q.shape[:-2])
    if k is not None:
        tensor(op, "k", k, ndims=(q.dim(),), dtypes=FLOAT_DTYPES, device=q.device,
               shape_hint=f"with the token dims of q {token_shape}")
        if tuple(k.shape[:-2]) != token_shape:
            fail(op, "k", f"token dims {token_shape} (those of q)", f"shape {tuple(k.shape)}")
    return token_shape


def mrope_args(op, mrope_section, mrope_interleaved, half):
    """None, or the (t, h, w) sections as a tuple summing to half."""
    if mrope_section is None:
        if mrope_interleaved:
            fail(op, "mrope_interleaved", "mrope_section to be given with it", "mrope_section=None")
        return None
    if not isinstance(mrope_section, (list, tuple)) or len(mrope_section) != 3 \
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in mrope_section):
        fail(op, "mrope_section", "3 non-negative ints (t, h, w) in frequency units", mrope_section)
    if sum(mrope_section) != half:
        fail(op, "mrope_section", f"sections summing to rotary_dim // 2 = {half}",
             f"{tuple(mrope_section)} (sum {sum(mrope_section)})")
    return tuple(mrope_section)


def head_sizes(op, q, k, rotary_dim):
    for name, x in (("q", q), ("k", k)):
        if x is not None and x.shape[-1] < rotary_dim:
            fail(op, name, f"a head size >= rotary_dim ({rotary_dim})", f"head size {x.shape[-1]}")


def rope_args(op, q, k, positions, cos_sin_cache, *, rotary_dim, mrope_section, mrope_interleaved, inplace):
    """Checks of apply_rope's arguments. Returns (rotary_dim, mrope) with mrope None or (t, h, w)."""
    token_shape = qk_args(op, q, k)
    device = q.device
    n_tok = len(token_shape)
    tensor(op, "cos_sin_cache", cos_sin_cache, ndims=(2,), dtypes=TABLE_DTYPES, device=device,
           shape_hint="(max_position, rotary_dim)")
    width = cos_sin_cache.shape[1]
    if rotary_dim is None:
        rotary_dim = width
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"{op}: rotary_dim: expected an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2:
        fail(op, "rotary_dim", "a positive even int", rotary_dim)
    if rotary_dim != width:
        fail(op, "rotary_dim", f"the width of cos_sin_cache ({width}: [cos | sin] of rotary_dim // 2 each)",
             rotary_dim)
    head_sizes(op, q, k, rotary_dim)
    if cos_sin_cache.shape[0] < 1:
        fail(op, "cos_sin_cache", "at least one row", f"shape {tuple(cos_sin_cache.shape)}")

    mrope = mrope_args(op, mrope_section, mrope_interleaved, rotary_dim // 2)

    if positions is None:
        if token_shape[-1] > cos_sin_cache.shape[0]:
            fail(op, "positions", f"explicit positions: None means arange({token_shape[-1]}), "
                 f"past the {cos_sin_cache.shape[0]} rows of cos_sin_cache", None)
    else:
        want = ((3,) + token_shape) if mrope is not None else token_shape
        tensor(op, "positions", positions, ndims=(len(want),), dtypes=INDEX_DTYPES, device=device,
               shape_hint=str(want), last_stride_one=False)
        if tuple(positions.shape) != want:
            what = "(3, *T) for M-RoPE" if mrope is not None else "*T, the token dims of q"
            fail(op, "positions", f"shape {want} ({what})", f"shape {tuple(positions.shape)}")

    if inplace:
        for name, x in (("q", q), ("k", k)):
            if x is not None and has_internal_overlap(x):
                fail(op, name, "a tensor without broadcast (stride 0) dims when inplace=True",
                     f"strides {tuple(x.stride())}")
        if k is not None and may_overlap(q, k, n_tok):
            fail(op, "k", "memory disjoint from q when inplace=True", "a tensor overlapping q")
        if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
            fail(op, "inplace", "False when q or k requires grad (autograd needs the inputs)", True)
    return rotary_dim, mrope


def positions_in_range(op: str, positions: torch.Tensor, max_position: int) -> None:
    """Strict mode: name the first out-of-range position (one device sync)."""
    bad = (positions < 0) | (positions >= max_position)
    if bool(bad.any()):
        flat = int(bad.flatten().nonzero()[0, 0])
        index = tuple(int(v) for v in torch.unravel_index(torch.tensor(flat), tuple(positions.shape)))
        value = int(positions[index])
        fail(op, "positions", f"values in [0, {max_position}) (the rows of cos_sin_cache)",
             f"positions{list(index)} = {value}")


def angle_args(op, q, k, cos, sin, *, mrope_section, mrope_interleaved):
    """Checks of per-token cos/sin. Returns (cos, sin, mrope) with cos/sin broadcast to full shape
    (views; both given the same strides, which the kernel assumes)."""
    token_shape = qk_args(op, q, k)
    for name, x in (("cos", cos), ("sin", sin)):
        tensor(op, name, x, ndims=range(1, 8), dtypes=TABLE_DTYPES, device=q.device, last_stride_one=False)
        if x.requires_grad and torch.is_grad_enabled():
            fail(op, name, "a tensor that does not require grad (angles are constants to ropekit)",
                 "requires_grad=True")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        fail(op, "sin", f"the shape and dtype of cos {tuple(cos.shape)} {_dtype_name(cos.dtype)}",
             f"{tuple(sin.shape)} {_dtype_name(sin.dtype)}")
    half = cos.shape[-1]
    if half < 1:
        fail(op, "cos", "a last dim of rotary_dim // 2 >= 1", f"shape {tuple(cos.shape)}")
    head_sizes(op, q, k, 2 * half)
    mrope = mrope_args(op, mrope_section, mrope_interleaved, half)
    want = ((3,) if mrope is not None else ()) + token_shape + (half,)
    try:
        cos, sin = cos.broadcast_to(want), sin.broadcast_to(want)
    except RuntimeError:
        fail(op, "cos", f"a shape broadcastable to {want}", f"shape {tuple(cos.shape)}")
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, mrope
