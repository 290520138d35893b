"""The rotation ops and their torch.library custom ops (each next to its fake).

    apply_rope(q, k, positions, cos_sin_cache, ...)   angles from a [cos | sin] table by position
    rotate_with_angles(q, k, cos, sin, ...)           angles given per token (Hugging Face style)
    rotate_angles(...)                                 the same for ropekit.hf: HF's (B, H, S, D)
                                                       layout and HF's unsliced cos / sin tables

Each call goes through ropekit.pipeline: a signature key, the memoized spec (validated once per
signature), then one door: the custom op under torch.compile (and for tensor subclasses), the
autograd Function when autograd records the call, else a direct run.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from . import distributed, freqs, launcher, pipeline, validate
from .pipeline import (
    CUSTOM_OP,
    DIRECT,
    FUNCTION,
    MROPE_CHUNKED,
    MROPE_INTERLEAVED,
    RotateFunction,
    RotateInPlaceFunction,
    Spec,
    Variant,
    tensor_key,
    value_key,
)
from .validate import fail

_MEMO = pipeline._MEMO  # the pipeline's memo, read here without a function call per op call
Scale = Union[None, float, torch.Tensor]


def _mrope_code(mrope_section, mrope_interleaved) -> tuple:
    """(mode, sections) of a Variant for validated M-RoPE arguments."""
    if mrope_section is None:
        return 0, (0, 0, 0)
    return (MROPE_INTERLEAVED if mrope_interleaved else MROPE_CHUNKED), tuple(mrope_section)


def _mrope_list(variant: Variant) -> Optional[List[int]]:
    """The custom ops' encoding of M-RoPE: None or [mode, t, h, w] (None, not []: an empty list
    would be a pytree node that the op's backward would have to mirror)."""
    return [variant.mrope, *variant.sections] if variant.mrope else None


def _variant_of(interleaved, out_interleaved, mrope, inverse, angles, heads_first=False) -> Variant:
    mode, sections = (mrope[0], tuple(mrope[1:])) if mrope else (0, (0, 0, 0))
    return Variant(bool(interleaved), bool(out_interleaved), mode, sections, angles, bool(inverse), heads_first)


def _extent(x):
    """Bytes from x's first element to one past its last (x with non-negative strides)."""
    if x is None or x.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()


def _spans_meet(tensors, extents) -> bool:
    """Does the byte range of q or k meet that of any other argument? (q, k written in place)"""
    ptrs = [0 if x is None else x.data_ptr() for x in tensors]
    for i in (0, 1):
        if not extents[i]:
            continue
        for j in range(len(tensors)):
            if j != i and extents[j] and ptrs[i] < ptrs[j] + extents[j] and ptrs[j] < ptrs[i] + extents[i]:
                return True
    return False


def _bump_versions(q, k) -> None:
    """The kernel writes through raw pointers, which autograd does not see: bump the version
    counters so a backward that saved q or k (for another op) raises instead of using the new values."""
    torch.autograd.graph.increment_version(q)
    if k is not None:
        torch.autograd.graph.increment_version(k)


# ---------------------------------------------------------------------------------------------
# apply_rope


def apply_rope(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    cos_sin_cache: Optional[torch.Tensor] = None,
    *,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    inplace: bool = False,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    inverse: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    q_scale: Scale = None,
    k_scale: Scale = None,
    layout: Optional[str] = None,
    inv_freq: Optional[torch.Tensor] = None,
    axes: Optional[Sequence[int]] = None,
):
    """Rotate q and k by the angles of their positions.

    Args:
        q: (*T, Hq, Dq) fp16/bf16/fp32, *T = (T,) or (B, S); any strides, last stride 1. With
            layout='bhsd': (B, Hq, S, Dq), Hugging Face's layout (results come back in it).
        k: (*T, Hk, Dk) or None; Dk may differ from Dq; its own strides.
        positions: (*T) int32/int64; (3, *T) for M-RoPE; None means arange over the last token dim.
            Dims of size 1 broadcast over the token dims (HF's (1, S) position_ids; an expand view).
        cos_sin_cache: (max_position, rotary_dim) rows [cos | sin]; fp32 recommended, bf16/fp16 ok.
            HF's cos (rows [f, f]) is refused, checked once per table.
        interleaved: False rotates halves (i, i + rotary_dim/2) (Llama/NeoX); True rotates pairs
            (2i, 2i+1) (GPT-J, Llama 4, DeepSeek).
        rotary_dim: dims [0, rotary_dim) are rotated, the rest kept; must equal the cache width.
        mrope_section: (t, h, w) frequencies per position row, summing to rotary_dim // 2.
        mrope_interleaved: Qwen3-VL's interleaved frequency layout instead of chunks.
        inplace: write into q and k; otherwise return new tensors and leave the inputs untouched.
        q_norm_weight, k_norm_weight: RMSNorm of q / k before the rotation, in the same launch:
            (D,) normalizes each head, (H * D,) all heads of a token (OLMo 2); fp32/bf16/fp16.
            y = x * rsqrt(mean(x^2) + norm_eps) * (w + norm_weight_offset) over the whole head
            (the tail past rotary_dim too), in float32; offset 1.0 for Gemma's (1 + w). Gradients
            flow to the weights as well. See ropekit.qknorm and docs/qknorm.md.
        cu_seqlens: packed sequences (THD): (N+1,) int32/int64 cumulative local lengths on q's
            device, q (T, H, D), positions None. Positions restart at 0 in every sequence and are
            derived inside the kernel (no positions tensor, no sync); cp_size / cp_rank map them
            through context parallelism's dual-chunk layout (ropekit.positions_from_cu_seqlens
            computes the same positions). Values are checked in strict mode only.
        inverse: rotate by -angle (R(-angle)): undoes a rotation by the same positions (the
            de-rotation of an attention output, DeepSeek-V4 style). Differentiable like the forward.
        out_dtype: dtype of the outputs (out of place only): None (q's dtype), a float dtype, or
            float8_e4m3fn / float8_e5m2 for the prologue of FP8 attention. With an fp8 out_dtype
            the stored value is saturate(rotated / scale) in float32, then one cast (round to
            nearest even): saturate clamps to the fp8 type's finite range (448 for e4m3fn, 57344
            for e5m2). Inference only: refused while q or k requires grad under grad mode.
        q_scale, k_scale: None (1.0), a float > 0, or a 0-d / 1-element float32 tensor on q's
            device (read in the kernel: no sync, safe in CUDA graphs): the per-tensor scale of
            q's / k's outputs. Given with out_dtype only.
        layout: None or 'thd' / 'bshd' (tokens first, by q's rank), or 'bhsd' (HF's (B, H, S, D)).
            None warns (ropekit.validate.LayoutWarning, once per call signature) when a 4-D q has
            the strides of HF's (B, H, S, D) view and the positions fit either reading.

        inv_freq: instead of cos_sin_cache (pass None there), float32 (rotary_dim // 2,) inverse
            frequencies: the angles are computed in the kernel, positions[axis(j), t] * inv_freq[j]
            for rotary pair j, in float32 (no table, no size limit; docs/vision.md states the error).
            positions may then be int32/int64/float32/float64, negative and fractional values
            included. When inv_freq requires grad (learnable frequencies) it gets a gradient.
        axes: with inv_freq, the number of rotary pairs of each axis (1 to 4 ints summing to
            len(inv_freq), e.g. (8, 28, 28) for Flux; ropekit.axial_inv_freq builds the
            frequencies); positions are then (len(axes), *T). None: positions (*T) drive all pairs.

    Returns (q_out, k_out), k_out None when k is None. Math in float32, outputs in input dtypes.
    A position outside [0, max_position) gives NaN in that token's rotated dims (never an
    out-of-bounds read); under `ropekit.strict()` it raises ValueError before anything is written.
    Differentiable in q and k (the backward is the inverse rotation, by the same kernel), in
    place too (autograd's in-place rules: q and k are marked dirty; a leaf that requires grad
    cannot be rotated in place, as with any in-place torch op).
    """
    if inv_freq is not None or axes is not None:
        return _rope_freqs(
            q,
            k,
            positions,
            inv_freq,
            axes,
            interleaved,
            rotary_dim,
            inplace,
            (q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset),
            inverse,
            (
                ("cos_sin_cache", cos_sin_cache),
                ("mrope_section", mrope_section),
                ("cu_seqlens", cu_seqlens),
                ("out_dtype", out_dtype),
                ("q_scale", q_scale),
                ("k_scale", k_scale),
            ),
        )
    if q_norm_weight is not None or k_norm_weight is not None:
        if inverse is not False or out_dtype is not None or q_scale is not None or k_scale is not None:
            name = "inverse" if inverse is not False else ("out_dtype" if out_dtype is not None else "q_scale/k_scale")
            validate.fail("apply_rope", name, "its default with q_norm_weight / k_norm_weight", "a value given")
        from .qknorm import rope_with_norm

        hf = validate.layout_arg("apply_rope", layout, q)
        validate.table_not_hf_cos("apply_rope", cos_sin_cache)  # read once per table object
        if hf:  # the norm path takes tokens-first views; results are transposed back below
            q, k = pipeline.heads_first(q, hf), pipeline.heads_first(k, hf)
        if cu_seqlens is not None:  # the norm path takes positions: derive them (no sync)
            validate.packed_args("apply_rope", q, positions, cu_seqlens, cp_size, cp_rank, mrope_section)
            from .packed import packed_positions

            positions = packed_positions("apply_rope", cu_seqlens, cp_size, cp_rank, q.shape[0])
        q_out, k_out = rope_with_norm(
            q,
            k,
            _expanded_positions(q, positions, mrope_section),
            cos_sin_cache,
            interleaved=interleaved,
            rotary_dim=rotary_dim,
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            inplace=inplace,
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            norm_eps=norm_eps,
            norm_weight_offset=norm_weight_offset,
        )
        return pipeline.heads_first(q_out, hf), pipeline.heads_first(k_out, hf)
    # the angle source: positions, or cu_seqlens (positions derived from it in the kernel)
    a = positions if cu_seqlens is None else cu_seqlens
    if torch.compiler.is_compiling():
        spec = _rope_spec(
            q,
            k,
            positions,
            cos_sin_cache,
            interleaved,
            rotary_dim,
            mrope_section,
            mrope_interleaved,
            inplace,
            cu_seqlens,
            cp_size,
            cp_rank,
            inverse,
            out_dtype,
            q_scale,
            k_scale,
            layout,
        )
        if spec.angle_shape is not None:  # positions with size-1 dims: an expand view
            a = positions.expand(spec.angle_shape)
        return _rope_custom_op(spec, q, k, a, cos_sin_cache, inplace, _scales(spec, q, q_scale, k_scale))
    try:
        key = (
            "apply_rope",
            torch.is_grad_enabled(),
            tensor_key(q),
            tensor_key(k),
            tensor_key(positions),
            tensor_key(cos_sin_cache),
            type(interleaved),
            interleaved,
            type(rotary_dim),
            rotary_dim,
            None if mrope_section is None else value_key(mrope_section),
            type(mrope_interleaved),
            mrope_interleaved,
            type(inplace),
            inplace,
            tensor_key(cu_seqlens),
            type(cp_size),
            cp_size,
            type(cp_rank),
            cp_rank,
            type(inverse),
            inverse,
            out_dtype,
            _scale_key(q_scale),
            _scale_key(k_scale),
            layout,
        )
        spec = _MEMO.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: validation names them
        key = spec = None
    if spec is None:
        spec = pipeline.remember(
            key,
            _rope_spec(
                q,
                k,
                positions,
                cos_sin_cache,
                interleaved,
                rotary_dim,
                mrope_section,
                mrope_interleaved,
                inplace,
                cu_seqlens,
                cp_size,
                cp_rank,
                inverse,
                out_dtype,
                q_scale,
                k_scale,
                layout,
            ),
        )
    if spec.table is None or spec.table() is not cos_sin_cache:  # a new table: HF's cos is refused
        validate.read_new_table(spec, "apply_rope", cos_sin_cache)
    if spec.angle_shape is not None:  # positions with size-1 dims: an expand view
        a = positions = positions.expand(spec.angle_shape)
    scales = _scales(spec, q, q_scale, k_scale)
    if spec.door is CUSTOM_OP:  # tensor subclasses (DTensor): through the dispatcher
        return _rope_custom_op(spec, q, k, a, cos_sin_cache, inplace, scales)
    if inplace and _spans_meet((q, k, a, cos_sin_cache), spec.extents):
        # the checks that depend on addresses, not on the signature: exact ones only when the
        # written tensors' byte ranges meet another argument's (a cheap range test first)
        validate.inplace_aliasing(
            "apply_rope",
            q,
            k,
            (("positions" if cu_seqlens is None else "cu_seqlens", a), ("cos_sin_cache", cos_sin_cache)),
        )
    if cu_seqlens is not None and validate.is_strict():
        validate.packed_values("apply_rope", cu_seqlens, q.shape[0], cp_size)
    if positions is not None and validate.is_strict():
        validate.positions_in_range("apply_rope", positions, cos_sin_cache.shape[0])
    if spec.door is DIRECT:
        if inplace:
            pipeline.run_rotate(spec, spec.variant, q, k, q, k, a, cos_sin_cache)
            _bump_versions(q, k)
            return q, k
        q_out = pipeline.empty_like(q, dtype=spec.out_dtype)
        k_out = None if k is None else pipeline.empty_like(k, dtype=spec.out_dtype)
        pipeline.run_rotate(spec, spec.variant, q, k, q_out, k_out, a, cos_sin_cache, scales=scales)
        return q_out, k_out
    if inplace:
        # autograd lets a Function that writes into a view return that one tensor only, and q and
        # k usually are views (of a fused qkv projection): one Function call (one launch) each
        _no_leaf_written(q, k)
        spec_q, spec_k = spec.split()
        RotateInPlaceFunction.apply(q, a, cos_sin_cache, spec_q, spec.variant)
        if k is not None:
            RotateInPlaceFunction.apply(k, a, cos_sin_cache, spec_k, spec.variant)
        return q, k
    return RotateFunction.apply(q, k, a, cos_sin_cache, spec, spec.variant)


def _no_leaf_written(q, k) -> None:
    """Autograd's in-place rule, checked before the kernel writes (autograd itself would raise only
    after the forward ran): a leaf that requires grad, or a view of one, is never written."""
    for name, x in (("q", q), ("k", k)):
        if x is not None and x.requires_grad and (x.is_leaf or (x._base is not None and x._base.is_leaf)):
            validate.fail(
                "apply_rope",
                name,
                "a tensor that is not a leaf requiring grad (nor a view of one) when inplace=True under "
                "autograd: pass a clone, or inplace=False",
                "a leaf tensor that requires grad",
            )


def _scale_key(scale):
    """A scale's part of a signature: a tensor's layout, or a float's value (validation depends on it)."""
    if isinstance(scale, torch.Tensor):
        return tensor_key(scale)
    return type(scale), scale


def _scales(spec: Spec, q, q_scale, k_scale):
    """(q's, k's) float32 scale tensors for a scaled variant (floats become cached device
    tensors, None becomes 1.0), else None."""
    if not spec.variant.scaled:
        return None
    return (
        pipeline.scale_tensor(1.0 if q_scale is None else q_scale, q.device, unit=True),
        pipeline.scale_tensor(1.0 if k_scale is None else k_scale, q.device, unit=True),
    )


def _rope_spec(
    q,
    k,
    positions,
    cos_sin_cache,
    interleaved,
    rotary_dim,
    mrope_section,
    mrope_interleaved,
    inplace,
    cu_seqlens=None,
    cp_size=1,
    cp_rank=0,
    inverse=False,
    out_dtype=None,
    q_scale=None,
    k_scale=None,
    layout=None,
) -> Spec:
    op = "apply_rope"
    packed = (1, 0)
    hf = validate.layout_arg(op, layout, q)
    q_t, k_t = pipeline.heads_first(q, hf), pipeline.heads_first(k, hf)  # tokens first
    if cu_seqlens is not None or not (cp_size == 1 and cp_rank == 0):
        packed = validate.packed_args(op, q_t, positions, cu_seqlens, cp_size, cp_rank, mrope_section)
    rot, mrope = validate.rope_args(
        op,
        q_t,
        k_t,
        positions,
        cos_sin_cache,
        rotary_dim=rotary_dim,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        inplace=inplace,
        packed=cu_seqlens is not None,
        inplace_grad=True,
        broadcast=True,
    )
    validate.no_grad_table(op, cos_sin_cache)
    if layout is None:
        validate.warn_ambiguous_layout(op, q, positions is None and cu_seqlens is None)
    grad = pipeline.records_grad(q, k)
    scaled = validate.out_args(op, q, out_dtype, q_scale, k_scale, inverse, inplace=inplace, grad=grad)
    if cu_seqlens is not None:
        if inplace and type(q) is torch.Tensor and not torch.compiler.is_compiling():
            validate.inplace_aliasing(op, q, k, (("cu_seqlens", cu_seqlens),))
        angles = "packed"
    else:
        angles = "table" if positions is not None else "arange"
    mode, sections = _mrope_code(mrope if positions is not None and cu_seqlens is None else None, mrope_interleaved)
    il = bool(interleaved)
    variant = Variant(il, il, mode, sections, angles, inverse, hf, scaled=scaled)
    door = pipeline.door_for(q, grad)
    source = cu_seqlens if cu_seqlens is not None else positions
    extents = (_extent(q), _extent(k), _extent(source), _extent(cos_sin_cache))
    expand = None  # positions with size-1 dims (HF's (1, S)): the shape each call expands them to
    if angles == "table":
        want = ((3,) if mode else ()) + tuple(q_t.shape[:-2])
        expand = want if tuple(positions.shape) != want else None
    return Spec(
        variant,
        rot,
        door,
        pipeline.triton_runs(q),
        extents=extents,
        packed=packed,
        angle_shape=expand,
        inplace=bool(inplace),
        out_dtype=None if out_dtype == q.dtype else out_dtype,
    )


def _expanded_positions(q, positions, mrope_section):
    """positions with size-1 dims expanded to q's token dims ((3, *T) with M-RoPE); anything else
    as given (validation names it)."""
    if not (isinstance(q, torch.Tensor) and isinstance(positions, torch.Tensor)):
        return positions
    want = ((3,) if mrope_section is not None else ()) + tuple(q.shape[:-2])
    if tuple(positions.shape) != want and validate.broadcasts_to(tuple(positions.shape), want):
        return positions.expand(want)
    return positions


def _rope_custom_op(spec: Spec, q, k, positions, table, inplace, scales=None):
    """The dispatcher's door: torch.compile traces it, DTensor shards it, autograd through the
    custom op's registered backward. In place under autograd: the out-of-place op, then copy_
    into q and k (autograd's own in-place op: versions, views and the backward follow)."""
    v = spec.variant
    mrope = _mrope_list(v)
    qs, ks = (None, None) if scales is None else scales
    if v.angles == "packed":
        # DTensor: head-sharded or replicated q and k (distributed.OPS' rule for rotate_packed)
        positions, table, qs, ks = distributed.like(q, positions, table, qs, ks)
        outs = torch.ops.ropekit.rotate_packed(
            q,
            k,
            positions,
            table,
            spec.rot,
            v.interleaved,
            spec.packed[0],
            spec.packed[1],
            v.inverse,
            spec.out_dtype,
            qs,
            ks,
        )
        return _results(outs, q, k, inplace)
    positions, table, qs, ks = distributed.like(q, positions, table, qs, ks)
    hf = v.heads_first  # the ops take tokens-first views; results go back to HF's layout
    if inplace and not pipeline.records_grad(q, k):
        q_t, k_t = pipeline.heads_first(q, hf), pipeline.heads_first(k, hf)
        torch.ops.ropekit.rotate_(q_t, k_t, positions, table, spec.rot, v.interleaved, mrope, v.inverse)
        return q, k
    rotate = torch.ops.ropekit.rotate
    args = (positions, table, spec.rot, v.interleaved, v.out_interleaved, mrope, v.inverse, spec.out_dtype, qs, ks)
    return _results(_tokens_first_call(rotate, hf, q, k, *args), q, k, inplace)


def _results(outs, q, k, inplace):
    """(q_out, k_out) of an out-of-place custom op's outputs; in place: copied into q and k."""
    if inplace:
        q.copy_(outs[0])
        if k is not None:
            k.copy_(outs[1])
        return q, k
    return outs[0], (outs[1] if k is not None else None)


def _tokens_first_call(op, hf: bool, q, k, *args):
    """An out-of-place rotation custom op on tokens-first views of q and k ((B, H, S, D) transposed
    when hf); its outputs returned in the layout of q and k (k's None when k is None)."""
    outs = op(pipeline.heads_first(q, hf), pipeline.heads_first(k, hf), *args)
    return pipeline.heads_first(outs[0], hf), (pipeline.heads_first(outs[1], hf) if k is not None else None)


def _op_spec(tag, q, k, a, b, variant: Variant, rot: int, packed=(1, 0)) -> Spec:
    """The spec inside a custom op: its inputs were validated by the public op (or are gradients);
    only layouts are memoized here."""
    key = (tag, variant, rot, packed, tensor_key(q), tensor_key(k), tensor_key(a), tensor_key(b))
    spec = _MEMO.get(key)
    if spec is None:
        angle_shape = angle_strides = None
        if variant.angles == "tokens":
            angle_shape = tuple(a.shape)
            angle_strides = launcher.per_token_strides(a, q.dim() - 2, variant.mrope != 0)
        spec = pipeline.remember(
            key,
            Spec(
                variant,
                rot,
                DIRECT,
                pipeline.triton_runs(q),
                angle_shape=angle_shape,
                angle_strides=angle_strides,
                packed=packed,
            ),
        )
    return spec


def _rotated_outputs(
    tag, q, k, a, b, variant: Variant, rot: int, packed=(1, 0), out_dtype=None, q_scale=None, k_scale=None
) -> List[torch.Tensor]:
    """The body of every out-of-place rotation custom op: q and k (unit last stride) rotated into
    fresh outputs (of out_dtype, None: the inputs') by (a, b) as `pipeline.run_rotate` takes them;
    scaled when out_dtype is an fp8 type or a scale is given."""
    q, k = pipeline.unit_last_stride(q), pipeline.unit_last_stride(k)
    scaled = validate.is_scaled(out_dtype, q_scale, k_scale)
    if scaled:
        variant = variant.with_scaled(True)
    spec = _op_spec(tag, q, k, a, b, variant, rot, packed)
    q_out = pipeline.empty_like(q, dtype=out_dtype)
    k_out = None if k is None else pipeline.empty_like(k, dtype=out_dtype)
    scales = None
    if scaled:
        one = pipeline.scale_tensor(1.0, q.device, unit=True)
        scales = (one if q_scale is None else q_scale, one if k_scale is None else k_scale)
    pipeline.run_rotate(spec, variant, q, k, q_out, k_out, a, b, scales=scales)
    return [q_out] if k is None else [q_out, k_out]


def _fake_outputs(q, k, out_dtype=None) -> List[torch.Tensor]:
    """The fake of every out-of-place rotation custom op: the real op's output layouts (empty_like
    of the inputs, copied first when their last stride is not 1)."""
    q, k = pipeline.unit_last_stride(q), pipeline.unit_last_stride(k)
    outs = [torch.empty_like(q, dtype=out_dtype)]
    return outs if k is None else outs + [torch.empty_like(k, dtype=out_dtype)]


@torch.library.custom_op("ropekit::rotate", mutates_args=())
def _rotate_op(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    table: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    out_interleaved: bool,
    mrope: Optional[List[int]],
    inverse: bool,
    out_dtype: Optional[torch.dtype] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
) -> List[torch.Tensor]:
    variant = _variant_of(interleaved, out_interleaved, mrope, inverse, "table" if positions is not None else "arange")
    return _rotated_outputs("rotate", q, k, positions, table, variant, rotary_dim, (1, 0), out_dtype, q_scale, k_scale)


@_rotate_op.register_fake
def _(q, k, positions, table, rotary_dim, interleaved, out_interleaved, mrope, inverse, out_dtype=None, *scales):
    return _fake_outputs(q, k, out_dtype)


def _save_angles(ctx, inputs, output):
    """setup_context of both out-of-place custom ops: what the backward needs (no activations)."""
    q, k, a, b, *flags = inputs
    ctx.save_for_backward(a, b)
    ctx.flags = flags
    ctx.metas = ((q.shape, q.dtype, q.device), None if k is None else (k.shape, k.dtype, k.device))


def _inverse_backward(op_name: str, inverse_flags):
    """The backward of an out-of-place rotation custom op: the same op with the flags of the inverse
    rotation (`inverse_flags` maps the forward's flags to them), so the backward traces under
    torch.compile and is itself differentiable. One rule for every rotation op: pipeline.Variant.backward."""

    def backward(ctx, *grads):
        a, b = ctx.saved_tensors
        n_inputs = len(ctx.needs_input_grad)  # one gradient slot per argument, as autograd counts them
        gq, gk = grads[0][0], (grads[0][1] if len(grads[0]) > 1 else None)
        want_q, want_k, first, second = pipeline.grad_operands(ctx.metas, ctx.needs_input_grad, gq, gk)
        if first is None:
            return (None,) * n_inputs
        g = getattr(torch.ops.ropekit, op_name)(first, second, a, b, *inverse_flags(*ctx.flags))
        d_second = g[1] if second is not None else None
        return (*pipeline.input_grads(want_q, want_k, g[0], d_second),) + (None,) * (n_inputs - 2)

    return backward


_rotate_op.register_autograd(
    # out_dtype and scales are refused under autograd: the backward's are None
    _inverse_backward(
        "rotate", lambda rot, il, out_il, mrope, inv, *_: (rot, out_il, il, mrope, not inv, None, None, None)
    ),
    setup_context=_save_angles,
)


@torch.library.custom_op("ropekit::rotate_packed", mutates_args=())
def _rotate_packed_op(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cu_seqlens: torch.Tensor,
    table: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    cp_size: int,
    cp_rank: int,
    inverse: bool,
    out_dtype: Optional[torch.dtype] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
) -> List[torch.Tensor]:
    variant = Variant(interleaved, interleaved, angles="packed", inverse=inverse)
    return _rotated_outputs(
        "rotate_packed", q, k, cu_seqlens, table, variant, rotary_dim, (cp_size, cp_rank), out_dtype, q_scale, k_scale
    )


@_rotate_packed_op.register_fake
def _(q, k, cu_seqlens, table, rotary_dim, interleaved, cp_size, cp_rank, inverse, out_dtype=None, *scales):
    return _fake_outputs(q, k, out_dtype)


_rotate_packed_op.register_autograd(
    _inverse_backward(
        "rotate_packed",
        lambda rot, il, cp_size, cp_rank, inv, *_: (rot, il, cp_size, cp_rank, not inv, None, None, None),
    ),
    setup_context=_save_angles,
)


@torch.library.custom_op("ropekit::rotate_", mutates_args=("q", "k"))
def _rotate_inplace_op(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    table: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    mrope: Optional[List[int]],
    inverse: bool = False,
) -> None:
    # the address checks validation skips while tracing (torch.compile), made before any write
    validate.inplace_aliasing("apply_rope", q, k, (("positions", positions), ("cos_sin_cache", table)))
    variant = _variant_of(interleaved, interleaved, mrope, inverse, "table" if positions is not None else "arange")
    spec = _op_spec("rotate_", q, k, positions, table, variant, rotary_dim)
    pipeline.run_rotate(spec, variant, q, k, q, k, positions, table)


@_rotate_inplace_op.register_fake
def _(q, k, positions, table, rotary_dim, interleaved, mrope, inverse=False):
    return None


# ---------------------------------------------------------------------------------------------
# angles computed in the kernel: positions x inverse frequencies (axial N-D RoPE)


def _rope_freqs(q, k, positions, inv_freq, axes, interleaved, rotary_dim, inplace, norm, inverse, exclusive):
    """apply_rope with inv_freq (see its docstring). norm: (q weight, k weight, eps, offset);
    exclusive: (name, value) of the arguments that must be None with inv_freq."""
    op = "apply_rope"
    if inv_freq is None:
        fail(op, "inv_freq", "a tensor when axes is given (axes split inv_freq's pairs)", None)
    for name, value in exclusive:
        if value is not None:
            fail(op, name, "None with inv_freq (angles computed from positions x inv_freq)", type(value).__name__)
    if not isinstance(inverse, bool):
        raise TypeError(f"{op}: inverse: expected a bool, got {type(inverse).__name__}")
    if norm[0] is not None or norm[1] is not None:
        if inverse:
            fail(op, "inverse", "False with q_norm_weight / k_norm_weight", True)
        return _rope_freqs_norm(q, k, positions, inv_freq, axes, interleaved, rotary_dim, inplace, *norm)
    if torch.compiler.is_compiling():
        spec = _freqs_spec(q, k, positions, inv_freq, axes, interleaved, rotary_dim, inplace, inverse)
        return _freqs_custom_op(spec, q, k, positions, inv_freq, inplace)
    try:
        key = (
            "apply_rope freqs",
            torch.is_grad_enabled(),
            tensor_key(q),
            tensor_key(k),
            tensor_key(positions),
            tensor_key(inv_freq),
            None if axes is None else value_key(axes),
            type(interleaved),
            interleaved,
            type(rotary_dim),
            rotary_dim,
            type(inplace),
            inplace,
            inverse,
        )
        spec = _MEMO.get(key)
    except (AttributeError, TypeError):
        key = spec = None
    if spec is None:
        spec = pipeline.remember(
            key, _freqs_spec(q, k, positions, inv_freq, axes, interleaved, rotary_dim, inplace, inverse)
        )
    if validate.is_strict():
        validate.positions_finite(op, positions)
    if spec.door is CUSTOM_OP:  # tensor subclasses, and gradients for inv_freq
        return _freqs_custom_op(spec, q, k, positions, inv_freq, inplace)
    if inplace and _spans_meet((q, k, positions, inv_freq), spec.extents):
        validate.inplace_aliasing(op, q, k, (("positions", positions), ("inv_freq", inv_freq)))
    if spec.door is DIRECT:
        if inplace:
            pipeline.run_rotate(spec, spec.variant, q, k, q, k, positions, inv_freq)
            _bump_versions(q, k)
            return q, k
        q_out = pipeline.empty_like(q)
        k_out = None if k is None else pipeline.empty_like(k)
        pipeline.run_rotate(spec, spec.variant, q, k, q_out, k_out, positions, inv_freq)
        return q_out, k_out
    return RotateFunction.apply(q, k, positions, inv_freq, spec, spec.variant)


def _freqs_spec(q, k, positions, inv_freq, axes, interleaved, rotary_dim, inplace, inverse) -> Spec:
    validate.no_dtensor("apply_rope", "inv_freq (angles computed in the kernel)", ("q", q), ("k", k))
    rot, axes = validate.freqs_args(
        "apply_rope", q, k, positions, inv_freq, axes, rotary_dim=rotary_dim, inplace=inplace
    )
    il = bool(interleaved)
    variant = Variant(il, il, 0, axes, "freqs", inverse)
    # autograd's eager door (RotateFunction) treats angles as constants: a gradient for the
    # frequencies goes through the custom op, whose registered backward computes it
    if inv_freq.requires_grad and torch.is_grad_enabled():
        door = CUSTOM_OP
    else:
        door = pipeline.door_for(q, pipeline.records_grad(q, k))
    extents = (_extent(q), _extent(k), _extent(positions), _extent(inv_freq))
    return Spec(variant, rot, door, pipeline.triton_runs(q), extents=extents)


def _freqs_custom_op(spec: Spec, q, k, positions, inv_freq, inplace):
    v = spec.variant
    outs = torch.ops.ropekit.rotate_freqs(q, k, positions, inv_freq, v.interleaved, list(v.sections) or None, v.inverse)
    return _results(outs, q, k, inplace)


def _rope_freqs_norm(q, k, positions, inv_freq, axes, interleaved, rotary_dim, inplace, wq, wk, eps, offset):
    """QK-RMSNorm with angles from positions x inv_freq: per-token cos / sin computed once
    (`_freq_angles`), then the fused norm + rotation kernel and its backward."""
    from .qknorm import rotate_angles_with_norm

    op = "apply_rope"
    _, axes = validate.freqs_args(op, q, k, positions, inv_freq, axes, rotary_dim=rotary_dim, inplace=inplace)
    if inv_freq.requires_grad and torch.is_grad_enabled():
        fail(op, "inv_freq", "a tensor that does not require grad with q_norm_weight / k_norm_weight", "requires_grad")
    if validate.is_strict() and not torch.compiler.is_compiling():
        validate.positions_finite(op, positions)
    cos, sin = _freq_angles(positions, inv_freq, axes, tuple(q.shape[:-2]))
    return rotate_angles_with_norm(
        q,
        k,
        cos,
        sin,
        interleaved=interleaved,
        q_norm_weight=wq,
        k_norm_weight=wk,
        norm_eps=eps,
        norm_weight_offset=offset,
        op=op,
        inplace=inplace,
    )


def _freq_angles(positions, inv_freq, axes, token_shape):
    """Per-token cos and sin (*T, half) float32 of positions x inv_freq, by one launch of the kernel's
    own angle source: the rotation of the unit pairs (1, 0) of a broadcast (*T, 1, 2 * half) view is
    (cos, sin). Returned as strided views of that output."""
    half = inv_freq.shape[0]
    key = ("unit pairs", half, inv_freq.device)
    unit = _MEMO.get(key)
    if unit is None or torch.compiler.is_compiling():
        unit = torch.cat((torch.ones(half, device=inv_freq.device), torch.zeros(half, device=inv_freq.device)))
        if not torch.compiler.is_compiling():
            pipeline.remember(key, unit)
    unit = unit.expand(*token_shape, 1, 2 * half)
    with torch.no_grad():
        cs, _ = apply_rope(unit, None, positions, None, inv_freq=inv_freq.detach(), axes=axes or None)
    return cs[..., 0, :half], cs[..., 0, half:]


def _pairs(x, half: int, interleaved: bool):
    """The two members of each rotated pair of x (*T, H, D) as float32 views (*T, H, half)."""
    x = x.float()
    return (
        (x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2])
        if interleaved
        else (x[..., :half], x[..., half : 2 * half])
    )


def _freq_grad(outs, grads, positions, half: int, axes, interleaved: bool, inverse: bool) -> torch.Tensor:
    """d loss / d inv_freq (float32 (half,)), by torch ops. A pair's output o = R(angle) x moves
    with its angle as (-o2, o1), so d loss / d angle = g2 o1 - g1 o2 (summed over heads), and
    angle = position x inv_freq (negated when inverse)."""
    d_angle = 0.0
    for o, g in zip(outs, grads):
        if g is not None:
            o1, o2 = _pairs(o, half, interleaved)
            g1, g2 = _pairs(g, half, interleaved)
            d_angle = d_angle + (g2 * o1 - g1 * o2).sum(-2)
    p = freqs.pair_positions(positions, axes, half).to(torch.float32)
    d = (p * d_angle).reshape(-1, half).sum(0)
    return -d if inverse else d


@torch.library.custom_op("ropekit::rotate_freqs", mutates_args=())
def _rotate_freqs_op(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    interleaved: bool,
    axes: Optional[List[int]],
    inverse: bool,
) -> List[torch.Tensor]:
    variant = Variant(interleaved, interleaved, 0, tuple(axes or ()), "freqs", inverse)
    return _rotated_outputs("rotate_freqs", q, k, positions, inv_freq, variant, 2 * inv_freq.shape[0])


@_rotate_freqs_op.register_fake
def _(q, k, positions, inv_freq, interleaved, axes, inverse):
    return _fake_outputs(q, k)


def _save_freqs(ctx, inputs, output):
    """What the backward needs: the angles' inputs, and the outputs when inv_freq wants a gradient."""
    q, k, positions, inv_freq, *flags = inputs
    ctx.flags = flags
    ctx.metas = ((q.shape, q.dtype, q.device), None if k is None else (k.shape, k.dtype, k.device))
    ctx.save_for_backward(positions, inv_freq, *(output if inv_freq.requires_grad else ()))


def _rotate_freqs_backward(ctx, *grads):
    """q, k: the inverse rotation by the same op (traceable, differentiable); inv_freq: _freq_grad."""
    positions, inv_freq, *outs = ctx.saved_tensors
    interleaved, axes, inverse = ctx.flags
    gq, gk = grads[0][0], (grads[0][1] if len(grads[0]) > 1 else None)
    want_q, want_k, first, second = pipeline.grad_operands(ctx.metas, ctx.needs_input_grad, gq, gk)
    d_q = d_k = d_freq = None
    if first is not None:
        g = torch.ops.ropekit.rotate_freqs(first, second, positions, inv_freq, interleaved, axes, not inverse)
        d_q, d_k = pipeline.input_grads(want_q, want_k, g[0], g[1] if second is not None else None)
    if ctx.needs_input_grad[3] and outs:
        d_freq = _freq_grad(outs, (gq, gk), positions, inv_freq.shape[0], axes or (), interleaved, inverse)
    return d_q, d_k, None, d_freq, None, None, None


_rotate_freqs_op.register_autograd(_rotate_freqs_backward, setup_context=_save_freqs)


# ---------------------------------------------------------------------------------------------
# per-token angles


def rotate_with_angles(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    *,
    freqs_cis: Optional[torch.Tensor] = None,
    interleaved: Optional[bool] = None,
    out_interleaved: Optional[bool] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    layout: Optional[str] = None,
    rotary_dim: Optional[int] = None,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
):
    """Rotate q and k by per-token angles (the form Hugging Face models pass). Out of place.

    q: (*T, Hq, Dq), k: (*T, Hk, Dk) or None, as in apply_rope; with layout='bhsd' (B, H, S, D),
    HF's layout, and the results come back in it. cos, sin: broadcastable to (*T, rotary_dim // 2),
    or (3, *T, rotary_dim // 2) with mrope_section; any strides; fp32/bf16/fp16. HF's cos / sin as
    HF returns them ((B, S, R) with halves [f, f]) are taken as they are: pass rotary_dim=R to say
    so, else they are recognised from their values (once per call signature, one device sync;
    not under torch.compile, where rotary_dim says it). out_interleaved (default: interleaved) is
    the layout the rotated dims are written in (DeepSeek-V3's HF code reads pairs and writes
    halves). layout: as apply_rope's. Differentiable in q and k; cos and sin are constants
    (refused if they require grad under grad mode).

    freqs_cis: instead of cos and sin, complex64 e^(i angle) broadcastable to (*T, rotary_dim // 2)
    (or (3, *T, rotary_dim // 2) with mrope_section), as Meta's Llama code, torchtitan and
    diffusers' complex path pass it: x viewed as complex pairs times freqs_cis. Its real and
    imaginary parts are read in place (strided views, no copy). interleaved defaults to True with
    freqs_cis (pairs (2i, 2i+1) are the complex numbers), to False with cos / sin.

    q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset: RMSNorm of q / k before the
    rotation, fused, as apply_rope takes them (per head (D,) or across heads (H * D,); gradients to
    the weights); not with out_interleaved, mrope_section or layout='bhsd'.
    """
    op = "rotate_with_angles"
    if freqs_cis is not None or (cos is None and sin is None):
        cos, sin = _cis_parts(op, freqs_cis, cos, sin)
        if interleaved is None:
            interleaved = True
    if q_norm_weight is not None or k_norm_weight is not None:
        from .qknorm import rotate_angles_with_norm

        for name, value in (("out_interleaved", out_interleaved), ("mrope_section", mrope_section)):
            if value is not None:
                fail(op, name, "None with q_norm_weight / k_norm_weight", value)
        if layout is not None and validate.layout_arg(op, layout, q):
            fail(op, "layout", "a tokens-first layout with q_norm_weight / k_norm_weight", layout)
        if rotary_dim is not None:
            cos, sin = cos[..., : rotary_dim // 2], sin[..., : rotary_dim // 2]
        return rotate_angles_with_norm(
            q,
            k,
            cos,
            sin,
            interleaved=bool(interleaved),
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            norm_eps=norm_eps,
            norm_weight_offset=norm_weight_offset,
        )
    hf = None if layout is None else validate.layout_arg("rotate_with_angles", layout, q)
    return rotate_angles(
        q,
        k,
        cos,
        sin,
        interleaved=interleaved,
        out_interleaved=out_interleaved,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        heads_first=hf,
        rotary_dim=rotary_dim,
    )


def _cis_parts(op, freqs_cis, cos, sin):
    """(cos, sin) as strided float32 views of complex freqs_cis (torch.view_as_real: no copy)."""
    if cos is not None or sin is not None:
        fail(op, "freqs_cis", "None when cos and sin are given (one angle source)", "a tensor")
    if not isinstance(freqs_cis, torch.Tensor):
        raise TypeError(f"{op}: freqs_cis: expected a torch.Tensor (or cos and sin), got {type(freqs_cis).__name__}")
    if freqs_cis.dtype != torch.complex64:
        fail(op, "freqs_cis", "dtype complex64", str(freqs_cis.dtype).replace("torch.", ""))
    if freqs_cis.requires_grad and torch.is_grad_enabled():
        fail(op, "freqs_cis", "a tensor that does not require grad (angles are constants)", "requires_grad=True")
    parts = torch.view_as_real(freqs_cis.resolve_conj())
    return parts[..., 0], parts[..., 1]


def rotate_angles(
    q,
    k,
    cos,
    sin,
    *,
    interleaved=False,
    out_interleaved=None,
    mrope_section=None,
    mrope_interleaved=False,
    heads_first=False,
    columns=None,
    rotary_dim=None,
):
    """rotate_with_angles with two more options, the seam ropekit.hf calls:

    heads_first: q and k are (B, H, S, D) (Hugging Face's layout, views of (B, S, H, D)
        projections); results come back in that layout, and no view is made per call. None:
        tokens first, not said by the caller (an ambiguous layout warns).
    columns: use the first `columns` columns of cos and sin (HF's tables hold [f, f]: pass them
        unsliced with columns = rotary_dim // 2); None: decided by rotary_dim, else by the values
        (`_angle_columns`).
    """
    interleaved = bool(interleaved)
    out_il = interleaved if out_interleaved is None else out_interleaved
    if torch.compiler.is_compiling():
        columns, _ = _angle_columns(q, k, cos, sin, rotary_dim, columns)
        spec = _angles_spec(q, k, cos, sin, interleaved, out_il, mrope_section, mrope_interleaved, heads_first, columns)
        return _angles_custom_op(spec, q, k, cos, sin)
    try:
        key = (
            "rotate_angles",
            torch.is_grad_enabled(),
            tensor_key(q),
            tensor_key(k),
            tensor_key(cos),
            tensor_key(sin),
            type(interleaved),
            interleaved,
            type(out_il),
            out_il,
            None if mrope_section is None else value_key(mrope_section),
            type(mrope_interleaved),
            mrope_interleaved,
            heads_first,
            columns,
            type(rotary_dim),
            rotary_dim,
        )
        spec = _MEMO.get(key)
    except (AttributeError, TypeError):
        key = spec = None
    if spec is None:
        columns, settled = _angle_columns(q, k, cos, sin, rotary_dim, columns)
        spec = pipeline.remember(
            key if settled else None,
            _angles_spec(q, k, cos, sin, interleaved, out_il, mrope_section, mrope_interleaved, heads_first, columns),
        )
    door = spec.door
    if spec.copy_angles:  # validation had to copy cos / sin: so does every call
        cos, sin = pipeline.angle_views(spec, cos, sin)
    if door is DIRECT:
        q_out = pipeline.empty_like(q)
        k_out = None if k is None else pipeline.empty_like(k)
        pipeline.run_rotate(spec, spec.variant, q, k, q_out, k_out, cos, sin)
        return q_out, k_out
    if door is FUNCTION:
        return RotateFunction.apply(q, k, cos, sin, spec, spec.variant)
    return _angles_custom_op(spec, q, k, cos, sin)


def _angle_columns(q, k, cos, sin, rotary_dim, columns):
    """(columns of cos / sin to read, settled): HF's full-width [f, f] form reads half of them.
    settled False when the values could not tell the forms apart (all angles zero): that verdict
    is then not remembered for the signature."""
    if columns is not None:
        return columns, True
    if rotary_dim is not None:
        return validate.angle_rotary_dim("rotate_with_angles", cos, rotary_dim), True
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.dim() == 0:
        return None, True  # validation names them
    if not (validate.data_readable(cos) and validate.data_readable(sin)):
        return _columns_by_width(q, k, cos), True  # tracing, capturing, a subclass: shapes decide
    duplicated = validate.duplicated_angles(cos, sin)
    if duplicated is None:
        return _columns_by_width(q, k, cos), False
    return (cos.shape[-1] // 2 if duplicated else None), True


def _columns_by_width(q, k, cos):
    """Without values: HF's form only where rotary_dim // 2 columns could not fit the heads."""
    width = cos.shape[-1]
    too_wide = any(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[-1] < 2 * width for x in (q, k))
    return width // 2 if too_wide and width % 2 == 0 else None


def _angles_spec(q, k, cos, sin, interleaved, out_il, mrope_section, mrope_interleaved, heads_first, columns):
    op = "rotate_with_angles"
    hf = bool(heads_first)
    if columns is not None and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor):
        cos, sin = cos[..., :columns], sin[..., :columns]
    cos_v, sin_v, mrope = validate.angle_args(
        op,
        pipeline.heads_first(q, hf),
        pipeline.heads_first(k, hf),
        cos,
        sin,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
    )
    if heads_first is None:
        validate.warn_ambiguous_layout(op, q, False, stacklevel=5)
    mode, sections = _mrope_code(mrope, mrope_interleaved)
    variant = Variant(bool(interleaved), bool(out_il), mode, sections, "tokens", False, hf)
    door = pipeline.door_for(q, pipeline.records_grad(q, k))
    # broadcast views start where their tensors do, so a launch can take cos and sin as given with
    # these strides; unless validation had to copy them (cos and sin strides differ): then again per call
    copied = (
        door != CUSTOM_OP
        and not torch.compiler.is_compiling()
        and (cos_v.data_ptr() != cos.data_ptr() or sin_v.data_ptr() != sin.data_ptr())
    )
    n_tok = q.dim() - 2
    return Spec(
        variant,
        2 * cos_v.shape[-1],
        door,
        pipeline.triton_runs(q),
        copy_angles=copied,
        angle_shape=tuple(cos_v.shape),
        angle_strides=launcher.per_token_strides(cos_v, n_tok, mode != 0),
    )


def _angles_custom_op(spec: Spec, q, k, cos, sin):
    v = spec.variant
    cos, sin = distributed.like(q, *pipeline.angle_views(spec, cos, sin))
    rotate = torch.ops.ropekit.rotate_angles
    return _tokens_first_call(
        rotate, v.heads_first, q, k, cos, sin, v.interleaved, v.out_interleaved, _mrope_list(v), False
    )


@torch.library.custom_op("ropekit::rotate_angles", mutates_args=())
def _rotate_angles_op(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    out_interleaved: bool,
    mrope: Optional[List[int]],
    inverse: bool,
) -> List[torch.Tensor]:
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    variant = _variant_of(interleaved, out_interleaved, mrope, inverse, "tokens")
    return _rotated_outputs("rotate_angles", q, k, cos, sin, variant, 2 * cos.shape[-1])


@_rotate_angles_op.register_fake
def _(q, k, cos, sin, interleaved, out_interleaved, mrope, inverse):
    return _fake_outputs(q, k)


_rotate_angles_op.register_autograd(
    _inverse_backward("rotate_angles", lambda il, out_il, mrope, inv: (out_il, il, mrope, not inv)),
    setup_context=_save_angles,
)
