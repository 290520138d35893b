"""ropekit.hf.patch(model, fuse_qk_norm=True): tiny random Qwen3, Qwen3-MoE, Gemma 3 and OLMo 2
models, patched vs unpatched (float32): logits and every gradient, the q/k norm weights included;
the fused op is really called (and HF's q/k norms are not); unpatch restores HF's objects."""

import importlib
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropekit import hf  # noqa: E402
from ropekit.api import ops  # noqa: E402
from ropekit.integrations import hf_qknorm  # noqa: E402

from helpers.hf_models import PARITY_LM  # noqa: E402

V, HID, LAYERS, S = PARITY_LM["vocab_size"], PARITY_LM["hidden_size"], PARITY_LM["num_hidden_layers"], 5
COMMON = PARITY_LM


def _build(name):
    T = transformers
    if name == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=16))
    if name == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(
            T.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        )
    if name == "gemma3":
        return T.Gemma3ForCausalLM(
            T.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=4, query_pre_attn_scalar=16)
        )
    if name == "olmo2":
        return T.Olmo2ForCausalLM(T.Olmo2Config(**COMMON))
    raise KeyError(name)


def _randomize_norms(model):
    """Norm weights away from their init (ones, or zeros for Gemma's 1 + w) so that a norm applied
    with the wrong weight, the wrong offset or not at all changes the logits."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(0.5 + torch.rand_like(p))


def _forward_backward(model, ids, up):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits * up).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "gemma3", "olmo2"])
def test_fused_qk_norm_parity_and_unpatch(name):
    torch.manual_seed(0)
    model = _build(name).float().eval()
    model.config._attn_implementation = "eager"
    _randomize_norms(model)
    ids = torch.randint(3, V, (2, S))
    up = torch.randn(2, S, V)
    logits0, grads0 = _forward_backward(model, ids, up)

    spec = hf_qknorm.FAMILIES[name]
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    before = (getattr(module, spec.rope), getattr(module, spec.norm).forward, getattr(module, spec.attention).forward)
    calls = mock.MagicMock(wraps=ops.rotate_angles)
    with mock.patch.object(ops, "rotate_angles", calls):
        done = hf.patch(model, fuse_qk_norm=True)
        try:
            assert name in done and f"{spec.attention}.forward" in done[name]
            logits1, grads1 = _forward_backward(model, ids, up)
        finally:
            restored = hf.unpatch()
    assert name in restored
    after = (getattr(module, spec.rope), getattr(module, spec.norm).forward, getattr(module, spec.attention).forward)
    assert after == before, "unpatch must restore HF's function, norm forward and attention forward"
    fused = [c for c in calls.call_args_list if c.kwargs.get("q_norm_weight") is not None]
    assert len(fused) == LAYERS, f"{len(fused)} fused calls, expected one per layer"
    for c in fused:
        w = c.kwargs["q_norm_weight"]
        assert c.kwargs["norm_weight_offset"] == spec.offset
        assert w.shape[0] == (64 if name == "olmo2" else 16), "OLMo 2 normalizes across heads (H*D)"

    assert _rel(logits1, logits0) < 5e-6
    assert grads1.keys() == grads0.keys()
    norm_grads = [n for n in grads0 if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norm_grads) == 2 * LAYERS
    for n in grads0:
        assert _rel(grads1[n], grads0[n]) < 5e-5, f"grad {n}: {_rel(grads1[n], grads0[n]):.2e}"

    # the same model after unpatch is HF's again
    logits2, _ = _forward_backward(model, ids, up)
    assert torch.equal(logits2, logits0)


def test_patch_would_notice_a_skipped_norm():
    """Can the parity test fail? The fused call with the norm weights dropped changes the logits."""
    torch.manual_seed(0)
    model = _build("qwen3").float().eval()
    model.config._attn_implementation = "eager"
    _randomize_norms(model)
    ids = torch.randint(3, V, (2, S))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    real = ops.rotate_angles

    def no_weights(q, k, cos, sin, **kw):
        if kw.get("q_norm_weight") is not None:
            kw["q_norm_weight"] = torch.ones_like(kw["q_norm_weight"])
        return real(q, k, cos, sin, **kw)

    with (
        hf.patched(model, fuse_qk_norm=True),
        mock.patch.object(ops, "rotate_angles", no_weights),
        torch.no_grad(),
    ):
        wrong = model(input_ids=ids).logits
    assert _rel(wrong, ref) > 1e-3
    assert hf_qknorm.fused_families() == []


def test_unpatch_fuse_undoes_exactly_what_the_fuse_patch_did():
    """patch(fuse_qk_norm=True) alone, then unpatch(fuse_qk_norm=True): everything is HF's again.
    A plain patch before it asked for the rotary function: then that one stays ropekit's."""
    torch.manual_seed(0)
    model = _build("olmo2").float().eval()
    module = importlib.import_module("transformers.models.olmo2.modeling_olmo2")
    hf_function = module.apply_rotary_pos_emb
    try:
        hf.patch(model, fuse_qk_norm=True)
        assert hf.unpatch(fuse_qk_norm=True) == {
            "olmo2": ["Olmo2RMSNorm.forward", "Olmo2Attention.forward", "apply_rotary_pos_emb"]
        }
        assert hf_qknorm.fused_families() == [] and module.apply_rotary_pos_emb is hf_function
        for first, second in ((False, True), (True, False)):  # either order of the two calls
            hf.patch(model, fuse_qk_norm=first)
            hf.patch(model, fuse_qk_norm=second)
            assert hf.unpatch(fuse_qk_norm=True) == {"olmo2": ["Olmo2RMSNorm.forward", "Olmo2Attention.forward"]}
            assert hf_qknorm.fused_families() == []
            assert module.apply_rotary_pos_emb.ropekit_original is hf_function
            assert hf.unpatch() == {"olmo2": ["apply_rotary_pos_emb"]}
            assert module.apply_rotary_pos_emb is hf_function
    finally:
        hf.unpatch()
    assert module.apply_rotary_pos_emb is hf_function


def test_patch_and_unpatch_report_each_name_once_and_truthfully():
    """patch lists the rotary function once (the fusion swaps it a second time); patching twice
    changes nothing; the full unpatch lists each name once."""
    model = _build("olmo2").float().eval()
    module = importlib.import_module("transformers.models.olmo2.modeling_olmo2")
    hf_function = module.apply_rotary_pos_emb
    done = hf.patch(model, fuse_qk_norm=True)
    try:
        assert done == {"olmo2": ["apply_rotary_pos_emb", "Olmo2RMSNorm.forward", "Olmo2Attention.forward"]}
        assert done.forms == {"olmo2": {"apply_rotary_pos_emb": "olmo"}}
        fused = module.apply_rotary_pos_emb
        assert hf.patch(model, fuse_qk_norm=True) == done
        assert module.apply_rotary_pos_emb is not hf_function and hf_qknorm.fused_families() == ["olmo2"]
        assert fused.__name__ == "apply_rotary_pos_emb"
    finally:
        restored = hf.unpatch()
    assert restored == {"olmo2": ["Olmo2RMSNorm.forward", "Olmo2Attention.forward", "apply_rotary_pos_emb"]}
    assert module.apply_rotary_pos_emb is hf_function


def test_fuse_qk_norm_on_a_family_without_qk_norm():
    """Llama has no q/k norm: fuse_qk_norm=True for it alone raises (nothing patched); next to a
    family that has one, it warns and patches both (the fusion only where it applies)."""
    module = importlib.import_module("transformers.models.llama.modeling_llama")
    hf_function = module.apply_rotary_pos_emb
    config = transformers.LlamaConfig(**COMMON)
    for kwargs in ({"families": ["llama"]}, {"model": transformers.LlamaForCausalLM(config)}):
        with pytest.raises(ValueError, match=r"ropekit.hf.patch: fuse_qk_norm: expected families with q/k RMSNorm"):
            hf.patch(fuse_qk_norm=True, **kwargs)
        assert module.apply_rotary_pos_emb is hf_function, "nothing may be patched when it raises"
    try:
        with pytest.warns(UserWarning, match=r"\['llama'\] have no q/k RMSNorm"):
            done = hf.patch(families=["llama", "qwen3"], fuse_qk_norm=True)
        assert done["llama"] == ["apply_rotary_pos_emb"] and "Qwen3Attention.forward" in done["qwen3"]
    finally:
        hf.unpatch()
    assert module.apply_rotary_pos_emb is hf_function


# families fused from what the model shows (hf_qknorm_detect), beyond the rows of hf_qknorm.FAMILIES
DETECTED = {"exaone4": ("Exaone4Config", "Exaone4ForCausalLM"), "olmo3": ("Olmo3Config", "Olmo3ForCausalLM")}


@pytest.mark.parametrize("family", sorted(DETECTED))
def test_detected_family_fuses_and_matches(family):
    assert family not in hf_qknorm.FAMILIES
    torch.manual_seed(0)
    config_cls, model_cls = DETECTED[family]
    config = getattr(transformers, config_cls)(**dict(COMMON, head_dim=8))
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).float()
    for name, p in model.named_parameters():
        if "norm" in name:  # norm weights away from their init, so a skipped norm would show
            p.data.normal_(1.0, 0.5)
    ids = torch.randint(3, COMMON["vocab_size"], (2, 6))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids).logits
        (out**2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = run()
    try:
        report = hf.patch(model, fuse_qk_norm=True)
        assert report.unfused == {}
        assert any(n.endswith("Attention.forward") for n in report[family])
        with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
            got, got_grads = run()
        fused = [c for c in spy.call_args_list if c.kwargs.get("q_norm_weight") is not None]
        assert len(fused) == COMMON["num_hidden_layers"]
    finally:
        hf.unpatch()
    assert _rel(got, want) <= 1e-5
    for name, g in want_grads.items():
        assert _rel(got_grads[name], g) <= 1e-5, name


def _llama4(use_qk_norm=True):
    """A tiny Llama 4 text model: two rope layers with qk_norm (or none), MoE of 2 experts."""
    T = transformers
    config = T.Llama4TextConfig(
        **dict(COMMON, intermediate_size=96),
        intermediate_size_mlp=96,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        use_qk_norm=use_qk_norm,
        no_rope_layers=[1] * LAYERS,
        attention_chunk_size=64,
    )
    config._attn_implementation = "eager"
    return T.Llama4ForCausalLM(config).float().eval()


def test_llama4_l2_norm_fused_after_the_rotation():
    """Llama 4 normalizes q and k with one weightless qk_norm AFTER its rotation: the fused rope call
    (l2_norm=True, the module's eps) replaces both, logits and every gradient as HF's, the norm's
    forward is never run on q / k, and unpatch restores HF's objects. Can it fail? The same model
    with the fused call's norm dropped differs (checked last)."""
    torch.manual_seed(0)
    model = _llama4()
    ids = torch.randint(3, V, (2, S))
    up = torch.randn(2, S, V)
    logits0, grads0 = _forward_backward(model, ids, up)
    module = importlib.import_module("transformers.models.llama4.modeling_llama4")
    spec = hf_qknorm.FAMILIES["llama4"]
    norm_cls = getattr(module, spec.norm)
    hf_norm_forward, runs = norm_cls.forward, []

    def counted(self, x, *args, **kwargs):  # HF's norm, counted: the fused calls skip it
        runs.append(x.shape)
        return hf_norm_forward(self, x, *args, **kwargs)

    calls = mock.MagicMock(wraps=ops.rotate_angles)
    with mock.patch.object(norm_cls, "forward", counted), mock.patch.object(ops, "rotate_angles", calls):
        before = (module.apply_rotary_emb, norm_cls.forward, module.Llama4TextAttention.forward)
        done = hf.patch(model, fuse_qk_norm=True)
        try:
            assert "Llama4TextAttention.forward" in done["llama4"] and "apply_rotary_emb" in done["llama4"]
            logits1, grads1 = _forward_backward(model, ids, up)
            fused = [c for c in calls.call_args_list if c.kwargs.get("l2_norm")]
            assert len(fused) == LAYERS, f"{len(fused)} fused calls, expected one per layer"
            assert all(c.kwargs["norm_eps"] == model.config.rms_norm_eps for c in fused)
        finally:
            restored = hf.unpatch()
        after = (module.apply_rotary_emb, norm_cls.forward, module.Llama4TextAttention.forward)
    assert "llama4" in restored and after == before
    assert runs == [], f"HF's qk_norm ran {len(runs)} times under the fusion"
    assert _rel(logits1, logits0) < 5e-6
    assert grads1.keys() == grads0.keys()
    for n in grads0:
        assert _rel(grads1[n], grads0[n]) < 5e-5, f"grad {n}: {_rel(grads1[n], grads0[n]):.2e}"
    # the check can fail: the rope call without its norm (and HF's norm skipped) changes the logits
    real = ops.rotate_angles

    def no_norm(q, k, cos, sin, **kw):
        kw.pop("l2_norm", None)
        return real(q, k, cos, sin, **kw)

    with hf.patched(model, fuse_qk_norm=True), mock.patch.object(ops, "rotate_angles", no_norm), torch.no_grad():
        wrong = model(input_ids=ids).logits
    assert _rel(wrong, logits0) > 1e-3


def test_llama4_without_qk_norm_is_left_to_hf():
    """use_qk_norm=False (the 128-expert model): nothing deferred, HF's math, same logits."""
    torch.manual_seed(0)
    model = _llama4(use_qk_norm=False)
    ids = torch.randint(3, V, (2, S))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        calls = mock.MagicMock(wraps=ops.rotate_angles)
        with mock.patch.object(ops, "rotate_angles", calls), hf.patched(families=["llama4"], fuse_qk_norm=True):
            got = model(input_ids=ids).logits
    assert not [c for c in calls.call_args_list if c.kwargs.get("l2_norm")]
    assert _rel(got, ref) < 5e-6
