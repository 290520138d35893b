"""The addresses each run step hands the launch. On a GPU the direct launch passes them to the
compiled kernel as they are (it never asks the tensors again), so a wrong one reads or writes
elsewhere; the interpreter on CPU launches through Triton's own path, which ignores them. This is
their check without a GPU: for each op and the signatures that change its pointer slots, the
addresses are the slots' tensors' own, slot by slot, and `bits` is their OR.

The launch is replaced by a recorder (nothing runs), and the kernel path is taken for CPU tensors
whatever TRITON_INTERPRET says (the plans are built from shapes and strides only)."""

import functools
import operator

import pytest
import torch

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


class _Runtime:  # Triton's knobs.runtime with no launch hook registered
    launch_enter_hook = launch_exit_hook = None


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
    monkeypatch.setitem(launch._STATE, "tools", (lambda device: 0, _Runtime))
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


@pytest.mark.parametrize("case", ["misaligned q", "k is q in place", "another table", "strict mode", "a launch hook"])
def test_a_launch_record_declines_what_the_general_path_decides(case, stub_launches, monkeypatch):
    """Once a spec has its record, a call the record does not serve goes the general path, which
    decides it: a pointer off the 16-byte grid (its own compiled entry), in-place operands that
    overlap (refused with the aliasing named, nothing launched), a new table (its values read),
    strict mode (its value checks), a profiler's launch hook (handed the launch's metadata)."""
    from ropekit.core import dispatch, launch
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
    elif case == "strict mode":
        with ropekit.strict():
            call()
    else:

        class Chain:  # Triton's HookChain with one hook registered
            calls = [lambda *a: None]

        # on the runtime knobs the launches read (the record keeps that object, as Triton's is one)
        monkeypatch.setattr(launch._STATE["tools"][1], "launch_enter_hook", Chain())
        call()
    assert paths == ["general"] * 3, case


@pytest.mark.parametrize("name", ["rotation, in place", "rotation, per-token angles"])
def test_a_launch_record_is_at_most_five_functions_in_three_files(name, stub_launches):
    """The steady state a record serves: the public op (rotate_with_angles: and the seam it calls),
    prepare, the record and its launch-hook test; the compiled launcher is Triton's."""
    from ropekit.tools import call_path

    path = call_path.path_of(_recorded_calls("cpu")[name])
    assert path[-3:] == [
        ("core/pipeline.py", "prepare"),
        ("core/pipeline.py", "rotate_record"),
        ("core/launch.py", "hooked"),
    ]
    assert len(path) <= 5 and len({f for f, _ in path}) == 3, path
