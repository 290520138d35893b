"""Training step of small random-weight Flux.1 and Wan 2.1 transformers, with and without
`ropekit.diffusers.patch`.

    PYTHONPATH=src python benchmarks/e2e_dit.py --out OUT/e2e_dit.json [--quick] [--compile]
        [--models flux,wan] [--steps 10] [--warmup 3] [--rounds 2] [--wan-latent 21,60,104]

The models are diffusers' own classes with their real widths and only a few blocks, random
weights from a fixed seed, on CUDA in bf16 (parameters cast as `from_pretrained(torch_dtype=
torch.bfloat16)` casts them: bf16 except the class's `_keep_in_fp32_modules`; buffers such as
Wan's float32 rotary table as the constructor made them):

    Flux.1  FluxTransformer2DModel: 24 heads x 128 = 3072 wide, joint_attention_dim 4096,
            pooled_projection_dim 768, axes_dims_rope (16, 56, 56), in_channels 64 (2 x 2 packed
            latent patches), no guidance embedding; 2 double-stream + 4 single-stream blocks.
            Input: B=1, a 64 x 64 grid of packed patches (a 1024 x 1024 image) = 4096 image tokens
            and 512 text tokens: 4608 tokens through every attention (W13's shape).
    Wan 2.1 WanTransformer3DModel with the 14B model's widths: 40 heads x 128 = 5120, ffn 13824,
            text_dim 4096, in_channels 16, patch (1, 2, 2), QK-RMSNorm across heads; 2 blocks.
            Input: B=1, a 16 x 21 x 60 x 104 latent (81 frames at 480 x 832) = 21 x 30 x 52 =
            32,760 video tokens, and 512 text tokens (cross-attention). `--wan-latent 21,90,160`
            gives W14's 21 x 45 x 80 = 75,600 tokens (720p).

A training step is: gradients set to None, forward, MSE loss (float32) to a fixed random
target, backward. No optimizer step: the weights stay fixed, so every step does the same work
and the patched and unpatched runs see the same weights. Each variant (unpatched, patched) runs
`warmup` steps then `steps` timed ones (CUDA events around each step), `rounds` times in turn
(unpatched, patched, unpatched, ...); the figure is the median over all timed steps. The first
step of each variant gives the loss, the output and the gradient norm compared. Checks (the
script exits 1 if one fails): the patched loss equals the unpatched one within `--loss-rtol`
(bf16 default 8e-3, float32 1e-5); the patched output's error against the unpatched model run
in float32 (same weights, upcast) is within 1.5x the unpatched output's own error plus 1e-3
(float32: 1e-5). The loss alone is a weak check (an MSE to a random target barely moves when
the output does); the output check catches a rotation by the wrong angle.
The first patched step also counts ropekit's calls (a patch that did nothing would show 0).
Peak memory: `torch.cuda.max_memory_allocated` over each variant's steps.

`--compile` also times `torch.compile(model)` of both variants (patched before compiling; the
first step's wall time, compilation included, is recorded); a variant that fails to compile is
recorded with its error and the run goes on.

`--quick` shrinks everything to tiny configs (float32, a few tokens, 2 steps) that run on CPU
too; `tests/test_e2e_dit.py` runs it. Output: the JSON file (one row per model and mode) and a
markdown table on stdout.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

# Flux.1's widths (FluxTransformer2DModel's defaults) with 2 double- and 4 single-stream blocks
FLUX_FULL = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=4,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
FLUX_TINY = dict(in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2)
FLUX_CONFIG = {
    "full": FLUX_FULL,
    "quick": {
        **FLUX_FULL,
        **FLUX_TINY,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 8,
        "axes_dims_rope": (4, 6, 6),
    },
}
FLUX_TOKENS = {"full": (64, 64, 512), "quick": (4, 4, 8)}  # image grid rows, columns; text tokens

# Wan 2.1 14B's widths (WanTransformer3DModel's defaults) with 2 blocks
WAN_FULL = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
WAN_TINY = dict(num_attention_heads=3, attention_head_dim=12, in_channels=4, out_channels=4, num_layers=1)
WAN_CONFIG = {
    "full": WAN_FULL,
    "quick": {**WAN_FULL, **WAN_TINY, "text_dim": 16, "freq_dim": 16, "ffn_dim": 16, "rope_max_seq_len": 32},
}
WAN_LATENT = {"full": (21, 60, 104), "quick": (2, 4, 4)}  # latent frames, height, width
WAN_TEXT = {"full": 512, "quick": 5}

SCHEDULE = {"full": dict(warmup=3, steps=10, rounds=2), "quick": dict(warmup=1, steps=2, rounds=1)}
LOSS_RTOL = {torch.bfloat16: 8e-3, torch.float32: 1e-5}  # about one rounding of the dtype
OUTPUT_SLACK = {torch.bfloat16: 1e-3, torch.float32: 1e-5}  # added to 1.5x the unpatched error


# ---------------------------------------------------------------------------------------------
# models and inputs


def cast_params(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Floating parameters to dtype except those of the class's `_keep_in_fp32_modules` (float32),
    as diffusers' from_pretrained(torch_dtype=dtype) loads them; buffers are left as built."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, p in model.named_parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.float32 if any(k in name.split(".") for k in keep) else dtype)
    return model


def build(cls, config: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A random-weight model made on the device (seeded), its parameters cast, in training mode."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(**config)
    return cast_params(model, dtype).train()


def flux_inputs(cfg: dict, tokens, device, dtype, gen: torch.Generator) -> dict:
    """Flux's forward arguments: packed latent patches, T5 states, CLIP pooled vector, timestep,
    and the position ids the Flux pipeline builds ((0, row, column) per patch, zeros for text)."""
    rows, cols, n_txt = tokens
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    img_ids = torch.stack((torch.zeros_like(r), r, c), -1).reshape(-1, 3).float()
    floats = dict(
        hidden_states=torch.randn(1, rows * cols, cfg["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(1, n_txt, cfg["joint_attention_dim"], generator=gen),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=gen),
    )
    inputs = {k: v.to(device, dtype) for k, v in floats.items()}
    inputs["timestep"] = torch.rand(1, generator=gen).to(device, dtype)  # the pipeline's t / 1000
    inputs["img_ids"] = img_ids.to(device)
    inputs["txt_ids"] = torch.zeros(n_txt, 3, device=device)
    return inputs


def wan_inputs(cfg: dict, latent, n_txt: int, device, dtype, gen: torch.Generator) -> dict:
    """Wan's forward arguments: a (1, C, frames, height, width) latent, a timestep in [0, 1000),
    umT5 states."""
    return dict(
        hidden_states=torch.randn(1, cfg["in_channels"], *latent, generator=gen).to(device, dtype),
        timestep=(torch.rand(1, generator=gen) * 1000).to(device),
        encoder_hidden_states=torch.randn(1, n_txt, cfg["text_dim"], generator=gen).to(device, dtype),
    )


def flux_case(size: str, device, dtype, gen, args) -> dict:
    from diffusers import FluxTransformer2DModel

    cfg = dict(FLUX_CONFIG[size])
    if args.flux_blocks:
        cfg.update(num_layers=args.flux_blocks[0], num_single_layers=args.flux_blocks[1])
    rows, cols, n_txt = FLUX_TOKENS[size]
    if args.flux_image:
        rows, cols = args.flux_image
    return dict(
        model="flux",
        blocks=f"{cfg['num_layers']} double + {cfg['num_single_layers']} single",
        hidden=cfg["num_attention_heads"] * cfg["attention_head_dim"],
        tokens=f"{rows}x{cols} img + {n_txt} txt",
        seq_tokens=rows * cols + n_txt,
        build=lambda: build(FluxTransformer2DModel, cfg, device, dtype),
        inputs=flux_inputs(cfg, (rows, cols, n_txt), device, dtype, gen),
    )


def wan_case(size: str, device, dtype, gen, args) -> dict:
    from diffusers import WanTransformer3DModel

    cfg = dict(WAN_CONFIG[size])
    if args.wan_blocks:
        cfg.update(num_layers=args.wan_blocks)
    latent = args.wan_latent or WAN_LATENT[size]
    _, ph, pw = cfg["patch_size"]
    grid = (latent[0], latent[1] // ph, latent[2] // pw)
    return dict(
        model="wan",
        blocks=f"{cfg['num_layers']}",
        hidden=cfg["num_attention_heads"] * cfg["attention_head_dim"],
        tokens=f"{grid[0]}x{grid[1]}x{grid[2]} video (+ {WAN_TEXT[size]} txt, cross)",
        seq_tokens=grid[0] * grid[1] * grid[2],
        build=lambda: build(WanTransformer3DModel, cfg, device, dtype),
        inputs=wan_inputs(cfg, latent, WAN_TEXT[size], device, dtype, gen),
    )


CASES = {"flux": flux_case, "wan": wan_case}


# ---------------------------------------------------------------------------------------------
# one training step, timed


def make_step(model: Callable, params: List[torch.nn.Parameter], inputs: dict, target: torch.Tensor):
    """The training step: gradients to None, forward, float32 MSE to target, backward; returns the
    loss and the output (detached)."""

    def step():
        for p in params:
            p.grad = None
        out = model(**inputs, return_dict=False)[0]
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        return loss.detach(), out.detach()

    return step


def timed_steps(step: Callable, n: int, device: torch.device) -> List[float]:
    """Milliseconds of n consecutive steps: CUDA events around each on CUDA, wall clock on CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def grad_norm(params: List[torch.nn.Parameter]) -> float:
    norms = [p.grad.float().norm() for p in params if p.grad is not None]
    return torch.stack(norms).norm().item()


def first_step(step: Callable, device: torch.device, count: bool) -> dict:
    """The first step, wall-timed (compilation included when compiled): its loss and output, and
    with count, ropekit's rotation calls (all of them, and those with a fused norm weight)."""
    import ropekit.diffusers as rd

    real = rd.rotate_with_angles
    calls = {"ropekit_calls": 0, "fused_norm_calls": 0}

    def counting(*args, **kwargs):
        calls["ropekit_calls"] += 1
        calls["fused_norm_calls"] += kwargs.get("q_norm_weight") is not None
        return real(*args, **kwargs)

    if count:
        rd.rotate_with_angles = counting
    try:
        sync(device)
        t = time.perf_counter()
        loss, out = step()
        sync(device)
        first_s = time.perf_counter() - t
    finally:
        rd.rotate_with_angles = real
    return dict(loss=loss.item(), output=out, first_step_s=first_s, **(calls if count else {}))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def set_patched(model: torch.nn.Module, patched: bool) -> int:
    """Patch (returns the attention modules prepared) or unpatch the model."""
    import ropekit.diffusers as rd

    rd.unpatch()
    return sum(rd.patch(model).values()) if patched else 0


def run_variant(step, params, device, warmup: int, steps: int, first: bool, count: bool) -> dict:
    """One variant's turn: (on its first turn, the first step and the gradient norm), warmup
    steps, then timed ones; peak memory over the turn."""
    result: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if first:
        result.update(first_step(step, device, count))
        result["grad_norm"] = grad_norm(params)
        warmup -= 1
    for _ in range(max(warmup, 0)):
        step()
    result["step_ms"] = timed_steps(step, steps, device)
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compare(unpatched: dict, patched: dict, tol: dict, reference: torch.Tensor) -> dict:
    """The row's numbers from both variants' results: times, and the checks (the loss within
    tol's loss_rtol of the unpatched loss; the output's error against the float32 reference
    within 1.5x the unpatched output's own plus tol's output_slack)."""
    u_ms = statistics.median(unpatched["step_ms"])
    p_ms = statistics.median(patched["step_ms"])
    loss_diff = rel(patched["loss"], unpatched["loss"])
    u_out, p_out = unpatched.pop("output"), patched.pop("output")
    u_err, p_err = rel_norm(u_out, reference), rel_norm(p_out, reference)
    return dict(
        unpatched_ms=u_ms,
        patched_ms=p_ms,
        speedup=u_ms / p_ms,
        loss_unpatched=unpatched["loss"],
        loss_patched=patched["loss"],
        loss_rel_diff=loss_diff,
        output_rel_diff=rel_norm(p_out, u_out),
        grad_norm_rel_diff=rel(patched["grad_norm"], unpatched["grad_norm"]),
        output_err_unpatched=u_err,
        output_err_patched=p_err,
        **tol,
        loss_ok=loss_diff <= tol["loss_rtol"],
        output_ok=p_err <= 1.5 * u_err + tol["output_slack"],
        ropekit_calls=patched.get("ropekit_calls"),
        fused_norm_calls=patched.get("fused_norm_calls"),
        unpatched=unpatched,
        patched=patched,
    )


def measure_eager(model, inputs, target, device, schedule: dict, tol: dict, reference) -> dict:
    """Unpatched and patched eager turns in alternation; the row's numbers."""
    params = [p for p in model.parameters() if p.requires_grad]
    step = make_step(model, params, inputs, target)
    results: Dict[str, dict] = {}
    prepared = 0
    for r in range(schedule["rounds"]):
        for name in ("unpatched", "patched"):
            prepared = max(prepared, set_patched(model, name == "patched"))
            turn = run_variant(step, params, device, schedule["warmup"], schedule["steps"], r == 0, count=True)
            if r == 0:
                results[name] = turn
            else:
                results[name]["step_ms"] += turn["step_ms"]
                if "peak_gib" in turn:
                    results[name]["peak_gib"] = max(results[name]["peak_gib"], turn["peak_gib"])
    set_patched(model, False)
    return dict(compare(results["unpatched"], results["patched"], tol, reference), patched_modules=prepared)


def measure_compiled(model, inputs, target, device, schedule: dict, tol: dict, reference) -> dict:
    """torch.compile(model) of each variant (patched before compiling, dynamo reset in between);
    a variant that fails is reported by its error."""
    params = [p for p in model.parameters() if p.requires_grad]
    results: Dict[str, dict] = {}
    for name in ("unpatched", "patched"):
        torch._dynamo.reset()
        set_patched(model, name == "patched")
        step = make_step(torch.compile(model), params, inputs, target)
        try:
            results[name] = run_variant(step, params, device, schedule["warmup"], schedule["steps"], True, False)
        except Exception as e:  # a compile failure is a result: recorded, the run goes on
            return dict(error=f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        finally:
            set_patched(model, False)
    torch._dynamo.reset()
    return compare(results["unpatched"], results["patched"], tol, reference)


def reference_output(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The unpatched model's output computed in float32 (a float32 copy of the same weights, the
    inputs upcast): the yardstick of both bf16 variants' outputs."""
    ref = cast_params(copy.deepcopy(model), torch.float32)
    floats = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        out = ref(**floats, return_dict=False)[0]
    del ref
    return out


def run_case(case: dict, device, dtype, schedule: dict, tol: dict, compile_too: bool) -> List[dict]:
    """The eager row (and the compiled row) of one model."""
    head = {k: case[k] for k in ("model", "blocks", "hidden", "tokens", "seq_tokens")}
    head.update(dtype=str(dtype).replace("torch.", ""), device=str(device), **schedule)
    model = case["build"]()
    head["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    inputs = case["inputs"]
    reference = reference_output(model, inputs)
    target = torch.randn(reference.shape, generator=torch.Generator().manual_seed(2)).to(device)
    measured = (model, inputs, target, device, schedule, tol, reference)
    rows = [dict(head, mode="eager", **measure_eager(*measured))]
    if compile_too:
        rows.append(dict(head, mode="compile", **measure_compiled(*measured)))
    return rows


def release(device: torch.device) -> None:
    """Give a finished model's memory back (an out-of-memory traceback may have held it)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# report


def environment(device: torch.device) -> dict:
    import diffusers

    env = dict(torch=torch.__version__, diffusers=diffusers.__version__, python=platform.python_version())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        git = ["git", "describe", "--always", "--dirty"]
        env["git"] = subprocess.run(git, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def table(rows: List[dict]) -> str:
    """The markdown table: one line per model and mode."""
    lines = [
        "| model | mode | blocks | tokens | unpatched ms | patched ms | speedup | loss rel diff | "
        "output rel diff | peak GiB unpatched / patched |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r['blocks']} | {r['tokens']} | {r['error']} ||||||")
            continue
        peak = "-"
        if "peak_gib" in r["unpatched"]:
            peak = f"{r['unpatched']['peak_gib']:.1f} / {r['patched']['peak_gib']:.1f}"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['blocks']} | {r['tokens']} | {r['unpatched_ms']:.2f} | "
            f"{r['patched_ms']:.2f} | {r['speedup']:.3f}x | {r['loss_rel_diff']:.1e} | "
            f"{r['output_rel_diff']:.1e} | {peak} |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="tiny configs, float32, 2 steps (CPU is fine)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile of both variants")
    p.add_argument("--models", default="flux,wan", help="comma-separated: flux, wan")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 (fp32 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before each variant's timed ones")
    p.add_argument("--rounds", type=int, default=None, help="unpatched / patched turns, alternated")
    p.add_argument("--flux-blocks", default=None, help="Flux double,single blocks (default 2,4)")
    p.add_argument("--flux-image", default=None, help="Flux packed-patch grid rows,cols (default 64,64)")
    p.add_argument("--wan-blocks", type=int, default=None, help="Wan blocks (default 2)")
    p.add_argument("--wan-latent", default=None, help="Wan latent frames,height,width (default 21,60,104)")
    p.add_argument("--loss-rtol", type=float, default=None, help="patched vs unpatched loss, relative")
    args = p.parse_args(argv)
    for key in ("flux_blocks", "flux_image", "wan_latent"):
        if getattr(args, key):
            setattr(args, key, tuple(int(v) for v in getattr(args, key).split(",")))
    return args


def main(argv: Optional[List[str]] = None) -> List[dict]:
    """Run the benchmark; returns the rows (also written to --out as JSON with the environment)."""
    args = parse_args(argv)
    size = "quick" if args.quick else "full"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("fp32" if args.quick else "bf16")]
    schedule = dict(SCHEDULE[size])
    if device.type == "cuda":
        # cuDNN's fused attention backward failed at these shapes on the H200 (torch 2.11:
        # "mha_graph.execute ... is_good()"), with or without the patch: both variants use the
        # flash / memory-efficient kernels instead, so the comparison stays like for like
        torch.backends.cuda.enable_cudnn_sdp(False)
    for key in schedule:
        if getattr(args, key) is not None:
            schedule[key] = getattr(args, key)
    tol = dict(
        loss_rtol=LOSS_RTOL[dtype] if args.loss_rtol is None else args.loss_rtol, output_slack=OUTPUT_SLACK[dtype]
    )
    rows: List[dict] = []
    for name in args.models.split(","):
        case = CASES[name](size, device, dtype, torch.Generator().manual_seed(1), args)
        try:
            rows += run_case(case, device, dtype, schedule, tol, args.compile)
        except torch.cuda.OutOfMemoryError as e:  # one model too large must not lose the other's row
            rows.append(
                dict(model=name, mode="eager", blocks=case["blocks"], tokens=case["tokens"], error=str(e)[:300])
            )
        del case
        release(device)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=environment(device), size=size, rows=rows), f, indent=1)
    return rows


def failed(rows: List[dict]) -> List[dict]:
    """Rows whose losses differ beyond the tolerance, and eager rows that did not run (a compile
    failure is a recorded result, not a failure)."""
    bad = [r for r in rows if r.get("loss_ok") is False or r.get("output_ok") is False]
    return bad + [r for r in rows if r["mode"] == "eager" and "error" in r]


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
