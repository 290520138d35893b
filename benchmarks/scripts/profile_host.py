"""Usage: PYTHONPATH=src python3 benchmarks/scripts/profile_host.py [--out FILE.json] [--stub-launch]

Host time of one steady-state eager call of each op, beside the floors measured in the same run on
the same host: the direct launch of the same compiled kernel with its arguments prebuilt (what any
Python caller of that kernel pays), Triton's generic launch of an empty kernel, and an in-place
ATen op on the same q; for the out-of-place call also the allocation of its two outputs
(torch.empty_like, timed alone), which the direct launch does not pay. Needs CUDA. The calls: W3
(64 decode tokens, Llama-3-8B heads, bf16, fp32 table) in place and out of place, W7-T64's fused
store into a paged bf16 cache, and a re-rotation of 64 cached rows (W12's form). Each figure: the
median of 7 batches (min and max beside it).

--stub-launch (no GPU needed; CPU tensors, the Triton interpreter plans the calls): ropekit's Python
per call with the kernel run replaced by a no-op. The call goes its whole steady-state path, the
launch function's argument packing included (ropekit.core.launch's host_only state); only the
compiled launcher's run is a Python no-op. Each figure is the minimum over --rounds rounds of
--calls calls (the machine may be shared), beside the no-op run called alone with the same
arguments; their difference is the Python above the direct launch.
"""

import argparse
import json
import os
import time

import torch

import ropekit
from ropekit.tools.bench import timing


def calls(dev: str) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    T, Hq, Hk, D = 64, 32, 8, 128
    q = torch.randn(T, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, Hk, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, Hk, D, device=dev, dtype=torch.bfloat16, generator=g)
    pos = torch.randint(0, 8192, (T,), device=dev, generator=g)
    cache = ropekit.cos_sin_cache(D, 8192).to(dev)
    blocks, block = 512, 16
    k_cache = torch.zeros(blocks, block, Hk, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(blocks * block, device=dev, generator=g)[:T]
    delta = torch.full((T,), 7, device=dev)
    # each row: (a tensor on the device, the call, the allocation of the outputs it returns new or None)
    return {
        "W3 in place": (q, lambda: ropekit.apply_rope(q, k, pos, cache, inplace=True), None),
        "W3 out of place": (
            q,
            lambda: ropekit.apply_rope(q, k, pos, cache),
            lambda: (torch.empty_like(q), torch.empty_like(k)),
        ),
        "W7-T64 store": (q, lambda: ropekit.apply_rope_and_store(q, k, v, pos, cache, k_cache, v_cache, slots), None),
        "W12 re-rotation": (q, lambda: ropekit.rerotate_kv_cache(k_cache, slots, delta, cache), None),
    }


def _nothing(*args):
    """The stubbed compiled launcher's run: takes the launch's arguments, launches nothing."""


def stub_launch(fn) -> tuple:
    """After one real (interpreted) call of fn: its compiled-kernel cache seeded with an entry whose
    run does nothing, and launch's host_only state on, so later calls of fn go ropekit's direct
    launch path to the end. Returns (the stubbed run, its arguments as the launch passes them)."""
    from triton import knobs

    from ropekit.core import launch as launching
    from ropekit.core import pipeline

    fn()  # spec, plan (and the interpreter's run of the kernel)
    launching._STATE["host_only"] = True  # from here CPU tensors may get a launch record (pipeline.rotate_record)
    seen = []
    real = pipeline.launch
    pipeline.launch = lambda *a, **kw: seen.append(a)
    try:
        fn()
    finally:
        pipeline.launch = real
    assert len(seen) == 1, f"{len(seen)} launches in one call"
    _, compiled, variant, grid, ptrs, args, _ = seen[0]
    addrs = [p.data_ptr() for p in ptrs]
    aligned = tuple(a % 16 == 0 for a in addrs)
    key = (variant, True) if all(aligned) else (variant, *aligned)
    g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    compiled[key] = (_nothing, *g, None, None, (), None)  # ropekit.core.launch's compiled entry
    # a stream getter of no cost; Triton's own runtime knobs (their hook chains, empty), as on a GPU
    launching._STATE["tools"] = (lambda device: 0, knobs.runtime)
    launching.current_device = lambda: -1
    return _nothing, (*g, 0, None, None, None, None, None, *addrs, *args)


def min_us(fn, rounds: int, n: int) -> float:
    """The fastest of `rounds` rounds of n calls, microseconds per call."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
    return best


def stubbed(args) -> None:
    """The --stub-launch mode (CPU)."""
    from ropekit.core import launch as launching

    os.environ.setdefault("TRITON_INTERPRET", "1")
    rows = {}
    for name, (_, fn, _) in calls("cpu").items():
        run, full = stub_launch(fn)
        direct = min_us(lambda: run(*full), args.rounds, args.calls)
        eager = min_us(fn, args.rounds, args.calls)
        rows[name] = {"eager": eager, "stub run": direct, "python": eager - direct}
        print(
            f"{name:18s} eager (launch stubbed) {eager:6.2f} us  stub run {direct:5.2f} us  python above it {eager - direct:6.2f} us",
            flush=True,
        )
        launching._STATE["host_only"] = False
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": "cpu, launch stubbed", "rows": rows}, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--eager-only", action="store_true", help="the eager calls alone (any ropekit version)")
    ap.add_argument("--stub-launch", action="store_true", help="CPU: ropekit's Python per call, the kernel run a no-op")
    ap.add_argument("--rounds", type=int, default=20, help="--stub-launch: timed rounds (the fastest counts)")
    ap.add_argument("--calls", type=int, default=2000, help="--stub-launch: calls per round")
    args = ap.parse_args()
    if args.stub_launch:
        stubbed(args)
        return
    dev = "cuda"
    rows = {}
    for name, (q, fn, outputs) in calls(dev).items():
        fn()
        torch.cuda.synchronize()
        eager = timing.host_us_stats(fn, dev)
        if args.eager_only:
            rows[name] = {"eager": eager}
            print(f"{name:18s} eager {eager['median']:6.2f} us  [{eager['min']:.2f}-{eager['max']:.2f}]", flush=True)
            continue
        direct = timing.direct_launch_floor(fn, dev)
        floors = timing.host_floors(q)
        rows[name] = {"eager": eager, "direct": direct, "launch": floors["launch"], "aten": floors["aten"]}
        d, a = direct.get("median"), floors["aten"]["median"]
        line = f"{name:18s} eager {eager['median']:6.2f} us  [{eager['min']:.2f}-{eager['max']:.2f}]"
        line += f"  direct {d:5.2f} us ({eager['median'] / d:.2f}x)" if d else f"  direct: {direct.get('why')}"
        line += (
            f"  empty launch {floors['launch']['median']:5.2f} us ({eager['median'] / floors['launch']['median']:.2f}x)"
        )
        line += f"  aten {a:5.2f} us; aten + direct {a + (d or 0):5.2f} us"
        if outputs is not None and d:
            # what the call allocates, timed alone: the floor of an out-of-place call is the direct
            # launch plus these allocations (torch.empty_like of each output)
            rows[name]["outputs"] = timing.host_us_stats(outputs, dev)
            o = rows[name]["outputs"]["median"]
            line += f"  outputs {o:5.2f} us; direct + outputs {d + o:5.2f} us ({eager['median'] / (d + o):.2f}x)"
        print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
