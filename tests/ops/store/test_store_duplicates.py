"""Duplicate slots in apply_rope_and_store's slot_mapping.

Contract: two tokens naming one slot are a caller error. Without strict mode the row holds an
unspecified mix (each element comes from one of the tokens naming it, k and v possibly from
different tokens); every other row is exact. Under ropekit.strict() the call raises ValueError
naming the slot and both tokens before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from ropekit.api.store import apply_rope_and_store
from ropekit.core import strict
from ropekit.tools import reference

from conftest import make_cache


def _inputs(T, H, D, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, H, D, generator=g).to(device) for _ in range(3))
    pos = torch.randint(0, 64, (T,), generator=g).to(device)
    return q, k, v, pos, make_cache(64, D, device=device)


@pytest.mark.parametrize("shape", [(6,), (2, 3)], ids=["flat", "batched"])
def test_strict_refuses_duplicate_slots_before_writing(device, shape):
    T, H, D = 6, 2, 32
    q, k, v, pos, table = _inputs(T, H, D, device)
    q, k, v, pos = (x.reshape(*shape, *x.shape[1:]) for x in (q, k, v, pos))
    k_cache = torch.full((4, 4, H, D), float("nan"), device=device)
    v_cache = torch.full((4, 4, H, D), float("nan"), device=device)
    slots = torch.tensor([3, -1, 7, -1, 3, 7], device=device).reshape(shape)  # padding may repeat
    q0 = q.clone()
    where = "[0] and slot_mapping[4]" if len(shape) == 1 else "[0, 0] and slot_mapping[1, 1]"
    with (
        strict.strict(),
        pytest.raises(
            ValueError,
            match=r"apply_rope_and_store: slot_mapping: expected "
            r"distinct slots .*got slot 3 at slot_mapping" + where.replace("[", r"\[").replace("]", r"\]"),
        ),
    ):
        apply_rope_and_store(q, k, v, pos, table, k_cache, v_cache, slots)
    assert torch.equal(q, q0), "q written before the error"
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all(), "cache written before the error"


def test_strict_accepts_distinct_slots_and_repeated_padding(device):
    T, H, D = 4, 2, 32
    q, k, v, pos, table = _inputs(T, H, D, device)
    k_cache = torch.zeros(4, 4, H, D, device=device)
    v_cache = torch.zeros(4, 4, H, D, device=device)
    with strict.strict():
        apply_rope_and_store(q, k, v, pos, table, k_cache, v_cache, torch.tensor([5, -1, 2, -1], device=device))
    c, s = reference.angles_from_table(table.double(), pos, (T,))
    want_k = reference.rotate(k.double(), c, s)
    k_rows, v_rows = k_cache.view(-1, H, D), v_cache.view(-1, H, D)
    for t, slot in ((0, 5), (2, 2)):
        assert torch.allclose(k_rows[slot].double(), want_k[t], atol=1e-5)
        assert torch.equal(v_rows[slot], v[t])
    untouched = [i for i in range(16) if i not in (5, 2)]
    assert not k_rows[untouched].any() and not v_rows[untouched].any()


def _check_mix(device, T=64, H=8, D=64, dup_every=4):
    """Without strict mode: rows named once are exact; a duplicated row's every element is that
    element of one of the tokens naming it."""
    q, k, v, pos, table = _inputs(T, H, D, device, seed=1)
    slots = (torch.arange(T) // dup_every).to(device)  # groups of dup_every tokens share a slot
    slots[::dup_every] = torch.arange(T // dup_every, 2 * (T // dup_every)).to(device)  # one unique per group
    n_slots = 2 * (T // dup_every)
    k_cache = torch.full((n_slots, H, D), float("nan"), device=device)
    v_cache = torch.full((n_slots, H, D), float("nan"), device=device)
    _, k_rot = reference.apply_rope(q.double(), k.double(), pos, table.double())
    apply_rope_and_store(q, k, v, pos, table, k_cache, v_cache, slots)
    for cache, rows, tol in ((k_cache, k_rot, 1e-5), (v_cache, v.double(), 0.0)):
        cache = cache.double().cpu()
        rows = rows.cpu()
        for slot in range(n_slots):
            tokens = (slots.cpu() == slot).nonzero().flatten()
            cand = rows[tokens]  # (n, H, D)
            match = ((cache[slot][None] - cand).abs() <= tol + 1e-5 * cand.abs()).any(0)
            assert match.all(), f"slot {slot}: an element from none of tokens {tokens.tolist()}"


def test_duplicate_slots_store_elements_of_the_naming_tokens_cpu():
    _check_mix("cpu")


@pytest.mark.gpu
def test_duplicate_slots_store_elements_of_the_naming_tokens_gpu():
    """On the GPU the programs of different tokens race for the row: still, no element is torn or
    foreign, and strict mode refuses (test_strict_refuses_duplicate_slots_before_writing[cuda])."""
    for seed_T in (64, 4096):
        _check_mix("cuda", T=seed_T, H=8, D=128, dup_every=2)
