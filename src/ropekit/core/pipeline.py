"""One call of every op, written once: prepare (the validated spec of the call's signature), then
the direct door (eager, nothing to record): the launch plan of the spec filled with this call's
pointers and launched.

    prepare(sig, leading, kw, check)   -> (spec, door): the signature key, the memoized spec (the
                                          op's entry in ropekit.core.checks validates a new one)
    rotate_direct / run_rotate         the rotation (run_rotate: every door's forward, and the
                                          backward with Variant.backward())
    run_norm_backward                  a normed rotation's backward, one tensor (q or k) at a time
    store_direct / run_store           the fused RoPE + KV-cache store
    rerotate_direct / run_rerotate     the re-rotation of cached keys

The steady-state eager call is: the public op (ropekit.api.*) -> prepare -> the op's per-call
checks (ropekit.core.checks.*_call, called by the op, or inside the custom op when it runs)
-> the direct door -> its run step -> ropekit.core.launch: six functions in four files, counted
by `python -m ropekit.tools.call_path` and held by tests/ops/test_call_path.py.
So this path calls no helper per argument: keys are built in a loop here, strict mode is an
attribute read, and no comprehension runs (each is a frame of its own before Python 3.12).
The autograd Function and the torch.library custom ops (ropekit.core.dispatch) run the same run
steps. Tensors on CPU without Triton take the PyTorch path (ropekit.core.run).
"""

from __future__ import annotations

from functools import reduce
from itertools import compress, repeat
from operator import is_, is_not, itemgetter, or_

import torch

from . import cpu, plans, run
from .launch import launch
from .memo import MEMO, remember
from .variant import TRACED, Signature, Spec, Variant, arg_key

_Tensor = torch.Tensor
_SCALARS = frozenset((bool, int, float, str, torch.dtype, type(None)))
_SIMPLE = _SCALARS | {_Tensor, type}  # a type: a re-rotation's int shift is keyed by `int`
_TENSOR = repeat(_Tensor)
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_increment_version = torch._C._increment_version  # of a list of tensors (torch.autograd.graph's, minus a frame)
_RECENT = 8  # recent signatures an op tries before its memo (a model's layers share a few)
try:  # torch's compiled check of a tensor's dtype, device, dispatch keys, shape, strides, requires_grad
    from torch._C._dynamo.guards import TensorGuards as _GUARDS
except ImportError:
    _GUARDS = None


def prepare(sig: Signature, leading: tuple, keywords: tuple, check, keyed: tuple = None):
    """(spec, door) of a call: the spec validated once per signature (`check(args) -> Spec`, the
    op's entry in ropekit.core.checks, given the arguments by name) and memoized; the door its
    spec's, or while tracing (torch.compile: validated afresh, no memo) TRACED. leading, keywords:
    the op's positional and keyword-only arguments, in signature order (variant.Signature). keyed:
    the positional arguments as the key reads them, when a value must not be part of it (a
    re-rotation's int shift: checked on every call, keyed by its type).

    The signature: grad mode, which keywords differ from their defaults (one identity test each),
    each other argument with its type (16 and 16.0 hash alike but validate differently), and each
    tensor's (shape, strides, dtype, device, requires_grad). Its recent signatures (sig.recent)
    are tried first: the types, the changed keywords and grad mode compared as they are, the other
    values picked by the entry's own getter (the types fix where the tensors are) and compared as
    a tuple, the tensors by torch's compiled tensor guards (one C call, the check torch.compile's
    guards make); a miss builds the full key and looks it up in the memo."""
    if _is_compiling():
        return check(sig.arguments(leading, keywords)), TRACED
    tensors = pattern = None
    try:
        given = leading if keyed is None else keyed
        # the indices of the keywords set, in one pass; their values join the positional ones
        changed = tuple(compress(sig.indices, map(is_not, keywords, sig.defaults)))
        for i in changed:
            given += (keywords[i],)
        types = tuple(map(type, given))
        grad = _grad_enabled()
        if _SIMPLE.issuperset(types):  # plain tensors and scalars: no Python loop over them
            # an entry: (types, changed, grad, its others' getter, their values, its tensors' getter,
            # the tensors' guards, spec); the types fix where the tensors are, so equal types let the
            # entry's getters pick the others and the tensors out of this call's arguments (an
            # entry of equal types is a simple signature's: it has its getters)
            for e_types, e_changed, e_grad, pick, values, pick_tensors, guards, spec in sig.recent:
                if (
                    e_types == types
                    and e_changed == changed
                    and e_grad is grad
                    and pick(given) == values
                    and guards.check(*pick_tensors(given))
                ):
                    return spec, spec.door
            tensors = tuple(compress(given, map(is_, types, _TENSOR)))
            others = tuple(compress(given, map(is_not, types, _TENSOR)))
        else:  # a tensor subclass or a sequence: its own key (variant.arg_key)
            tensors, others = [], []
            for x, t in zip(given, types):
                if t is _Tensor:
                    tensors.append(x)
                else:
                    others.append(x if t in _SCALARS else arg_key(x))
            others = tuple(others)
            # an entry of equal types is such a signature's: it keeps the keyed values, no getters
            for e_types, e_changed, e_grad, _, values, _, guards, spec in sig.recent:
                if e_types == types and e_changed == changed and e_grad is grad and values == others:
                    if guards.check(*tensors):
                        return spec, spec.door
        pattern = (grad, changed, types, others)
        key = [sig.op, pattern]
        for x in tensors:
            key.append((x.shape, x.stride(), x.dtype, x.device, x.requires_grad))
        key = tuple(key)
        spec = MEMO.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: validation names them
        key = spec = pattern = None
    if spec is None:
        spec = check(sig.arguments(leading, keywords))
        if spec.settled:
            remember(key, spec)
    elif _GUARDS is not None:  # a signature seen twice: tried first from now on
        try:
            guards = _GUARDS(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        except Exception:  # a torch whose guards differ: the memo alone
            guards = None
        if guards is not None:
            sig.recent.insert(0, _entry(pattern, guards, spec))
            del sig.recent[_RECENT:]
    return spec, spec.door


def _getter(positions: list):
    """A C getter of those positions of an argument tuple, always giving a tuple."""
    if len(positions) == 1:
        return itemgetter(slice(positions[0], positions[0] + 1))
    return itemgetter(*positions) if positions else itemgetter(slice(0, 0))


def _entry(pattern: tuple, guards, spec: Spec) -> tuple:
    """A recent-signature entry of prepare (off the steady path: made once per signature)."""
    grad, changed, types, others = pattern
    if not _SIMPLE.issuperset(types):
        return (types, changed, grad, None, others, None, guards, spec)
    where = {True: [], False: []}
    for i, t in enumerate(types):
        where[t is _Tensor].append(i)
    return (types, changed, grad, _getter(where[False]), others, _getter(where[True]), guards, spec)


# ---------------------------------------------------------------------------------------------
# the rotation: (spec, q, k, a, b, weights, scales, q_out, k_out) -> (q_out, k_out)


def rotate_direct(spec: Spec, q, k, a, b, weights, scales, q_out=None, k_out=None):
    """The rotation's direct door: outputs allocated (or given), one run. (a, b): the angle
    operands (run_rotate's); weights: (q's, k's) norm weights; scales: (q's, k's) scale tensors."""
    if spec.normed and not spec.triton:  # the CPU path: torch ops, which autograd records
        outs = run.norm_rotated(spec, spec.variant, q, k, a, b, weights, spec.out_dtype, scales)
        return run.into(outs, *((q, k) if spec.inplace else (q_out, k_out)))
    w = weights if spec.normed else None
    if spec.inplace:
        run_rotate(spec, spec.variant, q, k, q, k, a, b, None, None, w)
        # the kernels write through raw pointers, which autograd does not see: anything that saved
        # q or k for a backward then raises instead of computing with rotated values
        _increment_version([q] if k is None else [q, k])
        return q, k
    if q_out is None:
        q_out = run.empty_like(q, dtype=spec.out_dtype)
    if k_out is None and k is not None:
        k_out = run.empty_like(k, dtype=spec.out_dtype)
    run_rotate(spec, spec.variant, q, k, q_out, k_out, a, b, None, scales, w)
    return q_out, k_out


def run_rotate(
    spec: Spec, variant: Variant, q, k, q_out, k_out, a, b, layout_key=None, scales=None, weights=None
) -> None:
    """q -> q_out and k -> k_out (outputs may be the inputs: in place), rotated as `variant` says.

    (a, b): (positions or None, [cos | sin] table) for table / arange angles, (cu_seqlens, table)
    for packed ones, (positions, inverse frequencies) for computed ones, (cos, sin) for per-token
    angles. layout_key: None when the outputs' layout follows from the spec's signature (forward
    calls), else a key of the tensors' layouts (gradients). With variant.heads_first the tensors
    are Hugging Face's (B, H, S, D) views; a launch needs only their addresses.
    scales: with variant.scaled, (q's, k's) float32 scalar tensors the outputs are divided by.
    weights: with variant.normed, (q's, k's) RMSNorm weights (None where that tensor is not
    normalized); eps and offset are the spec's. The CPU path of a normed variant is `run.norm_rotated`.

    The plan's pointer slots, in rope_kernel's order: q, k, q_out, k_out, positions, cos, sin,
    q's scale, k's scale; a slot the plan never reads gets a tensor of the same pointer type."""
    if not spec.triton:
        run.rotate_cpu(spec, variant, q, k, q_out, k_out, a, b, scales)
        return
    forward = variant is spec.variant and layout_key is None
    plan = spec.plan if forward else spec.plans.get((variant, layout_key))
    if plan is None:
        hf = variant.heads_first
        plan = plans.plan_rotate(
            run.heads_first(q, hf),
            run.heads_first(k, hf),
            run.heads_first(q_out, hf),
            run.heads_first(k_out, hf),
            plans.angle_layout(variant, spec.rot, a, b, spec.angle_strides, spec.packed),
            variant,
            spec.q_temperature,
        )
        if forward:
            spec.plan = plan if plan is not None else False
        else:
            spec.plans[(variant, layout_key)] = plan
    if not plan:  # an empty call: nothing to write
        return
    meta = plan.meta
    if meta["HAS_POS"] or meta["FREQS"]:  # positions; a table, or the inverse frequencies
        pos, cos, sin = a, b, b
    elif a is None:  # arange: the table alone
        pos, cos, sin = b, b, b
    else:  # per-token angles
        pos, cos, sin = a, a, b
    # each operand's address read once (the pair-alignment test and the launch share them)
    qa = q.data_ptr()
    ka = qa if k is None else k.data_ptr()
    if q_out is q:  # in place
        qoa, koa = qa, ka
    else:
        qoa = q_out.data_ptr()
        koa = qoa if k_out is None else k_out.data_ptr()
    pa = pos.data_ptr()
    sa = pa if sin is pos else sin.data_ptr()
    ca = pa if cos is pos else sa  # cos is the positions' tensor or the sin one (the three cases above)
    if scales is None:  # the scale slots get the sin tensor, never read
        qs = ks = sin
        qsa = ksa = sa
    else:
        qs = scales[0]
        ks = qs if scales[1] is None else scales[1]
        qsa = qs.data_ptr()
        ksa = ks.data_ptr()
    if plan.pack_bytes and (qa | qoa | ka | koa) % plan.pack_bytes:
        meta = dict(meta, PACK=0)  # a base pointer off the pair alignment: the element path
    ptrs = (q, q if k is None else k, q_out, q_out if k_out is None else k_out, pos, cos, sin, qs, ks)
    addrs = (qa, ka, qoa, koa, pa, ca, sa, qsa, ksa)
    bits = qa | ka | qoa | koa | pa | sa | qsa | ksa  # ca is pa or sa
    if weights is None:
        kernel = plans.kernel("rope_kernel")
        launch(kernel, plan.compiled, meta["PACK"], plan.grid, ptrs, plan.args, meta, addrs=addrs, bits=bits)
        return
    wq, wk = weights
    wq, wk = (wk if wq is None else wq), (wq if wk is None else wk)
    if wq is None:  # l2_norm: no weight, never read (its slots get the sin tensor)
        wq = wk = sin
    if wq.dtype != wk.dtype:
        # q and k share one code path that selects the weight's pointer, and a select needs one
        # pointer type: weights of two dtypes are read as float32 (exact; a (D,) or (H*D,) copy)
        wq, wk = wq.float(), wk.float()
    wa, wb = wq.data_ptr() % 16, wk.data_ptr() % 16
    if meta["W_PAIRS"] and (wa or wb):
        meta = dict(meta, W_PAIRS=False)  # a weight off the 16-byte grid: its element loads
    # weights follow the ints (kernel order): their 16-byte alignment is part of the compiled key
    args = (*plan.args, wq, wk, spec.norm_eps, spec.norm_offset)
    kernel = plans.kernel("rope_kernel")
    launch(kernel, plan.compiled, (meta["PACK"], wa, wb), plan.grid, ptrs, args, meta, addrs=addrs, bits=bits)


def run_norm_backward(spec: Spec, variant: Variant, x, g, w, mode: int, a, b):
    """(gradient of x, of w) for one tensor of a normed variant (mode: its NORM_* mode) given its
    output gradient g: rope_norm_backward_kernel, or on the CPU path the formulas."""
    if not spec.triton:
        cos, sin = run.token_angles(spec, variant, a, b, tuple(x.shape[:-2]))
        if variant.inverse:
            sin = -sin
        gx, dw = cpu.norm_rotate_backward(
            x,
            g,
            run.unit_weight(w, mode, x),
            cos,
            sin,
            interleaved=variant.interleaved,
            eps=spec.norm_eps,
            offset=spec.norm_offset,
            halves=variant.rope_halves,
        )
        return gx, (None if w is None else dw)  # l2_norm's unit weight is no argument: no gradient
    hf = variant.heads_first
    gx = run.out_like(x)  # x and g of any last stride are read through it (the kernel's STRIDED)
    key = ("norm backward", mode, x.shape, x.stride(), g.stride(), None if w is None else w.stride())
    plan = spec.plans.get(key)
    if plan is None:
        plan = spec.plans[key] = plans.plan_norm_backward(
            run.heads_first(x, hf),
            run.heads_first(g, hf),
            run.heads_first(gx, hf),
            w,
            plans.angle_layout(variant, spec.rot, a, b, spec.angle_strides, spec.packed),
            variant,
            mode,
        )
    if plan is None:  # nothing to write (no token or no head)
        return gx.zero_(), (None if w is None else torch.zeros_like(w))
    dw = None if w is None else plans.norm_partials(plan, x.device)
    plans.fire_norm_backward(plan, x, g, gx, w, dw, a, b, spec.norm_eps, spec.norm_offset)
    return gx, (None if w is None else plans.norm_weight_grad(dw, w))


# ---------------------------------------------------------------------------------------------
# the fused store


def store_direct(spec: Spec, t: run.StoreOperands) -> None:
    """The store's direct door (eager with or without autograd: the store records no graph), after
    this call's checks (checks.store_call, by the caller): the run, the written tensors' versions
    moved."""
    run_store(spec, t)
    written = [t.q if t.q_out is None else t.q_out, t.k_cache, t.v_cache]
    if spec.variant.fp4:
        written += [t.kcs, t.vcs]
    if spec.variant.write_key:
        written.append(t.k)
    _increment_version(written)


def run_store(spec: Spec, t: run.StoreOperands) -> None:
    """The store's run step: q rotated in place (or into q_out), rotated k and v into their cache
    rows (and rotated k back into k with write_key), q and k normalized first when the variant says
    so. The Triton launch (plan made once per spec), or the PyTorch path on CPU tensors.

    rope_store_kernel's pointer slots: q, k, v, positions, table, slots, k cache, v cache, k's
    scale, v's scale, q_out, q's scale, the norm weights, the no-rope parts, NVFP4's block scales;
    a slot the plan never reads (unscaled, unnormalized) points at the table."""
    if not spec.triton:
        run.store_cpu(spec, t)
        return
    plan = spec.plans.get(None)
    if plan is None:
        plan = spec.plans[None] = plans.plan_store(t, spec.variant, spec.rot, spec.packed)
        if plan is None:
            spec.plans[None] = False
    if not plan:  # an empty call
        return
    meta = plan.meta
    # the kernel's pointers picked out of the operands by getters (which are None is fixed by the
    # signature): each distinct operand's address read once, then spread over its slots
    slots = spec.plans.get("store slots")
    if slots is None:
        slots = spec.plans["store slots"] = _store_slots(t)
    pick, pick_distinct, spread = slots
    ptrs = pick(t)
    distinct = tuple(map(_data_ptr, pick_distinct(t)))
    bits = reduce(or_, distinct)
    addrs = spread(distinct)
    if meta["PACK_Q"] and (addrs[_Q] | addrs[_Q_OUT]) % (meta["PACK_Q"] // 8):
        meta = dict(meta, PACK_Q=0)  # a view may start at an odd element: the element path
    if meta["PACK_K"] and (addrs[_K] | addrs[_K_CACHE]) % (meta["PACK_K"] // 8):
        meta = dict(meta, PACK_K=0)
    args = (*plan.args, spec.norm_eps, spec.norm_offset)
    kernel = plans.kernel("rope_store_kernel")
    variant = (meta["PACK_Q"], meta["PACK_K"])
    launch(kernel, plan.compiled, variant, plan.grid, ptrs, args, meta, addrs=addrs, bits=bits)


# rope_store_kernel's pointer slots by operand name, and what an absent operand's slot points at
_STORE_SLOTS = ("q", "k", "v", "a", "table", "slot_mapping", "k_cache", "v_cache", "ks", "vs", "q_out", "qs")
_STORE_SLOTS += ("wq", "wk", "qn", "kn", "kcs", "vcs")
# the slots the pair-alignment tests read (q_out's holds q when there is no q_out)
_Q, _Q_OUT, _K, _K_CACHE = (_STORE_SLOTS.index(n) for n in ("q", "q_out", "k", "k_cache"))
_data_ptr = torch.Tensor.data_ptr


def _store_slots(t: run.StoreOperands) -> tuple:
    """Getters of rope_store_kernel's pointers from the store's operands: (the slots' tensors, the
    distinct ones among them, the slots' addresses from the distinct ones' addresses). q_out's slot
    gets q when q_out is None, any other absent operand's slot the table (never read)."""
    where = []
    for name in _STORE_SLOTS:
        if getattr(t, name) is None:
            name = "q" if name == "q_out" else "table"
        where.append(t._fields.index(name))
    distinct = sorted(set(where))  # q, k, the table, slot_mapping and k_cache at least: getters of tuples
    return itemgetter(*where), itemgetter(*distinct), itemgetter(*(distinct.index(i) for i in where))


# ---------------------------------------------------------------------------------------------
# the re-rotation


def rerotate_direct(spec: Spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table):
    """The re-rotation's direct door, after this call's checks (checks.rerotate_call, by the
    caller): the run, the cache's version moved."""
    run_rerotate(spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table)
    _increment_version([k_cache])


def run_rerotate(spec: Spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table) -> None:
    """Rows of k_cache rotated by the angle of delta (a tensor, or the int delta_int); with
    spec.variant.two_tables, from table row positions to to_table row positions + delta.

    rerotate_kernel's pointer slots: the cache, slots, destination slots, delta, the table, k's
    scale, positions, the second table; a slot the plan never reads points at slots or the table."""
    if not spec.triton:
        run.rerotate_cpu(spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table)
        return
    plan = spec.plans.get(None)
    if plan is None:
        plan = plans.plan_rerotate(k_cache, slots, delta, table, dst_slots, spec.variant, spec.rot, positions, to_table)
        spec.plans[None] = plan if plan is not None else False
    if not plan:  # an empty call
        return
    ptrs = (
        k_cache,
        slots,
        slots if dst_slots is None else dst_slots,
        slots if delta is None else delta,
        table,
        table if k_scale is None else k_scale,
        slots if positions is None else positions,
        table if to_table is None else to_table,
    )
    # an int shift travels as int32 (one compiled kernel for every value): a |delta| past 2^31 - 1 is
    # past any table anyway, and stays past it when clamped
    value = 0 if delta_int is None else max(-(2**31 - 1), min(2**31 - 1, delta_int))
    launch(plans.kernel("rerotate_kernel"), plan.compiled, (), plan.grid, ptrs, (value, *plan.args), plan.meta)
