"""One entry per op: a call's arguments (the public op's, by name) checked into its Spec.

    rope(args)      apply_rope             angles(args)    rotate_with_angles / rotate_angles
    store(args)     apply_rope_and_store   rerotate(args)  rerotate_kv_cache

Each runs once per call signature (ropekit.core.pipeline.prepare memoizes its Spec) and reads only
shapes, strides, dtypes and devices: the first bad argument raises ValueError (TypeError for a
wrong type) naming it, before anything is written. What depends on a call's addresses or values is
checked on every call by the `*_call` entries below (aliasing of written tensors, a new table,
strict mode's value checks). The rules themselves are ropekit.core.rules (arguments),
ropekit.core.aliasing (byte ranges), ropekit.core.forms (other libraries' forms) and
ropekit.core.strict (values).
"""

from __future__ import annotations

import math
import os
from operator import itemgetter

import torch

from . import aliasing, forms, rules, strict
from .args import addresses_known, data_readable, fail
from .variant import (
    ANGLE_NAMES,
    CUSTOM_OP,
    DIRECT,
    FLAGS,
    FUNCTION,
    NORM_HEAD,
    NORM_NONE,
    NORM_TOKEN,
    NORM_UNIT,
    Spec,
    Variant,
)

_TABLE_EXCLUSIVE = ("cos_sin_cache", "mrope_section", "cu_seqlens")


def triton_runs(x: torch.Tensor) -> bool:
    """Does the Triton kernel run for tensors like x? (CUDA, or CPU under TRITON_INTERPRET=1)"""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def records_grad(*xs) -> bool:
    """Will autograd record this call? (arguments that are not tensors: no; validation names them)"""
    return torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) is True for x in xs)


def door_for(q, grad: bool, normed: bool = False, triton: bool = True) -> str:
    """The eager door: subclasses (DTensor, ...) and meta tensors go through the dispatcher (the
    custom ops' fakes give meta outputs their shapes and dtypes), grad through autograd; the CPU
    path of a normed variant is a direct run (torch ops that autograd records)."""
    if type(q) is not torch.Tensor or q.device.type == "meta":
        return CUSTOM_OP
    if normed and not triton:
        return DIRECT
    return FUNCTION if grad else DIRECT


def scaled_by(scale) -> bool:
    """Does a validated scale divide? (a float 1.0 does not: the run skips it)"""
    return scale is not None and (isinstance(scale, torch.Tensor) or scale != 1.0)


def _mrope_code(mrope) -> dict:
    """A Variant's M-RoPE fields (mrope, sections, axis_map) for validated arguments (rules.MRope or None)."""
    if mrope is None:
        return dict(mrope=0, sections=(0, 0, 0), axis_map=())
    return dict(mrope=mrope.mode, sections=mrope.sections, axis_map=mrope.axis_map)


def _heads_first(x, yes: bool):
    return x.transpose(1, 2) if yes and x is not None else x


def _seq(x):
    return None if x is None else x.transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# apply_rope


def rope(args: dict) -> Spec:
    """apply_rope's Spec (names the first bad argument)."""
    op = "apply_rope"
    q, k, positions, table = args["q"], args["k"], args["positions"], args["cos_sin_cache"]
    inplace, layout, inv_freq, axes = args["inplace"], args["layout"], args["inv_freq"], args["axes"]
    cu_seqlens, cp_size, cp_rank = args["cu_seqlens"], args["cp_size"], args["cp_rank"]
    mrope_section, mrope_interleaved = args["mrope_section"], args["mrope_interleaved"]
    weights = (args["q_norm_weight"], args["k_norm_weight"])
    packed = (1, 0)
    hf = forms.layout_arg(op, layout, q, sbhd=True)
    seq = layout == "sbhd"
    q_t, k_t = _heads_first(q, hf), _heads_first(k, hf)  # tokens first
    if seq:  # checked as the (B, S, H, D) views the run takes
        rows = len(mrope_section) if isinstance(mrope_section, (list, tuple)) else int(mrope_section is not None)
        forms.sbhd_args(op, q, k, positions, rows)
        q_t, k_t = _seq(q_t), _seq(k_t)
        if isinstance(positions, torch.Tensor) and positions.dim() >= 2:
            positions = positions.transpose(-1, -2)
    expand = None  # positions with size-1 dims (HF's (1, S)): the shape each call expands them to
    if inv_freq is not None or axes is not None:
        if inv_freq is None:
            fail(op, "inv_freq", "a tensor when axes is given (axes split inv_freq's pairs)", None)
        for name, value in zip(_TABLE_EXCLUSIVE, (table, mrope_section, cu_seqlens)):
            if value is not None:
                fail(op, name, "None with inv_freq (angles computed from positions x inv_freq)", type(value).__name__)
        rot, sections = rules.freqs_args(
            op,
            q_t,
            k_t,
            positions,
            inv_freq,
            axes,
            rotary_dim=args["rotary_dim"],
            inplace=inplace,
            any_last_stride=True,
        )
        angles, mode, source, b = "freqs", 0, positions, inv_freq
        mrope_fields = dict(mrope=0, sections=sections)
    else:
        if cu_seqlens is not None or not (cp_size == 1 and cp_rank == 0):
            packed = rules.packed_args(op, q_t, positions, cu_seqlens, cp_size, cp_rank, mrope_section)
        rot, mrope = rules.rope_args(
            op,
            q_t,
            k_t,
            positions,
            table,
            rotary_dim=args["rotary_dim"],
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            mrope_layout=args["mrope_layout"],
            inplace=inplace,
            packed=cu_seqlens is not None,
            inplace_grad=True,
            broadcast=True,
            any_last_stride=True,
            head_table=True,
        )
        if table.dim() == 3:
            rules.head_table_args(op, q_t, k_t, table, positions, mrope, cu_seqlens, weights, args["l2_norm"])
        rules.no_grad_table(op, table)
        if layout is None:
            forms.warn_ambiguous_layout(op, q, positions is None and cu_seqlens is None, stacklevel=5)
        if cu_seqlens is not None:
            if inplace and addresses_known(q):
                aliasing.inplace_aliasing(op, q, k, (("cu_seqlens", cu_seqlens),))
            angles, source = "packed", cu_seqlens
        else:
            angles, source = ("table" if positions is not None else "arange"), positions
        mrope_fields = _mrope_code(mrope if angles == "table" else None)
        mode = mrope_fields["mrope"]
        b = table
        if angles == "table":
            want = ((mrope.rows,) if mode else ()) + tuple(q_t.shape[:-2])
            expand = want if tuple(positions.shape) != want else None
    norm_eps, norm_offset = args["norm_eps"], args["norm_weight_offset"]
    modes = rules.norm_weights(op, q_t, k_t, *weights, norm_eps, norm_offset, inplace=inplace, l2=args["l2_norm"])
    normed = modes != (NORM_NONE, NORM_NONE)
    q_nope, k_nope = args["q_nope"], args["k_nope"]
    parts = nope_parts(op, q, k, q_nope, k_nope, rot, inplace, modes)
    grad = records_grad(q, k, *weights, inv_freq, q_nope, k_nope)
    keyed = keyword_flags(op, args)  # every boolean flag the table gives a keyword (variant.FLAGS)
    out_dtype, inverse = args["out_dtype"], keyed["inverse"]
    scaled = rules.out_args(op, q, out_dtype, args["q_scale"], args["k_scale"], inverse, inplace=inplace, grad=grad)
    if normed:
        rules.norm_flags(op, inverse=inverse, inplace=inplace, grad=grad, names=rules.norm_names(modes))
    rules.out_buffers(
        op, q, k, args["q_out"], args["k_out"], out_dtype, inplace=inplace, grad=grad, parts=(q_nope, k_nope)
    )
    position = rules.rotary_position_arg(op, args["rotary_position"], normed and rules.norm_names(modes))
    il = bool(args["interleaved"])
    if position == "halves":
        rules.halves_args(op, q_t, k_t, il)
        for name, given in zip(("q_nope", "k_nope"), parts):
            if given:  # p-RoPE's pairs span the whole head: no part of it is apart
                fail(op, name, "None with rotary_position='halves' (its pairs span the whole head)", "a tensor")
    # a rotation of whole heads is the same wherever its dims are said to sit: the usual variant
    partial = any(parts) or any(x is not None and x.shape[-1] > rot for x in (q_t, k_t))
    temperature = q_temperature(op, args, angles, mode, normed, scaled, position)
    variant = Variant(
        interleaved=il,
        out_interleaved=il,
        **mrope_fields,
        angles=angles,
        heads_first=hf,
        scaled=scaled,
        norm_q=modes[0],
        norm_k=modes[1],
        seq_first=seq,
        rope_last=position == "last" and partial,
        rope_halves=position == "halves" and partial,
        nope_q=parts[0],
        nope_k=parts[1],
        q_temperature=temperature is not None,
        head_table=angles == "table" and table.dim() == 3,
        **keyed,
    )
    refusals(op, variant)
    triton = triton_runs(q)
    return Spec(
        variant,
        rot,
        door_for(q, grad, normed, triton),
        triton,
        strided=any(x is not None and x.shape[-1] > 1 and x.stride(-1) != 1 for x in (q, k)),
        extents=tuple(aliasing.extent(x) for x in (q, k, source, b, *weights)),
        packed=packed,
        angle_shape=expand,
        inplace=bool(inplace),
        out_dtype=None if out_dtype == q.dtype else out_dtype,
        norm_eps=float(norm_eps),
        norm_offset=float(norm_offset),
        q_temperature=temperature or (1.0, 0.0),
    )


def q_temperature(op: str, args: dict, angles: str, mrope: int, normed: bool, scaled: bool, position: str):
    """apply_rope's q_temperature: None, or (floor_scale, attn_scale) as two floats; refused by name
    with what the flag does not cover (table angles by a positions tensor only)."""
    value = args["q_temperature"]
    if value is None:
        return None
    given = lambda: repr(value)  # noqa: E731  (formatted only when refusing: a traced float has no repr)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        fail(op, "q_temperature", "None or a pair (floor_scale, attn_scale)", given())
    if any(type(x) not in (int, float) for x in value):
        fail(op, "q_temperature", "a pair of floats (floor_scale, attn_scale)", given())
    floor_scale, attn_scale = float(value[0]), float(value[1])
    if not (0 < floor_scale < math.inf and 0 <= attn_scale < math.inf):  # NaN fails both
        fail(op, "q_temperature", "floor_scale > 0 and attn_scale >= 0, both finite", given())
    refused = (
        (angles == "freqs", "inv_freq"),
        (angles == "packed", "cu_seqlens"),
        (angles == "arange", "positions None"),
        (mrope != 0, "mrope_section"),
        (normed, "q_norm_weight / k_norm_weight / l2_norm"),
        (scaled, "fp8 out_dtype or scales"),
        (position != "first", f"rotary_position={position!r}"),
        (args["q_nope"] is not None or args["k_nope"] is not None, "q_nope / k_nope"),
    )
    for hit, what in refused:
        if hit:
            fail(op, "q_temperature", f"None with {what} (table angles by positions only)", given())
    return floor_scale, attn_scale


def keyword_flags(op: str, args: dict) -> dict:
    """The flags an op's boolean keywords set as given, by the flag table's `keyword` column (the
    keywords the op has): {field: value}; a value that is not a bool is refused naming its keyword
    (TypeError)."""
    flags = {}
    for f in FLAGS:
        if f.keyword is not None and f.keyword in args:
            value = args[f.keyword]
            if not isinstance(value, bool):
                raise TypeError(f"{op}: {f.keyword}: expected a bool, got {type(value).__name__}")
            flags[f.name] = value
    return flags


def refusals(op: str, variant: Variant) -> None:
    """The flag table's `refuses` column, for every row alike: a call whose record sets a keyword
    flag and a field that flag does not compose with is refused (ValueError), naming the keyword
    and the argument that set the other field (its row's `named`)."""
    for f in FLAGS:
        fields, why = f.refuses
        if not fields or getattr(variant, f.name) == f.default:
            continue
        names = []
        for other in fields:
            row, value = _FLAG_ROWS[other], getattr(variant, other)
            name = row.named.get(value, f"{row.keyword or other}={value!r}")
            if value != row.default and name not in names:
                names.append(name)
        if names:
            fail(op, f.keyword or f.name, f"{f.default!r} with {' / '.join(names)} ({why})", getattr(variant, f.name))


_FLAG_ROWS = {f.name: f for f in FLAGS}


def nope_parts(op, q, k, q_nope, k_nope, rot, inplace, modes) -> tuple:
    """(nope_q, nope_k) of validated no-rope parts: each None, or a tensor of its rope part's dims
    but the last (`rules.nope_part`), out of place, its tensor not normalized."""
    given = []
    for name, part, x, mode in (("q_nope", q_nope, q, modes[0]), ("k_nope", k_nope, k, modes[1])):
        given.append(part is not None)
        if part is None:
            continue
        if x is None:
            fail(op, name, "None when k is None", "a tensor")
        if inplace:
            fail(op, name, "None when inplace=True (the output is the whole head, a new tensor)", "a tensor")
        if mode != NORM_NONE:
            norm = "l2_norm=True" if mode == NORM_UNIT else f"{name[0]}_norm_weight"
            fail(op, name, f"None with {norm} (the norm covers a whole head, not one given in two parts)", "a tensor")
        rules.nope_part(op, name, part, x, rot, inference=False)
    return tuple(given)


def rope_call(spec: Spec, q, k, a, b, wq, wk, q_out, k_out, q_scale, k_scale, q_nope, k_nope, cp_size) -> None:
    """apply_rope's checks of this call's addresses and (strict mode) values, before any write:
    (a, b) the angle operands the run reads; the rest apply_rope's arguments of those names."""
    v = spec.variant
    if v.angles != "freqs" and (spec.table is None or spec.table() is not b):
        forms.read_new_table(spec, "apply_rope", b)  # a new table: HF's cos is refused
    if spec.door is CUSTOM_OP:  # the custom ops check addresses themselves
        return
    if spec.inplace:
        # a cheap test on addresses first (inline: this runs on every in-place call): the exact
        # tests run only when the byte range of q or k (written) meets another argument's
        ext = spec.extents  # bytes spanned by q, k, the angle source, b, the weights (0: none)
        q0 = q.data_ptr()
        q1 = q0 + ext[0]
        k0 = 0 if k is None else k.data_ptr()
        k1 = k0 + ext[1]
        meet = ext[0] and ext[1] and q0 < k1 and k0 < q1
        # the read tensors: those of a nonzero extent (which are given is fixed by the signature)
        for x, n in zip((a, b, wq, wk), ext[2:6]) if ext[4] or ext[5] else ((a, ext[2]), (b, ext[3])):
            if n and not meet:
                x0 = x.data_ptr()
                x1 = x0 + n
                meet = (ext[0] and x0 < q1 and q0 < x1) or (ext[1] and x0 < k1 and k0 < x1)
        if meet:
            names = ANGLE_NAMES[v.angles]
            read = ((names[0], a), (names[1], b), ("q_norm_weight", wq), ("k_norm_weight", wk))
            aliasing.inplace_aliasing("apply_rope", q, k, read)
    if (q_out is not None or k_out is not None) and type(q) is torch.Tensor:
        names = ANGLE_NAMES[v.angles]
        scales = [s if isinstance(s, torch.Tensor) else None for s in (q_scale, k_scale)]
        read = (("q", q), ("k", k), ("q_nope", q_nope), ("k_nope", k_nope), (names[0], a), (names[1], b))
        read += (("q_norm_weight", wq), ("k_norm_weight", wk))
        read += (("q_scale", scales[0]), ("k_scale", scales[1]))
        extents = [aliasing.extent(q_out), aliasing.extent(k_out)] + [aliasing.extent(x) for _, x in read]
        aliasing.out_aliasing("apply_rope", q_out, k_out, read, extents)
    if strict.mode.on:
        if v.angles == "packed":
            strict.packed_values("apply_rope", a, q.shape[0], cp_size)
        elif v.angles == "freqs":
            strict.positions_finite("apply_rope", a)
        elif a is not None:
            strict.positions_in_range("apply_rope", a, b.shape[0])


# ---------------------------------------------------------------------------------------------
# rotate_with_angles (ropekit.hf's seam, rotate_angles: per-token cos / sin)


def angle_columns(q, k, cos, sin, rotary_dim, columns):
    """(columns of cos / sin to read, settled): HF's full-width [f, f] form reads half of them.
    settled False when the values could not tell the forms apart (all angles zero): that verdict
    is then not remembered for the signature."""
    if columns is not None:
        return columns, True
    if rotary_dim is not None:
        return forms.angle_rotary_dim("rotate_with_angles", cos, rotary_dim), True
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.dim() == 0:
        return None, True  # validation names them
    if not (data_readable(cos) and data_readable(sin)):
        return _columns_by_width(q, k, cos), True  # tracing, capturing, a subclass: shapes decide
    duplicated = forms.duplicated_angles(cos, sin)
    if duplicated is None:
        return _columns_by_width(q, k, cos), False
    return (cos.shape[-1] // 2 if duplicated else None), True


def _columns_by_width(q, k, cos):
    """Without values: HF's form only where rotary_dim // 2 columns could not fit the heads."""
    width = cos.shape[-1]
    too_wide = any(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[-1] < 2 * width for x in (q, k))
    return width // 2 if too_wide and width % 2 == 0 else None


def angles(args: dict) -> Spec:
    """rotate_angles' Spec (names the first bad argument)."""
    op = "rotate_with_angles"
    q, k, cos, sin = args["q"], args["k"], args["cos"], args["sin"]
    interleaved = bool(args["interleaved"])
    out_il = interleaved if args["out_interleaved"] is None else args["out_interleaved"]
    heads_first, inplace = args["heads_first"], args["inplace"]
    weights = (args["q_norm_weight"], args["k_norm_weight"])
    mrope_section, mrope_interleaved = args["mrope_section"], args["mrope_interleaved"]
    columns, settled = angle_columns(q, k, cos, sin, args["rotary_dim"], args["columns"])
    hf = bool(heads_first)
    if columns is not None and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor):
        cos, sin = cos[..., :columns], sin[..., :columns]
    q_t, k_t = _heads_first(q, hf), _heads_first(k, hf)
    cos_v, sin_v, mrope = rules.angle_args(
        op,
        q_t,
        k_t,
        cos,
        sin,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        mrope_layout=args["mrope_layout"],
    )
    if heads_first is None:
        forms.warn_ambiguous_layout(op, q, False, stacklevel=6)
    if inplace:
        read = (("cos", cos_v), ("sin", sin_v), ("q_norm_weight", weights[0]), ("k_norm_weight", weights[1]))
        rules.inplace_args(op, q_t, k_t, read, inplace_grad=True)
    norm = (args["norm_eps"], args["norm_weight_offset"])
    modes = rules.norm_weights(op, q_t, k_t, *weights, *norm, inplace=inplace, l2=args["l2_norm"])
    normed = modes != (NORM_NONE, NORM_NONE)
    grad = records_grad(q, k, *weights)
    if normed:
        names = rules.norm_names(modes)
        rules.norm_flags(op, inplace=inplace, grad=grad, out_interleaved=bool(out_il) != interleaved, names=names)
    keyed = keyword_flags(op, args)  # the table's keywords this op has (eager_rounding)
    mrope_fields = _mrope_code(mrope)
    mode = mrope_fields["mrope"]
    variant = Variant(
        interleaved=interleaved,
        out_interleaved=bool(out_il),
        **mrope_fields,
        angles="tokens",
        heads_first=hf,
        norm_q=modes[0],
        norm_k=modes[1],
        **keyed,
    )
    refusals(op, variant)
    triton = triton_runs(q)
    door = door_for(q, grad, normed, triton)
    # broadcast views start where their tensors do, so a launch can take cos and sin as given with
    # these strides; unless validation had to copy them (cos and sin strides differ): then again per call
    copied = (
        door != CUSTOM_OP
        and not torch.compiler.is_compiling()
        and (cos_v.data_ptr() != cos.data_ptr() or sin_v.data_ptr() != sin.data_ptr())
    )
    sec = cos_v.stride(0) if mode else 0
    token = cos_v[0] if mode else cos_v
    n_tok = q.dim() - 2
    token_strides = (token.stride(0), token.stride(1)) if n_tok == 2 else (0, token.stride(0))
    return Spec(
        variant,
        2 * cos_v.shape[-1],
        door,
        triton,
        copy_angles=copied,
        angle_shape=tuple(cos_v.shape),
        angle_strides=(sec, *token_strides, cos_v.stride(-1)),
        inplace=bool(inplace),
        norm_eps=float(norm[0]),
        norm_offset=float(norm[1]),
        settled=settled,
    )


def angles_call(spec: Spec, q, k, cos, sin, wq, wk) -> None:
    """rotate_angles' address checks of this call (in place: q and k against what is read)."""
    if spec.inplace and spec.door is not CUSTOM_OP:
        read = (("cos", cos), ("sin", sin), ("q_norm_weight", wq), ("k_norm_weight", wk))
        aliasing.inplace_aliasing("rotate_with_angles", q, k, read)


# ---------------------------------------------------------------------------------------------
# apply_rope_and_store

STORE = "apply_rope_and_store"


def store(args: dict) -> Spec:
    """apply_rope_and_store's Spec, for the store's own tensors (the public op has made its views:
    MLA's parts, 3-D caches, strided last dims read through copies)."""
    op = STORE
    q, k, v, positions = args["q"], args["k"], args["v"], args["positions"]
    k_cache, v_cache, slot_mapping = args["k_cache"], args["v_cache"], args["slot_mapping"]
    cu_seqlens, cp_size, cp_rank = args["cu_seqlens"], args["cp_size"], args["cp_rank"]
    mrope_section, mrope_interleaved = args["mrope_section"], args["mrope_interleaved"]
    q_out, q_scale, write_key = args["q_out"], args["q_scale"], args["write_key"]
    weights = (args["q_norm_weight"], args["k_norm_weight"])
    # GQA / MHA's key in two parts beside v (MLA's k_nope, v None, has taken v's place before)
    q_nope, k_nope = args["q_nope"], args["k_nope"]
    packed = (1, 0)
    if cu_seqlens is not None or not (cp_size == 1 and cp_rank == 0):
        packed = rules.packed_args(op, q, positions, cu_seqlens, cp_size, cp_rank, mrope_section)
    rot, mrope, k_scale, v_scale = rules.store_args(
        op,
        q,
        k,
        v,
        positions,
        args["cos_sin_cache"],
        k_cache,
        v_cache,
        slot_mapping,
        rotary_dim=args["rotary_dim"],
        k_scale=args["k_scale"],
        v_scale=args["v_scale"],
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        mrope_layout=args["mrope_layout"],
        packed=cu_seqlens is not None,
        k_nope=k_nope,
        cache_scales=(args["k_cache_scales"], args["v_cache_scales"]),
    )
    fp4 = rules.is_nvfp4(k_cache, v_cache, (args["k_cache_scales"], args["v_cache_scales"]))
    if q_nope is not None:
        if q_out is None:
            fail(op, "q_nope", "None without q_out (q_out receives the rotated q and q_nope after it)", "a tensor")
        rules.nope_part(op, "q_nope", q_nope, q, rot)
    rules.store_outputs(op, q, k, q_out, q_scale, write_key, q_nope=q_nope)
    modes = store_norm_modes(q, k, *weights, args["norm_eps"], args["norm_weight_offset"], args["l2_norm"])
    for name, part, weight, mode in (
        ("q_nope", q_nope, "q_norm_weight", modes[0]),
        ("k_nope", k_nope, "k_norm_weight", modes[1]),
    ):
        if part is not None and mode != NORM_NONE:
            weight = "l2_norm=True" if mode == NORM_UNIT else weight
            fail(op, name, f"None with {weight} (the norm covers a whole head, not one given in two parts)", "a tensor")
    if cu_seqlens is not None:
        angle_source, a = "packed", cu_seqlens
    else:
        angle_source, a = ("table" if positions is not None else "arange"), positions
    # M-RoPE needs its (N, *T) positions
    mrope_fields = _mrope_code(mrope if positions is not None else None)
    il = bool(args["interleaved"])
    halves = rules.rotary_position_arg(op, args["rotary_position"], allowed=("first", "halves")) == "halves"
    if fp4:
        nvfp4_pairs(op, q, rot, il, halves)
    if halves:
        rules.halves_args(op, q, k, il)
        for name, part in (("q_nope", q_nope), ("k_nope", k_nope)):
            if part is not None:  # p-RoPE's pairs span the whole head: no part of it is apart
                fail(op, name, "None with rotary_position='halves' (its pairs span the whole head)", "a tensor")
    variant = Variant(
        interleaved=il,
        out_interleaved=il,
        **mrope_fields,
        rope_halves=halves and k.shape[-1] > rot,  # whole heads: the usual variant
        nope_q=q_nope is not None,
        nope_k=k_nope is not None,
        angles=angle_source,
        norm_q=modes[0],
        norm_k=modes[1],
        scaled=scaled_by(q_scale),
        q_out=q_out is not None,
        write_key=bool(write_key),
        k_scaled=scaled_by(k_scale),
        v_scaled=scaled_by(v_scale),
        fp4=fp4,
    )
    refusals(op, variant)
    spec = store_spec(args, variant, rot, packed, door_for(q, False), a)
    spec.norm_eps, spec.norm_offset = float(args["norm_eps"]), float(args["norm_weight_offset"])
    return spec


def nvfp4_pairs(op, q, rot: int, interleaved: bool, halves: bool) -> None:
    """NVFP4 caches quantize the rotated pairs as the kernel holds them: every 16-value block must lie
    within the rotated dims or the tail, and within one half of a half-split head. Eager plain
    tensors only: the custom ops' schema (DTensor, meta tensors, torch.compile) has no block scales."""
    if door_for(q, False) == CUSTOM_OP or torch.compiler.is_compiling():
        what = "meta" if q.device.type == "meta" else type(q).__name__
        if torch.compiler.is_compiling():
            what = "a call traced by torch.compile"
        fail(op, "k_cache", "NVFP4 caches with plain tensors called eagerly (not DTensor, meta or compiled)", what)
    if halves:
        fail(op, "rotary_position", "'first' with NVFP4 caches (p-RoPE's kept dims split the blocks)", "'halves'")
    step = 16 if interleaved else 32
    if rot % step:
        what = "pairs (2i, 2i+1)" if interleaved else "halves"
        fail(op, "rotary_dim", f"a multiple of {step} with NVFP4 caches and {what} (16-value blocks)", rot)


def store_spec(args: dict, variant: Variant, rot: int, packed, door: str, a) -> Spec:
    """The Spec of a validated store call (the public op's, or a custom op's for its local tensors)."""
    t = (args["q"], args["k"], args["v"], args["k_cache"], args["v_cache"], a, args["cos_sin_cache"])
    t += (args["slot_mapping"], args["q_out"], args["q_norm_weight"], args["k_norm_weight"], args["q_nope"])
    t += (args["k_nope"],)
    return Spec(variant, rot, door, triton_runs(args["q"]), extents=aliasing.store_extents(*t), packed=packed)


def store_norm_modes(q, k, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset, l2_norm=False) -> tuple:
    """(norm_q, norm_k) of the store's norm arguments: NORM_NONE without weights or l2_norm;
    inference only."""
    if q_norm_weight is None and k_norm_weight is None and l2_norm is False:
        return NORM_NONE, NORM_NONE
    modes = rules.norm_weights(STORE, q, k, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset, l2=l2_norm)
    if torch.is_grad_enabled():
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w is not None and w.requires_grad:
                fail(STORE, name, "a tensor that does not require grad (apply_rope_and_store is inference only)", True)
    return modes


def store_weights(variant: Variant, q, k, wq, wk, qn, kn) -> None:
    """A custom store op's norm weights against the encoded norm modes and the (local) tensors: a
    weight per mode, of D elements per head or H*D across heads (the kernel reads that many); its
    no-rope parts exactly where the variant says (the kernel reads them then)."""
    for name, part, given in (("q_nope", qn, variant.nope_q), ("k_nope", kn, variant.nope_k)):
        if (part is not None) != given:
            fail(STORE, name, f"{'a tensor' if given else 'None'} (as the variant says)", type(part).__name__)
    for name, w, x, mode in (("q_norm_weight", wq, q, variant.norm_q), ("k_norm_weight", wk, k, variant.norm_k)):
        want = {NORM_HEAD: x.shape[-1], NORM_TOKEN: x.shape[-2] * x.shape[-1]}.get(mode)
        got = None if w is None else w.numel()
        if got != want:
            what = "None" if want is None else f"a tensor of {want} elements"
            fail(STORE, name, f"{what} (norm mode {mode} of the variant)", "None" if w is None else f"{got}")


def store_call(spec: Spec, t) -> None:
    """The store's checks of this call's addresses (and data in strict mode), before any write.
    t: the run's operands (ropekit.core.run.StoreOperands)."""
    if strict.mode.on:
        if spec.variant.angles == "packed":
            strict.packed_values(STORE, t.a, t.q.shape[0], spec.packed[0])
        elif t.a is not None:
            strict.positions_in_range(STORE, t.a, t.table.shape[0])
        num_slots = t.k_cache.shape[0] * (t.k_cache.shape[1] if t.k_cache.dim() == 4 else 1)
        strict.slots_in_range(STORE, t.slot_mapping, num_slots)
        strict.slots_unique(STORE, t.slot_mapping)
        for name, scale in (("k_scale", t.ks), ("v_scale", t.vs), ("q_scale", t.qs)):
            if scale is not None:
                strict.scale_value(STORE, name, scale)
    # the address checks' verdict depends on the addresses alone (the spec fixes every layout):
    # the addresses that passed are kept (a bounded set per spec), so a decode loop that passes
    # buffers it passed before (a static cache per layer, reused activations) pays for the
    # addresses and one lookup (pipeline.store_record reads the same set)
    # which operands are given is fixed by the signature: a getter of those, made once per spec
    given = spec.plans.get("given operands")
    if given is None:
        given = spec.plans["given operands"] = _given(t)
    addrs = []
    for x in given(t):
        addrs.append(x.data_ptr())
    addrs = tuple(addrs)
    checked = spec.plans.get("checked addresses") or _checked(spec)  # no call once one passed
    if addrs in checked:
        return
    write_key = spec.variant.write_key
    ext = spec.extents
    aliasing.store_aliasing(
        STORE, t.q, t.k, t.v, t.k_cache, t.v_cache, extents=ext, memo=spec.alias, q_out=t.q_out, write_key=write_key
    )
    packed = spec.variant.angles == "packed"
    # written (q's place taken by q_out when given; k with write_key) against the read-only inputs
    written = [("q", t.q) if t.q_out is None else ("q_out", t.q_out), ("k_cache", t.k_cache), ("v_cache", t.v_cache)]
    read = [("cu_seqlens" if packed else "positions", t.a), ("cos_sin_cache", t.table)]
    read += [("slot_mapping", t.slot_mapping), ("k_scale", t.ks), ("v_scale", t.vs)]
    # scales: one float32
    extents = [ext[0] if t.q_out is None else ext[8], ext[1], ext[2]]
    tail = [ext[5], ext[6], ext[7], 0 if t.ks is None else 4, 0 if t.vs is None else 4]
    if write_key:
        written.append(("k", t.k))
        extents.append(ext[3])
    if t.qs is not None:
        read.append(("q_scale", t.qs))
        tail.append(4)
    if t.wq is not None or t.wk is not None:
        read += [("q_norm_weight", t.wq), ("k_norm_weight", t.wk)]
        tail += [ext[9], ext[10]]
    if t.qn is not None or t.kn is not None:
        read += [("q_nope", t.qn), ("k_nope", t.kn)]
        tail += [ext[11], ext[12]]
    aliasing.written_vs_read(STORE, written, read, extents=extents + tail)
    if spec.variant.fp4:
        # the block scales are written too: apart from each other and from every other tensor
        scales = [("k_cache_scales", t.kcs), ("v_cache_scales", t.vcs)]
        others = [("q", t.q), ("k", t.k), ("v", t.v), ("k_cache", t.k_cache), ("v_cache", t.v_cache)]
        others += [("q_out", t.q_out), *read]
        aliasing.written_vs_read(STORE, scales[:1], scales[1:] + others)
        aliasing.written_vs_read(STORE, scales[1:], others)
    _passed(checked, addrs)


_CHECKED = 256  # address tuples kept per spec (a layer's buffers each: a model's layers fit)


def _checked(spec: Spec) -> set:
    """The address tuples whose aliasing checks passed for this spec (the verdict depends on the
    addresses alone: the spec fixes every layout and extent)."""
    checked = spec.plans.get("checked addresses")
    if checked is None:
        checked = spec.plans["checked addresses"] = set()
    return checked


def _passed(checked: set, addrs: tuple) -> None:
    """addrs passed: kept in checked, which is emptied when full (it stays bounded)."""
    if len(checked) >= _CHECKED:
        checked.clear()
    checked.add(addrs)


def _given(t) -> itemgetter:
    """A getter of the store operands that are not None (q, k, v, the table, the caches and the
    slots always are: a tuple of at least two)."""
    where = []
    for i, x in enumerate(t):
        if x is not None:
            where.append(i)
    return itemgetter(*where)


# ---------------------------------------------------------------------------------------------
# rerotate_kv_cache

REROTATE = "rerotate_kv_cache"


def rerotate(args: dict) -> Spec:
    """rerotate_kv_cache's Spec (names the first bad argument)."""
    op = REROTATE
    k_cache, slots, delta, table = args["k_cache"], args["slots"], args["delta"], args["cos_sin_cache"]
    dst_slots, positions, to_cache = args["dst_slots"], args["positions"], args["to_cache"]
    if not torch.compiler.is_compiling():
        rules.no_dtensor(op, "re-rotation", ("k_cache", k_cache))
    rot, _, k_scale, _ = rules.rerotate_args(
        op,
        k_cache,
        slots,
        delta,
        table,
        interleaved=args["interleaved"],
        rotary_dim=args["rotary_dim"],
        k_scale=args["k_scale"],
        dst_slots=dst_slots,
        positions=positions,
        to_cache=to_cache,
    )
    il = bool(args["interleaved"])
    halves = rules.rotary_position_arg(op, args["rotary_position"], allowed=("first", "halves")) == "halves"
    if halves:
        rules.halves_args(op, k_cache, None, il, q_name="k_cache")
    variant = Variant(
        il,
        il,
        angles="delta",
        rope_halves=halves and k_cache.shape[-1] > rot,
        k_scaled=scaled_by(k_scale),
        to_dst=dst_slots is not None,
        two_tables=to_cache is not None,
    )
    refusals(op, variant)
    return Spec(variant, rot, door_for(k_cache, False), triton_runs(k_cache), extents=rerotate_extents(args))


def rerotate_extents(args: dict) -> tuple:
    """Byte extents of the re-rotation's tensors but the scale, in `aliasing.rerotate_aliasing`'s order."""
    names = ("k_cache", "slots", "dst_slots", "delta", "cos_sin_cache", "positions", "to_cache")
    return tuple(aliasing.extent(args[n]) for n in names)


def rerotate_call(
    spec: Spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table
) -> tuple:
    """The re-rotation's checks of this call's addresses and values (an int shift's range on every
    call, free; tensors' values in strict mode), before any write. Returns the addresses of
    (k_cache, slots, delta, table, k_scale, dst_slots, positions, to_table), 0 for None (the
    launch record's, pipeline.rerotate_record)."""
    to_rows = None if to_table is None else to_table.shape[0]
    if delta_int is not None:  # its range, inline (no call on the steady path); int_shift names a bad one
        rows = table.shape[0]
        if not -rows < delta_int < (rows if to_rows is None else to_rows):
            strict.int_shift(REROTATE, delta_int, rows, to_rows)
    # the address checks' verdict depends on the addresses alone (the spec fixes every layout):
    # buffers passed before (a static cache per layer, a reused slot list) cost the addresses and
    # one lookup
    addrs = []
    for x in (k_cache, slots, delta, table, k_scale, dst_slots, positions, to_table):
        addrs.append(0 if x is None else x.data_ptr())
    addrs = tuple(addrs)
    checked = spec.plans.get("checked addresses") or _checked(spec)  # no call once one passed
    if addrs not in checked:
        extents = None
        if spec.extents:
            extents = spec.extents + (0 if k_scale is None else 4,)  # a scale is one float32
        aliasing.rerotate_aliasing(
            REROTATE, k_cache, slots, delta, table, k_scale, dst_slots, positions, to_table, extents=extents
        )
        _passed(checked, addrs)
    if strict.mode.on:
        num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
        shifts = delta if delta is not None else delta_int
        strict.rerotate_values(REROTATE, slots, shifts, dst_slots, num_slots, table.shape[0], positions, to_rows)
        if k_scale is not None:
            strict.scale_value(REROTATE, "k_scale", k_scale)
    return addrs
