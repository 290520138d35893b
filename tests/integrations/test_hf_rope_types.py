"""Every rope type of the installed transformers (modeling_rope_utils.ROPE_INIT_FUNCTIONS, and the
default): ropekit.inv_freq / cos_sin_cache and RotaryEmbedding.from_hf_config against transformers'
own frequencies and its rotary embedding's cos / sin, on tiny Llama configs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
mru = pytest.importorskip("transformers.modeling_rope_utils")

import ropekit  # noqa: E402
from ropekit.core import freqs  # noqa: E402
from ropekit.integrations.hf_config import hf_rope_args  # noqa: E402

HEAD, MAX_POS = 16, 64
# the parameters each rope type needs (tiny; the values are arbitrary but in range)
PARAMS = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0},
    "longrope": {
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD // 2)],
        "long_factor": [2.0 + 0.3 * i for i in range(HEAD // 2)],
        "original_max_position_embeddings": 16,
        "factor": 4.0,
    },
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "proportional": {"partial_rotary_factor": 0.25},
}


def _config(rope_type):
    params = {"rope_type": rope_type, "rope_theta": 1000.0, **PARAMS[rope_type]}
    return transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=HEAD * 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD,
        max_position_embeddings=MAX_POS,
        rope_parameters=params,
    )


def test_every_hf_rope_type_is_known():
    hf_types = set(mru.ROPE_INIT_FUNCTIONS) | {"default"}
    assert hf_types <= set(freqs.ROPE_TYPES), f"missing: {sorted(hf_types - set(freqs.ROPE_TYPES))}"


@pytest.mark.parametrize("rope_type", sorted(set(mru.ROPE_INIT_FUNCTIONS) | {"default"}))
def test_tables_match_transformers(rope_type):
    if rope_type not in PARAMS:
        pytest.fail(f"rope type {rope_type!r} of this transformers has no test parameters here")
    config = _config(rope_type)
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    # frequencies: HF's (float32) against ropekit's (float64, rounded once) for the model's length
    seq_len = MAX_POS if rope_type in ("dynamic", "longrope") else None
    if rope_type == "default":
        hf_inv, hf_af = hf_rope.compute_default_rope_parameters(config)
    else:
        hf_inv, hf_af = mru.ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    scaling = dict(config.rope_parameters)
    if rope_type == "dynamic":
        scaling["original_max_position_embeddings"] = MAX_POS
    ours, af = ropekit.inv_freq(HEAD, scaling=scaling, max_position=MAX_POS)
    torch.testing.assert_close(ours, hf_inv.float(), rtol=2e-6, atol=0)
    assert af == pytest.approx(hf_af, rel=1e-12)

    # the table from_hf_config builds (its arguments) against HF's cos / sin (halves [f, f]) at the same positions
    args = hf_rope_args(config)
    table = ropekit.cos_sin_cache(HEAD, MAX_POS, args["base"], args["rope_scaling"]).double()
    cos, sin = hf_rope(torch.zeros(1, MAX_POS, HEAD), torch.arange(MAX_POS)[None])
    rows = torch.cat((cos[0, :, : HEAD // 2], sin[0, :, : HEAD // 2]), dim=-1).double()
    torch.testing.assert_close(table, rows, rtol=0, atol=2e-5)
    module = ropekit.RotaryEmbedding.from_hf_config(config)
    if rope_type == "proportional":  # p-RoPE: the rotated pairs (i, i + HEAD/2) only, their columns of HF's table
        rot = 2 * int(PARAMS[rope_type]["partial_rotary_factor"] * HEAD // 2)
        assert (args["rotary_dim"], args["rotary_position"], module.rotary_dim) == (rot, "halves", rot)
        cols = list(range(rot // 2)) + list(range(HEAD // 2, HEAD // 2 + rot // 2))
        assert torch.equal(module.cos_sin_cache.double(), table[:, cols])
    else:
        assert args["rotary_dim"] == HEAD and module.rotary_dim == HEAD


def test_proportional_rotates_only_its_fraction():
    """p-RoPE's table is full width; pairs past the fraction have angle 0 (cos 1, sin 0)."""
    table = ropekit.cos_sin_cache(
        HEAD, 8, base=1000.0, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25}
    )
    half = HEAD // 2
    rotated = int(0.25 * HEAD // 2)
    assert torch.equal(table[:, rotated:half], torch.ones(8, half - rotated))
    assert torch.equal(table[:, half + rotated :], torch.zeros(8, half - rotated))
    assert (table[1:, half : half + rotated] != 0).all()
    with pytest.raises(
        ValueError, match=r"cos_sin_cache: scaling\['partial_rotary_factor'\]: expected a number in \[0, 1\]"
    ):
        ropekit.cos_sin_cache(HEAD, 8, scaling={"rope_type": "proportional", "partial_rotary_factor": 2})
