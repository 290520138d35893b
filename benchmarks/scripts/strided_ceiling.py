"""Usage: PYTHONPATH=src python3 benchmarks/scripts/strided_ceiling.py

The access-pattern ceiling of W6: how fast can any kernel read and write back W6's
bytes, the last 64 of every 192 bf16 elements of q (T=16384, 128 heads), without rotating them?

Times, as percent of the device-to-device copy bandwidth (bytes read + written), over the same
(T, 128, 64-of-192) views: a Triton kernel that loads the 128-byte slices and stores them back in
place (what W6's rotation must move, nothing computed), the same into a contiguous buffer, torch's
own copy_ between two such views, and ropekit's W6 call itself. If the in-place copy kernel is no
faster than ropekit, the rotation is at the pattern's ceiling.
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_core import copy_bandwidth  # noqa: E402

import ropekit  # noqa: E402


@triton.jit
def _slice_copy(
    x_ptr,  # source: (T, H, >= D) rows, last dim unit stride
    y_ptr,  # destination rows (x_ptr itself for in place)
    n_heads,  # H
    stride_x_token,  # x's stride between tokens, in elements
    stride_x_head,  # x's stride between heads
    stride_y_token,  # y's strides likewise
    stride_y_head,
    D: tl.constexpr,  # elements per slice
    BLOCK_H: tl.constexpr,  # heads per program
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, D)[None, :]
    m = h[:, None] < n_heads
    h64 = h.to(tl.int64)[:, None]
    x = tl.load(x_ptr + t * stride_x_token + h64 * stride_x_head + j, mask=m)
    tl.store(y_ptr + t * stride_y_token + h64 * stride_y_head + j, x, mask=m)


def pct(fn, nbytes, bw):
    t = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
    return 100 * nbytes / t / bw, t * 1e6


def main():
    bf = dict(dtype=torch.bfloat16, device="cuda")
    bw = copy_bandwidth()
    T, H = 16384, 128
    q = torch.randn(T, H, 192, **bf)
    q2 = torch.randn(T, H, 192, **bf)
    out = torch.empty(T, H, 64, **bf)
    k = torch.randn(T, 1, 64, **bf)
    x = q[..., 128:]
    nbytes = 2 * x.numel() * 2
    c = ropekit.cos_sin_cache(64, 65536, device="cuda")
    p = torch.randint(0, 65536, (T,), device="cuda")
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s")
    for bh in (16, 32, 64, 128):
        for nw in (2, 4, 8):

            def inplace(bh=bh, nw=nw):
                _slice_copy[(T, triton.cdiv(H, bh))](x, x, H, *x.stride()[:2], *x.stride()[:2], 64, bh, num_warps=nw)

            def to_dense(bh=bh, nw=nw):
                _slice_copy[(T, triton.cdiv(H, bh))](
                    x, out, H, *x.stride()[:2], *out.stride()[:2], 64, bh, num_warps=nw
                )

            a, ta = pct(inplace, nbytes, bw)
            b, tb = pct(to_dense, nbytes, bw)
            print(
                f"Triton slice copy, {bh:3d} heads/program, {nw} warps: in place {a:5.1f}% ({ta:6.1f} us)   "
                f"to a dense buffer {b:5.1f}% ({tb:6.1f} us)",
                flush=True,
            )
    a, ta = pct(lambda: q2[..., 128:].copy_(x), nbytes, bw)
    print(f"torch copy_ between two such views: {a:5.1f}% ({ta:6.1f} us)")
    nb6 = nbytes + 2 * k.numel() * 2
    a, ta = pct(lambda: ropekit.apply_rope(x, k, p, c, interleaved=True, inplace=True), nb6, bw)
    print(f"ropekit W6 (rotation in place, with k_pe): {a:5.1f}% ({ta:6.1f} us)")


if __name__ == "__main__":
    main()
