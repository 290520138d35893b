"""q/k RMSNorm fused with RoPE: the torch-facing side of the rotation ops' norm.

    rope_with_norm(q, k, positions, cos_sin_cache, *, ..., q_norm_weight, k_norm_weight, norm_eps,
                   norm_weight_offset)                       apply_rope with the norm (its hook)

(The fused KV-cache store takes the norm in its own pipeline: ropekit.store.)

y = x * rsqrt(mean(x^2) + eps) * (w + offset) in float32 over each head (weight (D,): Qwen3, Gemma 3)
or over all heads of a token (weight (H*D,): OLMo 2), then the rotation; one launch of the kernel
family's rope_kernel with NORM_Q / NORM_K set. Weights: fp32/bf16/fp16, unit
stride, on q's device. Autograd: gradients for q, k and both weights (rope_norm_backward_kernel,
one launch per tensor). CUDA runs the kernels, CPU tensors under TRITON_INTERPRET=1 too; plain CPU
runs ropekit.cpu (differentiable by autograd).

Everything here is self-contained (plans, launches, custom ops) so that it can be folded into the
call pipeline of ops.py / store.py: it reuses ops.plan_launch and store._plan and only adds the
norm's arguments to what they build.
"""

from __future__ import annotations

import os
from typing import List, NamedTuple, Optional, Sequence

import torch

from . import cpu, launcher, pipeline, tuning, validate
from .launch import launch as launch_kernel
from .launcher import next_pow2 as _next_pow2
from .launcher import token_strides as _token_strides
from .pipeline import MROPE_CHUNKED, MROPE_INTERLEAVED, Variant


def _use_triton(x):
    return pipeline.triton_runs(x)


OP = "apply_rope"

# rope_kernel's runtime-argument positions that the norm's head blocking changes (see plan_launch)
_ARG_N_Q_BLOCKS, _ARG_N_BLOCKS = 7, 8
# programs of the backward along tokens: each writes one float32 weight-gradient row per head block,
# summed with torch afterwards (enough to fill an H200; few rows to sum)
_BWD_PROGRAMS = int(os.environ.get("ROPEKIT_NORM_BWD_PROGRAMS", "1024"))


def _mrope_arg(mrope, mrope_interleaved, positions):
    if mrope is None or positions is None:
        return None
    return [MROPE_INTERLEAVED if mrope_interleaved else MROPE_CHUNKED, *mrope]


def _warps(block_h: int, half_pad: int, tail_pad: int, warps: int) -> int:
    return launcher.block_warps(block_h, half_pad, tail_pad, warps)


# ---------------------------------------------------------------------------------------------
# forward launch: rope_kernel with NORM_Q / NORM_K


class NormLaunch(NamedTuple):
    """A normed rope_kernel / rope_store_kernel launch minus its tensors (one per call signature)."""

    grid: tuple
    args: tuple  # the runtime arguments before the norm's (weights, eps, offset)
    meta: dict
    pack_bytes: int
    compiled: dict


def plan_forward(q, k, q_out, k_out, angles, interleaved, mrope, modes) -> NormLaunch:
    """ops.plan_launch, then what the norm changes: the tail is always processed (it is normalized,
    in place too), and across-heads norms need one head block holding all heads of a token."""
    mode, sections = (mrope[0], tuple(mrope[1:])) if mrope else (0, (0, 0, 0))
    variant = Variant(bool(interleaved), bool(interleaved), mode, sections, "table" if angles.max_pos else "tokens")
    base = launcher.plan_rotate(q, k, q_out, k_out, angles, variant)
    meta = dict(base.meta, NORM_Q=modes[0], NORM_K=modes[1])
    args = list(base.args[:-4])  # minus the placeholders of the norm's arguments
    rot = 2 * angles.half
    tail = max(q.shape[-1], k.shape[-1] if k is not None else 0) - rot
    meta["TAIL_PAD"] = _next_pow2(tail) if tail > 0 else 0
    grid = base.grid
    if 2 in modes:
        n_q, n_k = q.shape[-2], (k.shape[-2] if k is not None else 0)
        bh = _next_pow2(max(n_q, n_k))
        nqb, nkb = 1, (1 if n_k else 0)
        meta["BLOCK_H"] = bh
        args[_ARG_N_Q_BLOCKS], args[_ARG_N_BLOCKS] = nqb, nqb + nkb
        grid = (grid[0], 1 if meta["HEAD_LOOP"] else nqb + nkb)
    meta["num_warps"] = _warps(meta["BLOCK_H"], meta["HALF_PAD"], meta["TAIL_PAD"], meta["num_warps"])
    return NormLaunch(grid, tuple(args), meta, base.pack_bytes, {})


def fire_forward(launch: NormLaunch, q, k, q_out, k_out, angles_tensors, wq, wk, eps, offset) -> None:
    meta = launch.meta
    if launch.pack_bytes and any(x is not None and x.data_ptr() % launch.pack_bytes for x in (q, k, q_out, k_out)):
        meta = dict(meta, PACK=0)
    wq_t = wq if wq is not None else wk  # an unused weight slot gets the other (never read)
    wk_t = wk if wk is not None else wq
    positions, cos, sin = angles_tensors
    ptrs = (
        q,
        q if k is None else k,
        q_out,
        q_out if k_out is None else k_out,
        cos if positions is None else positions,
        cos,
        sin,
        sin,  # the scale slots: unscaled, never read
        sin,
    )
    # weights are passed after the ints (kernel order): their 16-byte alignment is part of the key
    variant = (meta["PACK"], wq_t.data_ptr() % 16 == 0, wk_t.data_ptr() % 16 == 0)
    launch_kernel(
        launcher.kernel("rope_kernel"),
        launch.compiled,
        variant,
        launch.grid,
        ptrs,
        (*launch.args, wq_t, wk_t, float(eps), float(offset)),
        meta,
    )


_sig = pipeline.tensor_key


def _cached(key, make):
    """Plans in ropekit's one memo (pipeline), by the call's layouts."""
    key = ("qknorm",) + key
    plan = pipeline.lookup(key)
    if plan is None:
        plan = pipeline.remember(key, make())
    return plan


def _forward_triton(q, k, q_out, k_out, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset):
    """Normalize and rotate q -> q_out, k -> k_out (the outputs may be the inputs) with one launch.

    positions, cos, sin: as ops._run takes them: (max_position, half) table views picked by
    positions, or per-token views (*T, half) / (3, *T, half) with positions None."""
    if q.shape[:-2].numel() == 0:
        return
    modes = _modes(q, k, wq, wk)
    angles = launcher.layout_from_views(positions, cos, sin, q.dim() - 2, mrope is not None)
    key = (
        "fwd",
        _sig(q),
        _sig(k),
        _sig(q_out),
        _sig(k_out),
        q_out.data_ptr() == q.data_ptr(),
        _sig(positions),
        _sig(cos),
        _sig(sin),
        interleaved,
        None if mrope is None else tuple(mrope),
        modes,
        _sig(wq),
        _sig(wk),
    )
    launch = _cached(key, lambda: plan_forward(q, k, q_out, k_out, angles, interleaved, mrope, modes))
    fire_forward(launch, q, k, q_out, k_out, (positions, cos, sin), wq, wk, eps, offset)


def _modes(q, k, wq, wk):
    """The kernel's NORM_Q / NORM_K: 0 none, 1 per head (weight (D,)), 2 across heads ((H*D,))."""

    def one(x, w):
        if w is None:
            return 0
        return 1 if w.shape[0] == x.shape[-1] else 2

    return one(q, wq), (one(k, wk) if k is not None else 0)


# ---------------------------------------------------------------------------------------------
# backward launch: rope_norm_backward_kernel, one tensor (q or k) per launch


class BackwardLaunch(NamedTuple):
    grid: tuple
    args: tuple  # runtime arguments minus eps and offset
    meta: dict
    dw_shape: tuple  # (rows, dw_row) of the float32 partial sums
    compiled: dict


def plan_backward(x, g, gx, w, angles, positions_t, interleaved, mrope, mode) -> BackwardLaunch:
    n_tok = x.dim() - 2
    S = x.shape[n_tok - 1]
    n_tokens = x.shape[:n_tok].numel()
    n_heads, d = x.shape[-2], x.shape[-1]
    half = angles.half
    half_pad = _next_pow2(half)
    tail = d - 2 * half
    tail_pad = _next_pow2(tail) if tail > 0 else 0
    if mode == 2:
        bh = _next_pow2(n_heads)  # the norm group: all heads in one block
    else:
        bh = min(_next_pow2(n_heads), _next_pow2(max(1, tuning.get("block_elems") // (2 * half_pad))))
    n_blocks = -(-n_heads // bh)
    tpp = -(-n_tokens // max(1, _BWD_PROGRAMS))
    n_progs = -(-n_tokens // tpp)
    positions = positions_t
    mode_m = 0 if mrope is None else mrope[0]
    sec = (0, 0, 0) if mrope is None else tuple(mrope[1:])
    if positions is not None:
        sp = ((positions.stride(0) if mode_m else 0), *_token_strides(positions[0] if mode_m else positions, n_tok))
    else:
        sp = (0, 0, 0)
    dw_row = d if mode == 1 else n_heads * d
    args = (
        n_tokens,
        S,
        n_heads,
        tail,
        angles.max_pos,
        n_blocks,
        angles.sin_off,
        tpp,
        dw_row,
        *_token_strides(x, n_tok),
        x.stride(-2),
        *_token_strides(g, n_tok),
        g.stride(-2),
        *_token_strides(gx, n_tok),
        gx.stride(-2),
        *sp,
        *angles.strides,
        *sec,
    )
    meta = dict(
        HALF=half,
        HALF_PAD=half_pad,
        BLOCK_H=bh,
        TAIL_PAD=tail_pad,
        HAS_POS=positions is not None,
        MROPE=mode_m,
        IN_INTERLEAVED=interleaved,
        OUT_INTERLEAVED=interleaved,
        NORM=mode,
        num_warps=_warps(bh, half_pad, tail_pad, 4),
    )
    return BackwardLaunch((n_progs, n_blocks), args, meta, (n_progs * n_blocks, dw_row), {})


def _backward_kernel():
    from .kernels.rope import rope_norm_backward_kernel  # imported on first use: Triton loads lazily

    return rope_norm_backward_kernel


def backward_triton(x, g, w, positions, cos, sin, interleaved, mrope, eps, offset):
    """(gx, dw) for one normalized-and-rotated tensor x given its output gradient g (dw None
    without a weight, gx then the plain inverse rotation); angles as _forward_triton takes them."""
    g = pipeline.unit_last_stride(g)
    gx = pipeline.empty_like(x)
    if x.shape[:-2].numel() == 0:
        return gx.zero_(), (None if w is None else torch.zeros_like(w))
    mode = 0 if w is None else (1 if w.shape[0] == x.shape[-1] else 2)
    angles = launcher.layout_from_views(positions, cos, sin, x.dim() - 2, mrope is not None)
    key = (
        "bwd",
        _sig(x),
        _sig(g),
        _sig(gx),
        _sig(w),
        _sig(positions),
        _sig(cos),
        _sig(sin),
        interleaved,
        None if mrope is None else tuple(mrope),
        mode,
    )
    launch = _cached(key, lambda: plan_backward(x, g, gx, w, angles, positions, interleaved, mrope, mode))
    dw_buf = torch.empty(launch.dw_shape if mode else (1, 1), dtype=torch.float32, device=x.device)
    ptrs = (x, g, gx, cos if w is None else w, dw_buf, cos if positions is None else positions, cos, sin)
    variant = (None if w is None else w.data_ptr() % 16 == 0,)
    launch_kernel(
        _backward_kernel(),
        launch.compiled,
        variant,
        launch.grid,
        ptrs,
        (*launch.args, float(eps), float(offset)),
        launch.meta,
    )
    dw = None if w is None else dw_buf.sum(0).to(w.dtype)
    return gx, dw


# ---------------------------------------------------------------------------------------------
# the CPU path (no Triton): ropekit.cpu


def _ref_angles(x, positions, cos, sin, mrope):
    """cos, sin per token (*T, half) from the views _forward_triton takes."""
    n_tok = x.dim() - 2
    sections = None if mrope is None else mrope[1:]
    il_sections = mrope is not None and mrope[0] == MROPE_INTERLEAVED
    if positions is not None:
        return cpu.angles_at(cos, sin, positions, tuple(x.shape[:n_tok]), sections, il_sections)
    if mrope is not None:
        return cpu.pick_sections(cos, sin, sections, il_sections)
    return cos, sin


def _forward_reference(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset):
    c, s = _ref_angles(q, positions, cos, sin, mrope)
    outs = []
    for x, w in ((q, wq), (k, wk)):
        outs.append(None if x is None else cpu.norm_rotate(x, w, c, s, interleaved=interleaved, eps=eps, offset=offset))
    return outs[0], outs[1]


def _backward_reference(x, g, w, positions, cos, sin, interleaved, mrope, eps, offset):
    with torch.enable_grad():
        xd = x.detach().requires_grad_(True)
        wd = None if w is None else w.detach().requires_grad_(True)
        y, _ = _forward_reference(xd, None, positions, cos, sin, interleaved, mrope, wd, None, eps, offset)
        grads = torch.autograd.grad(y, [xd] + ([wd] if wd is not None else []), g)
    return grads[0], (grads[1] if wd is not None else None)


def _forward_out(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset):
    """Out of place: fresh outputs."""
    if _use_triton(q):
        q_out = pipeline.empty_like(q)
        k_out = None if k is None else pipeline.empty_like(k)
        _forward_triton(q, k, q_out, k_out, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset)
        return q_out, k_out
    return _forward_reference(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset)


def _forward_inplace(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset):
    if _use_triton(q):
        _forward_triton(q, k, q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset)
    else:
        qo, ko = _forward_reference(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset)
        q.copy_(qo)
        if k is not None:
            k.copy_(ko)


def _backward(x, g, w, positions, cos, sin, interleaved, mrope, eps, offset):
    if _use_triton(x):
        return backward_triton(x, g, w, positions, cos, sin, interleaved, mrope, eps, offset)
    return _backward_reference(x, g, w, positions, cos, sin, interleaved, mrope, eps, offset)


# ---------------------------------------------------------------------------------------------
# eager autograd


class _NormRope(torch.autograd.Function):
    """Eager autograd: saves the unnormalized q and k (the backward recomputes the inverse rms from
    them, no extra activation is stored) and launches the backward kernel once per tensor that
    needs a gradient (for its input or its weight). Not twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, positions, cos, sin, wq, wk, cfg):
        interleaved, mrope, eps, offset = cfg
        q_out, k_out = _forward_out(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset)
        ctx.save_for_backward(q, k, positions, cos, sin, wq, wk)
        ctx.cfg = cfg
        return q_out, k_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gq, gk):
        q, k, positions, cos, sin, wq, wk = ctx.saved_tensors
        interleaved, mrope, eps, offset = ctx.cfg
        return (
            *_grads(
                ctx.needs_input_grad,
                (q, k, wq, wk),
                (gq, gk),
                _backward,
                (positions, cos, sin, interleaved, mrope, eps, offset),
            ),
            None,
        )  # cfg


def _grads(need, tensors, out_grads, backward, rest):
    """(dq, dk, dwq, dwk) from per-tensor backward calls; need: needs_input_grad in the order
    (q, k, positions, cos, sin, wq, wk, ...)."""
    q, k, wq, wk = tensors
    res = [None, None, None, None]
    for i, (x, w, g, need_x, need_w) in enumerate(
        ((q, wq, out_grads[0], need[0], need[5]), (k, wk, out_grads[1], need[1], need[6]))
    ):
        if x is None or not (need_x or (w is not None and need_w)):
            continue
        if g is None:
            g = torch.zeros_like(x)
        gx, dw = backward(x, g, w, *rest)
        res[i] = gx if need_x else None
        res[2 + i] = dw if (w is not None and need_w) else None
    dq, dk, dwq, dwk = res
    return dq, dk, None, None, None, dwq, dwk


def _backward_op_call(x, g, w, positions, cos, sin, interleaved, mrope, eps, offset):
    res = _rope_norm_backward_op(x, g, w, positions, cos, sin, interleaved, mrope, eps, offset)
    return res[0], (res[1] if w is not None else None)


# ---------------------------------------------------------------------------------------------
# torch.library registration: what torch.compile sees


@torch.library.custom_op("ropekit::rope_norm", mutates_args=())
def _rope_norm_op(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    wq: Optional[torch.Tensor],
    wk: Optional[torch.Tensor],
    interleaved: bool,
    mrope: Optional[List[int]],
    eps: float,
    offset: float,
) -> List[torch.Tensor]:
    q_out, k_out = _forward_out(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset)
    return [q_out] if k is None else [q_out, k_out]


@_rope_norm_op.register_fake
def _(q, k, positions, cos, sin, wq, wk, interleaved, mrope, eps, offset):
    return [torch.empty_like(q)] if k is None else [torch.empty_like(q), torch.empty_like(k)]


@torch.library.custom_op("ropekit::rope_norm_backward", mutates_args=())
def _rope_norm_backward_op(
    x: torch.Tensor,
    g: torch.Tensor,
    w: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    mrope: Optional[List[int]],
    eps: float,
    offset: float,
) -> List[torch.Tensor]:
    gx, dw = _backward(x, g, w, positions, cos, sin, interleaved, mrope, eps, offset)
    return [gx] if dw is None else [gx, dw]


@_rope_norm_backward_op.register_fake
def _(x, g, w, positions, cos, sin, interleaved, mrope, eps, offset):
    return [torch.empty_like(x)] if w is None else [torch.empty_like(x), torch.empty_like(w)]


def _rope_norm_setup(ctx, inputs, output):
    q, k, positions, cos, sin, wq, wk, interleaved, mrope, eps, offset = inputs
    ctx.save_for_backward(q, k, positions, cos, sin, wq, wk)
    ctx.cfg = (interleaved, mrope, eps, offset)


def _rope_norm_backward(ctx, grads):
    q, k, positions, cos, sin, wq, wk = ctx.saved_tensors
    interleaved, mrope, eps, offset = ctx.cfg
    gq, gk = grads[0], (grads[1] if len(grads) > 1 else None)
    return (
        *_grads(
            ctx.needs_input_grad,
            (q, k, wq, wk),
            (gq, gk),
            _backward_op_call,
            (positions, cos, sin, interleaved, mrope, eps, offset),
        ),
        None,
        None,
        None,
        None,
    )


_rope_norm_op.register_autograd(_rope_norm_backward, setup_context=_rope_norm_setup)


@torch.library.custom_op("ropekit::rope_norm_", mutates_args=("q", "k"))
def _rope_norm_inplace_op(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    wq: Optional[torch.Tensor],
    wk: Optional[torch.Tensor],
    interleaved: bool,
    mrope: Optional[List[int]],
    eps: float,
    offset: float,
) -> None:
    # the address checks validation skips while tracing, made before any write
    validate.inplace_aliasing(
        OP,
        q,
        k,
        (
            ("positions", positions),
            ("cos_sin_cache", cos),
            ("cos_sin_cache", sin),
            ("q_norm_weight", wq),
            ("k_norm_weight", wk),
        ),
    )
    _forward_inplace(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset)


@_rope_norm_inplace_op.register_fake
def _(q, k, positions, cos, sin, wq, wk, interleaved, mrope, eps, offset):
    return None


# ---------------------------------------------------------------------------------------------
# public entries: apply_rope's hook, and per-token angles (ropekit.hf_qknorm)


def _records_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) is True for x in xs)


def _dispatch(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset, inplace):
    """The validated call: compile (custom ops), eager autograd, eager inference, in place or not."""
    if torch.compiler.is_compiling():
        args = (positions, cos, sin, wq, wk, interleaved, mrope, eps, offset)
        if inplace:
            torch.ops.ropekit.rope_norm_(q, k, *args)
            return q, k
        outs = _rope_norm_op(q, k, *args)
        return outs[0], (outs[1] if k is not None else None)
    if inplace:
        _forward_inplace(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset)
        # Triton's writes are invisible to autograd: bump the version counters (see ops.apply_rope)
        torch.autograd.graph.increment_version(q)
        if k is not None:
            torch.autograd.graph.increment_version(k)
        return q, k
    if _records_grad(q, k, wq, wk) and _use_triton(q):
        return _NormRope.apply(q, k, positions, cos, sin, wq, wk, (interleaved, mrope, eps, offset))
    # no grad, or plain CPU: ropekit.cpu's norm path is differentiable by autograd as it is
    return _forward_out(q, k, positions, cos, sin, interleaved, mrope, wq, wk, eps, offset)


def rope_with_norm(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
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
):
    """apply_rope with RMSNorm of q and/or k before the rotation, in the same launch.

    q_norm_weight: (Dq,) normalizes each head of q, (Hq*Dq,) all heads of a token together; None:
        q is only rotated. k_norm_weight likewise for k. fp32/bf16/fp16, unit stride, q's device.
    norm_eps: added to mean(x^2). norm_weight_offset: added to the weight (1.0: Gemma's (1 + w)).
    The whole head is normalized, the tail past rotary_dim included (and written, in place too).
    Other arguments, results and guarantees as apply_rope; gradients for q, k and both weights.
    """
    # validated once per signature (the pipeline's memo; types included); addresses every call
    key = None
    if not torch.compiler.is_compiling():
        try:
            key = (
                OP + " norm",
                torch.is_grad_enabled(),
                _sig(q),
                _sig(k),
                _sig(positions),
                _sig(cos_sin_cache),
                type(interleaved),
                interleaved,
                type(rotary_dim),
                rotary_dim,
                None if mrope_section is None else pipeline.value_key(mrope_section),
                type(mrope_interleaved),
                mrope_interleaved,
                type(inplace),
                inplace,
                _sig(q_norm_weight),
                _sig(k_norm_weight),
                type(norm_eps),
                norm_eps,
                type(norm_weight_offset),
                norm_weight_offset,
            )
            hash(key)
        except (AttributeError, TypeError):
            key = None
    known = pipeline.lookup(key)
    if known is None:
        validate.no_dtensor(OP, "the QK-norm path", ("q", q), ("k", k))
        rot, mrope = validate.rope_args(
            OP,
            q,
            k,
            positions,
            cos_sin_cache,
            rotary_dim=rotary_dim,
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            inplace=inplace,
        )
        validate.norm_weights(OP, q, k, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset, inplace=inplace)
        validate.no_grad_table(OP, cos_sin_cache)
        pipeline.remember(key, (rot, mrope))
    else:
        rot, mrope = known
        if inplace:
            validate.inplace_aliasing(OP, q, k, (("positions", positions), ("cos_sin_cache", cos_sin_cache)))
    if inplace and not torch.compiler.is_compiling():
        validate.written_vs_read(
            OP, (("q", q), ("k", k)), (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight))
        )
    if positions is not None and validate.is_strict() and not torch.compiler.is_compiling():
        validate.positions_in_range(OP, positions, cos_sin_cache.shape[0])
    cos, sin = _table_views(cos_sin_cache, positions, rot, q)
    return _dispatch(
        q,
        k,
        positions,
        cos,
        sin,
        bool(interleaved),
        _mrope_arg(mrope, mrope_interleaved, positions),
        q_norm_weight,
        k_norm_weight,
        float(norm_eps),
        float(norm_weight_offset),
        inplace,
    )


def _table_views(cache, positions, rot, x):
    """cos and sin as views of a [cos | sin] table: the whole columns for positions, or (positions
    None: arange over x's last token dim) the first S rows broadcast over the batch dim."""
    half = rot // 2
    cos, sin = cache[:, :half], cache[:, half:rot]
    if positions is not None:
        return cos, sin
    S, shape = x.shape[-3], (*x.shape[:-2], half)
    return cos[:S].expand(shape), sin[:S].expand(shape)


def rotate_angles_with_norm(
    q,
    k,
    cos,
    sin,
    *,
    interleaved=False,
    q_norm_weight=None,
    k_norm_weight=None,
    norm_eps=1e-6,
    norm_weight_offset=0.0,
    op="rotate_with_angles",
    inplace=False,
):
    """rotate_with_angles with the norm: per-token cos, sin broadcastable to (*T, rotary_dim // 2)
    (Hugging Face's cos[..., :half] views). q (*T, Hq, D), k (*T, Hk, D) or None. inplace: written
    into q and k (the caller has checked their layouts and aliasing), else new tensors."""
    validate.no_dtensor(op, "the QK-norm path", ("q", q), ("k", k))
    cos, sin, _ = validate.angle_args(op, q, k, cos, sin, mrope_section=None, mrope_interleaved=False)
    validate.norm_weights(op, q, k, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset, inplace=inplace)
    return _dispatch(
        q,
        k,
        None,
        cos,
        sin,
        bool(interleaved),
        None,
        q_norm_weight,
        k_norm_weight,
        float(norm_eps),
        float(norm_weight_offset),
        inplace,
    )
