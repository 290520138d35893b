"""The doors of every op that records something: the autograd Functions and the torch.library
custom ops, each next to its fake and (the rotation) its autograd rule; and each op's door table.

    ROTATE / STORE / REROTATE   door -> function, indexed by the door ropekit.core.pipeline.prepare
                                gives: eager without autograd -> the direct door (pipeline.py);
                                eager with autograd -> the Function; torch.compile and tensor
                                subclasses (DTensor, meta) -> the custom op

The custom ops (their schemas take the call's record as `Variant.encode()`):

    ropekit::rotate(q, k, a, b, wq, wk, q_scale, k_scale, variant, rotary_dim, packed, norm, out_dtype)
        -> [q_out] (k None) or [q_out, k_out]
    ropekit::rotate_(q, k, a, b, wq, wk, variant, rotary_dim, packed, norm) -> None   (q, k written)
    ropekit::rotate_norm_backward(x, g, w, a, b, variant, rotary_dim, packed, norm, mode) -> [gx] or [gx, dw]
    ropekit::rope_and_store(q, k, v, positions, table, k_cache, v_cache, slots, variant, rotary_dim,
                            k_scale, v_scale, q_norm_weight, k_norm_weight, norm, packed) -> None
    ropekit::rope_and_store_q_out(... the same ..., q_out, q_scale) -> None
    ropekit::rerotate_kv_cache(k_cache, slots, delta, delta_int, table, variant, rotary_dim, k_scale,
                               dst_slots, positions=None, to_cache=None) -> None

(a, b): the angle operands as ropekit.core.pipeline.run_rotate takes them; packed: [cp_size, cp_rank];
norm: [eps, offset]. The backward of every door is the same run with `Variant.backward()` (the
inverse rotation), or with a norm the norm's backward kernel; inverse frequencies that require
grad get `freq_grad` of the outputs. DTensor rules: ropekit.core.sharding, derived from the
same encoded record.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from . import aliasing, checks, pipeline, run
from .args import fail
from .freqs import pair_positions
from .memo import lookup, remember
from .pipeline import (
    rerotate_direct,
    rerotate_record,
    rotate_direct,
    rotate_record,
    run_rotate,
    store_direct,
    store_record,
)
from .run import StoreOperands, heads_first, unit_last_stride
from .sharding import dtensor_like
from .variant import ANGLE_NAMES, CUSTOM_OP, DIRECT, FUNCTION, RECORD, TRACED, Spec, Variant, arg_key


def op_spec(name: str, values: tuple, make) -> Spec:
    """The spec inside a custom op, memoized by the op's arguments (its inputs were validated by
    the public op, or are gradients): make() builds it the first time."""
    key = (name, *map(arg_key, values))
    spec = lookup(key)
    if spec is None:
        spec = remember(key, make())
    return spec


def no_leaf_written(q, k) -> None:
    """Autograd's in-place rule, checked before the kernel writes (autograd itself would raise only
    after the forward ran): a leaf that requires grad, or a view of one, is never written."""
    for name, x in (("q", q), ("k", k)):
        if x is None or not x.requires_grad:
            continue
        view_of_leaf = not x.is_leaf and x._base is not None and x._base.is_leaf
        if x.is_leaf or view_of_leaf:
            fail(
                "apply_rope",
                name,
                "a tensor that is not a leaf requiring grad (nor a view of one) when inplace=True under "
                "autograd: pass a clone, or inplace=False",
                "a view of a leaf tensor that requires grad" if view_of_leaf else "a leaf tensor that requires grad",
            )


# ---------------------------------------------------------------------------------------------
# the rotation's doors: (spec, q, k, a, b, weights, scales, q_out, k_out) -> (q_out, k_out)


def _rotate_function(spec: Spec, q, k, a, b, weights, scales, q_out=None, k_out=None):
    v = spec.variant
    if spec.inplace:
        # autograd lets a Function that writes into a view return that one tensor only, and q and
        # k usually are views (of a fused qkv projection): one Function call (one launch) each
        no_leaf_written(q, k)
        spec_q, spec_k = spec.split()
        RotateInPlaceFunction.apply(q, a, b, spec_q, v)
        if k is not None:
            RotateInPlaceFunction.apply(k, a, b, spec_k, v)
        return q, k
    return RotateFunction.apply(q, k, a, b, weights[0], weights[1], spec, v)


def _rotate_custom(spec: Spec, q, k, a, b, weights, scales, q_out=None, k_out=None):
    """torch.compile traces it, DTensor shards it, autograd through the custom op's registered
    backward. In place under autograd: the out-of-place op, then copy_ into q and k (autograd's own
    in-place op: versions, views and the backward follow). Given destinations likewise: the
    out-of-place op, then copy_ into q_out / k_out (one custom op per schema)."""
    v = spec.variant
    hf = v.heads_first  # the ops take tokens-first views; results go back to HF's layout
    codes = v.tokens_first().encode()
    qs, ks = (None, None) if scales is None else scales
    a, b, wq, wk, qs, ks = dtensor_like(q, a, b, weights[0], weights[1], qs, ks)
    q_t, k_t = heads_first(q, hf), heads_first(k, hf)
    # the floats of the call: the norm's eps and offset, then q's temperature (floor_scale, attn_scale)
    packed, norm = list(spec.packed), [spec.norm_eps, spec.norm_offset, *spec.q_temperature]
    if spec.inplace and not checks.records_grad(q, k, wq, wk, b):
        torch.ops.ropekit.rotate_(q_t, k_t, a, b, wq, wk, codes, spec.rot, packed, norm)
        return q, k
    if spec.inplace:  # refused by name before the op (the copy_ below would fail inside torch)
        no_leaf_written(q, k)
    outs = torch.ops.ropekit.rotate(q_t, k_t, a, b, wq, wk, qs, ks, codes, spec.rot, packed, norm, spec.out_dtype)
    rotated = (heads_first(outs[0], hf), heads_first(outs[1], hf) if k is not None else None)
    return run.into(rotated, *((q, k) if spec.inplace else (q_out, k_out)))


ROTATE = {
    DIRECT: rotate_direct,
    FUNCTION: _rotate_function,
    CUSTOM_OP: _rotate_custom,
    TRACED: _rotate_custom,
    RECORD: rotate_record,
}


def _zeros(meta):
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def grad_operands(metas, needs, gq, gk):
    """(want_q, want_k, first, second): the output gradients to rotate back, those of the inputs
    that need one only, as autograd gives them (any strides, a last stride other than 1 too: the
    kernel reads them through their strides; k alone goes in q's slot); None for an unused output
    is zeros."""
    q_meta, k_meta = metas
    want_q = needs[0]
    want_k = k_meta is not None and needs[1]
    gq = (gq if gq is not None else _zeros(q_meta)) if want_q else None
    gk = (gk if gk is not None else _zeros(k_meta)) if want_k else None
    first, second = (gq, gk) if want_q else (gk, None)
    return want_q, want_k, first, second


def input_grads(want_q, want_k, d_first, d_second):
    """The inverse of grad_operands' packing: (grad of q, grad of k)."""
    grad_q = d_first if want_q else None
    grad_k = (d_second if want_q else d_first) if want_k else None
    return grad_q, grad_k


def norm_grads(variant: Variant, needs, saved, gq, gk, backward_one) -> tuple:
    """(dq, dk, dwq, dwk) of a normed variant: one backward per tensor that needs a gradient for
    itself or its weight. needs: needs_input_grad of RotateFunction or of the rotate custom op
    (both take q, k, a, b, wq, wk first); saved: (q, k, wq, wk) as the forward got them;
    backward_one(x, g, w, mode) -> (gx, dw): pipeline.run_norm_backward, or the custom op that runs it."""
    q, k, wq, wk = saved
    res = [None, None, None, None]
    for i, (x, w, g, mode) in enumerate(((q, wq, gq, variant.norm_q), (k, wk, gk, variant.norm_k))):
        need_x, need_w = needs[i], w is not None and needs[4 + i]
        if x is None or not (need_x or need_w):
            continue
        gx, dw = backward_one(x, torch.zeros_like(x) if g is None else g, w, mode)
        res[i] = gx if need_x else None
        res[2 + i] = dw if need_w else None
    return tuple(res)


def _pairs(x: torch.Tensor, half: int, interleaved: bool, gap: int):
    """The two members of each rotated pair of x (*T, H, D) as float32 views (*T, H, half); half-split
    pairs are (i, gap + i) (gap: half, or D/2 with rotary_position='halves')."""
    x = x.float()
    if interleaved:
        return x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    return x[..., :half], x[..., gap : gap + half]


def freq_grad(outs, grads, positions: torch.Tensor, half: int, variant) -> torch.Tensor:
    """d loss / d inv_freq (float32 (half,)) of a rotation whose angles are positions x inv_freq,
    by torch ops. A pair's output o = R(angle) x moves with its angle as (-o2, o1), so
    d loss / d angle = g2 o1 - g1 o2 (summed over heads), and angle = position x inv_freq
    (negated when variant.inverse). outs, grads: (q's, k's) outputs and their gradients (None
    where absent), in the variant's output layout; the norm before the rotation changes nothing."""
    d_angle = 0.0
    for o, g in zip(outs, grads):
        if o is None or g is None:
            continue
        if variant.heads_first:  # (B, H, S, D) -> (B, S, H, D)
            o, g = o.transpose(1, 2), g.transpose(1, 2)
        gap = o.shape[-1] // 2 if variant.rope_halves else half
        o1, o2 = _pairs(o, half, variant.out_interleaved, gap)
        g1, g2 = _pairs(g, half, variant.out_interleaved, gap)
        d_angle = d_angle + (g2 * o1 - g1 * o2).sum(-2)
    p = pair_positions(positions, variant.sections, half).to(torch.float32)
    d = (p * d_angle).reshape(-1, half).sum(0)
    return -d if variant.inverse else d


def _saved_for_backward(variant: Variant, wants_freq_grad: bool, a, b, q, k, wq, wk, outs) -> tuple:
    """What a rotation's backward needs (RotateFunction's and the custom op's alike): the angle
    operands, q, k and the weights of a normed variant (the norm's backward recomputes the inverse
    rms from them), the outputs when inverse frequencies want a gradient."""
    saved = (q, k, wq, wk) if variant.normed else ()
    return (a, b, *saved, *(outs if variant.angles == "freqs" and wants_freq_grad else ()))


def _rotation_grads(variant: Variant, rot: int, needs, saved, gq, gk, metas, backward_one, rotate_back):
    """The one backward rule of the rotation, for RotateFunction and the custom op: (dq, dk, d_b,
    dwq, dwk). backward_one(x, g, w, mode): a normed tensor's gradients; rotate_back(first,
    second): the inverse rotation of the output gradients (Variant.backward())."""
    a, b, *rest = saved
    d_b = None
    if variant.angles == "freqs" and needs[3]:
        d_b = freq_grad(rest[-2:], (gq, gk), a, rot // 2, variant)
    if variant.normed:
        dq, dk, dwq, dwk = norm_grads(variant, needs, rest[:4], gq, gk, backward_one)
        return dq, dk, d_b, dwq, dwk
    # q's temperature scales the first slot: k's gradient never goes in it (q's is made, then dropped)
    wants = (needs[0] or variant.q_temperature, *needs[1:])
    want_q, want_k, first, second = grad_operands(metas, wants, gq, gk)
    if first is None:
        return None, None, d_b, None, None
    d_first, d_second = rotate_back(first, second)
    dq, dk = input_grads(want_q, want_k, d_first, d_second)
    return (dq if needs[0] else None), dk, d_b, None, None


class RotateFunction(torch.autograd.Function):
    """The eager autograd door of every rotation: forward runs the spec's variant, backward the
    one backward rule (`_rotation_grads`). Few arguments: each costs host time in apply."""

    @staticmethod
    def forward(ctx, q, k, a, b, wq, wk, spec, variant):
        ctx.spec, ctx.variant = spec.out_of_place(), variant
        ctx.metas = ((q.shape, q.dtype, q.device), None if k is None else (k.shape, k.dtype, k.device))
        if spec.inplace:
            # autograd's in-place rules: q and k are marked dirty (their version counters move; a
            # leaf that requires grad is refused by autograd itself, views are rebased on their base)
            ctx.save_for_backward(a, b)  # autograd's version check covers the angles
            run_rotate(spec, variant, q, k, q, k, a, b)
            ctx.mark_dirty(*(x for x in (q, k) if x is not None))
            return q, k
        q_out, k_out = run.out_like(q), run.out_like(k)
        run_rotate(spec, variant, q, k, q_out, k_out, a, b, weights=(wq, wk) if variant.normed else None)
        ctx.save_for_backward(
            *_saved_for_backward(variant, ctx.needs_input_grad[3], a, b, q, k, wq, wk, (q_out, k_out))
        )
        return q_out, k_out

    @staticmethod
    def backward(ctx, gq, gk):
        variant, spec = ctx.variant, ctx.spec
        if variant.normed and torch.is_grad_enabled():
            raise RuntimeError(
                "apply_rope: q_norm_weight / k_norm_weight: expected a backward without create_graph=True "
                "(the norm's backward is not itself differentiable), got create_graph=True"
            )
        saved = ctx.saved_tensors
        a, b = saved[0], saved[1]

        def backward_one(x, g, w, mode):
            return pipeline.run_norm_backward(spec, variant, x, g, w, mode, a, b)

        def rotate_back(first, second):
            inverse = variant.backward()
            if torch.is_grad_enabled():  # create_graph=True: the backward is differentiable too
                return RotateFunction.apply(first, second, a, b, None, None, spec, inverse)
            d_first, d_second = run.out_like(first), run.out_like(second)
            layout = (first.shape, first.stride(), None if second is None else second.stride())
            run_rotate(spec, inverse, first, second, d_first, d_second, a, b, layout)
            return d_first, d_second

        dq, dk, d_b, dwq, dwk = _rotation_grads(
            variant, spec.rot, ctx.needs_input_grad, saved, gq, gk, ctx.metas, backward_one, rotate_back
        )
        return dq, dk, None, d_b, dwq, dwk, None, None


class RotateInPlaceFunction(torch.autograd.Function):
    """RotateFunction for one tensor rotated in place under autograd (marked dirty): a Function
    that writes into a view may return that tensor alone. Same forward and backward bodies."""

    @staticmethod
    def forward(ctx, x, a, b, spec, variant):
        RotateFunction.forward(ctx, x, None, a, b, None, None, spec, variant)
        return x

    @staticmethod
    def backward(ctx, g):
        return RotateFunction.backward(ctx, g, None)[0], None, None, None, None


# ---------------------------------------------------------------------------------------------
# the rotation's custom ops


def _local_spec(codes, rot: int, packed, norm, q, k, a, b, inplace: bool, out_dtype=None) -> Spec:
    """The spec inside a rotation op: in place and out of place are different specs (an
    out-of-place launch copies the tail past the rotary dims)."""

    def make():
        variant = Variant.decode(codes)
        angle_shape = angle_strides = None
        if variant.angles == "tokens":
            from .plans import per_token_strides

            angle_shape = tuple(a.shape)
            angle_strides = per_token_strides(a, q.dim() - 2, variant.mrope != 0)
        return Spec(
            variant,
            rot,
            DIRECT,
            checks.triton_runs(q),
            angle_shape=angle_shape,
            angle_strides=angle_strides,
            packed=tuple(packed),
            inplace=inplace,
            out_dtype=out_dtype,
            norm_eps=norm[0],
            norm_offset=norm[1],
            q_temperature=tuple(norm[2:4]) or (1.0, 0.0),
        )

    values = (inplace, tuple(codes), rot, tuple(packed), tuple(norm), out_dtype, q, k, a, b)
    return op_spec("rotate op", values, make)


def _rotate_body(q, k, a, b, wq, wk, q_scale, k_scale, codes, rot, packed, norm, out_dtype, inplace: bool):
    """The body of both rotation ops: (q_out, k_out) new tensors (run.out_like's layout, the fake's),
    or q and k written in place; a last stride other than 1 is read (and in place written) where
    it lies."""
    v = Variant.decode(codes)
    if v.angles == "tokens" and a.stride() != b.stride():  # the kernel reads both with one set
        a, b = a.contiguous(), b.contiguous()
    spec = _local_spec(codes, rot, packed, norm, q, k, a, b, inplace, out_dtype)
    scales = None
    if v.scaled:
        one = run.scale_tensor(1.0, q.device, unit=True)
        scales = (one if q_scale is None else q_scale, one if k_scale is None else k_scale)
    if inplace:
        return rotate_direct(spec, q, k, a, b, (wq, wk), scales)
    outs = (run.out_like(q, out_dtype), run.out_like(k, out_dtype))
    return rotate_direct(spec, q, k, a, b, (wq, wk), scales, *outs)


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
    outs = _rotate_body(q, k, a, b, wq, wk, q_scale, k_scale, variant, rotary_dim, packed, norm, out_dtype, False)
    return [outs[0]] if k is None else [outs[0], outs[1]]


@_rotate_op.register_fake
def _(q, k, a, b, wq, wk, q_scale, k_scale, variant, rotary_dim, packed, norm, out_dtype):
    q, k = unit_last_stride(q), unit_last_stride(k)
    outs = [torch.empty_like(q, dtype=out_dtype)]
    return outs if k is None else outs + [torch.empty_like(k, dtype=out_dtype)]


def _setup_rotate(ctx, inputs, output):
    q, k, a, b, wq, wk, _, _, codes, rot, packed, norm, _ = inputs
    v = Variant.decode(codes)
    ctx.variant, ctx.codes, ctx.rot, ctx.packed, ctx.norm = v, codes, rot, packed, norm
    ctx.metas = ((q.shape, q.dtype, q.device), None if k is None else (k.shape, k.dtype, k.device))
    outs = (output[0], output[1] if k is not None else None)
    ctx.save_for_backward(*_saved_for_backward(v, b.requires_grad, a, b, q, k, wq, wk, outs))


def _rotate_backward(ctx, grads):
    saved = ctx.saved_tensors
    a, b = saved[0], saved[1]
    gq, gk = grads[0], (grads[1] if len(grads) > 1 else None)

    def backward_one(x, g, w, mode):
        out = torch.ops.ropekit.rotate_norm_backward(x, g, w, a, b, ctx.codes, ctx.rot, ctx.packed, ctx.norm, mode)
        return out[0], (out[1] if w is not None else None)

    def rotate_back(first, second):
        back = ctx.variant.backward().encode()
        g = torch.ops.ropekit.rotate(
            first, second, a, b, None, None, None, None, back, ctx.rot, ctx.packed, ctx.norm, None
        )
        return g[0], (g[1] if second is not None else None)

    dq, dk, d_b, dwq, dwk = _rotation_grads(
        ctx.variant, ctx.rot, ctx.needs_input_grad, saved, gq, gk, ctx.metas, backward_one, rotate_back
    )
    return dq, dk, None, d_b, dwq, dwk, *(None,) * 7  # scales and the non-tensor arguments


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
    names = ANGLE_NAMES[Variant.decode(variant).angles]
    # the address checks validation skips while tracing (torch.compile), made before any write
    read = ((names[0], a), (names[1], b), ("q_norm_weight", wq), ("k_norm_weight", wk))
    aliasing.inplace_aliasing("apply_rope", q, k, read)
    _rotate_body(q, k, a, b, wq, wk, None, None, variant, rotary_dim, packed, norm, None, True)


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
    spec = _local_spec(variant, rotary_dim, packed, norm, x, None, a, b, False)
    gx, dw = pipeline.run_norm_backward(spec, spec.variant, x, g, w, mode, a, b)
    return [gx] if dw is None else [gx, dw]


@_rotate_norm_backward_op.register_fake
def _(x, g, w, a, b, variant, rotary_dim, packed, norm, mode):
    gx = torch.empty_like(unit_last_stride(x))  # run.out_like's layout, the op's
    return [gx] if w is None else [gx, torch.empty_like(w)]


# ---------------------------------------------------------------------------------------------
# the fused store's doors: (spec, StoreOperands) -> None


def _store_custom(spec: Spec, t: StoreOperands) -> None:
    """Plain tensors (tables, positions, scales, weights) become replicated DTensors like q for a
    DTensor call (DTensor refuses mixed calls); as they are otherwise."""
    if spec.variant.fp4:  # checks.store refuses it first: the schema below has no block scales
        fail("apply_rope_and_store", "k_cache", "NVFP4 caches with plain tensors called eagerly", "a custom op call")
    a, table, slots, ks, vs, qs, wq, wk = dtensor_like(t.q, t.a, t.table, t.slot_mapping, t.ks, t.vs, t.qs, t.wq, t.wk)
    # built by keyword, not NamedTuple._replace: torch 2.11's compiler traces a constructor call
    t = StoreOperands(
        q=t.q,
        k=t.k,
        v=t.v,
        a=a,
        table=table,
        k_cache=t.k_cache,
        v_cache=t.v_cache,
        slot_mapping=slots,
        ks=ks,
        vs=vs,
        q_out=t.q_out,
        qs=qs,
        wq=wq,
        wk=wk,
        qn=t.qn,
        kn=t.kn,
    )
    head = (*t[:8], spec.variant.encode(), spec.rot, t.ks, t.vs, t.wq, t.wk, [spec.norm_eps, spec.norm_offset])
    if t.q_out is None:
        torch.ops.ropekit.rope_and_store(*head, list(spec.packed), t.kn)
    else:
        torch.ops.ropekit.rope_and_store_q_out(*head, list(spec.packed), t.q_out, t.qs, t.kn, t.qn)


STORE = {
    DIRECT: store_direct,
    FUNCTION: store_direct,
    CUSTOM_OP: _store_custom,
    TRACED: _store_custom,
    RECORD: store_record,  # (spec, the operands as a tuple) -> True, or None: the general path decides
}


def _store_body(t: StoreOperands, codes, rot, norm, packed) -> None:
    """The body of both store ops: the memoized spec of these (local) tensors, then the direct door."""

    def make():
        variant = Variant.decode(codes)
        checks.store_weights(variant, t.q, t.k, t.wq, t.wk, t.qn, t.kn)
        names = ("q", "k", "v", "positions", "cos_sin_cache", "k_cache", "v_cache", "slot_mapping")
        args = dict(zip(names, t[:8]), q_out=t.q_out, q_norm_weight=t.wq, k_norm_weight=t.wk, q_nope=t.qn, k_nope=t.kn)
        spec = checks.store_spec(args, variant, rot, tuple(packed), DIRECT, t.a)
        spec.norm_eps, spec.norm_offset = norm[0], norm[1]
        return spec

    spec = op_spec("store op", (*t, tuple(codes), rot, tuple(norm), tuple(packed)), make)
    checks.store_call(spec, t)
    store_direct(spec, t)


# Two ops, not one with an optional q_out: a mutated argument that may be None breaks fake-tensor
# tracing on torch 2.11 (IndexError), and q is written in place exactly when q_out is absent. One
# body and one schema text for both. variant: Variant.encode() of the call; positions: positions,
# or cu_seqlens for packed angles; norm: [eps, offset]; packed: [cp_size, cp_rank].
_STORE_SCHEMA = (
    "(Tensor{q} q, Tensor(a1!) k, Tensor v, Tensor? positions, Tensor cos_sin_cache, Tensor(a5!) k_cache, "
    "Tensor(a6!) v_cache, Tensor slot_mapping, SymInt[] variant, SymInt rotary_dim, Tensor? k_scale, "
    "Tensor? v_scale, Tensor? q_norm_weight, Tensor? k_norm_weight, float[] norm, SymInt[] packed{rest}) -> ()"
)


def _store_in_place(q, k, v, a, table, kc, vc, slots, codes, rot, ks, vs, wq, wk, norm, packed, k_nope=None):
    t = StoreOperands(q, k, v, a, table, kc, vc, slots, ks, vs, None, None, wq, wk, None, k_nope)
    _store_body(t, codes, rot, norm, packed)


def _store_q_out(
    q, k, v, a, table, kc, vc, slots, codes, rot, ks, vs, wq, wk, norm, packed, q_out, qs, kn=None, qn=None
):
    t = StoreOperands(q, k, v, a, table, kc, vc, slots, ks, vs, q_out, qs, wq, wk, qn, kn)
    _store_body(t, codes, rot, norm, packed)


for _name, _impl, _rest, _written in (
    ("rope_and_store", _store_in_place, ", Tensor? k_nope=None", "q"),
    (
        "rope_and_store_q_out",
        _store_q_out,
        ", Tensor(a16!) q_out, Tensor? q_scale, Tensor? k_nope=None, Tensor? q_nope=None",
        "q_out",
    ),
):
    _schema = _STORE_SCHEMA.format(q="(a0!)" if _written == "q" else "", rest=_rest)
    _op = torch.library.custom_op(
        f"ropekit::{_name}", _impl, mutates_args=(_written, "k", "k_cache", "v_cache"), schema=_schema
    )
    _op.register_fake(lambda *args, **kwargs: None)


# ---------------------------------------------------------------------------------------------
# the re-rotation's doors: (spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions,
# to_table) -> None


def _rerotate_custom(spec: Spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table):
    codes = spec.variant.encode()
    shift = 0 if delta_int is None else delta_int
    torch.ops.ropekit.rerotate_kv_cache(
        k_cache, slots, delta, shift, table, codes, spec.rot, k_scale, dst_slots, positions, to_table
    )


REROTATE = {
    DIRECT: rerotate_direct,
    FUNCTION: rerotate_direct,
    CUSTOM_OP: _rerotate_custom,
    TRACED: _rerotate_custom,
    RECORD: rerotate_record,  # (spec, k_cache, the call's addresses, the int shift) -> True, or None
}


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
    positions: Optional[torch.Tensor] = None,
    to_cache: Optional[torch.Tensor] = None,
) -> None:
    def make():
        named = dict(
            k_cache=k_cache,
            slots=slots,
            dst_slots=dst_slots,
            delta=delta,
            cos_sin_cache=cos_sin_cache,
            positions=positions,
            to_cache=to_cache,
        )
        extents = checks.rerotate_extents(named)
        return Spec(Variant.decode(variant), rotary_dim, DIRECT, checks.triton_runs(k_cache), extents=extents)

    values = (k_cache, slots, delta, cos_sin_cache, tuple(variant), rotary_dim, k_scale, dst_slots, positions, to_cache)
    spec = op_spec("rerotate op", values, make)
    shift = None if delta is not None else delta_int
    checks.rerotate_call(spec, k_cache, slots, delta, shift, cos_sin_cache, k_scale, dst_slots, positions, to_cache)
    rerotate_direct(spec, k_cache, slots, delta, shift, cos_sin_cache, k_scale, dst_slots, positions, to_cache)


@_rerotate_op.register_fake
def _(k_cache, slots, delta, delta_int, cos_sin_cache, variant, rotary_dim, k_scale, dst_slots, *tables):
    return None  # tables: positions and to_cache, left out by the dispatcher when None (their default)
