"""eager_rounding=True against transformers' own eager rotation, bit for bit.

HF's rotary module (LlamaRotaryEmbedding) makes cos / sin in the model's dtype and HF's
apply_rotary_pos_emb computes q * cos + rotate_half(q) * sin op by op in that dtype. ropekit's
rotate_with_angles(eager_rounding=True) on the same cos / sin, and apply_rope(eager_rounding=True)
on a float32 [cos | sin] table of the same angles, must give exactly HF's tensors, forward and
backward (autograd through HF's function), on fresh random inputs with NaN-poisoned outputs; the
default rounding must not (so the test can fail).
"""

import pytest
import torch

import ropekit
from ropekit.core import memo

from conftest import DEVICES

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("poison", "hf_unpatched")

B, S, HQ, HK, D, P = 2, 24, 4, 2, 64, 4096


def _hf_inputs(dtype, device, grad=False, seed=0):
    """HF's cos / sin for random positions (its rotary module, in the model's dtype), the float32
    angles they came from as a [cos | sin] table, and q, k as HF holds them: (B, H, S, D)
    transposed views of (B, S, H, D) projections."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HK, head_dim=D, max_position_embeddings=P
    )
    rotary = llama.LlamaRotaryEmbedding(config).to(device)
    positions = torch.randint(0, P, (B, S), device=device)
    x = torch.zeros(B, S, HQ * D, dtype=dtype, device=device)
    cos, sin = rotary(x, positions)  # (B, S, D), [f, f] halves, dtype
    with torch.no_grad():
        f = torch.arange(P, device=device, dtype=torch.float32)[:, None] * rotary.inv_freq.float()[None]
        table = torch.cat((f.cos(), f.sin()), dim=-1) * rotary.attention_scaling  # HF's float32 values
    q = torch.randn(B, S, HQ, D, device=device).mul(3).to(dtype).transpose(1, 2).requires_grad_(grad)
    k = torch.randn(B, S, HK, D, device=device).mul(3).to(dtype).transpose(1, 2).requires_grad_(grad)
    return q, k, cos, sin, positions, table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_equals_hf_eager(device, dtype):
    memo.clear()
    q, k, cos, sin, positions, table = _hf_inputs(dtype, device)
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = ropekit.rotate_with_angles(q, k, cos, sin, layout="bhsd", rotary_dim=D, eager_rounding=True)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # the same angles as a float32 table picked by positions: cos / sin rounded in the kernel
    got_q, got_k = ropekit.apply_rope(q, k, positions, table, layout="bhsd", eager_rounding=True)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    if dtype != torch.float32:  # the default rounds once: not HF's bits
        plain_q, _ = ropekit.rotate_with_angles(q, k, cos, sin, layout="bhsd", rotary_dim=D)
        assert not torch.equal(plain_q, want_q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_equals_hf_autograd(device, dtype):
    memo.clear()
    q, k, cos, sin, _, _ = _hf_inputs(dtype, device, grad=True, seed=1)
    want = llama.apply_rotary_pos_emb(q, k, cos, sin)
    grads = [torch.randn_like(x) for x in want]
    want_grads = torch.autograd.grad(want, (q, k), grads)
    got = ropekit.rotate_with_angles(q, k, cos, sin, layout="bhsd", rotary_dim=D, eager_rounding=True)
    got_grads = torch.autograd.grad(got, (q, k), grads)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)


def test_refused_with_a_fused_norm():
    q, k, cos, sin, _, _ = _hf_inputs(torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="rotate_with_angles: eager_rounding: expected False with l2_norm=True"):
        ropekit.rotate_with_angles(q, k, cos, sin, layout="bhsd", rotary_dim=D, l2_norm=True, eager_rounding=True)
    with pytest.raises(TypeError, match="rotate_with_angles: eager_rounding: expected a bool, got str"):
        ropekit.rotate_with_angles(q, k, cos, sin, layout="bhsd", rotary_dim=D, eager_rounding="yes")
