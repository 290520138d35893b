"""The PyTorch path of every op and the pieces the doors share: a validated call's tensors on CPU
without Triton (ropekit.core.cpu), with the semantics of the kernels; the norm's backward run; the
store's operand record; output allocation (the norm's backward run: ropekit.core.pipeline).

    rotate_cpu / store_cpu / rerotate_cpu   the PyTorch paths of ropekit.core.pipeline's run steps
    norm_rotated                            a normed rotation on the PyTorch path (autograd records it)
    StoreOperands                           the tensors of one store run, by name
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import cpu
from .memo import lookup, remember
from .variant import NORM_UNIT, Spec, Variant

# Output allocation goes through one name so tests can poison fresh outputs (an unwritten element
# must fail a test, which memory that happens to be zero would hide).
empty_like = torch.empty_like


def heads_first(x, yes: bool):
    """(B, H, S, D) <-> (B, S, H, D) views: the Hugging Face layout and the kernel's."""
    return x.transpose(1, 2) if yes and x is not None else x


def out_like(x: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """A new rotation output for input x: `empty_like`'s layout when x's last dim has stride 1 (or
    one element), else contiguous, apply_rope's rule for a q or k of another last stride (the
    kernel reads x where it lies; an output of unit last stride is what attention reads and is
    written in vectors). The custom op's fake gives the same layout."""
    if x is None:
        return None
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        return empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    return empty_like(x, dtype=dtype)


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


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) clamped to an fp8 dtype's finite range in place (the kernels' rule); x otherwise."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        big = torch.finfo(dtype).max
        x.clamp_(-big, big)
    return x


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


# ---------------------------------------------------------------------------------------------
# the rotation


def into(outs, q_out, k_out):
    """Results computed as new tensors, copied into the destinations given (None: kept as they are)."""
    res = list(outs)
    for i, dst in enumerate((q_out, k_out)):
        if dst is not None and res[i] is not None:
            res[i] = dst.copy_(res[i])
    return res[0], res[1]


def rotate_cpu(spec: Spec, variant: Variant, q, k, q_out, k_out, a, b, scales=None) -> None:
    """The PyTorch path of ropekit.core.pipeline.run_rotate (its arguments), a normed variant
    excepted (`norm_rotated`): scaled outputs rotate into float32, then divide, saturate and cast."""
    if variant.scaled:
        wide = [None if x is None else torch.empty(x.shape, dtype=torch.float32, device=x.device) for x in (q, k)]
        _cpu_rotate(spec, variant.unscaled(), q, k, wide[0], wide[1], a, b)
        for w, out, scale in zip(wide, (q_out, k_out), (scales[0], scales[1] if scales[1] is not None else scales[0])):
            if w is not None:
                out.copy_(saturate(w.div_(scale), out.dtype))
        return
    if variant.q_temperature:  # q rotated into float32, times its tokens' factors, then cast
        wide = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        _cpu_rotate(spec, variant, q, k, wide, k_out, a, b)
        factor = q_temperature_factor(a, *spec.q_temperature)
        factor = factor[:, None, :, None] if variant.heads_first else factor[..., None, None]
        q_out.copy_(wide.mul_(factor))
        return
    _cpu_rotate(spec, variant, q, k, q_out, k_out, a, b)


def q_temperature_factor(positions, floor_scale: float, attn_scale: float):
    """Llama 4's attention temperature of each token, float32 (*T): log(floor((positions + 1) /
    floor_scale) + 1) * attn_scale + 1, as rope_kernel computes it with Q_TEMPERATURE."""
    p = (positions.long() + 1).float()
    return torch.log(torch.floor(p / floor_scale) + 1.0) * attn_scale + 1.0


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
    axis_map = variant.pair_rows()
    if variant.angles == "freqs":
        from .freqs import pair_positions

        angle = pair_positions(a, variant.sections, half).double() * b.double()
        return angle.cos().float(), angle.sin().float()
    if variant.angles == "tokens":
        cos, sin = a[..., :half], b[..., :half]
        if axis_map is not None:
            cos, sin = cpu.pick_sections(cos, sin, axis_map)
        return cos.broadcast_to((*token_shape, half)), sin.broadcast_to((*token_shape, half))
    if variant.angles == "packed":
        from .packed import packed_positions

        a = packed_positions("apply_rope", a, spec.packed[0], spec.packed[1], token_shape[0])
    return cpu.table_angles(b, a, token_shape, spec.rot, axis_map)


def unit_weight(w, mode: int, x):
    """The weight the PyTorch path normalizes x with: w, or ones for NORM_UNIT (l2_norm, whose
    kernels read no weight; norm_weight_offset is 0 then)."""
    return torch.ones(x.shape[-1], dtype=torch.float32, device=x.device) if mode == NORM_UNIT else w


def norm_rotated(spec: Spec, variant: Variant, q, k, a, b, weights, out_dtype=None, scales=None):
    """The CPU path of a normed variant: (q_out, k_out) as new tensors, built from differentiable
    torch ops (autograd through them is the CPU backward). Scaled outputs: divided, saturated, cast."""
    hf = variant.heads_first
    q_t, k_t = heads_first(q, hf), heads_first(k, hf)
    cos, sin = token_angles(spec, variant, a, b, tuple(q_t.shape[:-2]))
    if variant.inverse:
        sin = -sin
    outs = []
    weights = (unit_weight(weights[0], variant.norm_q, q_t), unit_weight(weights[1], variant.norm_k, k_t))
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


# ---------------------------------------------------------------------------------------------
# the fused store


class StoreOperands(NamedTuple):
    """The tensors of one store run, by name (None where absent): q is rotated in place unless
    q_out is given; a is the angle source (positions, cu_seqlens, or None for arange); ks, vs, qs
    float32 scale tensors; wq, wk the norm weights; qn, kn the heads' no-rope parts given apart."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: Optional[torch.Tensor]
    table: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    ks: Optional[torch.Tensor] = None
    vs: Optional[torch.Tensor] = None
    q_out: Optional[torch.Tensor] = None
    qs: Optional[torch.Tensor] = None
    wq: Optional[torch.Tensor] = None
    wk: Optional[torch.Tensor] = None
    qn: Optional[torch.Tensor] = None  # q's no-rope part given apart (with q_out), Variant.nope_q
    kn: Optional[torch.Tensor] = None  # k's likewise (the k cache rows' tails), Variant.nope_k
    kcs: Optional[torch.Tensor] = None  # NVFP4 caches (Variant.fp4): the k cache's block scales
    vcs: Optional[torch.Tensor] = None  # ... and the v cache's

    def whole(self, q: torch.Tensor, k: torch.Tensor) -> "StoreOperands":
        """These operands with whole heads q and k (their no-rope parts joined in)."""
        return self._replace(q=q, k=k, qn=None, kn=None)

    def into_rows(self, k_rows, v_rows, slot_mapping) -> "StoreOperands":
        """These operands storing into plain float rows (k_rows, v_rows at slot_mapping), unscaled."""
        return self._replace(
            k_cache=k_rows, v_cache=v_rows, slot_mapping=slot_mapping, ks=None, vs=None, kcs=None, vcs=None
        )


def store_cpu(spec: Spec, t: StoreOperands) -> None:
    """The PyTorch path of ropekit.core.pipeline.run_store (its arguments)."""
    v = spec.variant
    if v.fp4:
        _store_fp4_cpu(spec, t)
        return
    if v.nope_q or v.nope_k:
        _store_parts_cpu(spec, t)
        return
    a = t.a
    if v.angles == "packed":  # CPU: the positions the kernel derives, made here
        from .packed import packed_positions

        a = packed_positions("apply_rope_and_store", a, spec.packed[0], spec.packed[1], t.q.shape[0])
    cpu.store_rows(
        t.q,
        t.k,
        t.v,
        a,
        t.table,
        t.k_cache,
        t.v_cache,
        t.slot_mapping,
        interleaved=v.interleaved,
        rotary_dim=spec.rot,
        k_scale=t.ks,
        v_scale=t.vs,
        q_out=t.q_out,
        q_scale=t.qs,
        write_key=v.write_key,
        axis_map=v.pair_rows(),
        norm=(unit_weight(t.wq, v.norm_q, t.q), unit_weight(t.wk, v.norm_k, t.k), spec.norm_eps, spec.norm_offset)
        if v.normed
        else None,
        halves=v.rope_halves,
    )


def _store_fp4_cpu(spec: Spec, t: StoreOperands) -> None:
    """The CPU path of NVFP4 caches: the store into float32 rows of its own (token i to row i; a
    padding slot stays padding, a slot past the cache stays past it, so q is flagged alike), then
    each stored row quantized (cpu.nvfp4_rows) into the codes and block scales of its slot."""
    kc, vc = t.k_cache, t.v_cache
    block_size = kc.shape[1] if kc.dim() == 4 else 1
    num_slots = kc.shape[0] * block_size
    slots = t.slot_mapping.reshape(-1).long()
    n = slots.numel()
    rows = torch.where(slots < 0, -1, torch.where(slots >= num_slots, n, torch.arange(n)))
    kf = torch.empty((n, kc.shape[-2], 2 * kc.shape[-1]), dtype=torch.float32)
    vf = torch.empty((n, vc.shape[-2], 2 * vc.shape[-1]), dtype=torch.float32)
    plain = Spec(spec.variant.float_caches(), spec.rot, spec.door, spec.triton)
    plain.packed, plain.norm_eps, plain.norm_offset = spec.packed, spec.norm_eps, spec.norm_offset
    flat = rows.reshape(t.slot_mapping.shape)
    store_cpu(plain, t.into_rows(kf, vf, flat))
    keep = (slots >= 0) & (slots < num_slots)
    at = slots[keep]
    where = (at // block_size, at % block_size) if kc.dim() == 4 else (at,)
    for cache, scales, f, g in ((kc, t.kcs, kf, t.ks), (vc, t.vcs, vf, t.vs)):
        codes, sf = cpu.nvfp4_rows(f[keep], g)
        cache[where] = codes
        scales[where] = sf


def _store_parts_cpu(spec: Spec, t: StoreOperands) -> None:
    """The CPU path of heads given in two parts (q_nope, k_nope): the run on whole heads (rope
    part, then no-rope part: torch.cat, a copy), rotated k written back into k's own dims with
    write_key (a head in two parts is never normalized)."""
    whole_q = t.q if t.qn is None else torch.cat((t.q, t.qn), -1)
    whole_k = t.k if t.kn is None else torch.cat((t.k, t.kn), -1)
    plain = Spec(spec.variant.whole_heads(), spec.rot, spec.door, spec.triton)
    plain.packed, plain.norm_eps, plain.norm_offset = spec.packed, spec.norm_eps, spec.norm_offset
    store_cpu(plain, t.whole(whole_q, whole_k))
    if spec.variant.write_key and whole_k is not t.k:
        t.k.copy_(whole_k[..., : t.k.shape[-1]])


# ---------------------------------------------------------------------------------------------
# the re-rotation


def rerotate_cpu(spec: Spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table) -> None:
    """The PyTorch path of ropekit.core.pipeline.run_rerotate (its arguments)."""
    if slots.shape[0]:
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
            positions=positions,
            to_table=to_table,
        )
