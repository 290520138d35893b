"""Usage: ncu --nvtx --nvtx-include "profiled/" [ncu options] python3 benchmarks/scripts/profile_kernels.py NAME [--knob k=v]

One profiled call of a workload, for Nsight Compute: what stands between the kernels and the copy speed.

    ncu --clock-control none --nvtx --nvtx-include "profiled/" --section SpeedOfLight ... \
        python3 benchmarks/scripts/profile_kernels.py W7 [--knob store_head_loop=1]

Warms the call up (compile, plan), then runs it once inside the NVTX range "profiled", so ncu's
--nvtx-include filter profiles exactly that call's kernels. Names: the workloads of tune_core.py
(W1 train_8b, W2 prefill_70b, W4 mrope, W5 llama4, W6 mla, W7 store), W3 (decode, in place), and
W7-compile: the unfused HF formulation of W7 (rotate, then index_copy_ of k and v into the cache
rows) through torch.compile, the peer W7 is measured against (TORCH_LOGS=output_code prints the
code inductor generates for it).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_core import cache, workloads  # noqa: E402

import ropekit  # noqa: E402
from ropekit.core import tuning  # noqa: E402

BF = dict(dtype=torch.bfloat16, device="cuda")


def w7_compile():
    T, c = 16384, cache(65536, 128)
    q, k, v = torch.randn(T, 32, 128, **BF), torch.randn(T, 8, 128, **BF), torch.randn(T, 8, 128, **BF)
    kc = torch.empty(T // 16 * 2, 16, 8, 128, **BF)
    vc = torch.empty_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device="cuda")[:T]
    p = torch.randint(0, 65536, (T,), device="cuda")
    cos, sin = c[p, :64].to(torch.bfloat16).repeat(1, 2), c[p, 64:].to(torch.bfloat16).repeat(1, 2)

    def rot_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    @torch.compile
    def store(q, k, v, cos, sin, k_rows, v_rows, slots):
        cb, sb = cos[:, None, :], sin[:, None, :]
        qo, ko = q * cb + rot_half(q) * sb, k * cb + rot_half(k) * sb
        k_rows.index_copy_(0, slots, ko)
        v_rows.index_copy_(0, slots, v)
        return qo

    kr, vr = kc.view(-1, 8, 128), vc.view(-1, 8, 128)
    return lambda: store(q, k, v, cos, sin, kr, vr, slots)


def w3():
    q, k = torch.randn(64, 32, 128, **BF), torch.randn(64, 8, 128, **BF)
    c, p = cache(65536, 128), torch.randint(0, 65536, (64,), device="cuda")
    return lambda: ropekit.apply_rope(q, k, p, c, inplace=True)


def ptx_memory_ops():
    """Per compiled ropekit kernel (name and constexprs): how many global loads and stores of each
    width its PTX holds (ld.global.v4.b32 is a 16-byte access per thread)."""
    import re

    from ropekit.kernels.rope import rope_kernel
    from ropekit.kernels.store import rope_store_kernel

    for kernel in (rope_kernel, rope_store_kernel):
        for per_device in kernel.device_caches.values():
            for compiled in per_device[0].values():
                ops = re.findall(
                    r"\b(ld|st)\.global(?:\.[a-zA-Z0-9_:]+)*?(\.v[248])?\.(b16|b32|b64|u16|u32|u64|f32)",
                    compiled.asm["ptx"],
                )
                hist = {}
                for op, vec, ty in ops:
                    key = f"{op}{vec or ''}.{ty}"
                    hist[key] = hist.get(key, 0) + 1
                regs = getattr(compiled, "n_regs", None)
                print(f"{compiled.name}: registers {regs}, {dict(sorted(hist.items()))}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--ptx", action="store_true", help="print the global load/store widths of the compiled kernels")
    ap.add_argument("--knob", action="append", default=[], help="name=value (ropekit.core.tuning), repeatable")
    args = ap.parse_args()
    knobs = {}
    for kv in args.knob:
        name, value = kv.split("=")
        knobs[name] = int(value)
    if args.name == "W7-compile":
        fn = w7_compile()
    elif args.name == "W3":
        fn = w3()
    else:
        fn = {n.split()[0]: f for n, (f, _) in workloads().items()}[args.name]
    with tuning.override(**knobs):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profiled")
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    if args.ptx:
        ptx_memory_ops()


if __name__ == "__main__":
    main()
