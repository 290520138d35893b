"""Shared test fixtures, and the backend the "cpu" cases run (tests/README.md).

Without CUDA, kernels run in the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 is set here
before ropekit imports its kernels). With CUDA and TRITON_INTERPRET unset, CPU tensors take the
PyTorch path (ropekit.core.cpu) instead. Triton reads TRITON_INTERPRET when a kernel is decorated,
so one process has one choice: the header line "ropekit backend" says which, and a `device`
parameter's test id says it too ("cpu-interpreter" or "cpu-torch"; "cuda" for the tests marked gpu).
"""

import importlib
import os
import pathlib
import pkgutil
import sys

import pytest
import torch

# Test files share helpers by module name (`from test_store import Caches`) across folders: every
# folder that holds test files is importable, whichever subset of the suite runs.
for _folder in sorted({p.parent for p in pathlib.Path(__file__).parent.rglob("test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every kernel module imported now, so every kernel is decorated under this process's choice: a
# test that unsets TRITON_INTERPRET for the PyTorch path (the bench's CPU rows) must not be the
# first to import one (its kernels would then be compiled ones, which the interpreter's later
# launches refuse: "Cannot call @triton.jit'd outside of the scope of a kernel").
import ropekit.kernels  # noqa: E402
from ropekit.core import memo, run  # noqa: E402

for _module in pkgutil.iter_modules(ropekit.kernels.__path__):
    importlib.import_module(f"ropekit.kernels.{_module.name}")

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)]
# what ropekit runs for CPU tensors in this process (ropekit.core.checks: the Triton kernel when
# TRITON_INTERPRET is "1", else the PyTorch path); CUDA tensors run compiled kernels unless interpreted
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CPU_BACKEND = "interpreter" if INTERPRET else "torch"
DEVICE_IDS = {"cpu": f"cpu-{CPU_BACKEND}", "cuda": "cuda-interpreter" if HAS_CUDA and INTERPRET else "cuda"}


def pytest_report_header(config):
    cpu = (
        "the Triton kernels in the Triton interpreter (TRITON_INTERPRET=1)"
        if INTERPRET
        else "the PyTorch path, ropekit.core.cpu (TRITON_INTERPRET is not 1: no Triton kernel runs on CPU)"
    )
    if HAS_CUDA:
        how = "in the Triton interpreter" if INTERPRET else "compiled"
        cuda = f"run ({torch.cuda.get_device_name()}, kernels {how}; -m gpu selects only them)"
    else:
        cuda = "skipped (no CUDA)"
    return [f'ropekit backend: "cpu" cases run {cpu}; CUDA cases (marked gpu) {cuda}']


def pytest_make_parametrize_id(config, val, argname):
    """A `device` parameter's id names the backend: cpu-interpreter, cpu-torch, cuda."""
    if argname == "device" and isinstance(val, str) and val in DEVICE_IDS:
        return DEVICE_IDS[val]
    return None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "bigmem" in item.keywords and HAS_CUDA:
            free, _ = torch.cuda.mem_get_info()
            if free < 20 * 2**30:
                item.add_marker(pytest.mark.skip(reason="needs >= 20 GB of free GPU memory"))


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The backend of CPU tensors for one test: the Triton kernel (in the interpreter) or the
    PyTorch path (a test file's own `path` fixture takes precedence)."""
    if request.param == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    memo.clear()
    yield request.param
    memo.clear()


def spy_plans(monkeypatch, pick, planner: str = "plan_rotate") -> list:
    """A list that gets pick(plan.meta) of every plan that ropekit.core.plans' `planner` makes from
    here on (rope_kernel's by default, "plan_rerotate" for rerotate_kernel's; the memo is cleared:
    plans are made once per signature)."""
    from ropekit.core import plans

    seen, real = [], getattr(plans, planner)

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        if plan:
            seen.append(pick(plan.meta))
        return plan

    monkeypatch.setattr(plans, planner, spy)
    memo.clear()
    return seen


def make_cache(max_position, rotary_dim, *, base=10000.0, dtype=torch.float32, device="cpu"):
    """A [cos | sin] table computed in float64."""
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    f = torch.arange(max_position, dtype=torch.float64)[:, None] * inv
    return torch.cat((f.cos(), f.sin()), dim=-1).to(dtype=dtype, device=device)


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.fixture
def hf_unpatched():
    """transformers unpatched before and after a test (the HF test files use it for every test),
    and Dynamo's caches cleared after it: a patch changes what compiled graphs called."""
    from ropekit import hf

    hf.unpatch()
    yield
    hf.unpatch()
    torch._dynamo.reset()


@pytest.fixture
def poison(monkeypatch):
    """Fresh outputs come back filled with NaN, so any element the kernel skips fails the test."""

    def empty_like(x, *args, **kwargs):
        return torch.empty_like(x, *args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(run, "empty_like", empty_like)


def fp8_close(got, want, dtype):
    """Within one fp8 ulp: 2^-mantissa_bits of the value, or the smallest normal step. On CPU the
    Triton interpreter's float32 -> fp8 cast loses the carry when rounding up reaches the next power
    of two (31.9 -> 16 instead of 32): there, that value is accepted too; compiled (CUDA) it is not."""
    mant = 3 if dtype == torch.float8_e4m3fn else 2
    g, w = got.double(), want.double()
    assert not torch.isnan(g).any(), "NaN in an fp8 output"
    tol = w.abs() * 2.0**-mant + torch.finfo(dtype).tiny
    bad = (g - w).abs() > tol
    if not got.is_cuda:
        power_of_two = (w != 0) & (torch.frexp(w).mantissa.abs() == 0.5)
        bad &= ~(power_of_two & (g == w / 2))
    assert not bad.any(), f"{int(bad.sum())} fp8 values off by more than an ulp, e.g. {g[bad][:4]} vs {w[bad][:4]}"
