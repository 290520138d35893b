"""Timing done right.

GPU: CUDA events around each call with warm-up, L2 flushed before every call, median
(triton.testing.do_bench, or the same loop written out when Triton is missing); CUDA-graph
replay for launch-bound sizes, with the graph walking over several input sets so that their
total size is past the L2, or calling one input set many times (its data in L2, the launch-bound
floor of a row; beside it the same graph of an empty kernel: `graph_launch_floor`); host time per
eager call with a wall clock over many calls; the copy bandwidth of a large device-to-device copy
measured in the same run, and a copy of each workload's own size (`same_size_copy`).

CPU: a wall clock around each call, median of several.

Every timing keeps its spread (min / median / max): a noisy host shows as a wide spread, flagged
by the report when max / min exceeds SPREAD_FLAG. Host floors (what any eager op pays on this
host, measured in the same run) put host times in proportion: see `host_floors`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, List, Optional, Sequence

import torch

DEFAULT_L2 = 60 * 1024 * 1024  # H200's 60 MB: used when the device does not say
SPREAD_FLAG = 1.5  # max / min above this: the table marks the figure as noisy


def l2_bytes(device) -> int:
    if torch.device(device).type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(torch.device(device))
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2)


def rotation_sets(bytes_per_set: int, l2: int, cap: int = 256) -> int:
    """How many distinct input sets a graph must walk so that they don't all sit in L2 (2x L2)."""
    if l2 <= 0 or bytes_per_set <= 0:
        return 1
    return max(1, min(cap, -(-2 * l2 // bytes_per_set)))


def _do_bench_fallback(fn, warmup_ms, rep_ms):
    """triton.testing.do_bench's method (events per call, L2 flushed before each), median."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        flush.zero_()
        fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(1, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))


def gpu_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of one call (device time between events)."""
    try:
        from triton.testing import do_bench
    except Exception:  # pragma: no cover - triton is there on GPUs
        return _do_bench_fallback(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def gpu_stats(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """`stats` of the per-call milliseconds do_bench measured (median as gpu_ms)."""
    try:
        from triton.testing import do_bench

        times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    except Exception:  # pragma: no cover
        return stats([gpu_ms(fn, warmup_ms, rep_ms)])
    return stats([float(t) for t in times])


def graph_ms(
    fns: Sequence[Callable[[], object]],
    warmup_ms: float = 25,
    rep_ms: float = 100,
    all_stats: bool = False,
    calls_per_set: int = 1,
):
    """Median milliseconds per call under CUDA-graph replay.

    One graph holds `calls_per_set` calls per input set, in order; a replay's time over the number
    of calls is the time of one call. With one call per set and sets larger than L2 together, the
    inputs are not in L2; with one set called many times (calls_per_set=100), they are. The calls
    are warmed up first (Triton JIT, torch.compile, autotuning) on a side stream, as PyTorch asks
    before a capture. all_stats: return `stats` (per call) instead of the median."""
    if calls_per_set < 1:
        raise ValueError(f"graph_ms: calls_per_set: expected an int >= 1, got {calls_per_set!r}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            for _ in range(calls_per_set):
                f()
    graph.replay()
    torch.cuda.synchronize()
    calls = len(fns) * calls_per_set
    try:
        if all_stats:
            st = gpu_stats(graph.replay, warmup_ms, rep_ms)
            return {**st, **{key: st[key] / calls for key in ("min", "median", "max")}}
        return gpu_ms(graph.replay, warmup_ms, rep_ms) / calls
    finally:
        del graph


def host_us(fn: Callable[[], object], device, n: int = 200, warmup: int = 20) -> float:
    """Wall-clock microseconds per eager call, the device drained before; not waiting for the
    device after (that is device time, reported separately)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    _sync(device)
    return (t1 - t0) / n * 1e6


def stats(samples: Sequence[float]) -> dict:
    """min / median / max of some timings, and whether their spread is above SPREAD_FLAG."""
    lo, mid, hi = min(samples), statistics.median(samples), max(samples)
    return {"min": lo, "median": mid, "max": hi, "n": len(samples), "noisy": bool(lo > 0 and hi / lo > SPREAD_FLAG)}


def host_us_stats(fn: Callable[[], object], device, batches: int = 7, n: int = 50, warmup: int = 20) -> dict:
    """`stats` (microseconds per call) over several batches of host_us's loop."""
    for _ in range(warmup):
        fn()
    return stats([host_us(fn, device, n=n, warmup=0) for _ in range(batches)])


def cpu_samples(
    fn: Callable[[], object], min_s: float = 0.2, min_reps: int = 3, max_reps: int = 50, warmup: int = 1
) -> List[float]:
    """Wall-clock milliseconds of single calls on the CPU (at least min_reps, for about min_s)."""
    for _ in range(warmup):
        fn()
    times: List[float] = []
    t_start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - t_start < min_s):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def cpu_ms(
    fn: Callable[[], object],
    min_s: float = 0.2,
    min_reps: int = 3,
    max_reps: int = 50,
    warmup: int = 1,
    best: bool = False,
) -> float:
    """Median (best=True: fastest) wall-clock milliseconds of one call on the CPU."""
    times = cpu_samples(fn, min_s, min_reps, max_reps, warmup)
    return min(times) if best else statistics.median(times)


# ------------------------------------------------------------------------------------------
# host floors: what any eager call pays on this host, measured in the same run


def _empty_kernel():
    """A Triton kernel that does nothing. Without a GPU, the interpreter's (flagged as such by
    host_floors), built as an InterpretedFunction directly: the TRITON_INTERPRET variable is read
    through Triton's knobs, which an earlier assignment in the process (Inductor's, a test's) can pin."""
    import triton

    def empty(x_ptr):
        pass

    if torch.cuda.is_available():
        return triton.jit(empty)
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(empty)


@contextlib.contextmanager
def _interpreter_knob(on: bool):
    """Triton's interpret knob on for the block when `on`: the interpreter's first launch in a
    process imports triton.experimental.gluon, whose import asserts the knob, and the bench's CPU
    rows run with TRITON_INTERPRET unset (the CPU path users get)."""
    if not on:
        yield
        return
    from triton import knobs

    with knobs.runtime.scope():
        knobs.runtime.interpret = True
        yield


class _Nothing(torch.autograd.Function):
    """An autograd.Function that launches nothing: W8's floor (forward + backward bookkeeping)."""

    @staticmethod
    def forward(ctx, q, k):
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, gq, gk):
        return gq, gk


def host_floors(q: torch.Tensor, k: Optional[torch.Tensor] = None) -> dict:
    """Per-call host floors on q's device, each as `stats` in microseconds (None where it cannot
    run, with the reason under 'why'):

    - launch: Triton's generic launch of an empty kernel, `kernel[(1,)](q)`;
    - aten: an in-place ATen op on the same q, `q.add_(0)` (what a C++ extension op pays);
    - autograd: an autograd.Function that launches nothing, forward + backward.

    'interpreted' is True when the launch floor is the Triton interpreter's (no GPU).
    """
    device = q.device
    k = q if k is None else k
    out: dict = {"interpreted": device.type != "cuda", "why": {}}
    try:
        with _interpreter_knob(device.type != "cuda"):
            kern = _empty_kernel()
            out["launch"] = host_us_stats(lambda: kern[(1,)](q), device)
    except Exception as e:  # no triton, or no backend for this device
        out["launch"] = None
        out["why"]["launch"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    scratch = q.detach().clone()
    out["aten"] = host_us_stats(lambda: scratch.add_(0), device)
    qg, kg = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    gq, gk = torch.ones_like(qg), torch.ones_like(kg)

    def fwd_bwd():
        qg.grad = kg.grad = None  # no accumulation: the first backward assigns
        a, b = _Nothing.apply(qg, kg)
        torch.autograd.backward((a, b), (gq, gk))

    out["autograd"] = host_us_stats(fwd_bwd, device, n=20)
    return out


def direct_launch_floor(call: Callable[[], object], device) -> dict:
    """Host time of the direct launch of the compiled kernel that one ropekit call launches, with
    its arguments prebuilt (the addresses, ints and constexprs of that call): the floor of any
    eager op that launches this kernel from Python. `stats` in microseconds, or {'why': ...} when
    the call does not launch exactly one compiled kernel (the CPU path, the interpreter, several
    launches)."""
    from ropekit.core import dispatch, pipeline
    from ropekit.core import launch as launching
    from ropekit.core.variant import RECORD

    seen = []
    tables = (dispatch.ROTATE, dispatch.STORE, dispatch.REROTATE)  # each op's door table
    real, records = pipeline.launch, [doors[RECORD] for doors in tables]

    def spy(*args, **keywords):
        seen.append(args)
        return real(*args, **keywords)

    call()  # compiled and planned before the spied call
    pipeline.launch = spy
    # the launch records decline: the launch is seen
    for doors in tables:
        doors[RECORD] = lambda *args: None
    try:
        call()
    finally:
        pipeline.launch = real
        for doors, record in zip(tables, records):
            doors[RECORD] = record
    if len(seen) != 1:
        return {"why": f"{len(seen)} launches in one call (direct floor: one)"}
    kernel, compiled, variant, grid, ptrs, args, meta = seen[0]
    if not ptrs[0].is_cuda or len(compiled) != 1:
        return {"why": "no compiled kernel (CPU) or several for one plan"}
    # a compiled entry of ropekit.core.launch: launcher, grid's three dims, launch fields, constexprs
    run, gx, gy, gz, function, packed, consts, _ = next(iter(compiled.values()))
    full = (*[p.data_ptr() for p in ptrs], *args, *consts)
    stream = launching.stream_tools()[0](ptrs[0].get_device())

    def direct():
        run(gx, gy, gz, stream, function, packed, None, None, None, *full)

    return host_us_stats(direct, device)


def graph_launch_floor(x: torch.Tensor, calls: int = 100, warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """What one launch costs inside a CUDA graph: an empty Triton kernel (one pointer argument,
    grid (1,)) captured `calls` times in one graph, replayed; `stats` in microseconds per launch.
    x: any CUDA tensor (the pointer argument). The floor of a launch-bound row timed with
    graph_ms(..., calls_per_set=calls)."""
    kern = _empty_kernel()
    st = graph_ms([lambda: kern[(1,)](x)], warmup_ms, rep_ms, all_stats=True, calls_per_set=calls)
    return {
        **{k: (v * 1e3 if k in ("min", "median", "max") else v) for k, v in st.items()},
        "calls_per_graph": calls,
        "what": f"empty Triton kernel (one pointer argument, grid (1,)), {calls} launches in one CUDA graph, "
        "per launch",
    }


def same_size_copy(device, nbytes: int, warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """A contiguous torch copy moving `nbytes` in all (nbytes // 2 read, as many written):
    `dst.copy_(src)` with uint8 src of nbytes // 2, timed like a workload (CUDA events with L2
    flushed, median; CPU: wall clock, the fastest of several, as copy_bandwidth times the CPU
    memcpy). Returns gbps (bytes read + written per second), time_us, bytes and the spread
    (`stats`, microseconds)."""
    dev = torch.device(device)
    half = max(1, nbytes // 2)
    src = torch.empty(half, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    if dev.type == "cuda":
        st = gpu_stats(fn, warmup_ms, rep_ms)
        ms = st["median"]
    else:
        st = stats(cpu_samples(fn, min_s=rep_ms / 1e3, min_reps=5))
        ms = st["min"]
    return {
        "gbps": 2 * half / (ms * 1e-3) / 1e9,
        "time_us": ms * 1e3,
        "bytes": 2 * half,
        "spread": {k: (v * 1e3 if k in ("min", "median", "max") else v) for k, v in st.items()},
    }


def copy_bandwidth(device, nbytes: Optional[int] = None, warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """Bytes read + written per second of a large device-to-device copy (dst.copy_(src))."""
    dev = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if dev.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    ms = gpu_ms(fn, warmup_ms, rep_ms) if dev.type == "cuda" else cpu_ms(fn, min_s=0.3, min_reps=5, best=True)
    return {
        "gbps": 2 * nbytes / (ms * 1e-3) / 1e9,
        "ms": ms,
        "bytes": 2 * nbytes,
        "what": (
            "device-to-device copy (torch copy_), bytes read + written"
            if dev.type == "cuda"
            else "CPU memcpy (torch copy_, fastest of several), bytes read + written"
        ),
    }


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
