"""Re-rotation of cached keys by a position shift: validation -> plan -> one launch of `rerotate_kernel`.

    rerotate_kv_cache(k_cache, slots, delta, cos_sin_cache, *, interleaved, rotary_dim, k_scale, dst_slots)

Serving engines that evict tokens (attention sinks + a sliding window, H2O-style eviction), shift a
context or compact a cache move keys to new positions. RoPE composes, so a cached key rotated for
position p becomes the key for p + delta after one more rotation by the angle of delta: no need to
keep unrotated keys or recompute them. CUDA tensors run the Triton kernel; CPU tensors run it
under TRITON_INTERPRET=1, otherwise the pure-PyTorch reference, with the same semantics.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import torch

from . import reference, validate
from .launch import launch as launch_kernel
from .ops import _next_pow2, _use_triton
from .store import _pair_bits, _scale_tensor, _sig, _slot_geometry

OP = "rerotate_kv_cache"

Scale = Union[None, float, torch.Tensor]

# elements per program: one row of 8 heads x 128 (W12's shape) in one program
_BLOCK_ELEMS = 1024


@functools.lru_cache(maxsize=None)
def _meta(half: int, n_heads: int, tail: int):
    """(HALF_PAD, BLOCK_H, TAIL_PAD, head blocks, num_warps) for a cache shape; cached for decode."""
    half_pad = _next_pow2(half)
    block_h = min(_next_pow2(n_heads), _next_pow2(max(1, _BLOCK_ELEMS // (2 * half_pad))))
    tail_pad = _next_pow2(tail) if tail > 0 else 0
    return half_pad, block_h, tail_pad, -(-n_heads // block_h), 4 if block_h * 2 * half_pad >= 1024 else 2


class Launch(NamedTuple):
    """A rerotate_kernel launch minus its tensors and its scalar shift: planned once per call signature."""
    grid: tuple
    args: tuple             # the runtime ints after the pointers and delta_value, in kernel order
    meta: dict              # constexprs and num_warps
    compiled: dict          # ropekit.launch's cache of compiled kernels for this plan


def _plan(k_cache, slots, delta, table, dst_slots, interleaved: bool, rot: int, scaled: bool) -> Launch:
    """Grid, runtime arguments and constexprs of one call signature (delta: a tensor or None for an int)."""
    half = rot // 2
    n_heads, d = k_cache.shape[-2], k_cache.shape[-1]
    tail = d - rot if dst_slots is not None else 0      # in place, the tail already sits where it belongs
    half_pad, block_h, tail_pad, n_blocks, num_warps = _meta(half, n_heads, tail)
    block_size, stride_block, stride_offset, stride_head = _slot_geometry(k_cache)
    args = (
        n_heads, d - rot, table.shape[0], half * table.stride(1), block_size, k_cache.shape[0] * block_size,
        slots.stride(0), 0 if dst_slots is None else dst_slots.stride(0),
        0 if delta is None else delta.stride(0), table.stride(0), table.stride(1),
        stride_block, stride_offset, stride_head,
    )
    meta = dict(
        HALF=half, HALF_PAD=half_pad, BLOCK_H=block_h, TAIL_PAD=tail_pad, INTERLEAVED=interleaved,
        HAS_DST=dst_slots is not None, DELTA_SCALAR=delta is None, SCALED=scaled,
        PACK=_pair_bits(k_cache) if interleaved else 0, num_warps=num_warps,
    )
    return Launch((slots.shape[0], n_blocks), args, meta, {})


def _fire(launch: Launch, k_cache, slots, delta, delta_int, table, dst_slots, k_scale) -> None:
    from .kernels.rerotate import rerotate_kernel

    meta = launch.meta
    # packed pairs need a word-aligned base pointer too (a view may start at an odd element)
    if meta["PACK"] and k_cache.data_ptr() % (meta["PACK"] // 8):
        meta = dict(meta, PACK=0)
    # pointers never read under the plan's flags point at the table (any valid address)
    ptrs = (k_cache, slots, slots if dst_slots is None else dst_slots, slots if delta is None else delta, table,
            table if k_scale is None else k_scale)
    # an int shift travels as int32 (one compiled kernel for every value): a |delta| past 2^31 - 1 is
    # past any table anyway, and stays past it when clamped
    value = 0 if delta_int is None else max(-(2**31 - 1), min(2**31 - 1, delta_int))
    launch_kernel(rerotate_kernel, launch.compiled, (meta["PACK"],), launch.grid, ptrs,
                  (value, *launch.args), meta)


def _checks(k_cache, slots, delta, delta_int, table, k_scale, dst_slots) -> None:
    """The checks that need real tensors (addresses; data in strict mode), before any write."""
    validate.rerotate_aliasing(OP, k_cache, slots, delta, table, k_scale, dst_slots)
    if validate.is_strict():
        num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
        validate.rerotate_values(OP, slots, delta if delta is not None else delta_int, dst_slots, num_slots,
                                 table.shape[0])
        if k_scale is not None:
            validate.scale_value(OP, "k_scale", k_scale)


def _run(k_cache, slots, delta, delta_int, table, interleaved, rot, k_scale, dst_slots, plan=None) -> None:
    """Checks, then the kernel (or the reference on CPU). plan: a one-slot list caching the Launch."""
    _checks(k_cache, slots, delta, delta_int, table, k_scale, dst_slots)
    if slots.shape[0] == 0:
        return
    if _use_triton(k_cache):
        launch = plan[0] if plan is not None else None
        if launch is None:
            launch = _plan(k_cache, slots, delta, table, dst_slots, interleaved, rot, k_scale is not None)
            if plan is not None:
                plan[0] = launch
        _fire(launch, k_cache, slots, delta, delta_int, table, dst_slots, k_scale)
    else:
        reference.rerotate_kv_cache(k_cache, slots, delta if delta is not None else delta_int, table,
                                    interleaved=interleaved, rotary_dim=rot, k_scale=k_scale, dst_slots=dst_slots)


# ---------------------------------------------------------------------------------------------
# torch.library registration: what torch.compile sees


@torch.library.custom_op("ropekit::rerotate_kv_cache", mutates_args=("k_cache",))
def _rerotate_op(
    k_cache: torch.Tensor, slots: torch.Tensor, delta: Optional[torch.Tensor], delta_int: int,
    cos_sin_cache: torch.Tensor, interleaved: bool, rotary_dim: int, k_scale: Optional[torch.Tensor],
    dst_slots: Optional[torch.Tensor],
) -> None:
    _run(k_cache, slots, delta, None if delta is not None else delta_int, cos_sin_cache, interleaved, rotary_dim,
         k_scale, dst_slots)


@_rerotate_op.register_fake
def _(k_cache, slots, delta, delta_int, cos_sin_cache, interleaved, rotary_dim, k_scale, dst_slots):
    return None


# ---------------------------------------------------------------------------------------------
# public op


def rerotate_kv_cache(
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    delta: Union[torch.Tensor, int],
    cos_sin_cache: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    k_scale: Scale = None,
    dst_slots: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Re-rotate cached keys by a position shift: the key stored at position p ends as if stored at p + delta.

    Args:
        k_cache: (num_blocks, block_size, H, D) paged or (num_slots, H, D) flat; any strides with last
            stride 1 (HND as `cache.permute(0, 2, 1, 3)`, the k half of a joint k/v buffer, MLA's rope
            part of the joint row as `cache[..., kv_lora_rank:]`). fp16/bf16/fp32 or float8_e4m3fn.
            Written in place.
        slots: (N,) int32/int64 rows to re-rotate (slot = block * block_size + offset); < 0 is padding
            (skipped).
        delta: (N,) int32/int64 shifts, or one Python int for all rows; negative allowed (the inverse
            rotation). Row i is rotated by the angle of table row |delta[i]|.
        cos_sin_cache: (max_position, rotary_dim) [cos | sin], the table the keys were rotated with.
        interleaved: False rotates halves (Llama/NeoX), True pairs (2i, 2i+1) (GPT-J, DeepSeek).
        rotary_dim: must equal the table's width (default); dims past it are not rotated.
        k_scale: None, a float or a 0-d/1-element float32 tensor: the cache holds value / k_scale
            (fp8). Rows are dequantized, rotated in float32 and quantized back with the same scale.
        dst_slots: None (in place), or (N,) rows to write the re-rotated keys into (compaction); the
            source rows are left untouched, the dims past rotary_dim are copied. A dst slot < 0 skips
            the row. Destination rows must not be source rows of the same call (strict mode checks
            it; otherwise the result is unspecified, as it is for duplicate slots or dst slots).

    Returns k_cache. Rows that no (slot, dst slot) pair writes are never touched.

    Bad values never cause an out-of-bounds access, and nothing is synced by default: a |delta|
    outside [0, max_position) makes that row's rotated dims NaN (its tail and every other row kept);
    a slot or dst slot >= num_slots writes nothing. Under `ropekit.strict()` (or ROPEKIT_STRICT=1)
    these, destination rows that are source rows and non-finite or non-positive tensor scales raise
    ValueError before anything is written (one device sync).

    fp8: keep |value / k_scale| <= 448 (e4m3's range); nothing is clamped. Inference only.
    """
    if torch.compiler.is_compiling():
        rot, _, k_scale, delta_int = validate.rerotate_args(
            OP, k_cache, slots, delta, cos_sin_cache, interleaved=interleaved, rotary_dim=rotary_dim,
            k_scale=k_scale, dst_slots=dst_slots)
        torch.ops.ropekit.rerotate_kv_cache(
            k_cache, slots, None if delta_int is not None else delta, 0 if delta_int is None else delta_int,
            cos_sin_cache, bool(interleaved), rot, _scale_tensor(k_scale, k_cache.device), dst_slots)
        return k_cache

    # eager: validation and the launch plan are made once per call signature (decode host time)
    key = _call_key(k_cache, slots, delta, cos_sin_cache, interleaved, rotary_dim, k_scale, dst_slots)
    spec = _SPECS.get(key) if key is not None else None
    if spec is None:
        rot, _, _, _ = validate.rerotate_args(
            OP, k_cache, slots, delta, cos_sin_cache, interleaved=interleaved, rotary_dim=rotary_dim,
            k_scale=k_scale, dst_slots=dst_slots)
        spec = _Spec(rot, [None])
        if key is not None:
            if len(_SPECS) >= 1024:
                _SPECS.clear()
            _SPECS[key] = spec
    is_tensor = isinstance(delta, torch.Tensor)
    _run(k_cache, slots, delta if is_tensor else None, None if is_tensor else int(delta), cos_sin_cache,
         bool(interleaved), spec.rot, _scale_tensor(k_scale, k_cache.device), dst_slots, plan=spec.launch)
    # the kernel writes through raw pointers, which autograd does not see
    torch.autograd.graph.increment_version(k_cache)
    return k_cache


class _Spec(NamedTuple):
    """What validation concluded about one call signature, and its launch plan once made."""
    rot: int
    launch: list            # [Launch or None]


_SPECS: dict = {}


def _call_key(k_cache, slots, delta, table, interleaved, rotary_dim, k_scale, dst_slots):
    """A hashable signature of a call (all that validation reads; an int delta's value is checked
    only for its range, so only the fact that it is a small int is part of the key), or None when
    the call must be validated afresh."""
    try:
        if torch.is_grad_enabled() and k_cache.requires_grad:
            return None
        if isinstance(delta, torch.Tensor):
            dkey = _sig(delta)
        elif type(delta) is int and -2**62 < delta < 2**62:
            dkey = int
        else:
            return None
        if k_scale is None:
            skey = None
        elif isinstance(k_scale, torch.Tensor):
            skey = _sig(k_scale)
        else:
            skey = (type(k_scale), k_scale)
        key = (_sig(k_cache), _sig(slots), dkey, _sig(table), bool(interleaved), type(rotary_dim), rotary_dim,
               skey, None if dst_slots is None else _sig(dst_slots))
        hash(key)
        return key
    except (AttributeError, TypeError):
        return None
