"""Usage: PYTHONPATH=src python3 benchmarks/scripts/profile_host.py [--out FILE.json]

Host time of one steady-state eager call of each op, beside the floors measured in the same run on
the same host: the direct launch of the same compiled kernel with its arguments prebuilt (what any
Python caller of that kernel pays), Triton's generic launch of an empty kernel, and an in-place
ATen op on the same q. Needs CUDA. The calls: W3 (64 decode tokens, Llama-3-8B heads, bf16, fp32
table) in place and out of place, W7-T64's fused store into a paged bf16 cache, and a re-rotation
of 64 cached rows (W12's form). Each figure: the median of 7 batches (min and max beside it).
"""

import argparse
import json

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
    return {
        "W3 in place": (q, lambda: ropekit.apply_rope(q, k, pos, cache, inplace=True)),
        "W3 out of place": (q, lambda: ropekit.apply_rope(q, k, pos, cache)),
        "W7-T64 store": (q, lambda: ropekit.apply_rope_and_store(q, k, v, pos, cache, k_cache, v_cache, slots)),
        "W12 re-rotation": (q, lambda: ropekit.rerotate_kv_cache(k_cache, slots, delta, cache)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--eager-only", action="store_true", help="the eager calls alone (any ropekit version)")
    args = ap.parse_args()
    dev = "cuda"
    rows = {}
    for name, (q, fn) in calls(dev).items():
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
        print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
