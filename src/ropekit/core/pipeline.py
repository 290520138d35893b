"""One call of every op, written once: prepare (the validated spec of the call's signature), then
the direct door (eager, nothing to record): the launch plan of the spec filled with this call's
pointers and launched.

    prepare(sig, leading, kw, check)   -> (spec, door): the signature key, the memoized spec (the
                                          op's entry in ropekit.core.checks validates a new one)
    rotate_direct / run_rotate         the rotation (run_rotate: every door's forward, and the
                                          backward with Variant.backward())
    rotate_record                      a direct rotation's steady state: its launch record
    run_norm_backward                  a normed rotation's backward, one tensor (q or k) at a time
    store_direct / run_store           the fused RoPE + KV-cache store (store_record: its record)
    rerotate_direct / run_rerotate     the re-rotation of cached keys (rerotate_record: its record)

The steady-state eager call is: the public op (ropekit.api.*) -> prepare -> the op's per-call
checks (ropekit.core.checks.*_call, called by the op, or inside the custom op when it runs)
-> the direct door -> its run step -> ropekit.core.launch: six functions in four files, counted
by `python -m ropekit.tools.call_path` and held by tests/ops/test_call_path.py.
So this path calls no helper per argument: keys are built in a loop here, strict mode is an
attribute read, and no comprehension runs (each is a frame of its own before Python 3.12).
Each op's direct door keeps a launch record once its kernel is compiled; the spec's later calls
take it after prepare (the op, prepare, the record; the re-rotation's after its call checks), and
any call it does not serve goes the path above. The autograd Function and the torch.library custom ops
(ropekit.core.dispatch) run the same run steps. Tensors on CPU without Triton take the PyTorch
path (ropekit.core.run).
"""

from __future__ import annotations

from functools import reduce
from itertools import compress, repeat
from marshal import dumps as _dumps
from operator import is_, is_not, itemgetter, or_

import torch

from . import checks, cpu, plans, run
from . import launch as launching
from .launch import launch
from .memo import MEMO, remember
from .variant import DIRECT, TRACED, Signature, Spec, Variant, arg_key

_Tensor = torch.Tensor
_SCALARS = frozenset((bool, int, float, str, torch.dtype, type(None)))
_SIMPLE = _SCALARS | {_Tensor, type}  # a type: a re-rotation's int shift is keyed by `int`
_TENSOR = repeat(_Tensor)
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_increment_version = torch._C._increment_version  # of a list of tensors (torch.autograd.graph's, minus a frame)
_WRITE_VALUES = 2  # marshal's version that writes no object identities (references came in 3)
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
    tensor's (shape, strides, dtype, device, requires_grad). Its recent signatures are tried first,
    the tensors of each by torch's compiled tensor guards (one C call, the check torch.compile's
    guards make). Of those, sig.exact's (keywords all tensors, dtypes and values marshal writes)
    compare the non-tensor keywords as one `marshal` string of them (version 2, which writes each
    value's exact type and value and no object identities: True, 1 and 1.0 differ, a list is read
    for its contents, an object marshal cannot write is no match); sig.recent's compare the types,
    the changed keywords and grad mode as they are and the other values picked by the entry's own
    getter (the types fix where the tensors are). A miss builds the full key and looks it up in
    the memo (so does a call that passes one tensor twice: the guards refuse duplicates)."""
    if _is_compiling():
        return check(sig.arguments(leading, keywords)), TRACED
    tensors = pattern = None
    try:
        given = leading if keyed is None else keyed
        grad = _grad_enabled()
        # an exact entry: (grad, its keywords' getter but tensors and dtypes (None: all), their
        # marshal string, the dtypes' getter (None: no dtype) and values, the non-tensor leading
        # arguments' getter (None: all tensors) and values, the tensors' getter over leading +
        # keywords (None: leading itself), the tensors' guards, spec). The dtypes and the leading
        # values (None, or a re-rotation shift's type) compare by identity (one object each), the
        # tensors by the guards (the exact type: None, another subclass or a plain tensor for a
        # Parameter fails)
        for e_grad, scalars, code, dtypes, e_dtypes, lead, e_lead, tensors_of, guards, spec in sig.exact:
            if e_grad is not grad:
                continue
            try:
                same = _dumps(keywords if scalars is None else scalars(keywords), _WRITE_VALUES) == code
            except ValueError:  # a value marshal cannot write (a tensor) where this entry has one
                continue
            if (
                same
                and (dtypes is None or all(map(is_, dtypes(keywords), e_dtypes)))
                and (lead is None or all(map(is_, lead(given), e_lead)))
                and guards.check(*(given if tensors_of is None else tensors_of(given + keywords)))
            ):
                return spec, spec.door
        # the indices of the keywords set, in one pass; their values join the positional ones
        changed = tuple(compress(sig.indices, map(is_not, keywords, sig.defaults)))
        for i in changed:
            given += (keywords[i],)
        types = tuple(map(type, given))
        if _SIMPLE.issuperset(types):  # plain tensors and scalars: no Python loop over them
            # the types fix where the tensors are, so equal types let the entry's getters pick the
            # others and the tensors out of this call's arguments (an entry of equal types is a
            # simple signature's: it has its getters)
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
            exact = _exact_entry(leading if keyed is None else keyed, keywords, grad, spec)
            if exact is not None:
                sig.exact.insert(0, exact)
                del sig.exact[_RECENT:]
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


def _exact_entry(given: tuple, keywords: tuple, grad: bool, spec: Spec):
    """An exact entry of prepare (its fields there; off the steady path: made once per signature),
    or None when an argument is none of: a tensor, a dtype, None or a type among the positional
    ones, a value marshal writes among the keywords. Its guards test every tensor, subclasses
    included (their exact type, and what the memo key holds of them: shape, strides, dtype,
    device, requires_grad)."""
    tensors, lead, scalars, dtypes = [], [], [], []
    for i, x in enumerate(given + keywords):
        if isinstance(x, _Tensor):
            tensors.append(i)
        elif i < len(given):
            if x is not None and type(x) is not type:
                return None
            lead.append(i)
        elif type(x) is torch.dtype:
            dtypes.append(i - len(given))
        else:
            scalars.append(i - len(given))
    scalars_of = None if len(scalars) == len(keywords) else _getter(scalars)
    dtypes_of, lead_of = (_getter(dtypes) if dtypes else None), (_getter(lead) if lead else None)
    tensors_of = None if tensors == list(range(len(given))) else _getter(tensors)
    try:
        code = _dumps(keywords if scalars_of is None else scalars_of(keywords), _WRITE_VALUES)
        guards = _GUARDS(
            *(given if tensors_of is None else tensors_of(given + keywords)),
            dynamic_dims_sizes=None,
            dynamic_dims_strides=None,
        )
    except Exception:  # a value marshal cannot write; a tensor the guards do not take: no entry
        return None
    return (
        grad,
        scalars_of,
        code,
        dtypes_of,
        dtypes_of and dtypes_of(keywords),
        lead_of,
        lead_of and lead_of(given),
        tensors_of,
        guards,
        spec,
    )


# ---------------------------------------------------------------------------------------------
# the rotation: (spec, q, k, a, b, weights, scales, q_out, k_out) -> (q_out, k_out)


def rotate_direct(spec: Spec, q, k, a, b, weights, scales, q_out=None, k_out=None):
    """The rotation's direct door: outputs allocated (or given), one run. (a, b): the angle
    operands (run_rotate's); weights: (q's, k's) norm weights; scales: (q's, k's) scale tensors.
    A spec's later calls take its launch record (rotate_record) once this has made one."""
    if spec.normed and not spec.triton:  # the CPU path: torch ops, which autograd records
        outs = run.norm_rotated(spec, spec.variant, q, k, a, b, weights, spec.out_dtype, scales)
        return run.into(outs, *((q, k) if spec.inplace else (q_out, k_out)))
    w = weights if spec.normed else None
    if spec.record is None:
        spec.record = _record(spec, q.get_device(), q_out is None and k_out is None, weights)
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


def _record(spec: Spec, device: int, fresh: bool, weights):
    """The launch record of a direct rotation (rotate_record's), from its plan and the compiled
    kernel of its aligned pointers: None while that kernel is not compiled (asked again on the next
    call), False for a spec no record serves. device: q's (-1: CPU); fresh: this call's outputs
    are not given; weights: its (q's, k's) norm weights (their dtypes are the signature's).

    A record serves the steady state of the common calls: table, arange and per-token angles, in
    place or into fresh outputs, normed or not. The others keep the general path: given outputs,
    scales, view forms, per-call angle copies or expanded positions, normed in place, a norm
    without two weights of one dtype, per-token angles in place (their aliasing tests are the
    exact ones)."""
    v, plan = spec.variant, spec.plan
    if not spec.triton:
        return False
    if plan is None:  # not planned yet (the first call plans, then launches)
        return None
    tokens = v.angles == "tokens"
    wq, wk = (None, None) if weights is None else weights
    if (
        not plan
        or not fresh
        or spec.door != DIRECT
        or v.scaled
        or spec.views
        or spec.copy_angles
        or (spec.inplace and (spec.normed or tokens))
        or v.angles not in ("table", "arange", "tokens")
        or (not tokens and (spec.angle_shape is not None or spec.table is None))
        or (spec.normed and (wq is None or wk is None or wq.dtype != wk.dtype))
    ):
        return False
    pack = plan.meta["PACK"]
    made = launching.record(plan.compiled, (pack, 0, 0) if spec.normed else pack, device)
    if not made:
        return made
    return (*made, plan.args, plan.pack_bytes, tokens)


def rotate_record(spec: Spec, q, k, a, b, wq=None, wk=None):
    """A direct rotation's steady state from its launch record (made by rotate_direct): (q_out,
    k_out) as rotate_direct returns them, or None when this call needs the general path, which
    then decides it: a pointer off the 16-byte grid (or a packed path's pair alignment), a device
    other than the current one, a profiler's launch hook, or (in place) a written byte range that
    meets another operand's (its exact test names the aliasing).
    (a, b): the angle operands as rotate_direct takes them; wq, wk: a normed spec's weights.
    Each operand's address is read once; its pointer slots are rope_kernel's (run_rotate)."""
    run_, gx, gy, gz, function, packed, consts, state, (current_stream, runtime), head, pack, tokens = spec.record
    # what needs no outputs first: a declined call allocates nothing here (the general path does)
    device = q.get_device()
    try:  # Triton's hook chains: a registered hook (a profiler's) takes the general launch, which calls it
        hooks = runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls
    except AttributeError:  # hooks that are not chains (None, a function): launch.hooked decides
        hooks = launching.hooked(runtime)
    if hooks or not state["ok"] or device != launching.current_device():
        return None
    qa = q.data_ptr()
    ka = qa if k is None else k.data_ptr()
    ba = b.data_ptr()
    aa = ba if a is None else a.data_ptr()  # arange: the table in the positions' slot
    if (qa | ka | aa | ba) & 15:
        return None
    if spec.inplace:
        # checks.rope_call's cheap test of byte ranges (the angle operands: per-token ones refused)
        ext = spec.extents
        q1, k1 = qa + ext[0], ka + ext[1]
        if ext[1] and qa < k1 and ka < q1:
            return None
        a1, b1 = aa + ext[2], ba + ext[3]  # the positions' range (empty for arange), the table's
        if (
            (aa < q1 and qa < a1)
            or (ba < q1 and qa < b1)
            or (ext[1] and ((aa < k1 and ka < a1) or (ba < k1 and ka < b1)))
        ):
            return None
        q_out, k_out, qoa, koa = q, k, qa, ka
    else:
        dt = spec.out_dtype  # None: no keyword passed, which torch's parsing skips (a fifth of the call)
        q_out = run.empty_like(q) if dt is None else run.empty_like(q, dtype=dt)
        k_out = None if k is None else run.empty_like(k) if dt is None else run.empty_like(k, dtype=dt)
        qoa = q_out.data_ptr()
        koa = qoa if k_out is None else k_out.data_ptr()
    bits = qa | ka | qoa | koa
    if bits & 15 or (pack and bits % pack):
        return None
    ca = aa if tokens else ba  # per-token angles: cos in the positions' slot too (run_rotate)
    if spec.normed:  # both weights, of one dtype (the signature's: _record)
        wqa, wka = wq.data_ptr(), wk.data_ptr()
        if (wqa | wka) & 15:
            return None
        run_(gx, gy, gz, current_stream(device), function, packed, None, None, None, qa, ka, qoa, koa, aa, ca, ba, ba, ba,
             *head, wqa, wka, spec.norm_eps, spec.norm_offset, *consts)  # fmt: skip
    else:
        run_(gx, gy, gz, current_stream(device), function, packed, None, None, None, qa, ka, qoa, koa, aa, ca, ba, ba, ba,
             *head, *consts)  # fmt: skip
    launching.COUNTS["direct"] += 1
    if spec.inplace:  # as rotate_direct: what saved q or k for a backward raises instead
        _increment_version([q] if k is None else [q, k])
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
    moved. A spec's later calls take its launch record (store_record) once this has made one."""
    written = spec.plans.get("written")
    if written is None:
        written = spec.plans["written"] = _written(spec, t)
    if spec.record is None:
        spec.record = _store_record(spec, t, written)
    run_store(spec, t)
    _increment_version(written(t))


def _written(spec: Spec, t: run.StoreOperands) -> itemgetter:
    """A getter of the operands a store writes, whose versions its call moves: q (or q_out), both
    caches, NVFP4's block scales, k with write_key (which are given is fixed by the signature)."""
    names = ["q" if t.q_out is None else "q_out", "k_cache", "v_cache"]
    names += ["kcs", "vcs"] if spec.variant.fp4 else []
    names += ["k"] if spec.variant.write_key else []
    return itemgetter(*[t._fields.index(name) for name in names])


def _record_plan(spec: Spec):
    """The plan a store's or re-rotation's launch record is made from: None while not planned (the
    first call plans, then launches), False when no record serves (on CPU; an empty call)."""
    plan = spec.plans.get(None)
    if not spec.triton:
        return False
    return plan if plan is None or plan else False


def _store_record(spec: Spec, t: run.StoreOperands, written: itemgetter):
    """The launch record of a direct store (store_record's), from its plan and the compiled kernel
    of its aligned pointers: None while that kernel is not compiled (asked again on the next call),
    False for a spec no record serves (on CPU; an empty call). written: store_direct's getter of
    the written operands (_written)."""
    plan = _record_plan(spec)
    if not plan:
        return plan
    meta = plan.meta
    made = launching.record(plan.compiled, (meta["PACK_Q"], meta["PACK_K"]), t.q.get_device())
    if not made:
        return made
    _, given, spread = spec.plans["store slots"]
    args = (*plan.args, spec.norm_eps, spec.norm_offset)
    return (*made, given, spread, args, meta["PACK_Q"] // 8, meta["PACK_K"] // 8, written)


def store_record(spec: Spec, t: tuple):
    """The store's steady state from its launch record (made by store_direct): True once launched,
    or None when this call needs the general path, which then decides it: a pointer off the 16-byte
    grid (or a packed path's pair alignment), a device other than the current one, a profiler's
    launch hook. t: the operands, StoreOperands' fields as a plain tuple (None where absent).
    Addresses the aliasing checks have not passed for this spec are checked here first
    (checks.store_call: refused with the aliasing named, nothing written)."""
    run_, gx, gy, gz, function, packed, consts, state, tools, given, spread, args, pack_q, pack_k, written = spec.record
    current_stream, runtime = tools
    device = t[0].get_device()
    try:  # Triton's hook chains: a registered hook (a profiler's) takes the general launch, which calls it
        hooks = runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls
    except AttributeError:  # hooks that are not chains (None, a function): launch.hooked decides
        hooks = launching.hooked(runtime)
    if hooks or not state["ok"] or device != launching.current_device():
        return None
    distinct = tuple(map(_data_ptr, given(t)))  # the given operands' addresses, in field order
    if distinct not in spec.plans.get("checked addresses", ()):
        checks.store_call(spec, run.StoreOperands._make(t))  # raises, or remembers these addresses
    addrs = spread(distinct)
    if (
        reduce(or_, distinct) & 15
        or (pack_q and (addrs[_Q] | addrs[_Q_OUT]) % pack_q)
        or (pack_k and (addrs[_K] | addrs[_K_CACHE]) % pack_k)
    ):
        return None
    run_(gx, gy, gz, current_stream(device), function, packed, None, None, None, *addrs, *args, *consts)
    launching.COUNTS["direct"] += 1
    _increment_version(written(t))
    return True


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
    caller): the run, the cache's version moved. A spec's later calls take its launch record
    (rerotate_record) once this has made one."""
    if spec.record is None:
        spec.record = _rerotate_record(spec, k_cache)
    run_rerotate(spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table)
    _increment_version([k_cache])


def _rerotate_record(spec: Spec, k_cache):
    """The launch record of a direct re-rotation (rerotate_record's), from its plan and the compiled
    kernel of its aligned pointers: None while that kernel is not compiled (asked again on the next
    call), False for a spec no record serves (on CPU; an empty call)."""
    plan = _record_plan(spec)
    if not plan:
        return plan
    made = launching.record(plan.compiled, (), k_cache.get_device())
    return (*made, plan.args) if made else made


def rerotate_record(spec: Spec, k_cache, addrs: tuple, delta_int):
    """The re-rotation's steady state from its launch record (made by rerotate_direct), after this
    call's checks (checks.rerotate_call, whose addresses it takes: (k_cache, slots, delta, table,
    k_scale, dst_slots, positions, to_table), 0 for None): True once launched, or None when the
    general path decides it (a pointer off the 16-byte grid, a device other than the current one,
    a profiler's launch hook). delta_int: the int shift, or None (a tensor delta)."""
    run_, gx, gy, gz, function, packed, consts, state, (current_stream, runtime), args = spec.record
    device = k_cache.get_device()
    try:  # Triton's hook chains: a registered hook (a profiler's) takes the general launch, which calls it
        hooks = runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls
    except AttributeError:  # hooks that are not chains (None, a function): launch.hooked decides
        hooks = launching.hooked(runtime)
    if hooks or not state["ok"] or device != launching.current_device():
        return None
    k, s, d, t, ks, dst, p, to = addrs
    if (k | s | d | t | ks | dst | p | to) & 15:
        return None
    # run_rerotate's slots: a slot the plan never reads points at slots or the table (an address
    # of 0 is an absent operand: an empty tensor's call has no plan, so no record)
    value = 0 if delta_int is None else max(-(2**31 - 1), min(2**31 - 1, delta_int))
    run_(gx, gy, gz, current_stream(device), function, packed, None, None, None,
         k, s, dst or s, d or s, t, ks or t, p or s, to or t, value, *args, *consts)  # fmt: skip
    launching.COUNTS["direct"] += 1
    _increment_version([k_cache])
    return True


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
