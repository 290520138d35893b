"""DTensor sharding rules of the core's custom ops (torch.distributed.tensor), beside their fakes.

RoPE is pointwise over tokens and heads, so a DTensor call needs no communication when every
input is laid out compatibly with q; the rules here tell DTensor which layouts those are, per mesh
dim of q's placements:

    q placement              k, v (like q)   positions, slot_mapping   cos/sin tables   KV caches      cu_seqlens
    Replicate()              Replicate()     Replicate()               Replicate()      Replicate()    Replicate()
    Shard(d), d a token dim  Shard(d)        Shard(d [+1 for M-RoPE])  Replicate()      refused        refused
    Shard(H), the head dim   Shard(H)        Replicate()               Replicate()      Shard(heads)   Replicate()

A per-head table (max_position, Ht, rotary_dim) is replicated like a table under token sharding and
sharded on its head dim (Shard(1)) under head sharding: each rank then holds the table heads of its
own q and k heads, so the local head j // (H / Ht) mapping is the global one. Ht, Hq and Hk must be
multiples of the mesh size there (even shards).

RMSNorm weights (the store's q_norm_weight / k_norm_weight) are replicated; a weight across heads
((H*D,), the variant's NORM_TOKEN) needs every head of a token, so head sharding refuses it.

The reference placement on a mesh dim is that of whichever of q, k, v is sharded there (they must
agree), Replicate() when none is. Outputs (rotate) get the reference placements. A replicated
argument that the rule wants sharded is sliced locally by DTensor (no communication: this is how
autograd's replicated gradients, e.g. of `out.sum()`, come back in). Any other layout (Partial, a
shard of the head size D, positions sharded while q is head-sharded, q and k sharded on different
dims, ...) raises a ValueError naming the argument; DTensor's dispatcher re-raises it as a
RuntimeError whose message starts with it (`check()` raises the ValueError itself). ropekit does
not gather: redistribute such inputs yourself (`x.redistribute(mesh, placements)`), which keeps
the communication visible.

Per-token angles (rotate with positions None, the Hugging Face form): cos and sin are (*T, half)
(or (3, *T, half)) and are sharded on token dims like positions, replicated under head sharding.
Every tensor argument of a DTensor call must be a DTensor (DTensor refuses mixed calls); wrap a
plain table with `replicate(table, mesh)`.

`register()` installs the rules (idempotent). The public ops call it through
`dtensor_like`, the first time one of their custom ops is called with a tensor subclass:
importing DTensor costs ~1 s, which `import ropekit` must not pay, and no DTensor can exist before
that module is imported, so nothing is installed at import time. Call it yourself before calling
the custom ops (torch.ops.ropekit.*) directly on DTensors. OPS is the one table of op-schema
knowledge: update it when a schema changes. ropekit.distributed (integrations/distributed.py) is
the public path of `check`, `register` and `replicate`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .variant import ANGLE_NAMES, NORM_TOKEN, Variant

# Roles of an op's arguments (schema order). Non-tensor arguments have role None.
HEADS = "heads"  # (*T, H, D): token dims and the head dim follow q
TOKENS = "tokens"  # (*T) or (3, *T) with M-RoPE: token dims follow q, replicated under head sharding
ANGLES = "angles"  # cos / sin: tables (positions given) replicated; per-token (*T, half) like TOKENS
TABLE = "table"  # always replicated (a [cos | sin] table)
HEAD_TABLE = "head table"  # a per-head table: replicated, or Shard(1) (its heads) under head sharding
CACHE = "cache"  # KV cache (..., H, D): head dim follows q; token sharding refused
SCALE = "scale"  # per-tensor scale: replicated
SEQLENS = "seqlens"  # cu_seqlens: replicated; it numbers the tokens of the whole packed batch, so q
#                      and k may be sharded on heads but not on tokens
MROPE = "mrope"  # non-tensor (M-RoPE's N leading position rows are recognised by tensor rank)


class OpRule(NamedTuple):
    """How one custom op's arguments shard. args: (name, role) for EVERY schema argument, in order.
    outputs: for each returned tensor, the argument whose placements it takes (() for in-place ops).
    written: arguments the op mutates (never sliced from Replicate: the write would land in a copy)."""

    args: tuple
    outputs: tuple
    written: tuple = ()


WEIGHT = "weight"  # a per-head RMSNorm weight (D,): replicated
WEIGHT_ALL = "weight across heads"  # an (H * D,) weight: replicated; head sharding refused
GRAD_SUM = "partial"  # an output summed over tokens and heads (a weight's gradient): Partial where sharded


def _rotate_roles(codes):
    """Names and roles of the rotation ops' angle operands (a, b), from the encoded Variant's angle
    source, and the roles of the two norm weights, from its norm modes."""
    v = Variant.decode(codes)
    name_a, name_b = ANGLE_NAMES[v.angles]
    role_a = {"packed": SEQLENS, "tokens": ANGLES}.get(v.angles, TOKENS)
    role_b = ANGLES if v.angles == "tokens" else (HEAD_TABLE if v.head_table else TABLE)
    return (name_a, role_a), (name_b, role_b), [WEIGHT_ALL if m == NORM_TOKEN else WEIGHT for m in (v.norm_q, v.norm_k)]


_ROTATE_FLAGS = (("variant", None), ("rotary_dim", None), ("packed", None), ("norm", None))


def _rotate_args(codes) -> tuple:
    a, b, (wq, wk) = _rotate_roles(codes)
    return (("q", HEADS), ("k", HEADS), a, b, ("q_norm_weight", wq), ("k_norm_weight", wk))


def _rotate(codes) -> OpRule:
    scales = (("q_scale", SCALE), ("k_scale", SCALE))
    return OpRule(_rotate_args(codes) + scales + _ROTATE_FLAGS + (("out_dtype", None),), ("q", "k"))


def _rotate_inplace(codes) -> OpRule:
    return OpRule(_rotate_args(codes) + _ROTATE_FLAGS, (), ("q", "k"))


def _rotate_norm_backward(codes) -> OpRule:
    a, b, roles_w = _rotate_roles(codes)
    w = WEIGHT_ALL if WEIGHT_ALL in roles_w else WEIGHT
    args = (("x", HEADS), ("g", HEADS), ("w", w), a, b)
    return OpRule(args + _ROTATE_FLAGS + (("mode", None),), ("x", GRAD_SUM))


def _store(codes, q_out: bool) -> OpRule:
    """The fused store's rule: positions (or cu_seqlens) follow the tokens, replicated under head
    sharding (token sharding is refused by the caches); weights by the variant's norm modes."""
    _, _, (wq, wk) = _rotate_roles(codes)
    args = (
        ("q", HEADS),
        ("k", HEADS),
        ("v", HEADS),
        ("positions", TOKENS),
        ("cos_sin_cache", TABLE),
        ("k_cache", CACHE),
        ("v_cache", CACHE),
        ("slot_mapping", TOKENS),
        ("variant", None),
        ("rotary_dim", None),
        ("k_scale", SCALE),
        ("v_scale", SCALE),
        ("q_norm_weight", wq),
        ("k_norm_weight", wk),
        ("norm", None),
        ("packed", None),
    )
    outs = (("q_out", HEADS), ("q_scale", SCALE)) if q_out else ()
    written = ("q_out" if q_out else "q", "k", "k_cache", "v_cache")
    parts = (("k_nope", HEADS),) + ((("q_nope", HEADS),) if q_out else ())  # no-rope parts: like q and k
    return OpRule(args + outs + parts, (), written)


# The op-schema table (core/dispatch.py defines the ops): a rule, or for the
# rotation ops (argument index of their encoded Variant, the function deriving the rule from it).
OPS = {
    "rotate": (8, _rotate),
    "rotate_": (6, _rotate_inplace),
    "rotate_norm_backward": (5, _rotate_norm_backward),
    "rope_and_store": (8, lambda codes: _store(codes, q_out=False)),
    "rope_and_store_q_out": (8, lambda codes: _store(codes, q_out=True)),
}


def rule_of(op: str, values) -> OpRule:
    """The rule of `op` for one call: OPS' rule, or for a rotation op the one derived from its
    encoded Variant. values: the op's arguments, positional (a list) or by name (a dict)."""
    entry = OPS[op]
    if isinstance(entry, OpRule):
        return entry
    index, derive = entry
    return derive(values[index] if isinstance(values, (list, tuple)) else values["variant"])


def reference_placements(op: str, rule: OpRule, specs: dict) -> tuple:
    """Per mesh dim, the placement of the (*T, H, D) arguments (q, k, v): the one sharded among
    them, or Replicate() when none is (a replicated one is sliced to match, which is free)."""
    from torch.distributed.tensor import Replicate

    heads = [(n, specs[n][1]) for n, role in rule.args if role == HEADS and n in specs]
    first, placements = heads[0]
    out = []
    for i in range(len(placements)):
        pick, by = Replicate(), first
        for name, pl in heads:
            if isinstance(pl[i], Replicate):
                continue
            if not isinstance(pick, Replicate) and pl[i] != pick:
                _fail(op, name, f"placement {pick!r} on mesh dim {i} (that of {by})", tuple(pl))
            pick, by = pl[i], name
        out.append(pick)
    return tuple(out)


def expected_placements(op: str, rule: OpRule, specs: dict) -> dict:
    """The placements every tensor argument must have: {name: tuple of placements}.

    specs: {name: (ndim, placements)} of the tensor arguments present (q, or x, among them).
    Raises ValueError `ropekit.<op>: <arg>: expected ..., got ...` for a layout no rule covers.
    """
    from torch.distributed.tensor import Replicate, Shard

    first = next(n for n, role in rule.args if role == HEADS and n in specs)  # q, or x
    q_ndim = specs[first][0]
    n_tok = q_ndim - 2
    # per-token angles (cos / sin) are sharded like tokens; anything else in the ANGLES role is a table
    positions_given = not any(role == ANGLES for _, role in rule.args)
    ref = reference_placements(op, rule, specs)
    for p in ref:
        if not isinstance(p, Replicate) and (not isinstance(p, Shard) or p.dim < 0 or p.dim >= q_ndim - 1):
            _fail(
                op,
                first,
                f"placements Replicate(), Shard(token dim) or Shard(head dim {q_ndim - 2}) on every mesh dim",
                specs[first][1],
            )
    want = {}
    for name, role in rule.args:
        if role in (None, MROPE) or name not in specs:
            continue
        ndim, _ = specs[name]
        per_mesh_dim = []
        for p in ref:
            if isinstance(p, Replicate):
                per_mesh_dim.append(Replicate())
                continue
            token = p.dim < n_tok
            if role == HEADS:
                per_mesh_dim.append(Shard(p.dim))
            elif role == TOKENS or (role == ANGLES and not positions_given):
                lead = ndim - n_tok - (1 if role == ANGLES else 0)  # 3 M-RoPE rows, or 0
                per_mesh_dim.append(Shard(p.dim + lead) if token else Replicate())
            elif role in (ANGLES, TABLE, SCALE, WEIGHT):
                per_mesh_dim.append(Replicate())
            elif role == HEAD_TABLE:
                per_mesh_dim.append(Replicate() if token else Shard(1))
            elif role == WEIGHT_ALL:
                if not token:
                    _fail(
                        op,
                        name,
                        "a per-head (D,) weight when q / k are sharded on heads (a norm across heads "
                        "needs every head of a token: replicate q / k, or gather first)",
                        f"an across-heads weight with {first} placements {specs[first][1]}",
                    )
                per_mesh_dim.append(Replicate())
            elif role == SEQLENS:
                if token:
                    _fail(
                        op,
                        "q",
                        "a head-dim or replicated placement with cu_seqlens (it numbers the tokens of the "
                        "whole packed batch; shard packed sequences with cp_size / cp_rank instead)",
                        specs["q"][1],
                    )
                per_mesh_dim.append(Replicate())
            elif role == CACHE:
                if token:
                    _fail(
                        op,
                        "q",
                        "a head-dim or replicated placement (a KV cache cannot take a "
                        "token-sharded write without communication)",
                        specs["q"][1],
                    )
                per_mesh_dim.append(Shard(ndim - 2))
        want[name] = tuple(per_mesh_dim)
    return want


def _fail(op, name, expected, given):
    raise ValueError(f"ropekit.{op}: {name}: expected {expected}, got {given}")


def _settle(op: str, rule: OpRule, name: str, got: tuple, want: tuple, ref: tuple) -> bool:
    """True if got must be redistributed to want (only Replicate -> Shard, a local slice);
    False if it is want already; raises for anything that would need communication, or for a
    written argument that is not laid out as wanted."""
    from torch.distributed.tensor import Replicate

    if got == want:
        return False
    if name in rule.written:
        _fail(
            op,
            name,
            f"placements {want} (to match {ref}, those of q/k; it is written in place, so it cannot be resharded)",
            got,
        )
    if len(got) == len(want) and all(g == w or isinstance(g, Replicate) for g, w in zip(got, want)):
        return True
    _fail(
        op,
        name,
        f"placements {want} (to match {ref}, those of q/k; a replicated input is sliced, "
        "anything else would need communication: redistribute it first)",
        got,
    )


def check(op: str, args: dict) -> dict:
    """Check DTensor arguments of `op` (a key of OPS) without running it: {name: value} of its
    arguments (DTensors, None or plain values). Returns the placements the op will run with per
    tensor name. Raises the same ValueError the registered rule raises inside DTensor's dispatcher."""
    rule = rule_of(op, args)
    specs = {n: (v.dim(), tuple(v.placements)) for n, v in args.items() if hasattr(v, "placements")}
    want = expected_placements(op, rule, specs)
    ref = reference_placements(op, rule, specs)
    for name, (_, got) in specs.items():
        _settle(op, rule, name, got, want[name], ref)
    return want


def _strategy(op: str, op_schema):
    """DTensor strategy: the one OpSpec that runs the op on the local shards as they are."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    rule = rule_of(op, op_schema.args_schema)
    values, specs, given = {}, {}, []
    for (name, _role), arg in zip(rule.args, op_schema.args_schema):
        values[name] = arg
        if isinstance(arg, OpStrategy):
            spec = arg.strategies[0].output_spec
            specs[name] = (spec.ndim, tuple(spec.placements))
            given.append((name, spec))
    want = expected_placements(op, rule, specs)
    ref = reference_placements(op, rule, specs)
    mesh = given[0][1].mesh
    inputs = {}
    for name, spec in given:
        moved = _settle(op, rule, name, tuple(spec.placements), want[name], ref)
        inputs[name] = DTensorSpec(mesh, want[name], tensor_meta=spec.tensor_meta) if moved else spec
    outputs = tuple(_output_spec(mesh, n, want, ref) for n in rule.outputs if n in inputs or n == GRAD_SUM)
    return OpStrategy(
        [
            OpSpec(
                output_specs=outputs if rule.outputs else None,
                input_specs=[inputs[n] for n, _ in given],
                redistribute_cost=[[0.0] for _ in given],
            )
        ]
    )


def _output_spec(mesh, name: str, want: dict, ref: tuple):
    """An output's DTensorSpec: an argument's placements, or for a sum over tokens and heads
    Partial() on every sharded mesh dim (DTensor reduces it when the caller needs it)."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if name == GRAD_SUM:
        return DTensorSpec(mesh, tuple(Replicate() if isinstance(p, Replicate) else Partial() for p in ref))
    return DTensorSpec(mesh, want[name])


_registered = False


def register() -> bool:
    """Register OPS' rules with DTensor's sharding propagator; idempotent. False when
    torch.distributed (or DTensor) is unavailable in this build."""
    global _registered
    if _registered:
        return True
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    except ImportError:
        return False
    # every op of OPS exists by now: importing any ropekit module runs the package's __init__,
    # which imports the api modules that define them
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, entry in OPS.items():
        overload = getattr(torch.ops.ropekit, name).default
        # flags and mrope change the rule: hash every argument from the first non-tensor one on
        if isinstance(entry, OpRule):
            static = next(i for i, (_, role) in enumerate(entry.args) if role in (None, MROPE))
        else:
            static = entry[0]  # the encoded Variant
        propagator.register_op_strategy(
            overload, lambda schema, _n=name: _strategy(_n, schema), RuntimeSchemaInfo(static_argnum=static)
        )
    _registered = True
    return True


def dtensor_like(q, *xs):
    """xs, each a DTensor like q: plain tensors (tables, positions, weights) become DTensors
    replicated on q's mesh (DTensor refuses calls that mix the two; every rank holds the same
    values, so no communication); when q is not a DTensor, xs as they are.

    Every custom-op door of the public ops passes here, so this is where the sharding rules are
    registered: the first time q is a tensor subclass (a DTensor dispatches the op through them).
    A plain tensor costs one type test."""
    if type(q) is torch.Tensor:
        return xs
    register()
    mesh = getattr(q, "device_mesh", None)
    if mesh is None:
        return xs
    from torch.distributed.tensor import DTensor, Replicate

    def like(x):
        if not isinstance(x, torch.Tensor) or hasattr(x, "device_mesh"):
            return x
        return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)

    return tuple(like(x) for x in xs)


# What torch.compiler.assume_constant_result(register) does, without importing torch._dynamo (~3 s)
# at import time (that decorator only sets this attribute; tests/integrations/test_distributed.py checks it
# still does): under torch.compile dynamo calls register() while tracing instead of tracing into
# it, so the rules exist before DTensor's fake run of the op. A traced call would defer the
# registration to after the graph, too late for that run.
register._dynamo_marked_constant = True
