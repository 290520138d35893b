"""Fused RoPE + KV-cache store: `apply_rope_and_store`, one launch of `rope_store_kernel`.

    apply_rope_and_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ...)

Serving engines rotate q and k, then write k and v into the KV cache: two or three launches and a
round trip of k through memory. Here one kernel rotates q in place and writes rotated k and v
straight into the cache rows `slot_mapping` names. The call goes through ropekit.pipeline like the
rotation ops (signature -> memoized spec -> door -> run); CPU tensors without TRITON_INTERPRET=1
run the pure-PyTorch reference with the same semantics.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import pipeline, validate
from .pipeline import CUSTOM_OP, Spec, Variant, tensor_key

OP = "apply_rope_and_store"

Scale = Union[None, float, torch.Tensor]
_MEMO = pipeline._MEMO


def _checks(spec, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """The checks that need real tensors (addresses; data in strict mode), before any write."""
    validate.store_aliasing(
        OP,
        q,
        k,
        v,
        k_cache,
        v_cache,
        extents=None if spec is None else spec.extents,
        memo=None if spec is None else spec.alias,
    )
    extents = None
    if spec is not None:
        ext = spec.extents
        extents = (
            ext[0],
            ext[1],
            ext[2],
            ext[5],
            ext[6],
            ext[7],
            0 if k_scale is None else 4,
            0 if v_scale is None else 4,
        )  # scales: one float32
    validate.written_vs_read(
        OP,
        (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)),
        (
            ("positions", positions),
            ("cos_sin_cache", cos_sin_cache),
            ("slot_mapping", slot_mapping),
            ("k_scale", k_scale),
            ("v_scale", v_scale),
        ),
        extents=extents,
    )
    if validate.is_strict():
        if positions is not None:
            validate.positions_in_range(OP, positions, cos_sin_cache.shape[0])
        num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
        validate.slots_in_range(OP, slot_mapping, num_slots)
        validate.slots_unique(OP, slot_mapping)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                validate.scale_value(OP, name, scale)


def _fp8_scales(k_cache, v_cache, ks, vs, device):
    """fp8 caches always take the scaled path (scale 1.0 by default): the kernel then casts to fp8
    from float32 only, the one conversion every backend has (bf16 -> fp8 directly is not everywhere)."""
    if ks is None and k_cache.dtype in validate.FP8_DTYPES:
        ks = pipeline.scale_tensor(1.0, device, unit=True)
    if vs is None and v_cache.dtype in validate.FP8_DTYPES:
        vs = pipeline.scale_tensor(1.0, device, unit=True)
    return ks, vs


def _store_spec(
    q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, interleaved, rotary_dim, k_scale, v_scale
) -> Spec:
    rot, _, _, _, _ = validate.store_args(
        OP,
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        rotary_dim=rotary_dim,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    il = bool(interleaved)
    variant = Variant(il, il, 0, (0, 0, 0), "table" if positions is not None else "arange")
    door = pipeline.door_for(q, False)
    return Spec(
        variant,
        rot,
        door,
        pipeline.triton_runs(q),
        extents=validate.store_extents(q, k, v, k_cache, v_cache, positions, cos_sin_cache, slot_mapping),
    )


def _run(spec, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs) -> None:
    """Address checks, then the run step: the body of the eager door and of the custom op."""
    _checks(spec, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs)
    if spec.triton:
        ks, vs = _fp8_scales(k_cache, v_cache, ks, vs, q.device)
    pipeline.run_store(spec, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs)


# ---------------------------------------------------------------------------------------------
# torch.library registration: what torch.compile (and the dispatcher, for tensor subclasses) sees


@torch.library.custom_op("ropekit::rope_and_store", mutates_args=("q", "k_cache", "v_cache"))
def _rope_and_store_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool,
    rotary_dim: int,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
) -> None:
    key = (
        "rope_and_store op",
        tensor_key(q),
        tensor_key(k),
        tensor_key(v),
        tensor_key(positions),
        tensor_key(cos_sin_cache),
        tensor_key(k_cache),
        tensor_key(v_cache),
        tensor_key(slot_mapping),
        interleaved,
        rotary_dim,
        tensor_key(k_scale),
        tensor_key(v_scale),
    )
    spec = _MEMO.get(key)
    if spec is None:
        il = bool(interleaved)
        variant = Variant(il, il, 0, (0, 0, 0), "table" if positions is not None else "arange")
        spec = pipeline.remember(
            key,
            Spec(
                variant,
                rotary_dim,
                pipeline.DIRECT,
                pipeline.triton_runs(q),
                extents=validate.store_extents(q, k, v, k_cache, v_cache, positions, cos_sin_cache, slot_mapping),
            ),
        )
    _run(spec, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_rope_and_store_op.register_fake
def _(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, interleaved, rotary_dim, k_scale, v_scale):
    return None


def _scale_key(scale):
    if isinstance(scale, torch.Tensor):
        return tensor_key(scale)
    return type(scale), scale  # the value: validation depends on it (> 0, finite)


# ---------------------------------------------------------------------------------------------
# public op


def apply_rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
) -> torch.Tensor:
    """Rotate q in place; write rotated k and unrotated v into the cache rows of their slots. One launch.

    Args:
        q: (*T, Hq, Dq) fp16/bf16/fp32, *T = (T,) or (B, S); any strides, last stride 1. Rotated
            in place (dims past rotary_dim untouched).
        k: (*T, Hk, Dk), its own strides; rotated into k_cache (q and k are never mixed up:
            MLA's q_pe view of a 192-wide head and a separate k_pe are fine).
        v: (*T, Hv, Dv), copied into v_cache; Dv may differ from Dk (MLA: latent 512, rope 64).
        positions: (*T) int32/int64, or None for arange over the last token dim.
        cos_sin_cache: (max_position, rotary_dim) rows [cos | sin]; fp32 recommended.
        k_cache: (num_blocks, block_size, Hk, Dk) paged or (num_slots, Hk, Dk) flat, any strides
            with last stride 1: NHD as is, HND as `cache.permute(0, 2, 1, 3)`, the k half of a
            (num_blocks, 2, block_size, H, D) buffer as `buf[:, 0]`. fp16/bf16/fp32 or
            float8_e4m3fn (need not match k's dtype; values are cast).
        v_cache: like k_cache for v, with the same slot dims (num_blocks, block_size) or
            (num_slots,). MLA keeps one joint row [latent | rope]: pass views of one cache,
            `k_cache = cache[..., L:]`, `v_cache = cache[..., :L]` (a 3-D MLA cache
            (num_blocks, block_size, L + R) as `cache.unsqueeze(-2)` first).
        slot_mapping: (*T) int32/int64; token i goes to slot slot_mapping[i] = block * block_size
            + offset. A slot < 0 is padding: nothing is stored for that token.
        interleaved: False rotates halves (Llama/NeoX), True pairs (2i, 2i+1) (GPT-J, DeepSeek).
        rotary_dim: must equal the width of cos_sin_cache (default); dims past it are kept.
        k_scale, v_scale: None, a float, or a 0-d/1-element float32 tensor on q's device: the
            cache stores value / scale (per-tensor fp8 scaling; also honoured for other caches).
            A tensor scale is read inside the kernel: no host sync, safe in CUDA graphs. A float
            is turned into a cached device tensor (1.0 means no scaling).

    Returns q (rotated in place). Rows of the caches that no slot names are never touched.
    Duplicate slots (two tokens naming one slot) are a caller error: without strict mode the row
    holds an unspecified mix (its k row and its v row may come from different tokens); under
    `ropekit.strict()` they raise ValueError naming the slot and both tokens, before any write.

    Bad inputs never cause an out-of-bounds access, and nothing is synced by default:
    - a position outside [0, max_position): that token's rotated dims of q and of its k row are
      NaN (as in apply_rope);
    - a slot >= num_slots: nothing is stored for that token, and its rotated q dims are made NaN,
      so the mistake shows up in the attention output instead of corrupting someone else's row.
    Under `ropekit.strict()` (or ROPEKIT_STRICT=1) bad positions and slots, and tensor scales that
    are not finite and > 0, raise ValueError before anything is written (one device sync).

    fp8: values are divided by the scale in float32 and cast once (round to nearest even); keep
    |value / scale| <= 448 (e4m3's range): ropekit does not clamp, and what a value out of range
    becomes depends on the backend's cast (the GPU saturates).

    Inference only: tensors that require grad are refused while grad mode is on.

    q_norm_weight / k_norm_weight, norm_eps, norm_weight_offset: RMSNorm of q / k first, same
    launch (q's whole head normalized in place; see ropekit.qknorm).
    """
    if q_norm_weight is not None or k_norm_weight is not None:
        from .qknorm import rope_and_store_with_norm

        return rope_and_store_with_norm(
            q,
            k,
            v,
            positions,
            cos_sin_cache,
            k_cache,
            v_cache,
            slot_mapping,
            interleaved=interleaved,
            rotary_dim=rotary_dim,
            k_scale=k_scale,
            v_scale=v_scale,
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            norm_eps=norm_eps,
            norm_weight_offset=norm_weight_offset,
        )
    if torch.compiler.is_compiling():
        rot, _, _, k_scale, v_scale = validate.store_args(
            OP,
            q,
            k,
            v,
            positions,
            cos_sin_cache,
            k_cache,
            v_cache,
            slot_mapping,
            rotary_dim=rotary_dim,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        torch.ops.ropekit.rope_and_store(
            q,
            k,
            v,
            positions,
            cos_sin_cache,
            k_cache,
            v_cache,
            slot_mapping,
            bool(interleaved),
            rot,
            pipeline.scale_tensor(k_scale, q.device),
            pipeline.scale_tensor(v_scale, q.device),
        )
        return q
    try:
        key = (
            OP,
            torch.is_grad_enabled(),
            tensor_key(q),
            tensor_key(k),
            tensor_key(v),
            tensor_key(positions),
            tensor_key(cos_sin_cache),
            tensor_key(k_cache),
            tensor_key(v_cache),
            tensor_key(slot_mapping),
            type(interleaved),
            interleaved,
            type(rotary_dim),
            rotary_dim,
            _scale_key(k_scale),
            _scale_key(v_scale),
        )
        spec = _MEMO.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: validation names them
        key = spec = None
    if spec is None:
        spec = pipeline.remember(
            key,
            _store_spec(
                q,
                k,
                v,
                positions,
                cos_sin_cache,
                k_cache,
                v_cache,
                slot_mapping,
                interleaved,
                rotary_dim,
                k_scale,
                v_scale,
            ),
        )
    ks, vs = pipeline.scale_tensor(k_scale, q.device), pipeline.scale_tensor(v_scale, q.device)
    if spec.door is CUSTOM_OP:  # tensor subclasses (DTensor): through the dispatcher
        from .distributed import like

        positions, cos_sin_cache, slot_mapping, ks, vs = like(q, positions, cos_sin_cache, slot_mapping, ks, vs)
        torch.ops.ropekit.rope_and_store(
            q,
            k,
            v,
            positions,
            cos_sin_cache,
            k_cache,
            v_cache,
            slot_mapping,
            spec.variant.interleaved,
            spec.rot,
            ks,
            vs,
        )
        return q
    _run(spec, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs)
    # the kernel writes through raw pointers, which autograd does not see: bump the version counters
    # so that anything that saved q or a cache for a backward raises instead of reading new values
    for x in (q, k_cache, v_cache):
        torch.autograd.graph.increment_version(x)
    return q
