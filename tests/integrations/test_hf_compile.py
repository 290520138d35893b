"""Patched tiny Llama / Qwen3 models under torch.compile(fullgraph=True): three sequence lengths,
with static shapes and with dynamic=True, logits equal to the eager patched model's (no graph
break: fullgraph=True raises on one). CPU runs the aot_eager backend (no C++ build); CUDA runs
inductor."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropekit import hf  # noqa: E402

from helpers.hf_models import TINY_LM  # noqa: E402

COMMON = dict(TINY_LM, head_dim=8)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


pytestmark = pytest.mark.usefixtures("hf_unpatched")  # transformers unpatched around every test


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_model_compiles_fullgraph(family, dynamic, device):
    torch.manual_seed(0)
    config_cls, model_cls = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).float().eval().to(device)
    report = hf.patch(model)
    assert report.forms[family] == {"apply_rotary_pos_emb": "llama"}
    torch._dynamo.reset()

    def logits(ids):
        return model(input_ids=ids, use_cache=False).logits

    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(logits, fullgraph=True, dynamic=dynamic, backend=backend)
    for seq in (5, 7, 8):
        ids = torch.randint(3, 64, (2, seq), device=device)
        with torch.no_grad():
            want = logits(ids)
            got = compiled(ids)
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err <= 1e-5, f"seq {seq}: relative error {err:.3g}"
