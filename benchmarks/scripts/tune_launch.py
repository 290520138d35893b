"""Usage: PYTHONPATH=src python3 benchmarks/scripts/tune_launch.py [--out DIR] [--only decode,store]

Launch-shape sweeps for the launch-bound decode calls and the fused store, on one GPU.

decode: W3 (T=64, Hq=32, Hk=8, D=128, random positions, in place) under CUDA-graph replay, with
        one input set (a graph of 100 calls on the same tensors: the data stays in L2) and with 192
        rotating sets (a graph of one call per set), and W7-T64 (the fused store) likewise with one
        set; per (decode_block_elems, warps, programmatic dependent launch).
        The floor beside it: an empty Triton kernel captured 100 times.
store:  W7 (T=16384, Llama-3-8B heads, block 16, shuffled slots) per (program per head block or
        per token, elements per block, warps): median time and percent of the copy bandwidth.
"""

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_core import cache, copy_bandwidth, nbytes  # noqa: E402

import ropekit  # noqa: E402
from ropekit.core import tuning  # noqa: E402
from ropekit.tools.bench import timing  # noqa: E402

BF = dict(dtype=torch.bfloat16, device="cuda")


@triton.jit
def _empty(x_ptr):
    pass


def graph_us(calls, reps=1):
    """Microseconds per call: a graph of `calls` (a list of thunks), each repeated reps times."""
    return timing.graph_ms(calls, 20, 200, calls_per_set=reps) * 1e3


def decode_sets(n):
    c = cache(65536, 128)
    sets = []
    for _ in range(n):
        q, k = torch.randn(64, 32, 128, **BF), torch.randn(64, 8, 128, **BF)
        p = torch.randint(0, 65536, (64,), device="cuda")
        sets.append(lambda q=q, k=k, p=p: ropekit.apply_rope(q, k, p, c, inplace=True))
    return sets


def store_call(T, positions="random"):
    c = cache(65536, 128)
    q, k, v = torch.randn(T, 32, 128, **BF), torch.randn(T, 8, 128, **BF), torch.randn(T, 8, 128, **BF)
    kc = torch.empty(max(T // 16 * 2, 8), 16, 8, 128, **BF)
    vc = torch.empty_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device="cuda")[:T]
    p = torch.randint(0, 65536, (T,), device="cuda")
    return (lambda: ropekit.apply_rope_and_store(q, k, v, p, c, kc, vc, slots)), 2 * nbytes(q, k, v)


def sweep_decode(rows):
    x = torch.empty(1, device="cuda")
    floor = graph_us([lambda: _empty[(1,)](x)], reps=100)
    print(f"empty Triton kernel, graph of 100: {floor:.2f} us per launch", flush=True)
    one, rot = decode_sets(1), decode_sets(192)
    st64, _ = store_call(64)
    print(f"{'elems':>6s} {'warps':>5s} {'pdl':>3s} {'W3 one set':>10s} {'W3 192 sets':>11s} {'W7-T64 one':>10s}")
    for pdl in (False, True):
        for be in (256, 512, 1024, 2048, 4096):
            for nw in (1, 2, 4, 8):
                with tuning.override(decode_block_elems=be, num_warps=nw, pdl=pdl):
                    r = dict(
                        sweep="decode",
                        elems=be,
                        warps=nw,
                        pdl=pdl,
                        w3_one_us=graph_us(one, reps=100),
                        w3_rot_us=graph_us(rot),
                        w7_t64_one_us=graph_us([st64], reps=100),
                        floor_us=floor,
                    )
                rows.append(r)
                print(
                    f"{be:6d} {nw:5d} {int(pdl):3d} {r['w3_one_us']:10.2f} {r['w3_rot_us']:11.2f} "
                    f"{r['w7_t64_one_us']:10.2f}",
                    flush=True,
                )


def sweep_store(rows, bw):
    fn, b = store_call(16384)
    print(f"{'loop':>4s} {'elems':>6s} {'warps':>5s} {'us':>8s} {'% copy':>7s}")
    for loop in (False, True):
        for be in (1024, 2048, 4096):
            for nw in (1, 2, 4):
                with tuning.override(store_head_loop=loop, num_warps=nw, store_block_elems=be):
                    t = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
                r = dict(sweep="store", loop=loop, elems=be, warps=nw, us=t * 1e6, pct=100 * b / t / bw)
                rows.append(r)
                print(f"{int(loop):4d} {be:6d} {nw:5d} {r['us']:8.1f} {r['pct']:6.1f}%", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="decode,store")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    if "decode" in args.only:
        sweep_decode(rows)
    if "store" in args.only:
        sweep_store(rows, bw)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_launch.json"), "w") as f:
            json.dump(dict(copy_bw=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
