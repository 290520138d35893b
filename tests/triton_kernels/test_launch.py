"""ropekit.core.launch: the direct launch is taken once a kernel is compiled, its fallback (Triton's
generic launch) gives the same result, and the device guard launches on the tensors' device.

On CPU the launch logic runs against stand-in kernel objects (the shapes of Triton's objects that
launch.py relies on); on CUDA (marked gpu) against the real kernels.
"""

import pytest
import torch

import ropekit
from ropekit.core import launch
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err


class FakePointer:
    """What launch reads of a CUDA tensor: is_cuda, its device and its address."""

    is_cuda = True

    def __init__(self, addr):
        self.addr = addr

    def get_device(self):
        return 0

    def data_ptr(self):
        return self.addr


class FakeCompiled:
    """Triton's compiled kernel as the generic launch returns it: `run` and its launch fields."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
        self.log.append(("direct", (gx, gy, gz), stream, args))


class FakeParam:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class FakeKernel:
    """kernel[grid](*args, **meta): records the generic launch and returns a compiled kernel."""

    params = [FakeParam("x", False), FakeParam("n", False), FakeParam("BLOCK", True)]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("generic", grid, args, meta))
            return FakeCompiled(self.log)

        return run


@pytest.fixture
def fake_cuda(monkeypatch):
    """Device 0 current, stream 7 on it; the direct launch on and its counters reset."""

    class Runtime:  # Triton's knobs.runtime with no launch hooks registered
        launch_enter_hook = launch_exit_hook = None

    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setitem(launch._STATE, "ok", True)
    # the stream getter: device 0's current stream is 7 (another device's would not be)
    monkeypatch.setitem(launch._STATE, "tools", (lambda device: 7 if device == 0 else -1, Runtime))
    monkeypatch.setattr(launch, "COUNTS", {"direct": 0, "generic": 0})


def test_first_call_generic_then_direct_with_addresses(fake_cuda):
    kernel, compiled = FakeKernel(), {}
    ptrs = (FakePointer(4096),)
    launch.launch(kernel, compiled, 0, (3,), ptrs, (5,), {"BLOCK": 16})
    launch.launch(kernel, compiled, 0, (3,), ptrs, (5,), {"BLOCK": 16})
    assert [e[0] for e in kernel.log] == ["generic", "direct"]
    # the direct launch: grid padded to 3-D, the current stream, addresses then ints then constexprs
    assert kernel.log[1][1:] == ((3, 1, 1), 7, (4096, 5, 16))
    assert launch.COUNTS == {"direct": 1, "generic": 1}


def test_a_tensor_in_several_slots_gives_each_slot_its_address(fake_cuda):
    """Slots that share a tensor (in a row or not) each get that tensor's address, in slot order."""
    kernel, compiled = FakeKernel(), {}
    a, b = FakePointer(4096), FakePointer(8192)
    ptrs = (a, a, b, a, b, b)
    for _ in range(2):
        launch.launch(kernel, compiled, 0, (2, 3, 4), ptrs, (5,), {"BLOCK": 16})
    assert kernel.log[1][1:] == ((2, 3, 4), 7, (4096, 4096, 8192, 4096, 8192, 8192, 5, 16))


def test_host_only_sends_cpu_tensors_down_the_direct_path(fake_cuda, monkeypatch):
    """profile_host.py --stub-launch's state: CPU tensors take the direct path (a CPU tensor's device
    is -1); off, they go to kernel[grid] (the interpreter) every time."""
    x, kernel, compiled = torch.zeros(4), FakeKernel(), {}
    monkeypatch.setitem(launch._STATE, "host_only", True)
    monkeypatch.setattr(launch, "current_device", lambda: -1)
    for _ in range(2):
        launch.launch(kernel, compiled, 0, (1,), (x,), (5,), {"BLOCK": 16})
    assert [e[0] for e in kernel.log] == ["generic", "direct"]
    assert kernel.log[1][1:] == ((1, 1, 1), -1, (x.data_ptr(), 5, 16))
    monkeypatch.setitem(launch._STATE, "host_only", False)
    launch.launch(kernel, compiled, 0, (1,), (x,), (5,), {"BLOCK": 16})
    assert [e[0] for e in kernel.log] == ["generic", "direct", "generic"]


def test_misaligned_pointer_gets_its_own_compiled_entry(fake_cuda):
    kernel, compiled = FakeKernel(), {}
    launch.launch(kernel, compiled, 0, (1,), (FakePointer(4096),), (), {"BLOCK": 16})
    launch.launch(kernel, compiled, 0, (1,), (FakePointer(4098),), (), {"BLOCK": 16})
    assert [e[0] for e in kernel.log] == ["generic", "generic"]
    assert len(compiled) == 2


def test_a_triton_whose_launcher_differs_falls_back_for_good(fake_cuda, monkeypatch):
    kernel, compiled = FakeKernel(), {}
    ptrs = (FakePointer(4096),)

    def broken(*args):
        raise TypeError("run() takes other arguments")

    # the launcher the compiled entry keeps (read once, at the generic launch) takes other arguments
    monkeypatch.setattr(FakeCompiled, "run", broken)
    launch.launch(kernel, compiled, 0, (1,), ptrs, (), {"BLOCK": 16})
    launch.launch(kernel, compiled, 0, (1,), ptrs, (), {"BLOCK": 16})
    launch.launch(kernel, compiled, 0, (1,), ptrs, (), {"BLOCK": 16})
    assert [e[0] for e in kernel.log] == ["generic", "generic", "generic"]
    assert launch._STATE["ok"] is False


@pytest.mark.gpu
def test_direct_launch_taken_on_cuda_and_fallback_gives_the_same_result(monkeypatch):
    cache = make_cache(256, 128, device="cuda")
    q = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 2, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 256, (64,), device="cuda")
    ropekit.apply_rope(q, k, positions, cache)  # compiles; the generic launch records the kernel
    monkeypatch.setattr(launch, "COUNTS", {"direct": 0, "generic": 0})
    direct = ropekit.apply_rope(q, k, positions, cache)
    assert launch.COUNTS == {"direct": 1, "generic": 0}
    monkeypatch.setitem(launch._STATE, "ok", False)
    generic = ropekit.apply_rope(q, k, positions, cache)
    assert launch.COUNTS["generic"] == 1
    for a, b in zip(direct, generic):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_device_guard_path_on_one_gpu(monkeypatch):
    """The guard's branch (the current device differs from the tensors'), runnable on one GPU: the
    launch enters torch.cuda.device(tensor's device) and gives the unguarded result."""
    cache = make_cache(128, 64, device="cuda")
    q = torch.randn(9, 4, 64, device="cuda")
    positions = torch.randint(0, 128, (9,), device="cuda")
    want, _ = ropekit.apply_rope(q, None, positions, cache)
    entered = []
    real = torch.cuda.device

    def spy(index):
        entered.append(index)
        return real(index)

    monkeypatch.setattr(launch, "current_device", lambda: -1)
    monkeypatch.setattr(torch.cuda, "device", spy)
    got, _ = ropekit.apply_rope(q, None, positions, cache)
    assert entered == [q.get_device()]
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_device_guard_launches_on_the_tensors_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    assert torch.cuda.current_device() == 0
    dev = torch.device("cuda", 1)
    cache = make_cache(128, 64, device=dev)
    q = torch.randn(33, 4, 64, device=dev)
    k = torch.randn(33, 2, 64, device=dev)
    positions = torch.randint(0, 128, (33,), device=dev)
    for inplace in (False, True):
        qo, ko = ropekit.apply_rope(q.clone(), k.clone(), positions, cache, inplace=inplace)
        torch.cuda.synchronize(dev)
        assert qo.device == dev
        rq, rk = reference.apply_rope(q.double(), k.double(), positions, cache.double())
        assert rel_err(qo, rq) < TOL[torch.float32] and rel_err(ko, rk) < TOL[torch.float32]
    with pytest.raises(ValueError, match="apply_rope: k: expected a tensor on cuda:1 .*got one on cuda:0"):
        ropekit.apply_rope(q, k.to("cuda:0"), positions, cache)


@pytest.mark.gpu
def test_at_most_two_compilations_per_variant_across_shapes():
    """docs/core.md's bound: one variant (bf16, 8 q heads, 2 k heads, D 128, half-split) over batch
    sizes and sequence lengths from 1 to 4096 compiles rope_kernel at most twice."""
    from ropekit.kernels.rope import rope_kernel

    caches = getattr(rope_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its kernel cache elsewhere")
    compiled = caches[torch.cuda.current_device()][0]
    table = make_cache(8192, 128, device="cuda")
    # heads chosen so that no other test of the session compiles this variant first
    hq, hk = 12, 3
    before = len(compiled)
    for batch in (1, 3):
        for seqlen in (1, 5, 16, 217, 1000, 1024, 2049, 4096):
            q = torch.randn(batch, seqlen, hq, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(batch, seqlen, hk, 128, device="cuda", dtype=torch.bfloat16)
            ropekit.apply_rope(q, k, None, table)
    torch.cuda.synchronize()
    assert len(compiled) - before <= 2, len(compiled) - before


def _record_case(name, table, g):
    """(call(q, k) -> (q_out, k_out), its float64 answer for those inputs) of one launch-record case."""
    dev, T, D = "cuda", 48, 128
    pos = torch.randint(0, table.shape[0], (T,), device=dev, generator=g)
    c = table[pos]
    cos, sin = c[:, : D // 2], c[:, D // 2 :]
    wq, wk = (torch.rand(D, device=dev, generator=g) + 0.5 for _ in range(2))
    t64 = table.double()
    if name == "per-token angles":
        return (
            lambda q, k: ropekit.rotate_with_angles(q, k, cos, sin),
            lambda q, k: tuple(reference.rotate(x.double(), cos.double(), sin.double()) for x in (q, k)),
        )
    if name == "normed":
        return (
            lambda q, k: ropekit.apply_rope(q, k, pos, table, q_norm_weight=wq, k_norm_weight=wk),
            lambda q, k: reference.rms_norm_rope(
                q.double(), k.double(), pos, t64, q_norm_weight=wq.double(), k_norm_weight=wk.double()
            ),
        )
    positions = None if name == "arange" else pos
    inplace = name == "in place"
    alone = name == "q alone"
    return (
        lambda q, k: ropekit.apply_rope(q, None if alone else k, positions, table, inplace=inplace),
        lambda q, k: reference.apply_rope(q.double(), None if alone else k.double(), positions, t64),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["out of place", "in place", "q alone", "arange", "per-token angles", "normed"])
def test_launch_record_gives_the_float64_answer_call_after_call(name, dtype, poison, monkeypatch):
    """A signature's later calls take its launch record (ropekit.core.pipeline.rotate_record): seven
    calls of one signature, each on fresh random inputs (fresh outputs NaN-poisoned), each checked
    against float64; the record served the last three at least (a process's first compile may
    leave the record to the third call), and a q off the 16-byte grid afterwards (same shape and
    strides) goes the general path with the same answer."""
    from ropekit.core import dispatch, memo
    from ropekit.core.variant import RECORD

    served = []
    real = dispatch.ROTATE[RECORD]

    def spy(*args):
        out = real(*args)
        served.append(out is not None)
        return out

    monkeypatch.setitem(dispatch.ROTATE, RECORD, spy)
    memo.clear()
    g = torch.Generator(device="cuda").manual_seed(7)
    table = make_cache(4096, 128, device="cuda")
    call, want = _record_case(name, table, g)
    Hq, Hk, T, D = 8, 2, 48, 128
    tol = TOL[dtype] * (2 if name == "normed" else 1)
    for i in range(8):
        if i < 7:
            q = torch.randn(T, Hq, D, device="cuda", dtype=dtype, generator=g)
        else:  # 4 bytes off the grid: the same signature, the general path
            q = torch.randn(T * Hq * D + 2, device="cuda", dtype=dtype, generator=g)[2:].view(T, Hq, D)
        k = torch.randn(T, Hk, D, device="cuda", dtype=dtype, generator=g)
        rq, rk = want(q, k)  # before an in-place call overwrites q and k
        got_q, got_k = call(q, k)
        assert rel_err(got_q, rq) < tol, (name, i)
        if name != "q alone":
            assert rel_err(got_k, rk) < tol, (name, i)
    assert served[-4:] == [True, True, True, False], served


def _served(monkeypatch, doors: dict) -> list:
    """A list of whether each call of that door table's launch record was served (the record
    spied on); memo cleared."""
    from ropekit.core import memo
    from ropekit.core.variant import RECORD

    served = []
    real = doors[RECORD]

    def spy(*args):
        out = real(*args)
        served.append(bool(out))
        return out

    monkeypatch.setitem(doors, RECORD, spy)
    memo.clear()
    return served


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["plain", "normed", "q_out", "write_key"])
def test_store_launch_record_gives_the_float64_answer_call_after_call(name, dtype, monkeypatch):
    """The store's later calls take its launch record (ropekit.core.pipeline.store_record): eight
    calls of one signature into one NaN-poisoned paged cache, each on fresh random q, k, v,
    positions and slots (new addresses: the record checks them first), each checked against
    float64 (q or q_out, the cache rows written, k with write_key); the record served the last
    three of the first seven at least, and a q off the 16-byte grid afterwards goes the general
    path with the same answer."""
    from ropekit.core import dispatch

    served = _served(monkeypatch, dispatch.STORE)
    g = torch.Generator(device="cuda").manual_seed(11)
    dev, T, Hq, Hk, D, blocks, block = "cuda", 48, 8, 2, 128, 16, 16
    table = make_cache(4096, D, device=dev)
    k_cache, v_cache = (torch.full((blocks, block, Hk, D), float("nan"), device=dev, dtype=dtype) for _ in range(2))
    norm = {}
    if name == "normed":
        norm = {w: torch.rand(D, device=dev, generator=g) + 0.5 for w in ("q_norm_weight", "k_norm_weight")}
    tol = TOL[dtype] * (2 if name == "normed" else 1)
    for i in range(8):
        if i < 7:
            q = torch.randn(T, Hq, D, device=dev, dtype=dtype, generator=g)
        else:  # off the grid: the same signature, the general path
            q = torch.randn(T * Hq * D + 2, device=dev, dtype=dtype, generator=g)[2:].view(T, Hq, D)
        k, v = (torch.randn(T, Hk, D, device=dev, dtype=dtype, generator=g) for _ in range(2))
        pos = torch.randint(0, table.shape[0], (T,), device=dev, generator=g)
        slots = torch.randperm(blocks * block, device=dev, generator=g)[:T]
        want_q, want_k = reference.rms_norm_rope(
            q.double(), k.double(), pos, table.double(), **{n: w.double() for n, w in norm.items()}
        )
        want_v = v.double()
        q_out = torch.full_like(q, float("nan")) if name == "q_out" else None
        got = ropekit.apply_rope_and_store(
            q, k, v, pos, table, k_cache, v_cache, slots, q_out=q_out, write_key=name == "write_key", **norm
        )
        assert got is (q if q_out is None else q_out)
        assert rel_err(got, want_q) < tol, (name, i)
        assert rel_err(k_cache.view(-1, Hk, D)[slots], want_k) < tol, (name, i)
        assert rel_err(v_cache.view(-1, Hk, D)[slots], want_v) == 0, (name, i)
        if name == "write_key":
            assert rel_err(k, want_k) < tol, (name, i)
    assert served[-4:] == [True, True, True, False], served


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["int shift", "tensor delta", "dst slots"])
def test_rerotation_launch_record_gives_the_float64_answer_call_after_call(name, dtype, monkeypatch):
    """The re-rotation's later calls take its launch record (ropekit.core.pipeline.rerotate_record):
    eight calls of one signature, each on a fresh random cache, slots and shift (new addresses),
    each cache checked whole against float64 (the rows written, every other row untouched); the
    record served the last three of the first seven at least, and a cache off the 16-byte grid
    afterwards goes the general path with the same answer."""
    from ropekit.core import dispatch

    served = _served(monkeypatch, dispatch.REROTATE)
    g = torch.Generator(device="cuda").manual_seed(13)
    dev, N, Hk, D, blocks, block = "cuda", 24, 2, 128, 8, 16
    table = make_cache(4096, D, device=dev)
    for i in range(8):
        n = blocks * block * Hk * D
        if i < 7:
            cache = torch.randn(blocks, block, Hk, D, device=dev, dtype=dtype, generator=g)
        else:  # off the grid: the same signature, the general path
            cache = torch.randn(n + 2, device=dev, dtype=dtype, generator=g)[2:].view(blocks, block, Hk, D)
        rows = torch.randperm(blocks * block, device=dev, generator=g)
        slots, dst = rows[:N], (rows[N : 2 * N] if name == "dst slots" else None)
        if name == "tensor delta":
            delta = torch.randint(-100, 100, (N,), device=dev, generator=g)
        else:
            delta = int(torch.randint(-100, 100, (1,), generator=torch.Generator().manual_seed(i)))
        want = cache.double()
        reference.rerotate_kv_cache(want, slots, delta, table.double(), dst_slots=dst)
        got = ropekit.rerotate_kv_cache(cache, slots, delta, table, dst_slots=dst)
        assert got is cache
        written = slots if dst is None else dst
        flat, flat_want = cache.view(-1, Hk, D), want.view(-1, Hk, D)
        assert rel_err(flat[written], flat_want[written]) < TOL[dtype], (name, i)
        kept = torch.ones(blocks * block, dtype=torch.bool, device=dev)
        kept[written] = False
        assert torch.equal(flat[kept].double(), flat_want[kept]), (name, i)
    assert served[-4:] == [True, True, True, False], served
