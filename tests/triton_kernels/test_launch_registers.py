"""benchmarks/scripts/launch_registers.py: a workload's real launches compiled for sm_90 without a GPU. The
prefetch knob must show in the recorded launch and cost registers (W14: k's 40 heads held during
q's norm; 167 against 223 with Triton 3.6, 154 against 208 with 3.9), and the programs an SM must follow from the registers (65,536 a SM, 8-register
allocation steps, at most 64 warps)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
TOOL = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "launch_registers.py"
LINE = re.compile(r"rope_kernel warps=(\d+) .*'PREFETCH': (True|False).*Used (\d+) registers.*; (\d+) programs an SM")


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(TOOL.parents[2] / "src"))
    out = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    found = [LINE.search(ln) for ln in out.stdout.splitlines()]
    found = [m for m in found if m]
    assert len(found) == 1, out.stdout
    warps, prefetch, regs, programs = found[0].groups()
    return int(warps), prefetch == "True", int(regs), int(programs)


def test_prefetch_shows_and_costs_registers():
    bin_dir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists():
        pytest.skip("this Triton carries no ptxas")
    plain = _run("W14")
    held = _run("W14", "prefetch=1")
    assert not plain[1] and held[1]
    assert held[2] > plain[2]
    for warps, _, regs, programs in (plain, held):
        per_program = -(-regs // 8) * 8 * 32 * warps
        assert programs == min(65536 // per_program, 64 // warps)
