"""ropekit.timm on tiny random-weight timm ViT RoPE models (timm.create_model, pretrained=False):
outputs and every parameter's gradient equal to the unpatched model (fp32, 1e-5 relative), and
ropekit's rotation did run; each helper verified at patch time and restored by unpatch().

timm imports torchvision, which needs a torch it was built for: CI runs this file in a venv of
its own (.ci/run); it is skipped where timm does not import.
"""

from __future__ import annotations

import pytest
import torch

try:
    import timm
except Exception as e:  # torchvision built for another torch fails at import with its own error
    pytest.skip(f"timm does not import: {type(e).__name__}: {e}", allow_module_level=True)

import ropekit.timm as rt  # noqa: E402
from ropekit.integrations import rotations  # noqa: E402

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=4)
MODELS = {
    "vit_rope_cat": ("vit_small_patch16_rope_224", {}),  # EVA attention, RotaryEmbeddingCat, pairs
    "vit_rope_reg_gap": ("vit_medium_patch16_rope_reg1_gap_256", {}),  # prefix tokens left unrotated
    "vit_rope_mixed": ("vit_small_patch16_rope_mixed_224", {}),  # per-head learnable frequencies
    "eva02": ("eva02_tiny_patch14_224", dict(patch_size=8, mlp_ratio=2.0)),  # half=True (rotate_half)
}


@pytest.fixture(autouse=True)
def _unpatched():
    rt.unpatch()
    yield
    rt.unpatch()


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = rotations.rotate_with_angles
    monkeypatch.setattr(rotations, "rotate_with_angles", lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen


def _model(name):
    arch, extra = MODELS[name]
    torch.manual_seed(0)
    return timm.create_model(arch, pretrained=False, **{**TINY, **extra}).eval()


def _run(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_parity_with_unpatched(name, calls):
    model = _model(name)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    want, want_grads = _run(model, x)
    with torch.no_grad():
        want_eval = model(x).double()
    report = rt.patch()
    assert "timm.layers.pos_embed_sincos.apply_rot_embed_cat" in report
    out, grads = _run(model, x)
    with torch.no_grad():
        got_eval = model(x).double()
    assert calls, "ropekit's rotation did not run"
    for got, ref in ((out, want), (got_eval, want_eval)):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    assert grads.keys() == want_grads.keys()
    scale = max(g.norm().item() for g in want_grads.values())
    for n, g in grads.items():
        assert (g - want_grads[n]).norm().item() <= 1e-5 * want_grads[n].norm().item() + 1e-7 * scale, n


def test_report_and_unpatch():
    import timm.layers.pos_embed_sincos as host
    import timm.models.eva as eva

    own = eva.apply_rot_embed_cat
    report = rt.patch()
    assert set(report) == {f"{host.__name__}.apply_rot_embed", f"{host.__name__}.apply_rot_embed_cat"}
    assert report.left[f"{host.__name__}.apply_rot_embed_list"].startswith("not replaced: it calls apply_rot_embed")
    assert eva.apply_rot_embed_cat is not own and eva.apply_rot_embed_cat.ropekit_original is own
    restored = rt.unpatch()  # {module: [attributes]}, the shape of ropekit.hf.unpatch()
    assert isinstance(restored, dict) and all(isinstance(v, list) and v for v in restored.values())
    assert "apply_rot_embed_cat" in restored["timm.models.eva"]
    assert set(restored[host.__name__]) >= {"apply_rot_embed", "apply_rot_embed_cat"}
    assert eva.apply_rot_embed_cat is own and host.apply_rot_embed_cat is own
    assert rt.unpatch() == {}  # nothing left to restore


def test_unverified_convention_runs_timm():
    """A call outside the verified conventions (here a 5-D emb) goes to timm's own helper."""
    import timm.layers.pos_embed_sincos as host

    own = host.apply_rot_embed_cat
    rt.patch()
    x = torch.randn(1, 2, 1, 4, 8)
    emb = torch.randn(1, 2, 1, 4, 16)
    torch.testing.assert_close(host.apply_rot_embed_cat(x, emb), own(x, emb), rtol=0, atol=0)
