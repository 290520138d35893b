"""ropekit.hf.fuse_qkv(model): tiny random-weight Llama, Qwen3 and Qwen3-MoE models, fused against
the same model in float64 (logits and every gradient, the q/k norm weights included); the fused
prologue really runs once a layer; the layers that do not fit are named with their reason; a forward
that stops fitting raises; unfuse_qkv gives HF's classes and function back."""

import copy
import importlib
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropekit import hf  # noqa: E402
from ropekit.integrations import hf_qkv  # noqa: E402

from conftest import DEVICES, INTERPRET  # noqa: E402
from helpers.hf_models import PARITY_LM  # noqa: E402

V, HID, LAYERS, S = PARITY_LM["vocab_size"], PARITY_LM["hidden_size"], PARITY_LM["num_hidden_layers"], 5
COMMON = PARITY_LM


def _build(name):
    T = transformers
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**COMMON))
    if name == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=16))
    if name == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(
            T.Qwen3MoeConfig(
                **COMMON,
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                experts_implementation="eager",
            )
        )
    if name == "qwen2":  # q/k/v projections with a bias
        return T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON))
    if name == "olmo2":  # q/k norm across all heads
        return T.Olmo2ForCausalLM(T.Olmo2Config(**COMMON))
    if name == "cohere":  # rotates interleaved pairs
        return T.CohereForCausalLM(T.CohereConfig(**COMMON))
    if name == "olmo":  # clamps q, k, v between the projections and the rotation when clip_qkv is set
        return T.OlmoForCausalLM(T.OlmoConfig(**COMMON, clip_qkv=0.5))
    if name == "gemma3":  # q/k norm with Gemma's 1 + w weight
        return T.Gemma3ForCausalLM(
            T.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=4, query_pre_attn_scalar=16)
        )
    raise KeyError(name)


def _model(name, device="cpu"):
    torch.manual_seed(0)
    model = _build(name).float().eval().to(device)
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # norm weights away from their init, so a norm skipped or doubled shows
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(0.5 + torch.rand_like(p))
    return model


def _run(model, ids, up):
    """Logits and every parameter's gradient of sum(logits * up)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits * up.to(logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["auto", "unfused", "fused"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe"])
def test_fused_model_matches_float64(name, impl, device):
    if impl == "fused" and device == "cpu" and not INTERPRET:
        pytest.skip("impl='fused' on CPU tensors runs in the Triton interpreter only")
    model = _model(name, device)
    ids = torch.randint(3, V, (2, S), device=device)
    up = torch.randn(2, S, V, device=device)
    ref_logits, ref_grads = _run(copy.deepcopy(model).double(), ids, up)  # the float64 reference
    hf_logits, hf_grads = _run(model, ids, up)  # unpatched float32: the error HF itself makes

    fusion = hf.fuse_qkv(model, impl=impl)
    assert fusion.fused == [f"model.layers.{i}.self_attn" for i in range(LAYERS)] and fusion.left == {}
    calls = mock.MagicMock(wraps=hf_qkv.project)
    try:
        with mock.patch.object(hf_qkv, "project", calls):
            logits, grads = _run(model, ids, up)
    finally:
        restored = hf.unfuse_qkv(model)
    assert restored == fusion.fused
    assert calls.call_count == LAYERS, f"{calls.call_count} fused prologues, expected one a layer"
    normed = name != "llama"
    for c in calls.call_args_list:  # project(fused, x, weight, positions, table, q_norm_weight, ...)
        assert c.args[0] is (impl == "fused") and (c.args[5] is not None) == normed

    tol = 1e-5
    assert _rel(logits, ref_logits) < max(tol, 4 * _rel(hf_logits, ref_logits))
    assert grads.keys() == ref_grads.keys() == hf_grads.keys()
    assert sum(n.endswith(("q_norm.weight", "k_norm.weight")) for n in grads) == (2 * LAYERS if normed else 0)
    for n in grads:
        err, hf_err = _rel(grads[n], ref_grads[n]), _rel(hf_grads[n], ref_grads[n])
        assert err < max(1e-4, 4 * hf_err), f"grad {n}: {err:.2e} (HF's float32: {hf_err:.2e})"


def test_generate_and_no_grad_calls_match_hf():
    """Decoding with a KV cache (one token a step) and no-grad forwards: the same greedy tokens as
    the unpatched model; the kept concatenated weight follows an in-place weight update."""
    model = _model("qwen3")
    ids = torch.randint(3, V, (2, S))
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        want_logits = model(input_ids=ids).logits
    hf.fuse_qkv(model)
    try:
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want)
        attn = model.model.layers[0].self_attn
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            assert _rel(logits, want_logits) < 1e-5
            attn.v_proj.weight.mul_(2.0)  # an optimizer-like in-place write: the kept copy is rebuilt
            fused_after = model(input_ids=ids).logits
    finally:
        hf.unfuse_qkv(model)
    with torch.no_grad():
        hf_after = model(input_ids=ids).logits
    assert _rel(fused_after, hf_after) < 1e-5 and _rel(hf_after, want_logits) > 1e-3


@pytest.mark.parametrize(
    "name, reason",
    [
        ("qwen2", "have a bias"),
        ("olmo2", "not per head"),
        ("gemma3", "is not y * rsqrt(mean(y^2) + eps) * weight"),
        ("cohere", "is not a half-split rotation (cohere)"),
        ("olmo", "calls clamp_ between the projections and apply_rotary_pos_emb"),
    ],
)
def test_layers_that_do_not_fit_are_named_and_keep_hf(name, reason):
    model = _model(name)
    ids = torch.randint(3, V, (1, S))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"ropekit.hf.fuse_qkv: strict: expected every rotary attention layer"):
        hf.fuse_qkv(model, strict=True)
    assert [type(m) for m in model.modules()] == classes, "a strict refusal changes nothing"
    with pytest.warns(UserWarning, match="keep HF's prologue"):
        fusion = hf.fuse_qkv(model)
    assert fusion.fused == [] and len(fusion.left) == LAYERS
    assert all(reason in why for why in fusion.left.values()), fusion.left
    assert [type(m) for m in model.modules()] == classes
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_unfuse_restores_classes_and_the_modules_function():
    model = _model("qwen3")
    module = importlib.import_module("transformers.models.qwen3.modeling_qwen3")
    bound = module.apply_rotary_pos_emb
    classes = [type(m) for m in model.modules()]
    ids = torch.randint(3, V, (2, S))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    hf.fuse_qkv(model)
    twin = copy.deepcopy(model)  # a copy stays fused, and is unfused on its own
    assert type(twin.model.layers[1].self_attn) is type(model.model.layers[1].self_attn) is not classes[0]
    hf.fuse_qkv(model)  # twice: the same state
    assert hf.unfuse_qkv(model) == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    assert [type(m) for m in model.modules()] == classes
    assert module.apply_rotary_pos_emb is bound, "no fused layer known: HF's binding again"
    with torch.no_grad():
        assert _rel(twin(input_ids=ids).logits, before) < 1e-5  # the twin wraps it again
    assert module.apply_rotary_pos_emb is not bound
    assert len(hf.unfuse_qkv(twin)) == LAYERS
    assert module.apply_rotary_pos_emb is bound
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert hf.unfuse_qkv(model) == []


def test_a_forward_that_stops_fitting_raises():
    """An apply_rotary_pos_emb bound later that rotates copies (so the fused q and k are not handed
    back): the call raises instead of returning twice-rotated attention."""
    model = _model("llama")
    module = importlib.import_module("transformers.models.llama.modeling_llama")
    hf.fuse_qkv(model)
    wrapper = module.apply_rotary_pos_emb
    hf_rope = wrapper.ropekit_wraps

    def copies(q, k, cos, sin, *args, **kwargs):
        return hf_rope(q.clone(), k.clone(), cos, sin, *args, **kwargs)

    copies.ropekit_fuse_qkv = True  # looks like fuse_qkv's wrapper: it is not wrapped again
    module.apply_rotary_pos_emb = copies
    try:
        with pytest.raises(RuntimeError, match="never skipped apply_rotary_pos_emb"):
            with torch.no_grad():
                model(input_ids=torch.randint(3, V, (1, S)))
    finally:
        module.apply_rotary_pos_emb = wrapper
        hf.unfuse_qkv(model)


def test_calls_outside_the_fused_form_take_hf_prologue():
    """Hidden states of another dtype than the weights (autocast): HF's own prologue, HF's numbers."""
    model = _model("qwen3")
    ids = torch.randint(3, V, (1, S))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(input_ids=ids).logits
    hf.fuse_qkv(model)
    calls = mock.MagicMock(wraps=hf_qkv.project)
    try:
        with mock.patch.object(hf_qkv, "project", calls):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                got = model(input_ids=ids).logits
    finally:
        hf.unfuse_qkv(model)
    assert calls.call_count == 0 and torch.equal(got, want)


def test_with_the_rotary_patch_and_fused_norms():
    """fuse_qkv on a model whose module hf.patch(fuse_qk_norm=True) patched: still one prologue a
    layer (norms applied once), float64 parity; both undo cleanly in either order."""
    model = _model("qwen3")
    ids = torch.randint(3, V, (2, S))
    up = torch.randn(2, S, V)
    ref_logits, _ = _run(copy.deepcopy(model).double(), ids, up)
    hf.patch(model, fuse_qk_norm=True)
    try:
        hf.fuse_qkv(model)
        logits, grads = _run(model, ids, up)
        assert _rel(logits, ref_logits) < 1e-5
        hf.unpatch()
        logits2, _ = _run(model, ids, up)  # the wrapper wraps HF's function again
        assert _rel(logits2, ref_logits) < 1e-5
    finally:
        hf.unfuse_qkv(model)
        hf.unpatch()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(impl="triton"),
            ValueError,
            r"ropekit.hf.fuse_qkv: impl: expected one of \('auto', 'fused', 'unfused'\), got 'triton'",
        ),
        (dict(strict=1), TypeError, r"ropekit.hf.fuse_qkv: strict: expected a bool, got int"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, match):
    model = _model("llama")
    classes = [type(m) for m in model.modules()]
    with pytest.raises(error, match=match):
        hf.fuse_qkv(model, **kwargs)
    assert [type(m) for m in model.modules()] == classes


def test_a_model_without_rotary_attention_is_refused():
    with pytest.raises(TypeError, match=r"ropekit.hf.fuse_qkv: model: expected a torch.nn.Module, got str"):
        hf.fuse_qkv("llama")
    with pytest.raises(ValueError, match=r"ropekit.hf.fuse_qkv: model: expected a transformers model with rotary"):
        hf.fuse_qkv(torch.nn.Linear(4, 4))
