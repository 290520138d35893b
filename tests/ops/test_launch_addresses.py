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
