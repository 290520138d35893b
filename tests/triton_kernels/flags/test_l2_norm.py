"""apply_rope(l2_norm=True) and apply_rope_and_store(l2_norm=True): Llama 4's qk L2 norm.

The oracle (reference.rms_norm_rope(l2_norm=True)) rotates first and normalizes each head after,
x / sqrt(mean(x^2) + eps), as Llama 4's attention does; ropekit normalizes in the same launch (before
the rotation, which keeps the sum of squares). Forward and backward against float64 on fresh random
inputs with poisoned outputs, the kernel (the interpreter on CPU, compiled on CUDA) and the PyTorch
path; the store; torch.compile through the custom op; the refusals.
"""

import pytest
import torch

import ropekit
from ropekit.api.store import apply_rope_and_store
from ropekit.core import memo
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err

pytestmark = pytest.mark.usefixtures("poison")

EPS = 1e-5  # Llama 4's rms_norm_eps

CASES = [
    # (token shape, Hq, Hk, D, rotary_dim, keywords)
    ((6,), 4, 2, 64, 64, {}),
    ((6,), 4, 2, 64, 64, {"interleaved": True}),
    ((2, 3), 4, 1, 96, 32, {}),  # GQA, partial rotary: the kept tail counts in the norm
]


def _inputs(shape, hq, hk, d, rot, dtype, device="cpu", grad=False):
    cache = make_cache(64, rot, device=device)
    # a scale per head: the norm must undo it head by head
    q = torch.randn(*shape, hq, d, dtype=torch.float64) * torch.rand(hq, 1, dtype=torch.float64).add(0.2) * 3
    k = torch.randn(*shape, hk, d, dtype=torch.float64) * torch.rand(hk, 1, dtype=torch.float64).add(0.2) * 3
    q, k = (x.to(dtype=dtype, device=device).requires_grad_(grad) for x in (q, k))
    return q, k, torch.randint(0, 64, shape, device=device), cache


def _oracle(q, k, positions, cache, **kw):
    d = lambda x: None if x is None else x.detach().double().cpu()  # noqa: E731
    return reference.rms_norm_rope(d(q), d(k), positions.cpu(), d(cache), l2_norm=True, norm_eps=EPS, **kw)


@pytest.mark.parametrize("shape,hq,hk,d,rot,kw", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_forward_matches_the_oracle(device, shape, hq, hk, d, rot, kw, dtype, inplace):
    memo.clear()
    q, k, positions, cache = _inputs(shape, hq, hk, d, rot, dtype, device)
    want_q, want_k = _oracle(q, k, positions, cache, **kw)
    qi, ki = q.clone(), k.clone()
    qo, ko = ropekit.apply_rope(qi, ki, positions, cache, l2_norm=True, norm_eps=EPS, inplace=inplace, **kw)
    assert (qo is qi) == inplace and (ko is ki) == inplace
    assert rel_err(qo, want_q) < TOL[dtype]
    assert rel_err(ko, want_k) < TOL[dtype]
    # every head has unit rms
    for x in (qo, ko):
        rms = x.double().pow(2).mean(-1).sqrt()
        assert torch.allclose(
            rms, torch.ones_like(rms), atol=3e-2 if dtype == torch.bfloat16 else 1e-4
        )  # eps: rms^2 = m / (m + eps)
    if not inplace:
        assert torch.equal(qi, q) and torch.equal(ki, k)


@pytest.mark.parametrize("shape,hq,hk,d,rot,kw", CASES)
def test_backward_matches_the_oracle(device, shape, hq, hk, d, rot, kw):
    memo.clear()
    q, k, positions, cache = _inputs(shape, hq, hk, d, rot, torch.float32, device, grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qo, ko = ropekit.apply_rope(q, k, positions, cache, l2_norm=True, norm_eps=EPS, **kw)
    torch.autograd.backward((qo, ko), (gq, gk))
    q64, k64 = (x.detach().double().cpu().requires_grad_() for x in (q, k))
    wq, wk = reference.rms_norm_rope(q64, k64, positions.cpu(), cache.double().cpu(), l2_norm=True, norm_eps=EPS, **kw)
    torch.autograd.backward((wq, wk), (gq.double().cpu(), gk.double().cpu()))
    assert rel_err(q.grad, q64.grad) < 1e-5
    assert rel_err(k.grad, k64.grad) < 1e-5


@pytest.mark.parametrize("shape,hq,hk,d,rot,kw", CASES[:2] + CASES[2:])
def test_both_cpu_paths(path, shape, hq, hk, d, rot, kw):
    """The PyTorch path and the interpreted kernel, forward and backward, against the oracle."""
    q, k, positions, cache = _inputs(shape, hq, hk, d, rot, torch.float32, grad=True)
    want_q, want_k = _oracle(q, k, positions, cache, **kw)
    qo, ko = ropekit.apply_rope(q, k, positions, cache, l2_norm=True, norm_eps=EPS, **kw)
    assert rel_err(qo, want_q) < TOL[torch.float32] and rel_err(ko, want_k) < TOL[torch.float32]
    gq = torch.randn_like(qo)
    qo.backward(gq)
    q64 = q.detach().double().requires_grad_()
    wq, _ = reference.rms_norm_rope(q64, None, positions, cache.double(), l2_norm=True, norm_eps=EPS, **kw)
    wq.backward(gq.double())
    assert rel_err(q.grad, q64.grad) < 1e-5


def test_q_alone_and_hf_layout(path):
    """k None, and layout='bhsd' (HF's (B, H, S, D) views)."""
    cache = make_cache(64, 32)
    q = torch.randn(2, 3, 5, 32)
    positions = torch.randint(0, 64, (2, 5))
    qo, ko = ropekit.apply_rope(q, None, positions, cache, layout="bhsd", l2_norm=True, norm_eps=EPS)
    want_q, _ = _oracle(q.transpose(1, 2), None, positions, cache)
    assert ko is None and rel_err(qo.transpose(1, 2), want_q) < TOL[torch.float32]


@pytest.mark.parametrize("rotary_position", ["first", "halves"])
def test_store(device, rotary_position):
    """apply_rope_and_store(l2_norm=True): q normalized and rotated in place, k's cache row too."""
    memo.clear()
    T, hq, hk, d, rot = 5, 4, 2, 64, 32
    q, k, positions, cache = _inputs((T,), hq, hk, d, rot, torch.float32, device)
    v = torch.randn(T, hk, d, device=device)
    kc = torch.full((3, 4, hk, d), float("nan"), device=device)
    vc = torch.full_like(kc, float("nan"))
    slots = torch.tensor([0, 5, -1, 7, 11], device=device)
    want_q, want_k = _oracle(q, k, positions, cache, rotary_position=rotary_position)
    qi = q.clone()
    apply_rope_and_store(
        qi, k, v, positions, cache, kc, vc, slots, l2_norm=True, norm_eps=EPS, rotary_position=rotary_position
    )
    assert rel_err(qi, want_q) < TOL[torch.float32]
    flat_k, flat_v = kc.view(-1, hk, d), vc.view(-1, hk, d)
    keep = slots >= 0
    assert rel_err(flat_k[slots[keep]], want_k[keep.cpu()]) < TOL[torch.float32]
    assert torch.equal(flat_v[slots[keep]], v[keep])
    unnamed = torch.ones(12, dtype=torch.bool)
    unnamed[slots[keep].cpu()] = False
    assert torch.isnan(flat_k.cpu()[unnamed]).all() and torch.isnan(flat_v.cpu()[unnamed]).all()


def test_torch_compile_two_shapes(path):
    """Through the custom op (dynamic=True), forward and backward, two token counts."""
    cache = make_cache(64, 32)

    def f(q, k, positions):
        return ropekit.apply_rope(q, k, positions, cache, l2_norm=True, norm_eps=EPS)

    compiled = torch.compile(f, dynamic=True, backend="eager", fullgraph=True)
    for n in (5, 9):
        q = torch.randn(n, 2, 48, requires_grad=True)
        k = torch.randn(n, 1, 48, requires_grad=True)
        positions = torch.randint(0, 64, (n,))
        got = compiled(q, k, positions)
        want = _oracle(q, k, positions, cache)
        for x, y in zip(got, want):
            assert rel_err(x, y) < TOL[torch.float32]
        g = torch.randn_like(got[1])
        got[1].backward(g)
        k64 = k.detach().double().requires_grad_()
        _, wk = reference.rms_norm_rope(q.detach().double(), k64, positions, cache.double(), l2_norm=True, norm_eps=EPS)
        wk.backward(g.double())
        assert rel_err(k.grad, k64.grad) < 1e-5


def test_transformers_llama4_l2norm(path):
    """Llama 4's own module after the rotation (transformers' Llama4TextL2Norm, when installed)."""
    llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")
    cache = make_cache(64, 64)
    q, k = torch.randn(7, 4, 64), torch.randn(7, 2, 64)
    positions = torch.randint(0, 64, (7,))
    plain_q, plain_k = ropekit.apply_rope(q, k, positions, cache, interleaved=True)
    norm = llama4.Llama4TextL2Norm(EPS)
    got_q, got_k = ropekit.apply_rope(q, k, positions, cache, interleaved=True, l2_norm=True, norm_eps=EPS)
    torch.testing.assert_close(got_q, norm(plain_q), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got_k, norm(plain_k), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rotary_position", ["first", "halves"])
def test_out_of_range_positions(device, rotary_position):
    """A position outside the table: that token's rotated dims NaN, its kept dims normalized (the
    norm of its head as the other tokens'), other tokens exact; the oracle agrees."""
    memo.clear()
    q, k, _, cache = _inputs((4,), 3, 2, 64, 32, torch.float32, device)
    positions = torch.tensor([3, 64, -1, 5], device=device)
    want_q, want_k = _oracle(q, k, positions, cache, rotary_position=rotary_position)
    qo, ko = ropekit.apply_rope(q, k, positions, cache, l2_norm=True, norm_eps=EPS, rotary_position=rotary_position)
    for got, want in ((qo, want_q), (ko, want_k)):
        got = got.double().cpu()
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.isnan(got[1:3]).any() and not torch.isnan(got[1:3]).all()  # rotated dims only
        fin = ~torch.isnan(want)
        assert rel_err(got[fin], want[fin]) < TOL[torch.float32]
