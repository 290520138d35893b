"""ropekit.RotaryEmbedding: vLLM / SGLang calling convention over apply_rope.

Outputs are compared with ropekit.tools.reference.apply_rope run in float64 on a table built in float64
by ropekit.cos_sin_cache (independent of the module's buffer). Sizes are small so the Triton
kernels stay quick under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import pytest
import torch

import ropekit
from ropekit import strict
from ropekit.api.modules import RotaryEmbedding
from ropekit.core.freqs import cos_sin_cache
from ropekit.integrations.hf_config import hf_rope_args
from ropekit.tools import reference


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (x + 0.25 * x.sign()).to(dtype)  # no zeros: a dropped rotation cannot look right


def _oracle(rope, positions, q, k, table=None):
    """Expected (q, k) in float64, heads unflattened, from a float64 table."""
    if table is None:
        table = cos_sin_cache(rope.rotary_dim, rope.max_position, rope.base, rope.rope_scaling, dtype=torch.float64)
    n_tok = positions.dim()
    D = rope.head_size

    def heads(x):
        return None if x is None else (x.reshape(*x.shape[:n_tok], -1, D) if x.dim() == n_tok + 1 else x).double()

    return reference.apply_rope(heads(q), heads(k), positions, table, interleaved=not rope.is_neox_style)


def _close(got, want, dtype):
    got = got.reshape(want.shape).double()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one rounding to bf16/fp16 plus float32 math
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# forward against the float64 oracle


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "headed"])
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out_of_place"])
def test_forward_matches_reference(neox, rotary_dim, flat, inplace):
    T, Hq, Hk, D, L = 7, 4, 2, 32, 64
    rope = RotaryEmbedding(D, rotary_dim, L, 10000.0, neox, inplace=inplace)
    positions = torch.tensor([0, 5, 63, 17, 1, 40, 2])
    q = _rand(T, Hq * D, seed=1) if flat else _rand(T, Hq, D, seed=1)
    k = _rand(T, Hk * D, seed=2) if flat else _rand(T, Hk, D, seed=2)
    q0, k0 = q.clone(), k.clone()
    want_q, want_k = _oracle(rope, positions, q0, k0)

    q_out, k_out = rope(positions, q, k)
    assert q_out.shape == q0.shape and k_out.shape == k0.shape
    if inplace:
        assert q_out is q and k_out is k
    else:
        assert torch.equal(q, q0) and torch.equal(k, k0)  # inputs untouched
    _close(q_out, want_q, torch.float32)
    _close(k_out, want_k, torch.float32)
    # the tail beyond rotary_dim is passed through bit for bit
    D_tail = q_out.reshape(T, Hq, D)[..., rotary_dim:]
    assert torch.equal(D_tail, q0.reshape(T, Hq, D)[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_keep_float32_table(dtype):
    rope = RotaryEmbedding(16, 16, 32, 500.0)
    positions = torch.arange(5) * 6
    q, k = _rand(5, 3 * 16, dtype=dtype, seed=3), _rand(5, 16, dtype=dtype, seed=4)
    want_q, want_k = _oracle(rope, positions, q, k)
    q_out, k_out = rope(positions, q, k)
    assert q_out.dtype == dtype and rope.cos_sin_cache.dtype == torch.float32
    _close(q_out, want_q, dtype)
    _close(k_out, want_k, dtype)


def test_key_none_and_batched_positions():
    rope = RotaryEmbedding(8, 8, 16, 100.0, inplace=False)
    positions = torch.tensor([[0, 1, 2], [7, 3, 15]])  # (B, S)
    q = _rand(2, 3, 2 * 8, seed=5)
    want_q, _ = _oracle(rope, positions, q, None)
    q_out, k_out = rope(positions, q)
    assert k_out is None
    _close(q_out, want_q, torch.float32)


def test_fused_qkv_views_in_place():
    """q and k as column slices of one qkv buffer: rotated through the views, v untouched."""
    T, Hq, Hk, D = 6, 4, 2, 16
    rope = RotaryEmbedding(D, D, 32, 10000.0)
    qkv = _rand(T, (Hq + 2 * Hk) * D, seed=6)
    before = qkv.clone()
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    positions = torch.tensor([3, 1, 4, 1, 5, 9])
    want_q, want_k = _oracle(rope, positions, q.clone(), k.clone())
    q_out, k_out = rope(positions, q, k)
    assert q_out is q and k_out is k
    _close(qkv[:, : Hq * D], want_q, torch.float32)
    _close(qkv[:, Hq * D : (Hq + Hk) * D], want_k, torch.float32)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], before[:, (Hq + Hk) * D :])


def test_mla_slices_with_different_widths():
    """DeepSeek-style: q_pe a 64-wide slice of 192-wide heads, k_pe its own (T, 1, 64) tensor."""
    T, H = 5, 3
    rope = RotaryEmbedding(
        64,
        64,
        128,
        10000.0,
        is_neox_style=False,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 32,
        },
    )
    q_full = _rand(T, H, 192, seed=7)
    q_pe = q_full[..., 128:]
    k_pe = _rand(T, 1, 64, seed=8)
    before = q_full.clone()
    positions = torch.tensor([0, 127, 64, 3, 31])
    want_q, want_k = _oracle(rope, positions, q_pe.clone(), k_pe.clone())
    rope(positions, q_pe, k_pe)
    _close(q_full[..., 128:], want_q, torch.float32)
    _close(k_pe, want_k, torch.float32)
    assert torch.equal(q_full[..., :128], before[..., :128])


def test_out_of_range_positions_are_nan_or_strict_error():
    rope = RotaryEmbedding(8, 4, 16, 100.0, inplace=False)
    positions = torch.tensor([0, 16, -1, 15])
    q = _rand(4, 2 * 8, seed=9)
    q_out, _ = rope(positions, q)
    q_out = q_out.reshape(4, 2, 8)
    assert torch.isnan(q_out[[1, 2], :, :4]).all()
    assert torch.equal(q_out[..., 4:], q.reshape(4, 2, 8)[..., 4:])  # tail kept
    assert not torch.isnan(q_out[[0, 3]]).any()
    with strict(), pytest.raises(ValueError, match="positions"):
        rope(positions, q.clone())


# ---------------------------------------------------------------------------------------------
# LongRoPE: short rows while every position is below the original length, long rows otherwise


def _small_longrope():
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 4.0],
        "long_factor": [1.0, 3.0, 9.0, 27.0],
        "original_max_position_embeddings": 16,
    }
    return RotaryEmbedding(8, 8, 64, 10000.0, rope_scaling=scaling, inplace=False), scaling


def test_longrope_picks_short_or_long_per_call():
    rope, scaling = _small_longrope()
    assert rope.cos_sin_cache.shape == (16 + 64, 8)
    short = cos_sin_cache(8, 16, 10000.0, dict(scaling, factor=4.0), dtype=torch.float64)
    long = cos_sin_cache(8, 64, 10000.0, dict(scaling, factor=4.0), dtype=torch.float64)
    assert not torch.allclose(short, long[:16])
    q = _rand(4, 2 * 8, seed=10)
    for positions, table in (
        (torch.tensor([0, 3, 15, 7]), short),
        (torch.tensor([0, 3, 16, 7]), long),
        (torch.tensor([63, 1, 2, 3]), long),
    ):
        want_q, _ = _oracle(rope, positions, q, None, table=table)
        got, _ = rope(positions, q)
        _close(got, want_q, torch.float32)
    # out of range either way: NaN, never a row of the other segment
    got, _ = rope(torch.tensor([-1, 20, 64, 2]), q)
    got = got.reshape(4, 2, 8)
    assert torch.isnan(got[[0, 2]]).all() and not torch.isnan(got[[1, 3]]).any()
    # a table no longer than the original length holds the short rows only
    only_short = RotaryEmbedding(8, 8, 16, 10000.0, rope_scaling=scaling)
    assert only_short.cos_sin_cache.shape == (16, 8)


# ---------------------------------------------------------------------------------------------
# device, dtype, lifecycle


def test_buffer_lifecycle():
    rope = RotaryEmbedding(16, 8, 32, 1000.0, dtype=None)
    ref = cos_sin_cache(8, 32, 1000.0)
    assert torch.equal(rope.cos_sin_cache, ref)
    assert "cos_sin_cache" not in rope.state_dict()  # persistent=False
    rope.half()  # the table keeps its dtype
    assert rope.cos_sin_cache.dtype == torch.float32 and torch.equal(rope.cos_sin_cache, ref)
    rope.to_empty(device="cpu")  # rebuilt, not garbage
    assert torch.equal(rope.cos_sin_cache, ref)
    bf = RotaryEmbedding(16, 8, 32, 1000.0, dtype=torch.bfloat16)
    assert torch.equal(bf.cos_sin_cache, cos_sin_cache(8, 32, 1000.0).bfloat16())


def test_meta_construction_builds_lazily_on_query_device():
    with torch.device("meta"):
        rope = RotaryEmbedding(8, 8, 16, 100.0, inplace=False)
    assert rope.cos_sin_cache.is_meta
    positions, q = torch.tensor([1, 9]), _rand(2, 8, seed=11)
    want, _ = _oracle(rope, positions, q, None)
    got, _ = rope(positions, q)
    assert rope.cos_sin_cache.device.type == "cpu"
    _close(got, want, torch.float32)


def test_extra_repr():
    text = repr(RotaryEmbedding(128, 64, 4096, 500000.0, False, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    for part in (
        "head_size=128",
        "rotary_dim=64",
        "max_position=4096",
        "base=500000.0",
        "is_neox_style=False",
        "rope_type='linear'",
        "inplace=True",
        "cache_dtype=float32",
    ):
        assert part in text, text
    assert "long_from=16" in repr(_small_longrope()[0])


# ---------------------------------------------------------------------------------------------
# torch.compile: fullgraph, no graph break, same answers, in-place semantics kept


@pytest.mark.parametrize("with_key", [False, True], ids=["q", "qk"])
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out_of_place"])
def test_torch_compile_fullgraph(inplace, with_key):
    torch._dynamo.reset()
    rope = RotaryEmbedding(16, 8, 64, 10000.0, is_neox_style=False, inplace=inplace)
    compiled = torch.compile(rope, fullgraph=True)
    positions = torch.tensor([0, 9, 33, 63, 4])
    q0, k0 = _rand(5, 2 * 16, seed=12), _rand(5, 16, seed=13)
    want_q, want_k = _oracle(rope, positions, q0, k0 if with_key else None)
    q, k = q0.clone(), (k0.clone() if with_key else None)
    q_out, k_out = compiled(positions, q, k)
    _close(q_out, want_q, torch.float32)
    if with_key:
        _close(k_out, want_k, torch.float32)
    else:
        assert k_out is None
    if inplace:
        _close(q, want_q, torch.float32)  # mutation reached the caller
    else:
        assert torch.equal(q, q0)


def test_torch_compile_longrope():
    torch._dynamo.reset()
    rope, scaling = _small_longrope()
    compiled = torch.compile(rope, fullgraph=True, backend="aot_eager")
    q = _rand(3, 8, seed=14)
    for positions, length in ((torch.tensor([1, 2, 3]), 16), (torch.tensor([1, 40, 3]), 64)):
        table = cos_sin_cache(8, length, 10000.0, dict(scaling, factor=4.0), dtype=torch.float64)
        want, _ = _oracle(rope, positions, q, None, table=table)
        got, _ = compiled(positions, q)
        _close(got, want, torch.float32)


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        ((128, 127, 4096), {}, r"rotary_dim: expected an even integer in \[2, head_size = 128\], got 127"),
        ((128, 130, 4096), {}, r"rotary_dim: .*got 130"),
        ((128, 0, 4096), {}, r"rotary_dim: .*got 0"),
        ((0, 0, 4096), {}, r"head_size: expected a positive integer, got 0"),
        ((64, 64, 0), {}, r"max_position: expected a positive integer, got 0"),
        ((64, 64, 128), {"rope_scaling": {"rope_type": "xpos"}}, r"scaling\['rope_type'\].*got 'xpos'"),
        ((64, 64, 128), {"rope_scaling": {"rope_type": "linear", "factor": -1}}, r"scaling\['factor'\].*got -1"),
        (
            (64, 64, 128),
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
            r"scaling\['original_max_position_embeddings'\]",
        ),
    ],
)
def test_constructor_rejects_bad_arguments(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        RotaryEmbedding(*args, **kwargs)


def test_forward_rejects_bad_shapes():
    rope = RotaryEmbedding(16, 16, 32, 100.0)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match=r"query: expected a last dimension that is a multiple of head_size = 16"):
        rope(pos, _rand(3, 40))
    with pytest.raises(ValueError, match=r"key: expected a last dimension of head_size = 16, got shape \(3, 2, 8\)"):
        rope(pos, _rand(3, 32), _rand(3, 2, 8))
    with pytest.raises(ValueError, match=r"query: expected \(\*T, H \* 16\) or \(\*T, H, 16\)"):
        rope(pos, _rand(3, 2, 2, 16))
    with pytest.raises(ValueError, match=r"positions: expected a \(T,\) or \(B, S\) tensor"):
        rope(torch.zeros(3, 1, 1, dtype=torch.long), _rand(3, 16))


# ---------------------------------------------------------------------------------------------
# from_hf_config: config.json dicts (and HF config objects when transformers is installed)

_PHI3_SHORT = [1.0 + 0.05 * i for i in range(48)]
_PHI3_LONG = [1.0 + 1.3 * i for i in range(48)]

HF_CONFIGS = {
    "llama3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    ),
    "qwen2.5-7b-yarn": dict(
        model_type="qwen2",
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    ),
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        hidden_size=7168,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=163840,
        rope_theta=10000,
        rope_scaling={
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    ),
    "phi3-128k": dict(
        model_type="phi3",
        hidden_size=3072,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling={"long_factor": _PHI3_LONG, "short_factor": _PHI3_SHORT, "type": "longrope"},
    ),
    "llama2-dynamic": dict(
        model_type="llama",
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling={"factor": 2.0, "type": "dynamic"},
    ),
    "gpt-neox-20b": dict(
        model_type="gpt_neox",
        hidden_size=6144,
        num_attention_heads=64,
        max_position_embeddings=2048,
        rotary_pct=0.25,
        rotary_emb_base=10000,
    ),
    "gpt-j-6b": dict(model_type="gptj", n_embd=4096, n_head=16, n_positions=2048, rotary_dim=64),
}

# expected: head_size, rotary_dim, max_position (table), base, is_neox_style, scaling passed on
EXPECTED = {
    "llama3.1-8b": (128, 128, 131072, 500000.0, True, dict(HF_CONFIGS["llama3.1-8b"]["rope_scaling"])),
    "qwen2.5-7b-yarn": (
        128,
        128,
        131072,
        1000000.0,
        True,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    "deepseek-v3": (
        64,
        64,
        163840,
        10000,
        False,
        {
            "rope_type": "yarn",
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
    ),
    "phi3-128k": (
        96,
        96,
        131072,
        10000.0,
        True,
        {
            "rope_type": "longrope",
            "long_factor": _PHI3_LONG,
            "short_factor": _PHI3_SHORT,
            "original_max_position_embeddings": 4096,
            "factor": 32.0,
        },
    ),
    "llama2-dynamic": (
        128,
        128,
        8192,
        10000.0,
        True,
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4096},
    ),
    "gpt-neox-20b": (96, 24, 2048, 10000, True, {"rope_type": "default"}),
    "gpt-j-6b": (256, 64, 2048, 10000.0, False, {"rope_type": "default"}),
}

_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "deepseek_v3": "DeepseekV3Config",
    "phi3": "Phi3Config",
    "gpt_neox": "GPTNeoXConfig",
    "gptj": "GPTJConfig",
}


def _hf_object(raw):
    transformers = pytest.importorskip("transformers")
    kwargs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items() if k != "model_type"}
    return getattr(transformers, _CONFIG_CLASSES[raw["model_type"]])(**kwargs)


def _scaling_subset(got: dict, want: dict):
    """The keys ropekit uses must match; HF 5.x adds harmless ones (partial_rotary_factor, ...)."""
    for key, value in want.items():
        assert key in got, (key, got)
        if isinstance(value, float) or isinstance(got[key], float):
            assert math.isclose(got[key], value, rel_tol=1e-15), (key, got[key], value)
        else:
            assert got[key] == value, (key, got[key], value)


@pytest.mark.parametrize("form", ["dict", "hf_object"])
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_from_hf_config_reads_families(name, form):
    raw = HF_CONFIGS[name]
    config = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()} if form == "dict" else _hf_object(raw)
    head, rot, length, base, neox, scaling = EXPECTED[name]
    args = hf_rope_args(config)
    assert (args["head_size"], args["rotary_dim"], args["max_position"]) == (head, rot, length)
    assert float(args["base"]) == float(base) and args["is_neox_style"] is neox
    _scaling_subset(args["rope_scaling"], scaling)


@pytest.mark.parametrize("name", ["llama3.1-8b", "deepseek-v3", "phi3-128k", "gpt-neox-20b"])
def test_from_hf_config_builds_the_table(name):
    head, rot, length, base, neox, scaling = EXPECTED[name]
    rope = RotaryEmbedding.from_hf_config(dict(HF_CONFIGS[name]))
    assert (rope.head_size, rope.rotary_dim, rope.max_position, rope.is_neox_style) == (head, rot, length, neox)
    if name == "phi3-128k":
        want = torch.cat((cos_sin_cache(rot, 4096, base, scaling), cos_sin_cache(rot, length, base, scaling)))
    else:
        want = cos_sin_cache(rot, length, base, scaling)
    assert torch.equal(rope.cos_sin_cache, want)


def test_from_hf_config_overrides_and_nested_parameters():
    rope = RotaryEmbedding.from_hf_config(
        dict(HF_CONFIGS["gpt-neox-20b"]), max_position=64, is_neox_style=False, inplace=False, dtype=torch.float64
    )
    assert rope.max_position == 64 and not rope.is_neox_style and not rope.inplace
    assert rope.cos_sin_cache.dtype == torch.float64
    gemma_like = dict(
        model_type="gemma3_text",
        hidden_size=640,
        num_attention_heads=4,
        head_dim=256,
        max_position_embeddings=32768,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    with pytest.raises(ValueError, match=r"layer_type: expected one of \['full_attention', 'sliding_attention'\]"):
        hf_rope_args(gemma_like)
    args = hf_rope_args(gemma_like, layer_type="full_attention")
    assert args["base"] == 1e6 and args["max_position"] == 32768 * 8 and args["rope_scaling"]["factor"] == 8.0
    assert hf_rope_args(gemma_like, layer_type="sliding_attention")["base"] == 1e4


def test_llama31_module_matches_hf_attention_rotation():
    """End to end against HF's LlamaRotaryEmbedding + apply_rotary_pos_emb (positions near 0,
    where HF's float32 angles are accurate)."""
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as ml

    config = _hf_object(HF_CONFIGS["llama3.1-8b"])
    rope = RotaryEmbedding.from_hf_config(config, max_position=256, inplace=False)
    T, Hq, Hk, D = 6, 4, 2, 128
    positions = torch.tensor([0, 1, 2, 30, 100, 255])
    q, k = _rand(T, Hq, D, seed=20), _rand(T, Hk, D, seed=21)
    cos, sin = ml.LlamaRotaryEmbedding(config=config)(q, positions[None])
    hq, hk = ml.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = rope(positions, q, k)
    # HF's float32 angle p * f is off by up to ~p * 2^-24 rad (1.5e-5 at p = 255)
    torch.testing.assert_close(got_q, hq[0].transpose(0, 1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_k, hk[0].transpose(0, 1), rtol=1e-5, atol=1e-4)


def test_deepseek_v3_module_matches_hf_interleaved_rotation():
    """DeepSeek-V3 rotates pairs; HF's apply_rotary_pos_emb_interleave writes the rotated pairs
    as halves (evens then odds), ropekit in place as pairs: same numbers, permuted."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as md

    config = _hf_object(HF_CONFIGS["deepseek-v3"])
    rope = RotaryEmbedding.from_hf_config(config, inplace=False)
    assert not rope.is_neox_style and rope.max_position == 163840
    T, H, D = 5, 3, 64
    positions = torch.tensor([0, 1, 7, 50, 200])
    q, k = _rand(T, H, D, seed=22), _rand(T, 1, D, seed=23)
    cos, sin = md.DeepseekV3RotaryEmbedding(config=config)(q, positions[None])
    hq, hk = md.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    hq, hk = hq[0].transpose(0, 1), hk[0].transpose(0, 1)
    got_q, got_k = rope(positions, q, k)
    for got, want in ((got_q, hq), (got_k, hk)):
        torch.testing.assert_close(got[..., 0::2], want[..., :32], rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(got[..., 1::2], want[..., 32:], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("interleaved_sections", [False, True], ids=["qwen2-vl", "qwen3-vl"])
@pytest.mark.parametrize("flat", [False, True], ids=["heads", "flat"])
def test_mrope_positions(interleaved_sections, flat, device):
    """M-RoPE: (3, T) and (3, B, S) positions, against the float64 reference; text-only positions
    (T,) still work and equal three identical rows."""
    from ropekit.tools import reference

    D, Hq, Hk, T = 64, 3, 1, 5
    section = [8, 12, 12] if not interleaved_sections else [12, 10, 10]
    rope = ropekit.RotaryEmbedding(
        D, D, 64, base=10000.0, mrope_section=section, mrope_interleaved=interleaved_sections, inplace=False
    ).to(device)
    q = torch.randn(T, Hq, D, device=device)
    k = torch.randn(T, Hk, D, device=device)
    pos = torch.randint(0, 64, (3, T), device=device)
    qa, ka = (q.flatten(-2), k.flatten(-2)) if flat else (q, k)
    qo, ko = rope(pos, qa, ka)
    rq, rk = reference.apply_rope(
        q.double(),
        k.double(),
        pos,
        rope.cos_sin_cache.double(),
        mrope_section=section,
        mrope_interleaved=interleaved_sections,
    )
    torch.testing.assert_close(qo.reshape(q.shape).double(), rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko.reshape(k.shape).double(), rk, rtol=1e-5, atol=1e-5)
    # (3, B, S)
    qb = q[:4].reshape(2, 2, Hq, D)
    qo2, _ = rope(pos[:, :4].reshape(3, 2, 2), qb.flatten(-2) if flat else qb, None)
    rq2, _ = reference.apply_rope(
        qb.double(),
        None,
        pos[:, :4].reshape(3, 2, 2),
        rope.cos_sin_cache.double(),
        mrope_section=section,
        mrope_interleaved=interleaved_sections,
    )
    torch.testing.assert_close(qo2.reshape(qb.shape).double(), rq2, rtol=1e-5, atol=1e-5)
    # text-only tokens: plain positions equal three identical rows
    p1 = pos[0]
    plain, _ = rope(p1, qa, None)
    same, _ = rope(p1.expand(3, T), qa, None)
    torch.testing.assert_close(plain, same, rtol=1e-6, atol=1e-6)


def test_mrope_from_scaling_dict_and_bad_sections():
    rope = ropekit.RotaryEmbedding(
        128, 128, 256, base=1e6, rope_scaling={"rope_type": "default", "mrope_section": [16, 24, 24]}
    )
    assert rope.mrope_section == (16, 24, 24) and not rope.mrope_interleaved
    with pytest.raises(ValueError, match="mrope_section"):
        ropekit.RotaryEmbedding(128, 128, 256, mrope_section=[16, 24, 20])


# ---------------------------------------------------------------------------------------------
# input defects: M-RoPE position layouts, bad sections, errors in the caller's words


def test_mrope_rows_with_as_many_tokens_as_heads_are_mrope():
    """(3, T) rows with a flat query whose token count equals anything else are still M-RoPE."""
    D, T = 16, 3
    rope = RotaryEmbedding(D, D, 64, 10000.0, mrope_section=[2, 3, 3], inplace=False)
    q = _rand(T, 3 * D)  # (T, H * D), H == T == 3
    pos = torch.tensor([[1, 5, 9], [2, 6, 10], [3, 7, 11]])
    got, _ = rope(pos, q)
    want, _ = reference.apply_rope(
        q.view(T, 3, D).double(), None, pos, rope.cos_sin_cache.double(), mrope_section=[2, 3, 3]
    )
    torch.testing.assert_close(got.view(T, 3, D).double(), want, rtol=1e-5, atol=1e-5)
    plain, _ = reference.apply_rope(q.view(T, 3, D).double(), None, pos[0], rope.cos_sin_cache.double())
    assert not torch.allclose(got.view(T, 3, D).double(), plain, atol=1e-3)  # the old silent reading


def test_mrope_batch_of_three_plain_positions_stays_plain():
    D = 16
    rope = RotaryEmbedding(D, D, 64, 10000.0, mrope_section=[2, 3, 3], inplace=False)
    q = _rand(3, 4, 2, D)  # (B=3, S=4, H, D): only a plain reading fits
    pos = torch.randint(0, 64, (3, 4))
    got, _ = rope(pos, q)
    want, _ = reference.apply_rope(q.double(), None, pos, rope.cos_sin_cache.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_mrope_ambiguous_positions_are_an_error():
    D = 16
    rope = RotaryEmbedding(D, D, 64, 10000.0, mrope_section=[2, 3, 3])
    q = _rand(3, 3, D)  # (T=3, H=3, D) or (B=3, S=3, 1 * D)
    before = q.clone()
    with pytest.raises(
        ValueError,
        match=r"RotaryEmbedding.forward: positions: expected a shape that tells "
        r"M-RoPE rows from a batch.*got shape \(3, 3\)",
    ):
        rope(torch.zeros(3, 3, dtype=torch.long), q)
    assert torch.equal(q, before)
    # either unambiguous spelling works
    rope(torch.zeros(3, 3, dtype=torch.long), q.reshape(3, 3 * D))
    rope(torch.zeros(3, 3, dtype=torch.long), q.reshape(3, 3, 1, D))


@pytest.mark.parametrize("section", [[-2, 10, 8], [20, -2, -2], [8, 8, 0.5]])
def test_mrope_section_rejects_negative_or_non_int_entries(section):
    with pytest.raises(ValueError, match=r"RotaryEmbedding: mrope_section: expected N >= 1 non-negative ints"):
        RotaryEmbedding(32, 32, 64, mrope_section=section)


def test_errors_through_the_module_name_the_callers_arguments():
    """The op's `apply_rope: q` / `k` / table rows come back as the module's query / key / max_position."""
    rope = RotaryEmbedding(16, 16, 32, 100.0)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match=r"^RotaryEmbedding.forward: query: expected dtype in .*got float64$"):
        rope(pos, _rand(3, 16, dtype=torch.float64))
    with pytest.raises(
        ValueError,
        match=r"^RotaryEmbedding.forward: key: expected the dtype of query \(float32\), "
        r"got float16$",
    ):
        rope(pos, _rand(3, 16), _rand(3, 16, dtype=torch.float16))
    with pytest.raises(
        ValueError,
        match=r"^RotaryEmbedding.forward: key: expected a tensor on cpu \(the device of "
        r"query\)",
    ):
        rope(pos, _rand(3, 16), torch.empty(3, 16, device="meta"))
    with (
        strict(),
        pytest.raises(
            ValueError,
            match=r"^RotaryEmbedding.forward: positions: expected values in "
            r"\[0, 32\) \(max_position = 32\), got positions\[1\] = 40$",
        ),
    ):
        rope(torch.tensor([0, 40, 1]), _rand(3, 16))


def test_store_errors_through_the_module_name_the_callers_arguments():
    rope = RotaryEmbedding(16, 16, 32, 100.0)
    q, k, v = _rand(3, 32), _rand(3, 16), _rand(3, 16)
    k_cache, v_cache = torch.zeros(8, 1, 16), torch.zeros(8, 1, 16)
    with pytest.raises(ValueError, match=r"^RotaryEmbedding.forward_and_store: value: expected dtype"):
        rope.forward_and_store(torch.arange(3), q, k, v.double(), k_cache, v_cache, torch.arange(3))


# --- vLLM's and SGLang's conventions, as their documented signatures give them --------------------
# vLLM / SGLang: RotaryEmbedding(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
# dtype); forward(positions, query, key, offsets=None) (SGLang, vLLM before 0.9), offsets added to
# positions.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_constructor_positional_dtype(dtype):
    rope = RotaryEmbedding(16, 16, 32, 10000.0, True, dtype)
    assert rope.cos_sin_cache.dtype == dtype and rope.cos_sin_cache.shape == (32, 16)
    by_keyword = RotaryEmbedding(
        head_size=16, rotary_dim=16, max_position_embeddings=32, base=10000.0, is_neox_style=True, dtype=dtype
    )
    assert torch.equal(by_keyword.cos_sin_cache, rope.cos_sin_cache) and by_keyword.max_position == 32


def test_rope_scaling_is_keyword_only():
    scaling = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(
        TypeError, match=r"RotaryEmbedding: dtype: expected a torch.dtype or None .*got dict .*rope_scaling="
    ) as info:
        RotaryEmbedding(16, 16, 32, 10000.0, True, scaling)
    assert "6th positional argument" in str(info.value)
    rope = RotaryEmbedding(16, 16, 32, 10000.0, True, rope_scaling=scaling)
    assert rope.rope_type == "linear"
    with pytest.raises(TypeError, match=r"RotaryEmbedding: device: expected a device, got torch.dtype"):
        RotaryEmbedding(16, 16, 32, 10000.0, True, None, torch.float32)
    with pytest.raises(ValueError, match=r"max_position_embeddings: expected None when max_position is given"):
        RotaryEmbedding(16, 16, 32, max_position_embeddings=32)
    with pytest.raises(TypeError, match=r"RotaryEmbedding: max_position: expected a positive integer"):
        RotaryEmbedding(16, 16)


@pytest.mark.parametrize("as_keyword", [False, True])
def test_forward_offsets_are_added_to_positions(as_keyword):
    rope = RotaryEmbedding(16, 16, 64, 10000.0, True, torch.float32, inplace=False)
    positions = torch.tensor([0, 1, 2, 5])
    offsets = torch.tensor([7, 7, 3, 0])
    q, k = _rand(4, 2 * 16), _rand(4, 16, seed=1)
    got = rope(positions, q, k, offsets=offsets) if as_keyword else rope(positions, q, k, offsets)
    want = rope(positions + offsets, q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[0], rope(positions, q, k)[0]), "offsets were ignored"
    # one offset for every token broadcasts
    one = rope(positions, q, k, torch.tensor(4))
    assert torch.equal(one[0], rope(positions + 4, q, k)[0])


def test_forward_offsets_are_checked():
    rope = RotaryEmbedding(16, 16, 64, 10000.0, inplace=False)
    positions, q = torch.arange(4), _rand(4, 16)
    with pytest.raises(
        ValueError, match=r"RotaryEmbedding.forward: offsets: expected dtype in \(int32, int64\), got float32"
    ):
        rope(positions, q, None, torch.zeros(4))
    with pytest.raises(
        ValueError, match=r"offsets: expected a shape broadcastable to positions' \(4,\), got shape \(3,\)"
    ):
        rope(positions, q, None, torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"RotaryEmbedding.forward: offsets: expected a torch.Tensor or None, got int"):
        rope(positions, q, None, 3)


def test_in_place_default_under_autograd_says_what_to_construct():
    """In place under autograd works on activations (autograd's in-place rules); where autograd
    refuses it (a leaf that requires grad, or q/k norm weights that require grad), the error says
    to construct the module with inplace=False."""
    rope = RotaryEmbedding(16, 16, 64, 10000.0)
    q = _rand(4, 16).requires_grad_()
    with pytest.raises(ValueError) as info:
        rope(torch.arange(4), q)
    message = str(info.value)
    assert message.startswith("RotaryEmbedding.forward: query: ") and "when inplace=True" in message, message
    assert "construct it with RotaryEmbedding(..., inplace=False)" in message
    w = torch.ones(16, requires_grad=True)
    with pytest.raises(ValueError) as info:
        rope(torch.arange(4), q * 1.0, q_norm_weight=w)
    assert "construct it with RotaryEmbedding(..., inplace=False)" in str(info.value), str(info.value)
    out, _ = RotaryEmbedding(16, 16, 64, 10000.0, inplace=False)(torch.arange(4), q, q_norm_weight=w)
    out.sum().backward()
    assert q.grad is not None and w.grad is not None


@pytest.mark.parametrize(
    "section, layout",
    [((8,), None), ((3, 5), "pangu"), ((2, 2, 2, 2), "ernie"), ((2, 3, 3), (2, 1, 0, 2, 1, 0, 0, 1))],
    ids=["n1", "n2-pangu", "n4-ernie", "n3-map"],
)
def test_mrope_rows_and_layouts(section, layout):
    """N position rows and any mrope_layout through the module, against the float64 oracle."""
    D, T = 16, 5
    rope = RotaryEmbedding(D, D, 64, 10000.0, mrope_section=section, mrope_layout=layout, inplace=False)
    q = _rand(T, 3 * D)
    pos = torch.randint(0, 64, (len(section), T))
    want, _ = reference.apply_rope(
        q.view(T, 3, D).double(), None, pos, rope.cos_sin_cache.double(), mrope_section=section, mrope_layout=layout
    )
    got, _ = rope(pos, q)
    torch.testing.assert_close(got.view(T, 3, D).double(), want, rtol=1e-5, atol=1e-5)
    plain, _ = rope(pos[0], q)  # text tokens: one row
    want_plain, _ = reference.apply_rope(q.view(T, 3, D).double(), None, pos[0], rope.cos_sin_cache.double())
    torch.testing.assert_close(plain.view(T, 3, D).double(), want_plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mrope_layout"):
        RotaryEmbedding(D, D, 64, 10000.0, mrope_layout="ernie")
