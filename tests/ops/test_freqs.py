"""Parity of ropekit.inv_freq / ropekit.cos_sin_cache with Hugging Face transformers' rope init.

The configs are real model configs written out in code (no network, no weights). Each is checked
three ways against HF:

1. HF's own functions evaluated in float64 (its module's `torch.float` redirected to float64 for
   the call) against ropekit's float64 result: same formula, so agreement to ~1e-15;
2. HF as shipped (float32) against ropekit's float32 result: agreement to float32 rounding;
3. cos/sin rows near 0, mid and near the end of the table against HF's float64 angles, and rows
   near 0 against HF's rotary-embedding module forward (float32, position-dependent tolerance).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
mru = pytest.importorskip("transformers.modeling_rope_utils")

from ropekit.core import freqs  # noqa: E402
from ropekit.core.freqs import cos_sin_cache, inv_freq  # noqa: E402

# ---------------------------------------------------------------------------------------------
# real model configs (rope-relevant fields as in the checkpoints' config.json)

LLAMA31_8B = dict(
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
)
LLAMA2_7B = dict(
    model_type="llama",
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rope_scaling=None,
)
# togethercomputer/LLaMA-2-7B-32K: linear position interpolation
LLAMA2_7B_32K = dict(LLAMA2_7B, max_position_embeddings=32768, rope_scaling={"factor": 8.0, "type": "linear"})
# Llama-2-7B with dynamic NTK, the example of HF's and vLLM's docs
LLAMA2_7B_DYNAMIC = dict(LLAMA2_7B, rope_scaling={"factor": 2.0, "type": "dynamic"})
# Qwen2.5-7B-Instruct with the YaRN block its model card asks for
QWEN25_7B_YARN = dict(
    model_type="qwen2",
    hidden_size=3584,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
)
DEEPSEEK_V3 = dict(
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
)
# DeepSeek-V3's block with unequal temperatures (synthetic: real checkpoints set the two equal,
# which makes the ratio 1 and would not exercise it)
DEEPSEEK_V3_MSCALE = dict(DEEPSEEK_V3, rope_scaling=dict(DEEPSEEK_V3["rope_scaling"], mscale=1.0, mscale_all_dim=0.707))
# openai/gpt-oss-20b: YaRN without truncating the correction range
GPT_OSS_20B = dict(
    model_type="gpt_oss",
    hidden_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=150000,
    rope_scaling={
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
)
# Phi-3 128k LongRoPE; factors from microsoft/Phi-3-vision-128k-instruct's config.json
PHI3_LONG_FACTOR = [
    1.0299999713897705,
    1.0499999523162842,
    1.0499999523162842,
    1.0799999237060547,
    1.2299998998641968,
    1.2299998998641968,
    1.2999999523162842,
    1.4499999284744263,
    1.5999999046325684,
    1.6499998569488525,
    1.8999998569488525,
    2.859999895095825,
    3.68999981880188,
    5.419999599456787,
    5.489999771118164,
    5.489999771118164,
    9.09000015258789,
    11.579999923706055,
    15.65999984741211,
    15.769999504089355,
    15.789999961853027,
    18.360000610351562,
    21.989999771118164,
    23.079999923706055,
    30.009998321533203,
    32.35000228881836,
    32.590003967285156,
    35.56000518798828,
    39.95000457763672,
    53.840003967285156,
    56.20000457763672,
    57.95000457763672,
    59.29000473022461,
    59.77000427246094,
    59.920005798339844,
    61.190006256103516,
    61.96000671386719,
    62.50000762939453,
    63.3700065612793,
    63.48000717163086,
    63.48000717163086,
    63.66000747680664,
    63.850006103515625,
    64.08000946044922,
    64.760009765625,
    64.80001068115234,
    64.81001281738281,
    64.81001281738281,
]
PHI3_SHORT_FACTOR = (
    [
        1.05,
        1.05,
        1.05,
        1.1,
        1.1,
        1.1,
        1.2500000000000002,
        1.2500000000000002,
        1.4000000000000004,
        1.4500000000000004,
        1.5500000000000005,
        1.8500000000000008,
        1.9000000000000008,
    ]
    + [2.000000000000001] * 19
    + [
        2.1000000000000005,
        2.1000000000000005,
        2.2,
        2.3499999999999996,
        2.3499999999999996,
        2.3499999999999996,
        2.3499999999999996,
        2.3999999999999995,
        2.3999999999999995,
        2.6499999999999986,
        2.6999999999999984,
        2.8999999999999977,
        2.9499999999999975,
        3.049999999999997,
        3.049999999999997,
        3.049999999999997,
    ]
)
PHI3_128K = dict(
    model_type="phi3",
    hidden_size=3072,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=131072,
    original_max_position_embeddings=4096,
    rope_theta=10000.0,
    rope_scaling={"long_factor": PHI3_LONG_FACTOR, "short_factor": PHI3_SHORT_FACTOR, "type": "longrope"},
)
# EleutherAI/gpt-neox-20b: partial rotary (rotary_pct 0.25 of a 96-wide head)
GPT_NEOX_20B = dict(
    model_type="gpt_neox",
    hidden_size=6144,
    num_attention_heads=64,
    max_position_embeddings=2048,
    rotary_pct=0.25,
    rotary_emb_base=10000,
)

_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "deepseek_v3": "DeepseekV3Config",
    "gpt_oss": "GptOssConfig",
    "phi3": "Phi3Config",
    "gpt_neox": "GPTNeoXConfig",
}


def hf_config(raw: dict):
    """Build the HF config object in code, as from_pretrained would from config.json."""
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    if kwargs.get("rope_scaling") is not None:
        kwargs["rope_scaling"] = _copy(kwargs["rope_scaling"])
    cls = getattr(transformers, _CONFIG_CLASSES[raw["model_type"]], None)
    if cls is None:
        pytest.skip(f"this transformers has no {_CONFIG_CLASSES[raw['model_type']]}")
    return cls(**kwargs)


def hf_rope_dict(config) -> dict:
    """config.rope_parameters (5.x) or config.rope_scaling (4.x, theta outside)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params)


def _copy(d):
    return {k: (list(v) if isinstance(v, list) else v) for k, v in d.items()}


# ---------------------------------------------------------------------------------------------
# HF side


class _Float64Torch:
    """Stands in for `torch` inside an HF module: `torch.float` / `torch.float32` mean float64."""

    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _hf_modeling(config):
    mt = config.model_type
    return importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")


def _hf_rotary_class(config):
    mod = _hf_modeling(config)
    names = [n for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_")]
    assert len(names) == 1, names
    return getattr(mod, names[0])


def hf_inv_freq(config, seq_len=None, float64=False):
    """HF's (inv_freq, attention_factor) for this config; in float64 when asked."""
    params = hf_rope_dict(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in mru.ROPE_INIT_FUNCTIONS:  # 4.x keeps "default" here too
        fn = mru.ROPE_INIT_FUNCTIONS[rope_type]
    else:  # 5.x: on the model's rotary class
        fn = _hf_rotary_class(config).compute_default_rope_parameters
    module = importlib.import_module(fn.__module__)
    if not float64:
        out, af = fn(config, device=None, seq_len=seq_len)
        assert out.dtype == torch.float32
        return out, af
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "torch", _Float64Torch())
        mp.setattr(torch.Tensor, "float", lambda self: self.double())
        out, af = fn(config, device=None, seq_len=seq_len)
    assert out.dtype == torch.float64
    return out, af


def hf_rows(inv64: torch.Tensor, attention_factor: float, positions) -> torch.Tensor:
    """[cos | sin] rows in float64 from HF's float64 frequencies, laid out as ropekit's table."""
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv64[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_factor


# ---------------------------------------------------------------------------------------------
# cases: (id, raw config, ropekit arguments, table lengths to check)
# the ropekit arguments use the dict the checkpoint's config.json holds (4.x rope_scaling form)


def _case(name, raw, rotary_dim, base, scaling, lengths, hf_seq_len=None):
    return pytest.param(raw, rotary_dim, base, scaling, lengths, hf_seq_len, id=name)


CASES = [
    _case("llama2-default", LLAMA2_7B, 128, 10000.0, None, [4096]),
    _case("gpt-neox-20b-partial", GPT_NEOX_20B, 24, 10000, None, [2048]),
    _case("llama2-32k-linear", LLAMA2_7B_32K, 128, 10000.0, LLAMA2_7B_32K["rope_scaling"], [32768]),
    _case("llama3.1-8b", LLAMA31_8B, 128, 500000.0, LLAMA31_8B["rope_scaling"], [131072]),
    _case("qwen2.5-7b-yarn", QWEN25_7B_YARN, 128, 1000000.0, QWEN25_7B_YARN["rope_scaling"], [131072]),
    _case("deepseek-v3-yarn", DEEPSEEK_V3, 64, 10000, DEEPSEEK_V3["rope_scaling"], [163840]),
    _case("deepseek-v3-mscale-ratio", DEEPSEEK_V3_MSCALE, 64, 10000, DEEPSEEK_V3_MSCALE["rope_scaling"], [163840]),
    _case("gpt-oss-20b-yarn-no-truncate", GPT_OSS_20B, 64, 150000, GPT_OSS_20B["rope_scaling"], [131072]),
    # dynamic: HF's function called with seq_len = the table length
    _case(
        "llama2-dynamic",
        LLAMA2_7B_DYNAMIC,
        128,
        10000.0,
        dict(LLAMA2_7B_DYNAMIC["rope_scaling"], original_max_position_embeddings=4096),
        [2048, 4096, 4097, 8192, 12345],
        hf_seq_len="length",
    ),
    # longrope: long factors for tables longer than 4096 (HF: seq_len > original), short otherwise;
    # factor = 131072 / 4096 given so a short table keeps the model's attention factor
    _case(
        "phi3-128k-longrope",
        PHI3_128K,
        96,
        10000.0,
        dict(PHI3_128K["rope_scaling"], original_max_position_embeddings=4096, factor=32.0),
        [1024, 4096, 4097, 131072],
        hf_seq_len="length",
    ),
]


def _check_rows(table, inv64, af, length, atol=1e-6):
    picks = [0, 1, 2, 3, 17, length // 2 - 1, length // 2, length - 2, length - 1]
    picks = sorted({p for p in picks if 0 <= p < length})
    want = hf_rows(inv64, af, picks)
    got = table[picks].double()
    err = (got - want).abs().max().item()
    assert err <= atol, f"rows {picks}: max abs error {err:.3g} > {atol}"


@pytest.mark.parametrize("raw, rotary_dim, base, scaling, lengths, hf_seq_len", CASES)
def test_parity_with_hf(raw, rotary_dim, base, scaling, lengths, hf_seq_len):
    config = hf_config(raw)
    for length in lengths:
        seq_len = length if hf_seq_len == "length" else None
        hf32, hf_af = hf_inv_freq(config, seq_len)
        hf64, hf_af64 = hf_inv_freq(config, seq_len, float64=True)
        assert hf64.shape == (rotary_dim // 2,)

        ours64, af = inv_freq(rotary_dim, base, scaling, length, dtype=torch.float64)
        ours32, af32 = inv_freq(rotary_dim, base, scaling, length)
        assert ours32.dtype == torch.float32 and ours32.shape == (rotary_dim // 2,)
        assert isinstance(af, float) and af == af32
        # same formula in float64: agreement to float64 rounding
        torch.testing.assert_close(ours64, hf64, rtol=1e-12, atol=0)
        assert math.isclose(af, hf_af64, rel_tol=1e-12) and math.isclose(af, hf_af, rel_tol=1e-12)
        # HF as shipped computes in float32: agreement to float32 rounding
        torch.testing.assert_close(ours32, hf32, rtol=1e-6, atol=0)
        # ropekit's float32 result is the float64 value correctly rounded
        assert torch.equal(ours32, ours64.float())

        table = cos_sin_cache(rotary_dim, length, base, scaling)
        assert table.shape == (length, rotary_dim) and table.dtype == torch.float32
        _check_rows(table, hf64, hf_af64, length)


@pytest.mark.parametrize("raw, rotary_dim, base, scaling, lengths, hf_seq_len", CASES)
def test_rope_parameters_form_matches_rope_scaling_form(raw, rotary_dim, base, scaling, lengths, hf_seq_len):
    """transformers 5.x's standardized config.rope_parameters (theta inside) gives the same result."""
    config = hf_config(raw)
    if not hasattr(config, "rope_parameters"):
        pytest.skip("transformers 4.x has no rope_parameters")
    params = _copy(config.rope_parameters)
    if params["rope_type"] == "dynamic":
        params["original_max_position_embeddings"] = config.max_position_embeddings
    if params["rope_type"] == "longrope":
        params["factor"] = config.max_position_embeddings / params["original_max_position_embeddings"]
    for length in lengths:
        want, want_af = inv_freq(rotary_dim, base, scaling, length, dtype=torch.float64)
        got, got_af = inv_freq(rotary_dim, None, params, length, dtype=torch.float64)
        assert torch.equal(got, want) and got_af == want_af


def _hf_forward_rows(config, positions):
    """cos, sin from HF's rotary module forward (float32, as models run it), first half only."""
    rotary = _hf_rotary_class(config)(config=config)
    x = torch.zeros(1, len(positions), 8)
    cos, sin = rotary(x, torch.tensor([positions]))
    cos, sin = cos[0].double(), sin[0].double()
    half = rotary.inv_freq.shape[0]
    if cos.shape[-1] == 2 * half:  # HF's cat(freqs, freqs) layout
        assert torch.equal(cos[:, :half], cos[:, half:])
    return torch.cat((cos[:, :half], sin[:, :half]), dim=-1), rotary.inv_freq.double()


@pytest.mark.parametrize("raw, rotary_dim, base, scaling, lengths, hf_seq_len", CASES)
def test_rows_match_hf_module_forward(raw, rotary_dim, base, scaling, lengths, hf_seq_len):
    """End to end: HF's rotary embedding forward (layout, attention factor folded in) at positions
    near 0, where its float32 angles are still exact to ~1e-6. Tables are built for the length HF
    uses at these positions (dynamic: the original length; longrope: the short factors)."""
    config = hf_config(raw)
    positions = list(range(0, 48)) + [255, 1000]
    length = min(lengths) if hf_seq_len == "length" else lengths[0]
    if raw is PHI3_128K:
        length = 4096
    rows, hf_inv = _hf_forward_rows(config, positions)
    table = cos_sin_cache(rotary_dim, length, base, scaling)[positions].double()
    # float32 angle p * f carries ~p * f * 2^-24 of rounding, plus HF's float32 inv_freq error
    p = torch.tensor(positions, dtype=torch.float64)[:, None]
    tol = 2e-6 + 4e-7 * p * hf_inv.max()
    err = (table - rows).abs()
    assert bool((err <= tol).all()), f"max abs error {err.max().item():.3g}"


# ---------------------------------------------------------------------------------------------
# rules ropekit documents


def test_longrope_picks_factors_by_table_length():
    scaling = dict(PHI3_128K["rope_scaling"], original_max_position_embeddings=4096)
    plain, _ = inv_freq(96, 10000.0, None, dtype=torch.float64)
    short = torch.tensor(PHI3_SHORT_FACTOR, dtype=torch.float64)
    long = torch.tensor(PHI3_LONG_FACTOR, dtype=torch.float64)
    for length, ext in ((None, short), (1, short), (4096, short), (4097, long), (131072, long)):
        got, _ = inv_freq(96, 10000.0, scaling, length, dtype=torch.float64)
        torch.testing.assert_close(got, plain / ext, rtol=1e-15, atol=0)
    # attention factor: from `factor` when given, else max_position / original (HF: config ratio)
    _, af_long = inv_freq(96, 10000.0, scaling, 131072)
    assert math.isclose(af_long, math.sqrt(1 + math.log(32) / math.log(4096)), rel_tol=1e-15)
    _, af_short = inv_freq(96, 10000.0, scaling, 4096)
    assert af_short == 1.0
    _, af_short = inv_freq(96, 10000.0, dict(scaling, factor=32.0), 4096)
    assert af_short == af_long
    _, af_given = inv_freq(96, 10000.0, dict(scaling, attention_factor=1.5), 131072)
    assert af_given == 1.5


def test_dynamic_uses_table_length_as_seq_len():
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4096}
    plain, _ = inv_freq(128, 10000.0, None, dtype=torch.float64)
    for length in (None, 100, 4096):  # up to the original length: plain RoPE, as HF at init
        got, _ = inv_freq(128, 10000.0, scaling, length, dtype=torch.float64)
        assert torch.equal(got, plain)
    got, _ = inv_freq(128, 10000.0, scaling, 8192, dtype=torch.float64)
    base = 10000.0 * (2.0 * 8192 / 4096 - 1.0) ** (128 / 126)
    torch.testing.assert_close(
        got, 1.0 / base ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128), rtol=1e-14, atol=0
    )


def test_yarn_factor_none_uses_length_ratio():
    scaling = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}
    a, af_a = inv_freq(64, 10000.0, scaling, 4096 * 16, dtype=torch.float64)
    b, af_b = inv_freq(64, 10000.0, dict(scaling, factor=16.0), 4096 * 16, dtype=torch.float64)
    assert torch.equal(a, b) and af_a == af_b == 0.1 * math.log(16) + 1


def test_yarn_attention_factor_is_folded_into_table():
    scaling = QWEN25_7B_YARN["rope_scaling"]
    _, af = inv_freq(128, 1e6, scaling)
    assert math.isclose(af, 0.1 * math.log(4.0) + 1.0, rel_tol=1e-15)
    table = cos_sin_cache(128, 64, 1e6, scaling, dtype=torch.float64)
    assert math.isclose(table[0, 0].item(), af, rel_tol=1e-15)  # cos(0) * af
    assert table[0, 64:].abs().max().item() == 0.0  # sin(0)
    norm = table[:, :64] ** 2 + table[:, 64:] ** 2
    torch.testing.assert_close(norm, torch.full_like(norm, af * af), rtol=1e-14, atol=0)


def test_dtype_device_and_layout():
    t64 = cos_sin_cache(16, 10, 100.0, None, dtype=torch.float64)
    f, _ = inv_freq(16, 100.0, dtype=torch.float64)
    angles = torch.arange(10, dtype=torch.float64)[:, None] * f
    torch.testing.assert_close(t64, torch.cat((angles.cos(), angles.sin()), -1), rtol=0, atol=1e-15)
    assert torch.equal(cos_sin_cache(16, 10, 100.0), t64.float())
    assert cos_sin_cache(16, 10, 100.0, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert cos_sin_cache(16, 10, 100.0, device="meta").device.type == "meta"
    f32, af = inv_freq(16, 100.0)
    assert f32.dtype == torch.float32 and af == 1.0


def test_aliases_and_both_key_spellings():
    long = inv_freq(
        8,
        10.0,
        {
            "type": "longrope",
            "short_factor": [1, 2, 3, 4],
            "long_factor": [2, 2, 2, 2],
            "original_max_position_embeddings": 16,
        },
        32,
    )
    su = inv_freq(
        8,
        10.0,
        {
            "rope_type": "su",
            "short_factor": [1, 2, 3, 4],
            "long_factor": [2, 2, 2, 2],
            "original_max_position_embeddings": 16,
        },
        32,
    )
    assert torch.equal(long[0], su[0]) and long[1] == su[1]
    mrope = inv_freq(8, 10.0, {"type": "mrope", "mrope_section": [2, 1, 1]})
    assert torch.equal(mrope[0], inv_freq(8, 10.0)[0])
    # rope_theta inside the dict is the base when base is None; a conflicting base is refused
    a, _ = inv_freq(8, None, {"rope_type": "default", "rope_theta": 500.0})
    assert torch.equal(a, inv_freq(8, 500.0)[0])
    assert torch.equal(inv_freq(8, 500.0, {"rope_theta": 500})[0], a)
    with pytest.raises(ValueError, match=r"base: expected the same value as scaling\['rope_theta'\]"):
        inv_freq(8, 10000.0, {"rope_type": "default", "rope_theta": 500.0})


# ---------------------------------------------------------------------------------------------
# bad input: ValueError naming the key and the value


_LLAMA3 = LLAMA31_8B["rope_scaling"]
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
_LONG = {
    "rope_type": "longrope",
    "short_factor": [1.0] * 4,
    "long_factor": [2.0] * 4,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    "rotary_dim, scaling, max_position, pattern",
    [
        (8, {"rope_type": "ntk-by-parts"}, None, r"scaling\['rope_type'\]: expected one of .*, got 'ntk-by-parts'"),
        (8, {"type": "axial"}, None, r"scaling\['rope_type'\].*'axial'"),
        (
            8,
            {"rope_type": "linear"},
            None,
            r"scaling\['factor'\]: expected a value \(required for rope_type 'linear'\)",
        ),
        (8, {"rope_type": "linear", "factor": 0}, None, r"scaling\['factor'\]: expected a positive number, got 0"),
        (8, {"rope_type": "linear", "factor": -2.0}, None, r"scaling\['factor'\].*got -2.0"),
        (8, {"rope_type": "linear", "factor": float("nan")}, None, r"scaling\['factor'\].*got nan"),
        (8, {"rope_type": "linear", "factor": "2"}, None, r"scaling\['factor'\].*got '2'"),
        (
            8,
            {"rope_type": "dynamic", "factor": 2.0},
            100,
            r"scaling\['original_max_position_embeddings'\]: expected a value",
        ),
        (
            8,
            {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 0},
            100,
            r"scaling\['original_max_position_embeddings'\]: expected a positive integer, got 0",
        ),
        (2, {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}, 100, r"rotary_dim.*got 2"),
        (8, {"rope_type": "yarn", "factor": 4.0}, None, r"scaling\['original_max_position_embeddings'\]"),
        (8, {k: v for k, v in _YARN.items() if k != "factor"}, None, r"scaling\['factor'\]: expected a value"),
        (8, dict(_YARN, factor=None), None, r"scaling\['factor'\]: expected a number \(or None with max_position"),
        (8, dict(_YARN, attention_factor=0.0), None, r"scaling\['attention_factor'\].*got 0.0"),
        (8, dict(_YARN, beta_fast=-1), None, r"scaling\['beta_fast'\].*got -1"),
        (8, dict(_YARN, mscale=-0.5, mscale_all_dim=1.0), None, r"scaling\['mscale'\].*got -0.5"),
        (128, {k: v for k, v in _LLAMA3.items() if k != "low_freq_factor"}, None, r"scaling\['low_freq_factor'\]"),
        (128, dict(_LLAMA3, high_freq_factor=1.0), None, r"scaling\['high_freq_factor'\]: expected a number above"),
        (128, dict(_LLAMA3, factor=0.0), None, r"scaling\['factor'\].*got 0.0"),
        (
            8,
            {k: v for k, v in _LONG.items() if k != "short_factor"},
            None,
            r"scaling\['short_factor'\]: expected a value",
        ),
        (
            8,
            dict(_LONG, long_factor=[1.0] * 3),
            None,
            r"scaling\['long_factor'\]: expected a list of 4 numbers \(rotary_dim // 2\), got list of length 3",
        ),
        (8, dict(_LONG, short_factor=[1.0, 0.0, 1.0, 1.0]), None, r"scaling\['short_factor'\]\[1\].*got 0.0"),
        (8, dict(_LONG, factor=-1.0), None, r"scaling\['factor'\].*got -1.0"),
        (7, None, None, r"rotary_dim: expected a positive even integer, got 7"),
        (0, None, None, r"rotary_dim: .*got 0"),
        (8.0, None, None, r"rotary_dim: .*got 8.0"),
        (8, None, 0, r"max_position: expected a positive integer, got 0"),
    ],
)
def test_bad_input_raises_value_error_naming_key(rotary_dim, scaling, max_position, pattern):
    with pytest.raises(ValueError, match=pattern):
        inv_freq(rotary_dim, 10000.0, scaling, max_position)
    if "or None with max_position" in pattern:  # a table always has a length
        return
    with pytest.raises(ValueError, match=pattern):
        cos_sin_cache(rotary_dim, 16 if max_position is None else max_position, 10000.0, scaling)


def test_bad_base_and_table_args():
    with pytest.raises(ValueError, match=r"base: expected a positive number, got -1.0"):
        inv_freq(8, -1.0)
    with pytest.raises(ValueError, match=r"scaling\['rope_theta'\]: expected a positive number, got 0"):
        inv_freq(8, None, {"rope_theta": 0})
    with pytest.raises(ValueError, match=r"max_position: expected a positive integer, got -3"):
        cos_sin_cache(8, -3)
    with pytest.raises(ValueError, match=r"dtype: expected a floating-point torch.dtype"):
        cos_sin_cache(8, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"scaling: expected a dict or None, got str"):
        inv_freq(8, 10.0, "yarn")


def test_every_rope_type_is_registered():
    assert set(freqs.ROPE_TYPES) == set(freqs._ROPE_FUNCTIONS)
    hf_types = set(mru.ROPE_INIT_FUNCTIONS) | {"default"}
    assert set(freqs.ROPE_TYPES) <= hf_types


def test_public_names():
    import ropekit

    assert ropekit.inv_freq is inv_freq and ropekit.cos_sin_cache is cos_sin_cache
    from ropekit.api.modules import RotaryEmbedding

    assert ropekit.RotaryEmbedding is RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, "float32"])
def test_inv_freq_refuses_non_float_dtypes(dtype):
    """Frequencies below 1 would truncate to 0 in an integer dtype: refused, as cos_sin_cache does."""
    with pytest.raises(ValueError, match=r"^inv_freq: dtype: expected a floating-point torch.dtype, got "):
        inv_freq(64, 10000.0, dtype=dtype)
    with pytest.raises(ValueError, match=r"^cos_sin_cache: dtype: expected a floating-point torch.dtype"):
        cos_sin_cache(64, 16, 10000.0, dtype=dtype)
