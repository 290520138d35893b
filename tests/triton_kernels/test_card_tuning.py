"""A card's own launches of the plain rotation's head loop (ropekit.core.tuning.CARD_PLAIN): which
calls take them, that a set knob or card_tuning=False turns them off, and on CUDA that the calls
that take them (whatever the card) match the float64 reference, in the layouts they serve."""

import pytest
import torch

import ropekit
from ropekit.core import tuning
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err, spy_plans

pytestmark = pytest.mark.usefixtures("poison")

H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    "card,elems,want",
    [
        (H100, 9216, (4096, 8)),  # W2: 64 + 8 heads of 128 (PERF_LOG v48)
        (H100, 8256, (4096, 8)),  # W6: 128 + 1 heads, 64 rotated dims
        (H100, 8192, (4096, 8)),
        (H100, 8191, None),
        (H100, 6144, None),  # W5: the defaults
        (H100, 5120, None),  # W1: 32 + 8 heads of 128, no gain in the bench
        (H100, 1024, None),
        ("NVIDIA H100 PCIe", 9216, (4096, 8)),
        ("NVIDIA H200", 9216, None),  # the defaults came from its sweeps
        ("NVIDIA A100-SXM4-80GB", 5120, None),
    ],
)
def test_rows(card, elems, want):
    assert tuning.plain_rows(card, elems) == want


def test_cpu_and_set_knobs_take_the_defaults():
    assert tuning.card_plain(torch.device("cpu"), 9216) is None
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda")
    for knobs in ({"block_elems": 2048}, {"num_warps": 4}, {"card_tuning": False}):
        with tuning.override(**knobs):
            assert tuning.card_plain(dev, 9216) is None, knobs
    assert tuning.card_plain(dev, 9216) == tuning.plain_rows(torch.cuda.get_device_name(), 9216)


def test_strided_knobs_unless_the_layout_is_set():
    assert tuning.strided_plain() == (tuning.get("strided_block_elems"), tuning.get("strided_warps"))
    with tuning.override(strided_block_elems=256, strided_warps=4):
        assert tuning.strided_plain() == (256, 4)
    for knobs in ({"block_elems": 2048}, {"num_warps": 4}):
        with tuning.override(**knobs):
            assert tuning.strided_plain() is None, knobs


@pytest.fixture
def launches(monkeypatch):
    """(BLOCK_H, num_warps, STRIDED_IN, STRIDED_OUT) of every rope_kernel plan made from here on."""
    return spy_plans(monkeypatch, lambda m: (m["BLOCK_H"], m["num_warps"], m["STRIDED_IN"], m["STRIDED_OUT"]))


@pytest.mark.parametrize("inplace", [False, True], ids=["strided input", "in place"])
def test_a_strided_plain_rotation_takes_the_strided_knobs(device, launches, inplace):
    """A table-driven call past decode size with a last stride of 2 (read, and in place written):
    blocks of strided_block_elems rotated elements and strided_warps warps; a unit-stride call of
    the same shapes does not take them."""
    from ropekit.core import checks

    if not checks.triton_runs(torch.empty(1, device=device)):
        pytest.skip("the PyTorch path plans no launch")
    T, D = 8, 64
    cache = make_cache(T, D, device=device)
    pos = torch.arange(T, device=device)
    q = torch.randn(T, 8, D, device=device)
    k = torch.randn(T, 2, D, device=device)
    wide = torch.empty(T, 8, 2 * D, device=device)[..., ::2]
    wide.copy_(q)
    # 8 tokens past decode size: the head loop, whose plain launches take the knobs
    with tuning.override(decode_tokens=4, strided_block_elems=256, strided_warps=4):
        ropekit.apply_rope(wide, k, pos, cache, inplace=inplace)
        ropekit.apply_rope(q, k, pos, cache, inplace=inplace)
    assert launches[0] == (256 // D, 4, True, inplace), launches
    assert launches[1][:2] != (256 // D, 4) and launches[1][2:] == (False, False), launches


# (token shape, Hq, Hk, D, rotary_dim, keywords): rotated elements a token of each row of CARD_PLAIN,
# more tokens than a decode-sized call
CALLS = [
    ((1100,), 64, 8, 128, 128, {}),  # 9216: W2's heads
    ((2, 600), 64, 8, 128, 128, {"layout": "bshd"}),  # 9216 in (B, S, H, D)
    ((1100,), 128, 1, 192, 64, {"rotary_position": "last"}),  # 8256: W6's heads, the last 64 dims
    ((1100,), 64, 8, 128, 128, {"interleaved": True}),
    ((1100,), 64, 8, 128, 128, {"strided": True}),  # a last stride of 2: the strided knobs
]


def _on_cuda(x, step):
    """x on the GPU, as a view of last stride `step` (every other element of a wider buffer for 2)."""
    buf = torch.zeros(*x.shape[:-1], x.shape[-1] * step, dtype=x.dtype, device="cuda")
    view = buf[..., ::step]
    view.copy_(x)
    return view


@pytest.mark.gpu
@pytest.mark.parametrize("card_tuning", [True, False], ids=["card", "defaults"])
@pytest.mark.parametrize("shape,hq,hk,d,rot,kw", CALLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_rotation_matches_the_reference(shape, hq, hk, d, rot, kw, dtype, card_tuning):
    g = torch.Generator().manual_seed(hq + d)
    kw = dict(kw)
    step = 2 if kw.pop("strided", False) else 1
    q = torch.randn(*shape, hq, d, generator=g).to(dtype)
    k = torch.randn(*shape, hk, d if "rotary_position" not in kw else rot, generator=g).to(dtype)
    pos = torch.randint(0, 4096, shape, generator=g)
    cache = make_cache(4096, rot)
    ref_kw = {n: v for n, v in kw.items() if n != "layout"}
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double(), **ref_kw)
    pc, cc = pos.cuda(), cache.cuda()
    with tuning.override(card_tuning=card_tuning):
        qo, ko = ropekit.apply_rope(_on_cuda(q, step), _on_cuda(k, step), pc, cc, **kw)
        qi, ki = _on_cuda(q, step), _on_cuda(k, step)
        ropekit.apply_rope(qi, ki, pc, cc, inplace=True, **kw)
    for got in ((qo, ko), (qi, ki)):
        assert rel_err(got[0].cpu(), rq) < TOL[dtype]
        assert rel_err(got[1].cpu(), rk) < TOL[dtype]
