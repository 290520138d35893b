"""ropekit's CPU path against Hugging Face's apply_rotary_pos_emb, on CPU tensors.

    python benchmarks/cpu_vs_hf.py [--threads 1,2,16] [--dtypes fp32,bf16] [--min-time 0.5] [--quick]

Each row times, in one process and interleaved call by call (so that a noisy host slows all
columns alike), three ways of rotating q and k of Hugging Face's layout (B, H, S, D), views of
(B, S, H, D) projections, with cos / sin as `LlamaRotaryEmbedding` returns them:

    HF        transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    hf        ropekit.hf.apply_rotary_pos_emb(q, k, cos, sin), the drop-in
    apply     ropekit.apply_rope(q', k', None, table) on the (B, S, H, D) tensors q', k' behind
              those views, with a float32 [cos | sin] table

Cells: median microseconds of single calls, and the ratio to HF (below 1: ropekit is faster).
TRITON_INTERPRET is removed before ropekit loads: this is the pure-PyTorch path CPU users get.
Each ropekit output is checked against HF's before it is timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

import ropekit  # noqa: E402
import ropekit.hf  # noqa: E402

SIZES = ((1, 8, 128, 64), (1, 32, 512, 128), (4, 32, 2048, 128))  # (B, H, S, D)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def hf_inputs(B, H, S, D, dtype):
    """q, k as HF's attention holds them, cos / sin from LlamaRotaryEmbedding, and the
    (B, S, H, D) tensors behind q and k."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D, max_position_embeddings=max(S, 2048))
    rotary = LlamaRotaryEmbedding(config)
    g = torch.Generator().manual_seed(0)
    q_bshd = torch.randn(B, S, H, D, generator=g).to(dtype)
    k_bshd = torch.randn(B, S, H, D, generator=g).to(dtype)
    positions = torch.arange(S)[None]  # what LlamaModel passes: cache_position.unsqueeze(0)
    cos, sin = rotary(q_bshd, positions)
    return q_bshd, k_bshd, q_bshd.transpose(1, 2), k_bshd.transpose(1, 2), cos, sin


def interleaved_samples(fns, min_s: float, max_reps: int):
    """Wall-clock seconds of single calls of each fn, calling them in turn (after one warm-up
    call each) until min_s has passed or max_reps rounds are done (at least 5 rounds)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    start = time.perf_counter()
    rounds = 0
    while rounds < max_reps and (rounds < 5 or time.perf_counter() - start < min_s):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        rounds += 1
    return [statistics.median(t) * 1e6 for t in times]


def check(got, want, dtype):
    """Same rotation as HF's (HF's float32 angles drift by ~1e-4 at position 2048; its bf16 math
    rounds after every op)."""
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)


def row(size, dtype, min_s, max_reps):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, H, S, D = size
    q_bshd, k_bshd, q, k, cos, sin = hf_inputs(B, H, S, D, dtype)
    table = ropekit.cos_sin_cache(D, S)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    check(ropekit.hf.apply_rotary_pos_emb(q, k, cos, sin), want, dtype)
    got = ropekit.apply_rope(q_bshd, k_bshd, None, table)
    check([x.transpose(1, 2) for x in got], want, dtype)
    with torch.no_grad():
        return interleaved_samples(
            [
                lambda: apply_rotary_pos_emb(q, k, cos, sin),
                lambda: ropekit.hf.apply_rotary_pos_emb(q, k, cos, sin),
                lambda: ropekit.apply_rope(q_bshd, k_bshd, None, table),
            ],
            min_s,
            max_reps,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1, 2, 16 where present)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of calls per row (at least 5 rounds)")
    p.add_argument("--max-reps", type=int, default=2000, help="most rounds per row")
    p.add_argument("--quick", action="store_true", help="the two small sizes only")
    args = p.parse_args(argv)
    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [t for t in (1, 2, 16) if t <= cores]
    sizes = SIZES[:2] if args.quick else SIZES
    print(f"torch {torch.__version__}, ropekit {ropekit.__version__}, {cores} cores; median us of single calls")
    header = f"{'B x H x S x D':16s} {'dtype':5s} {'thr':>3s} {'HF us':>9s} {'hf us':>9s} {'ratio':>6s} "
    header += f"{'apply us':>9s} {'ratio':>6s}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for n in threads:
        torch.set_num_threads(n)
        for size in sizes:
            for name in args.dtypes.split(","):
                hf_us, drop_us, apply_us = row(size, DTYPES[name], args.min_time, args.max_reps)
                worst = max(worst, drop_us / hf_us, apply_us / hf_us)
                print(
                    f"{'x'.join(map(str, size)):16s} {name:5s} {n:3d} {hf_us:9.1f} {drop_us:9.1f} "
                    f"{drop_us / hf_us:6.2f} {apply_us:9.1f} {apply_us / hf_us:6.2f}",
                    flush=True,
                )
    print(
        f"HF: transformers' apply_rotary_pos_emb; hf: ropekit.hf drop-in; apply: ropekit.apply_rope; worst ratio {worst:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
