"""Every modeling module of the installed transformers with a rotary function is either patched or
left with a reason (ropekit.hf.patch()), unpatch restores every one, and for each form (body class)
a tiny random-weight model of one family gives the unpatched model's logits and gradients.

The forms are decided at patch time by running HF's functions (ropekit.integrations.hf_census);
here the models check that decision end to end: float32, relative L2 within 1e-5, and the kernel
path actually taken (a spy on ops.rotate_angles counts the calls).
"""

import copy
import importlib
import inspect
import pathlib
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropekit import hf  # noqa: E402
from ropekit.api import ops  # noqa: E402
from ropekit.integrations import hf_forms  # noqa: E402

from conftest import DEVICES  # noqa: E402
from helpers.hf_models import TINY_LM, TINY_MLA  # noqa: E402

pytestmark = pytest.mark.usefixtures("hf_unpatched")  # transformers unpatched around every test
ROOT = pathlib.Path(__file__).resolve().parents[2]


# module-level functions that take a table but rotate nothing (they reshape or stack it for a
# rotary function), read in their sources; the enumeration below would count them otherwise
NOT_ROTATING = {
    "reshape_for_broadcast": "reshapes freqs_ci to broadcast against the query (Llama 4)",
    "stack_freqs": "stacks cos and sin into one table (PE audio / video)",
}
# globals whose use marks a rotation
_ROTATION_GLOBALS = {"rotate_half", "rotate_every_two", "view_as_complex", "polar"}


def _enumerate_rotary_functions():
    """{(module, attribute): binding} for every module-level function of every `modeling_*` module
    of the installed transformers (imported, not scanned as text) that rotates: it takes cos and
    sin or freqs_cis / freqs_ci / freqs, or reads rotate_half, rotate_every_two, view_as_complex or
    polar. A kernels hub Func module counts as the function it wraps (its forward's free
    variable). Independent of hf_census.scan, so a binding the scan misses fails the test.
    Also returns the modules that failed to import, {module: error}."""
    found, failed = {}, {}
    root = pathlib.Path(transformers.models.__file__).parent
    for path in sorted(root.glob("*/modeling_*.py")):
        name = f"transformers.models.{path.parent.name}.{path.stem}"
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  an optional dependency of that model is missing
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        for attr, bound in vars(module).items():
            fn = bound
            if isinstance(bound, torch.nn.Module):
                cells = getattr(type(bound).forward, "__closure__", None) or ()
                fns = [c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)]
                fn = fns[0] if len(fns) == 1 else bound
            if not inspect.isfunction(fn) or fn.__module__ != name or attr in NOT_ROTATING:
                continue
            params = set(inspect.signature(fn).parameters)
            reads = set(fn.__code__.co_names)
            for const in fn.__code__.co_consts:
                reads |= set(getattr(const, "co_names", ()))
            if {"cos", "sin"} <= params or params & {"freqs_cis", "freqs_ci", "freqs"} or reads & _ROTATION_GLOBALS:
                found[(name, attr)] = bound
    return found, failed


def test_every_rotary_function_is_patched_or_left_with_a_reason():
    """Every rotary function found by importing the modeling modules is, after hf.patch(), either
    replaced (the module attribute is ropekit's, wrapping what was bound) or left with a reason;
    at least 95% of them are replaced; patching again changes nothing; unpatch restores them."""
    found, failed = _enumerate_rotary_functions()
    assert len(found) > 200, "the enumeration found too few rotary functions"
    report = hf.patch()
    replaced = 0
    for (module_name, name), before in found.items():
        family = module_name.split(".")[2]
        label = name if module_name.endswith(f"modeling_{family}") else f"{module_name.split('.')[-1]}.{name}"
        patched = label in report.get(family, [])
        reason = report.left.get(family, {}).get(label)
        assert patched != (reason is not None), f"{module_name}.{name}: patched={patched}, reason={reason!r}"
        now = getattr(importlib.import_module(module_name), name)
        if patched:
            replaced += 1
            assert now.ropekit_original is before
            assert report.forms[family][label] in hf_forms.FORM
        else:
            assert reason and now is before
    for module_name, error in failed.items():  # a module that cannot be imported is reported, if it rotates
        family = module_name.split(".")[2]
        assert all(r.startswith("import failed") for r in report.left.get(family, {}).values()), error
    assert replaced / len(found) >= 0.95, f"{replaced} of {len(found)} rotary functions replaced"
    # patching again changes nothing; unpatch restores every function
    current = {key: getattr(importlib.import_module(key[0]), key[1]) for key in found}
    assert hf.patch() == report
    assert all(getattr(importlib.import_module(k[0]), k[1]) is v for k, v in current.items())
    hf.unpatch()
    assert all(getattr(importlib.import_module(k[0]), k[1]) is v for k, v in found.items())


COMMON = dict(TINY_LM, initializer_range=0.3)
# form (and what else the family differs in) -> (family, config class, model class, config keywords
# beyond COMMON); one family per form
MODELS = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {}),
    "neox": ("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}),
    "olmo": ("olmo", "OlmoConfig", "OlmoForCausalLM", {}),
    "olmo, float32 math (encoder)": (
        "modernbert",
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        {"global_attn_every_n_layers": 1},
    ),
    "glm": ("glm", "GlmConfig", "GlmForCausalLM", {"head_dim": 16, "partial_rotary_factor": 0.5}),
    "pairs": ("helium", "HeliumConfig", "HeliumForCausalLM", {"head_dim": 8}),
    "ernie": ("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 8}),
    "cohere": ("cohere", "CohereConfig", "CohereForCausalLM", {}),
    "narrow": (
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        {"head_dim": 8, "num_local_experts": 2, "num_experts_per_tok": 1, "experts_implementation": "eager"},
    ),
    "deepseek": (
        "deepseek_v3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(TINY_MLA, n_group=1, topk_group=1, rope_interleave=True),
    ),
    "gptj": ("gptj", "GPTJConfig", "GPTJForCausalLM", {"rotary_dim": 4, "n_inner": 64}),
    "gptj, whole head (CodeGen)": ("codegen", "CodeGenConfig", "CodeGenForCausalLM", {"rotary_dim": 8, "n_inner": 64}),
    "nanochat": ("nanochat", "NanoChatConfig", "NanoChatForCausalLM", {}),
    "deepseek_v2": (
        "deepseek_v2",
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        TINY_MLA,
    ),
    "narrow_pairs": (
        "openai_privacy_filter",
        "OpenAIPrivacyFilterConfig",
        "OpenAIPrivacyFilterForTokenClassification",
        {"head_dim": 8, "num_local_experts": 2, "num_experts_per_tok": 1, "experts_implementation": "eager"},
    ),
}


def _build(form):
    family, config_cls, model_cls, extra = MODELS[form]
    config = getattr(transformers, config_cls)(**dict(COMMON, **extra))
    config._attn_implementation = "eager"
    return family, getattr(transformers, model_cls)(config).float()


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids).logits
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("form", sorted(MODELS))
def test_tiny_model_of_each_form_matches_unpatched(form, device):
    torch.manual_seed(0)
    family, model = _build(form)
    model = model.to(device)
    ids = torch.randint(3, 64, (2, 7), device=device)
    want_logits, want_grads = _run(model, ids)
    patched_model = copy.deepcopy(model)
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        report = hf.patch(patched_model)
        assert form.split(",")[0] in report.forms[family].values(), report.forms
        got_logits, got_grads = _run(patched_model, ids)
    assert spy.call_count > 0, "the kernel path was never taken"
    assert _rel(got_logits, want_logits) <= 1e-5
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert _rel(got_grads[name], g) <= 1e-5 or (g.abs().max() < 1e-12 and got_grads[name].abs().max() < 1e-12), name


def _ci_pins(name: str):
    """The releases of `name` that CI's environments pin (.ci/newest.txt, .ci/oldest.txt)."""
    pins = set()
    for path in (ROOT / ".ci").glob("*.txt"):
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith(f"{name}=="):
                pins.add(line.split("==", 1)[1])
    return pins


def test_docs_table_is_current():
    """docs/hf.md's table for the installed transformers is what `python -m ropekit.tools.hf_table
    --write` gives now. The releases CI tests must each have one; another release is skipped."""
    from ropekit.tools import hf_table

    version = transformers.__version__
    section = hf_table.section(hf_table.DOC.read_text(encoding="utf-8"), version)
    if section is None:
        assert version not in _ci_pins("transformers"), (
            f"docs/hf.md has no table for transformers {version}, a release CI tests: run "
            "python -m ropekit.tools.hf_table --write"
        )
        pytest.skip(f"docs/hf.md has no table for transformers {version} (CI tests {sorted(_ci_pins('transformers'))})")
    assert section == hf_table.render(), "docs/hf.md is stale: run python -m ropekit.tools.hf_table --write"


def test_a_left_function_that_calls_a_replaced_one_says_so():
    """Gemma 4's apply_multidimensional_rope is left (its signature is no form's), but it calls
    apply_rotary_pos_emb, which ropekit replaces, on each part of the head: the report says its
    rotations run ropekit's kernel, and they do (one call a part, HF's result)."""
    gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    report = hf.patch(families=["gemma4"])
    reason = report.left["gemma4"]["apply_multidimensional_rope"]
    assert "it calls apply_rotary_pos_emb, which ropekit replaces" in reason
    # a function left that calls no replaced one keeps its plain reason
    assert all("ropekit replaces" not in r for f, left in report.left.items() if f != "gemma4" for r in left.values())
    g = torch.Generator().manual_seed(0)
    b, s, h, d, parts = 2, 5, 3, 16, 2
    x = torch.randn(b, s, h, d, generator=g)
    angles = torch.randn(b, s, parts, d // (2 * parts), generator=g, dtype=torch.float64)
    cos = torch.cat([torch.cat((angles[:, :, i].cos(),) * 2, -1) for i in range(parts)], -1).float()
    sin = torch.cat([torch.cat((angles[:, :, i].sin(),) * 2, -1) for i in range(parts)], -1).float()
    position_ids = torch.zeros(b, s, parts, dtype=torch.long)
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        got = gemma4.apply_multidimensional_rope(x, cos, sin, position_ids)
    assert spy.call_count == parts
    hf.unpatch()
    want = gemma4.apply_multidimensional_rope(x.double(), cos.double(), sin.double(), position_ids)
    assert ((got.double() - want).norm() / want.norm()).item() <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_vision_form_in_a_tiny_vision_tower(device):
    """The vision form (tokens (S, H, D), float32 math, outputs in the inputs' dtypes): Qwen2-VL's
    vision transformer, patched vs unpatched, outputs and every parameter gradient."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    config = transformers.Qwen2VLVisionConfig(
        depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=2, spatial_merge_size=2, temporal_patch_size=1
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    tower = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(config).float().to(device)
    grid = torch.tensor([[1, 4, 4]], device=device)
    pixels = torch.randn(16, 3 * 2 * 2, device=device)

    forward = lambda m, dtype: m(pixels.to(dtype), grid_thw=grid)  # noqa: E731
    _check_tower(tower, forward, ("qwen2_vl", "apply_rotary_pos_emb_vision", "vision"), config.depth)


@pytest.mark.parametrize("device", DEVICES)
def test_complex_flat_form_in_a_tiny_llama4_vision_model(device):
    """Llama 4's vision rotation (complex freqs_ci (S, 1, D/2), (B, S, H, D) q / k, the class token
    at angle 0): its vision model, patched vs unpatched, outputs and every parameter gradient."""
    from transformers.models.llama4 import modeling_llama4

    config = transformers.Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=16,
        patch_size=4,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
        pixel_shuffle_ratio=0.5,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = modeling_llama4.Llama4VisionModel(config).float().to(device)
    pixels = torch.randn(2, 3, 16, 16, device=device)
    forward = lambda m, dtype: m(pixel_values=pixels.to(dtype)).last_hidden_state  # noqa: E731
    _check_tower(model, forward, ("llama4", "vision_apply_rotary_emb", "llama4_vision"), config.num_hidden_layers)


@pytest.mark.parametrize("device", DEVICES)
def test_pairs_2d_form_in_a_tiny_sam2_video_memory_attention(device):
    """SAM 2 video's memory attention: self-attention over a 4 x 4 grid and cross-attention to a
    memory of three frames (the table tiled) and 4 object-pointer tokens (passed unrotated), patched
    vs unpatched, outputs and every parameter gradient. Self-attention rotates q and k in one launch,
    cross-attention in two (q, then the longer k)."""
    from transformers.models.sam2_video import modeling_sam2_video

    config = transformers.Sam2VideoConfig(
        memory_attention_hidden_size=32,
        memory_attention_num_layers=2,
        memory_attention_feed_forward_hidden_size=64,
        memory_attention_rope_feat_sizes=[4, 4],
        memory_attention_num_attention_heads=2,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = modeling_sam2_video.Sam2VideoMemoryAttention(config).float().eval().to(device)
    width = model.layers[0].cross_attn_image.k_proj.in_features
    tokens, batch, pointers = 16, 2, 4
    current, current_pe = (torch.randn(tokens, batch, 32, device=device) for _ in range(2))
    memory, memory_pe = (torch.randn(3 * tokens + pointers, batch, width, device=device) for _ in range(2))

    def forward(m, dtype):
        return m(
            current.to(dtype),
            memory.to(dtype),
            current_pe.to(dtype),
            memory_pe.to(dtype),
            num_object_pointer_tokens=pointers,
        )

    launches = (1 + 2) * config.memory_attention_num_layers
    _check_tower(model, forward, ("sam2_video", "apply_rotary_pos_emb_2d", "pairs_2d"), launches)


def _check_tower(model, forward, patched_as, launches):
    """The model's output (forward(model, dtype)) and parameter gradients, patched, equal HF's
    (unpatched, float32) within 1e-5 relative, or, where float32 itself is that far off (a
    gradient summed with cancellation, cuDNN's convolution backward), no further from a float64
    run of the unpatched model than twice HF's own float32 error; the function patched_as =
    (family, name, form) replaced by that form and launched `launches` times."""

    def run(m, dtype):
        m.zero_grad(set_to_none=True)
        out = forward(m, dtype)
        out = out if isinstance(out, torch.Tensor) else out.pooler_output
        (out.double() ** 2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    exact, exact_grads = run(copy.deepcopy(model).double(), torch.float64)  # HF's function: float64 is not the kernel's
    want, want_grads = run(model, torch.float32)
    report = hf.patch(model)
    family, name, form = patched_as
    assert report.forms[family][name] == form
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        got, got_grads = run(model, torch.float32)
    assert spy.call_count == launches
    assert _rel(got, want) <= 1e-5
    for name, g in want_grads.items():
        err = _rel(got_grads[name], g)
        assert err <= 1e-5 or _rel(got_grads[name], exact_grads[name]) <= 2 * _rel(g, exact_grads[name]), (name, err)


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_form_in_a_tiny_dinov3(device):
    """The prefix form (class and register tokens passed through, patch tokens rotated): a tiny
    DINOv3 ViT, patched vs unpatched, outputs and every parameter gradient."""
    config = transformers.DINOv3ViTConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        patch_size=4,
        image_size=16,
        num_register_tokens=2,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DINOv3ViTModel(config).float().eval().to(device)  # training mode jitters the patches
    pixels = torch.randn(2, 3, 16, 16, device=device)
    forward = lambda m, dtype: m(pixel_values=pixels.to(dtype)).last_hidden_state  # noqa: E731
    _check_tower(model, forward, ("dinov3_vit", "apply_rotary_pos_emb", "prefix"), config.num_hidden_layers)
