"""Usage: PYTHONPATH=src python3 tools/profile_host.py [--cpu-dry]

Host time of one eager call, step by step, beside the host floors measured in the same run.

On CUDA: W3's decode call (64 tokens, Llama-3-8B heads) and W7-T64's fused store, timed per eager
call with a wall clock, next to Triton's generic launch of an empty kernel, an in-place ATen op on
the same q, and an empty autograd.Function (forward + backward); then a cProfile of the decode
call. --cpu-dry (no GPU needed): the same calls on CPU tensors with the kernel launch replaced by
a no-op, which isolates ropekit's own Python from Triton's plans.

The "bound" rows of the W3 split time what a W3 call has to do before its launch in any design
that validates once per call signature, as ropekit does: the signature key of its four tensors and
one dict lookup, its two outputs, and the nine pointers the kernel takes. Beside "W3 apply_rope, launch stubbed" they
split W3's host time into that bound, ropekit's own Python above it, and the compiled launcher. The
split times its rows in interleaved rounds and keeps each row's fastest round, so that a noisy
host (a GPU machine's medians can move by 2x between runs) does not skew one row alone.
"""

import argparse
import cProfile
import inspect
import pstats
import time

import torch

import ropekit
from ropekit.core import checks, launch
from ropekit.core.variant import Signature


def per_call_us(fn, n=2000, repeat=5):
    fn()
    best = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n * 1e6)
    best.sort()
    return best[len(best) // 2]


def _interleaved(calls: dict, dev: str, stub=None, rounds: int = 15, n: int = 500) -> dict:
    """Each call's fastest round (us a call) over rounds that take every call in turn; stub: the name
    of a call also timed with ropekit's launch replaced by a no-op (its row "..., launch stubbed")."""
    import ropekit.core.plans as P

    real, best = P.launch_kernel, {}
    timed = [(name, fn, False) for name, fn in calls.items()]
    if stub is not None:
        timed.append((stub + ", launch stubbed", calls[stub], True))
    for _ in range(rounds):
        for name, fn, stubbed in timed:
            if stubbed:
                P.launch_kernel = lambda *a, **k: None
            fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            us = (time.perf_counter() - t) / n * 1e6
            P.launch_kernel = real
            best[name] = min(best.get(name, us), us)
    return best


def _keyed(q, k, pos, cache, outputs=False):
    """The bound: W3's signature key (apply_rope's own Signature) and a lookup; with outputs, the two
    new outputs and the kernel's nine pointers too."""
    sig = Signature.of(ropekit.apply_rope)
    call = {n: p.default for n, p in inspect.signature(ropekit.apply_rope).parameters.items()}
    call.update(q=q, k=k, positions=pos, cos_sin_cache=cache)
    memo = {sig.key(call): None}

    def run():
        memo[sig.key(call)]
        if outputs:
            qo, ko = torch.empty_like(q), torch.empty_like(k)
            return [x.data_ptr() for x in (q, k, qo, ko, pos, cache, cache, cache, cache)]

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-dry", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.cpu_dry else "cuda"
    if args.cpu_dry:
        checks.triton_runs = lambda x: True
        launch.launch = lambda *a, **k: None
        import ropekit.core.plans as P

        P.launch_kernel = lambda *a, **k: None
    bf = dict(dtype=torch.bfloat16, device=dev)
    T = 64
    q = torch.randn(T, 32, 128, **bf)
    k = torch.randn(T, 8, 128, **bf)
    cache = ropekit.cos_sin_cache(128, 65536, 500000.0, device=dev)
    pos = torch.randint(0, 65536, (T,), device=dev)
    v = torch.randn(T, 8, 128, **bf)
    kc = torch.empty(4096, 16, 8, 128, **bf)
    vc = torch.empty_like(kc)
    slots = torch.randperm(4096 * 16, device=dev)[:T]
    rows = {}
    rows["W3 apply_rope (decode, 64 tokens)"] = per_call_us(lambda: ropekit.apply_rope(q, k, pos, cache))
    rows["W3 apply_rope inplace"] = per_call_us(lambda: ropekit.apply_rope(q, k, pos, cache, inplace=True))
    rows["W7-T64 apply_rope_and_store"] = per_call_us(
        lambda: ropekit.apply_rope_and_store(q, k, v, pos, cache, kc, vc, slots)
    )
    rows["floor: q.add_(0)"] = per_call_us(lambda: q.add_(0))

    # W8's host side: forward + backward through autograd, small tensors so the host dominates
    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a.view_as(a), b.view_as(b)

        @staticmethod
        def backward(ctx, ga, gb):
            return ga, gb

    B, S = 1, 16
    qt = torch.randn(B, S, 32, 128, **bf).transpose(1, 2).requires_grad_()  # HF's (B, H, S, D) views
    kt = torch.randn(B, S, 8, 128, **bf).transpose(1, 2).requires_grad_()
    emb = torch.randn(1, S, 128, **bf)

    def step(fn):
        def run():
            a, b = fn()
            torch.autograd.backward((a, b), (torch.ones_like(a), torch.ones_like(b)))

        return run

    qb, kb = qt.transpose(1, 2).detach().requires_grad_(), kt.transpose(1, 2).detach().requires_grad_()
    rows["W8 apply_rope fwd+bwd"] = per_call_us(step(lambda: ropekit.apply_rope(qb, kb, None, cache)), n=500)
    rows["W8 hf.apply_rotary_pos_emb fwd+bwd"] = per_call_us(
        step(lambda: ropekit.hf.apply_rotary_pos_emb(qt, kt, emb, emb)), n=500
    )
    rows["floor: empty autograd.Function fwd+bwd"] = per_call_us(step(lambda: Empty.apply(qb, kb)), n=500)
    if not args.cpu_dry:
        import triton

        @triton.jit
        def empty(x):
            pass

        rows["floor: Triton empty kernel[(1,)](x)"] = per_call_us(lambda: empty[(1,)](q))
        # the same W3 call with the launch replaced by a no-op: ropekit's Python on CUDA tensors
        import ropekit.core.plans as P

        real = P.launch_kernel
        P.launch_kernel = lambda *a, **k: None
        rows["W3 apply_rope, launch stubbed"] = per_call_us(lambda: ropekit.apply_rope(q, k, pos, cache))
        P.launch_kernel = real
    for name, us in rows.items():
        print(f"{name:45s} {us:8.2f} us")
    split = {
        "W3 apply_rope": lambda: ropekit.apply_rope(q, k, pos, cache),
        "bound: key + lookup": _keyed(q, k, pos, cache),
        "bound: key + lookup, 2 outputs, 9 pointers": _keyed(q, k, pos, cache, True),
    }
    if not args.cpu_dry:
        split["Triton empty kernel[(1,)](x)"] = lambda: empty[(1,)](q)
    print("W3 split, fastest of 15 interleaved rounds of 500 calls (us a call):")
    for name, us in _interleaved(split, dev, stub=None if args.cpu_dry else "W3 apply_rope").items():
        print(f"  {name:50s} {us:8.2f}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        ropekit.apply_rope(q, k, pos, cache)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
