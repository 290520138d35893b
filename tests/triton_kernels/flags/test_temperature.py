"""apply_rope(q_temperature=(floor_scale, attn_scale)): Llama 4's attention temperature tuning.

q's outputs (rotated dims and kept tail) times log(floor((pos + 1) / floor_scale) + 1) * attn_scale
+ 1 of their token, k untouched; forward and backward against the float64 oracle on fresh random
inputs, outputs poisoned with NaN, the kernel (the Triton interpreter on CPU) and the PyTorch path;
and against transformers' own formula.
"""

import pytest
import torch

import ropekit
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err

pytestmark = pytest.mark.usefixtures("poison")

TEMP = (4.0, 0.25)  # small floor_scale: the factor changes within the table's positions

CASES = [
    # (token shape, Hq, Hk, D, rotary_dim, keywords)
    ((6,), 4, 2, 64, 64, {}),
    ((6,), 4, 2, 64, 64, {"interleaved": True}),
    ((2, 3), 4, 1, 96, 32, {}),  # GQA, partial rotary (a kept tail), (B, S) positions
]


def _inputs(shape, hq, hk, d, rot, dtype, grad=False):
    cache = make_cache(64, rot)
    q = torch.randn(*shape, hq, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(*shape, hk, d, dtype=dtype, requires_grad=grad)
    return q, k, torch.randint(0, 64, shape), cache


def _oracle(q, k, positions, cache, **kw):
    return reference.apply_rope(q.double(), k.double(), positions, cache.double(), q_temperature=TEMP, **kw)


@pytest.mark.parametrize("shape,hq,hk,d,rot,kw", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_forward_matches_the_oracle(path, shape, hq, hk, d, rot, kw, dtype, inplace):
    q, k, positions, cache = _inputs(shape, hq, hk, d, rot, dtype)
    want_q, want_k = _oracle(q, k, positions, cache, **kw)
    qi, ki = q.clone(), k.clone()
    qo, ko = ropekit.apply_rope(qi, ki, positions, cache, q_temperature=TEMP, inplace=inplace, **kw)
    assert (qo is qi) == inplace and (ko is ki) == inplace
    assert qo.dtype == dtype and ko.dtype == dtype
    assert rel_err(qo, want_q) < TOL[dtype]
    assert rel_err(ko, want_k) < TOL[dtype]
    # the tail is scaled too, k's is not
    if d > rot:
        assert not torch.equal(qo[..., rot:], q[..., rot:]) and torch.equal(ko[..., rot:], k[..., rot:])
    if not inplace:
        assert torch.equal(qi, q) and torch.equal(ki, k)


@pytest.mark.parametrize("shape,hq,hk,d,rot,kw", CASES)
def test_backward_matches_the_oracle(path, shape, hq, hk, d, rot, kw):
    q, k, positions, cache = _inputs(shape, hq, hk, d, rot, torch.float32, grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qo, ko = ropekit.apply_rope(q, k, positions, cache, q_temperature=TEMP, **kw)
    torch.autograd.backward((qo, ko), (gq, gk))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    wq, wk = reference.apply_rope(q64, k64, positions, cache.double(), q_temperature=TEMP, **kw)
    torch.autograd.backward((wq, wk), (gq.double(), gk.double()))
    assert rel_err(q.grad, q64.grad) < TOL[torch.float32]
    assert rel_err(k.grad, k64.grad) < TOL[torch.float32]


def test_gradient_of_k_alone_is_not_scaled(path):
    """With only k requiring grad, its gradient is R(-pos) g: no temperature."""
    q, k, positions, cache = _inputs((5,), 2, 2, 64, 64, torch.float32)
    k.requires_grad_()
    g = torch.randn_like(k)
    _, ko = ropekit.apply_rope(q, k, positions, cache, q_temperature=TEMP)
    ko.backward(g)
    c, s = reference.angles_from_table(cache.double(), positions, (5,))
    assert rel_err(k.grad, reference.rotate(g.double(), c, s, inverse=True)) < TOL[torch.float32]


def test_hf_layout(path):
    """layout='bhsd' (HF's (B, H, S, D) views): the factor follows each token's position."""
    cache = make_cache(64, 32)
    q, k = torch.randn(2, 3, 5, 32), torch.randn(2, 1, 5, 32)
    positions = torch.randint(0, 64, (2, 5))
    qo, ko = ropekit.apply_rope(q, k, positions, cache, layout="bhsd", q_temperature=TEMP)
    want_q, want_k = _oracle(q.transpose(1, 2), k.transpose(1, 2), positions, cache)
    assert rel_err(qo.transpose(1, 2), want_q) < TOL[torch.float32]
    assert rel_err(ko.transpose(1, 2), want_k) < TOL[torch.float32]


def test_transformers_formula(path):
    """Llama 4's own scale, restated from transformers/models/llama4/modeling_llama4.py
    (Llama4TextAttention.forward, lines 366-367: log1p(floor((positions + 1) / floor_scale)) *
    attn_scale + 1, with Llama 4's floor_scale 8192 and attn_scale 0.1), on positions around
    its steps."""
    floor_scale, attn_scale = 8192.0, 0.1
    positions = torch.tensor([0, 1, 8190, 8191, 8192, 16382, 16383, 16384, 30000])
    cache = make_cache(30001, 32)
    q = torch.randn(len(positions), 2, 32)
    plain, _ = ropekit.apply_rope(q, None, positions, cache)
    tuned, _ = ropekit.apply_rope(q, None, positions, cache, q_temperature=(floor_scale, attn_scale))
    hf = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    assert hf[3].item() == 1.0 + 0.1 * torch.log1p(torch.tensor(1.0)).item()  # pos 8191: the first step
    torch.testing.assert_close(tuned, plain * hf[:, None, None], rtol=1e-6, atol=1e-6)


def test_torch_compile_two_shapes(path):
    """Through the custom op (dynamic=True): the floats travel with the op, forward and backward."""
    cache = make_cache(64, 32)

    def f(q, k, positions):
        return ropekit.apply_rope(q, k, positions, cache, q_temperature=TEMP)

    compiled = torch.compile(f, dynamic=True, backend="eager", fullgraph=True)
    for n in (5, 9):
        q = torch.randn(n, 2, 48, requires_grad=True)
        k = torch.randn(n, 1, 48, requires_grad=True)
        positions = torch.randint(0, 64, (n,))
        want = _oracle(q.detach(), k.detach(), positions, cache)
        got = compiled(q, k, positions)
        for x, y in zip(got, want):
            assert rel_err(x, y) < TOL[torch.float32]
        g = torch.randn_like(got[0])
        got[0].backward(g)
        c, s = reference.angles_from_table(cache.double(), positions, (n,))
        factor = torch.log(torch.floor((positions.double() + 1) / TEMP[0]) + 1) * TEMP[1] + 1
        gd = g.double() * factor[:, None, None]
        want_dq = torch.cat((reference.rotate(gd[..., :32], c, s, inverse=True), gd[..., 32:]), -1)
        assert rel_err(q.grad, want_dq) < TOL[torch.float32]


def test_sbhd_layout_and_destinations(path):
    """layout='sbhd' ((S, B) positions) and given destinations q_out / k_out."""
    cache = make_cache(64, 32)
    q, k = torch.randn(5, 2, 3, 48), torch.randn(5, 2, 1, 48)
    positions = torch.randint(0, 64, (5, 2))
    qo, ko = ropekit.apply_rope(q, k, positions, cache, layout="sbhd", q_temperature=TEMP)
    want_q, want_k = _oracle(q.transpose(0, 1), k.transpose(0, 1), positions.t(), cache)
    assert rel_err(qo.transpose(0, 1), want_q) < TOL[torch.float32]
    assert rel_err(ko.transpose(0, 1), want_k) < TOL[torch.float32]
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    got = ropekit.apply_rope(q, k, positions, cache, layout="sbhd", q_temperature=TEMP, q_out=q_out, k_out=k_out)
    assert got[0] is q_out and got[1] is k_out
    assert torch.equal(q_out, qo) and torch.equal(k_out, ko)
