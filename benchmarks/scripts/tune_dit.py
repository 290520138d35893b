"""Usage: PYTHONPATH=src python3 benchmarks/scripts/tune_dit.py [--settings NAME,...] [--workloads W13,...] [--tiny] [--out FILE]

The image / video prologue's knob sweep (benchmarks/PERF_LOG.md): W13, W13-FB, W14, W14-FB, W15 and,
as regression guards, W1, W2 and W9 / W9-FB (Qwen3's per-head norm: its weight reads changed too),
run by the bench's own code (ropekit.tools.bench: its workload builders, its float64 check and its
timer, `runner.run_one`: CUDA events, L2 flushed, median), once per knob setting of
ropekit.core.tuning below. Prints one markdown table: percent of the copy bandwidth measured in the
same run and microseconds, a row per setting, a column per workload, and a last row with each
workload's same-size copy (percent of the large copy; a cell's percent of its same-size copy is its
percent over that one). A cell whose outputs miss the float64 reference says WRONG and why. W15, W1
and W2 change only under per-tensor (head_loop is every launch's knob); the other rows touch
normed launches only (W9's included), so their W15 / W1 / W2 cells show the run's noise. About 4
minutes on an H200.

--tiny: a few tokens per workload (TINY), forced without CUDA, where the kernels run in the Triton
interpreter (set here) and cells are CPU wall-clock times: a dry run of the script (every setting's
outputs still checked against float64), not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # a dry run: the kernels themselves, interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ropekit.core import tuning  # noqa: E402
from ropekit.tools.bench import peers as P  # noqa: E402
from ropekit.tools.bench import runner, timing  # noqa: E402
from ropekit.tools.bench import workloads as W  # noqa: E402

WORKLOADS = ("W13", "W13-FB", "W14", "W14-FB", "W15", "W1", "W2", "W9", "W9-FB")

# --tiny: each workload's shape with a few tokens (the bench's quick sizes take minutes interpreted)
TINY = {
    "W13": dict(B=1, Txt=4, Hp=2, Wp=4, H=24, D=128),
    "W14": dict(B=1, F=1, Hp=2, Wp=3, H=40, D=128),
    "W15": dict(B=1, Hp=2, H=16, D=64),
    "W1": dict(B=1, S=8, Hq=32, Hk=8, D=128, P=64),
    "W2": dict(T=8, Hq=64, Hk=8, D=128, P=64),
    "W9": dict(B=1, S=8, Hq=32, Hk=8, D=128, P=64),
}

# name -> knobs (ropekit.core.tuning; the table shows them as ROPEKIT_* variables); "defaults" first
SETTINGS = {
    "defaults": {},
    "blocks": dict(whole_heads=False),  # the small blocks whole heads replace (pair-word weights kept)
    "blocks-elemw": dict(whole_heads=False, weight_pairs=False),  # and element weight loads
    "elemw": dict(weight_pairs=False),
    "noprefetch": dict(prefetch=False),
    "per-tensor": dict(head_loop=False),  # a program per (token, tensor), angles computed twice
    "fwd-w2": dict(norm_warps=2),
    "fwd-w1": dict(norm_warps=1),
    "fwd-w4": dict(norm_warps=4),
    "per-tensor-w1": dict(head_loop=False, norm_warps=1),
    "per-tensor-w4": dict(head_loop=False, norm_warps=4),
    "w8": dict(norm_warps=8, norm_bwd_warps=8),
    "bwd-p264": dict(norm_bwd_programs=264),  # two programs an SM of 132, one wave
    "bwd-p4096": dict(norm_bwd_programs=4096),
    "whole-all": dict(whole_heads=True),  # per-head backwards whole too
}


def env(knobs: dict) -> str:
    """knobs as the environment variables that set them for a process."""
    if not knobs:
        return "(the shipped rules)"
    return " ".join(f"ROPEKIT_{k.upper()}={int(v) if isinstance(v, bool) else v}" for k, v in knobs.items())


def measure(wl, settings, device, copy_gbps, cfg, log):
    """{setting: run_one's record} for one workload, its inputs and float64 reference built once;
    and its same-size copy (timing.same_size_copy)."""
    s = wl.sizes(cfg.quick)
    table = W.make_table(wl, s, device)
    base = W.make_inputs(wl, s, table, device, cfg.seed)
    nbytes = W.min_bytes(wl, base)
    exp = W.expected(wl, base, W.Oracle())
    same = timing.same_size_copy(device, nbytes, cfg.warmup_ms, cfg.rep_ms)
    peer = P.Ropekit()
    recs = {}
    for name in settings:
        t0 = time.perf_counter()
        with tuning.override(**SETTINGS[name]):
            recs[name] = runner.run_one(peer, wl, base, exp, [], nbytes, copy_gbps, device, cfg)
        r = recs[name]
        log(f"{wl.id:7s} {name:12s} {r['status']:6s} {r['time_us'] or 0:10.1f} us  ({time.perf_counter() - t0:.1f} s)")
    del base, exp, table
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return recs, same


def cell(r, same_pct, cuda):
    if r["status"] != "ok":
        return f"{r['status'].upper()}: {r['reason'][:60]}"
    if not cuda:
        return f"{r['time_us']:.0f} us (CPU)"
    out = f"{r['pct_copy']:.1f}% ({r['time_us']:.1f} us)"
    if same_pct < 95:  # a small transfer: its own copy is below the large one's rate
        out += f" = {100 * r['pct_copy'] / same_pct:.0f}% of same-size"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {list(SETTINGS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of workload ids")
    ap.add_argument("--tiny", action="store_true", help="a few tokens per workload (always on without CUDA)")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--out", default=None, help="also write the records as JSON")
    args = ap.parse_args()
    settings = [n for n in args.settings.split(",") if n]
    unknown = [n for n in settings if n not in SETTINGS]
    if unknown:
        sys.exit(f"--settings: unknown {unknown}; known: {list(SETTINGS)}")
    device = runner.resolve_device("auto")
    cuda = device == "cuda"
    tiny = args.tiny or not cuda
    wls = [W.BY_ID[w] for w in args.workloads.split(",") if w]
    if tiny:  # the workloads' quick sizes, made tiny
        wls = [dataclasses.replace(w, quick=TINY[w.group]) for w in wls]
    cfg = runner.Config(workloads=wls, quick=tiny, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, cpu_row=False)

    def log(line):
        print(line, file=sys.stderr, flush=True)

    copy = timing.copy_bandwidth(device, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms)
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter: not a measurement)"
    log(f"{name}; copy {copy['gbps']:.0f} GB/s; {versions}")
    results, same = {}, {}
    for wl in wls:
        results[wl.id], same[wl.id] = measure(wl, settings, device, copy["gbps"], cfg, log)
    same_pct = {w: 100 * same[w]["gbps"] / copy["gbps"] for w in results}
    print(
        f"\n{name}, copy {copy['gbps']:.0f} GB/s, {versions}; `python3 benchmarks/scripts/tune_dit.py {' '.join(sys.argv[1:])}`\n"
    )
    print("| setting | " + " | ".join(results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for n in settings:
        print(
            f"| {n}: {env(SETTINGS[n])} | " + " | ".join(cell(results[w][n], same_pct[w], cuda) for w in results) + " |"
        )
    print(
        "| same-size copy | " + " | ".join(f"{same_pct[w]:.1f}% ({same[w]['time_us']:.1f} us)" for w in results) + " |"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy=copy, same_size=same, results=results, settings=SETTINGS), f, indent=1, default=str)


if __name__ == "__main__":
    main()
