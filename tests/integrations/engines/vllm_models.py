"""Tiny random-weight models through real vLLM, with the ropekit plugin selected and excluded.

    python tests/integrations/engines/vllm_models.py [--out summary.json] [model ...]

Builds each model with transformers (save_pretrained into a temporary folder; WRITTEN: the
checkpoint written here, in the layout vLLM reads and transformers does not build), then runs two child
processes of this script: one with VLLM_PLUGINS=ropekit (the plugin asked for), one with ropekit
installed and not asked (VLLM_PLUGINS and ROPEKIT_VLLM unset: vLLM loads the plugin, which must
change nothing). Each generates greedy tokens for the same prompt. The check: identical tokens, log
probabilities equal to 1e-4, and, from the plugin run, the trace file written inside vLLM's engine
process (ropekit.vllm.TRACE_ENV) naming the ropekit classes (or, through vLLM's Transformers
backend, the patched Hugging Face functions) constructed and called; for Transformers-backend
models, Hugging Face's own rotation helper is counted in the engine's process: never called with
the plugin on, called without it. Exit status 0 when every model passes; the JSON summary says per
model what ran, what was skipped and why.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile

PROMPT = [3, 17, 42, 99, 7, 64, 128, 5, 200, 31, 77, 150]
MAX_TOKENS = 8
MAX_MODEL_LEN = 256
VOCAB = 256
# small enough for a 2-core CPU; head_dim 64 (vLLM's CPU attention needs >= 32)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=MAX_MODEL_LEN,
    tie_word_embeddings=False,
    initializer_range=0.2,  # logits far apart, so greedy tokens are not decided by rounding
)

# name -> (transformers config class, its extra arguments, the vLLM rotary classes the plugin must
# construct and call; empty when the model does not reach vLLM's rotary layers)
MODELS = {
    "llama": (
        "LlamaConfig",
        dict(
            head_dim=64,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        ["Llama3RotaryEmbedding"],
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=64), ["RotaryEmbedding"]),  # q/k RMSNorm before RoPE
    "phi3": (
        "Phi3Config",
        dict(
            pad_token_id=0,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(32)],
                "long_factor": [1.0 + 0.5 * i for i in range(32)],
                "original_max_position_embeddings": 64,
            },
            original_max_position_embeddings=64,
        ),
        ["Phi3LongRoPEScaledRotaryEmbedding"],
    ),
    "stablelm": (  # partial rotary through vLLM's own model code
        "StableLmConfig",
        dict(partial_rotary_factor=0.25),
        ["RotaryEmbedding"],
    ),
    "gpt_neox": (  # partial rotary, through vLLM's Transformers backend: HF's modeling code, patched
        "GPTNeoXConfig",
        dict(rotary_pct=0.25, use_parallel_residual=True),
        ["hf:modeling_gpt_neox.apply_rotary_pos_emb"],
    ),
    "deepseek_v2": (  # MLA (kv_lora_rank 512 + rope 64: the CPU MLA backend's only head size), YaRN
        "DeepseekV2Config",
        dict(
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            num_key_value_heads=2,
            first_k_dense_replace=2,  # every layer dense: no MoE
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        ),
        ["DeepseekScalingRotaryEmbedding"],
    ),
    "llama_yarn": (
        "LlamaConfig",
        dict(
            head_dim=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        ["YaRNScalingRotaryEmbedding"],
    ),
    "llama_dynamic": (
        "LlamaConfig",
        dict(head_dim=64, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}),
        ["DynamicNTKScalingRotaryEmbedding"],
    ),
    "llama_linear": (
        "LlamaConfig",
        dict(head_dim=64, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        ["LinearScalingRotaryEmbedding"],
    ),
    "llama_ntk": ("LlamaConfig", dict(head_dim=64), ["NTKScalingRotaryEmbedding"]),
    "llama_ntk_alpha": ("LlamaConfig", dict(head_dim=64), ["DynamicNTKAlphaRotaryEmbedding"]),
    "llama_fope": ("LlamaConfig", dict(head_dim=64), ["FourierRotaryEmbedding"]),
    "gemma4": (  # sliding layers: the plain table; the full-attention layer: proportional RoPE
        "Gemma4TextConfig",
        dict(
            head_dim=64,
            global_head_dim=64,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=64,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=VOCAB,
        ),
        ["RotaryEmbedding", "Gemma4RotaryEmbedding"],
    ),
    "ernie45_vl": (None, {}, ["Ernie4_5_VLRotaryEmbedding"]),  # written by write_ernie45_vl (below)
    "paddleocr_vl": (  # M-RoPE (3, T) positions on a text-only prompt; the vision tower is not built
        "PaddleOCRVLConfig",
        dict(
            head_dim=64,
            pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
        ),
        ["MRotaryEmbedding"],
    ),
}

# name -> rope parameters written into the saved config.json over transformers' own: rope types
# that vLLM builds and transformers' modeling code has no rotary for (NTK by a factor or by alpha;
# FoPE's coefficients, which vLLM's get_rope takes from the rope parameters of any model that passes
# them through, Llama's included)
ROPE_AFTER_SAVE = {
    "llama_ntk": {"rope_type": "ntk", "rope_theta": 10000.0, "factor": 4.0},
    # transformers' config check wants a factor for "dynamic"; vLLM takes alpha when it is there
    "llama_ntk_alpha": {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 4.0, "factor": 1.0},
    "llama_fope": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "use_fope": True,
        "num_key_value_heads": 1,
        "num_inv_freq": 16,
        "fope_sep_head": True,
        "fope_init_factor": 0.1,
    },
}
# FoPE's coefficients (KV heads, frequencies, frequencies) per layer: vLLM loads them from the
# checkpoint into the rotary module; near the identity, so the table stays a rotation-like mix
FOPE_COEFFICIENTS = {"llama_fope": (1, 16)}

# Models written here rather than by transformers: vLLM 0.32 reads ERNIE 4.5-VL in Baidu's own
# checkpoint layout (a flat config of lists, `model.` weights), which transformers' ernie4_5_vl_moe
# classes neither build nor load; the config class is a local file of the model folder
# (trust_remote_code, nothing downloaded). Dense layers only (no MoE), the vision tower not built.
ERNIE_VL_CONFIG_CODE = """from transformers import PretrainedConfig


class VisionConfig(PretrainedConfig):
    model_type = "ernie4_5_moe_vl_vision"


class ErnieVLConfig(PretrainedConfig):
    model_type = "ernie4_5_moe_vl"

    def __init__(self, vision_config=None, **kwargs):
        self.vision_config = VisionConfig(**(vision_config or {}))
        super().__init__(**kwargs)
"""


def write_ernie45_vl(path: str) -> None:
    """ERNIE 4.5-VL: M-RoPE over (t, h, w) positions, freq_allocation 8 of the 32 frequency pairs to
    t and 12 each to h and w (vLLM's Ernie4_5_VLRotaryEmbedding), in Baidu's checkpoint layout."""
    import torch
    from safetensors.torch import save_file

    layers, hidden, inter, heads, kv_heads = (
        COMMON[k]
        for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    )
    head_dim = hidden // heads
    config = {
        "architectures": ["Ernie4_5_VLMoeForConditionalGeneration"],
        "model_type": "ernie4_5_moe_vl",
        "auto_map": {"AutoConfig": "configuration_ernie_vl.ErnieVLConfig"},
        **{k: v for k, v in COMMON.items() if k != "initializer_range"},
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        # mrope_section: what makes vLLM feed (3, T) positions; the attention takes its sections from
        # freq_allocation ((h, w, t) = (12, 12, 8))
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 12, 8]},
        "freq_allocation": 8,
        "use_moe": False,  # every layer dense; the lists are the shapes vLLM's code takes
        "moe_num_experts": [0, 0],
        "moe_layer_start_index": [0, 0],
        "moe_layer_end_index": [layers - 1, layers - 1],
        "moe_intermediate_size": [64, 64],
        "moe_k": 1,
        "im_patch_id": 252,
        "image_start_token_id": 250,
        "image_end_token_id": 251,
        "video_start_token_id": 253,
        "video_end_token_id": 254,
        "pixel_hidden_size": 32,
        "spatial_conv_size": 2,
        "temporal_conv_size": 2,
        "use_temporal_conv": True,
        "vision_config": dict(
            depth=1,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            in_channels=3,
            hidden_act="quick_gelu",
        ),
        "dtype": "float32",
    }
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "configuration_ernie_vl.py"), "w") as f:
        f.write(ERNIE_VL_CONFIG_CODE)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, hidden),
        "lm_head.weight": (VOCAB, hidden),
        "model.norm.weight": None,
    }
    for i in range(layers):
        at, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        shapes.update(
            {
                at + "q_proj.weight": (heads * head_dim, hidden),
                at + "k_proj.weight": (kv_heads * head_dim, hidden),
                at + "v_proj.weight": (kv_heads * head_dim, hidden),
                at + "o_proj.weight": (hidden, heads * head_dim),
                mlp + "gate_proj.weight": (inter, hidden),
                mlp + "up_proj.weight": (inter, hidden),
                mlp + "down_proj.weight": (hidden, inter),
                f"model.layers.{i}.input_layernorm.weight": None,
                f"model.layers.{i}.post_attention_layernorm.weight": None,
            }
        )
    g = torch.Generator().manual_seed(0)
    weights = {
        name: torch.ones(hidden) if shape is None else COMMON["initializer_range"] * torch.randn(shape, generator=g)
        for name, shape in sorted(shapes.items())
    }
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


# name -> the function writing it (its MODELS entry has no config class)
WRITTEN = {"ernie45_vl": write_ernie45_vl}

# multimodal models: MODELS' arguments are the text config's, these the outer config's (a vision
# tower as small as the config allows, special token ids inside the tiny vocabulary)
VISION = {
    "paddleocr_vl": dict(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        image_token_id=251,
        video_token_id=252,
        vision_start_token_id=253,
        vision_end_token_id=254,
        tie_word_embeddings=False,
    ),
}

# name -> extra arguments of vLLM's LLM. On a CPU with AMX tiles vLLM picks its AMX MLA backend
# for DeepSeek's attention unless another is asked for, and that backend takes bf16 weights only
# (these models are float32): the reference CPU MLA backend runs on every CPU.
# GPT-NeoX: vLLM's Transformers backend asked for by name (vLLM 0.32 has no GPT-NeoX of its own and
# picks it anyway; a later vLLM with one must not turn this into a test of its own model code).
ENGINE_ARGS = {
    "deepseek_v2": dict(attention_config={"backend": "CPU_MLA"}),
    "gpt_neox": dict(model_impl="transformers"),
    # vLLM's own FourierRotaryEmbedding defines forward_native only: with custom ops on (eager
    # mode) vLLM dispatches it to RotaryEmbedding.forward_cpu, the plain-table kernel on the table
    # computed at construction, before the checkpoint's coefficients are loaded. The comparison is
    # with the class's own forward_native (custom op off); the replacement serves every path.
    "llama_fope": dict(compilation_config={"custom_ops": ["-rotary_embedding"]}),
    # ERNIE 4.5-VL's rotary class overrides forward_native without `offsets`, and the CPU path it
    # inherits from MRotaryEmbedding passes them (TypeError on vLLM's own class): compared with its
    # forward_native (custom op off), as FoPE is
    # (both VL models) no image or video per prompt: vLLM builds the language model only, and still
    # feeds it M-RoPE positions (no HF processor is needed, which a tokenizer-less tiny model lacks)
    "ernie45_vl": dict(
        limit_mm_per_prompt={"image": 0, "video": 0},
        trust_remote_code=True,
        compilation_config={"custom_ops": ["-rotary_embedding"]},
    ),
    "paddleocr_vl": dict(limit_mm_per_prompt={"image": 0, "video": 0}),
}
# Transformers-backend models: (modeling module, HF's rotation helper that only HF's rotary function
# calls), counted in the engine's process while it generates
HF_ROTATION = {"gpt_neox": ("transformers.models.gpt_neox.modeling_gpt_neox", "rotate_half")}

# the environment of each run: asked for through VLLM_PLUGINS; installed and not asked (vLLM loads
# every installed plugin when VLLM_PLUGINS is unset, and ropekit's must then change nothing)
PLUGIN_ON = {"VLLM_PLUGINS": "ropekit"}
PLUGIN_OFF = {}


def build(name: str, root: str) -> str:
    import torch
    import transformers

    path = os.path.join(root, name)
    if name in WRITTEN:
        WRITTEN[name](path)
        return path
    cls_name, extra, _ = MODELS[name]
    if name in VISION:
        config = getattr(transformers, cls_name)(text_config={**COMMON, **extra}, **VISION[name])
        auto = transformers.AutoModelForImageTextToText
    else:
        config = getattr(transformers, cls_name)(**{**COMMON, **extra})
        auto = transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    if name in ROPE_AFTER_SAVE:
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
        saved["rope_parameters"] = ROPE_AFTER_SAVE[name]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(saved, f)
    if name in FOPE_COEFFICIENTS:
        from safetensors.torch import load_file, save_file

        heads, freqs = FOPE_COEFFICIENTS[name]
        weights = load_file(os.path.join(path, "model.safetensors"))
        # one rotary module serves every layer (vLLM's get_rope caches it): the same coefficients
        coef = {
            k: torch.eye(freqs).expand(heads, -1, -1) + 0.1 * torch.randn(heads, freqs, freqs) for k in ("cos", "sin")
        }
        for i in range(config.num_hidden_layers):
            for k in ("cos", "sin"):
                weights[f"model.layers.{i}.self_attn.rotary_emb.{k}_coef"] = coef[k].clone()
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def generate(paths: dict, trace_dir: str) -> dict:
    """In a child process: tokens, log probabilities and seconds per model, in order, up to and
    including the first model that raises (vLLM's in-process state is not reusable after that)."""
    import time

    from vllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, logprobs=0)
    results = {}
    for name, path in paths.items():
        os.environ["ROPEKIT_VLLM_TRACE"] = os.path.join(trace_dir, f"{name}.trace")
        start = time.monotonic()
        try:
            llm = LLM(
                model=path,
                skip_tokenizer_init=True,
                dtype="float32",
                enforce_eager=True,
                max_model_len=MAX_MODEL_LEN,
                distributed_executor_backend="uni",  # the worker in the engine's process
                **ENGINE_ARGS.get(name, {}),
            )
            built = time.monotonic()
            with hf_rotation_counted(name) as hf_calls:
                out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
        except Exception as e:  # reported per model: vLLM CPU cannot run every architecture
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]}
            break
        logprobs = [step[tok].logprob for step, tok in zip(out.logprobs, out.token_ids)]
        done = time.monotonic()
        results[name] = {
            "tokens": list(out.token_ids),
            "logprobs": logprobs,
            "seconds": {"build": round(built - start, 1), "generate": round(done - built, 1)},
            "hf_rotation_calls": hf_calls[0] if name in HF_ROTATION else None,
        }
        del llm
    return results


@contextlib.contextmanager
def hf_rotation_counted(name: str):
    """Count calls of the model's HF rotation helper (HF_ROTATION) in this process: [count]."""
    count = [0]
    if name not in HF_ROTATION:
        yield count
        return
    module = importlib.import_module(HF_ROTATION[name][0])
    attr = HF_ROTATION[name][1]
    helper = getattr(module, attr)

    def counted(*args, **kwargs):
        count[0] += 1
        return helper(*args, **kwargs)

    setattr(module, attr, counted)
    try:
        yield count
    finally:
        setattr(module, attr, helper)


def run_child(plugin_env: dict, paths: dict, trace_dir: str) -> dict:
    """Every model's result, from as many child processes as it takes (one more after each error)."""
    # the engine in the child process itself (one vLLM import per child, not three: CI time); vLLM
    # still loads its plugins there through its entry points, as in every process it starts
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "ROPEKIT_VLLM", "ROPEKIT_VLLM_TRACE")}
    env.update(plugin_env, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = os.path.join(trace_dir, "results.json")
    results = {}
    while len(results) < len(paths):
        todo = {name: path for name, path in paths.items() if name not in results}
        cmd = [sys.executable, __file__, "--generate", json.dumps(todo), "--trace-dir", trace_dir, "--out", out]
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            results.update(json.load(f))
    return results


def read_trace(path: str) -> dict:
    """{"init": {class: count}, "call": {class: count}, "pids": [...]} from a trace file."""
    seen = {"init": {}, "call": {}, "pids": set()}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                event, cls, pid = line.split()
                seen[event][cls] = seen[event].get(cls, 0) + 1
                seen["pids"].add(int(pid))
    seen["pids"] = sorted(seen["pids"])
    return seen


def check(names: list) -> dict:
    summary = {}
    with tempfile.TemporaryDirectory() as root:
        paths = {name: build(name, root) for name in names}
        on_dir, off_dir = os.path.join(root, "on"), os.path.join(root, "off")
        os.makedirs(on_dir)
        os.makedirs(off_dir)
        on = run_child(PLUGIN_ON, paths, on_dir)
        off = run_child(PLUGIN_OFF, paths, off_dir)
        for name in names:
            expected = MODELS[name][2]
            trace_on = read_trace(os.path.join(on_dir, f"{name}.trace"))
            trace_off = read_trace(os.path.join(off_dir, f"{name}.trace"))
            entry = {"expected_classes": expected, "trace_on": trace_on, "trace_off": trace_off}
            if "error" in on[name] or "error" in off[name]:
                entry.update(status="skipped", reason=on[name].get("error") or off[name].get("error"))
            else:
                problems = []
                if on[name]["tokens"] != off[name]["tokens"]:
                    problems.append(f"tokens differ: {on[name]['tokens']} vs {off[name]['tokens']}")
                gap = max(abs(a - b) for a, b in zip(on[name]["logprobs"], off[name]["logprobs"]))
                if gap > 1e-4:
                    problems.append(f"log probabilities differ by {gap:.3g}")
                for cls in expected:
                    if not trace_on["init"].get(cls) or not trace_on["call"].get(cls):
                        problems.append(f"ropekit's {cls} not constructed and called in the plugin run")
                if not expected and trace_on["call"]:
                    problems.append(f"unexpected ropekit calls {trace_on['call']}")
                if trace_off["init"] or trace_off["call"]:
                    problems.append("ropekit ran although the deployment did not ask for it")
                if name in HF_ROTATION:
                    calls = {"on": on[name]["hf_rotation_calls"], "off": off[name]["hf_rotation_calls"]}
                    entry["hf_rotation_calls"] = calls
                    if calls["on"] or not calls["off"]:
                        problems.append(f"HF's {HF_ROTATION[name][1]} calls {calls}: expected none on, some off")
                if trace_on["pids"] and os.getpid() in trace_on["pids"]:
                    problems.append("the trace came from the test process, not vLLM's")
                entry.update(
                    status="failed" if problems else "passed",
                    problems=problems,
                    tokens=on[name]["tokens"],
                    logprob_gap=gap,
                    seconds={"on": on[name]["seconds"], "off": off[name]["seconds"]},
                )
            summary[name] = entry
    return summary


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--out")
    parser.add_argument("--generate")  # internal: the child process
    parser.add_argument("--trace-dir")
    args = parser.parse_args()
    if args.generate:
        results = generate(json.loads(args.generate), args.trace_dir)
        with open(args.out, "w") as f:
            json.dump(results, f)
        return 0
    summary = check(args.models)
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0 if all(e["status"] != "failed" for e in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
