"""The path of one steady-state eager call: every ropekit function entered from the public op to the
kernel launch (the launch function itself counted, nothing below it), and the files they live in.
On CUDA each op's third call is served by its launch record (ropekit.core.pipeline's
rotate_record, store_record, rerotate_record), which calls the compiled launcher itself: every
ropekit function it enters counts.

    python -m ropekit.tools.call_path     # rotation, in place, store, re-rotation

Runs on CUDA when present, else on CPU tensors in the Triton interpreter (set here before ropekit
loads its kernels); the third call of each op is the one counted (the first two build specs, plans
and compiled kernels). Held by tests/ops/test_call_path.py: at most six functions in four files."""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ropekit  # noqa: E402
from ropekit.core import launch  # noqa: E402

PACKAGE = os.path.dirname(ropekit.__file__)
HERE = os.path.dirname(os.path.abspath(__file__))


def path_of(call) -> list:
    """[(file relative to the package, function name)] of the ropekit functions `call()` enters
    before (and including) the launch, in the order first entered."""
    for _ in range(2):
        call()
    seen, stop = [], [False]
    launch_code = launch.launch.__code__

    def profile(frame, event, arg):
        if event != "call" or stop[0]:
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE) or code.co_filename.startswith(HERE):
            return  # outside ropekit, or the calling code here
        entry = (os.path.relpath(code.co_filename, PACKAGE), code.co_name)
        if entry not in seen:
            seen.append(entry)
        if code is launch_code:
            stop[0] = True

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def calls(device: str = "cpu") -> dict:
    """One representative call per op (bf16 decode-like shapes), by name."""
    dt = torch.float32
    T, Hq, Hk, D = 4, 4, 2, 32
    q = torch.randn(T, Hq, D, device=device, dtype=dt)
    k = torch.randn(T, Hk, D, device=device, dtype=dt)
    v = torch.randn(T, Hk, D, device=device, dtype=dt)
    pos = torch.arange(T, device=device)
    cache = ropekit.cos_sin_cache(D, 64).to(device)
    k_cache = torch.zeros(4, 8, Hk, D, device=device, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(T, device=device)
    delta = torch.full((T,), 3, device=device)
    return {
        "rotation": lambda: ropekit.apply_rope(q, k, pos, cache),
        "in place": lambda: ropekit.apply_rope(q, k, pos, cache, inplace=True),
        "store": lambda: ropekit.apply_rope_and_store(q, k, v, pos, cache, k_cache, v_cache, slots),
        "re-rotation": lambda: ropekit.rerotate_kv_cache(k_cache, slots, delta, cache),
    }


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, call in calls(device).items():
        path = path_of(call)
        files = sorted({f for f, _ in path})
        print(f"{name}: {len(path)} frames in {len(files)} files")
        for f, fn in path:
            print(f"    {f}:{fn}")


if __name__ == "__main__":
    main()
