"""The rotation ops: what a user calls.

    apply_rope(q, k, positions, cos_sin_cache, ...)   angles from a [cos | sin] table by position,
                                                       from packed cu_seqlens, or computed in the
                                                       kernel from positions x inverse frequencies
    rotate_with_angles(q, k, cos, sin, ...)           angles given per token (Hugging Face style)
    rotate_angles(...)                                 the same for ropekit.hf: HF's (B, H, S, D)
                                                       layout and HF's unsliced cos / sin tables

Every call, whatever its flags (norm, fp8 outputs, inverse, in place, layout, angle source), goes
one way: a signature key, the memoized spec (validated once per signature: its `Variant` is the
record of every flag), then one door (`_run`): the custom op of ropekit.core.library under
torch.compile and for tensor subclasses, `pipeline.RotateFunction` when autograd records the call,
else a direct run of `pipeline.run_rotate`.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence, Union

import torch

from ..core import (
    launcher,
    library,  # noqa: F401  (defines the custom ops the doors below call: torch.ops.ropekit.rotate, rotate_)
    pipeline,
    validate,
)
from ..core.pipeline import (
    ANGLE_NAMES,
    CUSTOM_OP,
    DIRECT,
    MROPE_CHUNKED,
    MROPE_INTERLEAVED,
    RotateFunction,
    RotateInPlaceFunction,
    Spec,
    Variant,
    tensor_key,
    value_key,
)
from ..core.sharding import dtensor_like
from ..core.validate import fail

_MEMO_GET = pipeline.lookup
Scale = Union[None, float, torch.Tensor]


def _mrope_code(mrope_section, mrope_interleaved) -> tuple:
    """(mode, sections) of a Variant for validated M-RoPE arguments."""
    if mrope_section is None:
        return 0, (0, 0, 0)
    return (MROPE_INTERLEAVED if mrope_interleaved else MROPE_CHUNKED), tuple(mrope_section)


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


def _no_leaf_written(q, k) -> None:
    """Autograd's in-place rule, checked before the kernel writes (autograd itself would raise only
    after the forward ran): a leaf that requires grad, or a view of one, is never written."""
    for name, x in (("q", q), ("k", k)):
        if x is None or not x.requires_grad:
            continue
        view_of_leaf = not x.is_leaf and x._base is not None and x._base.is_leaf
        if x.is_leaf or view_of_leaf:
            validate.fail(
                "apply_rope",
                name,
                "a tensor that is not a leaf requiring grad (nor a view of one) when inplace=True under "
                "autograd: pass a clone, or inplace=False",
                "a view of a leaf tensor that requires grad" if view_of_leaf else "a leaf tensor that requires grad",
            )


# ---------------------------------------------------------------------------------------------
# the doors, for every op of this module


def _run(spec: Spec, q, k, a, b, weights, scales, q_out=None, k_out=None):
    """The validated call through its door: (q_out, k_out), or q and k themselves in place.
    q_out, k_out: destinations to write (None: new tensors); never given when autograd records."""
    door = spec.door
    v = spec.variant
    if door is DIRECT:
        if v.normed and not spec.triton:  # the CPU path: torch ops, which autograd records
            outs = pipeline.norm_rotated(spec, v, q, k, a, b, weights, spec.out_dtype, scales)
            if spec.inplace:
                q_out, k_out = q, k
            return _into(outs, q_out, k_out)
        w = weights if v.normed else None
        if spec.inplace:
            pipeline.run_rotate(spec, v, q, k, q, k, a, b, weights=w)
            _bump_versions(q, k)
            return q, k
        if q_out is None:
            q_out = pipeline.empty_like(q, dtype=spec.out_dtype)
        if k_out is None and k is not None:
            k_out = pipeline.empty_like(k, dtype=spec.out_dtype)
        pipeline.run_rotate(spec, v, q, k, q_out, k_out, a, b, scales=scales, weights=w)
        return q_out, k_out
    if door is CUSTOM_OP:
        return _custom_op(spec, q, k, a, b, weights, scales, q_out, k_out)
    if spec.inplace:
        # autograd lets a Function that writes into a view return that one tensor only, and q and
        # k usually are views (of a fused qkv projection): one Function call (one launch) each
        _no_leaf_written(q, k)
        spec_q, spec_k = spec.split()
        RotateInPlaceFunction.apply(q, a, b, spec_q, v)
        if k is not None:
            RotateInPlaceFunction.apply(k, a, b, spec_k, v)
        return q, k
    return RotateFunction.apply(q, k, a, b, weights[0], weights[1], spec, v)


def _into(outs, q_out, k_out):
    """Results computed as new tensors, copied into the destinations given (None: kept as they are)."""
    res = list(outs)
    for i, dst in enumerate((q_out, k_out)):
        if dst is not None and res[i] is not None:
            res[i] = dst.copy_(res[i])
    return res[0], res[1]


def _custom_op(spec: Spec, q, k, a, b, weights, scales, q_out=None, k_out=None):
    """The dispatcher's door: torch.compile traces it, DTensor shards it, autograd through the
    custom op's registered backward. In place under autograd: the out-of-place op, then copy_
    into q and k (autograd's own in-place op: versions, views and the backward follow). Given
    destinations likewise: the out-of-place op, then copy_ into q_out / k_out (one custom op per
    schema; the compiler may fuse the copy)."""
    v = spec.variant
    hf = v.heads_first  # the ops take tokens-first views; results go back to HF's layout
    codes = v.tokens_first().encode()
    qs, ks = (None, None) if scales is None else scales
    a, b, wq, wk, qs, ks = dtensor_like(q, a, b, weights[0], weights[1], qs, ks)
    q_t, k_t = pipeline.heads_first(q, hf), pipeline.heads_first(k, hf)
    packed, norm = list(spec.packed), [spec.norm_eps, spec.norm_offset]
    if spec.inplace and not pipeline.records_grad(q, k, wq, wk, b):
        torch.ops.ropekit.rotate_(q_t, k_t, a, b, wq, wk, codes, spec.rot, packed, norm)
        return q, k
    if spec.inplace:  # refused by name before the op (the copy_ below would fail inside torch)
        _no_leaf_written(q, k)
    outs = torch.ops.ropekit.rotate(q_t, k_t, a, b, wq, wk, qs, ks, codes, spec.rot, packed, norm, spec.out_dtype)
    rotated = (pipeline.heads_first(outs[0], hf), pipeline.heads_first(outs[1], hf) if k is not None else None)
    return _into(rotated, *((q, k) if spec.inplace else (q_out, k_out)))


def _seq(x):
    """(S, B, ...) <-> (B, S, ...) views (Transformer Engine's 'sbhd' and the kernel's 'bshd')."""
    return None if x is None else x.transpose(0, 1)


def _call(spec: Spec, door, q, k, a, b, weights, scales, q_out=None, k_out=None, parts=(None, None)):
    """apply_rope's views around its door (`_run`, or `_custom_op` under torch.compile), as the
    record says: 'sbhd' tensors as (B, S, H, D) views; q or k with a last stride other than 1
    read through one contiguous copy (in place: the copy rotated, then copied back); with
    rope_last the door sees the head's last rotary_dim dims only; with nope_q / nope_k (parts:
    q_nope, k_nope) the outputs are whole heads, the door's rotation joined to the part. Results
    in the caller's layout."""
    v = spec.variant
    if not (v.seq_first or v.rope_last or spec.copy_in or v.nope_q or v.nope_k):
        return door(spec, q, k, a, b, weights, scales, q_out, k_out)
    given = (q, k, q_out, k_out)
    if v.seq_first:
        q, k, q_out, k_out = map(_seq, (q, k, q_out, k_out))
        parts = tuple(map(_seq, parts))
    views = (q, k)
    if spec.copy_in:
        if spec.inplace and pipeline.records_grad(q, k):  # the copy is no leaf: name the caller's
            _no_leaf_written(given[0], given[1])
        q, k = pipeline.unit_last_stride(q), pipeline.unit_last_stride(k)
    if v.rope_last or v.nope_q or v.nope_k:
        res = _kept_apart(spec, door, q, k, a, b, weights, scales, q_out, k_out, parts)
    else:
        res = door(spec, q, k, a, b, weights, scales, q_out, k_out)
    if spec.inplace:
        for view, x in zip(views, (q, k)):
            if x is not view:
                view.copy_(x)
        return given[0], given[1]
    if v.seq_first:
        res = map(_seq, res)
    return tuple(g if g is not None else r for g, r in zip(given[2:], res))


def _kept_apart(spec: Spec, door, q, k, a, b, weights, scales, q_out, k_out, parts):
    """Heads whose unrotated dims the door does not see: rotary_position='last' (the door rotates
    views of the last rotary_dim dims of each head; the leading dims are kept) and the no-rope
    parts given apart (q_nope, k_nope: q / k are the rope parts, the outputs whole heads [rotated |
    nope], [nope | rotated] with 'last'). In place the door rotates the views; out of place the
    kept dims are copied once, with the outputs' scale and dtype, beside the door's rotation."""
    rot, last = spec.rot, spec.variant.rope_last
    split = [_split(x, p, rot, last) for x, p in zip((q, k), parts)]
    rope, kept_src, width = ([s[i] for s in split] for i in range(3))
    if spec.inplace:
        door(spec, rope[0], rope[1], a, b, weights, scales)
        return q, k
    kept = [None if c is None else _kept(spec, c, scales, i) for i, c in enumerate(kept_src)]
    if q_out is None and k_out is None and spec.door is not DIRECT:  # autograd or a subclass records it
        rotated = door(spec, rope[0], rope[1], a, b, weights, scales)
        return tuple(_joined(r, c, last) for r, c in zip(rotated, kept))
    outs, into = [], []
    for x, p, dst, c, n in zip((q, k), parts, (q_out, k_out), kept, width):
        if x is not None and dst is None:
            dst = _fresh(x, (*x.shape[:-1], x.shape[-1] + (0 if p is None else n)), spec.out_dtype)
        if c is not None:  # the kept dims at the front with 'last', after the rotated ones otherwise
            (dst[..., :n] if last else dst[..., dst.shape[-1] - n :]).copy_(c)
        outs.append(dst)
        into.append(None if dst is None or c is None else (dst[..., n:] if last else dst[..., : dst.shape[-1] - n]))
    door(
        spec, rope[0], rope[1], a, b, weights, scales, *(i if c is not None else o for i, o, c in zip(into, outs, kept))
    )
    return outs[0], outs[1]


def _split(x, part, rot: int, last: bool) -> tuple:
    """(what the door rotates, the kept dims or None, their width) of one input: x and its no-rope
    part given apart; x's last rot dims and its leading ones with 'last'; else x whole (its own
    tail, if any, kept by the kernel)."""
    if x is not None and part is not None:
        return x, part, part.shape[-1]
    if x is not None and last and x.shape[-1] > rot:
        n = x.shape[-1] - rot
        return x[..., n:], x[..., :n], n
    return x, None, 0


def _joined(rotated, kept, last: bool):
    """An output of the autograd / subclass door with its kept dims: torch.cat (whose backward
    splits the gradient)."""
    if rotated is None or kept is None:
        return rotated
    kept = kept.to(rotated.dtype)
    return torch.cat((kept, rotated) if last else (rotated, kept), -1)


def _fresh(x, shape, dtype):
    """A new output of `shape` for input x: empty_like(x)'s layout rule when the head is x's own
    width, else contiguous (a head joined from two parts has no layout to follow)."""
    if tuple(shape) == tuple(x.shape):
        return pipeline.empty_like(x, dtype=dtype)
    return pipeline.empty_like(x.new_empty(shape), dtype=dtype)


def _kept(spec: Spec, x, scales, i):
    """The dims a rotation keeps, as its outputs store them: scaled outputs divide by the scale and
    saturate (the kernel's rule for a tail), the cast happens in the copy."""
    if not spec.variant.scaled:
        return x
    dtype = spec.out_dtype or x.dtype
    return pipeline.saturate(x.float() / scales[i], dtype).to(dtype)


def _door(q, spec_grad: bool, normed: bool, triton: bool) -> str:
    """pipeline.door_for, except that the CPU path of a normed variant is a direct run (torch ops
    that autograd records) wherever door_for does not pick the dispatcher."""
    door = pipeline.door_for(q, spec_grad)
    if door is not CUSTOM_OP and normed and not triton:
        return DIRECT
    return door


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
    q_out: Optional[torch.Tensor] = None,
    k_out: Optional[torch.Tensor] = None,
    rotary_position: str = "first",
    q_nope: Optional[torch.Tensor] = None,
    k_nope: Optional[torch.Tensor] = None,
):
    """Rotate q and k by the angles of their positions.

    Args:
        q: (*T, Hq, Dq) fp16/bf16/fp32, *T = (T,) or (B, S); any strides. A last stride other
            than 1 is read through one contiguous copy (in place: the copy is rotated, then copied
            back), and out of place the outputs of such a q are contiguous; a q with last stride 1
            gets outputs of its own layout when it is dense (torch.empty_like's rule), contiguous
            otherwise. With layout='bhsd': (B, Hq, S, Dq), Hugging Face's layout; with
            layout='sbhd': (S, B, Hq, Dq), Transformer Engine's (results come back in it).
        k: (*T, Hk, Dk) or None; Dk may differ from Dq; its own strides.
        positions: (*T) int32/int64; (3, *T) for M-RoPE; None means arange over the last token dim
            (over S with layout='sbhd', whose positions are (S, B)).
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
            flow to the weights as well (docs/qknorm.md). Composes with every angle source,
            out_dtype and scales; not with inverse, nor in place while autograd records the call.
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
        layout: None or 'thd' / 'bshd' (tokens first, by q's rank), 'bhsd' (HF's (B, H, S, D)) or
            'sbhd' (Transformer Engine's (S, B, H, D): positions (S, B), size-1 dims broadcast).
            None warns (ropekit.core.validate.LayoutWarning, once per call signature) when a 4-D q has
            the strides of HF's (B, H, S, D) view and the positions fit either reading.

        inv_freq: instead of cos_sin_cache (pass None there), float32 (rotary_dim // 2,) inverse
            frequencies: the angles are computed in the kernel, positions[axis(j), t] * inv_freq[j]
            for rotary pair j, in float32 (no table, no size limit; docs/vision.md states the error).
            positions may then be int32/int64/float32/float64, negative and fractional values
            included. When inv_freq requires grad (learnable frequencies) it gets a gradient.
        axes: with inv_freq, the number of rotary pairs of each axis (1 to 4 ints summing to
            len(inv_freq), e.g. (8, 28, 28) for Flux; ropekit.axial_inv_freq builds the
            frequencies); positions are then (len(axes), *T). None: positions (*T) drive all pairs.
        q_out, k_out: destinations (out of place, not while autograd records the call): tensors of
            q's / k's shape in the outputs' dtype (out_dtype or q's), any strides with last stride
            1, disjoint from every input and from each other; written by the kernel and returned.
            Either may be given alone (the other output is a new tensor).
        rotary_position: 'first' rotates dims [0, rotary_dim); 'last' rotates [D - rotary_dim, D)
            (DeepSeek's [nope | rope] heads), the leading dims kept, not with the norm; 'halves'
            rotates the pairs (i, i + D/2) for i < rotary_dim / 2 (Gemma 4's p-RoPE: the table holds
            the rotated pairs' angles only, ropekit.cos_sin_cache(..., rotated_only=True)), the dims
            [rotary_dim/2, D/2) and [D/2 + rotary_dim/2, D) kept (copied out of place, untouched in
            place, normalized with the norm, scaled with fp8 outputs). 'halves' needs
            interleaved=False, an even D, and q and k of one head size.
        q_nope, k_nope: a head's no-rope part as a tensor of its own (FlashInfer's q_nope /
            k_nope of rope_quantize_fp8), (*T, H, N) in the call's layout, any float dtype and
            strides, on q's device: q (k) is then the rope part, rotary_dim wide, and the output
            is the whole head, (*T, H, rotary_dim + N): [rotated q | q_nope] ([q_nope | rotated
            q] with rotary_position='last'), the nope part divided by the scale and saturated
            with fp8 outputs, as a kept tail is. Out of place only; either may be given alone;
            gradients reach both parts. Not with the norm of that tensor.

    Returns (q_out, k_out), k_out None when k is None. Math in float32, outputs in input dtypes.
    A position outside [0, max_position) gives NaN in that token's rotated dims (never an
    out-of-bounds read); under `ropekit.strict()` it raises ValueError before anything is written.
    Differentiable in q and k (the backward is the inverse rotation, by the same kernel), in
    place too (autograd's in-place rules: q and k are marked dirty; a leaf that requires grad
    cannot be rotated in place, as with any in-place torch op).
    """
    args = (
        q,
        k,
        positions,
        cos_sin_cache,
        interleaved,
        rotary_dim,
        mrope_section,
        mrope_interleaved,
        inplace,
        q_norm_weight,
        k_norm_weight,
        norm_eps,
        norm_weight_offset,
        cu_seqlens,
        cp_size,
        cp_rank,
        inverse,
        out_dtype,
        q_scale,
        k_scale,
        layout,
        inv_freq,
        axes,
        q_out,
        k_out,
        rotary_position,
        q_nope,
        k_nope,
    )
    parts = (q_nope, k_nope)
    if torch.compiler.is_compiling():
        spec = _rope_spec(*args)
        a, b = _operands(spec, positions, cos_sin_cache, cu_seqlens, inv_freq)
        scales = _scales(spec, q, q_scale, k_scale)
        return _call(spec, _custom_op, q, k, a, b, (q_norm_weight, k_norm_weight), scales, q_out, k_out, parts)
    try:
        # the optional tensors, absent in most calls: one test instead of six calls
        if (
            cu_seqlens is None
            and inv_freq is None
            and q_norm_weight is None
            and k_norm_weight is None
            and q_scale is None
            and k_scale is None
            and q_out is None
            and k_out is None
            and q_nope is None
            and k_nope is None
        ):
            optional = None
        else:
            optional = (
                tensor_key(cu_seqlens),
                tensor_key(inv_freq),
                tensor_key(q_norm_weight),
                tensor_key(k_norm_weight),
                _scale_key(q_scale),
                _scale_key(k_scale),
                tensor_key(q_out),
                tensor_key(k_out),
                tensor_key(q_nope),
                tensor_key(k_nope),
            )
        flags = (
            interleaved,
            rotary_dim,
            mrope_section,
            mrope_interleaved,
            inplace,
            norm_eps,
            norm_weight_offset,
            cp_size,
            cp_rank,
            inverse,
            out_dtype,
            layout,
            axes,
            rotary_position,
        )
        # the flags, all at their defaults in most calls: identity tests instead of keying them
        if all(map(operator.is_, flags, _FLAG_DEFAULTS)):
            flags = None
        else:  # types too: 16 and 16.0, True and 1 hash alike but validate differently
            flags = tuple(map(value_key, flags))
        key = (
            "apply_rope",
            torch.is_grad_enabled(),
            tensor_key(q),
            tensor_key(k),
            tensor_key(positions),
            tensor_key(cos_sin_cache),
            optional,
            flags,
        )
        spec = _MEMO_GET(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: validation names them
        key = spec = None
    if spec is None:
        spec = pipeline.remember(key, _rope_spec(*args))
    v = spec.variant
    a, b = _operands(spec, positions, cos_sin_cache, cu_seqlens, inv_freq)
    if v.angles != "freqs" and (spec.table is None or spec.table() is not cos_sin_cache):
        validate.read_new_table(spec, "apply_rope", cos_sin_cache)  # a new table: HF's cos is refused
    weights = (q_norm_weight, k_norm_weight)
    if spec.door is not CUSTOM_OP:
        if inplace and _spans_meet((q, k, a, b, *weights), spec.extents):
            # the checks that depend on addresses, not on the signature: exact ones only when the
            # written tensors' byte ranges meet another argument's (a cheap range test first)
            names = ANGLE_NAMES[v.angles]
            read = ((names[0], a), (names[1], b), ("q_norm_weight", weights[0]), ("k_norm_weight", weights[1]))
            validate.inplace_aliasing("apply_rope", q, k, read)
        if (q_out is not None or k_out is not None) and type(q) is torch.Tensor:
            _out_aliasing(spec, q, k, a, b, weights, q_out, k_out, q_scale, k_scale, parts)
        if validate.is_strict():
            _strict_values(spec, q, a, b, cp_size)
    return _call(spec, _run, q, k, a, b, weights, _scales(spec, q, q_scale, k_scale), q_out, k_out, parts)


def _out_aliasing(spec: Spec, q, k, a, b, weights, q_out, k_out, q_scale, k_scale, parts=(None, None)) -> None:
    """Destinations share no byte with an input or each other: checked on every call (addresses),
    exactly only where byte ranges meet."""
    names = ANGLE_NAMES[spec.variant.angles]
    read = (
        ("q", q),
        ("k", k),
        ("q_nope", parts[0]),
        ("k_nope", parts[1]),
        (names[0], a),
        (names[1], b),
        ("q_norm_weight", weights[0]),
        ("k_norm_weight", weights[1]),
        ("q_scale", q_scale if isinstance(q_scale, torch.Tensor) else None),
        ("k_scale", k_scale if isinstance(k_scale, torch.Tensor) else None),
    )
    extents = [_extent(q_out), _extent(k_out)] + [_extent(x) for _, x in read]
    validate.out_aliasing("apply_rope", q_out, k_out, read, extents)


_FLAG_DEFAULTS = tuple(
    apply_rope.__kwdefaults__[n]
    for n in (
        "interleaved",
        "rotary_dim",
        "mrope_section",
        "mrope_interleaved",
        "inplace",
        "norm_eps",
        "norm_weight_offset",
        "cp_size",
        "cp_rank",
        "inverse",
        "out_dtype",
        "layout",
        "axes",
        "rotary_position",
    )
)


def _operands(spec: Spec, positions, table, cu_seqlens, inv_freq):
    """(a, b), the angle operands of pipeline.run_rotate, for apply_rope's angle sources."""
    angles = spec.variant.angles
    if angles == "freqs":
        return positions, inv_freq
    if angles == "packed":
        return cu_seqlens, table
    if positions is not None and spec.variant.seq_first:  # (S, B) -> the kernel's (B, S)
        positions = positions.transpose(-1, -2)
    if spec.angle_shape is not None:  # positions with size-1 dims (HF's (1, S)): an expand view
        positions = positions.expand(spec.angle_shape)
    return positions, table


def _strict_values(spec: Spec, q, a, b, cp_size) -> None:
    """Strict mode: the checks that read values (a device sync each)."""
    angles = spec.variant.angles
    if angles == "packed":
        validate.packed_values("apply_rope", a, q.shape[0], cp_size)
    elif angles == "freqs":
        validate.positions_finite("apply_rope", a)
    elif a is not None:
        validate.positions_in_range("apply_rope", a, b.shape[0])


_TABLE_EXCLUSIVE = ("cos_sin_cache", "mrope_section", "cu_seqlens")


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
    q_norm_weight,
    k_norm_weight,
    norm_eps,
    norm_weight_offset,
    cu_seqlens,
    cp_size,
    cp_rank,
    inverse,
    out_dtype,
    q_scale,
    k_scale,
    layout,
    inv_freq,
    axes,
    q_out,
    k_out,
    rotary_position,
    q_nope=None,
    k_nope=None,
) -> Spec:
    """Validate one apply_rope signature into its spec (names the first bad argument)."""
    op = "apply_rope"
    packed = (1, 0)
    hf = validate.layout_arg(op, layout, q, sbhd=True)
    seq = layout == "sbhd"
    q_t, k_t = pipeline.heads_first(q, hf), pipeline.heads_first(k, hf)  # tokens first
    if seq:  # checked as the (B, S, H, D) views the run takes
        validate.sbhd_args(op, q, k, positions, mrope_section is not None)
        q_t, k_t = _seq(q_t), _seq(k_t)
        if isinstance(positions, torch.Tensor) and positions.dim() >= 2:
            positions = positions.transpose(-1, -2)
    expand = None  # positions with size-1 dims (HF's (1, S)): the shape each call expands them to
    if inv_freq is not None or axes is not None:
        if inv_freq is None:
            fail(op, "inv_freq", "a tensor when axes is given (axes split inv_freq's pairs)", None)
        for name, value in zip(_TABLE_EXCLUSIVE, (cos_sin_cache, mrope_section, cu_seqlens)):
            if value is not None:
                fail(op, name, "None with inv_freq (angles computed from positions x inv_freq)", type(value).__name__)
        rot, sections = validate.freqs_args(
            op, q_t, k_t, positions, inv_freq, axes, rotary_dim=rotary_dim, inplace=inplace, any_last_stride=True
        )
        angles, mode, source, b = "freqs", 0, positions, inv_freq
    else:
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
            any_last_stride=True,
        )
        validate.no_grad_table(op, cos_sin_cache)
        if layout is None:
            validate.warn_ambiguous_layout(op, q, positions is None and cu_seqlens is None)
        if cu_seqlens is not None:
            if inplace and validate.addresses_known(q):
                validate.inplace_aliasing(op, q, k, (("cu_seqlens", cu_seqlens),))
            angles, source = "packed", cu_seqlens
        else:
            angles, source = ("table" if positions is not None else "arange"), positions
        mode, sections = _mrope_code(mrope if angles == "table" else None, mrope_interleaved)
        b = cos_sin_cache
        if angles == "table":
            want = ((3,) if mode else ()) + tuple(q_t.shape[:-2])
            expand = want if tuple(positions.shape) != want else None
    modes = validate.norm_weights(
        op, q_t, k_t, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset, inplace=inplace
    )
    normed = modes != (0, 0)
    parts = _nope_parts(op, q, k, q_nope, k_nope, rot, inplace, modes)
    grad = pipeline.records_grad(q, k, q_norm_weight, k_norm_weight, inv_freq, q_nope, k_nope)
    scaled = validate.out_args(op, q, out_dtype, q_scale, k_scale, inverse, inplace=inplace, grad=grad)
    if normed:
        validate.norm_flags(op, inverse=inverse, inplace=inplace, grad=grad)
    validate.out_buffers(op, q, k, q_out, k_out, out_dtype, inplace=inplace, grad=grad, parts=(q_nope, k_nope))
    position = validate.rotary_position_arg(op, rotary_position, normed)
    il = bool(interleaved)
    if position == "halves":
        validate.halves_args(op, q_t, k_t, il)
        for name, given in zip(("q_nope", "k_nope"), parts):
            if given:  # p-RoPE's pairs span the whole head: no part of it is apart
                fail(op, name, "None with rotary_position='halves' (its pairs span the whole head)", "a tensor")
    # a rotation of whole heads is the same wherever its dims are said to sit: the usual variant
    partial = any(parts) or any(x is not None and x.shape[-1] > rot for x in (q_t, k_t))
    last, halves = position == "last" and partial, position == "halves" and partial
    variant = Variant(
        il, il, mode, sections, angles, inverse, hf, scaled, *modes, seq_first=seq, rope_last=last, rope_halves=halves,
        nope_q=parts[0], nope_k=parts[1],
    )  # fmt: skip
    triton = pipeline.triton_runs(q)
    weights = (q_norm_weight, k_norm_weight)
    return Spec(
        variant,
        rot,
        _door(q, grad, normed, triton),
        triton,
        copy_in=any(x is not None and x.shape[-1] > 1 and x.stride(-1) != 1 for x in (q, k)),
        extents=tuple(_extent(x) for x in (q, k, source, b, *weights)),
        packed=packed,
        angle_shape=expand,
        inplace=bool(inplace),
        out_dtype=None if out_dtype == q.dtype else out_dtype,
        norm_eps=float(norm_eps),
        norm_offset=float(norm_weight_offset),
    )


def _nope_parts(op, q, k, q_nope, k_nope, rot, inplace, modes) -> tuple:
    """(nope_q, nope_k) of validated no-rope parts: each None, or a tensor of its rope part's dims
    but the last (`validate.nope_part`), out of place, its tensor not normalized."""
    given = []
    for name, part, x, mode in (("q_nope", q_nope, q, modes[0]), ("k_nope", k_nope, k, modes[1])):
        given.append(part is not None)
        if part is None:
            continue
        if x is None:
            fail(op, name, "None when k is None", "a tensor")
        if inplace:
            fail(op, name, "None when inplace=True (the output is the whole head, a new tensor)", "a tensor")
        if mode != pipeline.NORM_NONE:
            norm = f"{name[0]}_norm_weight"
            fail(op, name, f"None with {norm} (the norm covers a whole head, not one given in two parts)", "a tensor")
        validate.nope_part(op, name, part, x, rot, inference=False)
    return tuple(given)


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
    inplace: bool = False,
):
    """Rotate q and k by per-token angles (the form Hugging Face models pass).

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
    the weights); with every other option except an out_interleaved that differs from interleaved.

    inplace: write into q and k (returned) instead of new tensors; under autograd as apply_rope's
    (not with a norm while autograd records the call).
    """
    op = "rotate_with_angles"
    if freqs_cis is not None or (cos is None and sin is None):
        cos, sin = _cis_parts(op, freqs_cis, cos, sin)
        if interleaved is None:
            interleaved = True
    hf = None if layout is None else validate.layout_arg(op, layout, q)
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
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        norm_eps=norm_eps,
        norm_weight_offset=norm_weight_offset,
        inplace=inplace,
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
    q_norm_weight=None,
    k_norm_weight=None,
    norm_eps=1e-6,
    norm_weight_offset=0.0,
    inplace=False,
):
    """rotate_with_angles with two more options, the seam ropekit.hf and ropekit.integrations.hf_qknorm call:

    heads_first: q and k are (B, H, S, D) (Hugging Face's layout, views of (B, S, H, D)
        projections); results come back in that layout, and no view is made per call. None:
        tokens first, not said by the caller (an ambiguous layout warns).
    columns: use the first `columns` columns of cos and sin (HF's tables hold [f, f]: pass them
        unsliced with columns = rotary_dim // 2); None: decided by rotary_dim, else by the values
        (`_angle_columns`).
    """
    interleaved = bool(interleaved)
    out_il = interleaved if out_interleaved is None else out_interleaved
    weights = (q_norm_weight, k_norm_weight)
    norm = (norm_eps, norm_weight_offset)
    flags = (interleaved, out_il, mrope_section, mrope_interleaved, heads_first, inplace)
    if torch.compiler.is_compiling():
        columns, _ = _angle_columns(q, k, cos, sin, rotary_dim, columns)
        spec = _angles_spec(q, k, cos, sin, *flags, columns, weights, norm)
        return _custom_op(spec, q, k, *pipeline.angle_views(spec, cos, sin), weights, None)
    try:
        key = (
            "rotate_angles",
            torch.is_grad_enabled(),
            tensor_key(q),
            tensor_key(k),
            tensor_key(cos),
            tensor_key(sin),
            tensor_key(q_norm_weight),
            tensor_key(k_norm_weight),
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
            type(norm_eps),
            norm_eps,
            type(norm_weight_offset),
            norm_weight_offset,
            type(inplace),
            inplace,
        )
        spec = _MEMO_GET(key)
    except (AttributeError, TypeError):
        key = spec = None
    if spec is None:
        columns, settled = _angle_columns(q, k, cos, sin, rotary_dim, columns)
        spec = pipeline.remember(key if settled else None, _angles_spec(q, k, cos, sin, *flags, columns, weights, norm))
    if spec.copy_angles or spec.door is CUSTOM_OP:  # as validation saw them (copied when it had to)
        cos, sin = pipeline.angle_views(spec, cos, sin)
    if spec.inplace and spec.door is not CUSTOM_OP:  # addresses: checked on every call
        read = (("cos", cos), ("sin", sin), ("q_norm_weight", weights[0]), ("k_norm_weight", weights[1]))
        validate.inplace_aliasing("rotate_with_angles", q, k, read)
    return _run(spec, q, k, cos, sin, weights, None)


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


def _angles_spec(
    q, k, cos, sin, interleaved, out_il, mrope_section, mrope_interleaved, heads_first, inplace, columns, weights, norm
) -> Spec:
    op = "rotate_with_angles"
    hf = bool(heads_first)
    if columns is not None and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor):
        cos, sin = cos[..., :columns], sin[..., :columns]
    q_t, k_t = pipeline.heads_first(q, hf), pipeline.heads_first(k, hf)
    cos_v, sin_v, mrope = validate.angle_args(
        op, q_t, k_t, cos, sin, mrope_section=mrope_section, mrope_interleaved=mrope_interleaved
    )
    if heads_first is None:
        validate.warn_ambiguous_layout(op, q, False, stacklevel=5)
    if inplace:
        read = (("cos", cos_v), ("sin", sin_v), ("q_norm_weight", weights[0]), ("k_norm_weight", weights[1]))
        validate.inplace_args(op, q_t, k_t, read, inplace_grad=True)
    modes = validate.norm_weights(op, q_t, k_t, *weights, *norm, inplace=inplace)
    normed = modes != (0, 0)
    grad = pipeline.records_grad(q, k, *weights)
    if normed:
        validate.norm_flags(op, inplace=inplace, grad=grad, out_interleaved=bool(out_il) != bool(interleaved))
    mode, sections = _mrope_code(mrope, mrope_interleaved)
    variant = Variant(bool(interleaved), bool(out_il), mode, sections, "tokens", False, hf, False, *modes)
    triton = pipeline.triton_runs(q)
    door = _door(q, grad, normed, triton)
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
        triton,
        copy_angles=copied,
        angle_shape=tuple(cos_v.shape),
        angle_strides=launcher.per_token_strides(cos_v, n_tok, mode != 0),
        inplace=bool(inplace),
        norm_eps=float(norm[0]),
        norm_offset=float(norm[1]),
    )
