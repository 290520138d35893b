"""Usage: PYTHONPATH=src python3 benchmarks/scripts/tune_rerotate.py [--out FILE] [--blocks ...] [--warps ...]

Launch-shape sweep of the re-rotation (ropekit.rerotate_kv_cache) on one GPU: for the bench's W12
rows (W12, W12-fp8, W12-2T, W12-mla: the bench's own inputs and byte counts, benchmarks/WORKLOADS.md)
and each (rerotate_block_elems, rerotate_warps) knob pair, the median time and percent of the copy
bandwidth measured in the same run. The 256 MB rows are timed with triton.testing.do_bench (the L2
flushed before each call, as the bench does); W12-mla (17 MB, host-bound when eager) under CUDA-graph
replay. Each setting's output is checked against the bench's float64 expectation once.
"""

import argparse
import json

import torch
import triton
from tune_core import copy_bandwidth  # this folder is on the path of a script run from it

import ropekit
from ropekit.core import tuning
from ropekit.tools.bench import workloads as W
from ropekit.tools.bench.peers import _rerotate_args, _two_tables

ROWS = "W12,W12-fp8,W12-2T,W12-mla"


def call_of(wl, inp):
    cache, view, slots, delta, table, scale = _rerotate_args(inp, wl)
    ks = None if scale is None else torch.tensor([scale], device=cache.device)
    two = _two_tables(inp)
    return lambda: ropekit.rerotate_kv_cache(view, slots, delta, table, interleaved=wl.interleaved, k_scale=ks, **two)


def check(wl, s, table, knobs, device="cuda") -> float:
    """Relative error of one call against the bench's float64 expectation (fresh inputs)."""
    inp = W.make_inputs(wl, s, table, device, seed=11)
    want = W.rerotate_expected(wl, W.clone_inputs(inp))
    with tuning.override(**knobs):
        call_of(wl, inp)()
    got = W.rerotate_canon(wl, inp, (inp["k_cache"],))
    return max(W.rel_err(got[k], want[k]) for k in want)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--blocks", default="1024,2048,4096,8192")
    ap.add_argument("--warps", default="1,2,4,8")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(
        f"device {torch.cuda.get_device_name()}  copy {bw / 1e9:.0f} GB/s  torch {torch.__version__} triton {triton.__version__}"
    )
    print(f"{'row':10s} {'block':>6s} {'warps':>5s} {'us':>8s} {'% copy':>7s} {'rel err':>8s}")
    rows = []
    for wl in W.select(args.rows):
        s = wl.full
        table = W.make_table(wl, s, "cuda")
        inp = W.make_inputs(wl, s, table, "cuda", seed=0)
        nbytes = W.min_bytes(wl, inp)
        fn = call_of(wl, inp)
        for be in [int(x) for x in args.blocks.split(",")]:
            for nw in [int(x) for x in args.warps.split(",")]:
                knobs = dict(rerotate_block_elems=be, rerotate_warps=nw)
                err = check(wl, s, table, knobs)
                with tuning.override(**knobs):
                    fn()  # compile and plan outside the timing (and the capture)
                    torch.cuda.synchronize()
                    if wl.graph:
                        t = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e-3
                    else:
                        t = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
                r = dict(row=wl.id, block_elems=be, warps=nw, us=t * 1e6, pct=100 * nbytes / t / bw, rel_err=err)
                rows.append(r)
                print(f"{wl.id:10s} {be:6d} {nw:5d} {r['us']:8.1f} {r['pct']:6.1f}% {err:8.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
