"""python -m ropekit.selfcheck: every op against the float64 reference, as a table.

On a CUDA machine the compiled kernels run, followed by a short speed table (percent of measured
copy bandwidth, via ropekit.bench --quick). Without CUDA the Triton kernels run in the interpreter
on CPU tensors (TRITON_INTERPRET=1 is set before the kernels load), so the same code is checked.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ropekit  # noqa: E402
from ropekit import reference  # noqa: E402


def _cache(max_position, rotary_dim, device):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    f = torch.arange(max_position, dtype=torch.float64)[:, None] * inv
    return torch.cat((f.cos(), f.sin()), -1).float().to(device)


def _rel(out, ref):
    out = out.double().cpu()
    ref = ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def _cases(device):
    """(name, run) pairs; run() returns the list of (output, float64 reference) pairs."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    def rope_case(T, Hq, Hk, D, rot, **kw):
        def run():
            q, k = rnd(T, Hq, D), rnd(T, Hk, D)
            cache = _cache(4096, rot, device)
            shape = (3, T) if kw.get("mrope_section") else (T,)
            pos = torch.randint(0, 4096, shape, generator=g).to(device)
            rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double(), **kw)
            qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
            return [(qo, rq), (ko, rk)]
        return run

    def hf_layout():
        B, S, H, D = 2, 16, 8, 128
        q = rnd(B, H, S, D).transpose(1, 2)
        k = rnd(B, 2, S, D).transpose(1, 2)
        cache = _cache(S, D, device)
        rq, rk = reference.apply_rope(q.double(), k.double(), None, cache.double())
        qo, ko = ropekit.apply_rope(q, k, None, cache)
        return [(qo, rq), (ko, rk)]

    def mla():
        T = 16
        q = rnd(T, 16, 192)
        k = rnd(T, 1, 64)
        cache = _cache(4096, 64, device)
        pos = torch.randint(0, 4096, (T,), generator=g).to(device)
        rq, rk = reference.apply_rope(q[..., 128:].double(), k.double(), pos, cache.double(), interleaved=True)
        ropekit.apply_rope(q[..., 128:], k, pos, cache, interleaved=True, inplace=True)
        return [(q[..., 128:], rq), (k, rk)]

    return [
        ("half-split (Llama)", rope_case(32, 8, 2, 128, 128)),
        ("interleaved (GPT-J/Llama4)", rope_case(32, 8, 2, 128, 128, interleaved=True)),
        ("partial rotary 64/128", rope_case(32, 8, 2, 128, 64)),
        ("head size 80, 28 heads", rope_case(16, 28, 4, 80, 80)),
        ("M-RoPE chunked (Qwen2-VL)", rope_case(16, 4, 2, 128, 128, mrope_section=[16, 24, 24])),
        ("M-RoPE interleaved (Qwen3-VL)", rope_case(16, 4, 2, 128, 128, mrope_section=[24, 20, 20],
                                                   mrope_interleaved=True)),
        ("HF layout (B,H,S,D) views", hf_layout),
        ("MLA strided slice, in place", mla),
    ]


def backend_name(device) -> str:
    if device == "cuda":
        return "triton (CUDA)"
    return "triton interpreter (CPU)" if os.environ.get("TRITON_INTERPRET") == "1" else "pure PyTorch reference (CPU)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropekit.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true", help="skip the speed table on CUDA")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"ropekit {ropekit.__version__} self-check on {device}: {backend_name(device)}; "
          f"torch {torch.__version__}")
    print(f"{'case':34s} {'rel. error':>11s} {'time':>8s}  result")
    failed = 0
    for name, run in _cases(device):
        t0 = time.perf_counter()
        try:
            errs = [_rel(out, ref) for out, ref in run()]
            err = max(errs)
            ok = err < 1e-2
        except Exception as e:  # a crash is a failed check, reported, not hidden
            err, ok = float("nan"), False
            name = f"{name} ({type(e).__name__}: {e})"
        dt = time.perf_counter() - t0
        failed += not ok
        print(f"{name:34s} {err:11.2e} {dt:7.2f}s  {'PASS' if ok else 'FAIL'}")
    print(f"{'all checks passed' if not failed else f'{failed} check(s) FAILED'}")
    if device == "cuda" and not args.no_bench and not failed:
        try:
            from ropekit.bench.__main__ import main as bench_main
        except ImportError as e:
            print(f"speed table skipped: {e}")
        else:
            bench_main(["--quick"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
