"""torch.compile: ropekit's ops inside compiled attention blocks, fullgraph, forward and backward.

`fullgraph=True` turns any graph break into an error; the dynamo counters are checked as well.
Results (outputs and every gradient) are compared with the same block run eagerly in float64 on
the reference path. On CPU the custom ops run the Triton interpreter (or the reference) inside
the compiled graph; Inductor compiles the rest with the C++ compiler.
"""

import pytest
import torch
import torch.nn.functional as F

import ropekit
from ropekit import hf
from ropekit.tools import reference

from conftest import make_cache

pytest.importorskip("torch._dynamo")

B, S, HQ, HK, D, HID = 2, 4, 4, 2, 16, 32


class Block(torch.nn.Module):
    """q/k/v projections, rotary, causal SDPA (GQA), output projection."""

    def __init__(self, rope, hf_style=False):
        super().__init__()
        self.q = torch.nn.Linear(HID, HQ * D, bias=False)
        self.kv = torch.nn.Linear(HID, 2 * HK * D, bias=False)  # fused k|v: k is a strided view
        self.o = torch.nn.Linear(HQ * D, HID, bias=False)
        self.rope = rope
        self.hf_style = hf_style

    def forward(self, x, positions, cache_or_cos, sin=None):
        q = self.q(x).view(B, S, HQ, D)
        kv = self.kv(x).view(B, S, 2 * HK, D)
        k, v = kv[:, :, :HK], kv[:, :, HK:]
        if self.hf_style:  # HF layout (B, H, S, D) in and out
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cache_or_cos, sin)
        else:
            q, k = self.rope(q, k, positions, cache_or_cos)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.transpose(1, 2)
        k = k.repeat_interleave(HQ // HK, dim=1)
        v = v.repeat_interleave(HQ // HK, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(B, S, HQ * D))


def _hf_reference(q, k, cos, sin):
    """HF Llama semantics in any dtype: rotate_half formula on (B, H, S, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _inputs(gen):
    x = torch.randn(B, S, HID, generator=gen)
    positions = torch.randint(0, 32, (B, S), generator=gen)
    cache = make_cache(32, D)
    ang = torch.rand(B, S, D // 2, generator=gen, dtype=torch.float64) * 20
    emb = torch.cat((ang, ang), dim=-1)
    return x, positions, cache, emb.cos().float(), emb.sin().float()


def _run(block, x, args, up):
    block.zero_grad(set_to_none=True)
    x, up = x.to(block.o.weight.device), up.to(block.o.weight.device)
    xg = x.detach().clone().requires_grad_()
    out = block(xg, *args)
    (out * up.to(out.dtype)).sum().backward()
    return out.detach(), [xg.grad] + [p.grad for p in block.parameters()]


def _compiled_matches_float64(hf_style, backend, device):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = torch.Generator().manual_seed(21 + hf_style)
    torch.manual_seed(21)
    x, positions, cache, cos, sin = _inputs(gen)
    up = torch.randn(B, S, HID, generator=gen)
    if hf_style:
        block = Block(hf.apply_rotary_pos_emb, hf_style=True)
        ref_block = Block(_hf_reference, hf_style=True)
        args, ref_args = (None, cos, sin), (None, cos.double(), sin.double())
    else:
        block = Block(ropekit.apply_rope)
        ref_block = Block(reference.apply_rope)
        args, ref_args = (positions, cache), (positions, cache.double())
    ref_block.load_state_dict(block.state_dict())
    ref_block.double()
    block.to(device)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)

    compiled = torch.compile(block, fullgraph=True, backend=backend, dynamic=False)
    out, grads = _run(compiled, x, args, up)
    ref_out, ref_grads = _run(ref_block, x.double(), ref_args, up)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=1e-5, atol=1e-6)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        torch.testing.assert_close(g.double().cpu(), r, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {i}: {m}")

    # a second call with fresh values reuses the graph (no recompile) and is still right
    x2 = torch.randn(B, S, HID, generator=gen)
    out2, _ = _run(compiled, x2, args, up)
    ref2, _ = _run(ref_block, x2.double(), ref_args, up)
    torch.testing.assert_close(out2.double().cpu(), ref2, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_compile_attention_block_inductor(device):
    """apply_rope (positions + [cos | sin] table) in an attention block, Inductor, fwd + bwd."""
    _compiled_matches_float64(hf_style=False, backend="inductor", device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_hf_dropin_attention_block(device):
    """hf.apply_rotary_pos_emb on HF's (B, H, S, D) views with (B, S, D) cos/sin."""
    _compiled_matches_float64(hf_style=True, backend="aot_eager" if device == "cpu" else "inductor", device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_k", [False, True])
def test_compile_inplace_op_mutates_and_matches(with_k, device):
    """inplace=True inside a compiled function (no grad), q and k views of one fused buffer: the
    mutation is visible to the caller and matches the reference."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(23)
    cache = make_cache(32, D, device=device)
    positions = torch.randint(0, 32, (B, S), generator=gen).to(device)
    buf = torch.randn(B, S, (HQ + 2 * HK) * D, generator=gen).to(device)

    def views(b):
        q = b[..., : HQ * D].unflatten(-1, (HQ, D))
        k = b[..., HQ * D : (HQ + HK) * D].unflatten(-1, (HK, D)) if with_k else None
        return q, k

    def step(buf, positions):
        ropekit.apply_rope(*views(buf), positions, cache, inplace=True)
        return buf.sum()

    ref = buf.double().clone()
    rq, rk = reference.apply_rope(*views(ref), positions, cache.double())
    ref[..., : HQ * D] = rq.flatten(-2)
    if with_k:
        ref[..., HQ * D : (HQ + HK) * D] = rk.flatten(-2)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        total = compiled(buf, positions)
    torch.testing.assert_close(buf.double(), ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(total.double(), ref.sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_compile_strided_last_dim(inplace, device):
    """q and k of last stride 2 through the custom ops, fullgraph, forward and backward: read where
    they lie, out of place the op's outputs contiguous (as its fake says), in place the views
    written; the input gradients match the float64 reference."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(29)
    cache = make_cache(32, D, device=device)
    positions = torch.randint(0, 32, (B, S), generator=gen).to(device)
    bq = torch.randn(B, S, HQ, 2 * D, generator=gen).to(device)
    bk = torch.randn(B, S, HK, 2 * D, generator=gen).to(device)
    q, k = bq[..., ::2], bk[..., ::2]
    want_q, want_k = reference.apply_rope(q.double(), k.double(), positions, cache.double())

    def step(q, k):
        return ropekit.apply_rope(q, k, positions, cache, inplace=inplace)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got_q, got_k = compiled(q, k)
    assert got_q.is_contiguous() != inplace and got_k.is_contiguous() != inplace
    for got, want, view in ((got_q, want_q, q), (got_k, want_k, k)):
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
        if inplace:
            torch.testing.assert_close(view.double(), want, rtol=2e-6, atol=2e-6)
    if inplace:
        return
    leaf = bq.clone().requires_grad_(True)
    out, _ = compiled(leaf[..., ::2], None)
    g = torch.randn(out.shape, generator=gen).to(device)
    out.backward(g)
    c, s = reference.angles_from_table(cache.double(), positions, (B, S))
    torch.testing.assert_close(
        leaf.grad[..., ::2].double(), reference.rotate(g.double(), c, s, inverse=True), rtol=2e-6, atol=2e-6
    )
    assert not leaf.grad[..., 1::2].any()
