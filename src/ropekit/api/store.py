"""Fused RoPE + KV-cache store: `apply_rope_and_store`, one launch of `rope_store_kernel`.

    apply_rope_and_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ...)

Serving engines rotate q and k, then write k and v into the KV cache: two or three launches and a
round trip of k through memory. Here one kernel rotates q in place and writes rotated k and v
straight into the cache rows `slot_mapping` names. The call goes through ropekit.core.pipeline like the
rotation ops (signature -> memoized spec -> door -> run): every keyword (QK-RMSNorm weights, packed
sequences, M-RoPE, fp8 caches, q_out, write_key) is a field of the spec's Variant or of its launch
plan, not a second pipeline. CPU tensors without TRITON_INTERPRET=1 run ropekit.core.cpu with the same
semantics.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from ..core import cpu, launcher, memo, pipeline, validate
from ..core.pipeline import CUSTOM_OP, DIRECT, MROPE_CHUNKED, MROPE_INTERLEAVED, Spec, Variant, tensor_key, value_key
from ..core.sharding import dtensor_like

OP = "apply_rope_and_store"

Scale = Union[None, float, torch.Tensor]
_MEMO = memo.MEMO  # read here without a function call per op call
NORM_EPS, NORM_OFFSET = 1e-6, 0.0  # the norm's defaults (the public op's and the custom ops')
_CP_SIZE, _CP_RANK = 1, 0  # no context parallelism
_FIRST = "first"  # rotary_position's default


def checks(
    spec,
    q,
    k,
    v,
    a,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    k_scale,
    v_scale,
    q_out,
    q_scale,
    write_key,
    norm,
    parts=(None, None),
) -> None:
    """The checks that need real tensors (addresses; data in strict mode), before any write.
    a: the angle source (positions, cu_seqlens with packed angles, or None); norm: None or
    (q's weight, k's weight, eps, offset); parts: (q_nope, k_nope), the heads' no-rope parts given
    apart (read only; None where not given)."""
    q_nope, k_nope = parts
    if validate.is_strict():
        strict_checks(spec, q, a, cos_sin_cache, k_cache, slot_mapping, (k_scale, v_scale, q_scale))
    # the address checks' verdict depends on the addresses alone (the spec fixes every layout):
    # a decode loop that passes the same buffers again (a static cache, reused activations) pays
    # for the addresses and one compare
    weights = (None, None) if norm is None else norm[:2]
    tensors = (q, k, v, a, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale, q_out, q_scale, *weights)
    tensors += (q_nope, k_nope)
    addrs = tuple(0 if x is None else x.data_ptr() for x in tensors)
    if spec.plans.get("checked addresses") == (addrs, write_key):
        return
    ext = spec.extents
    validate.store_aliasing(
        OP, q, k, v, k_cache, v_cache, extents=ext, memo=spec.alias, q_out=q_out, write_key=write_key
    )
    packed = spec.variant.angles == "packed"
    # written (q's place taken by q_out when given; k with write_key) against the read-only inputs
    written = [("q", q) if q_out is None else ("q_out", q_out), ("k_cache", k_cache), ("v_cache", v_cache)]
    read = [
        ("cu_seqlens" if packed else "positions", a),
        ("cos_sin_cache", cos_sin_cache),
        ("slot_mapping", slot_mapping),
        ("k_scale", k_scale),
        ("v_scale", v_scale),
    ]
    # scales: one float32
    extents = [ext[0] if q_out is None else ext[8], ext[1], ext[2]]
    tail = [ext[5], ext[6], ext[7], 0 if k_scale is None else 4, 0 if v_scale is None else 4]
    if write_key:
        written.append(("k", k))
        extents.append(ext[3])
    if q_scale is not None:
        read.append(("q_scale", q_scale))
        tail.append(4)
    if norm is not None:
        read += [("q_norm_weight", norm[0]), ("k_norm_weight", norm[1])]
        tail += [ext[9], ext[10]]
    if q_nope is not None or k_nope is not None:
        read += [("q_nope", q_nope), ("k_nope", k_nope)]
        tail += [ext[11], ext[12]]
    validate.written_vs_read(OP, written, read, extents=extents + tail)
    spec.plans["checked addresses"] = (addrs, write_key)


def strict_checks(spec, q, a, cos_sin_cache, k_cache, slot_mapping, scales) -> None:
    """Strict mode: the data of positions (or cu_seqlens), slots and tensor scales (device syncs)."""
    if spec.variant.angles == "packed":
        validate.packed_values(OP, a, q.shape[0], spec.packed[0])
    elif a is not None:
        validate.positions_in_range(OP, a, cos_sin_cache.shape[0])
    num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
    validate.slots_in_range(OP, slot_mapping, num_slots)
    validate.slots_unique(OP, slot_mapping)
    for name, scale in zip(("k_scale", "v_scale", "q_scale"), scales):
        if scale is not None:
            validate.scale_value(OP, name, scale)


def _store_spec(
    q,
    k,
    v,
    positions,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    interleaved,
    rotary_dim,
    mrope_section,
    mrope_interleaved,
    cu_seqlens,
    cp_size,
    cp_rank,
    k_scale,
    v_scale,
    q_norm_weight,
    k_norm_weight,
    norm_eps,
    norm_weight_offset,
    q_out,
    q_scale,
    write_key,
    q_nope,
    k_nope,
    rotary_position,
) -> Spec:
    """Validate a public call (no data read) and make its Spec (the eager door q's type picks).
    k_nope: GQA / MHA's no-rope key part beside v (MLA's k_nope has taken v's place before)."""
    packed = (1, 0)
    if cu_seqlens is not None or not (cp_size == 1 and cp_rank == 0):
        packed = validate.packed_args(OP, q, positions, cu_seqlens, cp_size, cp_rank, mrope_section)
    rot, mrope, _, _ = validate.store_args(
        OP,
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        rotary_dim=rotary_dim,
        k_scale=k_scale,
        v_scale=v_scale,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        packed=cu_seqlens is not None,
        k_nope=k_nope,
    )
    if q_nope is not None:
        if q_out is None:
            validate.fail(
                OP, "q_nope", "None without q_out (q_out receives the rotated q and q_nope after it)", "a tensor"
            )
        validate.nope_part(OP, "q_nope", q_nope, q, rot)
    validate.store_outputs(OP, q, k, q_out, q_scale, write_key, q_nope=q_nope)
    modes = norm_modes(q, k, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset)
    for name, part, weight in (("q_nope", q_nope, "q_norm_weight"), ("k_nope", k_nope, "k_norm_weight")):
        if part is not None and modes[name == "k_nope"] != pipeline.NORM_NONE:
            validate.fail(
                OP, name, f"None with {weight} (the norm covers a whole head, not one given in two parts)", "a tensor"
            )
    if cu_seqlens is not None:
        angles, a = "packed", cu_seqlens
    else:
        angles, a = ("table" if positions is not None else "arange"), positions
    mode = 0
    if mrope is not None and positions is not None:  # M-RoPE needs its (3, *T) positions
        mode = MROPE_INTERLEAVED if mrope_interleaved else MROPE_CHUNKED
    il = bool(interleaved)
    position = validate.rotary_position_arg(OP, rotary_position, allowed=("first", "halves"))
    if position == "halves":
        validate.halves_args(OP, q, k, il)
        for name, part in (("q_nope", q_nope), ("k_nope", k_nope)):
            if part is not None:  # p-RoPE's pairs span the whole head: no part of it is apart
                validate.fail(
                    OP, name, "None with rotary_position='halves' (its pairs span the whole head)", "a tensor"
                )
    halves = position == "halves" and k.shape[-1] > rot  # whole heads: the usual variant
    variant = Variant(
        il,
        il,
        mode,
        mrope if mode else (0, 0, 0),
        angles,
        norm_q=modes[0],
        norm_k=modes[1],
        rope_halves=halves,
        nope_q=q_nope is not None,
        nope_k=k_nope is not None,
    )
    weights = (q_norm_weight, k_norm_weight)
    parts = (q_nope, k_nope)
    return _spec(q, k, v, a, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out, weights, parts, variant, rot, packed)


def norm_modes(q, k, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset) -> tuple:
    """(norm_q, norm_k) of validated norm arguments: NORM_NONE without weights."""
    if q_norm_weight is None and k_norm_weight is None:
        return pipeline.NORM_NONE, pipeline.NORM_NONE
    modes = validate.norm_weights(OP, q, k, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset)
    if torch.is_grad_enabled():
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w is not None and w.requires_grad:
                validate.fail(
                    OP, name, "a tensor that does not require grad (apply_rope_and_store is inference only)", True
                )
    return modes


def _spec(
    q, k, v, a, table, k_cache, v_cache, slot_mapping, q_out, weights, parts, variant, rot, packed, door=None
) -> Spec:
    """The Spec of a validated call (door None: the eager door q's type picks). weights: the norm
    weights (q's, k's); parts: the no-rope parts (q_nope, k_nope), None where not given."""
    return Spec(
        variant,
        rot,
        pipeline.door_for(q, False) if door is None else door,
        pipeline.triton_runs(q),
        extents=validate.store_extents(q, k, v, k_cache, v_cache, a, table, slot_mapping, q_out, *weights, *parts),
        packed=packed,
    )


def _run(spec, q, k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm, parts) -> None:
    """Address checks, then the run step: the body of the eager door and of the custom ops.
    parts: (q_nope, k_nope), the heads' no-rope parts of a variant that reads them."""
    checks(spec, q, k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm, parts)
    run(spec, q, k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm, parts)


def run(
    spec, q, k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm, parts=(None, None)
) -> None:
    """The store's run step: q rotated in place (or into q_out), rotated k and v into their cache
    rows (and rotated k back into k with write_key), q and k normalized first with norm. The Triton
    launch (plan made once per spec), or ropekit.core.cpu on CPU tensors. With the variant's
    nope_q / nope_k, parts (q_nope, k_nope) are the dims after the rotated ones in q_out / the k rows."""
    if spec.triton:
        plan = spec.plans.get(None)
        if plan is None:
            plan = spec.plans[None] = launcher.plan_store(
                q,
                k,
                v,
                a,
                table,
                k_cache,
                v_cache,
                slot_mapping,
                spec.variant,
                spec.rot,
                ks is not None,
                vs is not None,
                q_out,
                qs is not None,
                write_key,
                spec.packed,
                parts=parts,
            )
        launcher.fire_store(plan, q, k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, norm, parts)
        return
    variant = spec.variant
    if variant.nope_q or variant.nope_k:  # CPU: whole heads, as one tensor each would hold them
        _cpu_parts(spec, q, k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm, parts)
        return
    if variant.angles == "packed":  # CPU: the positions the kernel derives, made here
        from ..core.packed import packed_positions

        a = packed_positions(OP, a, spec.packed[0], spec.packed[1], q.shape[0])
    cpu.store_rows(
        q,
        k,
        v,
        a,
        table,
        k_cache,
        v_cache,
        slot_mapping,
        interleaved=variant.interleaved,
        rotary_dim=spec.rot,
        k_scale=ks,
        v_scale=vs,
        q_out=q_out,
        q_scale=qs,
        write_key=write_key,
        sections=variant.sections if variant.mrope else None,
        il_sections=variant.mrope == MROPE_INTERLEAVED,
        norm=norm,
        halves=variant.rope_halves,
    )


def _cpu_parts(spec, q, k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm, parts):
    """The CPU path of heads given in two parts (q_nope, k_nope): the run on whole heads (rope
    part, then no-rope part: torch.cat, a copy), rotated k written back into k's own dims with
    write_key. norm: the other tensor's norm, if any (a head in two parts is never normalized)."""
    q_nope, k_nope = parts
    whole_q = q if q_nope is None else torch.cat((q, q_nope), -1)
    whole_k = k if k_nope is None else torch.cat((k, k_nope), -1)
    one = spec.variant._replace(nope_q=False, nope_k=False)
    plain = Spec(one, spec.rot, spec.door, spec.triton, packed=spec.packed)
    run(plain, whole_q, whole_k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm)
    if write_key and whole_k is not k:
        k.copy_(whole_k[..., : k.shape[-1]])


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim has stride 1 (or one element), else one contiguous copy: how the
    store reads a k (or, with q_out, a q) whose last dim is strided."""
    if x.stride(-1) == 1 or x.shape[-1] <= 1:
        return x
    return x.contiguous()


def paged_mla(cache, x):
    """A 3-D cache beside a one-head x whose dim -2 is not 1 is FlashInfer's paged MLA cache
    (num_blocks, block_size, D): the 4-D view (num_blocks, block_size, 1, D). A 3-D cache is flat
    (num_slots, H, D) otherwise; (num_blocks, 1, D) reads the same either way (slot = block)."""
    if (
        isinstance(cache, torch.Tensor)
        and isinstance(x, torch.Tensor)
        and cache.dim() == 3
        and x.dim() >= 2
        and x.shape[-2] == 1
        and cache.shape[-2] != 1
    ):
        return cache.unsqueeze(-2)
    return cache


def mla_parts(k, v, k_cache, v_cache, k_nope):
    """MLA's split key (v None) as the store's (v, k_cache, v_cache): k_nope takes v's place
    (copied unrotated into v_cache); with v_cache None, k_cache is the joint row [nope | rope] and
    is split at k_nope's width."""
    if not isinstance(k_nope, torch.Tensor):
        raise TypeError(f"{OP}: k_nope: expected a torch.Tensor or None, got {type(k_nope).__name__}")
    if v_cache is None and isinstance(k_cache, torch.Tensor) and isinstance(k, torch.Tensor) and k_cache.dim() > 0:
        nope, rope = k_nope.shape[-1], k.shape[-1]
        if k_cache.shape[-1] != nope + rope:
            validate.fail(
                OP,
                "k_cache",
                f"a joint row of {nope} + {rope} = {nope + rope} dims (k_nope's, then k's; v_cache None)",
                f"shape {tuple(k_cache.shape)}",
            )
        k_cache, v_cache = k_cache[..., nope:], k_cache[..., :nope]
    return k_nope, k_cache, v_cache


# ---------------------------------------------------------------------------------------------
# torch.library registration: what torch.compile (and the dispatcher, for tensor subclasses) sees


def _op_body(
    q,
    k,
    v,
    a,
    table,
    k_cache,
    v_cache,
    slots,
    codes,
    rot,
    ks,
    vs,
    write_key,
    q_out,
    qs,
    wq,
    wk,
    eps,
    offset,
    cp,
    parts=(None, None),
):
    """The body of both store ops: the memoized spec of these (local) tensors and the encoded
    variant, then the checks and the run step. a: positions, or cu_seqlens for packed angles;
    parts: (q_nope, k_nope), the no-rope parts the variant's nope_q / nope_k say are given."""
    q_nope, k_nope = parts
    key = (
        "rope_and_store op",
        tensor_key(q),
        tensor_key(k),
        tensor_key(v),
        tensor_key(a),
        tensor_key(table),
        tensor_key(k_cache),
        tensor_key(v_cache),
        tensor_key(slots),
        tuple(codes),
        rot,
        tensor_key(ks),
        tensor_key(vs),
        write_key,
        tensor_key(q_out),
        tensor_key(qs),
        tensor_key(wq),
        tensor_key(wk),
        cp,
        tensor_key(q_nope),
        tensor_key(k_nope),
    )
    spec = _MEMO.get(key)
    if spec is None:
        variant = Variant.decode(codes)
        op_weights(variant, q, k, wq, wk)
        for name, part, given in (("q_nope", q_nope, variant.nope_q), ("k_nope", k_nope, variant.nope_k)):
            if (part is not None) != given:  # the kernel reads the part exactly when the variant says so
                validate.fail(OP, name, f"{'a tensor' if given else 'None'} (as the variant says)", type(part).__name__)
        spec = pipeline.remember(
            key, _spec(q, k, v, a, table, k_cache, v_cache, slots, q_out, (wq, wk), parts, variant, rot, cp, DIRECT)
        )
    norm = (wq, wk, eps, offset) if spec.variant.normed else None
    _run(spec, q, k, v, a, table, k_cache, v_cache, slots, ks, vs, q_out, qs, write_key, norm, parts)


def op_weights(variant: Variant, q, k, wq, wk) -> None:
    """The custom ops' norm weights against the encoded norm modes and the (local) tensors: a
    weight per mode, of D elements per head or H*D across heads (the kernel reads that many)."""
    for name, w, x, mode in (("q_norm_weight", wq, q, variant.norm_q), ("k_norm_weight", wk, k, variant.norm_k)):
        want = {pipeline.NORM_HEAD: x.shape[-1], pipeline.NORM_TOKEN: x.shape[-2] * x.shape[-1]}.get(mode)
        got = None if w is None else w.numel()
        if got != want:
            what = "None" if want is None else f"a tensor of {want} elements"
            validate.fail(OP, name, f"{what} (norm mode {mode} of the variant)", "None" if w is None else f"{got}")


# Two ops, not one with an optional q_out: a mutated argument that may be None breaks fake-tensor
# tracing on torch 2.11 (IndexError), and q is written in place exactly when q_out is absent.
# variant: pipeline.Variant.encode() of the call (interleaving, M-RoPE, angle source, norm modes,
# no-rope parts); positions: positions, or cu_seqlens when the variant's angles are packed; q_nope,
# k_nope: the heads' no-rope parts when given apart (read only; q_nope only with q_out).
@torch.library.custom_op("ropekit::rope_and_store", mutates_args=("q", "k", "k_cache", "v_cache"))
def _rope_and_store_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    variant: List[int],
    rotary_dim: int,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
    write_key: bool = False,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = NORM_EPS,
    norm_weight_offset: float = NORM_OFFSET,
    cp_size: int = 1,
    cp_rank: int = 0,
    k_nope: Optional[torch.Tensor] = None,
) -> None:
    _op_body(
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        variant,
        rotary_dim,
        k_scale,
        v_scale,
        write_key,
        None,
        None,
        q_norm_weight,
        k_norm_weight,
        norm_eps,
        norm_weight_offset,
        (cp_size, cp_rank),
        (None, k_nope),
    )


@torch.library.custom_op("ropekit::rope_and_store_q_out", mutates_args=("q_out", "k", "k_cache", "v_cache"))
def _rope_and_store_q_out_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    variant: List[int],
    rotary_dim: int,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
    write_key: bool,
    q_out: torch.Tensor,
    q_scale: Optional[torch.Tensor],
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = NORM_EPS,
    norm_weight_offset: float = NORM_OFFSET,
    cp_size: int = 1,
    cp_rank: int = 0,
    q_nope: Optional[torch.Tensor] = None,
    k_nope: Optional[torch.Tensor] = None,
) -> None:
    _op_body(
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        variant,
        rotary_dim,
        k_scale,
        v_scale,
        write_key,
        q_out,
        q_scale,
        q_norm_weight,
        k_norm_weight,
        norm_eps,
        norm_weight_offset,
        (cp_size, cp_rank),
        (q_nope, k_nope),
    )


def store_op(spec: Spec, args: Sequence, write_key: bool, q_out, q_scale, norm, parts=(None, None)) -> None:
    """The store's custom op for a validated call (the dispatcher's door): args are the eight
    leading tensors both ops share (q ... slot_mapping) then k_scale, v_scale; norm as `run` takes
    it; parts: (q_nope, k_nope), passed to the op by name (the usual call's schema is unchanged)."""
    q_nope, k_nope = parts
    q, k, v, a, table, k_cache, v_cache, slots, ks, vs = args
    head = (q, k, v, a, table, k_cache, v_cache, slots, spec.variant.encode(), spec.rot, ks, vs)
    wq, wk, eps, offset = (None, None, NORM_EPS, NORM_OFFSET) if norm is None else norm
    tail = (wq, wk, float(eps), float(offset), *spec.packed)
    named = {} if k_nope is None else {"k_nope": k_nope}
    if q_out is None:
        torch.ops.ropekit.rope_and_store(*head, write_key, *tail, **named)
    else:
        if q_nope is not None:
            named["q_nope"] = q_nope
        torch.ops.ropekit.rope_and_store_q_out(*head, write_key, q_out, q_scale, *tail, **named)


@_rope_and_store_op.register_fake
def _(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, variant, rotary_dim, *rest):
    return None


@_rope_and_store_q_out_op.register_fake
def _(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, variant, rotary_dim, *rest):
    return None


def rare_key(mrope_section, mrope_interleaved, cp_size, cp_rank, norm_eps, norm_weight_offset, position) -> tuple:
    """The part of a call signature the rarer keywords contribute, each value with its type."""
    return (
        None if mrope_section is None else value_key(mrope_section),
        value_key(mrope_interleaved),
        value_key(cp_size),
        value_key(cp_rank),
        value_key(norm_eps),
        value_key(norm_weight_offset),
        value_key(position),
    )


def scale_key(scale):
    """A scale argument's part of a call signature."""
    if isinstance(scale, torch.Tensor):
        return tensor_key(scale)
    return type(scale), scale  # the value: validation depends on it (> 0, finite)


# ---------------------------------------------------------------------------------------------
# public op


def apply_rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = _CP_SIZE,
    cp_rank: int = _CP_RANK,
    k_scale: Scale = None,
    v_scale: Scale = None,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = NORM_EPS,
    norm_weight_offset: float = NORM_OFFSET,
    write_key: bool = False,
    q_out: Optional[torch.Tensor] = None,
    q_scale: Scale = None,
    k_nope: Optional[torch.Tensor] = None,
    q_nope: Optional[torch.Tensor] = None,
    rotary_position: str = _FIRST,
) -> torch.Tensor:
    """Rotate q in place (or into q_out); write rotated k and unrotated v into the cache rows of
    their slots. One launch, whatever the keywords.

    Args:
        q: (*T, Hq, Dq) fp16/bf16/fp32, *T = (T,) or (B, S); any strides, last stride 1. Rotated
            in place (dims past rotary_dim untouched) unless q_out is given; with q_out, q is
            only read and may have any last stride (then read through one copy).
        k: (*T, Hk, Dk), its own strides; rotated into k_cache (q and k are never mixed up:
            MLA's q_pe view of a 192-wide head and a separate k_pe are fine). A last stride other
            than 1 is read through one copy (not with write_key, which writes k).
        v: (*T, Hv, Dv), copied into v_cache; Dv may differ from Dk (MLA: latent 512, rope 64).
            Any strides, the last one included (read in place, no copy). None with MLA's k_nope.
        positions: (*T) int32/int64, (3, *T) with mrope_section, or None for arange over the
            last token dim (or for positions derived from cu_seqlens).
        cos_sin_cache: (max_position, rotary_dim) rows [cos | sin]; fp32 recommended.
        k_cache: (num_blocks, block_size, Hk, Dk) paged or (num_slots, Hk, Dk) flat, any strides
            with last stride 1: NHD as is, HND as `cache.permute(0, 2, 1, 3)`, the k half of a
            (num_blocks, 2, block_size, H, D) buffer as `buf[:, 0]`. fp16/bf16/fp32,
            float8_e4m3fn or float8_e5m2 (need not match k's dtype; values are cast).
        v_cache: like k_cache for v, with the same slot dims (num_blocks, block_size) or
            (num_slots,). MLA keeps one joint row [latent | rope]: pass views of one cache,
            `k_cache = cache[..., L:]`, `v_cache = cache[..., :L]`, or use k_nope. A 3-D cache
            beside a one-head k (v) is FlashInfer's paged MLA cache (num_blocks, block_size, D)
            unless its dim -2 is 1 (then flat (num_slots, 1, D), which addresses the same rows).
        slot_mapping: (*T) int32/int64; token i goes to slot slot_mapping[i] = block * block_size
            + offset. A slot < 0 is padding: nothing is stored for that token.
        interleaved: False rotates halves (Llama/NeoX), True pairs (2i, 2i+1) (GPT-J, DeepSeek).
        rotary_dim: must equal the width of cos_sin_cache (default); dims past it are kept.
        mrope_section, mrope_interleaved: M-RoPE as in apply_rope: positions (3, *T) (t, h, w
            rows), mrope_section three ints (t, h, w) summing to rotary_dim // 2, frequencies
            chunked (Qwen2-VL) or interleaved (mrope_interleaved=True, Qwen3-VL).
        cu_seqlens, cp_size, cp_rank: packed sequences as in apply_rope: q, k, v (T, H, D),
            slot_mapping (T,), positions None, cu_seqlens (N+1,) int32/int64 cumulative local
            lengths on q's device; each token's position is derived inside the kernel (restarting
            at 0 per sequence; context parallelism's dual-chunk layout with cp_size > 1). No
            M-RoPE with it. Values checked only in strict mode (a sync), as apply_rope does.
        k_scale, v_scale: None, a float, or a 0-d/1-element float32 tensor on q's device: the
            cache stores value / scale (per-tensor fp8 scaling; also honoured for other caches).
            A tensor scale is read inside the kernel: no host sync, safe in CUDA graphs. A float
            is turned into a cached device tensor (1.0 means no scaling).
        write_key: True also writes the rotated (and normalized) k back into k, in place, for
            every token (padding ones included), as SGLang's fused set-kv-buffer does for engines
            that keep k for a local attention call. k's dims past rotary_dim stay as they are
            (normalized with k_norm_weight, like q's). k is then written: it must not overlap
            q, v, the caches or a read-only input, and needs a unit last stride.
        q_out: None, or a (*T, Hq, Dq) tensor in any of the cache dtypes (fp8 e4m3 / e5m2 for an
            FP8 attention's prologue), any strides with last stride 1: rotated (and normalized)
            q is written there, tail included, and q is left untouched (FlashInfer's
            rope_quantize_fp8 + paged append in one launch).
        q_scale: None, a float or a 1-element float32 tensor, only with q_out: q_out stores
            rotated q / q_scale (same rule as k_scale).
        k_nope: the key's no-rope part, a tensor of its own (k is then the rope part, (*T, Hk,
            R) with R = rotary_dim). Two forms, told apart by v:
            - v given (GQA / MHA, FlashInfer's rope_quantize_fp8_append_paged_kv_cache with
              no_rope_dim > 0): k_nope (*T, Hk, N), k_cache (..., Hk, R + N); each k cache row
              receives rotated k in dims [0, R) and k_nope in [R, R + N) (FlashInfer's order),
              v goes to v_cache as usual. Any strides, the last one included (read in place).
              Not with k_norm_weight (the norm covers a whole head).
            - v None (MLA, FlashInfer's append_paged_mla_kv_cache): k_nope (*T, Hk, L) is copied
              unrotated into v_cache, the nope cache (FlashInfer's ckv_cache, (num_blocks,
              block_size, Hk, L)), with k_cache the rope cache (kpe_cache, R wide); or v_cache
              None: k_cache is then the joint row (..., Hk, L + R) [nope | rope] (DeepSeek's
              layout) and is split at L.
            One launch either way; float dtypes, on q's device, token dims and heads of k.
        q_nope: only with q_out: q's no-rope part, a tensor of its own (*T, Hq, N), any strides
            (read in place); q is then the rope part (*T, Hq, R) with R = rotary_dim, and q_out
            (*T, Hq, R + N) receives rotated q in dims [0, R) and q_nope in [R, R + N), both
            divided by q_scale and saturated like the rotated dims (FlashInfer's q_rope_out and
            q_nope_out are the views q_out[..., :R] and q_out[..., R:]). Not with q_norm_weight.
        rotary_position: 'first' (dims [0, rotary_dim) rotated) or 'halves': the pairs (i, i + D/2)
            for i < rotary_dim / 2 (Gemma 4's p-RoPE, apply_rope's keyword), the other dims kept
            (untouched in q in place, copied into q_out and the cache rows, normalized with the
            norm); needs interleaved=False, an even D and q and k of one head size.

    Returns q (rotated in place), or q_out when given. Rows of the caches that no slot names are
    never touched. Duplicate slots (two tokens naming one slot) are a caller error: without
    strict mode the row holds an unspecified mix (its k row and its v row may come from different
    tokens); under `ropekit.strict()` they raise ValueError naming the slot and both tokens,
    before any write.

    Output layouts: every output is written where and how the caller laid it out (q and k in
    place keep their strides, q_out and the caches keep theirs; nothing is made contiguous). For
    a permuted q, `torch.empty_like(q, dtype=torch.float8_e4m3fn)` gives a q_out of q's layout.
    Inputs whose last dim is not contiguous (Transformer Engine's permuted tensors): v is read
    through its stride; k, and q with q_out, are read through one contiguous copy each (an extra
    pass over that input only); q rotated in place, and k with write_key, must have a unit last
    stride (refused with ValueError otherwise: rotating through a copy would need a second pass
    to copy back).

    Bad inputs never cause an out-of-bounds access, and nothing is synced by default:
    - a position outside [0, max_position): that token's rotated dims of q and of its k row are
      NaN (as in apply_rope);
    - a slot >= num_slots: nothing is stored for that token, and its rotated q dims (in q_out
      when given) are made NaN, so the mistake shows up in the attention output instead of
      corrupting someone else's row.
    Under `ropekit.strict()` (or ROPEKIT_STRICT=1) bad positions and slots, and tensor scales that
    are not finite and > 0, raise ValueError before anything is written (one device sync).

    fp8 outputs (caches, q_out; e4m3 or e5m2): values are divided by the scale in float32,
    saturated to the format's largest finite value (e4m3 448, e5m2 57344; NaN stays NaN) and
    cast once (round to nearest even).

    Inference only: tensors that require grad are refused while grad mode is on.

    q_norm_weight / k_norm_weight: None, or an RMSNorm weight (D,) (each head normalized: Qwen3)
    or (H*D,) (all heads of a token together: OLMo 2), fp32/bf16/fp16, unit stride, on q's device,
    not requiring grad: q / k normalized first, y = x * rsqrt(mean(x^2) + norm_eps) * (w +
    norm_weight_offset) in float32, same launch (q's whole head, tail included, normalized in
    place or into q_out; k's into its cache row, and with write_key into k). Every keyword above
    composes with the norm. DTensor: weights replicated; an (H*D,) weight with head-sharded q / k
    is refused (ropekit.distributed).
    """
    mla = k_nope is not None and v is None  # else k_nope (if any) is GQA / MHA's, beside v
    k_cache, v_cache = paged_mla(k_cache, k), paged_mla(v_cache, k_nope if mla else v)
    if mla:
        v, k_cache, v_cache = mla_parts(k, v, k_cache, v_cache, k_nope)
        k_nope = None
    # strided last dims of read-only inputs: one copy each (q rotated in place is refused by validation)
    if isinstance(k, torch.Tensor) and write_key is False and k.dim():
        k = unit_last(k)
    if q_out is not None and isinstance(q, torch.Tensor) and q.dim():
        q = unit_last(q)
    spec = None
    compiling = torch.compiler.is_compiling()
    if not compiling:
        try:
            key = (
                OP,
                torch.is_grad_enabled(),
                tensor_key(q),
                tensor_key(k),
                tensor_key(v),
                tensor_key(positions),
                tensor_key(cos_sin_cache),
                tensor_key(k_cache),
                tensor_key(v_cache),
                tensor_key(slot_mapping),
                type(interleaved),
                interleaved,
                type(rotary_dim),
                rotary_dim,
                None if cu_seqlens is None else tensor_key(cu_seqlens),
                None if q_norm_weight is None else tensor_key(q_norm_weight),
                None if k_norm_weight is None else tensor_key(k_norm_weight),
                # the rarer keywords: one None while each is its default object (the usual call)
                None
                if mrope_section is None
                and mrope_interleaved is False
                and cp_size is _CP_SIZE
                and cp_rank is _CP_RANK
                and norm_eps is NORM_EPS
                and norm_weight_offset is NORM_OFFSET
                and rotary_position is _FIRST
                else rare_key(
                    mrope_section, mrope_interleaved, cp_size, cp_rank, norm_eps, norm_weight_offset, rotary_position
                ),
                scale_key(k_scale),
                scale_key(v_scale),
                type(write_key),
                write_key,
                None if q_out is None else tensor_key(q_out),
                None if q_scale is None else scale_key(q_scale),
                None if q_nope is None and k_nope is None else (tensor_key(q_nope), tensor_key(k_nope)),
            )
            spec = _MEMO.get(key)
        except (AttributeError, TypeError):  # not tensors, or unhashable: validation names them
            key = None
    if spec is None:
        spec = _store_spec(
            q,
            k,
            v,
            positions,
            cos_sin_cache,
            k_cache,
            v_cache,
            slot_mapping,
            interleaved=interleaved,
            rotary_dim=rotary_dim,
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            cu_seqlens=cu_seqlens,
            cp_size=cp_size,
            cp_rank=cp_rank,
            k_scale=k_scale,
            v_scale=v_scale,
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            norm_eps=norm_eps,
            norm_weight_offset=norm_weight_offset,
            q_out=q_out,
            q_scale=q_scale,
            write_key=write_key,
            q_nope=q_nope,
            k_nope=k_nope,
            rotary_position=rotary_position,
        )
        if not compiling:
            pipeline.remember(key, spec)
    a = positions if cu_seqlens is None else cu_seqlens
    norm = (q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset) if spec.variant.normed else None
    dev = q.device
    ks, vs = pipeline.scale_tensor(k_scale, dev), pipeline.scale_tensor(v_scale, dev)
    qs = None if q_scale is None else pipeline.scale_tensor(q_scale, dev)
    parts = (q_nope, k_nope)
    if compiling or spec.door is CUSTOM_OP:  # the dispatcher: DTensor, torch.compile
        _dispatch(
            spec, q, k, v, a, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm, parts
        )
        return q if q_out is None else q_out
    _run(spec, q, k, v, a, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm, parts)
    # the kernel writes through raw pointers, which autograd does not see: bump the version counters
    # so that anything that saved q or a cache for a backward raises instead of reading new values
    bump_versions(q if q_out is None else q_out, k_cache, v_cache, k if write_key else None)
    return q if q_out is None else q_out


def _dispatch(spec, q, k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs, write_key, norm, parts):
    """The custom-op door: plain tensors (tables, positions, scales, weights) become replicated
    DTensors like q for a DTensor call (DTensor refuses mixed calls); as they are otherwise."""
    if spec.door is CUSTOM_OP:
        wq, wk = (None, None) if norm is None else norm[:2]
        a, table, slot_mapping, ks, vs, qs, wq, wk = dtensor_like(q, a, table, slot_mapping, ks, vs, qs, wq, wk)
        norm = None if norm is None else (wq, wk, norm[2], norm[3])
    args = (q, k, v, a, table, k_cache, v_cache, slot_mapping, ks, vs)
    store_op(spec, args, write_key, q_out, qs, norm, parts)


def bump_versions(*written) -> None:
    """Version counters of the tensors a launch wrote (None skipped)."""
    for x in written:
        if x is not None:
            torch.autograd.graph.increment_version(x)
