"""The rotation ops: what a user calls.

    apply_rope(q, k, positions, cos_sin_cache, ...)   angles from a [cos | sin] table by position,
                                                       from packed cu_seqlens, or computed in the
                                                       kernel from positions x inverse frequencies
    rotate_with_angles(q, k, cos, sin, ...)           angles given per token (Hugging Face style)
    rotate_angles(...)                                 the same for ropekit.hf: HF's (B, H, S, D)
                                                       layout and HF's unsliced cos / sin tables

Every op goes the one call path (ropekit.core.pipeline): its arguments by name -> `prepare`, the
memoized spec of their signature (validated once by the op's entry in ropekit.core.checks, whose
`Variant` is the record of every flag) -> this call's checks (checks.rope_call) -> the door the
spec names (dispatch.ROTATE: direct, autograd Function, custom op); once a direct spec has its
launch record (dispatch.ROTATE's RECORD entry), its calls take that right after prepare, and a call
the record declines goes the rest of the way. What is written here is each op's own part: its
keywords, the angle operands it hands the run, and the rotation's views (layouts, rotated part
last).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..core import checks, forms, run, strict
from ..core.args import fail
from ..core.dispatch import ROTATE
from ..core.pipeline import prepare
from ..core.run import angle_views, saturate, scale_tensor
from ..core.variant import CUSTOM_OP, DIRECT, RECORD, TRACED, Signature, Spec

Scale = Union[None, float, torch.Tensor]


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
    mrope_layout: Union[None, str, Sequence[int]] = None,
    inplace: bool = False,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
    l2_norm: bool = False,
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
    q_temperature: Optional[Sequence[float]] = None,
    eager_rounding: bool = False,
):
    """Rotate q and k by the angles of their positions.

    Args:
        q: (*T, Hq, Dq) fp16/bf16/fp32, *T = (T,) or (B, S); any strides. A last stride other
            than 1 is read through that stride by the kernel (in place: written back through it,
            no copy), and out of place the outputs of such a q are contiguous; a q with last stride 1
            gets outputs of its own layout when it is dense (torch.empty_like's rule), contiguous
            otherwise. With layout='bhsd': (B, Hq, S, Dq), Hugging Face's layout; with
            layout='sbhd': (S, B, Hq, Dq), Transformer Engine's (results come back in it).
        k: (*T, Hk, Dk) or None; Dk may differ from Dq; its own strides.
        positions: (*T) int32/int64; (N, *T) for M-RoPE; None means arange over the last token dim
            (over S with layout='sbhd', whose positions are (S, B)).
            Dims of size 1 broadcast over the token dims (HF's (1, S) position_ids; an expand view).
        cos_sin_cache: (max_position, rotary_dim) rows [cos | sin]; fp32 recommended, bf16/fp16 ok.
            HF's cos (rows [f, f]) is refused, checked once per table. Or a per-head table
            (max_position, Ht, rotary_dim), a [cos | sin] row per (position, head) (FoPE, whose
            rows are mixed per KV head: any values, not only unit pairs): head j of a tensor of H
            heads reads table head j // (H / Ht), so Ht = Hk rotates each KV head and its group of
            q heads alike, and Ht = Hq = Hk gives every head its own rows; Ht must divide Hq and
            Hk. Any strides. With a positions tensor, not with M-RoPE, cu_seqlens or a fused norm;
            every other keyword composes (docs/core.md, "Per-head tables"). E.g. q (T, 32, 128),
            k (T, 8, 128), positions (T,), table (max_position, 8, 128).
        interleaved: False rotates halves (i, i + rotary_dim/2) (Llama/NeoX); True rotates pairs
            (2i, 2i+1) (GPT-J, Llama 4, DeepSeek).
        rotary_dim: dims [0, rotary_dim) are rotated, the rest kept; must equal the cache width.
        mrope_section: M-RoPE: N >= 1 section sizes (rotary pairs per section, e.g. Qwen2-VL's
            (t, h, w)), summing to rotary_dim // 2; positions are then (N, *T), one row per section.
        mrope_interleaved: Qwen3-VL's interleaved frequency layout instead of chunks (the same as
            mrope_layout='interleaved').
        mrope_layout: which position row drives each rotary pair j < rotary_dim // 2. A preset:
            'chunked' (the default: sections in order), 'interleaved' (Qwen3-VL), 'ernie' (ERNIE
            4.5-VL, sections (h, w, t): h w h w ... t t t), 'bailing' (Bailing, sections (t, h, w),
            the same order), 'pangu' (openPangu's spread of the rows), or an explicit sequence
            of rotary_dim // 2 row indices in [0, N). Example, 4 rows: ``apply_rope(q, k, pos4,
            cache, mrope_section=(8, 8, 8, 8), mrope_layout="ernie")`` with pos4 (4, T) (pairs
            0, 3, 6, ... row 1, ..., the last 8 row 0); docs/vision.md lists each preset's order.
        inplace: write into q and k; otherwise return new tensors and leave the inputs untouched.
        q_norm_weight, k_norm_weight: RMSNorm of q / k before the rotation, in the same launch:
            (D,) normalizes each head, (H * D,) all heads of a token (OLMo 2); fp32/bf16/fp16.
            y = x * rsqrt(mean(x^2) + norm_eps) * (w + norm_weight_offset) over the whole head
            (the tail past rotary_dim too), in float32; offset 1.0 for Gemma's (1 + w). Gradients
            flow to the weights as well (docs/qknorm.md). Composes with every angle source,
            out_dtype and scales; not with inverse, nor in place while autograd records the call.
        l2_norm: True normalizes each head of q and k without a weight, y = x * rsqrt(mean(x^2) +
            norm_eps) over the whole head in float32: Llama 4's qk L2 norm (Llama4TextL2Norm, eps
            = config.rms_norm_eps), which Llama 4 applies after the rotation; the same values,
            since a rotation keeps a head's sum of squares (to a float32 table's precision: a bf16
            table's rows are unit to about 2^-8, docs/qknorm.md). Not with q_norm_weight / k_norm_weight;
            otherwise composes and is refused as the weighted norm is. Differentiable.
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
            None warns (ropekit.core.forms.LayoutWarning, once per call signature) when a 4-D q has
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
        q_temperature: None, or (floor_scale, attn_scale), floats with floor_scale > 0 and
            attn_scale >= 0: Llama 4's attention temperature tuning (Ministral 3's too). q's outputs
            (rotated dims and kept tail) are multiplied, in float32 before the output cast, by
            log(floor((position + 1) / floor_scale) + 1) * attn_scale + 1 of their token; k is not
            scaled. Differentiable (the backward scales the gradient alike). Table angles with a
            positions tensor only; not with inv_freq, cu_seqlens, M-RoPE, a fused norm, fp8
            outputs or scales, rotary_position other than 'first', nor q_nope / k_nope.
        eager_rounding: False (the default) rotates in float32 and rounds once, into the output.
            True rounds as eager PyTorch's ``q * cos + rotate_half(q) * sin`` does in q's dtype
            (Hugging Face's apply_rotary_pos_emb, vLLM's forward_native): cos and sin rounded to
            q's dtype, each product rounded, then the sum, so the rotated dims equal that
            expression bit for bit (a zero's sign aside) on angles that equal its cos / sin (e.g.
            a table of HF's float32 values); the backward rounds as eager autograd does (g * cos
            and g * sin, then their sum). For a serving or RL stack whose other side runs the
            eager expression. Any of q's dtypes (in float32: each product and the sum rounded
            apart, never one FMA); not with a fused norm. Later steps (q_temperature, fp8
            scales) act on the rounded rotation. Example: ``apply_rope(q, k, pos, cache,
            eager_rounding=True)`` with q (T, 32, 128) bf16, cache (P, 128) float32.

    Returns (q_out, k_out), k_out None when k is None. Math in float32, outputs in input dtypes.
    A position outside [0, max_position) gives NaN in that token's rotated dims (never an
    out-of-bounds read); under `ropekit.strict()` it raises ValueError before anything is written.
    Differentiable in q and k (the backward is the inverse rotation, by the same kernel), in
    place too (autograd's in-place rules: q and k are marked dirty; a leaf that requires grad
    cannot be rotated in place, as with any in-place torch op).
    """

    spec, door = prepare(
        _ROPE,
        (q, k, positions, cos_sin_cache),
        (
            interleaved,
            rotary_dim,
            mrope_section,
            mrope_interleaved,
            mrope_layout,
            inplace,
            q_norm_weight,
            k_norm_weight,
            norm_eps,
            norm_weight_offset,
            l2_norm,
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
            q_temperature,
            eager_rounding,
        ),
        checks.rope,
    )
    # a spec with a record is one without given outputs (pipeline._record; they are part of the
    # signature), so this call has none either
    if spec.record and not strict.mode.on and spec.table() is cos_sin_cache:
        done = ROTATE[RECORD](spec, q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight)
        if done is not None:  # the steady state's launch record; else the general path decides
            return done
    # (a, b), the angle operands of the run, for each angle source
    angles = spec.variant.angles
    if angles == "freqs":
        a, b = positions, inv_freq
    elif angles == "packed":
        a, b = cu_seqlens, cos_sin_cache
    else:
        a, b = positions, cos_sin_cache
        if a is not None and spec.variant.seq_first:  # (S, B) -> the kernel's (B, S)
            a = a.transpose(-1, -2)
        if spec.angle_shape is not None:  # positions with size-1 dims (HF's (1, S)): an expand view
            a = a.expand(spec.angle_shape)
    if door is not TRACED:
        checks.rope_call(
            spec, q, k, a, b, q_norm_weight, k_norm_weight, q_out, k_out, q_scale, k_scale, q_nope, k_nope, cp_size
        )
    scales = _scales(q.device, q_scale, k_scale) if spec.variant.scaled else None
    weights = (q_norm_weight, k_norm_weight)
    if spec.views:
        return _views(spec, door, q, k, a, b, weights, scales, q_out, k_out, (q_nope, k_nope))
    return ROTATE[door](spec, q, k, a, b, weights, scales, q_out, k_out)


_ROPE = Signature.of(apply_rope)


def _scales(device, *scales) -> tuple:
    """(q's, k's) float32 scale tensors of a scaled variant: floats become cached device tensors,
    None 1.0."""
    return tuple(scale_tensor(1.0 if s is None else s, device, unit=True) for s in scales)


def _seq(x):
    """(S, B, ...) <-> (B, S, ...) views (Transformer Engine's 'sbhd' and the kernel's 'bshd')."""
    return None if x is None else x.transpose(0, 1)


def _views(spec: Spec, door: str, q, k, a, b, weights, scales, q_out=None, k_out=None, parts=(None, None)):
    """apply_rope's views around its door, as the record says: 'sbhd' tensors as (B, S, H, D)
    views; with rope_last the door sees the head's last rotary_dim dims only; with nope_q / nope_k
    (parts: q_nope, k_nope) the outputs are whole heads, the door's rotation joined to the part.
    q or k with a last stride other than 1 is read where it lies (in place: written back through
    its strides); out of place its new output is contiguous (run.out_like; the autograd Function
    and the custom op allocate by the same rule). Results in the caller's layout."""
    v = spec.variant
    given = (q, k, q_out, k_out)
    if v.seq_first:
        q, k, q_out, k_out = map(_seq, (q, k, q_out, k_out))
        parts = tuple(map(_seq, parts))
    if v.rope_last or v.nope_q or v.nope_k:
        res = _kept_apart(spec, door, q, k, a, b, weights, scales, q_out, k_out, parts)
    else:
        if spec.strided and not spec.inplace and door is DIRECT:
            q_out = run.out_like(q, spec.out_dtype) if q_out is None else q_out
            k_out = run.out_like(k, spec.out_dtype) if k_out is None else k_out
        res = ROTATE[door](spec, q, k, a, b, weights, scales, q_out, k_out)
    if spec.inplace:
        return given[0], given[1]
    if v.seq_first:
        res = map(_seq, res)
    return tuple(g if g is not None else r for g, r in zip(given[2:], res))


def _kept_apart(spec: Spec, door: str, q, k, a, b, weights, scales, q_out, k_out, parts):
    """Heads whose unrotated dims the door does not see: rotary_position='last' (the door rotates
    views of the last rotary_dim dims of each head; the leading dims are kept) and the no-rope
    parts given apart (q_nope, k_nope: q / k are the rope parts, the outputs whole heads [rotated |
    nope], [nope | rotated] with 'last'). In place the door rotates the views; out of place the
    kept dims are copied once, with the outputs' scale and dtype, beside the door's rotation."""
    rot, last = spec.rot, spec.variant.rope_last
    split = [_split(x, p, rot, last) for x, p in zip((q, k), parts)]
    rope, kept_src, width = ([s[i] for s in split] for i in range(3))
    if spec.inplace:
        ROTATE[door](spec, rope[0], rope[1], a, b, weights, scales)
        return q, k
    kept = [None if c is None else _kept(spec, c, scales, i) for i, c in enumerate(kept_src)]
    if q_out is None and k_out is None and spec.door is not DIRECT:  # autograd or a subclass records it
        rotated = ROTATE[door](spec, rope[0], rope[1], a, b, weights, scales)
        return tuple(_joined(r, c, last) for r, c in zip(rotated, kept))
    outs, into = [], []
    for x, p, dst, c, n in zip((q, k), parts, (q_out, k_out), kept, width):
        if x is not None and dst is None:
            dst = _fresh(x, (*x.shape[:-1], x.shape[-1] + (0 if p is None else n)), spec.out_dtype)
        if c is not None:  # the kept dims at the front with 'last', after the rotated ones otherwise
            (dst[..., :n] if last else dst[..., dst.shape[-1] - n :]).copy_(c)
        outs.append(dst)
        into.append(None if dst is None or c is None else (dst[..., n:] if last else dst[..., : dst.shape[-1] - n]))
    dests = (i if c is not None else o for i, o, c in zip(into, outs, kept))
    ROTATE[door](spec, rope[0], rope[1], a, b, weights, scales, *dests)
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
    """A new output of `shape` for input x: run.out_like(x)'s layout rule when the head is x's own
    width, else contiguous (a head joined from two parts has no layout to follow)."""
    if tuple(shape) == tuple(x.shape):
        return run.out_like(x, dtype)
    return run.empty_like(x.new_empty(shape), dtype=dtype)


def _kept(spec: Spec, x, scales, i):
    """The dims a rotation keeps, as its outputs store them: scaled outputs divide by the scale and
    saturate (the kernel's rule for a tail), the cast happens in the copy."""
    if not spec.variant.scaled:
        return x
    dtype = spec.out_dtype or x.dtype
    return saturate(x.float() / scales[i], dtype).to(dtype)


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
    mrope_layout: Union[None, str, Sequence[int]] = None,
    layout: Optional[str] = None,
    rotary_dim: Optional[int] = None,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
    l2_norm: bool = False,
    inplace: bool = False,
    eager_rounding: bool = False,
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
    l2_norm: each head of q and k normalized without a weight, as apply_rope's (Llama 4).

    inplace: write into q and k (returned) instead of new tensors; under autograd as apply_rope's
    (not with a norm while autograd records the call).

    eager_rounding: as apply_rope's: rounded as eager ``q * cos + rotate_half(q) * sin`` in q's
    dtype, so with HF's own cos / sin (already in the model's dtype) the result equals HF's eager
    apply_rotary_pos_emb bit for bit. Example: ``rotate_with_angles(q, k, cos, sin,
    layout="bhsd", eager_rounding=True)`` with q (B, Hq, S, D), k (B, Hk, S, D), cos / sin (B, S, D)
    bf16 as HF's rotary module returns them.
    """
    op = "rotate_with_angles"
    if freqs_cis is not None or (cos is None and sin is None):
        cos, sin = _cis_parts(op, freqs_cis, cos, sin)
        if interleaved is None:
            interleaved = True
    hf = None if layout is None else forms.layout_arg(op, layout, q)
    return rotate_angles(
        q,
        k,
        cos,
        sin,
        interleaved=interleaved,
        out_interleaved=out_interleaved,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        mrope_layout=mrope_layout,
        heads_first=hf,
        rotary_dim=rotary_dim,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        norm_eps=norm_eps,
        norm_weight_offset=norm_weight_offset,
        l2_norm=l2_norm,
        inplace=inplace,
        eager_rounding=eager_rounding,
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
    mrope_layout=None,
    heads_first=False,
    columns=None,
    rotary_dim=None,
    q_norm_weight=None,
    k_norm_weight=None,
    norm_eps=1e-6,
    norm_weight_offset=0.0,
    l2_norm=False,
    inplace=False,
    eager_rounding=False,
):
    """rotate_with_angles with two more options, the seam ropekit.hf and ropekit.integrations.hf_qknorm call:

    heads_first: q and k are (B, H, S, D) (Hugging Face's layout, views of (B, S, H, D)
        projections); results come back in that layout, and no view is made per call. None:
        tokens first, not said by the caller (an ambiguous layout warns).
    columns: use the first `columns` columns of cos and sin (HF's tables hold [f, f]: pass them
        unsliced with columns = rotary_dim // 2); None: decided by rotary_dim, else by the values
        (`_angle_columns`).
    """
    spec, door = prepare(
        _ANGLES,
        (q, k, cos, sin),
        (
            interleaved,
            out_interleaved,
            mrope_section,
            mrope_interleaved,
            mrope_layout,
            heads_first,
            columns,
            rotary_dim,
            q_norm_weight,
            k_norm_weight,
            norm_eps,
            norm_weight_offset,
            l2_norm,
            inplace,
            eager_rounding,
        ),
        checks.angles,
    )
    if spec.record:
        done = ROTATE[RECORD](spec, q, k, cos, sin, q_norm_weight, k_norm_weight)
        if done is not None:  # the steady state's launch record; else the general path decides
            return done
    if spec.copy_angles or door is CUSTOM_OP or door is TRACED:
        cos, sin = angle_views(spec, cos, sin)  # as validation saw them (copied when it had to)
    if door is not TRACED:
        checks.angles_call(spec, q, k, cos, sin, q_norm_weight, k_norm_weight)
    return ROTATE[door](spec, q, k, cos, sin, (q_norm_weight, k_norm_weight), None)


_ANGLES = Signature.of(rotate_angles)
