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
from typing import List, Optional, Sequence

import torch

from . import reference, validate

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
def _meta(half: int, n_q: int, n_k: int, tail: int, block_elems: int, warps: int):
    """Compile-time tile sizes for a problem shape; cached so decode pays for it once."""
    half_pad = _next_pow2(half)
    rows = max(1, block_elems // (2 * half_pad))          # heads per program, ~block_elems elements
    block_hq = min(_next_pow2(n_q), _next_pow2(rows))
    block_hk = min(_next_pow2(max(n_k, 1)), _next_pow2(rows))
    tail_pad = _next_pow2(tail) if tail > 0 else 0
    elems = max(block_hq, block_hk) * 2 * half_pad
    num_warps = warps or (4 if elems <= 4096 else 8)
    n_q_blocks = -(-n_q // block_hq)
    n_k_blocks = -(-n_k // block_hk) if n_k else 0
    return half_pad, block_hq, block_hk, tail_pad, num_warps, n_q_blocks, n_k_blocks


# Tile size in elements per program, and a warps override: knobs for the tuning sweep
# (benchmarks/tune_core.py); the defaults are what that sweep picked on an H200.
_BLOCK_ELEMS = int(os.environ.get("ROPEKIT_BLOCK_ELEMS", "4096"))
_NUM_WARPS = int(os.environ.get("ROPEKIT_NUM_WARPS", "0"))


def _token_strides(x: torch.Tensor, n_tok: int):
    """(stride_b, stride_s) of the token dims; b's stride is 0 when there is one token dim."""
    return (x.stride(0), x.stride(1)) if n_tok == 2 else (0, x.stride(0))


def _launch_triton(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, inverse):
    from .kernels.rope import rope_kernel

    n_tok = q.dim() - 2
    S = q.shape[n_tok - 1]
    B = q.shape[0] if n_tok == 2 else 1
    half = cos.shape[-1]
    rot = 2 * half
    has_k = k is not None
    n_q, d_q = q.shape[-2], q.shape[-1]
    n_k, d_k = (k.shape[-2], k.shape[-1]) if has_k else (0, rot)
    copy_tail = q_out.data_ptr() != q.data_ptr() and max(d_q, d_k) > rot
    tail = max(d_q, d_k) - rot if copy_tail else 0
    half_pad, bhq, bhk, tail_pad, num_warps, nqb, nkb = _meta(half, n_q, n_k, tail, _BLOCK_ELEMS, _NUM_WARPS)

    has_pos = positions is not None
    mode = 0 if mrope is None else mrope[0]
    sec_t, sec_h, sec_w = (0, 0, 0) if mrope is None else mrope[1:]
    if has_pos:
        # table mode: cos/sin are (max_position, half) views; row stride goes in cs_s
        sp_sec = positions.stride(0) if mode else 0
        sp_b, sp_s = _token_strides(positions[0] if mode else positions, n_tok)
        cs_sec, cs_b, cs_s = 0, 0, cos.stride(0)
        max_pos = cos.shape[0]
        pos_arg = positions
    else:
        # per-token mode: cos/sin are (*T, half) or (3, *T, half) views, maybe broadcast
        sp_sec = sp_b = sp_s = 0
        cs_sec = cos.stride(0) if mode else 0
        cs_b, cs_s = _token_strides(cos[0] if mode else cos, n_tok)
        max_pos = 0
        pos_arg = cos
    k_arg, ko_arg = (k, k_out) if has_k else (q, q_out)
    sk = _token_strides(k, n_tok) + (k.stride(-2),) if has_k else (0, 0, 0)
    sko = _token_strides(k_out, n_tok) + (k_out.stride(-2),) if has_k else (0, 0, 0)
    grid = (B * S, nqb + nkb)
    rope_kernel[grid](
        q, k_arg, q_out, ko_arg, pos_arg, cos, sin,
        S, n_q, n_k, d_q - rot, d_k - rot, max_pos, nqb,
        *_token_strides(q, n_tok), q.stride(-2), *sk,
        *_token_strides(q_out, n_tok), q_out.stride(-2), *sko,
        sp_sec, sp_b, sp_s,
        cs_sec, cs_b, cs_s, cos.stride(-1),
        sec_t, sec_h, sec_w,
        HALF=half, HALF_PAD=half_pad, BLOCK_HQ=bhq, BLOCK_HK=bhk, TAIL_PAD=tail_pad,
        HAS_K=has_k, HAS_POS=has_pos, MROPE=mode,
        IN_INTERLEAVED=in_il, OUT_INTERLEAVED=out_il, INVERSE=inverse,
        num_warps=num_warps,
    )


def _run_reference(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, inverse):
    n_tok = q.dim() - 2
    token_shape = tuple(q.shape[:n_tok])
    if positions is not None:
        table = torch.cat((cos, sin), dim=-1)
        section = None if mrope is None else mrope[1:]
        c, s = reference.angles_from_table(table, positions, token_shape, mrope_section=section,
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


@torch.library.custom_op("ropekit::rotate", mutates_args=())
def _rotate_op(
    q: torch.Tensor, k: Optional[torch.Tensor], positions: Optional[torch.Tensor],
    cos: torch.Tensor, sin: torch.Tensor,
    interleaved: bool, out_interleaved: bool, mrope: Optional[List[int]], inverse: bool,
) -> List[torch.Tensor]:
    q_out = empty_like(q)
    k_out = None if k is None else empty_like(k)
    _run(q, k, q_out, k_out, positions, cos, sin, interleaved, out_interleaved, mrope, inverse)
    return [q_out] if k is None else [q_out, k_out]


@_rotate_op.register_fake
def _(q, k, positions, cos, sin, interleaved, out_interleaved, mrope, inverse):
    return [torch.empty_like(q)] if k is None else [torch.empty_like(q), torch.empty_like(k)]


def _rotate_setup(ctx, inputs, output):
    q, k, positions, cos, sin, interleaved, out_interleaved, mrope, inverse = inputs
    ctx.save_for_backward(positions, cos, sin)
    ctx.flags = (interleaved, out_interleaved, mrope, inverse)
    ctx.has_k = k is not None
    ctx.shapes = (q, k)


def _rotate_backward(ctx, grads):
    positions, cos, sin = ctx.saved_tensors
    interleaved, out_interleaved, mrope, inverse = ctx.flags
    q_like, k_like = ctx.shapes
    gq = grads[0] if grads[0] is not None else torch.zeros_like(q_like)
    gk = None
    if ctx.has_k:
        gk = grads[1] if grads[1] is not None else torch.zeros_like(k_like)
    # the inverse rotation, reading the forward's output layout and writing its input layout
    g = _rotate_op(gq, gk, positions, cos, sin, out_interleaved, interleaved, mrope, not inverse)
    return g[0], (g[1] if ctx.has_k else None), None, None, None, None, None, None, None


_rotate_op.register_autograd(_rotate_backward, setup_context=_rotate_setup)


@torch.library.custom_op("ropekit::rotate_", mutates_args=("q", "k"))
def _rotate_inplace_op(
    q: torch.Tensor, k: Optional[torch.Tensor], positions: Optional[torch.Tensor],
    cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, mrope: Optional[List[int]],
) -> None:
    _run(q, k, q, k, positions, cos, sin, interleaved, interleaved, mrope, False)


@_rotate_inplace_op.register_fake
def _(q, k, positions, cos, sin, interleaved, mrope):
    return None


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
        return q, k
    if _needs_dispatcher(q, k):
        outs = _rotate_op(q, k, positions, cos, sin, in_il, out_il, mrope, False)
        return outs[0], (outs[1] if k is not None else None)
    q_out = empty_like(q)
    k_out = None if k is None else empty_like(k)
    _run(q, k, q_out, k_out, positions, cos, sin, in_il, out_il, mrope, False)
    return q_out, k_out


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
    """
    op = "apply_rope"
    rot, mrope = validate.rope_args(op, q, k, positions, cos_sin_cache, rotary_dim=rotary_dim,
                                    mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
                                    inplace=inplace)
    _no_grad_table(op, cos_sin_cache)
    half = rot // 2
    cos, sin = cos_sin_cache[:, :half], cos_sin_cache[:, half:rot]
    mrope_arg = None
    if positions is None:
        # arange over the last token dim: the table's first S rows, broadcast over the batch dim
        S = q.shape[-3]
        cos, sin = cos[:S].expand(*q.shape[:-2], half), sin[:S].expand(*q.shape[:-2], half)
    elif mrope is not None:
        mrope_arg = [MROPE_INTERLEAVED if mrope_interleaved else MROPE_CHUNKED, *mrope]
    return _rotate(q, k, positions, cos, sin, interleaved, interleaved, mrope_arg, inplace)


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
    op = "rotate_with_angles"
    out_interleaved = interleaved if out_interleaved is None else out_interleaved
    cos, sin, mrope = validate.angle_args(op, q, k, cos, sin, mrope_section=mrope_section,
                                          mrope_interleaved=mrope_interleaved)
    mrope_arg = None
    if mrope is not None:
        mrope_arg = [MROPE_INTERLEAVED if mrope_interleaved else MROPE_CHUNKED, *mrope]
    return _rotate(q, k, None, cos, sin, interleaved, out_interleaved, mrope_arg, False)
