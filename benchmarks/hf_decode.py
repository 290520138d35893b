"""Eager Hugging Face decoding of a Qwen3 causal LM: unpatched, `ropekit.hf.patch(model)`,
`ropekit.hf.patch(model, fuse_qk_norm=True)` and `ropekit.hf.fuse_qkv(model)` (the attention
prologue, q/k/v projections + q/k norm + RoPE, as one rope_qkv_projection call a layer),
milliseconds per generated token.

    PYTHONPATH=src python benchmarks/hf_decode.py --out OUT/hf_decode.json [--batches 1,16]
        [--new-tokens 64] [--prompt 128] [--rounds 5] [--layers 28] [--device cuda] [--tiny]

The model is transformers' `Qwen3ForCausalLM` built from a `Qwen3Config` with random weights (fixed
seed, nothing downloaded): Qwen3-0.6B's shape, 28 layers, hidden 1024, 16 query / 8 key-value
heads of head_dim 128, intermediate 3072, the full vocabulary of 151,936 (tied input / output
embeddings, as Qwen3-0.6B: about 0.6 B parameters, 1.2 GB in bf16; the KV cache of batch 16 at
192 tokens is 0.35 GB, so nothing needs shrinking on a GPU), q / k RMSNorm per head, rope_theta 1e6,
SDPA attention. bf16 on CUDA, float32 on CPU. `--tiny` (hidden 64, 4 query / 2 key-value heads of
head_dim 16, intermediate 128, vocabulary 128, a 16-token prompt) is the CPU smoke test.

Decoding is eager: `model.generate(input_ids, attention_mask, do_sample=False, max_new_tokens=N,
min_new_tokens=N)` with transformers' default DynamicCache, no torch.compile, no CUDA graphs. The
prompt is `--prompt` random token ids per sequence (no padding); every sequence generates exactly N
tokens (min_new_tokens: no end-of-sequence stop).

Timing: torch.cuda.synchronize() and time.perf_counter() around a generate of N new tokens and
around one of 1 new token (the prefill and generate's setup alone); ms per token =
(t_N - t_1) / (N - 1), the N - 1 decode steps of a KV-cached forward, sampling and generate's
per-step bookkeeping each. The three configurations are timed in rounds: each round sets each
configuration in turn (the order rotates from round to round), runs a short warm-up generation,
then the two timed ones; a configuration is set with `ropekit.hf.unpatch()` and
`ropekit.hf.unfuse_qkv(model)`, then for the patched ones `ropekit.hf.patch(model[,
fuse_qk_norm=True])` or `ropekit.hf.fuse_qkv(model)` on the same model instance. The table gives the
median over the rounds and the min-max (host noise shows there), and the speedup of the medians over
the unpatched one.

Checks, before the timed rounds, one untimed generation of N tokens per configuration and batch:
- ropekit's calls: every call of a rotation op goes through one of `ropekit.core.dispatch.ROTATE`'s
  doors; they are wrapped for that generation only (restored afterwards) and counted, with the
  calls that fused the q / k norm (`spec.variant.normed`). Per token: the count over the N forwards
  (the prefill and the N - 1 decode steps), one call per layer when the patch reaches every layer.
  A patched configuration with no call is a failure.
- the tokens: compared with the unpatched ones; the first difference (sequence, step) is reported,
  not a failure: in bf16 a rotation rounded differently can flip a near-tie of the greedy argmax,
  after which the sequences part.
- the logits of the first step (the prompt's prefill, before any token can differ): compared with
  a float32 copy of the unpatched model (in float32, with the unpatched run itself). A configuration
  passes when its error (relative L2) is at most 1.5x the unpatched run's plus `--logit-slack`
  (1e-3 in bf16, 1e-5 in float32). Equal tokens alone would not do: a wrong rotation of a
  random-weight model can leave a few greedy tokens unchanged.
The script exits with 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch

CONFIGS = ("unpatched", "patched", "patched+qknorm", "fused-qkv")

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    num_hidden_layers=28,
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(QWEN3_0_6B, vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)  # fmt: skip
LOGIT_SLACK = {torch.bfloat16: 1e-3, torch.float32: 1e-5}


def build(cfg: dict, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(attn_implementation="sdpa", **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def set_config(model, name: str) -> Dict[str, List[str]]:
    """Everything unpatched, then the configuration's patch; returns its report ({family: names})."""
    import ropekit.hf as rh

    rh.unpatch()
    rh.unfuse_qkv(model)
    if name == "unpatched":
        return {}
    if name == "fused-qkv":
        return {"fused_qkv": rh.fuse_qkv(model, strict=True).fused}
    report = rh.patch(model, fuse_qk_norm=name == "patched+qknorm")
    return {family: list(names) for family, names in report.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model, prompt: dict, n: int, **kwargs):
    return model.generate(**prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n, **kwargs)


def timed(model, prompt: dict, n: int, device: torch.device) -> float:
    """Seconds of one generate of n new tokens, synchronized before and after."""
    sync(device)
    t = time.perf_counter()
    generate(model, prompt, n)
    sync(device)
    return time.perf_counter() - t


@contextlib.contextmanager
def counting_calls():
    """Count ropekit's rotation calls (and those with a fused norm weight) while the block runs."""
    from ropekit.core import dispatch

    real = dict(dispatch.ROTATE)
    calls = {"calls": 0, "fused_norm_calls": 0}

    def counting(door):
        def counted(spec, *args, **kwargs):
            out = door(spec, *args, **kwargs)
            if out is not None:  # None: the launch record declined, the spec's door runs the call
                calls["calls"] += 1
                calls["fused_norm_calls"] += bool(spec.variant.normed)
            return out

        return counted

    for name, door in real.items():
        dispatch.ROTATE[name] = counting(door)
    try:
        yield calls
    finally:
        dispatch.ROTATE.update(real)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_run(model, prompt: dict, n: int, device: torch.device) -> dict:
    """One untimed generation with the ROTATE doors counted: tokens, first-step logits, calls."""
    with counting_calls() as calls:
        out = generate(model, prompt, n, return_dict_in_generate=True, output_logits=True)
        sync(device)
    new = out.sequences[:, prompt["input_ids"].shape[1] :].cpu()
    return dict(tokens=new, first_logits=out.logits[0].float().cpu(), **calls)


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> Optional[dict]:
    """The first step at which a sequence of a differs from b's, and which sequence (None: equal)."""
    diff = (a != b).nonzero()
    if not len(diff):
        return None
    step = int(diff[:, 1].min())
    return dict(step=step, sequence=int(diff[diff[:, 1] == step][0, 0]))


def reference_logits(model, prompt: dict, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The unpatched model's last-prompt-token logits in float32 (None when it runs in float32)."""
    if dtype == torch.float32:
        return None
    import ropekit.hf as rh

    rh.unpatch()
    ref = copy.deepcopy(model).float()
    with torch.no_grad():
        logits = ref(**prompt, logits_to_keep=1).logits[:, -1].float().cpu()
    del ref
    return logits


def run_batch(model, batch: int, args, device: torch.device, dtype: torch.dtype) -> List[dict]:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt), generator=gen).to(device)
    prompt = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    n = args.new_tokens
    ref = reference_logits(model, prompt, dtype)

    rows: Dict[str, dict] = {}
    checks: Dict[str, dict] = {}
    for name in CONFIGS:
        report = set_config(model, name)
        checks[name] = check_run(model, prompt, n, device)
        rows[name] = dict(batch=batch, configuration=name, patched=report)
    base = checks["unpatched"]
    ref_logits = base["first_logits"] if ref is None else ref
    base_err = rel_l2(base["first_logits"], ref_logits)
    for name, c in checks.items():
        err = rel_l2(c["first_logits"], ref_logits)
        same = bool(torch.equal(c["tokens"], base["tokens"]))
        logits_ok = err <= 1.5 * base_err + args.logit_slack
        rows[name].update(
            ropekit_calls=c["calls"],
            fused_norm_calls=c["fused_norm_calls"],
            calls_per_token=c["calls"] / n,
            tokens_equal_unpatched=same,
            first_divergence=first_divergence(c["tokens"], base["tokens"]),
            first_logits_rel_diff_unpatched=rel_l2(c["first_logits"], base["first_logits"]),
            first_logits_err_fp32=None if ref is None else err,
            first_logits_ok=logits_ok,
            check_ok=logits_ok and (name == "unpatched" or c["calls"] > 0),
            tokens=c["tokens"].tolist() if args.keep_tokens else None,
        )

    samples: Dict[str, List[float]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
        for name in order:
            set_config(model, name)
            generate(model, prompt, args.warmup_tokens)  # warm-up
            t1 = timed(model, prompt, 1, device)
            tn = timed(model, prompt, n, device)
            samples[name].append((tn - t1) / (n - 1) * 1e3)
    set_config(model, "unpatched")

    base_ms = statistics.median(samples["unpatched"])
    out = []
    for name in CONFIGS:
        ms = samples[name]
        med = statistics.median(ms)
        out.append(dict(rows[name], ms_per_token=med, ms_min=min(ms), ms_max=max(ms), ms_rounds=ms,
                        speedup=base_ms / med))  # fmt: skip
    return out


def versions(device: torch.device) -> dict:
    import transformers

    import ropekit

    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        ropekit=ropekit.__version__,
    )
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    env["gpu"] = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    try:
        git = ["git", "describe", "--always", "--dirty"]
        env["git"] = subprocess.run(git, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def table(rows: List[dict]) -> str:
    lines = [
        "| batch | configuration | ms/token median [min-max] | speedup vs unpatched | ropekit calls/token | "
        "tokens = unpatched | check |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        calls = f"{r['calls_per_token']:g}"
        if r["fused_norm_calls"]:
            calls += f" ({r['fused_norm_calls'] / r['ropekit_calls']:.0%} norm-fused)"
        same = "yes" if r["tokens_equal_unpatched"] else f"no, from {r['first_divergence']}"
        lines.append(
            f"| {r['batch']} | {r['configuration']} | {r['ms_per_token']:.3f} [{r['ms_min']:.3f}-{r['ms_max']:.3f}] | "
            f"{r['speedup']:.3f}x | {calls} | {same} | {'ok' if r['check_ok'] else 'FAILED'} |"
        )
    return "\n".join(lines)


def ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",")]


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--batches", type=ints, default=[1, 16], help="comma-separated batch sizes (default 1,16)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence (default 64)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens per sequence (default 128; 16 with --tiny)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of the three configurations (default 5)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of the warm-up generation (default 8)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 28)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--tiny", action="store_true", help="hidden 64, 4 heads of 16, vocabulary 128 (CPU smoke test)")
    p.add_argument("--logit-slack", type=float, default=None, help="first-step logit check: added to 1.5x HF's error")
    p.add_argument("--keep-tokens", action="store_true", help="write the generated tokens into the JSON rows")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens: expected at least 2 (the time per token is (t_N - t_1) / (N - 1))")
    if args.prompt is None:
        args.prompt = 16 if args.tiny else 128
    return args


def main(argv: Optional[List[str]] = None) -> List[dict]:
    """Run the benchmark; returns the rows (also written to --out as JSON with the config and versions)."""
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.logit_slack is None:
        args.logit_slack = LOGIT_SLACK[dtype]
    cfg = dict(TINY if args.tiny else QWEN3_0_6B)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    model = build(cfg, device, dtype)
    try:
        rows = [row for batch in args.batches for row in run_batch(model, batch, args, device, dtype)]
    finally:
        import ropekit.hf as rh

        rh.unpatch()
        rh.unfuse_qkv(model)
    print(table(rows))
    bad = failed(rows)
    print(f"checks: {'FAILED ' + str([(r['batch'], r['configuration']) for r in bad]) if bad else 'ok'}")
    if args.out:
        config = dict(
            model="Qwen3ForCausalLM (random weights)",
            qwen3_config=cfg,
            parameters=sum(p.numel() for p in model.parameters()),
            device=str(device),
            dtype=str(dtype).replace("torch.", ""),
            attention="sdpa",
            batches=args.batches,
            prompt_tokens=args.prompt,
            new_tokens=args.new_tokens,
            rounds=args.rounds,
            warmup_tokens=args.warmup_tokens,
            logit_slack=args.logit_slack,
            timing="(t_generate(N) - t_generate(1)) / (N - 1), cuda synchronized, perf_counter",
        )
        with open(args.out, "w") as f:
            json.dump(dict(config=config, versions=versions(device), rows=rows), f, indent=1)
    return rows


def failed(rows: List[dict]) -> List[dict]:
    """Rows whose check failed: first-step logits off, or a patched configuration without ropekit calls."""
    return [r for r in rows if not r["check_ok"]]


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
