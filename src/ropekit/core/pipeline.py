"""One call pipeline for every op: signature -> spec -> one of three doors -> the run step.

    signature  the call's tensors as (type, shape, strides, dtype, device, requires_grad) and its
               other arguments with their types, plus grad mode: a hashable key (memo.py). Types
               are part of it, so `rotary_dim=16.0` never reuses the verdict on `rotary_dim=16`.
    spec       what validation concluded about that signature (a `Variant`: the frozen record of
               every flag a kernel or the CPU path branches on; the rotary width; which door; the
               norm's eps and offset), and the launch plans once made, in the one bounded memo.
    doors      torch.compile and tensor subclasses (DTensor) -> the torch.library custom ops
               (library.py, store.py, each with its fake); eager with grad -> `RotateFunction`;
               eager without grad -> a direct run.
    run        `run_rotate` (store.py's `run` for the fused store): the Triton launch (CUDA tensors,
               or CPU tensors under TRITON_INTERPRET=1) or ropekit.core.cpu's PyTorch ops on CPU
               tensors. The backward of every door is the same run with `Variant.backward()` (the
               inverse rotation), or with a norm `run_norm_backward` (the norm's backward kernel).

Adding a variant flag: a field of `Variant` with a bool or int default (`encode` / `decode` follow
the fields: nothing to edit there), its kernel constexpr in launcher.plan_rotate, its check in
validate.py, its branch in the kernel, in cpu.py and in the oracle reference.py, and its keyword
on the public op (ops.py). A new angle source also needs its entries in ANGLE_SOURCES and
ANGLE_NAMES and its operands' roles in sharding.py.
"""

from __future__ import annotations

import os
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import cpu, launcher
from .launcher import NORM_HEAD, NORM_NONE, NORM_TOKEN  # noqa: F401  (Variant.norm_q / norm_k's values)
from .memo import clear, lookup, remember, tensor_key, value_key  # noqa: F401  (this module's seam for ops)

# Output allocation goes through one name so tests can poison fresh outputs (an unwritten element
# must fail a test, which memory that happens to be zero would hide).
empty_like = torch.empty_like

MROPE_CHUNKED, MROPE_INTERLEAVED = 1, 2
# where the angles come from (Variant.angles); the index is the custom ops' code for each
ANGLE_SOURCES = ("table", "arange", "packed", "tokens", "freqs", "delta")
# what each angle source's operands (a, b) are called in errors and in the sharding rules
ANGLE_NAMES = {
    "table": ("positions", "cos_sin_cache"),
    "arange": ("positions", "cos_sin_cache"),
    "packed": ("cu_seqlens", "cos_sin_cache"),
    "tokens": ("cos", "sin"),
    "freqs": ("positions", "inv_freq"),
}
DIRECT, FUNCTION, CUSTOM_OP = "direct", "function", "custom_op"


class Variant(NamedTuple):
    """The compile-time description of one rotation: every flag the kernels and the CPU path
    branch on. Frozen and hashable: plans are keyed by it."""

    interleaved: bool = False  # input pairs are (2i, 2i+1); False: halves (i, i + rotary_dim/2)
    out_interleaved: bool = False  # layout the rotated pairs are written in (DeepSeek-V3's HF code differs)
    mrope: int = 0  # 0 none, MROPE_CHUNKED (Qwen2-VL), MROPE_INTERLEAVED (Qwen3-VL)
    sections: Tuple[int, ...] = (0, 0, 0)  # M-RoPE (t, h, w) frequencies per position row;
    #                                        "freqs": the pairs of each axis, () for one position row
    angles: str = "table"  # "table": rows of a [cos | sin] table picked by positions;
    #                                 "freqs": positions x inverse frequencies, computed in the kernel;
    #                                 "arange": row s for token (b, s); "tokens": per-token cos / sin;
    #                                 "delta": row |delta| per cache row, sin negated for delta < 0;
    #                                 "packed": table rows at positions derived from cu_seqlens
    inverse: bool = False  # rotate by -angle: the backward pass, or a de-rotation (apply_rope(inverse=True))
    heads_first: bool = False  # q, k (and their gradients) are (B, H, S, D) views (Hugging Face)
    scaled: bool = False  # outputs divided by a per-tensor scale, saturated to an fp8 output's range
    norm_q: int = 0  # RMSNorm of q before the rotation: NORM_NONE, NORM_HEAD ((D,) weight), NORM_TOKEN ((H*D,))
    norm_k: int = 0  # RMSNorm of k likewise
    seq_first: bool = False  # q, k (and given outputs) are (S, B, H, D) (Transformer Engine's 'sbhd'):
    #                          ops.py hands the run (B, S, H, D) views, transpose(0, 1)
    rope_last: bool = False  # the rotated dims are the last rotary_dim of the head ([nope | rope],
    #                          DeepSeek): ops.py hands the run views of that part, the rest is copied
    rope_halves: bool = False  # half-split pairs (i, i + D/2), i < rotary_dim / 2, of the whole head
    #                            (rotary_position='halves', Gemma 4's p-RoPE): the kernels' GAP is D/2
    #                            and the kept dims are [rotary_dim/2, D/2) and [D/2 + rotary_dim/2, D)
    nope_q: bool = False  # q is the rope part of the head and q_nope, a tensor of its own, the rest
    #                       (FlashInfer's q_rope / q_nope): the store's kernel reads q_out's dims past
    #                       the rotated ones from it; apply_rope's output joins it (ops.py, a view form)
    nope_k: bool = False  # k likewise with k_nope: the store's k cache row (beside v, GQA / MHA), or
    #                       apply_rope's k output

    def encode(self) -> List[int]:
        """The custom ops' encoding of this record (one int list: a schema cannot take a NamedTuple):
        every field as an int in field order, the angle source by its index in ANGLE_SOURCES, then
        the sections. The view flags (heads_first, seq_first, rope_last) are left out: the ops take
        tokens-first views of the rotated part. A new field needs no edit here."""
        return [_code(f, getattr(self, f)) for f in _CODED] + list(self.sections)

    @staticmethod
    def decode(codes: Sequence[int]) -> "Variant":
        """The record `encode` made (tokens first)."""
        n = len(_CODED)
        fields = {f: _field(f, c) for f, c in zip(_CODED, codes[:n])}
        return Variant(sections=tuple(codes[n:]), **fields)

    @property
    def normed(self) -> bool:
        """Is q or k normalized before the rotation?"""
        return self.norm_q != 0 or self.norm_k != 0

    def tokens_first(self) -> "Variant":
        """This variant for the views the rotation's custom ops take: tokens first, the rotated part
        alone (apply_rope's no-rope parts given apart are joined to it in ops.py)."""
        return self._replace(heads_first=False, seq_first=False, rope_last=False, nope_q=False, nope_k=False)

    def with_scaled(self, scaled: bool) -> "Variant":
        """This variant with its outputs scaled (fp8) or not."""
        return self._replace(scaled=scaled)

    def backward(self) -> "Variant":
        """The rotation that maps output gradients to input gradients: the inverse, reading the
        output layout and writing the input layout."""
        return self._replace(
            interleaved=self.out_interleaved, out_interleaved=self.interleaved, inverse=not self.inverse
        )


# Variant's fields in its custom-op encoding, and each field's value <-> int
_CODED = tuple(f for f in Variant._fields if f not in ("sections", "heads_first", "seq_first", "rope_last"))


def _code(field: str, value) -> int:
    return ANGLE_SOURCES.index(value) if field == "angles" else int(value)


def _field(field: str, code: int):
    if field == "angles":
        return ANGLE_SOURCES[code]
    return type(Variant._field_defaults[field])(code)


class Spec:
    """What validation concluded about one call signature, and its plans once made."""

    __slots__ = (
        "variant",
        "rot",
        "door",
        "triton",
        "extents",
        "angle_shape",
        "angle_strides",
        "copy_angles",
        "packed",
        "plans",
        "alias",
        "inplace",
        "out_dtype",
        "twin",
        "halves",
        "table",
        "norm_eps",
        "norm_offset",
        "copy_in",
    )

    def __init__(
        self,
        variant: Variant,
        rot: int,
        door: str,
        triton: bool,
        *,
        extents=(),
        angle_shape=None,
        angle_strides=None,
        copy_angles=False,
        packed=(1, 0),
        inplace=False,
        out_dtype=None,
        norm_eps=0.0,
        norm_offset=0.0,
        copy_in=False,
    ):
        self.variant = variant
        self.rot = rot  # rotated dims
        self.door = door
        self.triton = triton  # the Triton kernel runs (CUDA, or the interpreter on CPU)
        self.extents = extents  # bytes spanned by the call's tensors (cheap overlap tests)
        self.angle_shape = angle_shape  # per-token angles: the shape cos / sin broadcast to;
        #                                 table angles: the shape positions expand to (None: as given)
        self.angle_strides = angle_strides  # per-token angles: the kernel's (sec, b, s, col) strides
        self.copy_angles = copy_angles  # per-token angles whose strides differ: copied per call
        self.packed = packed  # packed angles: (cp_size, cp_rank)
        self.plans: dict = {}  # launch plans by (variant, output / gradient layouts)
        self.alias: dict = {}  # the store's aliasing verdicts by byte distance
        self.table = None  # a weak reference to the last [cos | sin] table whose values were read
        self.inplace = inplace  # the rotation writes into q and k (autograd: marked dirty)
        self.out_dtype = out_dtype  # dtype of fresh outputs (None: the input's)
        self.twin = None  # an in-place spec's out-of-place twin (its backward writes fresh tensors)
        self.halves = None  # specs for q alone and k alone (in-place views under autograd)
        self.norm_eps = norm_eps  # with variant.normed: RMSNorm's epsilon
        self.norm_offset = norm_offset  # ... and the offset added to its weights (Gemma's 1.0)
        self.copy_in = copy_in  # q or k has a last stride other than 1: read through a contiguous copy

    def _copy(self, inplace: bool) -> "Spec":
        return Spec(
            self.variant,
            self.rot,
            self.door,
            self.triton,
            extents=self.extents,
            angle_shape=self.angle_shape,
            angle_strides=self.angle_strides,
            copy_angles=self.copy_angles,
            packed=self.packed,
            inplace=inplace,
            out_dtype=self.out_dtype,
            norm_eps=self.norm_eps,
            norm_offset=self.norm_offset,
        )

    def out_of_place(self) -> "Spec":
        """This spec, or for an in-place one its out-of-place twin (made once)."""
        if not self.inplace:
            return self
        if self.twin is None:
            self.twin = self._copy(False)
        return self.twin

    def split(self) -> tuple:
        """Two specs like this one, for q alone and for k alone (each keeps its own launch plans)."""
        if self.halves is None:
            self.halves = (self._copy(self.inplace), self._copy(self.inplace))
        return self.halves


def triton_runs(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def door_for(q, grad: bool) -> str:
    """Eager calls: subclasses (DTensor, ...) and meta tensors go through the dispatcher (the custom
    ops' fakes give meta outputs their shapes and dtypes: a model built on meta runs for shapes),
    grad through autograd."""
    if type(q) is not torch.Tensor or q.device.type == "meta":
        return CUSTOM_OP
    return FUNCTION if grad else DIRECT


def records_grad(*xs) -> bool:
    """Will autograd record this call? (arguments that are not tensors: no; validation names them)"""
    return torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) is True for x in xs)


# ---------------------------------------------------------------------------------------------
# the run step


def heads_first(x, yes: bool):
    """(B, H, S, D) <-> (B, S, H, D) views: the Hugging Face layout and the kernel's."""
    return x.transpose(1, 2) if yes and x is not None else x


def run_rotate(
    spec: Spec, variant: Variant, q, k, q_out, k_out, a, b, layout_key=None, scales=None, weights=None
) -> None:
    """q -> q_out and k -> k_out (outputs may be the inputs: in place), rotated as `variant` says.

    (a, b): (positions or None, [cos | sin] table) for table / arange angles, (cos, sin) for
    per-token angles. layout_key: None when the outputs' layout follows from the spec's signature
    (forward calls), else a key of the tensors' layouts (gradients). With variant.heads_first the
    tensors are Hugging Face's (B, H, S, D) views; a launch needs only their addresses.
    scales: with variant.scaled, (q's, k's) float32 scalar tensors the outputs are divided by.
    weights: with variant.normed, (q's, k's) RMSNorm weights (None where that tensor is not
    normalized); eps and offset are the spec's. The CPU path of a normed variant is `norm_rotated`.
    """
    if spec.triton:
        key = (variant, layout_key)
        plan = spec.plans.get(key)
        if plan is None:
            hf = variant.heads_first
            plan = spec.plans[key] = launcher.plan_rotate(
                heads_first(q, hf),
                heads_first(k, hf),
                heads_first(q_out, hf),
                heads_first(k_out, hf),
                launcher.angle_layout(variant, spec.rot, a, b, spec.angle_strides, spec.packed),
                variant,
            )
        if plan is not None:
            norm = None if weights is None else (*weights, spec.norm_eps, spec.norm_offset)
            launcher.fire_rotate(plan, q, k, q_out, k_out, a, b, scales, norm)
        return
    if variant.scaled:
        _cpu_rotate_scaled(spec, variant, q, k, q_out, k_out, a, b, scales)
        return
    _cpu_rotate(spec, variant, q, k, q_out, k_out, a, b)


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) clamped to an fp8 dtype's finite range in place (the kernels' rule); x otherwise."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        big = torch.finfo(dtype).max
        x.clamp_(-big, big)
    return x


def _cpu_rotate_scaled(spec: Spec, variant: Variant, q, k, q_out, k_out, a, b, scales) -> None:
    """Scaled outputs on the CPU path: rotate into float32, divide by the scale, saturate, cast."""
    wide = [None if x is None else torch.empty(x.shape, dtype=torch.float32, device=x.device) for x in (q, k)]
    _cpu_rotate(spec, variant.with_scaled(False), q, k, wide[0], wide[1], a, b)
    for w, out, scale in zip(wide, (q_out, k_out), (scales[0], scales[1] if scales[1] is not None else scales[0])):
        if w is not None:
            out.copy_(saturate(w.div_(scale), out.dtype))


def _cpu_rotate(spec: Spec, variant: Variant, q, k, q_out, k_out, a, b) -> None:
    """CPU tensors without Triton: ropekit.core.cpu (per-token angles as given: it broadcasts them),
    with packed positions derived here, and angles from positions x inverse frequencies made here."""
    table = variant.angles != "tokens"
    if variant.angles == "packed":  # a: cu_seqlens
        from .packed import packed_positions

        a = packed_positions("apply_rope", a, spec.packed[0], spec.packed[1], q.shape[0])
    elif variant.angles == "freqs":  # a: positions, b: inverse frequencies
        a, b = cpu.freqs_angles(a, b, variant.sections)
        table = False
    cpu.rope(q, k, q_out, k_out, a, b, rot=spec.rot, table=table, variant=variant)


def token_angles(spec: Spec, variant: Variant, a, b, token_shape):
    """Per-token cos and sin (*T, rot // 2) of any angle source, by torch ops (the CPU path of a
    normed variant; differentiable in inverse frequencies that require grad)."""
    half = spec.rot // 2
    sections = variant.sections if variant.mrope else None
    il_sections = variant.mrope == MROPE_INTERLEAVED
    if variant.angles == "freqs":
        from .freqs import pair_positions

        angle = pair_positions(a, variant.sections, half).double() * b.double()
        return angle.cos().float(), angle.sin().float()
    if variant.angles == "tokens":
        cos, sin = a[..., :half], b[..., :half]
        if sections is not None:
            cos, sin = cpu.pick_sections(cos, sin, sections, il_sections)
        return cos.broadcast_to((*token_shape, half)), sin.broadcast_to((*token_shape, half))
    if variant.angles == "packed":
        from .packed import packed_positions

        a = packed_positions("apply_rope", a, spec.packed[0], spec.packed[1], token_shape[0])
    return cpu.table_angles(b, a, token_shape, spec.rot, sections, il_sections)


def norm_rotated(spec: Spec, variant: Variant, q, k, a, b, weights, out_dtype=None, scales=None):
    """The CPU path of a normed variant: (q_out, k_out) as new tensors, built from differentiable
    torch ops (autograd through them is the CPU backward). Scaled outputs: divided, saturated, cast."""
    hf = variant.heads_first
    q_t, k_t = heads_first(q, hf), heads_first(k, hf)
    cos, sin = token_angles(spec, variant, a, b, tuple(q_t.shape[:-2]))
    if variant.inverse:
        sin = -sin
    outs = []
    for i, (x, w) in enumerate(zip((q_t, k_t), weights)):
        if x is None:
            outs.append(None)
            continue
        dtype = out_dtype or x.dtype
        y = cpu.norm_rotate(
            x,
            w,
            cos,
            sin,
            interleaved=variant.interleaved,
            eps=spec.norm_eps,
            offset=spec.norm_offset,
            out_dtype=torch.float32 if variant.scaled else dtype,
            halves=variant.rope_halves,
        )
        if variant.scaled:
            y = saturate(y / scales[i if scales[i] is not None else 0], dtype).to(dtype)
        outs.append(heads_first(y, hf))
    return outs[0], outs[1]


def norm_backward_cpu(spec: Spec, variant: Variant, x, g, w, a, b):
    """run_norm_backward's CPU path (tokens-first x and g): cpu.norm_rotate_backward with the
    variant's per-token angles."""
    cos, sin = token_angles(spec, variant, a, b, tuple(x.shape[:-2]))
    if variant.inverse:
        sin = -sin
    return cpu.norm_rotate_backward(
        x,
        g,
        w,
        cos,
        sin,
        interleaved=variant.interleaved,
        eps=spec.norm_eps,
        offset=spec.norm_offset,
        halves=variant.rope_halves,
    )


def run_norm_backward(spec: Spec, variant: Variant, x, g, w, mode: int, a, b):
    """(gradient of x, of w) for one tensor of a normed variant (mode: its NORM_* mode) given its
    output gradient g: rope_norm_backward_kernel (the CPU path's gradients come from autograd)."""
    hf = variant.heads_first
    g = unit_last_stride(g)
    gx = empty_like(x)
    key = ("norm backward", mode, x.shape, x.stride(), g.stride(), None if w is None else w.stride())
    plan = spec.plans.get(key)
    if plan is None:
        plan = spec.plans[key] = launcher.plan_norm_backward(
            heads_first(x, hf),
            heads_first(g, hf),
            heads_first(gx, hf),
            w,
            launcher.angle_layout(variant, spec.rot, a, b, spec.angle_strides, spec.packed),
            variant,
            mode,
        )
    if plan is None:  # no tokens
        return gx.zero_(), (None if w is None else torch.zeros_like(w))
    dw = None if w is None else launcher.norm_partials(plan, x.device)
    launcher.fire_norm_backward(plan, x, g, gx, w, dw, a, b, spec.norm_eps, spec.norm_offset)
    return gx, (None if w is None else dw.sum(0).to(w.dtype))


def angle_views(spec: Spec, cos, sin):
    """Per-token cos and sin as validation saw them: broadcast to the token shape (only the first
    rot // 2 columns), copied when their strides differ (the kernel reads both through one set)."""
    half = spec.rot // 2
    if cos.shape[-1] != half:
        cos, sin = cos[..., :half], sin[..., :half]
    cos, sin = cos.broadcast_to(spec.angle_shape), sin.broadcast_to(spec.angle_shape)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def unit_last_stride(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x itself when its last dim has stride 1 (what the kernel addresses), else a contiguous copy.

    The public ops validate their inputs, but a backward gets whatever autograd produces: the
    gradient w.r.t. k of `q @ k.transpose(-1, -2)` has a transposed layout, and the gradient of
    `out.sum()` is an expanded tensor whose strides are all 0. Copying is what autograd requires
    then; gradients that already have a unit last stride are used as they are (no copy).
    """
    if x is None or x.shape[-1] <= 1 or x.stride(-1) == 1:
        return x
    return x.contiguous()


def run_rerotate(spec: Spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots) -> None:
    """Re-rotation's run step: rows of k_cache by the angle of delta (a tensor, or the int delta_int)."""
    if spec.triton:
        plan = spec.plans.get(None)
        if plan is None:
            plan = spec.plans[None] = launcher.plan_rerotate(
                k_cache, slots, delta, table, dst_slots, spec.variant, spec.rot, k_scale is not None
            )
        launcher.fire_rerotate(plan, k_cache, slots, delta, delta_int, table, dst_slots, k_scale)
    elif slots.shape[0]:
        cpu.rerotate_rows(
            k_cache,
            slots,
            delta if delta is not None else delta_int,
            table,
            interleaved=spec.variant.interleaved,
            rotary_dim=spec.rot,
            k_scale=k_scale,
            dst_slots=dst_slots,
            halves=spec.variant.rope_halves,
        )


# Float scales become 1-element device tensors, read inside the kernel like a tensor scale. Eager
# calls reuse one tensor per (value, device), so steady state costs no launch or copy; during CUDA
# graph capture (or under torch.compile) a fresh one is filled by a kernel that the graph records.
def scale_tensor(scale, device: torch.device, unit: bool = False) -> Optional[torch.Tensor]:
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    if scale == 1.0 and not unit:
        return None  # x / 1 == x: skip the division
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.full((1,), scale, dtype=torch.float32, device=device)
    key = ("scale tensor", type(scale), scale, str(device))
    t = lookup(key)
    if t is None:
        t = remember(key, torch.full((1,), scale, dtype=torch.float32, device=device))
    return t


# ---------------------------------------------------------------------------------------------
# the eager autograd door


def _zeros(meta):
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def grad_operands(metas, needs, gq, gk):
    """(want_q, want_k, first, second): the output gradients to rotate back, those of the inputs
    that need one only, with a unit last stride (k alone goes in q's slot); None for an unused
    output is zeros."""
    q_meta, k_meta = metas
    want_q = needs[0]
    want_k = k_meta is not None and needs[1]
    gq = unit_last_stride(gq if gq is not None else _zeros(q_meta)) if want_q else None
    gk = unit_last_stride(gk if gk is not None else _zeros(k_meta)) if want_k else None
    first, second = (gq, gk) if want_q else (gk, None)
    return want_q, want_k, first, second


def input_grads(want_q, want_k, d_first, d_second):
    """The inverse of grad_operands' packing: (grad of q, grad of k)."""
    grad_q = d_first if want_q else None
    grad_k = (d_second if want_q else d_first) if want_k else None
    return grad_q, grad_k


class RotateFunction(torch.autograd.Function):
    """The eager autograd door of every rotation: forward runs the spec's variant, backward the
    same run step with the inverse variant (itself through this Function when a graph of the
    backward is being built: double backward), or for a normed variant the norm's backward kernel
    per tensor. Inverse frequencies that require grad get theirs from the outputs (freq_grad).
    Few arguments: each costs host time in apply."""

    @staticmethod
    def forward(ctx, q, k, a, b, wq, wk, spec, variant):
        ctx.spec, ctx.variant = spec.out_of_place(), variant
        ctx.metas = ((q.shape, q.dtype, q.device), None if k is None else (k.shape, k.dtype, k.device))
        weights = None if not variant.normed else (wq, wk)
        if spec.inplace:
            # autograd's in-place rules: q and k are marked dirty (their version counters move; a
            # leaf that requires grad is refused by autograd itself, views are rebased on their base)
            ctx.save_for_backward(a, b)  # autograd's version check covers the angles
            run_rotate(spec, variant, q, k, q, k, a, b)
            ctx.mark_dirty(*(x for x in (q, k) if x is not None))
            return q, k
        q_out = empty_like(q)
        k_out = None if k is None else empty_like(k)
        run_rotate(spec, variant, q, k, q_out, k_out, a, b, weights=weights)
        keep_outs = variant.angles == "freqs" and ctx.needs_input_grad[3]
        saved = (q, k, wq, wk) if variant.normed else ()
        ctx.save_for_backward(a, b, *saved, *((q_out, k_out) if keep_outs else ()))
        return q_out, k_out

    @staticmethod
    def backward(ctx, gq, gk):
        a, b, *saved = ctx.saved_tensors
        variant = ctx.variant
        needs = ctx.needs_input_grad
        d_b = None
        if variant.angles == "freqs" and needs[3]:
            from .freqs import freq_grad

            d_b = freq_grad(saved[-2:], (gq, gk), a, ctx.spec.rot // 2, variant)
        if variant.normed:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "apply_rope: q_norm_weight / k_norm_weight: expected a backward without create_graph=True "
                    "(the norm's backward is not itself differentiable), got create_graph=True"
                )
            spec = ctx.spec

            def backward_one(x, g, w, mode):
                return run_norm_backward(spec, variant, x, g, w, mode, a, b)

            dq, dk, dwq, dwk = norm_grads(variant, needs, saved[:4], gq, gk, backward_one)
            return dq, dk, None, d_b, dwq, dwk, None, None
        want_q, want_k, first, second = grad_operands(ctx.metas, needs, gq, gk)
        if first is None:
            return None, None, None, d_b, None, None, None, None
        inverse = variant.backward()
        if torch.is_grad_enabled():  # create_graph=True: the backward is differentiable too
            d_first, d_second = RotateFunction.apply(first, second, a, b, None, None, ctx.spec, inverse)
        else:
            d_first = empty_like(first)
            d_second = None if second is None else empty_like(second)
            layout = (want_q, first.shape, first.stride(), None if second is None else second.stride())
            run_rotate(ctx.spec, inverse, first, second, d_first, d_second, a, b, layout)
        return (*input_grads(want_q, want_k, d_first, d_second), None, d_b, None, None, None, None)


def norm_grads(variant: Variant, needs, saved, gq, gk, backward_one) -> tuple:
    """(dq, dk, dwq, dwk) of a normed variant: one backward per tensor that needs a gradient for
    itself or its weight. needs: needs_input_grad of RotateFunction or of the rotate custom op
    (both take q, k, a, b, wq, wk first); saved: (q, k, wq, wk) as the forward got them;
    backward_one(x, g, w, mode) -> (gx, dw): run_norm_backward, or the custom op that runs it."""
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
