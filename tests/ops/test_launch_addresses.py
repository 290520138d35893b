"""The addresses each run step hands the launch. On a GPU the direct launch passes them to the
compiled kernel as they are (it never asks the tensors again), so a wrong one reads or writes
elsewhere; the interpreter on CPU launches through Triton's own path, which ignores them. This is
their check without a GPU: for each op and the signatures that change its pointer slots, the
addresses are the slots' tensors' own, slot by slot, and `bits` is their OR.

The launch is replaced by a recorder (nothing runs), and the kernel path is taken for CPU tensors
whatever TRITON_INTERPRET says (the plans are built from shapes and strides only)."""

import contextlib
import functools
import operator

import pytest
import torch
from triton import knobs

import ropekit
from ropekit.core import checks, memo, pipeline

from conftest import DEVICES, make_cache

T, HQ, HK, D = 5, 4, 2, 32


def _qkv(device, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(T, h, D, generator=g).to(device=device, dtype=dtype) for h in (HQ, HK, HK)]


def _pos(device):
    return torch.tensor([3, 0, 7, 1, 5], device=device)


def _caches(device, dtype=torch.bfloat16):
    return torch.zeros(4, 4, HK, D, device=device, dtype=dtype), torch.zeros(4, 4, HK, D, device=device, dtype=dtype)


def _slots(device):
    return torch.tensor([9, 2, 14, 0, 5], device=device)


def _weights(device):
    return torch.rand(D, device=device) + 0.5, torch.rand(D, device=device) + 0.5


def _rotate_with_angles(d):
    q, k, _ = _qkv(d)
    c = make_cache(8, D, device=d)[_pos(d)]
    return ropekit.rotate_with_angles(q, k, c[:, : D // 2], c[:, D // 2 :])


CALLS = {
    "rotation, out of place": lambda d: ropekit.apply_rope(*_qkv(d)[:2], _pos(d), make_cache(8, D, device=d)),
    "rotation, in place": lambda d: ropekit.apply_rope(*_qkv(d)[:2], _pos(d), make_cache(8, D, device=d), inplace=True),
    "rotation, q alone": lambda d: ropekit.apply_rope(_qkv(d)[0], None, _pos(d), make_cache(8, D, device=d)),
    "rotation, arange": lambda d: ropekit.apply_rope(*_qkv(d)[:2], None, make_cache(8, D, device=d)),
    "rotation, per-token angles": _rotate_with_angles,
    "rotation, fp8 out with scales": lambda d: ropekit.apply_rope(
        *_qkv(d)[:2],
        _pos(d),
        make_cache(8, D, device=d),
        out_dtype=torch.float8_e4m3fn,
        q_scale=0.5,
        k_scale=2.0,
    ),
    "rotation, normed": lambda d: ropekit.apply_rope(
        *_qkv(d)[:2], _pos(d), make_cache(8, D, device=d), q_norm_weight=_weights(d)[0], k_norm_weight=_weights(d)[1]
    ),
    "store": lambda d: ropekit.apply_rope_and_store(
        *_qkv(d), _pos(d), make_cache(8, D, device=d), *_caches(d), _slots(d)
    ),
    "store, q_out": lambda d: ropekit.apply_rope_and_store(
        *_qkv(d), _pos(d), make_cache(8, D, device=d), *_caches(d), _slots(d), q_out=torch.empty(T, HQ, D, device=d)
    ),
    "store, fp8 caches with scales": lambda d: ropekit.apply_rope_and_store(
        *_qkv(d),
        _pos(d),
        make_cache(8, D, device=d),
        *_caches(d, torch.float8_e4m3fn),
        _slots(d),
        k_scale=0.5,
        v_scale=2.0,
    ),
    "store, normed": lambda d: ropekit.apply_rope_and_store(
        *_qkv(d),
        _pos(d),
        make_cache(8, D, device=d),
        *_caches(d),
        _slots(d),
        q_norm_weight=_weights(d)[0],
        k_norm_weight=_weights(d)[1],
    ),
    "store, interleaved": lambda d: ropekit.apply_rope_and_store(
        *_qkv(d), _pos(d), make_cache(8, D, device=d), *_caches(d), _slots(d), interleaved=True
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CALLS))
def test_the_launch_gets_each_slots_own_address(name, device, monkeypatch):
    launches = []

    def recorder(kernel, compiled, variant, grid, ptrs, args, meta, addrs=None, bits=None):
        launches.append((ptrs, addrs, bits))

    monkeypatch.setattr(checks, "triton_runs", lambda x: True)
    monkeypatch.setattr(pipeline, "launch", recorder)
    memo.clear()
    try:
        for _ in range(3):  # the first call, the memoized one, the recent-signature one
            CALLS[name](device)
    finally:
        memo.clear()
    assert len(launches) == 3, name
    for ptrs, addrs, bits in launches:
        assert addrs is not None and bits is not None, f"{name}: the run step read no addresses"
        assert list(addrs) == [p.data_ptr() for p in ptrs], name
        assert bits == functools.reduce(operator.or_, addrs), name


# the calls a launch record serves (pipeline._record), each with its one table (a new table object
# takes the general path: its values are read again): their steady state skips the run step and
# the launch function, so its argument list is checked against theirs
def _recorded_calls(d):
    table = make_cache(8, D, device=d)
    c = table[_pos(d)]
    cos, sin = c[:, : D // 2], c[:, D // 2 :]
    return {
        "rotation, out of place": lambda: ropekit.apply_rope(*_qkv(d)[:2], _pos(d), table),
        "rotation, in place": lambda: ropekit.apply_rope(*_qkv(d)[:2], _pos(d), table, inplace=True),
        "rotation, q alone": lambda: ropekit.apply_rope(_qkv(d)[0], None, _pos(d), table),
        "rotation, arange": lambda: ropekit.apply_rope(*_qkv(d)[:2], None, table),
        "rotation, per-token angles": lambda: ropekit.rotate_with_angles(*_qkv(d)[:2], cos, sin),
        "rotation, normed": lambda: ropekit.apply_rope(
            *_qkv(d)[:2], _pos(d), table, q_norm_weight=_weights(d)[0], k_norm_weight=_weights(d)[1]
        ),
    }


RECORDED = list(_recorded_calls("cpu"))


# a record declines a call with a launch hook registered, in either form Triton's knobs take one
HOOKS = ["a launch hook", "a launch hook as a function"]


def _declining(case: str, monkeypatch):
    """The context of a decline case every record shares: "strict mode" (its value checks), or a
    launch hook registered (a profiler's, handed the launch's metadata): see _register_a_launch_hook."""
    if case == "strict mode":
        return ropekit.strict()
    _register_a_launch_hook(case, monkeypatch)
    return contextlib.nullcontext()


def _register_a_launch_hook(case: str, monkeypatch) -> None:
    """One launch hook on the runtime knobs the launches read, as a profiler registers one: on the
    chain ("a launch hook"), or assigned in the chain's place ("a launch hook as a function", as
    before Triton had chains). The records keep that knobs object, as Triton's is one."""
    from ropekit.core import launch

    assert case in HOOKS, case
    hook = lambda *a: None  # noqa: E731
    if case == "a launch hook":
        chain = knobs.HookChain(reversed=True)
        chain.add(hook)
    else:
        chain = hook
    monkeypatch.setattr(launch._STATE["tools"][1], "launch_exit_hook", chain)


@pytest.mark.parametrize("op", ["rotation", "store", "re-rotation"])
def test_a_launch_record_serves_a_runtime_whose_hooks_are_none(op, stub_launches, monkeypatch):
    """A Triton before hook chains has None for no hook: the record serves the call."""
    from ropekit.core import launch

    runs, _ = stub_launches
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    call = _recorded_calls("cpu")["rotation, in place"] if op == "rotation" else _same_operands(op)
    for _ in range(3):
        call()
    served = launch.COUNTS["direct"]
    call()
    assert launch.COUNTS["direct"] == served + 1 and len(runs) == 4, op


@pytest.fixture
def stub_launches(monkeypatch):
    """CPU tensors down the direct launch path (profile_host.py --stub-launch's state), each compiled
    kernel a recorder: returns (the compiled launcher's calls, the launch function's calls)."""
    from ropekit.core import launch

    runs, launches = [], []
    real = pipeline.launch

    def spied(kernel, compiled, variant, grid, ptrs, args, meta, **kw):
        launches.append(ptrs)
        if not compiled:  # the first launch of a plan: its compiled entry, a recorder as launcher
            entry = (lambda *a: runs.append(a), *(*grid, 1, 1)[:3], "function", "packed")
            compiled[(variant, True)] = (*entry, ("constexprs",), None)
        return real(kernel, compiled, variant, grid, ptrs, args, meta, **kw)

    monkeypatch.setattr(checks, "triton_runs", lambda x: True)
    monkeypatch.setattr(pipeline, "launch", spied)
    monkeypatch.setattr(launch, "current_device", lambda: -1)
    monkeypatch.setitem(launch._STATE, "host_only", True)
    monkeypatch.setitem(launch._STATE, "ok", True)
    # Triton's own runtime knobs (its launch-hook chains, empty), as a GPU's launches read them
    monkeypatch.setitem(launch._STATE, "tools", (lambda device: 0, knobs.runtime))
    memo.clear()
    yield runs, launches
    memo.clear()


_ROLES = ("q", "k", "a", "b", "wq", "wk", "q_out", "k_out")


def _named(tensors: dict, addresses) -> list:
    """Each address of a launch's pointer slots as the role of the call's tensor it is (the first
    role of that address in _ROLES: in place, q_out is q), or the address itself."""
    names = {}
    for role in reversed(_ROLES):
        if tensors.get(role) is not None:
            names[tensors[role].data_ptr()] = role
    return [names.get(a, a) for a in addresses]


@pytest.mark.parametrize("name", RECORDED)
def test_a_launch_record_passes_what_the_launch_passes(name, stub_launches, monkeypatch):
    """A spec's steady state (pipeline.rotate_record, once the general path has made its record)
    hands the compiled launcher the argument list the general launch hands it for its own tensors:
    each pointer slot the same operand's address, then the same ints and constexprs. Calls 1-2
    take the general path (plan and compiled entry, then the record), 3-4 the record."""
    from ropekit.core import dispatch
    from ropekit.core.variant import DIRECT, RECORD

    runs, launches = stub_launches
    calls = []  # (the path, the call's tensors by role)
    direct, record = dispatch.ROTATE[DIRECT], dispatch.ROTATE[RECORD]

    def general(spec, q, k, a, b, weights, scales, q_out=None, k_out=None):
        out = direct(spec, q, k, a, b, weights, scales, q_out, k_out)
        wq, wk = weights
        calls.append(("general", dict(q=q, k=k, a=a, b=b, wq=wq, wk=wk, q_out=out[0], k_out=out[1])))
        return out

    def recorded(spec, q, k, a, b, wq=None, wk=None):
        out = record(spec, q, k, a, b, wq, wk)
        if out is not None:
            calls.append(("record", dict(q=q, k=k, a=a, b=b, wq=wq, wk=wk, q_out=out[0], k_out=out[1])))
        return out

    monkeypatch.setitem(dispatch.ROTATE, DIRECT, general)
    monkeypatch.setitem(dispatch.ROTATE, RECORD, recorded)
    call = _recorded_calls("cpu")[name]
    for _ in range(4):
        call()
    assert [p for p, _ in calls] == ["general", "general", "record", "record"], name
    assert len(launches) == 2 and len(runs) == 4  # every launch direct: the entry is seeded at the first
    slots = len(launches[0])

    def named(tensors, args):  # the slots and the tail (a normed call's weights), operands by role
        tail = [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in args[9 + slots :]]
        return _named(tensors, args[9 : 9 + slots]), _named(tensors, tail)

    want = [named(tensors, args) for (_, tensors), args in zip(calls[:2], runs[:2])]
    assert want[0] == want[1] and all(isinstance(n, str) for n in want[0][0]), f"{name}: general slots {want}"
    for (_, tensors), args in zip(calls[2:], runs[2:]):
        assert named(tensors, args) == want[0], name
        assert args[:3] == runs[0][:3], name
        assert args[6:9] == (None, None, None)  # no launch metadata, no hooks


@pytest.mark.parametrize("case", ["misaligned q", "k is q in place", "another table", "strict mode", *HOOKS])
def test_a_launch_record_declines_what_the_general_path_decides(case, stub_launches, monkeypatch):
    """Once a spec has its record, a call the record does not serve goes the general path, which
    decides it: a pointer off the 16-byte grid (its own compiled entry), in-place operands that
    overlap (refused with the aliasing named, nothing launched), a new table (its values read),
    strict mode (its value checks), a profiler's launch hook (handed the launch's metadata)."""
    from ropekit.core import dispatch
    from ropekit.core.variant import DIRECT

    paths = []
    direct = dispatch.ROTATE[DIRECT]

    def general(*args, **kw):
        paths.append("general")
        return direct(*args, **kw)

    monkeypatch.setitem(dispatch.ROTATE, DIRECT, general)
    runs, _ = stub_launches
    table = make_cache(8, D, device="cpu")
    g = torch.Generator().manual_seed(1)

    def call(q=None, k=None, t=table):
        q = torch.randn(T, 2, D, generator=g) if q is None else q
        k = torch.randn(T, 2, D, generator=g) if k is None else k
        return ropekit.apply_rope(q, k, _pos("cpu"), t, inplace=True)

    for _ in range(3):
        call()
    assert paths == ["general", "general"] and len(runs) == 3  # the third call took the record
    if case == "misaligned q":
        buf = torch.randn(T * 2 * D + 1, generator=g)
        call(q=buf[1:].view(T, 2, D))  # 4 bytes off the grid, same shape and strides
    elif case == "k is q in place":
        q = torch.randn(T, 2, D, generator=g)
        with pytest.raises(ValueError, match="apply_rope: .*(overlap|alias)"):
            call(q=q, k=q)
        assert paths[-1] == "general" and len(runs) == 3  # refused before any launch
        return
    elif case == "another table":
        call(t=table.clone())
    else:
        with _declining(case, monkeypatch):
            call()
    assert paths == ["general"] * 3, case


# the store's calls a launch record serves (pipeline._store_record): every signature of the store
# on the direct door. Each call passes new operands (new addresses: the record checks them first)
def _stored_calls(d):
    table = make_cache(8, D, device=d)
    w = _weights(d)

    def store(**kw):
        return lambda: ropekit.apply_rope_and_store(*_qkv(d), _pos(d), table, *_caches(d), _slots(d), **kw)

    return {
        "store": store(),
        "store, q_out": lambda: ropekit.apply_rope_and_store(
            *_qkv(d), _pos(d), table, *_caches(d), _slots(d), q_out=torch.empty(T, HQ, D, device=d)
        ),
        "store, fp8 caches with scales": lambda: ropekit.apply_rope_and_store(
            *_qkv(d), _pos(d), table, *_caches(d, torch.float8_e4m3fn), _slots(d), k_scale=0.5, v_scale=2.0
        ),
        "store, normed": store(q_norm_weight=w[0], k_norm_weight=w[1]),
        "store, write_key": store(write_key=True),
        "store, arange": lambda: ropekit.apply_rope_and_store(*_qkv(d), None, table, *_caches(d), _slots(d)),
        "store, packed sequences": lambda: ropekit.apply_rope_and_store(
            *_qkv(d), None, table, *_caches(d), _slots(d), cu_seqlens=torch.tensor([0, 2, T], device=d)
        ),
        "store, NVFP4 caches": lambda: ropekit.apply_rope_and_store(
            *_qkv(d), _pos(d), table, *_nvfp4_caches(d), _slots(d), **dict(zip(_NVFP4_SCALES, _nvfp4_scales(d)))
        ),
    }


_NVFP4_SCALES = ("k_cache_scales", "v_cache_scales")


def _nvfp4_caches(d):  # NVFP4 codes: two values a byte
    return [torch.zeros(4, 4, HK, D // 2, dtype=torch.uint8, device=d) for _ in "kv"]


def _nvfp4_scales(d):  # their block scales: one float8_e4m3fn a block of 16 values
    return [torch.zeros(4, 4, HK, D // 16, dtype=torch.uint8, device=d).view(torch.float8_e4m3fn) for _ in "kv"]


STORED = list(_stored_calls("cpu"))


def _spy_store(monkeypatch) -> list:
    """dispatch.STORE's direct door and record wrapped: each launch's (path, operands by field)."""
    from ropekit.core import dispatch, run
    from ropekit.core.variant import DIRECT, RECORD

    calls = []
    direct, record = dispatch.STORE[DIRECT], dispatch.STORE[RECORD]

    def general(spec, t):
        direct(spec, t)
        calls.append(("general", t._asdict()))

    def recorded(spec, t):
        done = record(spec, t)
        if done:
            calls.append(("record", dict(zip(run.StoreOperands._fields, t))))
        return done

    monkeypatch.setitem(dispatch.STORE, DIRECT, general)
    monkeypatch.setitem(dispatch.STORE, RECORD, recorded)
    return calls


def _by_field(tensors: dict, addresses) -> list:
    """Each address as the first field (StoreOperands' order) of the call's tensor it is."""
    names = {}
    for name, x in reversed(list(tensors.items())):
        if x is not None:
            names[x.data_ptr()] = name
    return [names.get(a, a) for a in addresses]


@pytest.mark.parametrize("name", STORED)
def test_a_store_record_passes_what_the_launch_passes(name, stub_launches, monkeypatch):
    """The store's steady state (pipeline.store_record) hands the compiled launcher the argument
    list the general launch hands it for its own operands: each pointer slot the same operand's
    address, then the same ints and constexprs. Calls 1-2 take the general path, 3-4 the record;
    each written operand's version moves once a call."""
    runs, launches = stub_launches
    calls = _spy_store(monkeypatch)
    call = _stored_calls("cpu")[name]
    for _ in range(4):
        call()
    assert [p for p, _ in calls] == ["general", "general", "record", "record"], name
    assert len(launches) == 2 and len(runs) == 4
    slots = len(launches[0])

    def named(tensors, args):
        return _by_field(tensors, args[9 : 9 + slots]), list(args[9 + slots :])

    want = [named(tensors, args) for (_, tensors), args in zip(calls[:2], runs[:2])]
    assert want[0] == want[1] and all(isinstance(n, str) for n in want[0][0]), f"{name}: general slots {want}"
    for (_, tensors), args in zip(calls[2:], runs[2:]):
        assert named(tensors, args) == want[0], name
        assert args[:3] == runs[0][:3] and args[6:9] == (None, None, None), name
    # each call's own tensors: the written ones moved once (q or q_out, both caches, NVFP4's block
    # scales, k with write_key), the read ones not at all (the table and weights are shared: unmoved)
    written = {"q_out" if "q_out" in name else "q", "k_cache", "v_cache"}
    written |= {"kcs", "vcs"} if "NVFP4" in name else set()
    written |= {"k"} if "write_key" in name else set()
    for path, tensors in calls:
        moved = {f for f, x in tensors.items() if x is not None and x._version}
        assert moved == written, f"{name}, {path}: versions moved {moved}, written {written}"


@pytest.mark.parametrize("case", ["misaligned q", "k_cache is v_cache", "new caches", "strict mode", *HOOKS])
def test_a_store_record_declines_what_the_general_path_decides(case, stub_launches, monkeypatch):
    """Once the store's spec has its record, a call the record does not serve goes the general
    path: a pointer off the 16-byte grid, strict mode, a launch hook. Addresses not seen before
    are checked by the record itself: new caches are served, caches that alias are refused with
    the aliasing named and nothing launched."""

    runs, _ = stub_launches
    calls = _spy_store(monkeypatch)
    table, pos, slots = make_cache(8, D, device="cpu"), _pos("cpu"), _slots("cpu")
    kc, vc = _caches("cpu")

    def call(q=None, k_cache=kc, v_cache=vc):
        q_, k, v = _qkv("cpu")
        return ropekit.apply_rope_and_store(q_ if q is None else q, k, v, pos, table, k_cache, v_cache, slots)

    for _ in range(3):
        call()
    assert [p for p, _ in calls] == ["general", "general", "record"] and len(runs) == 3
    if case == "misaligned q":
        buf = torch.randn(T * HQ * D + 1).to(torch.bfloat16)
        call(q=buf[1:].view(T, HQ, D))  # 2 bytes off the grid, same shape and strides
    elif case == "k_cache is v_cache":
        with pytest.raises(ValueError, match="apply_rope_and_store: .*(overlap|alias)"):
            call(v_cache=kc)
        assert len(calls) == 3 and len(runs) == 3  # refused before any launch
        return
    elif case == "new caches":
        call(*(None, *_caches("cpu")))
        assert [p for p, _ in calls][-1] == "record" and len(runs) == 4, case
        return
    else:
        with _declining(case, monkeypatch):
            call()
    assert [p for p, _ in calls][-1] == "general" and len(calls) == 4, case


# the re-rotation's calls a launch record serves (pipeline._rerotate_record): each form of its
# pointer slots. Each call passes a new cache (new addresses: checks.rerotate_call tests them)
def _rerotated_calls(d):
    table, to_table = make_cache(8, D, device=d), make_cache(16, D, device=d)
    rows = torch.tensor([1, 6, 3], device=d)

    def rerotate(delta, dtype=torch.bfloat16, **kw):
        return lambda: ropekit.rerotate_kv_cache(_caches(d, dtype)[0], rows, delta, table, **kw)

    return {
        "re-rotation, int shift": rerotate(-2),
        "re-rotation, tensor delta": rerotate(torch.tensor([1, -1, 2], device=d)),
        "re-rotation, dst slots": rerotate(3, dst_slots=torch.tensor([9, 10, 11], device=d)),
        "re-rotation, two tables": rerotate(1, positions=torch.tensor([0, 5, 2], device=d), to_cache=to_table),
        "re-rotation, fp8 with a scale": rerotate(2, torch.float8_e4m3fn, k_scale=0.5),
    }


REROTATED = list(_rerotated_calls("cpu"))


def _spy_rerotate(monkeypatch) -> list:
    """dispatch.REROTATE's direct door and record wrapped: each launch's (path, its tensors by role)."""
    from ropekit.core import dispatch
    from ropekit.core.variant import DIRECT, RECORD

    calls = []
    direct, record = dispatch.REROTATE[DIRECT], dispatch.REROTATE[RECORD]
    roles = ("k_cache", "slots", "delta", "table", "k_scale", "dst_slots", "positions", "to_table")

    def general(spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table):
        direct(spec, k_cache, slots, delta, delta_int, table, k_scale, dst_slots, positions, to_table)
        tensors = (k_cache, slots, delta, table, k_scale, dst_slots, positions, to_table)
        calls.append(("general", dict(zip(roles, tensors)), delta_int))

    def recorded(spec, k_cache, addrs, delta_int):
        done = record(spec, k_cache, addrs, delta_int)
        if done:
            calls.append(("record", dict(zip(roles, addrs)), delta_int))
        return done

    monkeypatch.setitem(dispatch.REROTATE, DIRECT, general)
    monkeypatch.setitem(dispatch.REROTATE, RECORD, recorded)
    return calls


@pytest.mark.parametrize("name", REROTATED)
def test_a_rerotation_record_passes_what_the_launch_passes(name, stub_launches, monkeypatch):
    """The re-rotation's steady state (pipeline.rerotate_record) hands the compiled launcher the
    argument list the general launch hands it for its own operands: each pointer slot the same
    operand's address, the shift, then the same ints and constexprs. Calls 1-2 take the general
    path, 3-4 the record; the cache's version moves once a call."""
    runs, launches = stub_launches
    calls = _spy_rerotate(monkeypatch)
    call = _rerotated_calls("cpu")[name]
    versions = [call()._version for _ in range(4)]
    assert [p for p, _, _ in calls] == ["general", "general", "record", "record"], name
    assert len(launches) == 2 and len(runs) == 4 and versions == [1, 1, 1, 1], (name, versions)
    slots = len(launches[0])

    def named(tensors, args):  # each slot as the role of its address (records hold addresses)
        where = {}
        for role, x in reversed(list(tensors.items())):
            a = x if isinstance(x, int) else (0 if x is None else x.data_ptr())
            if a:
                where[a] = role
        return [where.get(a, a) for a in args[9 : 9 + slots]], list(args[9 + slots :])

    want = [named(tensors, args) for (_, tensors, _), args in zip(calls[:2], runs[:2])]
    assert want[0] == want[1] and all(isinstance(n, str) for n in want[0][0]), f"{name}: general slots {want}"
    for (_, tensors, _), args in zip(calls[2:], runs[2:]):
        assert named(tensors, args) == want[0], name
        assert args[:3] == runs[0][:3] and args[6:9] == (None, None, None), name


@pytest.mark.parametrize("case", ["misaligned cache", "overlapping slots and cache", "strict mode", *HOOKS])
def test_a_rerotation_record_declines_what_the_general_path_decides(case, stub_launches, monkeypatch):
    """Once the re-rotation's spec has its record, a call the record does not serve goes the
    general path (a pointer off the 16-byte grid, a launch hook); the call's checks run before the
    record on every call (strict mode's value checks; aliasing refused with nothing launched)."""

    runs, _ = stub_launches
    calls = _spy_rerotate(monkeypatch)
    table, rows = make_cache(8, D, device="cpu"), torch.tensor([1, 6, 3])

    def call(cache=None, slots=rows):
        return ropekit.rerotate_kv_cache(_caches("cpu")[0] if cache is None else cache, slots, -2, table)

    for _ in range(3):
        call()
    assert [p for p, _, _ in calls] == ["general", "general", "record"] and len(runs) == 3
    if case == "misaligned cache":
        buf = torch.zeros(4 * 4 * HK * D + 1, dtype=torch.bfloat16)
        call(cache=buf[1:].view(4, 4, HK, D))
    elif case == "overlapping slots and cache":
        cache = _caches("cpu")[0]
        with pytest.raises(ValueError, match="rerotate_kv_cache: .*(overlap|alias)"):
            call(cache=cache, slots=cache.view(torch.int64)[0, 0, 0, :3])
        assert len(calls) == 3 and len(runs) == 3  # refused before any launch
        return
    elif case == "strict mode":
        with ropekit.strict(), pytest.raises(ValueError, match="rerotate_kv_cache: slots"):
            call(slots=torch.tensor([1, 6, 300]))
        assert len(calls) == 3 and len(runs) == 3
        return
    else:
        with _declining(case, monkeypatch):
            call()
    assert [p for p, _, _ in calls][-1] == "general" and len(calls) == 4, case


def _same_operands(op: str):
    """A call of op whose operands are the same tensors every time (the steady state)."""
    if op == "store":
        operands = (*_qkv("cpu"), _pos("cpu"), make_cache(8, D), *_caches("cpu"), _slots("cpu"))
        return lambda: ropekit.apply_rope_and_store(*operands)
    cache, rows, table = _caches("cpu")[0], torch.tensor([1, 6, 3]), make_cache(8, D)
    return lambda: ropekit.rerotate_kv_cache(cache, rows, -2, table)


# each op's steady state with its record: (the call, the path's last functions, at most functions,
# files); the public op (rotate_with_angles: and the seam it calls) comes before them
FRAMES = {
    "rotation, in place": (lambda: _recorded_calls("cpu")["rotation, in place"], ["prepare", "rotate_record"], 3, 2),
    "rotation, per-token angles": (
        lambda: _recorded_calls("cpu")["rotation, per-token angles"],
        ["prepare", "rotate_record"],
        4,
        2,
    ),
    "store": (lambda: _same_operands("store"), ["prepare", "store_record"], 3, 2),
    "re-rotation": (lambda: _same_operands("re-rotation"), ["prepare", "rerotate_call", "rerotate_record"], 4, 3),
}


@pytest.mark.parametrize("name", FRAMES)
def test_a_launch_record_path_is_a_few_functions_in_a_few_files(name, stub_launches):
    """The steady state a record serves: the public op, prepare (the re-rotation: its call checks,
    which run on every call), the record; the compiled launcher is Triton's. The rotation and the
    store: 3 functions in 2 files (per-token angles: HF's seam too); the re-rotation 4 in 3."""
    from ropekit.tools import call_path

    make, last, functions, files = FRAMES[name]
    path = call_path.path_of(make())
    assert [f for _, f in path[-len(last) :]] == last, path
    assert path[-1][0] == "core/pipeline.py", path
    assert len(path) <= functions and len({f for f, _ in path}) == files, path
