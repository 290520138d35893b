"""apply_rope(eager_rounding=True): the rotation rounded as eager PyTorch's
`q * cos + rotate_half(q) * sin` rounds in q's dtype (cos / sin, each product, the sum).

The expected values are that eager expression itself, computed by torch's own bf16 / fp16 ops on
the same device (Hugging Face's apply_rotary_pos_emb is this expression; bf16, fp16 and fp32), and the float64 oracle
with the same roundings (reference.rotate(eager_rounding=True)): both are compared bit for bit, on
fresh random inputs, with NaN-poisoned outputs. Also: the default rounding differs from eager in
many elements (so these tests can fail), the backward equals eager autograd's bit for bit, the
flag composes with the other flags, torch.compile (dynamic shapes) runs it, and the refusals.
"""

import pytest
import torch

import ropekit
from ropekit.core import memo
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err

pytestmark = pytest.mark.usefixtures("poison")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CASES = [
    # (token shape, Hq, Hk, D, rotary_dim, interleaved, in place)
    ((40,), 4, 2, 64, 64, False, False),
    ((40,), 4, 2, 64, 64, True, True),
    ((3, 11), 4, 1, 96, 32, False, True),  # GQA, partial rotary: the tail is copied (out of place)
    ((17,), 2, 2, 128, 64, True, False),
]


def _rotate_half(x, interleaved):
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager(x, cache, positions, rot, interleaved, inverse=False):
    """Hugging Face's eager rotation in x's dtype, on x's device: cos / sin rows cast to x's dtype,
    repeated over both members of a pair, then x * cos + rotate_half(x) * sin (each op rounds)."""
    half = rot // 2
    c, s = (cache[positions.long()][..., i * half : (i + 1) * half].to(x.dtype) for i in (0, 1))
    if inverse:
        s = -s
    if interleaved:
        c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
    else:
        c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
    c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    xr = x[..., :rot]
    return torch.cat((xr * c + _rotate_half(xr, interleaved) * s, x[..., rot:]), dim=-1)


def _inputs(shape, hq, hk, d, rot, dtype, device, grad=False):
    cache = make_cache(4096, rot, device=device)
    q = torch.randn(*shape, hq, d, device=device).mul(4).to(dtype).requires_grad_(grad)
    k = torch.randn(*shape, hk, d, device=device).mul(4).to(dtype).requires_grad_(grad)
    return q, k, torch.randint(0, 4096, shape, device=device), cache


@pytest.mark.parametrize("shape,hq,hk,d,rot,il,inplace", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_the_eager_expression(device, shape, hq, hk, d, rot, il, inplace, dtype):
    memo.clear()
    q, k, positions, cache = _inputs(shape, hq, hk, d, rot, dtype, device)
    want_q, want_k = eager(q, cache, positions, rot, il), eager(k, cache, positions, rot, il)
    oracle_q, oracle_k = reference.apply_rope(
        q.cpu(), k.cpu(), positions.cpu(), cache.cpu(), interleaved=il, eager_rounding=True
    )
    assert torch.equal(oracle_q, want_q.cpu()) and torch.equal(oracle_k, want_k.cpu())
    qi, ki = q.clone(), k.clone()
    got_q, got_k = ropekit.apply_rope(qi, ki, positions, cache, interleaved=il, inplace=inplace, eager_rounding=True)
    assert (got_q is qi) == inplace
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # the default rounds once: in 16 bits it differs from the eager expression (the flag is not a
    # no-op); in float32 only where the compiler fuses a product into the sum (CUDA, not the interpreter)
    plain_q, _ = ropekit.apply_rope(q, k, positions, cache, interleaved=il)
    assert rel_err(plain_q, want_q) < TOL[dtype]
    if dtype != torch.float32:
        assert (plain_q != want_q).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_into_poisoned_outputs(device, dtype):
    """Given q_out / k_out full of NaN (and a float32 k_out): every element written, eager values."""
    memo.clear()
    q, k, positions, cache = _inputs((9,), 4, 2, 64, 48, dtype, device)
    q_out = torch.full_like(q, float("nan"))
    k_out = torch.full(k.shape, float("nan"), device=device, dtype=dtype)
    got_q, got_k = ropekit.apply_rope(q, k, positions, cache, q_out=q_out, k_out=k_out, eager_rounding=True)
    assert got_q is q_out and got_k is k_out
    assert torch.equal(q_out, eager(q, cache, positions, 48, False))
    assert torch.equal(k_out, eager(k, cache, positions, 48, False))


@pytest.mark.parametrize("il", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_eager_autograd(device, il, dtype):
    """The backward (the inverse rotation, rounded alike) equals autograd through the eager
    expression bit for bit: g * cos and g * sin rounded, then their sum."""
    memo.clear()
    q, k, positions, cache = _inputs((2, 13), 4, 2, 64, 64, dtype, device, grad=True)
    got_q, got_k = ropekit.apply_rope(q, k, positions, cache, interleaved=il, eager_rounding=True)
    gq, gk = torch.randn_like(got_q), torch.randn_like(got_k)
    torch.autograd.backward((got_q, got_k), (gq, gk))
    q2, k2 = (x.detach().clone().requires_grad_() for x in (q, k))
    torch.autograd.backward((eager(q2, cache, positions, 64, il), eager(k2, cache, positions, 64, il)), (gq, gk))
    assert torch.equal(q.grad, q2.grad) and torch.equal(k.grad, k2.grad)


@pytest.mark.parametrize(
    "kw",
    [
        {"inverse": True},
        {"rotary_position": "halves"},
        {"layout": "bhsd"},
        {"out_dtype": torch.float32},
    ],
    ids=["inverse", "halves", "bhsd", "out_float32"],
)
def test_composes_bit_for_bit(device, kw):
    """With the flags that only move or widen values, the float64 oracle with the same roundings,
    bit for bit (the oracle's halves / inverse code paths are checked against HF's above)."""
    memo.clear()
    q, k, positions, cache = _inputs((12,), 4, 2, 64, 32, torch.bfloat16, device)
    if kw.get("layout") == "bhsd":
        q, k = (x.reshape(1, 12, -1, 64).transpose(1, 2) for x in (q, k))
        positions = positions[None]
    got_q, got_k = ropekit.apply_rope(q, k, positions, cache, eager_rounding=True, **kw)
    ref_kw = {n: v for n, v in kw.items() if n in ("inverse", "rotary_position")}
    if kw.get("layout") == "bhsd":
        q, k, got_q, got_k = (x.transpose(1, 2) for x in (q, k, got_q, got_k))
    want_q, want_k = reference.apply_rope(q.cpu(), k.cpu(), positions.cpu(), cache.cpu(), eager_rounding=True, **ref_kw)
    dt = kw.get("out_dtype", torch.bfloat16)
    assert got_q.dtype == dt
    assert torch.equal(got_q.cpu(), want_q.to(dt)) and torch.equal(got_k.cpu(), want_k.to(dt))


def test_composes_with_a_per_head_table_and_temperature(device):
    """A per-head table (FoPE) bit for bit; q_temperature scales the rounded rotation (its own
    rounding into the output, within bf16's tolerance of the oracle)."""
    memo.clear()
    q, k, positions, _ = _inputs((10,), 4, 2, 64, 64, torch.bfloat16, device)
    table = torch.rand(4096, 2, 64, device=device) * 2 - 1
    got_q, got_k = ropekit.apply_rope(q, k, positions, table, eager_rounding=True)
    want_q, want_k = reference.apply_rope(q.cpu(), k.cpu(), positions.cpu(), table.cpu(), eager_rounding=True)
    assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_k.cpu(), want_k)
    cache = make_cache(4096, 64, device=device)
    got_q, _ = ropekit.apply_rope(q, k, positions, cache, q_temperature=(8.0, 0.1), eager_rounding=True)
    want_q, _ = reference.apply_rope(
        q.cpu(), k.cpu(), positions.cpu(), cache.cpu(), q_temperature=(8.0, 0.1), eager_rounding=True
    )
    assert rel_err(got_q, want_q) < TOL[torch.bfloat16]


def test_both_cpu_paths_and_compile(path):
    """The interpreted kernel and the PyTorch path agree bit for bit; torch.compile (dynamic=True)
    through the custom op, two token counts, forward and backward."""
    cache = make_cache(4096, 64)

    def f(q, k, positions):
        return ropekit.apply_rope(q, k, positions, cache, eager_rounding=True)

    compiled = torch.compile(f, dynamic=True, backend="eager", fullgraph=True)
    for n in (5, 9):
        q, k, positions, _ = _inputs((n,), 2, 1, 64, 64, torch.bfloat16, "cpu", grad=True)
        got_q, got_k = compiled(q, k, positions)
        assert torch.equal(got_q, eager(q, cache, positions, 64, False))
        assert torch.equal(got_k, eager(k, cache, positions, 64, False))
        g = torch.randn_like(got_q)
        got_q.backward(g)
        q2 = q.detach().clone().requires_grad_()
        eager(q2, cache, positions, 64, False).backward(g)
        assert torch.equal(q.grad, q2.grad)
