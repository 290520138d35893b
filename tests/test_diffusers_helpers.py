"""ropekit.diffusers' helper seams on tiny random-weight models: outputs and every parameter's
gradient equal to the unpatched model (fp32, 1e-5 relative), and ropekit's rotation did run.

LTX-Video: its own apply_rotary_emb (flat (B, S, C) with (B, S, C) pairs). LTX-2 with
rope_type="split": apply_split_rotary_emb (per-head (B, H, S, D/2) halves, x (B, S, H * D)).
Stable Audio 3: _apply_rotary_partial (angles, partial). JoyImage-Edit+: _apply_rotary_emb_batched
((B, S, D) pairs). The sizes are diffusers' own test configs (tests/models/transformers), smaller.
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


def _ltx2():
    from diffusers import LTX2VideoTransformer3DModel

    m = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=1, qk_norm="rms_norm_across_heads",
        caption_channels=16, rope_double_precision=False, rope_type="split",
    )  # fmt: skip

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 2 * 2 * 3, 4, generator=g),
            audio_hidden_states=torch.randn(1, 5, 4, generator=g),
            encoder_hidden_states=torch.randn(1, 3, 16, generator=g),
            audio_encoder_hidden_states=torch.randn(1, 3, 16, generator=g),
            timestep=torch.tensor([500.0]),
            encoder_attention_mask=torch.ones(1, 3).bool(),
            num_frames=2, height=2, width=3, audio_num_frames=5, fps=25.0,
        )  # fmt: skip

    return m, inputs


def _stable_audio3():
    from diffusers.models.transformers.transformer_stable_audio3 import StableAudio3DiTModel

    m = StableAudio3DiTModel(
        io_channels=4, patch_size=1, embed_dim=16, depth=1, num_heads=2, cond_token_dim=8, global_cond_dim=6,
        local_add_cond_dim=5, timestep_features_dim=8, ff_mult=2, num_memory_tokens=2,
        use_differential_attention=False,
    )  # fmt: skip

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 4, 6, generator=g),
            timestep=torch.rand(1, generator=g),
            encoder_hidden_states=torch.randn(1, 3, 8, generator=g),
            global_hidden_states=torch.randn(1, 6, generator=g),
        )

    return m, inputs


def _joyimage_edit_plus():
    from diffusers.models.transformers.transformer_joyimage_edit_plus import JoyImageEditPlusTransformer3DModel

    m = JoyImageEditPlusTransformer3DModel(
        patch_size=[1, 2, 2], in_channels=4, hidden_size=32, num_attention_heads=2, text_dim=8, num_layers=1,
        rope_dim_list=[4, 6, 6], theta=256,
    )  # fmt: skip

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 2, 4, 1, 2, 2, generator=g),
            encoder_hidden_states=torch.randn(1, 4, 8, generator=g),
            timestep=torch.tensor([1.0]),
            shape_list=[[(1, 1, 1), (1, 1, 1)]],
        )

    return m, inputs


BUILDERS = {"ltx": _ltx, "ltx2": _ltx2, "stable_audio3": _stable_audio3, "joyimage_edit_plus": _joyimage_edit_plus}


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
