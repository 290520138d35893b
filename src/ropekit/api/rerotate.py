"""Re-rotation of cached keys by a position shift: `rerotate_kv_cache`, one launch of `rerotate_kernel`.

    rerotate_kv_cache(k_cache, slots, delta, cos_sin_cache, *, interleaved, rotary_dim, k_scale, dst_slots,
                      rotary_position, positions, to_cache)

Serving engines that evict tokens (attention sinks + a sliding window, H2O-style eviction), shift a
context or compact a cache move keys to new positions. RoPE composes, so a cached key rotated for
position p becomes the key for p + delta after one more rotation by the angle of delta: no need to
keep unrotated keys or recompute them. With `to_cache` (and each row's position) a row moves
between tables as well (LongRoPE's short to long factors, a YaRN factor change), in the same pass. The call goes the one call path of every op (signature ->
memoized spec -> this call's checks -> one door). CUDA tensors run the Triton kernel; CPU tensors
run it under TRITON_INTERPRET=1, otherwise the pure-PyTorch path, with the same semantics.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..core import checks, forms
from ..core.dispatch import REROTATE
from ..core.pipeline import prepare
from ..core.run import scale_tensor
from ..core.variant import DIRECT, FUNCTION, RECORD, TRACED, Signature

OP = "rerotate_kv_cache"

Scale = Union[None, float, torch.Tensor]


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
    positions: Optional[torch.Tensor] = None,
    to_cache: Optional[torch.Tensor] = None,
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

    positions: None, or with to_cache (required then) the (N,) int32/int64 position each row is
        stored for, a row of cos_sin_cache.
    to_cache: None, or a second (max_position', rotary_dim) [cos | sin] table (same width; float32
        recommended): row i moves from cos_sin_cache[positions[i]] to to_cache[positions[i] +
        delta[i]] in one rotation (delta 0: a pure table switch), composed in float32 and rounded
        once. Tables that fold an attention factor into cos / sin (YaRN, LongRoPE) compose exactly:
        the from-row's magnitude is divided out, the to-row's applied. An int delta must lie in
        (-len(cos_sin_cache), len(to_cache)); a position outside cos_sin_cache or a positions + delta
        outside to_cache makes that row's rotated dims NaN (strict mode: ValueError naming it).

    fp8: keep |value / k_scale| <= 448 (e4m3's range); nothing is clamped. Inference only.

    Example, StreamingLLM-style eviction: the keys kept after dropping 100 tokens move 100
    positions back, in place (k_cache (num_blocks, 16, 8, 128) bf16, slots (N,) int64)::

        ropekit.rerotate_kv_cache(k_cache, slots, -100, cos_sin_cache)
    """
    if isinstance(delta, torch.Tensor) and delta.dim() == 0 and isinstance(slots, torch.Tensor) and slots.dim() == 1:
        delta = delta.expand(slots.shape[0])  # one shift for every row: a stride-0 view
    is_tensor = isinstance(delta, torch.Tensor)
    # an int shift's value is checked on every call (its range, free): the key holds its type only
    small_int = type(delta) is int and -(2**62) < delta < 2**62
    spec, door = prepare(
        _REROTATE,
        (k_cache, slots, delta, cos_sin_cache),
        (interleaved, rotary_dim, k_scale, dst_slots, rotary_position, positions, to_cache),
        checks.rerotate,
        (k_cache, slots, int, cos_sin_cache) if small_int else None,
    )
    if door is not TRACED:
        if spec.table is None or spec.table() is not cos_sin_cache:
            forms.read_new_table(spec, OP, cos_sin_cache)  # a new table: HF's cos is refused
        if to_cache is not None:
            forms.table_not_hf_cos(OP, to_cache)  # read once per table (remembered by identity)
    ks = k_scale if k_scale is None or isinstance(k_scale, torch.Tensor) else scale_tensor(k_scale, k_cache.device)
    shift = None if is_tensor else int(delta)
    delta = delta if is_tensor else None
    if door is DIRECT or door is FUNCTION:  # the custom op checks its call when it runs
        addrs = checks.rerotate_call(
            spec, k_cache, slots, delta, shift, cos_sin_cache, ks, dst_slots, positions, to_cache
        )
        if spec.record and REROTATE[RECORD](spec, k_cache, addrs, shift):  # the steady state's launch record
            return k_cache
    REROTATE[door](spec, k_cache, slots, delta, shift, cos_sin_cache, ks, dst_slots, positions, to_cache)
    return k_cache


_REROTATE = Signature.of(rerotate_kv_cache)
