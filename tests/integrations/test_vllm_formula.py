"""ropekit.apply_rope in place, as the vLLM plugin calls it, against vLLM's rotary formula on CUDA.

vLLM is not installed on the GPU machine, so its formula (RotaryEmbedding.forward_static with
ApplyRotaryEmb.forward_static: neox halves or GPT-J pairs, partial rotary keeping the tail) is
written here, evaluated in float64. The plugin's call: query (T, Hq * D) and key (T, Hk * D) viewed
as (T, H, D), vLLM's [cos | sin] table, `inplace=True`.
"""

import pytest
import torch

import ropekit

from conftest import TOL, make_cache, rel_err


def vllm_formula(positions, query, key, head_size, rotary_dim, cache, is_neox_style):
    """vLLM 0.32's RotaryEmbedding.forward_static, in float64."""
    cos, sin = cache.double()[positions].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)

    def rotate(x):
        x = x.double().view(positions.shape[0], -1, head_size)
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        if is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.cat((o1, o2), -1) if is_neox_style else torch.stack((o1, o2), -1).flatten(-2)
        return torch.cat((out, rest), -1).flatten(-2)

    return rotate(query), rotate(key)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [128, 64], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plugin_call_matches_vllm_formula(is_neox_style, rotary_dim, dtype):
    T, HQ, HK, D, MAXP = 37, 8, 2, 128, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = make_cache(MAXP, rotary_dim, device="cuda")
    positions = torch.randint(0, MAXP, (T,), device="cuda", generator=g)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, device="cuda", generator=g).to(dtype)
    query, key = qkv[:, : HQ * D], qkv[:, HQ * D : (HQ + HK) * D]  # views of a fused qkv, as vLLM splits it
    q_ref, k_ref = vllm_formula(positions, query, key, D, rotary_dim, cache, is_neox_style)
    value_before = qkv[:, (HQ + HK) * D :].clone()

    q_out, k_out = ropekit.apply_rope(
        query.view(T, -1, D),
        key.view(T, -1, D),
        positions,
        cache,
        interleaved=not is_neox_style,
        rotary_dim=rotary_dim,
        inplace=True,
    )
    torch.cuda.synchronize()
    assert q_out.data_ptr() == query.data_ptr() and k_out.data_ptr() == key.data_ptr()
    assert rel_err(query, q_ref) < TOL[dtype] and rel_err(key, k_ref) < TOL[dtype]
    assert torch.equal(qkv[:, (HQ + HK) * D :], value_before), "the value columns untouched"
