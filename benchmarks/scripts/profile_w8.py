"""Usage: PYTHONPATH=src python3 benchmarks/scripts/profile_w8.py

Where W8's time goes: forward + backward through autograd (Llama-3-8B shapes, B=4, S=4096).

Two entry points: apply_rope on (B, S, H, D) tensors with the [cos | sin] table, and the HF drop-in
on (B, H, S, D) views of (B, S, H, D) memory with HF's (B, S, D) bf16 cos/sin. For each, per step:
  host      wall clock of the Python per step (no synchronisation inside the loop)
  events    CUDA events around 50 back-to-back steps, divided by 50 (GPU-bound when host < GPU)
  do_bench  triton.testing.do_bench (events around each step, L2 flushed before it): what the
            benchmark CLI reports; a step whose host time exceeds the GPU's work shows up here
and the GPU time of the kernels themselves (torch.profiler).
"""

import sys

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import ropekit
import ropekit.core.launch
from ropekit import hf
from ropekit.tools.bench.timing import host_us

B, S, HQ, HK, D = 4, 4096, 32, 8, 128
bf = dict(dtype=torch.bfloat16, device="cuda")


def setups():
    q = torch.randn(B, S, HQ, D, **bf).requires_grad_()
    k = torch.randn(B, S, HK, D, **bf).requires_grad_()
    gq, gk = torch.randn(B, S, HQ, D, **bf), torch.randn(B, S, HK, D, **bf)
    cache = ropekit.cos_sin_cache(D, S, device="cuda")

    def table():
        qo, ko = ropekit.apply_rope(q, k, None, cache)
        return torch.autograd.grad((qo, ko), (q, k), (gq, gk))

    qh = torch.randn(B, S, HQ, D, **bf).transpose(1, 2).requires_grad_()
    kh = torch.randn(B, S, HK, D, **bf).transpose(1, 2).requires_grad_()
    gqh, gkh = gq.transpose(1, 2), gk.transpose(1, 2)
    freqs = cache[:S, : D // 2]
    cos = torch.cat([freqs, freqs], -1).to(torch.bfloat16).expand(B, S, D)  # HF's (B, S, D) rows
    sin = torch.cat([cache[:S, D // 2 :]] * 2, -1).to(torch.bfloat16).expand(B, S, D)

    def hf_dropin():
        qo, ko = hf.apply_rotary_pos_emb(qh, kh, cos, sin)
        return torch.autograd.grad((qo, ko), (qh, kh), (gqh, gkh))

    class Empty(torch.autograd.Function):
        """The autograd floor: allocates the outputs and gradients, launches nothing."""

        @staticmethod
        def forward(ctx, q_, k_):
            return torch.empty_like(q_), torch.empty_like(k_)

        @staticmethod
        def backward(ctx, g1, g2):
            return torch.empty_like(g1), torch.empty_like(g2)

    def floor():
        qo, ko = Empty.apply(q, k)
        return torch.autograd.grad((qo, ko), (q, k), (gq, gk))

    return {"apply_rope (table)": table, "hf.apply_rotary_pos_emb": hf_dropin, "empty Function (floor)": floor}


def measure(step):
    n = 50
    host = host_us(step, "cuda", n=n, warmup=10) * 1e-6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    events = start.elapsed_time(end) / n * 1e-3
    bench = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median") * 1e-3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    kernels = sum(e.device_time_total for e in prof.key_averages() if "rope" in e.key) / 10 * 1e-6
    return host, events, bench, kernels


def host_profile(step, n=300):
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(16)


def main():
    floor_bytes = 2 * 2 * B * S * (HQ + HK) * D * 2  # two passes, read + write q and k
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__} triton {triton.__version__}")
    print(f"{'W8 entry point':26s} {'host':>9s} {'events':>9s} {'do_bench':>9s} {'kernels':>9s}  (us per step)")
    for name, step in setups().items():
        host, events, bench, kernels = measure(step)
        print(f"{name:26s} {host * 1e6:9.1f} {events * 1e6:9.1f} {bench * 1e6:9.1f} {kernels * 1e6:9.1f}")
    print(f"floor bytes {floor_bytes / 1e6:.1f} MB; launches {ropekit.core.launch.COUNTS}")
    if "--cprofile" in sys.argv:
        for name, step in setups().items():
            print(f"== cProfile: {name}")
            host_profile(step)


if __name__ == "__main__":
    main()
