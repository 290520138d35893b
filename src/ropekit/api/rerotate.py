"""Re-rotation of cached keys by a position shift: validation -> plan -> one launch of `rerotate_kernel`.

    rerotate_kv_cache(k_cache, slots, delta, cos_sin_cache, *, interleaved, rotary_dim, k_scale, dst_slots,
                      rotary_position)

Serving engines that evict tokens (attention sinks + a sliding window, H2O-style eviction), shift a
context or compact a cache move keys to new positions. RoPE composes, so a cached key rotated for
position p becomes the key for p + delta after one more rotation by the angle of delta: no need to
keep unrotated keys or recompute them. CUDA tensors run the Triton kernel; CPU tensors run it
under TRITON_INTERPRET=1, otherwise the pure-PyTorch reference, with the same semantics.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch

from ..core import memo, pipeline, validate
from ..core.pipeline import CUSTOM_OP, Spec, Variant, tensor_key

OP = "rerotate_kv_cache"

Scale = Union[None, float, torch.Tensor]


def _extents(*xs) -> tuple:
    """Bytes from each tensor's first element to one past its last (0 for None or empty)."""
    return tuple(
        (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()
        if isinstance(x, torch.Tensor) and x.numel()
        else 0
        for x in xs
    )


def _checks(k_cache, slots, delta, delta_int, table, k_scale, dst_slots, spec=None) -> None:
    """The checks that need real tensors (addresses; data in strict mode), before any write. An int
    shift is a host value: its range is checked on every call (free), in any mode."""
    if delta_int is not None:
        validate.int_shift(OP, delta_int, table.shape[0])
    extents = None
    if spec is not None and spec.extents:
        extents = spec.extents + (0 if k_scale is None else 4,)  # a scale is one float32
    validate.rerotate_aliasing(OP, k_cache, slots, delta, table, k_scale, dst_slots, extents=extents)
    if validate.is_strict():
        num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
        validate.rerotate_values(
            OP, slots, delta if delta is not None else delta_int, dst_slots, num_slots, table.shape[0]
        )
        if k_scale is not None:
            validate.scale_value(OP, "k_scale", k_scale)


def _run(spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots) -> None:
    """Checks, then the run step (the kernel, or the reference on CPU)."""
    _checks(k_cache, slots, delta, delta_int, table, k_scale, dst_slots, spec)
    pipeline.run_rerotate(spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots)


def _variant(op, k_cache, interleaved, rotary_position, rot) -> Variant:
    """The record of a validated call: the pair layout (interleaved, or with rotary_position='halves'
    the pairs (i, i + D/2) of the cache's heads, refused with interleaved or an odd D)."""
    il = bool(interleaved)
    halves = validate.rotary_position_arg(op, rotary_position, allowed=("first", "halves")) == "halves"
    if halves:
        validate.halves_args(op, k_cache, None, il, q_name="k_cache")
    return Variant(il, il, angles="delta", rope_halves=halves and k_cache.shape[-1] > rot)


def _spec(rot, variant, door, k_cache, slots, dst_slots, delta, table) -> Spec:
    return Spec(
        variant,
        rot,
        door,
        pipeline.triton_runs(k_cache),
        extents=_extents(k_cache, slots, dst_slots, delta, table),
    )


# ---------------------------------------------------------------------------------------------
# torch.library registration: what torch.compile sees


@torch.library.custom_op("ropekit::rerotate_kv_cache", mutates_args=("k_cache",))
def _rerotate_op(
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    delta: Optional[torch.Tensor],
    delta_int: int,
    cos_sin_cache: torch.Tensor,
    variant: List[int],
    rotary_dim: int,
    k_scale: Optional[torch.Tensor],
    dst_slots: Optional[torch.Tensor],
) -> None:
    key = (
        "rerotate op",
        tensor_key(k_cache),
        tensor_key(slots),
        tensor_key(delta),
        tensor_key(cos_sin_cache),
        tuple(variant),
        rotary_dim,
        tensor_key(k_scale),
        tensor_key(dst_slots),
    )
    spec = _MEMO.get(key)
    if spec is None:
        v = Variant.decode(variant)
        spec = pipeline.remember(
            key, _spec(rotary_dim, v, pipeline.DIRECT, k_cache, slots, dst_slots, delta, cos_sin_cache)
        )
    _run(spec, k_cache, slots, delta, None if delta is not None else delta_int, cos_sin_cache, k_scale, dst_slots)


@_rerotate_op.register_fake
def _(k_cache, slots, delta, delta_int, cos_sin_cache, variant, rotary_dim, k_scale, dst_slots):
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
    rotary_position: str = "first",
) -> torch.Tensor:
    """Re-rotate cached keys by a position shift: the key stored at position p ends as if stored at p + delta.

    Args:
        k_cache: (num_blocks, block_size, H, D) paged or (num_slots, H, D) flat; any strides with last
            stride 1 (HND as `cache.permute(0, 2, 1, 3)`, the k half of a joint k/v buffer, MLA's rope
            part of the joint row as `cache[..., kv_lora_rank:]`). fp16/bf16/fp32 or float8_e4m3fn.
            Written in place.
        slots: (N,) int32/int64 rows to re-rotate (slot = block * block_size + offset); < 0 is padding
            (skipped).
        delta: (N,) int32/int64 shifts, or one shift for all rows: a Python int (|delta| <
            max_position, else ValueError) or a 0-d int32/int64 tensor (read on the device, no
            sync); negative allowed (the inverse rotation). Row i is rotated by the angle of table
            row |delta[i]|.
        cos_sin_cache: (max_position, rotary_dim) [cos | sin], the table the keys were rotated with.
        interleaved: False rotates halves (Llama/NeoX), True pairs (2i, 2i+1) (GPT-J, DeepSeek).
        rotary_dim: must equal the table's width (default); dims past it are not rotated.
        k_scale: None, a float or a 0-d/1-element float32 tensor: the cache holds value / k_scale
            (fp8). Rows are dequantized, rotated in float32 and quantized back with the same scale.
        dst_slots: None (in place), or (N,) rows to write the re-rotated keys into (compaction); the
            source rows are left untouched, the dims past rotary_dim are copied. A dst slot < 0 skips
            the row. Destination rows must not be source rows of the same call (strict mode checks
            it; otherwise the result is unspecified, as it is for duplicate slots or dst slots).
        rotary_position: 'first' (dims [0, rotary_dim) rotated) or 'halves': the pairs (i, i + D/2)
            for i < rotary_dim / 2 (Gemma 4's p-RoPE, as apply_rope rotated them), the other dims
            kept (untouched in place, copied with dst_slots); needs interleaved=False and an even D.

    Returns k_cache. Rows that no (slot, dst slot) pair writes are never touched.

    Bad values never cause an out-of-bounds access, and nothing is synced by default: a tensor
    |delta| outside [0, max_position) makes that row's rotated dims NaN (its tail and every other row kept);
    a slot or dst slot >= num_slots writes nothing. Under `ropekit.strict()` (or ROPEKIT_STRICT=1)
    these, destination rows that are source rows and non-finite or non-positive tensor scales raise
    ValueError before anything is written (one device sync).

    fp8: keep |value / k_scale| <= 448 (e4m3's range); nothing is clamped. Inference only.
    """
    if isinstance(delta, torch.Tensor) and delta.dim() == 0 and isinstance(slots, torch.Tensor) and slots.dim() == 1:
        delta = delta.expand(slots.shape[0])  # one shift for every row: a stride-0 view
    if torch.compiler.is_compiling():
        rot, _, k_scale, delta_int = validate.rerotate_args(
            OP,
            k_cache,
            slots,
            delta,
            cos_sin_cache,
            interleaved=interleaved,
            rotary_dim=rotary_dim,
            k_scale=k_scale,
            dst_slots=dst_slots,
        )
        variant = _variant(OP, k_cache, interleaved, rotary_position, rot)
        torch.ops.ropekit.rerotate_kv_cache(
            k_cache,
            slots,
            None if delta_int is not None else delta,
            0 if delta_int is None else delta_int,
            cos_sin_cache,
            variant.encode(),
            rot,
            pipeline.scale_tensor(k_scale, k_cache.device),
            dst_slots,
        )
        return k_cache

    # eager: validation and the launch plan are made once per call signature
    key = _call_key(k_cache, slots, delta, cos_sin_cache, interleaved, rotary_dim, k_scale, dst_slots, rotary_position)
    spec = _MEMO.get(key) if key is not None else None
    if spec is None:
        validate.no_dtensor(OP, "re-rotation", ("k_cache", k_cache))
        rot, _, _, _ = validate.rerotate_args(
            OP,
            k_cache,
            slots,
            delta,
            cos_sin_cache,
            interleaved=interleaved,
            rotary_dim=rotary_dim,
            k_scale=k_scale,
            dst_slots=dst_slots,
        )
        variant = _variant(OP, k_cache, interleaved, rotary_position, rot)
        door = pipeline.door_for(k_cache, False)
        spec = pipeline.remember(key, _spec(rot, variant, door, k_cache, slots, dst_slots, delta, cos_sin_cache))
    if spec.table is None or spec.table() is not cos_sin_cache:  # a new table: HF's cos is refused
        validate.read_new_table(spec, OP, cos_sin_cache)
    is_tensor = isinstance(delta, torch.Tensor)
    ks = pipeline.scale_tensor(k_scale, k_cache.device)
    if spec.door is CUSTOM_OP:
        torch.ops.ropekit.rerotate_kv_cache(
            k_cache,
            slots,
            delta if is_tensor else None,
            0 if is_tensor else int(delta),
            cos_sin_cache,
            spec.variant.encode(),
            spec.rot,
            ks,
            dst_slots,
        )
        return k_cache
    _run(
        spec,
        k_cache,
        slots,
        delta if is_tensor else None,
        None if is_tensor else int(delta),
        cos_sin_cache,
        ks,
        dst_slots,
    )
    # the kernel writes through raw pointers, which autograd does not see
    torch.autograd.graph.increment_version(k_cache)
    return k_cache


_MEMO = memo.MEMO  # read here without a function call per op call


def _call_key(k_cache, slots, delta, table, interleaved, rotary_dim, k_scale, dst_slots, rotary_position):
    """A hashable signature of a call (all that validation reads, with types; an int delta's value
    is checked only for its range, so only the fact that it is a small int is part of the key), or
    None when the call must be validated afresh."""
    try:
        if isinstance(delta, torch.Tensor):
            dkey = tensor_key(delta)
        elif type(delta) is int and -(2**62) < delta < 2**62:
            dkey = int
        else:
            return None
        if k_scale is None or isinstance(k_scale, torch.Tensor):
            skey = tensor_key(k_scale)
        else:
            skey = (type(k_scale), k_scale)
        key = (
            OP,
            torch.is_grad_enabled(),
            tensor_key(k_cache),
            tensor_key(slots),
            dkey,
            tensor_key(table),
            type(interleaved),
            interleaved,
            type(rotary_dim),
            rotary_dim,
            skey,
            tensor_key(dst_slots),
            type(rotary_position),
            rotary_position,
        )
        hash(key)
        return key
    except (AttributeError, TypeError):
        return None
