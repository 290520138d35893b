"""ropekit.diffusers' helper seams on tiny random-weight models: outputs and every parameter's
gradient equal to the unpatched model (fp32, 1e-5 relative), and ropekit's rotation did run.

LTX-Video: its own apply_rotary_emb (flat (B, S, C) with (B, S, C) pairs). LTX-2 with
rope_type="split": apply_split_rotary_emb (per-head (B, H, S, D/2) halves, x (B, S, H * D)).
Stable Audio 3: _apply_rotary_partial (angles, partial). Lumina 2: the shared apply_rotary_emb
with complex128 freqs_cis (B, S, D/2), each sample its own positions. JoyImage-Edit+: _apply_rotary_emb_batched
((B, S, D) pairs). Allegro: apply_rotary_emb_allegro (three axis tables, halves per third of D;
the model is given the embedding its pipeline builds). Mochi: its processor's per-head angles
(S, H, D / 2), fused into the norms (pos_frequencies frozen: learnable angles run the processor
as it was, checked below). The sizes are diffusers' own test configs (tests/models/transformers),
smaller.

test_helper_float64_parity: the patched helper (Allegro's, Wan-Animate 2's rope_apply, the shared
one with Lumina 2's complex128 freqs_cis, Mochi's attention processor) on fresh random inputs in fp32 and bf16 against the original evaluated in
float64 (its `.float()` casts kept in float64): fp32 within 1e-6 relative, bf16 within 1.5 times
the original's own bf16 error (3 times in the Triton interpreter, which truncates to bf16).
"""

from __future__ import annotations

import copy
import os

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


def _allegro():
    from diffusers import AllegroTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    m = AllegroTransformer3DModel(
        patch_size=1, num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, num_layers=1,
        cross_attention_dim=24, sample_height=4, sample_width=4, sample_frames=2, caption_channels=8,
    )  # fmt: skip
    frames, height, width = 2, 2, 3
    *freqs, gt, gh, gw = get_3d_rotary_pos_embed_allegro(12, ((0, 0), (height, width)), (height, width), frames)
    pos = torch.cartesian_prod(gt.long(), gh.long(), gw.long()).T.reshape(3, 1, -1)
    emb = (tuple(freqs), tuple(pos))

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 4, frames, height, width, generator=g),
            encoder_hidden_states=torch.randn(1, 3, 8, generator=g),
            timestep=torch.tensor([500]),
            image_rotary_emb=emb,
        )

    return m, inputs


def _mochi():
    from diffusers import MochiTransformer3DModel

    m = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=16, time_embed_dim=4, max_sequence_length=8,
    )  # fmt: skip
    with torch.no_grad():  # zeros at init: no rotation at all
        m.pos_frequencies.normal_(generator=torch.Generator().manual_seed(2))
    m.pos_frequencies.requires_grad_(False)

    def inputs(g):
        return dict(
            hidden_states=torch.randn(1, 4, 2, 4, 4, generator=g),
            encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
            timestep=torch.tensor([500]),
            encoder_attention_mask=torch.tensor([[1] * 6 + [0] * 2]),
        )

    return m, inputs


def _lumina2():
    from diffusers import Lumina2Transformer2DModel

    m = Lumina2Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=24, num_layers=1, num_refiner_layers=1,
        num_attention_heads=3, num_kv_heads=1, multiple_of=16, axes_dim_rope=(2, 2, 4), axes_lens=(10, 10, 10),
        cap_feat_dim=8,
    )  # fmt: skip

    def inputs(g):
        return dict(
            hidden_states=torch.randn(2, 4, 4, 4, generator=g),
            timestep=torch.rand(2, generator=g),
            encoder_hidden_states=torch.randn(2, 5, 8, generator=g),
            encoder_attention_mask=torch.tensor([[1] * 5, [1] * 3 + [0] * 2]),  # per-sample positions
        )

    return m, inputs


BUILDERS = {"ltx": _ltx, "ltx2": _ltx2, "stable_audio3": _stable_audio3, "joyimage_edit_plus": _joyimage_edit_plus,
    "allegro": _allegro, "mochi": _mochi, "lumina2": _lumina2,
}  # fmt: skip


@pytest.fixture(autouse=True)
def _unpatched():
    rd.unpatch()
    yield
    rd.unpatch()


def _counted(monkeypatch):
    """Counts ropekit's rotations: the helpers' (rotations) and the fused norms' (ropekit.diffusers)."""
    seen = []
    real = rotations.rotate_with_angles
    for module in (rotations, rd):
        monkeypatch.setattr(module, "rotate_with_angles", lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen


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
    seen = _counted(monkeypatch)
    rd.patch()
    seen.clear()  # the patch-time verification's own calls
    out, grads = _run(model, kwargs)
    assert seen, "ropekit's rotation did not run"
    assert ((out - want).norm() / want.norm()).item() < 1e-5
    assert grads.keys() == want_grads.keys()
    scale = max(g.norm().item() for g in want_grads.values())
    for name, g in grads.items():
        assert (g - want_grads[name]).norm().item() <= 1e-5 * want_grads[name].norm().item() + 1e-7 * scale, name


def test_mochi_learnable_angles_run_the_processor_as_it_was(monkeypatch):
    torch.manual_seed(0)
    model, inputs = _mochi()
    model.pos_frequencies.requires_grad_(True)
    kwargs = inputs(torch.Generator().manual_seed(1))
    want, want_grads = _run(model, kwargs)
    seen = _counted(monkeypatch)
    rd.patch()
    seen.clear()  # the patch-time verification's own calls
    out, grads = _run(model, kwargs)
    assert not seen and torch.equal(out, want) and "pos_frequencies" in grads
    assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)


# --- each patched helper against the original evaluated in float64


def _allegro_call(helper, g, dtype):
    x = torch.randn(2, 3, 7, 12, generator=g).to(dtype)
    theta = [torch.randn(9, 2, generator=g) * 3 for _ in range(3)]
    tables = tuple((torch.cat((t.cos(),) * 2, -1), torch.cat((t.sin(),) * 2, -1)) for t in theta)
    pos = tuple(torch.randint(0, 9, (1, 7), generator=g) for _ in range(3))
    return lambda wide: helper(
        x.double() if wide else x, tuple((c.double(), s.double()) for c, s in tables) if wide else tables, pos
    )


def _animate2_call(helper, g, dtype):
    from diffusers.models.transformers.transformer_wan_animate_2 import rope_params

    x = torch.randn(2, 9, 3, 12, generator=g).to(dtype)
    freqs = torch.cat([rope_params(16, 4), rope_params(16, 4, offset=3), rope_params(16, 4)], dim=1)
    grid = torch.tensor([[2, 2, 2], [1, 3, 2]])
    return lambda wide: helper(x.double() if wide else x, grid, freqs, 2)


def _lumina2_call(helper, g, dtype):
    """The shared apply_rotary_emb as Lumina 2 calls it: complex128 freqs_cis (B, S, D/2)."""
    x = torch.randn(2, 7, 3, 8, generator=g).to(dtype)
    freqs = torch.polar(torch.ones(2, 7, 4, dtype=torch.float64), torch.randn(2, 7, 4, generator=g).double() * 3)
    return lambda wide: helper(x.double() if wide else x, freqs, False)


HELPERS = {
    "lumina2": ("diffusers.models.embeddings", "apply_rotary_emb", _lumina2_call),
    "allegro": ("diffusers.models.embeddings", "apply_rotary_emb_allegro", _allegro_call),
    "wan_animate_2": ("diffusers.models.transformers.transformer_wan_animate_2", "rope_apply", _animate2_call),
}


def _float64_kept(monkeypatch):
    """The original's .float() casts keep float64 (its arithmetic then all in float64)."""
    cast = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: t if t.dtype == torch.float64 else cast(t))


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _on(x, device):
    """Tensors (also inside tuples) moved to device."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return tuple(_on(t, device) for t in x) if isinstance(x, tuple) else x


CASES = [(f, "cpu") for f in [*HELPERS, "mochi"]] + [pytest.param(f, "cuda", marks=pytest.mark.gpu) for f in HELPERS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, device", CASES)
def test_helper_float64_parity(family, device, dtype, monkeypatch):
    import importlib

    g = torch.Generator().manual_seed(3)
    if family == "mochi":
        call = _mochi_attention_call(g, dtype)
    else:
        module, name, make = HELPERS[family]
        host = importlib.import_module(module)
        # looked up at call time (patched or not), on the device; results back on the CPU
        call = make(lambda *a: getattr(host, name)(*_on(a, device)).cpu(), g, dtype)
    base = call(False)
    seen = _counted(monkeypatch)
    report = rd.patch()
    seen.clear()  # the patch-time verification's own calls
    assert family == "mochi" or f"{module}.{name}" in report.helpers
    got = call(False)
    rd.unpatch()
    assert seen, "ropekit's rotation did not run"
    with monkeypatch.context() as m:
        _float64_kept(m)
        want = call(True)
    assert want.dtype == torch.float64 and got.dtype == base.dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert _rel(got, want) < 1e-6
    else:  # one rounding each; the Triton interpreter's truncates (a whole ulp, tests/ops/test_autograd.py)
        factor = 3.0 if os.environ.get("TRITON_INTERPRET") == "1" else 1.5
        assert _rel(got, want) <= factor * _rel(base, want) + 1e-6


def _mochi_attention_call(g, dtype):
    """One Mochi attention (its processor: per-head MochiRMSNorm, then the per-head rotation);
    wide: the module and inputs in float64."""
    from diffusers.models.attention_processor import MochiAttention, MochiAttnProcessor2_0

    attn = MochiAttention(
        query_dim=24, added_kv_proj_dim=16, processor=MochiAttnProcessor2_0(), heads=3, dim_head=8, out_dim=24,
        added_proj_bias=False, out_context_dim=16, context_pre_only=False, eps=1e-5,
    )  # fmt: skip
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(generator=g)
    hidden, context = torch.randn(1, 6, 24, generator=g), torch.randn(1, 4, 16, generator=g)
    mask = torch.tensor([[1, 1, 1, 0]])
    theta = torch.randn(6, 3, 4, generator=g) * 3
    narrow = copy.deepcopy(attn).to(dtype)
    wide = copy.deepcopy(attn).double()

    def call(w):
        m, t = (wide, torch.float64) if w else (narrow, dtype)
        emb = (theta.cos().to(t), theta.sin().to(t)) if w else (theta.cos(), theta.sin())
        with torch.no_grad():
            return m(hidden.to(t), context.to(t), mask, image_rotary_emb=emb)[0]

    return call
