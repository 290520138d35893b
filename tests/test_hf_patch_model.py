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
