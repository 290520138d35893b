"""python -m ropekit.selfcheck: every public op has a row, a failing row fails the run, a missing
feature is 'not available' (never a pass); on CPU it checks the path CPU users get (ropekit.core.cpu)
unless asked for the Triton interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Triton loaded while conftest's TRITON_INTERPRET=1 is set: its own jit helpers keep the mode they
# were made in, and tests here remove the variable
import triton.language  # noqa: F401

import ropekit
from ropekit import selfcheck
from ropekit.core import cpu, memo, pipeline


@pytest.fixture
def restore_path(monkeypatch):
    """The environment variable and memoized specs as the other tests expect them, afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    yield
    memo.clear()


def test_selfcheck_runs_the_cpu_path_users_get(monkeypatch, restore_path):
    """Without --interpreter no Triton launch happens, and ropekit.core.cpu does the work."""
    selfcheck.use_cpu_path(False)
    assert "TRITON_INTERPRET" not in os.environ
    assert "ropekit.core.cpu" in selfcheck.backend_name("cpu")
    calls = []
    real = cpu.rope
    monkeypatch.setattr(cpu, "rope", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    monkeypatch.setattr(pipeline, "launch", lambda *a, **kw: pytest.fail("a Triton launch on the CPU path"))
    lines = []
    passed, failed, missing = selfcheck.run_checks("cpu", out=lines.append)
    assert failed == 0, "\n".join(lines)
    assert passed >= 18 and calls


def test_selfcheck_interpreter_when_asked(restore_path):
    selfcheck.use_cpu_path(True)
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert "interpreter" in selfcheck.backend_name("cpu")


def test_selfcheck_passes_and_covers_every_public_op():
    """The rows under the Triton interpreter (conftest's setting)."""
    lines = []
    passed, failed, missing = selfcheck.run_checks("cpu", out=lines.append)
    assert failed == 0, "\n".join(lines)
    assert passed >= 18
    assert selfcheck.unchecked_public_names() == []
    text = "\n".join(lines)
    for name in (
        "apply_rope_and_store, fp8",
        "rotate_with_angles",
        "backward",
        "tiny Llama",
        "M-RoPE interleaved",
        "strided MLA",
        "two token dims",
        "in place",
        "partial rotary",
        "interleaved (GPT-J",
    ):
        assert name in text
    # every row prints its dtype and threshold (0 for the bit-for-bit row)
    rows = [ln for ln in lines[1:] if "PASS" in ln]
    assert all(("bf16" in ln or "fp32" in ln) and ("e-0" in ln or " 0e+00 " in ln) for ln in rows), rows
    exact = [ln for ln in rows if "bit for bit" in ln]
    assert len(exact) == 1 and " 0e+00 " in exact[0] and " 0.00e+00 " in exact[0], exact


def test_a_wrong_op_fails_its_row(monkeypatch):
    real = ropekit.apply_rope

    def off_by_a_bit(q, k, *args, **kw):
        qo, ko = real(q, k, *args, **kw)
        return qo * 1.05, ko

    monkeypatch.setattr(ropekit, "apply_rope", off_by_a_bit)
    lines = []
    _, failed, _ = selfcheck.run_checks("cpu", checks=selfcheck.CHECKS[:1], out=lines.append)
    assert failed == 1 and "FAIL" in lines[-1]


def test_a_crash_fails_and_a_missing_feature_is_not_a_pass():
    def boom(device):
        raise RuntimeError("kaput")

    def absent(device):
        raise selfcheck.NotAvailable("no such op")

    rows = [selfcheck.Check("crash", "bf16", 1e-2, (), boom), selfcheck.Check("absent", "-", 0.0, (), absent)]
    lines = []
    passed, failed, missing = selfcheck.run_checks("cpu", checks=rows, out=lines.append)
    assert (passed, failed, missing) == (0, 1, 1)
    assert "FAIL" in lines[1] and "kaput" in lines[1] and "not available" in lines[2]


def test_a_broken_new_op_fails_its_row(monkeypatch):
    """The rows of the ops added later (QK-norm, re-rotation, packed sequences) fail when the op
    writes nothing or gets the math wrong."""
    monkeypatch.setattr(ropekit, "rerotate_kv_cache", lambda k_cache, *a, **kw: k_cache)
    row = next(c for c in selfcheck.CHECKS if c.name.startswith("rerotate_kv_cache"))
    _, failed, _ = selfcheck.run_checks("cpu", checks=[row], out=lambda s: None)
    assert failed == 1


def test_an_uncovered_public_name_fails(monkeypatch):
    monkeypatch.setattr(ropekit, "__all__", list(ropekit.__all__) + ["brand_new_op"])
    assert selfcheck.unchecked_public_names() == ["brand_new_op"]


@pytest.mark.slow
def test_module_entry_point_exit_status():
    src = os.path.dirname(os.path.dirname(os.path.abspath(ropekit.__file__)))
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # a user's shell: the CPU path
    r = subprocess.run(
        [sys.executable, "-m", "ropekit.selfcheck", "--no-bench"], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout and "ropekit.core.cpu" in r.stdout
