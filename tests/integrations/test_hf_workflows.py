"""Patched tiny transformers models through what a user does with a model besides calling it:
greedy generation with a KV cache, training with gradient checkpointing, save_pretrained /
from_pretrained (with a device_map when accelerate is installed) and torch.export with a dynamic
sequence length. Each against the same weights unpatched, with a spy showing ropekit's op ran.
Llama (the rotation alone) and Qwen3 (q/k RMSNorm fused into the rotation)."""

import copy
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropekit import hf  # noqa: E402
from ropekit.api import ops  # noqa: E402

from helpers.hf_models import TINY_LM  # noqa: E402

# family -> (config class, model class, fuse_qk_norm)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", False),
    "qwen3-fused": ("Qwen3Config", "Qwen3ForCausalLM", True),
}


pytestmark = pytest.mark.usefixtures("hf_unpatched")  # transformers unpatched around every test


@pytest.fixture
def kernel_calls():
    """The calls that reach ropekit's rotation op, with their keywords."""
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        yield spy


def _pair(name, device, **overrides):
    """(unpatched, patched) models with the same random weights, and the patch's report."""
    config_cls, model_cls, fuse = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY_LM, "head_dim": 8, **overrides})
    config._attn_implementation = "eager"
    plain = getattr(transformers, model_cls)(config).float().eval().to(device)
    patched = copy.deepcopy(plain)
    report = hf.patch(patched, fuse_qk_norm=fuse)
    return plain, patched, report


def _rel(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def _fused_calls(spy) -> int:
    return sum(1 for c in spy.call_args_list if c.kwargs.get("q_norm_weight") is not None)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_generation_with_kv_cache(name, device, kernel_calls):
    plain, patched, _ = _pair(name, device)
    ids = torch.randint(3, 64, (2, 5), device=device)
    kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    hf.unpatch()  # the functions are module globals: the unpatched run needs them restored
    want = plain.generate(ids, **kw)
    hf.patch(patched, fuse_qk_norm=MODELS[name][2])
    kernel_calls.reset_mock()  # the patch's first classification in a process runs ropekit's forms too
    got = patched.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 6
    for step, (g, w) in enumerate(zip(got.scores, want.scores)):
        assert _rel(g, w) <= 1e-5, f"step {step}"
    # the prefill and every decode step, each layer (2): the kernel ran where HF's code did
    assert kernel_calls.call_count >= 2 * 6
    if MODELS[name][2]:
        assert _fused_calls(kernel_calls) == kernel_calls.call_count


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradient_checkpointing_matches_unpatched(name, device, kernel_calls):
    plain, patched, _ = _pair(name, device)
    ids = torch.randint(3, 64, (2, 7), device=device)

    def loss_and_grads(model):
        model.train()
        # transformers 5 renamed gradient checkpointing to activation checkpointing
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    hf.unpatch()
    want_loss, want = loss_and_grads(plain)
    hf.patch(patched, fuse_qk_norm=MODELS[name][2])
    kernel_calls.reset_mock()
    got_loss, got = loss_and_grads(patched)
    assert getattr(patched, "is_activation_checkpointing", None) or patched.is_gradient_checkpointing
    assert _rel(got_loss, want_loss) <= 1e-6
    assert got.keys() == want.keys()
    for n in want:
        assert got[n] is not None, n
        assert _rel(got[n], want[n]) <= 1e-5, n
    # each layer's forward, then its recomputation in the backward (2 layers)
    assert kernel_calls.call_count == 4


@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_pretrained_and_from_pretrained(name, tmp_path, kernel_calls):
    plain, patched, _ = _pair(name, "cpu")
    # the patch adds, renames and changes no parameter or buffer
    assert patched.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(patched.state_dict()[key], value), key
    patched.save_pretrained(tmp_path)
    options = [{}]
    try:
        import accelerate  # noqa: F401

        options.append({"device_map": "cpu"})
    except ImportError:
        pass
    ids = torch.randint(3, 64, (2, 6))
    with torch.no_grad():
        want = patched(input_ids=ids).logits
    for extra in options:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", **extra)
        assert type(loaded) is type(patched)
        kernel_calls.reset_mock()
        with torch.no_grad():
            got = loaded.eval()(input_ids=ids).logits
        # the functions are patched in the modeling module, so a model loaded later uses them too
        assert kernel_calls.call_count == 2, extra
        assert _rel(got, want) <= 1e-6, extra


@pytest.mark.parametrize("name", sorted(MODELS))
def test_torch_export_with_a_dynamic_sequence_length(name, device):
    # as many k / v heads as q heads: with torch 2.11 on CUDA, transformers' repeat_kv (GQA) fails
    # this export unpatched too (a guard Min(8*s, 16*s) == 8*s on the sequence length)
    plain, patched, _ = _pair(name, device, num_key_value_heads=TINY_LM["num_attention_heads"])

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    seq = torch.export.Dim("seq", min=2, max=32)
    ids = torch.randint(3, 64, (2, 5), device=device)
    exported = torch.export.export(Logits(patched), (ids,), dynamic_shapes={"ids": {1: seq}})
    assert "torch.ops.ropekit.rotate" in str(exported.graph)  # the custom op, not a trace of its insides
    run = exported.module()
    for length in (3, 5, 9):
        x = torch.randint(3, 64, (2, length), device=device)
        with torch.no_grad():
            got = run(x)
            hf.unpatch()
            want = plain(input_ids=x, use_cache=False).logits
            hf.patch(patched, fuse_qk_norm=MODELS[name][2])
        assert got.shape == want.shape
        assert _rel(got, want) <= 1e-5, f"length {length}"
