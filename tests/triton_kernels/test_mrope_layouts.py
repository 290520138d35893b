"""M-RoPE of any number of sections and any section layout (apply_rope's mrope_section of N ints,
positions (N, *T), and mrope_layout: a preset or an explicit per-pair row map), against the float64
oracle: the presets' orders against hand-written ones, then forward (out of place and in place),
backward, per-token angles and the custom-op encoding for N = 1 to 4 and every preset.

The fused norm's cases are in test_qknorm.py, the store's in ops/store/test_store_angles.py, the
refusals in ops/test_bad_inputs.py, torch.compile's in ops/test_compile_dynamic.py.
"""

import pytest
import torch

import ropekit
from ropekit.core.variant import MROPE_CHUNKED, MROPE_INTERLEAVED, MROPE_MAP, Variant, mrope_axes
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err

pytestmark = pytest.mark.usefixtures("poison")

# (mrope_section, mrope_layout): N = 1 to 4, every preset, an explicit map; rotary_dim 16 (8 pairs)
CASES = {
    "n1-chunked": ((8,), "chunked"),
    "n2-chunked": ((3, 5), "chunked"),
    "n3-chunked": ((2, 3, 3), "chunked"),
    "n4-chunked": ((2, 2, 1, 3), "chunked"),
    "n3-interleaved": ((4, 2, 2), "interleaved"),
    "n4-interleaved": ((2, 2, 2, 2), "interleaved"),
    "n3-ernie": ((3, 3, 2), "ernie"),
    "n4-ernie": ((2, 2, 2, 2), "ernie"),
    "n3-bailing": ((2, 3, 3), "bailing"),
    "n2-pangu": ((3, 5), "pangu"),
    "n3-pangu": ((4, 2, 2), "pangu"),
    "n4-pangu": ((1, 2, 2, 3), "pangu"),
    "n3-map": ((2, 3, 3), (2, 0, 1, 2, 1, 0, 2, 1)),
    "n4-map": ((2, 2, 2, 2), [3, 3, 2, 1, 0, 0, 1, 2]),
}


def test_preset_orders():
    """Each preset's order, written out by hand (mrope_axes and the oracle's own code alike)."""
    want = {
        ("chunked", (2, 3, 3)): [0, 0, 1, 1, 1, 2, 2, 2],
        ("interleaved", (4, 2, 2)): [0, 1, 2, 0, 1, 2, 0, 0],  # Qwen3-VL: h at 1, 4; w at 2, 5
        ("interleaved", (2, 2, 2, 2)): [0, 1, 2, 3, 0, 1, 2, 3],
        ("ernie", (3, 3, 2)): [1, 2, 1, 2, 1, 2, 0, 0],  # (h, w, t): h w h w h w t t
        ("ernie", (2, 2, 2, 2)): [1, 2, 3, 1, 2, 3, 0, 0],
        ("bailing", (2, 3, 3)): [1, 2, 1, 2, 1, 2, 0, 0],  # (t, h, w): the same order
        ("pangu", (3, 5)): [0, 1, 0, 1, 0, 1, 1, 1],  # vLLM: get_mrope_interleaved_id_list(3, 5, 0)
        # vLLM's get_mrope_interleaved_id_list(4, 2, 2, force_last=True): 3 t spread, then the 4th t
        ("pangu", (4, 2, 2)): [0, 1, 2, 0, 1, 2, 0, 0],
    }
    for (layout, sections), rows in want.items():
        assert list(mrope_axes(layout, sections)) == rows, (layout, sections)
        assert reference.mrope_sections_of_frequencies(8, sections, False, layout).tolist() == rows, (layout, sections)


@pytest.mark.parametrize("case", list(CASES))
def test_oracle_and_record_agree_on_every_map(case):
    sections, layout = CASES[case]
    half = sum(sections)
    got = mrope_axes(layout, sections)
    assert list(got) == reference.mrope_sections_of_frequencies(half, sections, False, layout).tolist()
    assert sorted(set(got)) <= list(range(len(sections)))


def _inputs(device, sections, T=(3,), Hq=2, Hk=1, D=20, dtype=torch.float32, max_pos=24):
    q = torch.randn(*T, Hq, D, dtype=dtype, device=device)
    k = torch.randn(*T, Hk, D, dtype=dtype, device=device)
    pos = torch.randint(0, max_pos, (len(sections), *T), device=device)
    return q, k, pos, make_cache(max_pos, 16, device=device)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward(device, case, interleaved):
    sections, layout = CASES[case]
    q, k, pos, cache = _inputs(device, sections)
    kw = dict(interleaved=interleaved, mrope_section=sections, mrope_layout=layout)
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double(), **kw)
    q0, k0 = q.clone(), k.clone()
    qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert rel_err(qo, rq) < TOL[torch.float32] and rel_err(ko, rk) < TOL[torch.float32]
    assert torch.equal(qo[..., 16:], q0[..., 16:]), "the tail past rotary_dim kept"
    qi, ki = ropekit.apply_rope(q, k, pos, cache, inplace=True, **kw)
    assert qi is q and rel_err(q, rq) < TOL[torch.float32] and rel_err(k, rk) < TOL[torch.float32]


def test_two_token_dims_bf16(device):
    sections, layout = (2, 2, 2, 2), "ernie"
    q, k, pos, cache = _inputs(device, sections, T=(2, 3), dtype=torch.bfloat16)
    kw = dict(mrope_section=sections, mrope_layout=layout)
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double(), **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
    assert rel_err(qo, rq) < TOL[torch.bfloat16] and rel_err(ko, rk) < TOL[torch.bfloat16]


def test_each_pair_follows_its_row(device):
    """Pair j rotates by the angle of position row map[j] (a hand-built table, an explicit map)."""
    q = torch.randn(1, 1, 16, device=device)
    cache = make_cache(64, 16, device=device)
    pos = torch.tensor([[3], [17], [41], [60]], device=device)
    rows = [3, 1, 0, 2, 2, 0, 1, 3]
    p = pos[rows, 0]
    cos, sin = cache[p, torch.arange(8, device=device)], cache[p, 8 + torch.arange(8, device=device)]
    want = reference.rotate(q.double(), cos.double()[None], sin.double()[None])
    got, _ = ropekit.apply_rope(q, None, pos, cache, mrope_section=(2, 2, 2, 2), mrope_layout=rows)
    assert rel_err(got, want) < 1e-6


def test_bad_position_row_poisons_only_its_pairs(device):
    q = torch.randn(1, 1, 16, device=device)
    cache = make_cache(16, 16, device=device)
    pos = torch.tensor([[1], [99], [2], [3]], device=device)  # row 1 off the table
    out, _ = ropekit.apply_rope(q, None, pos, cache, mrope_section=(2, 2, 2, 2), mrope_layout="ernie")
    bad = torch.isnan(out[0, 0].cpu())
    rows = torch.tensor(mrope_axes("ernie", (2, 2, 2, 2)))
    assert torch.equal(bad[:8], rows == 1) and torch.equal(bad[8:], rows == 1)


@pytest.mark.parametrize("case", ["n1-chunked", "n2-pangu", "n4-ernie", "n3-bailing", "n4-map", "n3-interleaved"])
def test_backward(device, case):
    sections, layout = CASES[case]
    q, k, pos, cache = _inputs(device, sections, T=(2, 2))
    kw = dict(mrope_section=sections, mrope_layout=layout)
    mq, mk = (x.clone().requires_grad_(True) for x in (q, k))
    rq, rk = (x.double().requires_grad_(True) for x in (q, k))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qo, ko = ropekit.apply_rope(mq, mk, pos, cache, **kw)
    (qo * gq).sum().add((ko * gk).sum()).backward()
    oq, ok = reference.apply_rope(rq, rk, pos, cache.double(), **kw)
    (oq * gq.double()).sum().add((ok * gk.double()).sum()).backward()
    assert rel_err(mq.grad, rq.grad) < TOL[torch.float32] and rel_err(mk.grad, rk.grad) < TOL[torch.float32]


@pytest.mark.parametrize("case", ["n2-chunked", "n4-ernie", "n3-pangu", "n3-map"])
def test_per_token_angles(device, case):
    """rotate_with_angles with (N, *T, half) cos / sin: pair j's angle from row map[j]."""
    sections, layout = CASES[case]
    q, k, pos, cache = _inputs(device, sections)
    cos, sin = cache[pos, :8], cache[pos, 8:]
    qo, ko = ropekit.rotate_with_angles(q, k, cos, sin, mrope_section=sections, mrope_layout=layout)
    rq, rk = reference.apply_rope(
        q.double(), k.double(), pos, cache.double(), mrope_section=sections, mrope_layout=layout
    )
    assert rel_err(qo, rq) < TOL[torch.float32] and rel_err(ko, rk) < TOL[torch.float32]


def test_record_mode_and_encoding():
    """The three-row Qwen layouts stay the kernels' computed modes, whatever spells them; every
    other map is MROPE_MAP; the custom ops' encoding carries sections and map both ways."""
    from ropekit.core.rules import mrope_args

    def variant_of(sections, layout, interleaved=False):
        m = mrope_args("apply_rope", sections, interleaved, sum(sections), layout)
        return Variant(mrope=m.mode, sections=m.sections, axis_map=m.axis_map)

    assert variant_of((2, 3, 3), None).mrope == MROPE_CHUNKED
    assert variant_of((2, 3, 3), [0, 0, 1, 1, 1, 2, 2, 2]).mrope == MROPE_CHUNKED
    assert variant_of((4, 2, 2), None, True).mrope == MROPE_INTERLEAVED
    assert variant_of((4, 2, 2), "interleaved").mrope == MROPE_INTERLEAVED
    for sections, layout in CASES.values():
        v = variant_of(sections, layout)
        assert v.mrope in (MROPE_CHUNKED, MROPE_INTERLEAVED, MROPE_MAP)
        assert Variant.decode(v.encode()) == v
    assert variant_of((3, 3, 2), "ernie").mrope == MROPE_MAP
    assert variant_of((8,), "chunked").mrope == MROPE_MAP
