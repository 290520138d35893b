"""ropekit.hf.patch(model, hf_rounding=True): a patched bf16 model computes the unpatched model's
logits bit for bit.

Tiny random-weight models of families whose rotary functions round differently (Llama, Qwen3 and
GPT-NeoX rotate op by op in bf16; Cohere computes in float32 and casts once), built here, bf16,
eager attention. Each: the unpatched logits, then patched with hf_rounding=True (every rotation
through ropekit: counted), equal bit for bit; the report says the rounding each function took;
a default patch differs where HF rounds op by op (so the test can fail); unpatch restores HF's.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropekit import hf  # noqa: E402
from ropekit.api import ops  # noqa: E402
from ropekit.core import memo  # noqa: E402

from helpers.hf_models import TINY_LM  # noqa: E402

pytestmark = pytest.mark.usefixtures("hf_unpatched")

FAMILIES = [
    # (family, config class, model class, config keywords beyond TINY_LM, the rounding HF's function takes)
    ("llama", "LlamaConfig", "LlamaForCausalLM", {}, "eager"),
    ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}, "eager"),
    ("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}, "eager"),
    ("cohere", "CohereConfig", "CohereForCausalLM", {}, "once"),
]


def _model(config_cls, model_cls, extra):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**dict(TINY_LM, **extra))
    config._attn_implementation = "eager"
    return getattr(transformers, model_cls)(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("family,config_cls,model_cls,extra,rounding", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_patched_logits_equal_unpatched_bit_for_bit(monkeypatch, family, config_cls, model_cls, extra, rounding):
    if rounding == "once":
        # one rounding into bf16 outputs: the PyTorch path (Triton's interpreter truncates a float32 ->
        # bfloat16 store instead of rounding it, which a compiled kernel does not)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        memo.clear()
    model = _model(config_cls, model_cls, extra)
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    report = hf.patch(model, hf_rounding=True)
    assert set(report.rounding[family].values()) == {rounding}, report.rounding
    calls = []
    rotate = ops.rotate_angles

    def counted(*args, **kwargs):
        calls.append(kwargs.get("eager_rounding"))
        return rotate(*args, **kwargs)

    monkeypatch.setattr(ops, "rotate_angles", counted)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert calls == [rounding == "eager"] * model.config.num_hidden_layers  # every layer's rotation: ropekit's
    assert torch.equal(got, want)
    # the default rounding (once, from float32) is not HF's op-by-op bf16 rounding
    hf.patch(model)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    assert torch.equal(plain, want) == (rounding == "once")
    hf.unpatch()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    memo.clear()


def test_hf_rounding_refusals():
    model = _model("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8})
    with pytest.raises(TypeError, match=r"^ropekit.hf.patch: hf_rounding: expected a bool, got int$"):
        hf.patch(model, hf_rounding=1)
    with pytest.raises(ValueError, match=r"^ropekit.hf.patch: hf_rounding: expected False with fuse_qk_norm=True"):
        hf.patch(model, fuse_qk_norm=True, hf_rounding=True)
    assert not hf._ORIGINALS, "nothing patched"
    hf.patch(model, fuse_qk_norm=True)
    with pytest.raises(ValueError, match=r"hf_rounding: expected False while the q/k norms of \['qwen3'\] are fused"):
        hf.patch(model, hf_rounding=True)


def test_every_replaced_function_has_a_bit_for_bit_rounding():
    """Over the installed transformers: each function patch() replaces reproduces HF's bf16 output
    bit for bit with one of the two roundings (none "neither"), and both occur."""
    report = hf.patch(hf_rounding=True)
    found = [(family, name, way) for family, names in report.rounding.items() for name, way in names.items()]
    assert len(found) == sum(len(names) for names in report.values())
    assert not [f for f in found if f[2] == "neither"]
    assert {way for _, _, way in found} == {"eager", "once"}
