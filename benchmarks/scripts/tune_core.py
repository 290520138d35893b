"""Usage: PYTHONPATH=src python3 benchmarks/scripts/tune_core.py [--out DIR]

Tile-size sweep and core numbers for apply_rope on one GPU (the tuning log's source).

For each workload of benchmarks/WORKLOADS.md that apply_rope serves (W1, W2, W4, W5, W6) and each
(block elements, warps) setting: median time (triton.testing.do_bench) and percent of the copy
bandwidth measured in the same run. W3 (decode) is timed under CUDA-graph replay, and its host
time per eager call with a wall clock. Prints a table; writes JSON when --out is given.
"""

import argparse
import json
import os

import torch
import triton

import ropekit
from ropekit.core import launch, tuning
from ropekit.tools.bench.timing import host_us


def copy_bandwidth(nbytes=2 * 2**30):
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median") * 1e-3
    return 2 * nbytes / t


def cache(max_pos, rot):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.cat((f.cos(), f.sin()), -1).float().cuda()


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def workloads():
    bf = dict(dtype=torch.bfloat16, device="cuda")
    W = {}
    B, S = 4, 4096
    # (B, S, H, D) memory as a model's projections write it, the bench's W1 (a (B, H, S, D) tensor
    # transposed would put a token's heads S * D apart: another call)
    q = torch.randn(B, S, 32, 128, **bf)
    k = torch.randn(B, S, 8, 128, **bf)
    c = cache(S, 128)
    W["W1 train_8b"] = (lambda q=q, k=k, c=c: ropekit.apply_rope(q, k, None, c), 2 * nbytes(q, k))
    T = 32768
    q = torch.randn(T, 64, 128, **bf)
    k = torch.randn(T, 8, 128, **bf)
    c = cache(T, 128)
    p = torch.arange(T, device="cuda")
    W["W2 prefill_70b"] = (lambda q=q, k=k, c=c, p=p: ropekit.apply_rope(q, k, p, c), 2 * nbytes(q, k))
    T = 16384
    q = torch.randn(T, 28, 128, **bf)
    k = torch.randn(T, 4, 128, **bf)
    c = cache(65536, 128)
    p = torch.randint(0, 65536, (3, T), device="cuda")
    W["W4 mrope"] = (
        lambda q=q, k=k, c=c, p=p: ropekit.apply_rope(q, k, p, c, mrope_section=[16, 24, 24]),
        2 * nbytes(q, k),
    )
    q = torch.randn(T, 40, 128, **bf)
    k = torch.randn(T, 8, 128, **bf)
    p = torch.randint(0, 65536, (T,), device="cuda")
    W["W5 llama4"] = (lambda q=q, k=k, c=c, p=p: ropekit.apply_rope(q, k, p, c, interleaved=True), 2 * nbytes(q, k))
    qf = torch.randn(T, 128, 192, **bf)
    k = torch.randn(T, 1, 64, **bf)
    c64 = cache(65536, 64)
    # W7: fused store, Llama-3-8B heads, paged cache (block 16) with shuffled slots
    q7 = torch.randn(T, 32, 128, **bf)
    k7 = torch.randn(T, 8, 128, **bf)
    v7 = torch.randn(T, 8, 128, **bf)
    kc = torch.empty(T // 16 * 2, 16, 8, 128, **bf)
    vc = torch.empty_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device="cuda")[:T]
    W["W7 store"] = (
        lambda: ropekit.apply_rope_and_store(q7, k7, v7, p, c, kc, vc, slots),
        nbytes(q7, k7, v7) + nbytes(q7, k7, v7),
    )
    W["W6 mla"] = (
        lambda q=qf[..., 128:], k=k, c=c64, p=p: ropekit.apply_rope(q, k, p, c, interleaved=True, inplace=True),
        2 * (T * 128 * 64 * 2 + nbytes(k)),
    )
    return W


def strided_copy_seconds_inverse(bw):
    """Fraction of the copy bandwidth torch's own copy of W6's (T, 128, 64-of-192) views reaches."""
    src = torch.randn(16384, 128, 192, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = (
        triton.testing.do_bench(lambda: dst[..., 128:].copy_(src[..., 128:]), warmup=25, rep=200, return_mode="median")
        * 1e-3
    )
    return 2 * 16384 * 128 * 64 * 2 / t / bw


def decode():
    bf = dict(dtype=torch.bfloat16, device="cuda")
    q = torch.randn(64, 32, 128, **bf)
    k = torch.randn(64, 8, 128, **bf)
    c = cache(65536, 128)
    p = torch.randint(0, 65536, (64,), device="cuda")
    fn = lambda: ropekit.apply_rope(q, k, p, c, inplace=True)  # noqa: E731
    host = host_us(fn, "cuda", n=2000, warmup=10) * 1e-6
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    reps = 100
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = triton.testing.do_bench(lambda: g.replay(), warmup=20, rep=200, return_mode="median") * 1e-3 / reps
    return t, host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--blocks", default="1024,2048,4096,8192")
    ap.add_argument("--warps", default="0,2,4,8")
    ap.add_argument(
        "--head-loop",
        default="-1",
        help="comma list of -1 (the default rule), 0, 1: one program per token over all heads",
    )
    ap.add_argument(
        "--prefetch",
        default="-1",
        help="comma list of -1 (the default rule), 0, 1: with the head loop, load the next block "
        "before this one's stores",
    )
    ap.add_argument(
        "--defaults",
        action="store_true",
        help="measure the shipped defaults only (every knob untouched), with each workload's same-size copy beside it",
    )
    ap.add_argument("--only", default="", help="comma list of workload ids (W1,W4,...) to sweep; default: all")
    ap.add_argument("--once", default=None, help="run one call of this workload (for ncu) and exit")
    ap.add_argument("--profile-host", action="store_true", help="cProfile the W3 eager call")
    args = ap.parse_args()
    if args.once:
        fn, _ = workloads()[args.once]
        fn()
        torch.cuda.synchronize()
        return
    if args.profile_host:
        import cProfile
        import pstats

        t, host = decode()
        bf = dict(dtype=torch.bfloat16, device="cuda")
        q, k = torch.randn(64, 32, 128, **bf), torch.randn(64, 8, 128, **bf)
        c, p = cache(65536, 128), torch.randint(0, 65536, (64,), device="cuda")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            ropekit.apply_rope(q, k, p, c, inplace=True)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
        print(f"W3 host {host * 1e6:.1f} us per eager call (graph replay {t * 1e6:.2f} us); launches {launch.COUNTS}")
        return
    bw = copy_bandwidth()
    # the strided-slice ceiling for W6: torch's own copy of the same (T, 128, 64-of-192) views
    print(f"strided copy of W6's q[..., 128:] views: {100 * strided_copy_seconds_inverse(bw):.1f}% of copy")
    print(
        f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s  "
        f"torch {torch.__version__} triton {triton.__version__}"
    )
    W = workloads()
    if args.only:
        W = {n: w for n, w in W.items() if n.split()[0] in args.only.split(",")}
    rows = []

    def measure(be, nw, name, hl=None, pf=None):
        knobs = {}
        if be is not None:
            knobs.update(block_elems=be, decode_block_elems=be, store_block_elems=be, num_warps=nw)
        if pf is not None:
            knobs["prefetch"] = None if pf < 0 else bool(pf)
        if hl is not None:
            knobs["head_loop"] = None if hl < 0 else bool(hl)
        fn, b = W[name]
        with tuning.override(**knobs):
            t = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
        return dict(
            workload=name,
            block_elems=be,
            warps=nw,
            head_loop=-1 if hl is None else hl,
            prefetch=-1 if pf is None else pf,
            us=t * 1e6,
            pct=100 * b / t / bw,
        )

    def show(r):
        print(
            f"{r['workload']:16s} {r['block_elems']:6d} {r['warps']:5d} "
            f"{r['head_loop']:4d} {r['prefetch']:3d} {r['us']:9.1f} {r['pct']:6.1f}%",
            flush=True,
        )

    if args.defaults:
        # the same bytes moved by torch's contiguous copy: the ceiling at each workload's size
        # and the same call under CUDA-graph replay: do_bench's per-call events also count host time
        # whenever the call's Python outlasts the L2 flush before it (seen on W7)
        print(
            f"{'workload (defaults)':20s} {'us':>8s} {'% copy':>7s} {'graph us':>9s} {'% copy':>7s} "
            f"{'same-size copy':>15s}"
        )
        for name, (fn, b) in W.items():
            r = measure(None, None, name)
            g = torch.cuda.Stream()
            with torch.cuda.stream(g):
                fn()  # compile and plan outside the capture
            torch.cuda.synchronize()
            r["graph_us"] = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
            r["graph_pct"] = 100 * b / (r["graph_us"] * 1e-6) / bw
            same = copy_bandwidth(b // 2 // 2 * 2)
            r["same_size_copy_pct"] = 100 * same / bw
            rows.append(r)
            print(
                f"{name:20s} {r['us']:8.1f} {r['pct']:6.1f}% {r['graph_us']:9.1f} {r['graph_pct']:6.1f}% "
                f"{r['same_size_copy_pct']:14.1f}%",
                flush=True,
            )
        args.prefetch = ""
    print(f"{'workload':16s} {'block':>6s} {'warps':>5s} {'loop':>4s} {'pf':>3s} {'us':>9s} {'% copy':>7s}")
    for pf in [int(x) for x in args.prefetch.split(",") if x]:
        for hl in [int(x) for x in args.head_loop.split(",")]:
            for be in [int(x) for x in args.blocks.split(",")]:
                for nw in [int(x) for x in args.warps.split(",")]:
                    for name in W:
                        rows.append(measure(be, nw, name, hl, pf))
                        show(rows[-1])
    best = {}
    for r in rows:
        if r["workload"] not in best or r["us"] < best[r["workload"]]["us"]:
            best[r["workload"]] = r
    if not args.defaults:
        print("best per workload, measured again (the spread is the noise):")
    for r in [] if args.defaults else best.values():
        again = measure(r["block_elems"], r["warps"], r["workload"], r["head_loop"], r["prefetch"])
        print(
            f"  {r['workload']:16s} block {r['block_elems']:5d} warps {r['warps']} "
            f"loop {r['head_loop']} prefetch {r['prefetch']}  "
            f"{r['us']:8.1f} us {r['pct']:5.1f}%   again {again['us']:8.1f} us {again['pct']:5.1f}%"
        )
    t, host = decode()
    print(f"W3 decode_b64: {t * 1e6:.2f} us per call under graph replay; host {host * 1e6:.1f} us per eager call")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_core.json"), "w") as f:
            json.dump(dict(copy_bw=bw, rows=rows, w3_graph_us=t * 1e6, w3_host_us=host * 1e6), f, indent=1)


if __name__ == "__main__":
    main()
