"""Launchers: validation -> strides -> launch, and the torch.library / autograd registration.

Two public entry points share one launcher and one kernel:

    apply_rope(q, k, positions, cos_sin_cache, ...)   angles picked from a [cos | sin] table by position
    rotate_with_angles(q, k, cos, sin, ...)           angles given per token (Hugging Face style)

Both describe the angles to the kernel as a pair of (cos, sin) views plus optional positions, so
`_run` has a single signature. CUDA tensors run the Triton kernel; CPU tensors run the Triton
kernel under TRITON_INTERPRET=1, otherwise the pure-PyTorch reference.
"""

from __future__ import annotations

import functools
import os
from typing import List, NamedTuple, Optional, Sequence

import torch

from . import reference, validate
from .launch import launch as launch_kernel

# mrope encoding passed through the custom op: None, or [mode, t, h, w]; mode 1 chunked, 2 interleaved
MROPE_CHUNKED, MROPE_INTERLEAVED = 1, 2


# Output allocation goes through one name so tests can poison fresh outputs (an unwritten element
# must fail a test, which memory that happens to be zero would hide).
empty_like = torch.empty_like


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _meta(half: int, n_q: int, n_k: int, tail: int, block_elems: int, warps: int, head_loop: bool = False,
          mrope: bool = False):
    """Compile-time tile sizes for a problem shape; cached so decode pays for it once.

    One head block size serves q and k (they share the kernel's code path). Warps: what the H200
    sweeps picked (benchmarks/PERF_LOG.md, run 6): 4 for the head loop, 2 with M-RoPE's three
    table rows or without the loop."""
    half_pad = _next_pow2(half)
    rows = max(1, block_elems // (2 * half_pad))          # heads per program, ~block_elems elements
    block_h = min(_next_pow2(max(n_q, n_k)), _next_pow2(rows))
    tail_pad = _next_pow2(tail) if tail > 0 else 0
    num_warps = warps or (4 if head_loop and not mrope else 2)
    n_q_blocks = -(-n_q // block_h)
    n_k_blocks = -(-n_k // block_h) if n_k else 0
    return half_pad, block_h, block_h, tail_pad, num_warps, n_q_blocks, n_k_blocks


# Tile size in elements per program, and a warps override: knobs for the tuning sweep
# (benchmarks/tune_core.py); the defaults are what that sweep picked on an H200.
_BLOCK_ELEMS = int(os.environ.get("ROPEKIT_BLOCK_ELEMS", "2048"))
_NUM_WARPS = int(os.environ.get("ROPEKIT_NUM_WARPS", "0"))
_TOKENS = int(os.environ.get("ROPEKIT_TOKENS", "1"))
# cache hint for the streamed q/k loads ("" or "evict_first"): the table rows are hinted evict_last
_EVICT = os.environ.get("ROPEKIT_EVICT", "")
# one program per token walking all head blocks (angles read once per token) instead of one per
# block: None picks it for table angles (see plan_launch); "0" / "1" force it (tuning)
_HEAD_LOOP = {"0": False, "1": True}.get(os.environ.get("ROPEKIT_HEAD_LOOP", ""))
# with the head loop: load the next head block before storing this one (two blocks in flight).
# None: on except for M-RoPE (run 8: W2 94.3% -> 95.0%, W5 91.7% -> 92.2%, W6 81.3% -> 82.0%;
# W4 85.1% -> 82.0%, its three masked row loads already hold the registers); "0" / "1" force it
_PREFETCH = {"0": False, "1": True}.get(os.environ.get("ROPEKIT_PREFETCH", ""))


def _token_strides(x: torch.Tensor, n_tok: int):
    """(stride_b, stride_s) of the token dims; b's stride is 0 when there is one token dim."""
    return (x.stride(0), x.stride(1)) if n_tok == 2 else (0, x.stride(0))


class Angles(NamedTuple):
    """Where the kernel reads cos and sin.

    Table mode (positions given): row p of cos is at cos + p * row_stride, sin at sin + sin_off +
    p * row_stride. Per-token mode (positions None): rows addressed by the token's own (sec, b, s)
    indices through strides, any of them 0 for broadcast.
    """
    positions: Optional[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    sin_off: int
    strides: tuple          # (sec, b, s, col); in table mode s is the row stride, sec and b unused
    half: int
    max_pos: int


def angles_from_views(positions, cos, sin, n_tok, mrope) -> Angles:
    """From cos/sin views: (max_position, half) tables, or (*T, half) / (3, *T, half) per token."""
    if positions is not None:
        strides = (0, 0, cos.stride(0), cos.stride(-1))
        return Angles(positions, cos, sin, 0, strides, cos.shape[-1], cos.shape[0])
    sec = cos.stride(0) if mrope else 0
    strides = (sec, *_token_strides(cos[0] if mrope else cos, n_tok), cos.stride(-1))
    return Angles(None, cos, sin, 0, strides, cos.shape[-1], 0)


def angles_from_cache(cache, positions, half, n_tok) -> Angles:
    """From a [cos | sin] table, without making views (decode pays for every view)."""
    row, col = cache.stride(0), cache.stride(1)
    if positions is None:   # arange over the last token dim: row s, broadcast over b
        return Angles(None, cache, cache, half * col, (0, 0, row, col), half, 0)
    return Angles(positions, cache, cache, half * col, (0, 0, row, col), half, cache.shape[0])


class Launch(NamedTuple):
    """Everything about a rope_kernel launch except the tensors: built once per call signature."""
    grid: tuple
    args: tuple             # the runtime ints, in kernel order after the pointers
    meta: dict              # constexprs and num_warps
    pack_bytes: int         # alignment the packed-pairs path needs of the interleaved tensors (0: none)
    compiled: dict          # ropekit.launch's cache of compiled kernels for this plan


def _pair_pack(x, n_tok):
    """Bits of one (2i, 2i+1) pair if x's rows keep pairs aligned (element size 2 or 4), else 0."""
    e = x.element_size()
    if e not in (2, 4):
        return 0
    if any(st % 2 for st in x.stride()[:-1]):
        return 0
    return 16 * e


def plan_launch(q, k, q_out, k_out, angles: Angles, in_il, out_il, mrope, inverse) -> Launch:
    n_tok = q.dim() - 2
    S = q.shape[n_tok - 1]
    n_tokens = q.shape[:n_tok].numel()
    half = angles.half
    rot = 2 * half
    has_k = k is not None
    n_q, d_q = q.shape[-2], q.shape[-1]
    n_k, d_k = (k.shape[-2], k.shape[-1]) if has_k else (0, rot)
    copy_tail = q_out.data_ptr() != q.data_ptr() and max(d_q, d_k) > rot
    tail = max(d_q, d_k) - rot if copy_tail else 0
    mode = 0 if mrope is None else mrope[0]
    # Table angles: one program per token walks all head blocks, so the dependent position ->
    # table-row loads happen once per token, not once per head block (run 6: W2 87% -> 94%).
    # Per-token angles have no such chain: one program per head block is faster there (W1), except
    # with M-RoPE, whose three rows per token would be read by every head block (run 9: the HF
    # multimodal drop-in at 43% on W4 that way).
    # Decode-sized calls keep one program per head block: with few tokens, parallelism matters more.
    head_loop = _HEAD_LOOP if _HEAD_LOOP is not None else (
        (angles.positions is not None or mode != 0) and n_tokens >= 1024)
    half_pad, bhq, bhk, tail_pad, num_warps, nqb, nkb = _meta(half, n_q, n_k, tail, _BLOCK_ELEMS, _NUM_WARPS,
                                                              head_loop, mode != 0)
    tokens = _TOKENS

    # packed pairs: every interleaved-side tensor must keep pairs word-aligned, with one element size
    packs = set()
    for x, il in ((q, in_il), (k, in_il), (q_out, out_il), (k_out, out_il)):
        if x is not None and il:
            packs.add(_pair_pack(x, n_tok))
    pack = packs.pop() if len(packs) == 1 else 0

    sec_t, sec_h, sec_w = (0, 0, 0) if mrope is None else mrope[1:]
    positions = angles.positions
    if positions is not None:
        sp_sec = positions.stride(0) if mode else 0
        sp = (sp_sec, *_token_strides(positions[0] if mode else positions, n_tok))
    else:
        sp = (0, 0, 0)
    sk = _token_strides(k, n_tok) + (k.stride(-2),) if has_k else (0, 0, 0)
    sko = _token_strides(k_out, n_tok) + (k_out.stride(-2),) if has_k else (0, 0, 0)
    args = (
        n_tokens, S, n_q, n_k, d_q - rot, d_k - rot, angles.max_pos, nqb, nqb + nkb, angles.sin_off,
        *_token_strides(q, n_tok), q.stride(-2), *sk,
        *_token_strides(q_out, n_tok), q_out.stride(-2), *sko,
        *sp, *angles.strides, sec_t, sec_h, sec_w,
        0, 0, 0.0, 0.0,         # no q/k norm: weights, eps, offset unused (ropekit.qknorm sets them)
    )
    meta = dict(
        HALF=half, HALF_PAD=half_pad, BLOCK_H=bhq, TAIL_PAD=tail_pad, TOKENS=tokens,
        HAS_POS=positions is not None, MROPE=mode,
        IN_INTERLEAVED=in_il, OUT_INTERLEAVED=out_il, INVERSE=inverse, PACK=pack, EVICT=_EVICT,
        HEAD_LOOP=head_loop, PREFETCH=head_loop and (_PREFETCH if _PREFETCH is not None else mode == 0),
        NORM_Q=0, NORM_K=0, num_warps=num_warps,
    )
    grid = (-(-n_tokens // tokens), 1 if head_loop else nqb + nkb)
    return Launch(grid, args, meta, pack // 8, {})


def fire(launch: Launch, q, k, q_out, k_out, angles: Angles) -> None:
    """Launch rope_kernel (directly once compiled: see ropekit.launch)."""
    meta = launch.meta
    if launch.pack_bytes and any(x is not None and x.data_ptr() % launch.pack_bytes
                                 for x in (q, k, q_out, k_out)):
        meta = dict(meta, PACK=0)        # a base pointer off the pair alignment: element path
    ptrs = (q, q if k is None else k, q_out, q_out if k_out is None else k_out,
            angles.cos if angles.positions is None else angles.positions, angles.cos, angles.sin)
    launch_kernel(_rope_kernel(), launch.compiled, meta["PACK"], launch.grid, ptrs, launch.args, meta)


@functools.lru_cache(maxsize=None)
def _rope_kernel():
    from .kernels.rope import rope_kernel    # imported on first use: Triton loads lazily

    return rope_kernel


_LAUNCHES: dict = {}


def _launch_triton(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, inverse):
    """Launch from views, the plan cached per signature (training and HF calls repeat shapes)."""
    angles = angles_from_views(positions, cos, sin, q.dim() - 2, mrope)
    key = (_sig(q), _sig(k), _sig(q_out), _sig(k_out), q_out.data_ptr() == q.data_ptr(), _sig(positions),
           _sig(cos), _sig(sin), in_il, out_il, None if mrope is None else tuple(mrope), inverse)
    launch = _LAUNCHES.get(key)
    if launch is None:
        if len(_LAUNCHES) > 4096:
            _LAUNCHES.clear()
        launch = _LAUNCHES[key] = plan_launch(q, k, q_out, k_out, angles, in_il, out_il, mrope, inverse)
    fire(launch, q, k, q_out, k_out, angles)


def _run_reference(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, inverse):
    n_tok = q.dim() - 2
    token_shape = tuple(q.shape[:n_tok])
    if positions is not None:
        section = None if mrope is None else mrope[1:]
        c, s = reference.gather_angles(cos, sin, positions, token_shape, mrope_section=section,
                                       mrope_interleaved=mrope is not None and mrope[0] == MROPE_INTERLEAVED)
    elif mrope is not None:
        sec = reference.mrope_sections_of_frequencies(cos.shape[-1], mrope[1:], mrope[0] == MROPE_INTERLEAVED)
        pick = sec.to(cos.device).view(1, *([1] * n_tok), -1).expand(1, *cos.shape[1:])
        c, s = cos.gather(0, pick).squeeze(0), sin.gather(0, pick).squeeze(0)
    else:
        c, s = cos, sin
    for x, out in ((q, q_out), (k, k_out)):
        if x is not None:
            out.copy_(reference.rotate(x, c, s, interleaved=in_il, out_interleaved=out_il, inverse=inverse))


def _run(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, inverse):
    """Rotate q -> q_out and k -> k_out (outputs may be the inputs: in place)."""
    if q.shape[:-2].numel() == 0:
        return
    if positions is not None and validate.is_strict():
        validate.positions_in_range("apply_rope", positions, cos.shape[0])
    if _use_triton(q):
        _launch_triton(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, inverse)
    else:
        _run_reference(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, inverse)


# ---------------------------------------------------------------------------------------------
# torch.library registration: what torch.compile and autograd see


def _unit_last_stride(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x itself when its last dim has stride 1 (what the kernel addresses), else a contiguous copy.

    The public ops validate their inputs, but the backward gets whatever autograd produces: the
    gradient w.r.t. k of `q @ k.transpose(-1, -2)` has a transposed layout, and the gradient of
    `out.sum()` is an expanded tensor whose strides are all 0. Copying is what autograd requires
    then; gradients that already have a unit last stride are used as they are (no copy).
    """
    if x is None or x.shape[-1] <= 1 or x.stride(-1) == 1:
        return x
    return x.contiguous()


@torch.library.custom_op("ropekit::rotate", mutates_args=())
def _rotate_op(
    q: torch.Tensor, k: Optional[torch.Tensor], positions: Optional[torch.Tensor],
    cos: torch.Tensor, sin: torch.Tensor,
    interleaved: bool, out_interleaved: bool, mrope: Optional[List[int]], inverse: bool,
) -> List[torch.Tensor]:
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    q_out = empty_like(q)
    k_out = None if k is None else empty_like(k)
    _run(q, k, q_out, k_out, positions, cos, sin, interleaved, out_interleaved, mrope, inverse)
    return [q_out] if k is None else [q_out, k_out]


@_rotate_op.register_fake
def _(q, k, positions, cos, sin, interleaved, out_interleaved, mrope, inverse):
    # the real op's output layouts: empty_like of the (possibly copied) inputs
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    return [torch.empty_like(q)] if k is None else [torch.empty_like(q), torch.empty_like(k)]


def _rotate_setup(ctx, inputs, output):
    q, k, positions, cos, sin, interleaved, out_interleaved, mrope, inverse = inputs
    ctx.save_for_backward(positions, cos, sin)
    ctx.flags = (interleaved, out_interleaved, mrope, inverse)
    ctx.has_k = k is not None
    # metadata only: holding q and k would keep both activations alive until the backward
    ctx.q_meta = (q.shape, q.dtype, q.device)
    ctx.k_meta = None if k is None else (k.shape, k.dtype, k.device)


def _zeros(meta):
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _rotate_backward(ctx, grads):
    positions, cos, sin = ctx.saved_tensors
    interleaved, out_interleaved, mrope, inverse = ctx.flags
    want_q = ctx.needs_input_grad[0]
    want_k = ctx.has_k and ctx.needs_input_grad[1]
    gq = (grads[0] if grads[0] is not None else _zeros(ctx.q_meta)) if want_q else None
    gk = (grads[1] if grads[1] is not None else _zeros(ctx.k_meta)) if want_k else None
    # the inverse rotation, reading the forward's output layout and writing its input layout;
    # only for the inputs that need a gradient (k alone is passed in q's slot)
    first = gq if want_q else gk
    if first is None:
        return (None,) * 9
    g = _rotate_op(first, gk if want_q else None, positions, cos, sin,
                   out_interleaved, interleaved, mrope, not inverse)
    grad_q = g[0] if want_q else None
    grad_k = (g[1] if want_q else g[0]) if want_k else None
    return grad_q, grad_k, None, None, None, None, None, None, None


_rotate_op.register_autograd(_rotate_backward, setup_context=_rotate_setup)


@torch.library.custom_op("ropekit::rotate_", mutates_args=("q", "k"))
def _rotate_inplace_op(
    q: torch.Tensor, k: Optional[torch.Tensor], positions: Optional[torch.Tensor],
    cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, mrope: Optional[List[int]],
) -> None:
    # the address checks validation skips while tracing (torch.compile), made before any write
    validate.inplace_aliasing("apply_rope", q, k, (("positions", positions), ("cos", cos), ("sin", sin)))
    _run(q, k, q, k, positions, cos, sin, interleaved, interleaved, mrope, False)


@_rotate_inplace_op.register_fake
def _(q, k, positions, cos, sin, interleaved, mrope):
    return None


def _records_grad(q, k) -> bool:
    """Will autograd record this call? (arguments that are not tensors: no; validation names them)"""
    return torch.is_grad_enabled() and (getattr(q, "requires_grad", False) is True
                                        or getattr(k, "requires_grad", False) is True)


def _needs_dispatcher(q, k) -> bool:
    """Eager inference skips the dispatcher (host overhead at decode); compile and autograd need it."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))


def _rotate(q, k, positions, cos, sin, in_il, out_il, mrope, inplace):
    if inplace:
        if torch.compiler.is_compiling():
            torch.ops.ropekit.rotate_(q, k, positions, cos, sin, in_il, mrope)
        else:
            _run(q, k, q, k, positions, cos, sin, in_il, in_il, mrope, False)
            # the kernel writes through raw pointers, which autograd does not see: bump the version
            # counters so a backward that saved q or k (for another op) raises instead of silently
            # using the rotated values
            torch.autograd.graph.increment_version(q)
            if k is not None:
                torch.autograd.graph.increment_version(k)
        return q, k
    if torch.compiler.is_compiling():
        outs = _rotate_op(q, k, positions, cos, sin, in_il, out_il, mrope, False)
        return outs[0], (outs[1] if k is not None else None)
    if _needs_dispatcher(q, k):
        # eager training: a plain autograd.Function costs far less host time per call than the
        # custom op's autograd wrapper (the same _run underneath, forward and backward)
        return _EagerRotate.apply(q, k, positions, cos, sin, in_il, out_il, mrope, False)
    q_out = empty_like(q)
    k_out = None if k is None else empty_like(k)
    _run(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, False)
    return q_out, k_out


class _EagerRotate(torch.autograd.Function):
    """Eager autograd for the rotation; backward is the inverse rotation by the same kernel
    (itself an _EagerRotate, so double backward works)."""

    @staticmethod
    def forward(ctx, q, k, positions, cos, sin, in_il, out_il, mrope, inverse):
        q_out = empty_like(q)
        k_out = None if k is None else empty_like(k)
        _run(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, inverse)
        ctx.save_for_backward(positions, cos, sin)
        ctx.flags = (in_il, out_il, mrope, inverse)
        ctx.metas = ((q.shape, q.dtype, q.device), None if k is None else (k.shape, k.dtype, k.device))
        return q_out, k_out

    @staticmethod
    def backward(ctx, gq, gk):
        positions, cos, sin = ctx.saved_tensors
        in_il, out_il, mrope, inverse = ctx.flags
        want_q, want_k, first, second = _grad_operands(ctx, gq, gk)
        if first is None:
            return (None,) * 9
        d_first, d_second = _EagerRotate.apply(first, second, positions, cos, sin, out_il, in_il, mrope,
                                               not inverse)
        return (*_input_grads(want_q, want_k, d_first, d_second), None, None, None, None, None, None, None)


def _grad_operands(ctx, gq, gk):
    """(want_q, want_k, first, second): the output gradients to rotate back, those of the inputs
    that need one only, with a unit last stride (k alone goes in q's slot); None for an unused
    output is zeros."""
    q_meta, k_meta = ctx.metas
    want_q = ctx.needs_input_grad[0]
    want_k = k_meta is not None and ctx.needs_input_grad[1]
    gq = _unit_last_stride(gq if gq is not None else _zeros(q_meta)) if want_q else None
    gk = _unit_last_stride(gk if gk is not None else _zeros(k_meta)) if want_k else None
    first, second = (gq, gk) if want_q else (gk, None)
    return want_q, want_k, first, second


def _input_grads(want_q, want_k, d_first, d_second):
    """The inverse of _grad_operands' packing: (grad of q, grad of k)."""
    grad_q = d_first if want_q else None
    grad_k = (d_second if want_q else d_first) if want_k else None
    return grad_q, grad_k


def _no_grad_table(op, table):
    if table.requires_grad and torch.is_grad_enabled():
        validate.fail(op, "cos_sin_cache", "a tensor that does not require grad (ropekit does not "
                      "differentiate through the angles)", "requires_grad=True")


# ---------------------------------------------------------------------------------------------
# public ops


def apply_rope(
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
    """Rotate q and k by the angles of their positions.

    Args:
        q: (*T, Hq, Dq) fp16/bf16/fp32, *T = (T,) or (B, S); any strides, last stride 1.
        k: (*T, Hk, Dk) or None; Dk may differ from Dq; its own strides.
        positions: (*T) int32/int64; (3, *T) for M-RoPE; None means arange over the last token dim.
        cos_sin_cache: (max_position, rotary_dim) rows [cos | sin]; fp32 recommended, bf16/fp16 ok.
        interleaved: False rotates halves (i, i + rotary_dim/2) (Llama/NeoX); True rotates pairs
            (2i, 2i+1) (GPT-J, Llama 4, DeepSeek).
        rotary_dim: dims [0, rotary_dim) are rotated, the rest kept; must equal the cache width.
        mrope_section: (t, h, w) frequencies per position row, summing to rotary_dim // 2.
        mrope_interleaved: Qwen3-VL's interleaved frequency layout instead of chunks.
        inplace: write into q and k; otherwise return new tensors and leave the inputs untouched.

    Returns (q_out, k_out), k_out None when k is None. Math in float32, outputs in input dtypes.
    A position outside [0, max_position) gives NaN in that token's rotated dims (never an
    out-of-bounds read); under `ropekit.strict()` it raises ValueError before anything is written.

    q_norm_weight / k_norm_weight ((D,) per head or (H*D,) across heads), norm_eps,
    norm_weight_offset: RMSNorm of q / k before the rotation, same launch (see ropekit.qknorm).
    """
    if q_norm_weight is not None or k_norm_weight is not None:
        from .qknorm import rope_with_norm
        return rope_with_norm(q, k, positions, cos_sin_cache, interleaved=interleaved, rotary_dim=rotary_dim,
                              mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, inplace=inplace,
                              q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps,
                              norm_weight_offset=norm_weight_offset)
    op = "apply_rope"
    compiling = torch.compiler.is_compiling()
    grad = _records_grad(q, k)
    key = None if compiling else _call_key(q, k, positions, cos_sin_cache, grad, interleaved, rotary_dim,
                                           mrope_section, mrope_interleaved, inplace)
    spec = _SPECS.get(key) if key is not None else None
    if spec is None:
        rot, mrope = validate.rope_args(op, q, k, positions, cos_sin_cache, rotary_dim=rotary_dim,
                                        mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
                                        inplace=inplace)
        _no_grad_table(op, cos_sin_cache)
        mrope_arg = None
        if mrope is not None and positions is not None:
            mrope_arg = [MROPE_INTERLEAVED if mrope_interleaved else MROPE_CHUNKED, *mrope]
        spec = _Spec(rot, mrope_arg, (_extent(q), _extent(k), _extent(positions), _extent(cos_sin_cache)),
                     [None], {})
        if key is not None:
            if len(_SPECS) > 4096:
                _SPECS.clear()
            _SPECS[key] = spec
    elif inplace and _spans_meet((q, k, positions, cos_sin_cache), spec.extents):
        # the checks that depend on addresses, not on the call's signature: exact ones only when
        # the written tensors' byte ranges meet another argument's (cheap range test first)
        validate.inplace_aliasing(op, q, k, (("positions", positions), ("cos_sin_cache", cos_sin_cache)))

    half = spec.rot // 2
    if grad and not compiling and _use_triton(q) and q.shape[:-2].numel():
        # eager training: a lean autograd.Function on the same cached plans (W8 is host-bound)
        if positions is not None and validate.is_strict():
            validate.positions_in_range(op, positions, cos_sin_cache.shape[0])
        return _PlannedRotate.apply(q, k, positions, cos_sin_cache, _How(spec, interleaved, interleaved, True, False))
    if _use_triton(q) and not grad and not compiling:
        # eager inference: no views, no dispatcher, the launch planned once per call signature
        if q.shape[:-2].numel() == 0:
            return (q, k) if inplace else (empty_like(q), None if k is None else empty_like(k))
        if positions is not None and validate.is_strict():
            validate.positions_in_range(op, positions, cos_sin_cache.shape[0])
        q_out = q if inplace else empty_like(q)
        k_out = k if inplace or k is None else empty_like(k)
        angles = angles_from_cache(cos_sin_cache, positions, half, q.dim() - 2)
        launch = spec.launch[0]
        if launch is None:
            launch = spec.launch[0] = plan_launch(q, k, q_out, k_out, angles, interleaved, interleaved,
                                                  spec.mrope, False)
        fire(launch, q, k, q_out, k_out, angles)
        if inplace:
            # Triton's writes are invisible to autograd: a tensor saved for some backward must see
            # its version change, so that backward raises instead of using rotated values
            torch.autograd.graph.increment_version(q)
            if k is not None:
                torch.autograd.graph.increment_version(k)
        return q_out, k_out

    cos, sin = _table_views(cos_sin_cache, positions, spec.rot, q)
    return _rotate(q, k, positions, cos, sin, interleaved, interleaved, spec.mrope, inplace)


class _Spec(NamedTuple):
    """What validation concluded about one call signature, and its launch plans once made."""
    rot: int
    mrope: Optional[list]
    extents: tuple          # apply_rope: bytes spanned by q, k, positions, cos_sin_cache;
                            # rotate_angles: (the shape cos and sin are broadcast to, the kernel's
                            # angle strides for cos and sin as given, or None if they are copied)
    launch: list            # [Launch or None]: the forward rotation
    backward: dict          # gradient signatures -> Launch of the inverse rotation (_PlannedRotate)


class _How(NamedTuple):
    """The non-tensor half of a _PlannedRotate call."""
    spec: "_Spec"
    in_il: bool
    out_il: bool
    table: bool             # (a, b) are (positions, [cos | sin] table), else per-token (cos, sin)
    heads_first: bool       # q, k and their gradients are (B, H, S, D) views (Hugging Face's layout)


def _angles(how: _How, a, b, x) -> Angles:
    if how.table:
        return angles_from_cache(b, a, how.spec.rot // 2, x.dim() - 2)
    strides = how.spec.extents[1]
    if strides is None:                 # copies of the angles (rotate_angles): their own strides
        return angles_from_views(None, a, b, x.dim() - 2, how.spec.mrope)
    return Angles(None, a, b, 0, strides, how.spec.rot // 2, 0)


class _PlannedRotate(torch.autograd.Function):
    """Eager autograd on Triton devices for apply_rope (a, b = positions, table) and
    rotate_with_angles (a, b = cos, sin): the forward and the backward (the inverse rotation)
    launch from plans cached on the call's _Spec, with no per-call validation, no views and few
    Function arguments (each one costs host time in Function.apply). W8's step is host-bound:
    run 6 measured 495 us per step for 165 us of kernels.

    Hugging Face's (B, H, S, D) tensors (how.heads_first) are planned through their (B, S, H, D)
    views, once; a launch itself needs only their addresses, so calls make no views at all and
    outputs and gradients are allocated in the layout of what they mirror."""

    @staticmethod
    def forward(ctx, q, k, a, b, how):
        spec = how.spec
        q_out = empty_like(q)
        k_out = None if k is None else empty_like(k)
        angles = _angles(how, a, b, q)
        launch = spec.launch[0]
        if launch is None:
            launch = spec.launch[0] = plan_launch(*_kernel_layout(how, q, k, q_out, k_out), angles, how.in_il,
                                                  how.out_il, spec.mrope, False)
        fire(launch, q, k, q_out, k_out, angles)
        ctx.save_for_backward(a, b)          # autograd's version check covers the angles
        ctx.how = how
        ctx.metas = ((q.shape, q.dtype, q.device), None if k is None else (k.shape, k.dtype, k.device))
        return q_out, k_out

    @staticmethod
    def backward(ctx, gq, gk):
        a, b = ctx.saved_tensors
        how = ctx.how
        spec = how.spec
        want_q, want_k, first, second = _grad_operands(ctx, gq, gk)
        if first is None:
            return None, None, None, None, None
        if torch.is_grad_enabled():
            # create_graph=True: the backward must itself be differentiable (double backward)
            first, second = _kernel_layout(how, first, second)
            half = spec.rot // 2      # cos and sin may come unsliced (ropekit.hf): the first half
            positions, (cos, sin) = (a, _table_views(b, a, spec.rot, first)) if how.table else \
                (None, _angle_views(spec, a[..., :half], b[..., :half]))
            d_first, d_second = _kernel_layout(how, *_EagerRotate.apply(
                first, second, positions, cos, sin, how.out_il, how.in_il, spec.mrope, True))
        else:
            d_first = empty_like(first)
            d_second = None if second is None else empty_like(second)
            angles = _angles(how, a, b, first)
            key = (want_q, _sig(first), _sig(second))
            launch = spec.backward.get(key)
            if launch is None:
                launch = spec.backward[key] = plan_launch(*_kernel_layout(how, first, second, d_first, d_second),
                                                          angles, how.out_il, how.in_il, spec.mrope, True)
            fire(launch, first, second, d_first, d_second, angles)
        return (*_input_grads(want_q, want_k, d_first, d_second), None, None, None)


def _kernel_layout(how: _How, *xs):
    """xs as the kernel's (*T, H, D) views: Hugging Face's (B, H, S, D) tensors transposed."""
    return tuple(_heads_first(x, how.heads_first) for x in xs)


def _table_views(cache, positions, rot, x):
    """cos and sin as views of a [cos | sin] table: the whole columns for positions, or (positions
    None: arange over x's last token dim) the first S rows broadcast over the batch dim."""
    half = rot // 2
    cos, sin = cache[:, :half], cache[:, half:rot]
    if positions is not None:
        return cos, sin
    S, shape = x.shape[-3], (*x.shape[:-2], half)
    return cos[:S].expand(shape), sin[:S].expand(shape)


_SPECS: dict = {}


def _sig(x):
    return None if x is None else (x.shape, x.stride(), x.dtype, x.device)


def _call_key(q, k, positions, cache, *flags):
    """A hashable signature of a call (shapes, strides, dtypes, devices, flags; flags[0] says
    whether the call records a backward), or None when the call must be validated afresh:
    arguments of the wrong type, or angles that require grad (refused under grad mode).
    rotate_with_angles passes cos and sin in the positions and cache slots."""
    try:
        if cache.requires_grad or (positions is not None and positions.requires_grad):
            return None
        mrope_section = flags[3]
        if mrope_section is not None:
            flags = flags[:3] + (tuple(mrope_section),) + flags[4:]
        key = (_sig(q), _sig(k), _sig(positions), _sig(cache), *flags)
        hash(key)
        return key
    except (AttributeError, TypeError):
        return None


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


def rotate_with_angles(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    out_interleaved: Optional[bool] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
):
    """Rotate q and k by per-token angles (the form Hugging Face models pass). Out of place.

    cos, sin: broadcastable to (*T, rotary_dim // 2), or (3, *T, rotary_dim // 2) with
    mrope_section; any strides (views of Hugging Face's duplicated-half tensors are fine).
    out_interleaved (default: interleaved) is the layout the rotated dims are written in
    (DeepSeek-V3's HF code reads pairs and writes halves).
    """
    out_interleaved = interleaved if out_interleaved is None else out_interleaved
    return rotate_angles(q, k, cos, sin, interleaved, out_interleaved, mrope_section, mrope_interleaved, False)


def _heads_first(x, yes: bool):
    """(B, H, S, D) <-> (B, S, H, D) views: the Hugging Face layout and the kernel's."""
    return x.transpose(1, 2) if yes and x is not None else x


def rotate_angles(q, k, cos, sin, in_il, out_il, mrope_section, mrope_interleaved, heads_first, remember=None):
    """rotate_with_angles, also for Hugging Face's (B, H, S, D) q and k (heads_first, the
    ropekit.hf drop-ins): under autograd no view of q, k or the angles is made per call.

    remember: (dict, key): a call that goes to _PlannedRotate with cos and sin as given leaves its
    _How there, so that the caller can make the same call again without coming here. cos and sin
    may then be passed unsliced (the caller's cos[..., :half] starts where cos does and has its
    strides)."""
    op = "rotate_with_angles"
    compiling = torch.compiler.is_compiling()
    grad = _records_grad(q, k)
    key = None if compiling else _call_key(q, k, cos, sin, grad, op, in_il, mrope_section,
                                           mrope_interleaved, out_il, heads_first)
    spec = _SPECS.get(key) if key is not None else None
    if spec is None:
        cos_v, sin_v, mrope = validate.angle_args(op, _heads_first(q, heads_first), _heads_first(k, heads_first),
                                                  cos, sin, mrope_section=mrope_section,
                                                  mrope_interleaved=mrope_interleaved)
        mrope_arg = None
        if mrope is not None:
            mrope_arg = [MROPE_INTERLEAVED if mrope_interleaved else MROPE_CHUNKED, *mrope]
        # broadcast views start where their tensors do, so a launch can take cos and sin as given
        # with these strides; unless validation had to copy them (cos and sin strides differ)
        direct = not compiling and cos_v.data_ptr() == cos.data_ptr() and sin_v.data_ptr() == sin.data_ptr()
        strides = angles_from_views(None, cos_v, sin_v, q.dim() - 2, mrope_arg).strides if direct else None
        spec = _Spec(2 * cos_v.shape[-1], mrope_arg, (tuple(cos_v.shape), strides), [None], {})
        if key is not None:
            if len(_SPECS) > 4096:
                _SPECS.clear()
            _SPECS[key] = spec
    if grad and not compiling and _use_triton(q) and q.shape[:-2].numel():
        how = _How(spec, in_il, out_il, False, heads_first)
        if spec.extents[1] is None:
            cos, sin = _angle_views(spec, cos, sin)
        elif remember is not None:
            remember[0][remember[1]] = how
        return _PlannedRotate.apply(q, k, cos, sin, how)
    cos, sin = _angle_views(spec, cos, sin)
    qo, ko = _rotate(_heads_first(q, heads_first), _heads_first(k, heads_first), None, cos, sin, in_il,
                     out_il, spec.mrope, False)
    return _heads_first(qo, heads_first), _heads_first(ko, heads_first)


def _angle_views(spec, cos, sin):
    """The views of cos and sin that validation made: broadcast to the token shape, copied when
    their strides differ (the kernel reads both through one set of strides)."""
    shape = spec.extents[0]
    cos, sin = cos.broadcast_to(shape), sin.broadcast_to(shape)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin
