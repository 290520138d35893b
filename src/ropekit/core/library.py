"""The rotation's torch.library custom ops, each next to its fake and its autograd rule.

    ropekit::rotate(q, k, a, b, wq, wk, q_scale, k_scale, variant, rotary_dim, packed, norm, out_dtype)
        -> [q_out] (k None) or [q_out, k_out]
    ropekit::rotate_(q, k, a, b, wq, wk, variant, rotary_dim, packed, norm) -> None   (q, k written)
    ropekit::rotate_norm_backward(x, g, w, a, b, variant, rotary_dim, packed, norm, mode) -> [gx] or [gx, dw]

variant: `pipeline.Variant.encode()` of the call's tokens-first record (every flag, the angle source
among them); (a, b): the angle operands as `pipeline.run_rotate` takes them (positions or
cu_seqlens and a [cos | sin] table, per-token cos and sin, positions and inverse frequencies);
wq, wk: RMSNorm weights (None: that tensor is not normalized); packed: [cp_size, cp_rank];
norm: [eps, offset]. These are the doors torch.compile traces and tensor subclasses dispatch
through (DTensor: sharding.py derives their sharding from the same variant); eager calls take
ops.py's direct run or `pipeline.RotateFunction`, which run the same steps.

The backward of `rotate` is `rotate` with `Variant.backward()` (the inverse rotation), or for a
normed variant `rotate_norm_backward` per tensor; inverse frequencies that require grad get
`freqs.freq_grad` of the outputs.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from . import pipeline, validate
from .freqs import freq_grad
from .pipeline import ANGLE_NAMES, Spec, Variant


def op_spec(variant: Variant, rot: int, packed, norm, q, k, a, b, inplace: bool = False) -> Spec:
    """The spec inside a custom op: its inputs were validated by the public op (or are gradients);
    only layouts are memoized here. In place and out of place are different specs: their launch
    plans differ (an out-of-place launch copies the tail past the rotary dims)."""
    tk = pipeline.tensor_key
    key = ("op", inplace, variant, rot, tuple(packed), tuple(norm), tk(q), tk(k), tk(a), tk(b))
    spec = pipeline.lookup(key)
    if spec is None:
        angle_shape = angle_strides = None
        if variant.angles == "tokens":
            from .launcher import per_token_strides

            angle_shape = tuple(a.shape)
            angle_strides = per_token_strides(a, q.dim() - 2, variant.mrope != 0)
        spec = pipeline.remember(
            key,
            Spec(
                variant,
                rot,
                pipeline.DIRECT,
                pipeline.triton_runs(q),
                angle_shape=angle_shape,
                angle_strides=angle_strides,
                packed=tuple(packed),
                inplace=inplace,
                norm_eps=norm[0],
                norm_offset=norm[1],
            ),
        )
    return spec


def _angles(variant: Variant, a, b):
    """Per-token cos and sin with different strides are copied (the kernel reads both with one set)."""
    if variant.angles == "tokens" and a.stride() != b.stride():
        return a.contiguous(), b.contiguous()
    return a, b


def _scales(variant: Variant, q, q_scale, k_scale):
    if not variant.scaled:
        return None
    one = pipeline.scale_tensor(1.0, q.device, unit=True)
    return (one if q_scale is None else q_scale, one if k_scale is None else k_scale)


def _pair(outs, k) -> List[torch.Tensor]:
    return [outs[0]] if k is None else [outs[0], outs[1]]


@torch.library.custom_op("ropekit::rotate", mutates_args=())
def _rotate_op(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    a: Optional[torch.Tensor],
    b: torch.Tensor,
    wq: Optional[torch.Tensor],
    wk: Optional[torch.Tensor],
    q_scale: Optional[torch.Tensor],
    k_scale: Optional[torch.Tensor],
    variant: List[int],
    rotary_dim: int,
    packed: List[int],
    norm: List[float],
    out_dtype: Optional[torch.dtype],
) -> List[torch.Tensor]:
    v = Variant.decode(variant)
    q, k = pipeline.unit_last_stride(q), pipeline.unit_last_stride(k)
    a, b = _angles(v, a, b)
    spec = op_spec(v, rotary_dim, packed, norm, q, k, a, b)
    scales = _scales(v, q, q_scale, k_scale)
    if v.normed and not spec.triton:
        return _pair(pipeline.norm_rotated(spec, v, q, k, a, b, (wq, wk), out_dtype, scales), k)
    q_out = pipeline.empty_like(q, dtype=out_dtype)
    k_out = None if k is None else pipeline.empty_like(k, dtype=out_dtype)
    weights = (wq, wk) if v.normed else None
    pipeline.run_rotate(spec, v, q, k, q_out, k_out, a, b, scales=scales, weights=weights)
    return _pair((q_out, k_out), k)


@_rotate_op.register_fake
def _(q, k, a, b, wq, wk, q_scale, k_scale, variant, rotary_dim, packed, norm, out_dtype):
    q, k = pipeline.unit_last_stride(q), pipeline.unit_last_stride(k)
    outs = [torch.empty_like(q, dtype=out_dtype)]
    return outs if k is None else outs + [torch.empty_like(k, dtype=out_dtype)]


def _setup_rotate(ctx, inputs, output):
    """What the backward needs: the angle operands, q, k and the weights of a normed variant (the
    norm's backward recomputes the inverse rms from them), the outputs when inverse frequencies
    want a gradient."""
    q, k, a, b, wq, wk, _, _, codes, rot, packed, norm, _ = inputs
    v = Variant.decode(codes)
    ctx.variant, ctx.codes, ctx.rot, ctx.packed, ctx.norm = v, codes, rot, packed, norm
    ctx.metas = ((q.shape, q.dtype, q.device), None if k is None else (k.shape, k.dtype, k.device))
    saved = (q, k, wq, wk) if v.normed else ()
    keep = v.angles == "freqs" and b.requires_grad
    ctx.save_for_backward(a, b, *saved, *((output[0], output[1] if k is not None else None) if keep else ()))


def _rotate_backward(ctx, grads):
    a, b, *saved = ctx.saved_tensors
    v, needs = ctx.variant, ctx.needs_input_grad
    gq, gk = grads[0], (grads[1] if len(grads) > 1 else None)
    d_b = None
    if v.angles == "freqs" and needs[3]:
        d_b = freq_grad(saved[-2:], (gq, gk), a, ctx.rot // 2, v)
    rest = (None,) * 7  # scales and the non-tensor arguments
    if v.normed:

        def backward_one(x, g, w, mode):
            out = torch.ops.ropekit.rotate_norm_backward(x, g, w, a, b, ctx.codes, ctx.rot, ctx.packed, ctx.norm, mode)
            return out[0], (out[1] if w is not None else None)

        dq, dk, dwq, dwk = pipeline.norm_grads(v, needs, saved[:4], gq, gk, backward_one)
        return dq, dk, None, d_b, dwq, dwk, *rest
    want_q, want_k, first, second = pipeline.grad_operands(ctx.metas, needs, gq, gk)
    if first is None:
        return None, None, None, d_b, None, None, *rest
    back = v.backward().encode()
    g = torch.ops.ropekit.rotate(first, second, a, b, None, None, None, None, back, ctx.rot, ctx.packed, ctx.norm, None)
    d_q, d_k = pipeline.input_grads(want_q, want_k, g[0], g[1] if second is not None else None)
    return d_q, d_k, None, d_b, None, None, *rest


_rotate_op.register_autograd(_rotate_backward, setup_context=_setup_rotate)


@torch.library.custom_op("ropekit::rotate_", mutates_args=("q", "k"))
def _rotate_inplace_op(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    a: Optional[torch.Tensor],
    b: torch.Tensor,
    wq: Optional[torch.Tensor],
    wk: Optional[torch.Tensor],
    variant: List[int],
    rotary_dim: int,
    packed: List[int],
    norm: List[float],
) -> None:
    v = Variant.decode(variant)
    names = ANGLE_NAMES[v.angles]
    # the address checks validation skips while tracing (torch.compile), made before any write
    validate.inplace_aliasing(
        "apply_rope", q, k, ((names[0], a), (names[1], b), ("q_norm_weight", wq), ("k_norm_weight", wk))
    )
    spec = op_spec(v, rotary_dim, packed, norm, q, k, a, b, inplace=True)
    if v.normed and not spec.triton:
        q_out, k_out = pipeline.norm_rotated(spec, v, q, k, a, b, (wq, wk))
        q.copy_(q_out)
        if k is not None:
            k.copy_(k_out)
        return
    pipeline.run_rotate(spec, v, q, k, q, k, a, b, weights=(wq, wk) if v.normed else None)


@_rotate_inplace_op.register_fake
def _(q, k, a, b, wq, wk, variant, rotary_dim, packed, norm):
    return None


@torch.library.custom_op("ropekit::rotate_norm_backward", mutates_args=())
def _rotate_norm_backward_op(
    x: torch.Tensor,
    g: torch.Tensor,
    w: Optional[torch.Tensor],
    a: Optional[torch.Tensor],
    b: torch.Tensor,
    variant: List[int],
    rotary_dim: int,
    packed: List[int],
    norm: List[float],
    mode: int,
) -> List[torch.Tensor]:
    v = Variant.decode(variant)
    spec = op_spec(v, rotary_dim, packed, norm, x, None, a, b)
    if spec.triton:
        gx, dw = pipeline.run_norm_backward(spec, v, x, g, w, mode, a, b)
    else:  # the CPU path, by the formulas (autograd does not record inside a custom op)
        gx, dw = pipeline.norm_backward_cpu(spec, v, x, g, w, a, b)
    return [gx] if dw is None else [gx, dw]


@_rotate_norm_backward_op.register_fake
def _(x, g, w, a, b, variant, rotary_dim, packed, norm, mode):
    return [torch.empty_like(x)] if w is None else [torch.empty_like(x), torch.empty_like(w)]
