"""ropekit.diffusers: the QK-norm + rotary embedding of diffusers' Flux, Wan, HunyuanVideo and
Qwen-Image attention processors through ropekit, against the unpatched model.

Tiny random-weight configs built here (no downloads); outputs and parameter gradients of one
forward + backward, fp32 within 1e-5 relative, bf16 within the unpatched model's own bf16 error
against fp32. Skipped when diffusers is not installed (CI installs the `diffusers` extra).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import ropekit.diffusers as rd  # noqa: E402

from helpers.diffusers_models import BUILDERS, FAMILY  # noqa: E402


@pytest.fixture(autouse=True)
def _unpatched():
    rd.unpatch()
    yield
    rd.unpatch()


@pytest.fixture
def calls(monkeypatch):
    """Counts ropekit's rotations inside the patched norms (a patch that silently did nothing
    would otherwise pass the parity checks); those patch() itself runs to verify are dropped."""
    seen = []
    real = rd.rotate_with_angles

    def counting(*args, **kwargs):
        seen.append(kwargs.get("q_norm_weight") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(rd, "rotate_with_angles", counting)
    patch = rd.patch

    def patching(*args, **kwargs):  # patch()'s own verification (Mochi's processor) is not counted
        n = len(seen)
        try:
            return patch(*args, **kwargs)
        finally:
            del seen[n:]

    monkeypatch.setattr(rd, "patch", patching)
    return seen


def _run(model, kwargs, dtype):
    """One forward + backward: the output and every parameter's gradient (float64 copies)."""
    model.zero_grad(set_to_none=True)

    def cast(v):  # a float tensor, or a list of them (Z-Image's per-sample inputs)
        if isinstance(v, (list, tuple)):
            return type(v)(cast(t) for t in v)
        return v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v

    floats = {k: cast(v) for k, v in kwargs.items()}
    out = model(**floats, return_dict=False)[0]
    if isinstance(out, (list, tuple)):  # Z-Image: one output per sample, each its own size
        out = torch.cat([o.flatten() for o in out])
    out.float().square().mean().backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().double(), grads


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grads_close(grads, want, rtol, base=None, factor=1.5):
    """Every parameter's gradient within rtol relative (or, with base, within the unpatched
    model's own error times factor plus rtol); gradients that are zero in exact arithmetic (a key
    bias under softmax) are rounding noise: measured against the largest gradient instead."""
    assert grads.keys() == want.keys()
    scale = max(g.norm().item() for g in want.values())
    for name in grads:
        err = (grads[name] - want[name]).norm().item()
        bound = rtol * want[name].norm().item() + 1e-7 * scale
        if base is not None:
            bound += factor * (base[name] - want[name]).norm().item()
        assert err <= bound, f"{name}: {err} > {bound}"


def _model(family, dtype=torch.float32):
    torch.manual_seed(0)
    model, inputs = BUILDERS[family]()
    return model.to(dtype), inputs(torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", list(BUILDERS))
def test_patch_fp32_parity(family, calls):
    model, kwargs = _model(family)
    want_out, want_grads = _run(model, kwargs, torch.float32)
    counts = rd.patch(model)
    assert counts[FAMILY.get(family, family)] > 0
    out, grads = _run(model, kwargs, torch.float32)
    assert calls and all(calls), "ropekit's fused norm + rotation did not run"
    assert _rel(out, want_out) < 1e-5
    _grads_close(grads, want_grads, 1e-5)
    rd.unpatch()
    n = len(calls)
    again, _ = _run(model, kwargs, torch.float32)
    assert len(calls) == n and torch.equal(again, want_out)  # unpatched: diffusers' own code again


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_patch_bf16_within_unpatched_error(family, calls):
    model, kwargs = _model(family)
    ref_out, ref_grads = _run(model, kwargs, torch.float32)
    model = model.to(torch.bfloat16)
    base_out, base_grads = _run(model, kwargs, torch.bfloat16)
    rd.patch(model)
    out, grads = _run(model, kwargs, torch.bfloat16)
    assert calls
    # ropekit rounds once where diffusers rounds after the norm and again after the rotation:
    # its error against fp32 stays within the unpatched bf16 model's own (with a margin for noise).
    # The Triton interpreter truncates fp32 -> bf16 (a whole ulp, tests/ops/test_autograd.py): 3 times
    # there, as tests/integrations/test_diffusers_helpers.py allows (Flux's to_q gradient measured 1.6 times)
    factor = 3.0 if os.environ.get("TRITON_INTERPRET") == "1" else 1.5
    assert _rel(out, ref_out) <= factor * _rel(base_out, ref_out) + 1e-3
    _grads_close(grads, ref_grads, 1e-3, base=base_grads, factor=factor)


def test_patch_none_prepares_on_first_call(calls):
    model, kwargs = _model("wan")
    want, _ = _run(model, kwargs, torch.float32)
    counts = rd.patch()
    assert counts["wan"] == 0  # nothing prepared yet
    out, _ = _run(model, kwargs, torch.float32)
    assert calls and _rel(out, want) < 1e-5


def test_unpatch_returns_what_it_restored():
    """{family or module: [names]}, the shape of ropekit.hf.unpatch(): the processor under its
    family, the norm class and the helper bindings under their modules; each is diffusers' again."""
    import diffusers.models.embeddings as emb
    import diffusers.models.transformers.transformer_flux as flux

    model, _ = _model("flux")
    own_call, own_helper = flux.FluxAttnProcessor.__call__, emb.apply_rotary_emb
    norm = type(model.transformer_blocks[0].attn.norm_q)
    own_forward = norm.forward
    rd.patch(model)
    assert flux.FluxAttnProcessor.__call__ is not own_call and emb.apply_rotary_emb is not own_helper
    restored = rd.unpatch()
    assert all(isinstance(k, str) and isinstance(v, list) and v for k, v in restored.items())
    assert restored["flux"] == ["FluxAttnProcessor.__call__"]
    assert f"{norm.__qualname__}.forward" in restored[norm.__module__]
    assert "apply_rotary_emb" in restored["diffusers.models.embeddings"]
    assert all(len(v) == len(set(v)) for v in restored.values())
    assert flux.FluxAttnProcessor.__call__ is own_call and emb.apply_rotary_emb is own_helper
    assert norm.forward is own_forward
    assert rd.unpatch() == {}  # nothing left to restore


@pytest.mark.parametrize(
    "family, helpers", [("flux", {"diffusers.models.embeddings.apply_rotary_emb"}), ("wan", set())]
)
def test_patch_model_reports_only_that_model(family, helpers):
    """patch(model) reports the model's own family (its attention modules prepared) and the helpers
    bound where its attention runs (Flux calls the shared apply_rotary_emb, Wan rotates in its
    processor), none of the other families and helpers that patch() covers."""
    model, _ = _model(family)
    every = rd.patch()
    rd.unpatch()
    report = rd.patch(model)
    attns = [m for m in model.modules() if getattr(m, "processor", None) is not None]
    assert dict(report) == {family: len(attns)} and len(every) > 1
    assert set(report.helpers) == helpers and helpers < set(every.helpers)
    assert report.left == {}


def test_patch_keeps_state_dict_and_signature():
    import inspect

    model, _ = _model("flux")
    keys = list(model.state_dict())
    attn = model.transformer_blocks[0].attn
    before = inspect.signature(attn.processor.__call__)
    rd.patch(model)
    assert list(model.state_dict()) == keys
    assert inspect.signature(attn.processor.__call__) == before  # diffusers filters kwargs by it


def test_patch_refuses_a_non_module():
    with pytest.raises(TypeError, match="ropekit.diffusers: model: expected a torch.nn.Module or None, got str"):
        rd.patch("flux")


def test_rows_rule_mismatch_is_named():
    cos = torch.ones(4, 2)
    with pytest.raises(
        ValueError, match=r"ropekit.diffusers: rotary embedding: expected rows for 6 tokens \(tail rule\), got 4 rows"
    ):
        rd._rows((cos, cos), 6, "tail")


def test_patched_block_compiles_fullgraph(calls):
    """One Flux double-stream block, patched, under torch.compile(fullgraph=True): same output and
    gradients as eager."""
    model, kwargs = _model("flux")
    rd.patch(model)
    block = model.transformer_blocks[0]
    g = torch.Generator().manual_seed(3)
    hs = torch.randn(1, 6, 32, generator=g, requires_grad=True)
    ehs = torch.randn(1, 3, 32, generator=g)
    temb = torch.randn(1, 32, generator=g)
    emb = model.pos_embed(torch.cat((kwargs["txt_ids"], kwargs["img_ids"])))

    def step(hs):
        e, h = block(hidden_states=hs, encoder_hidden_states=ehs, temb=temb, image_rotary_emb=emb)
        return h.square().sum() + e.sum()

    eager = step(hs)
    (d_eager,) = torch.autograd.grad(eager, hs)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(hs)
    (d_compiled,) = torch.autograd.grad(compiled, hs)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_compiled, d_eager, rtol=1e-5, atol=1e-5)
    assert calls


def _cuda(v):
    """A model input on CUDA: a tensor, or a list of them (Z-Image's per-sample inputs)."""
    if isinstance(v, (list, tuple)):
        return type(v)(_cuda(t) for t in v)
    return v.cuda() if torch.is_tensor(v) else v


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(BUILDERS))
def test_patch_cuda_fp32_and_bf16(family):
    """The compiled kernels on CUDA: fp32 parity, and bf16 within the unpatched bf16 error."""
    model, kwargs = _model(family)
    model = model.cuda()
    kwargs = {k: _cuda(v) for k, v in kwargs.items()}
    want_out, want_grads = _run(model, kwargs, torch.float32)
    half = copy.deepcopy(model).to(torch.bfloat16)  # model keeps its float32 weights
    base_out, base_grads = _run(half, kwargs, torch.bfloat16)
    rd.patch(half)
    out, grads = _run(half, kwargs, torch.bfloat16)
    assert _rel(out, want_out) <= 1.5 * _rel(base_out, want_out) + 1e-3
    # bf16 gradients as a whole (one parameter's bf16 error is too noisy to compare alone), where
    # the unpatched model's own bf16 gradients mean something: the tiny random Flux's overflow
    # in bf16 on CUDA (~1e37, relative error ~1e37 unpatched too), which says nothing of the patch
    flat = lambda g: torch.cat([g[n].flatten() for n in sorted(want_grads)])  # noqa: E731
    base_err = _rel(flat(base_grads), flat(want_grads))
    if base_err < 0.5:
        assert _rel(flat(grads), flat(want_grads)) <= 1.5 * base_err + 1e-3
    rd.unpatch()
    rd.patch(model)
    out, grads = _run(model, kwargs, torch.float32)
    assert _rel(out, want_out) < 1e-5
    _grads_close(grads, want_grads, 1e-5)
