"""benchmarks/e2e_dit.py in --quick mode (tiny Flux.1 and Wan configs, float32): its rows exist,
ropekit ran inside the patched models, the patched losses and outputs equal the unpatched ones,
and its parity check flags a patch that rotates the wrong way. On CPU; the CUDA path and
torch.compile of both variants in a test marked gpu.

The CPU tests run ropekit's CPU path (TRITON_INTERPRET removed for the run: the interpreted
kernels are covered by tests/test_vision_diffusers.py, and take seconds per step here). Skipped
when diffusers is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("diffusers")

import ropekit.diffusers as rd  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_dit.py"


@pytest.fixture
def e2e(monkeypatch):
    """The benchmark script as a module, on the CPU path, with every patch undone afterwards."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = importlib.util.spec_from_file_location("e2e_dit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    rd.unpatch()


def test_quick_rows(e2e, tmp_path):
    out = tmp_path / "e2e.json"
    rows = e2e.main(["--quick", "--device", "cpu", "--out", str(out)])
    assert [(r["model"], r["mode"]) for r in rows] == [("flux", "eager"), ("wan", "eager")]
    calls = {"flux": 6, "wan": 2}  # norms with a rotary embedding: Flux 4 + 2 blocks' q / k, Wan's self-attention
    for r in rows:
        assert "error" not in r
        assert r["patched_modules"] > 0
        assert r["ropekit_calls"] == r["fused_norm_calls"] == calls[r["model"]]
        assert r["unpatched"]["ropekit_calls"] == 0
        assert r["unpatched_ms"] > 0 and r["patched_ms"] > 0
        assert r["loss_rel_diff"] < 1e-5 and r["output_rel_diff"] < 1e-5
        assert r["loss_ok"] and r["output_ok"]
    assert not e2e.failed(rows)
    saved = json.loads(out.read_text())
    assert saved["size"] == "quick" and len(saved["rows"]) == 2
    assert "| flux | eager |" in e2e.table(rows)


def test_wrong_rotation_fails_the_check(e2e, monkeypatch):
    """Rotating by the negated angle inside the patched norms must fail the parity check."""
    real = rd.rotate_with_angles

    def backwards(q, k, cos, sin, **kwargs):
        return real(q, k, cos, -sin, **kwargs)

    monkeypatch.setattr(rd, "rotate_with_angles", backwards)
    rows = e2e.main(["--quick", "--device", "cpu", "--models", "flux"])
    assert rows[0]["output_rel_diff"] > 1e-3
    assert not rows[0]["output_ok"] and not rows[0]["loss_ok"]
    assert e2e.failed(rows) == rows


@pytest.mark.gpu
def test_quick_on_cuda_with_compile(e2e):
    """The CUDA path (CUDA events, peak memory) and torch.compile of both variants, tiny configs."""
    rows = e2e.main(["--quick", "--device", "cuda", "--compile"])
    assert [(r["model"], r["mode"]) for r in rows] == [
        (m, mode) for m in ("flux", "wan") for mode in ("eager", "compile")
    ]
    for r in rows:
        assert "error" not in r, r["error"]
        assert r["loss_ok"] and r["output_ok"], (r["loss_rel_diff"], r["output_err_patched"])
        assert r["unpatched"]["peak_gib"] > 0 and r["patched"]["peak_gib"] > 0
    assert not e2e.failed(rows)
