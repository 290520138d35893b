"""ropekit.diffusers' helper seams on tiny random-weight models: outputs and every parameter's
gradient equal to the unpatched model (fp32, 1e-5 relative), and ropekit's rotation did run.

LTX-Video: its own apply_rotary_emb (flat (B, S, C) with (B, S, C) pairs).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import ropekit.diffusers as rd  # noqa: E402
from ropekit.integrations import rotations  # noqa: E402


def _ltx():
    from diffusers import LTXVideoTransformer3DModel

    m = LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, num_layers=1, caption_channels=16,
    )  # fmt: skip

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 2 * 2 * 3, 4, generator=g),
            encoder_hidden_states=torch.randn(1, 3, 16, generator=g),
            timestep=torch.tensor([500]),
            encoder_attention_mask=torch.ones(1, 3),
            num_frames=2, height=2, width=3,
        )  # fmt: skip

    return m, inputs


BUILDERS = {"ltx": _ltx}


@pytest.fixture(autouse=True)
def _unpatched():
    rd.unpatch()
    yield
    rd.unpatch()


def _run(model, kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs, return_dict=False)[0]
    out.square().mean().backward()
    return out.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_helper_seam_parity(family, monkeypatch):
    torch.manual_seed(0)
    model, inputs = BUILDERS[family]()
    kwargs = inputs(torch.Generator().manual_seed(1))
    want, want_grads = _run(model, kwargs)
    seen = []
    real = rotations.rotate_with_angles
    monkeypatch.setattr(rotations, "rotate_with_angles", lambda *a, **k: seen.append(1) or real(*a, **k))
    rd.patch()
    out, grads = _run(model, kwargs)
    assert seen, "ropekit's rotation did not run"
    assert ((out - want).norm() / want.norm()).item() < 1e-5
    assert grads.keys() == want_grads.keys()
    scale = max(g.norm().item() for g in want_grads.values())
    for name, g in grads.items():
        assert (g - want_grads[name]).norm().item() <= 1e-5 * want_grads[name].norm().item() + 1e-7 * scale, name
