"""The base of every argument check: the error grammar and the checks of one tensor argument.

Each failed check raises ValueError (TypeError for a wrong type) whose message names the op, the
argument, what was expected and what was given: `op: argument: expected X, got Y`. Checks read
only shapes, strides, dtypes and devices, so they cost no device sync.
"""

from __future__ import annotations

from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


INDEX_DTYPES = (torch.int32, torch.int64)


def fail(op: str, name: str, expected: str, given) -> None:
    raise ValueError(f"{op}: {name}: expected {expected}, got {given}")


def dtype_name(dt) -> str:
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
        fail(op, name, f"dtype in ({', '.join(dtype_name(d) for d in dtypes)})", dtype_name(x.dtype))
    if device is not None and x.device != device:
        fail(op, name, f"a tensor on {device} (the device of q)", f"one on {x.device}")
    if last_stride_one and x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        fail(op, name, "stride 1 in the last dimension", f"strides {tuple(x.stride())}")


# angles computed from positions x inverse frequencies: positions may be integers or floats
POSITION_DTYPES = INDEX_DTYPES + (torch.float32, torch.float64)


OUT_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)


def broadcasts_to(shape, want) -> bool:
    """shape has want's rank and each dim is want's or 1 (an expand view reaches want)."""
    return len(shape) == len(want) and all(s == w or s == 1 for s, w in zip(shape, want))


def heads_first_hint(q, tokens) -> str:
    """A note for a shape error: `tokens` (the token dims an argument has) would fit q read as
    Hugging Face's (B, H, S, D), i.e. (B, S)."""
    if isinstance(q, torch.Tensor) and q.dim() == 4 and broadcasts_to(tuple(tokens), (q.shape[0], q.shape[2])):
        return " (they fit q read as Hugging Face's (B, H, S, D): pass layout='bhsd')"
    return ""


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


FP8_DTYPES = (torch.float8_e4m3fn,)


# Python numbers, and the symbolic ones torch.compile passes for them under dynamic shapes
NUMBERS = (int, float, torch.SymInt, torch.SymFloat)


CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
