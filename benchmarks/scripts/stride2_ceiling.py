"""Usage: PYTHONPATH=src python3 benchmarks/scripts/stride2_ceiling.py

The access-pattern ceiling of W2-STRIDED: how fast can any kernel move W2's q and k when each is
every other element of a buffer twice as wide (`x[..., ::2]`, last stride 2, bf16), out of place
into contiguous outputs, without rotating them?

Times, as percent of the device-to-device copy bandwidth over the bytes the bench counts for the
row (q and k read once and written once), over W2's shapes (T 32768, 64 q / 8 k heads of 128):

    element   a Triton copy that loads each wanted element through the stride (2-byte loads four
              bytes apart: what the rotation kernel's strided path issues)
    wide      a Triton copy that loads each head's whole 2 x 128 span as 16-byte vectors and keeps
              the even elements (tl.split of a (.., 128, 2) view); it also reads the element after
              the view's last one, which these buffers hold
    torch     torch's own copy_ from the strided views
    ropekit   ropekit's W2-STRIDED call itself: its defaults, then a sweep of its strided launch
              knobs (strided_block_elems, strided_warps) and of a program per head block

If `wide` is well above `element`, vector loads of the span are the step for the kernel's strided
path; if they are equal, the strided path is at its pattern's ceiling.
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from strided_ceiling import pct  # noqa: E402  (percent of copy and us of a call, do_bench's median)
from tune_core import copy_bandwidth  # noqa: E402

import ropekit  # noqa: E402
from ropekit.core import tuning  # noqa: E402


@triton.jit
def _stride2_copy(
    x_ptr,  # source rows: (rows, D) elements at column stride 2 (rows of 2 * D in the buffer)
    y_ptr,  # destination: (rows, D) contiguous
    n_rows,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows (heads) per program
    WIDE: tl.constexpr,  # load the rows' whole 2 * D spans as vectors and keep the even elements
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m = r[:, None] < n_rows
    j = tl.arange(0, D)[None, :]
    if WIDE:
        w = tl.arange(0, 2 * D)[None, :]
        span = tl.load(x_ptr + r[:, None] * (2 * D) + w, mask=m)
        x, _ = tl.split(tl.reshape(span, (BLOCK_R, D, 2)))
    else:
        x = tl.load(x_ptr + r[:, None] * (2 * D) + 2 * j, mask=m)
    tl.store(y_ptr + r[:, None] * D + j, x, mask=m)


def main():
    bf = dict(dtype=torch.bfloat16, device="cuda")
    bw = copy_bandwidth()
    T, Hq, Hk, D = 32768, 64, 8, 128
    qw = torch.randn(T, Hq, 2 * D, **bf)
    kw = torch.randn(T, Hk, 2 * D, **bf)
    q, k = qw[..., ::2], kw[..., ::2]
    qo, ko = torch.empty(T, Hq, D, **bf), torch.empty(T, Hk, D, **bf)
    nbytes = 2 * (q.numel() + k.numel()) * 2
    c = ropekit.cos_sin_cache(D, T, device="cuda")
    p = torch.arange(T, device="cuda")
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s")
    for wide in (False, True):
        for br in (4, 8, 16):
            for nw in (2, 4, 8):

                def run(br=br, nw=nw, wide=wide):
                    for src, dst, h in ((qw, qo, Hq), (kw, ko, Hk)):
                        _stride2_copy[(triton.cdiv(T * h, br),)](src, dst, T * h, D, br, wide, num_warps=nw)

                run()
                assert torch.equal(qo, q) and torch.equal(ko, k)
                a, ta = pct(run, nbytes, bw)
                name = "wide" if wide else "element"
                print(f"{name:8s} {br:2d} heads/program, {nw} warps: {a:5.1f}% ({ta:6.1f} us)", flush=True)
    a, ta = pct(lambda: (qo.copy_(q), ko.copy_(k)), nbytes, bw)
    print(f"torch    copy_ from the strided views: {a:5.1f}% ({ta:6.1f} us)")
    a, ta = pct(lambda: ropekit.apply_rope(q, k, p, c, q_out=qo, k_out=ko), nbytes, bw)
    print(f"ropekit  W2-STRIDED (q_out= / k_out=), its defaults: {a:5.1f}% ({ta:6.1f} us)")
    # the launch knobs of a strided plain rotation (ropekit.core.tuning), and a program per head block
    for head_loop in (None, False):
        for elems in (256, 512, 1024, 2048):
            for nw in (1, 2, 4):
                knobs = dict(strided_block_elems=elems, strided_warps=nw)
                if head_loop is False:  # no head loop: the strided knobs do not apply, the generic ones do
                    knobs = dict(head_loop=False, block_elems=elems, num_warps=nw)
                with tuning.override(**knobs):
                    a, ta = pct(lambda: ropekit.apply_rope(q, k, p, c, q_out=qo, k_out=ko), nbytes, bw)
                loop = "head loop" if head_loop is None else "a program per head block"
                print(f"ropekit  {loop}, {elems} elements, {nw} warps: {a:5.1f}% ({ta:6.1f} us)", flush=True)


if __name__ == "__main__":
    main()
