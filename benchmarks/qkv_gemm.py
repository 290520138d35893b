"""The QKV projection with its RoPE (and q/k norm) epilogue fused, against cuBLAS + ropekit, same run.

    PYTHONPATH=src python benchmarks/qkv_gemm.py --out OUT/qkv_results.json
        [--tokens 4096,8192,16384,32768] [--models llama3_8b,qwen3_8b] [--rounds 2] [--rep 200]
        [--sweep] [--sweep-tokens 16384]
    PYTHONPATH=src python benchmarks/qkv_gemm.py --preset long --out OUT/qkv_long.json
    PYTHONPATH=src python benchmarks/qkv_gemm.py --shapes llama3_8b:32768 --modes fwd --variants fused,unfused

Shapes: every model of --models at every T of --tokens, or --shapes MODEL:T,... (one row each),
or --preset NAME (PRESETS: "long" is Llama-3-8B and Qwen3-8B at T = 8192 and 32768, forward and
forward + backward: about 3 minutes on an H100 with the default --rounds / --rep). --modes
(fwd, fwd_bwd) and --variants (fused, fused_tma, fused_packed, unfused; unfused always runs: it is the
reference) narrow a run further. The "store" mode times the paged-cache write (k_cache, v_cache,
slot_mapping: k and v into a bf16 cache of 16-token blocks, q returned) under torch.no_grad; not
in the defaults (--modes fwd,fwd_bwd,store adds it), not in the suggested auto table.

For each model and token count T (bf16, CUDA), one `ropekit.rope_qkv_projection` call timed as

    fused      impl="fused": the Triton GEMM whose epilogue normalizes and rotates (pointer path)
    fused_tma  the same on the TMA path (two half-width dots a k step)
    fused_packed  the same on the packed path (one (G * D, BLOCK_K) box of the pair-ordered weight
               copy and one wide dot a k step; kernels/qkv_gemm.py)
    unfused    impl="unfused": torch.nn.functional.linear (cuBLAS) then ropekit.apply_rope
    linear     torch.nn.functional.linear alone (the projection without RoPE: a floor for both)

forward (under torch.no_grad: inference / prefill) and forward + backward (x, the weight and the
norm weights require grad; torch.autograd.grad of all three outputs with fixed random output
gradients). Models: Llama-3-8B (hidden 4096, 32 q heads, 8 kv heads, head 128, half-split RoPE,
base 500000) and Qwen3-8B (the same widths, per-head q/k RMSNorm before the rotation, base 1e6).
Positions 0..T-1. Times: triton.testing.do_bench (CUDA events, L2 flushed before every call),
median of its repetitions, the smaller over `rounds` rounds that alternate the implementations.
Before timing, the fused outputs are compared with the unfused ones (relative error).

The JSON holds the config (device, versions, shapes), per shape and mode the three times, the
speedup unfused / fused, the fused kernel's and cuBLAS's TFLOP/s, and `auto_table`: the entries for
ropekit.api.qkv.AUTO_TABLE this run suggests ((device kind, shape class) -> "fused" where the fused
path was at least 2% faster, else "unfused"), also printed as a Python literal to paste.

--sweep also times the forward kernel alone under several fixed tile configs at --sweep-tokens
tokens (ropekit.kernels.qkv_gemm.qkv_rope_gemm with config=...), to pick tile_config's choice;
--sweep-configs 'G=2,BLOCK_M=128,BLOCK_K=64,GROUP_M=8,num_warps=8,num_stages=3,PACKED=1;...' times
those instead of SWEEP. The ROPEKIT_QKV_* knobs (docs/qkv.md, "Tuning") change tile_config's
choice for every fused variant of a run; the JSON's config records the ones set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

import ropekit
from ropekit.api import qkv as qkv_api
from ropekit.kernels import qkv_gemm

# timed variants: name -> (impl, qkv_gemm.PATH: the fused kernel's path)
VARIANTS = {
    "fused": ("fused", "pointer"),
    "fused_tma": ("fused", "tma"),
    "fused_packed": ("fused", "packed"),
    "unfused": ("unfused", ""),
}
FUSED = tuple(n for n in VARIANTS if n != "unfused")
# a variant's suffix in the JSON's fields: fused_ms, fused_tma_ms, ...; speedup, speedup_tma, ...
SUFFIX = {"fused": "", "fused_tma": "_tma", "fused_packed": "_packed"}

MODELS = {
    # name: (hidden, Hq, Hk, D, rope base, per-head q/k norm)
    "llama3_8b": (4096, 32, 8, 128, 500000.0, False),
    "qwen3_8b": (4096, 32, 8, 128, 1000000.0, True),
    # a dry run of this script on CPU tensors in the interpreter (--device cpu --models tiny --tokens 40)
    "tiny": (64, 4, 2, 32, 10000.0, True),
}

# --preset NAME -> the --shapes it stands for
PRESETS = {"long": "llama3_8b:8192,llama3_8b:32768,qwen3_8b:8192,qwen3_8b:32768"}
MODES = ("fwd", "fwd_bwd", "store")

SWEEP = [
    dict(G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(G=2, BLOCK_M=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=5),
    dict(G=2, BLOCK_M=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(G=1, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(G=1, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(G=1, BLOCK_M=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=4, num_warps=8, num_stages=3),
    dict(G=1, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, TMA=True),
    dict(G=1, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=True),
    dict(G=1, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=5, TMA=True),
    dict(G=1, BLOCK_M=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=True),
    dict(G=1, BLOCK_M=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, TMA=True),
    # the packed path: one (G * D, BLOCK_K) box and one wide dot per k step
    dict(G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, PACKED=True),
    dict(G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, PACKED=True),
    dict(G=2, BLOCK_M=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=2, PACKED=True),
    dict(G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=3, PACKED=True),
    dict(G=2, BLOCK_M=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4, PACKED=True),
    dict(G=1, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, PACKED=True),
    dict(G=1, BLOCK_M=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, PACKED=True),
    dict(G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, PACKED=True, WARP_SPEC=True),
    dict(G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, PACKED=True, PERSISTENT=True),
    dict(G=2, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, PACKED=True, PERSISTENT=True),
]


def bench(fn, rep_ms: int) -> float:
    if not torch.cuda.is_available():  # a dry run on CPU: one call, wall time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(model: str, T: int, device, dtype=torch.bfloat16, grad=False):
    hidden, hq, hk, d, base, normed = MODELS[model]
    g = torch.Generator(device="cpu").manual_seed(T)
    x = torch.randn(T, hidden, generator=g).to(device, dtype)
    w = (torch.randn((hq + 2 * hk) * d, hidden, generator=g) / hidden**0.5).to(device, dtype)
    wq = wk = None
    if normed:
        wq = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
        wk = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    for t in (x, w, wq, wk):
        if grad and t is not None:
            t.requires_grad_(True)
    cache = ropekit.cos_sin_cache(d, max(T, 8192), base=base, device=device)
    pos = torch.arange(T, device=device)
    kw = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, q_norm_weight=wq, k_norm_weight=wk)
    return x, w, pos, cache, kw


def run_shape(model: str, T: int, device, rounds: int, rep: int, modes=MODES, only=tuple(VARIANTS)) -> dict:
    hidden, hq, hk, d, _, normed = MODELS[model]
    n = (hq + 2 * hk) * d
    flops = 2.0 * T * n * hidden
    res = {"model": model, "T": T, "hidden": hidden, "Hq": hq, "Hk": hk, "D": d, "norm": normed}

    # correctness first: each fused path against unfused, forward and gradients
    x, w, pos, cache, kw = make(model, T, device, grad=True)
    leaves = [t for t in (x, w, kw["q_norm_weight"], kw["k_norm_weight"]) if t is not None]
    gen = torch.Generator(device="cpu").manual_seed(1)
    grads = None
    outs, gr = {}, {}
    variants = {n: v for n, v in VARIANTS.items() if n in only or n == "unfused"}
    for name, (impl, path) in dict(variants).items():
        qkv_gemm.PATH = path
        try:
            outs[name] = ropekit.rope_qkv_projection(x, w, pos, cache, impl=impl, **kw)
            if grads is None:
                grads = [torch.randn(o.shape, generator=gen).to(device, o.dtype) for o in outs[name]]
            gr[name] = torch.autograd.grad(outs[name], leaves, grads)
        except Exception as e:  # a path this Triton cannot compile: reported, not timed
            if name == "unfused":
                raise
            res[f"error_{name}"] = f"{type(e).__name__}: {e}"[:300]
            print(f"{model} T={T}: {name} failed: {res[f'error_{name}']}")
            del variants[name]
            outs.pop(name, None)
    qkv_gemm.PATH = ""
    for name in [n for n in FUSED if n in outs]:
        res[f"max_rel_err_fwd_{name}"] = max(rel_err(a, b) for a, b in zip(outs[name], outs["unfused"]))
        res[f"max_rel_err_grad_{name}"] = max(rel_err(a, b) for a, b in zip(gr[name], gr["unfused"]))
    del outs, gr

    def fwd(name):
        impl, path = VARIANTS[name]

        def f():
            qkv_gemm.PATH = path
            with torch.no_grad():
                ropekit.rope_qkv_projection(x, w, pos, cache, impl=impl, **kw)

        return f

    def linear_fwd():
        with torch.no_grad():
            F.linear(x, w)

    def fb(name):
        impl, path = VARIANTS[name]

        def f():
            qkv_gemm.PATH = path
            o = ropekit.rope_qkv_projection(x, w, pos, cache, impl=impl, **kw)
            torch.autograd.grad(o, leaves, grads)

        return f

    lin_grad = torch.randn(T, n, generator=gen).to(device, x.dtype)

    def linear_fb():
        torch.autograd.grad(F.linear(x, w), (x, w), lin_grad)

    # the paged-cache write: k and v into a 16-token-block cache (slot t for token t), q returned
    k_cache = torch.zeros((T + 15) // 16, 16, hk, d, device=device, dtype=x.dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(T, device=device)

    def store(name):
        impl, path = VARIANTS[name]

        def f():
            qkv_gemm.PATH = path
            with torch.no_grad():
                return ropekit.rope_qkv_projection(
                    x, w, pos, cache, impl=impl, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, **kw
                )

        return f

    if "store" in modes:  # each fused path's q and caches against the unfused write's
        nan = float("nan")  # caches NaN first: a row a write misses (or one it should not touch) shows
        k_cache.fill_(nan), v_cache.fill_(nan)
        want = (store("unfused")(), k_cache.clone(), v_cache.clone())
        for name in [n for n in FUSED if n in variants]:
            k_cache.fill_(nan), v_cache.fill_(nan)
            got = (store(name)(), k_cache, v_cache)
            same = all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(got, want))
            err = max(rel_err(a.nan_to_num(), b.nan_to_num()) for a, b in zip(got, want))
            res[f"max_rel_err_store_{name}"] = err if same else float("inf")
        qkv_gemm.PATH = ""

    fns = {
        "fwd": {**{n: fwd(n) for n in variants}, "linear": linear_fwd},
        "fwd_bwd": {**{n: fb(n) for n in variants}, "linear": linear_fb},
        "store": {**{n: store(n) for n in variants}, "linear": linear_fwd},
    }
    for mode, table in fns.items():
        if mode not in modes:
            continue
        times = {k: float("inf") for k in table}
        for _ in range(rounds):
            for k, fn in table.items():
                times[k] = min(times[k], bench(fn, rep))
        mult = 3.0 if mode == "fwd_bwd" else 1.0  # the backward is two more GEMMs of the same size
        for n in FUSED:
            times.setdefault(n, float("nan"))  # a path that failed, or not selected
        fused = [n for n in FUSED if n in variants]
        best = min(fused, key=lambda n: times[n]) if fused else None
        row = {f"{n}_ms": times[n] for n in FUSED}
        row.update(unfused_ms=times["unfused"], linear_ms=times["linear"])
        row.update({f"speedup{SUFFIX[n]}": times["unfused"] / times[n] for n in FUSED})
        row.update(best_fused=best, best_speedup=times["unfused"] / times[best] if best else 0.0)
        row.update({f"{n}_tflops": mult * flops / times[n] / 1e9 for n in FUSED})
        row["linear_tflops"] = mult * flops / times["linear"] / 1e9
        res[mode] = row
    return res


def sweep(models, T: int, device, rep: int, configs=None) -> list:
    rows = []
    for model in models:
        hidden, hq, hk, d, _, normed = MODELS[model]
        x, w, pos, cache, kw = make(model, T, device)
        flops = 2.0 * T * (hq + 2 * hk) * d * hidden
        out = torch.empty(T, hq + 2 * hk, d, device=device, dtype=x.dtype)
        lin = bench(lambda: F.linear(x, w), rep)
        rows.append({"model": model, "T": T, "config": "cuBLAS F.linear", "ms": lin, "tflops": flops / lin / 1e9})
        for cfg in configs or SWEEP:

            def f(cfg=cfg):
                qkv_gemm.qkv_rope_gemm(
                    x, w, pos, cache, out, None, n_q_heads=hq, n_k_heads=hk, head_dim=d, rotary_dim=d,
                    interleaved=False, q_norm_weight=kw["q_norm_weight"], k_norm_weight=kw["k_norm_weight"],
                    config=cfg,
                )  # fmt: skip

            try:
                ms = bench(f, rep)
            except Exception as e:  # a config that does not compile (shared memory, registers)
                rows.append({"model": model, "T": T, "config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            rows.append({"model": model, "T": T, "config": cfg, "ms": ms, "tflops": flops / ms / 1e9})
    return rows


def _config_with(path: str, T: int, model) -> dict:
    """tile_config's choice on a GPU for this model's shape on the given path (knobs applied)."""
    hidden, hq, hk, d = model[:4]
    saved, qkv_gemm.PATH = qkv_gemm.PATH, path
    try:
        return qkv_gemm.tile_config(T, hidden, d, d, hq, hk, True)
    finally:
        qkv_gemm.PATH = saved


def parse_configs(text: str) -> list:
    """--sweep-configs: 'KEY=V,KEY=V;KEY=V,...' -> [{KEY: int V}] (PACKED, TMA, WARP_SPEC, PERSISTENT:
    0 or 1)."""
    configs = []
    for item in (c for c in text.split(";") if c.strip()):
        cfg = {}
        for pair in item.split(","):
            key, _, value = pair.strip().partition("=")
            if not value.lstrip("-").isdigit():
                raise SystemExit(f"--sweep-configs: expected KEY=INT, got {pair.strip()!r}")
            cfg[key] = bool(int(value)) if key in ("PACKED", "TMA", "WARP_SPEC", "PERSISTENT") else int(value)
        missing = {"G", "BLOCK_M", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"} - set(cfg)
        if missing:
            raise SystemExit(f"--sweep-configs: expected keys {sorted(missing)} in {item.strip()!r}")
        configs.append(cfg)
    return configs


def _shapes(a) -> list:
    """[(model, T)] to run: --preset, else --shapes, else every --models x --tokens."""
    text = PRESETS[a.preset] if a.preset else a.shapes
    if text:
        rows = []
        for item in (i for i in text.split(",") if i):
            model, _, t = item.partition(":")
            if model not in MODELS or not t.isdigit():
                raise SystemExit(f"--shapes: expected MODEL:T with MODEL in {sorted(MODELS)}, got {item!r}")
            rows.append((model, int(t)))
        return rows
    return [(m, int(t)) for m in a.models.split(",") if m for t in a.tokens.split(",") if t]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="path of the JSON results (e.g. $OUT/qkv_results.json)")
    p.add_argument("--tokens", default="4096,8192,16384,32768")
    p.add_argument("--models", default="llama3_8b,qwen3_8b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rep", type=int, default=200, help="do_bench's rep (ms of repetitions per timing)")
    p.add_argument("--sweep", action="store_true", help="also time the forward kernel under fixed tile configs")
    p.add_argument("--sweep-tokens", type=int, default=16384)
    p.add_argument(
        "--sweep-configs",
        default=None,
        help="the --sweep's configs instead of SWEEP: 'G=2,BLOCK_M=128,BLOCK_K=64,GROUP_M=8,num_warps=8,"
        "num_stages=3,PACKED=1;...' (PACKED / TMA / WARP_SPEC / PERSISTENT 0 or 1)",
    )
    p.add_argument("--device", default="cuda", help="cuda; cpu for a dry run under TRITON_INTERPRET=1")
    p.add_argument("--shapes", default=None, help="MODEL:T,... rows to run instead of --models x --tokens")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="named --shapes (long: T 8192, 32768)")
    p.add_argument("--modes", default="fwd,fwd_bwd", help="fwd,fwd_bwd,store (which timings to take)")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="fused,fused_tma,fused_packed,unfused (unfused always runs)"
    )
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    shapes = _shapes(a)
    configs = parse_configs(a.sweep_configs) if a.sweep_configs else None
    models = list(dict.fromkeys(m for m, _ in shapes))
    tokens = list(dict.fromkeys(t for _, t in shapes))
    modes = tuple(m for m in a.modes.split(",") if m)
    only = tuple(v for v in a.variants.split(",") if v)
    for name, given, known in (("--modes", modes, MODES), ("--variants", only, tuple(VARIANTS))):
        if not given or not set(given) <= set(known):
            p.error(f"{name}: expected a comma-separated subset of {','.join(known)}, got {','.join(given)!r}")
    start = time.time()
    kind = qkv_api.device_kind(device)
    import triton

    config = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "device_kind": kind,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": "bfloat16",
        "models": {m: dict(zip(("hidden", "Hq", "Hk", "D", "base", "norm"), MODELS[m])) for m in models},
        "tokens": tokens,
        "shapes": [f"{m}:{t}" for m, t in shapes],
        "modes": list(modes),
        "variants": [n for n in VARIANTS if n in only or n == "unfused"],
        "rounds": a.rounds,
        "rep_ms": a.rep,
        "tile_configs": {
            f"{m}{'' if path == 'pointer' else ' ' + path}": _config_with(path, tokens[0], MODELS[m])
            for m in models
            for path in qkv_gemm.PATHS
        },
        "knobs": {k: os.environ[k] for k in ("ROPEKIT_QKV_PATH", *qkv_gemm.KNOBS) if k in os.environ},
    }
    results = []
    head = (
        f"{'model':<10} {'T':>6} {'mode':<8} {'fused ms':>9} {'tma ms':>9} {'packed ms':>9} {'unfused':>9} "
        f"{'linear':>9} {'speedup':>8} {'tma':>7} {'packed':>7} {'fused TF/s':>10} {'tma TF/s':>9} "
        f"{'packed TF/s':>11} {'cuBLAS TF/s':>11}"
    )
    print(head)
    for model, T in shapes:
        r = run_shape(model, T, device, a.rounds, a.rep, modes, only)
        results.append(r)
        for mode in modes:
            m = r[mode]
            print(
                f"{model:<10} {T:>6} {mode:<8} {m['fused_ms']:>9.3f} {m['fused_tma_ms']:>9.3f} "
                f"{m['fused_packed_ms']:>9.3f} {m['unfused_ms']:>9.3f} {m['linear_ms']:>9.3f} "
                f"{m['speedup']:>7.3f}x {m['speedup_tma']:>6.3f}x {m['speedup_packed']:>6.3f}x "
                f"{m['fused_tflops']:>10.0f} {m['fused_tma_tflops']:>9.0f} {m['fused_packed_tflops']:>11.0f} "
                f"{m['linear_tflops']:>11.0f}"
            )
        errs = ", ".join(
            f"{n}: forward {r[f'max_rel_err_fwd_{n}']:.2e}, grads {r[f'max_rel_err_grad_{n}']:.2e}"
            for n in FUSED
            if f"max_rel_err_fwd_{n}" in r
        )
        print(f"{'':<17} rel. err vs unfused: {errs}")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    auto, paths = {}, {}
    for r in results:
        for mode, train in (("fwd", False), ("fwd_bwd", True)):
            if mode not in r:
                continue
            key = (kind, qkv_api.shape_class(r["T"], r["hidden"], r["Hq"], r["Hk"], r["D"], r["norm"], train))
            auto[key] = "fused" if r[mode]["best_speedup"] >= 1.02 else "unfused"
            paths[key] = r[mode]["best_fused"]
    print("\nsuggested ropekit.api.qkv.AUTO_TABLE entries:")
    print("{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in auto.items()) + "}")
    n_fused = sum(v == "fused" for v in auto.values())
    for name, path in (("fused_tma", "tma"), ("fused_packed", "packed")):
        n = sum(1 for k, v in auto.items() if v == "fused" and paths[k] == name)
        print(
            f"fused entries fastest on the {path} path: {n} of {n_fused} "
            f"(taken with ROPEKIT_QKV_PATH={path} or ropekit.kernels.qkv_gemm.PATH = {path!r})"
        )

    sweep_rows = []
    if a.sweep:
        sweep_rows = sweep(models, a.sweep_tokens, device, a.rep, configs)
        print(f"\nforward kernel under fixed tile configs, T={a.sweep_tokens}:")
        for row in sweep_rows:
            what = (
                row["config"]
                if isinstance(row["config"], str)
                else " ".join(f"{k}={v}" for k, v in row["config"].items())
            )
            if "error" in row:
                print(f"  {row['model']:<10} {what:<70} {row['error']}")
            else:
                print(f"  {row['model']:<10} {what:<70} {row['ms']:8.3f} ms {row['tflops']:6.0f} TF/s")

    config["seconds"] = round(time.time() - start, 1)
    doc = {
        "config": config,
        "results": results,
        "auto_table": [
            {"device_kind": k[0], "shape_class": list(k[1]), "impl": v, "faster_fused_path": paths[k]}
            for k, v in auto.items()
        ],
        "sweep": sweep_rows,
    }
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwrote {a.out} ({config['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
