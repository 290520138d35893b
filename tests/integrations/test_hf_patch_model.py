"""ropekit.hf.patch(model=...) with something that is not a model: a TypeError naming `model`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from ropekit import hf  # noqa: E402


@pytest.mark.parametrize("model", [3, "meta-llama/Llama-3.1-8B", {"model_type": "llama"}, torch.zeros(2)])
def test_patch_refuses_what_is_not_a_model(model):
    before = dict(hf._ORIGINALS)
    with pytest.raises(
        TypeError,
        match=r"^ropekit.hf.patch: model: expected a torch.nn.Module \(a transformers "
        r"model\) or None, got " + type(model).__name__ + "$",
    ):
        hf.patch(model)
    assert hf._ORIGINALS == before, "nothing patched"


def test_patch_of_a_module_of_no_supported_family_still_says_value_error():
    with pytest.raises(ValueError, match=r"^ropekit.hf.patch: model: expected a transformers model"):
        hf.patch(torch.nn.Linear(2, 2))


# --- never silent: the binding each function had, and what patch(model) says when it leaves one ---

transformers = pytest.importorskip("transformers")
from ropekit.integrations import hf_census, hf_forms  # noqa: E402

from helpers.hf_models import TINY_LM  # noqa: E402


def _tiny_llama():
    config = transformers.LlamaConfig(**TINY_LM)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config).float().eval()


@pytest.mark.usefixtures("hf_unpatched")
def test_patch_replaces_the_binding_transformers_made_and_says_which():
    from transformers.models.llama import modeling_llama

    bound = modeling_llama.apply_rotary_pos_emb
    # what the installed transformers binds, read off the package (an nn.Module: kernels' Func)
    want_route = hf_census.HUB_FUNC if isinstance(bound, torch.nn.Module) else hf_census.FUNCTION
    model = _tiny_llama()
    ids = torch.randint(3, 64, (2, 7))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    report = hf.patch(model)
    assert report == {"llama": ["apply_rotary_pos_emb"]}
    assert report.routes == {"llama": {"apply_rotary_pos_emb": want_route}}
    assert modeling_llama.apply_rotary_pos_emb is not bound
    assert modeling_llama.apply_rotary_pos_emb.ropekit_original is bound  # what unpatch puts back
    calls = []
    from ropekit.integrations import hf_forms as forms

    real_run = forms.run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forms, "run", lambda *a, **kw: calls.append(1) or real_run(*a, **kw))
        with torch.no_grad():
            got = model(input_ids=ids).logits
    assert len(calls) == TINY_LM["num_hidden_layers"], "ropekit ran once per layer"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    hf.unpatch()
    assert modeling_llama.apply_rotary_pos_emb is bound


@pytest.fixture
def no_llama_form(monkeypatch):
    """ropekit loses the form Llama's function computes: classification finds none."""
    monkeypatch.setattr(hf_forms, "FORMS", tuple(f for f in hf_forms.FORMS if f.name != "llama"))
    monkeypatch.setattr(hf_census, "_VERDICTS", {})


@pytest.mark.usefixtures("hf_unpatched", "no_llama_form")
def test_a_function_the_model_calls_and_patch_leaves_is_a_warning():
    from transformers.models.llama import modeling_llama

    bound = modeling_llama.apply_rotary_pos_emb
    with pytest.warns(hf.RotaryLeftWarning, match=r"llama\.apply_rotary_pos_emb \(") as caught:
        report = hf.patch(_tiny_llama())
    assert len([w for w in caught if issubclass(w.category, hf.RotaryLeftWarning)]) == 1
    assert dict(report) == {}
    assert set(report.unreached["llama"]) == {"apply_rotary_pos_emb"}
    assert modeling_llama.apply_rotary_pos_emb is bound


@pytest.mark.usefixtures("hf_unpatched", "no_llama_form")
def test_strict_raises_before_anything_is_swapped():
    from transformers.models.llama import modeling_llama

    bound = modeling_llama.apply_rotary_pos_emb
    before = dict(hf._ORIGINALS)
    with pytest.raises(
        ValueError,
        match=r"^ropekit.hf.patch: strict: expected every rotary function the model "
        r"calls to be replaced, got these left as HF's: llama\.apply_rotary_pos_emb \(",
    ):
        hf.patch(_tiny_llama(), strict=True)
    assert hf._ORIGINALS == before and modeling_llama.apply_rotary_pos_emb is bound


@pytest.mark.usefixtures("hf_unpatched")
def test_strict_passes_and_nothing_is_said_when_every_called_function_is_replaced(recwarn):
    report = hf.patch(_tiny_llama(), strict=True)
    assert report == {"llama": ["apply_rotary_pos_emb"]} and report.unreached == {}
    assert not [w for w in recwarn if issubclass(w.category, hf.RotaryLeftWarning)]


def test_unwrap_finds_the_function_a_kernels_hub_func_module_wraps():
    kernels = pytest.importorskip("kernels")

    def rotate(q, k, cos, sin, unsqueeze_dim=1):
        return q, k

    wrapped = kernels.use_kernel_forward_from_hub("ropekit_test_rotary")(rotate)
    assert isinstance(wrapped, torch.nn.Module)
    assert hf_census.unwrap(wrapped) == (rotate, hf_census.HUB_FUNC)
    assert hf_census.unwrap(rotate) == (rotate, hf_census.FUNCTION)
