"""benchmarks/qkv_gemm.py on its tiny CPU configuration (the fused kernel in the Triton interpreter):
shape selection on the command line (--shapes, --preset, --modes, --variants) and the JSON it
writes (the fields it always had, and the new ones beside them)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "qkv_gemm.py"


@pytest.fixture
def qkv_bench():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the dry run takes the fused kernel in the interpreter (TRITON_INTERPRET=1)")
    spec = importlib.util.spec_from_file_location("qkv_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_selected_shapes(qkv_bench, tmp_path, capsys):
    out = tmp_path / "qkv.json"
    argv = ["--device", "cpu", "--shapes", "tiny:16,tiny:24", "--modes", "fwd_bwd", "--variants", "fused"]
    assert qkv_bench.main([*argv, "--rounds", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["shapes"] == ["tiny:16", "tiny:24"] and doc["config"]["modes"] == ["fwd_bwd"]
    assert doc["config"]["variants"] == ["fused", "unfused"] and doc["config"]["tokens"] == [16, 24]
    assert [(r["model"], r["T"]) for r in doc["results"]] == [("tiny", 16), ("tiny", 24)]
    for r in doc["results"]:
        assert "fwd" not in r and r["fwd_bwd"]["fused_ms"] > 0 and r["fwd_bwd"]["unfused_ms"] > 0
        # bf16: the fused path rounds once, the unfused one twice (about one bf16 ulp apart)
        assert r["max_rel_err_fwd_fused"] < 1e-2 and r["max_rel_err_grad_fused"] < 1e-2
        assert "max_rel_err_fwd_fused_tma" not in r  # not selected: not run
    assert [e["shape_class"][5] for e in doc["auto_table"]] == ["train"]  # both rows in token bucket 0
    printed = capsys.readouterr().out
    assert printed.count(" fwd_bwd ") == 2 and " fwd " not in printed


def test_tiny_cpu_store_mode(qkv_bench, tmp_path):
    """The paged-cache write's row: timed, its fused write checked against the unfused one."""
    out = tmp_path / "qkv.json"
    argv = ["--device", "cpu", "--shapes", "tiny:20", "--modes", "store", "--variants", "fused", "--rounds", "1"]
    assert qkv_bench.main([*argv, "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert set(r) & {"fwd", "fwd_bwd", "store"} == {"store"} and r["store"]["fused_ms"] > 0
    assert r["max_rel_err_store_fused"] < 1e-2  # bf16, one rounding apart; inf if a row differs in NaN


def test_preset_and_bad_selections(qkv_bench):
    class Args:
        preset, shapes, models, tokens = "long", None, "", ""

    rows = qkv_bench._shapes(Args)
    assert rows == [("llama3_8b", 8192), ("llama3_8b", 32768), ("qwen3_8b", 8192), ("qwen3_8b", 32768)]
    Args.preset, Args.shapes = None, "llama3_8b:big"
    with pytest.raises(SystemExit, match="--shapes: expected MODEL:T"):
        qkv_bench._shapes(Args)
    with pytest.raises(SystemExit):
        qkv_bench.main(["--device", "cpu", "--shapes", "tiny:8", "--modes", "bwd"])


def test_tiny_cpu_packed_variant_and_sweep_configs(qkv_bench, tmp_path, monkeypatch):
    """The packed path as a timed variant (checked against the unfused op first), and
    --sweep-configs parsed into the sweep's configs."""
    from ropekit.kernels import qkv_gemm

    calls = []
    real = qkv_gemm.packed_weight
    monkeypatch.setattr(qkv_gemm, "packed_weight", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = tmp_path / "qkv.json"
    argv = ["--device", "cpu", "--shapes", "tiny:16", "--modes", "fwd", "--variants", "fused_packed"]
    assert qkv_bench.main([*argv, "--rounds", "1", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert calls and r["max_rel_err_fwd_fused_packed"] < 1e-2 and r["fwd"]["fused_packed_ms"] > 0
    assert "max_rel_err_fwd_fused" not in r and qkv_gemm.PATH == ""
    text = "G=2,BLOCK_M=128,BLOCK_K=64,GROUP_M=8,num_warps=8,num_stages=3,PACKED=1;" + (
        "G=1,BLOCK_M=64,BLOCK_K=32,GROUP_M=4,num_warps=4,num_stages=2,WARP_SPEC=0"
    )
    first, second = qkv_bench.parse_configs(text)
    assert first["PACKED"] is True and first["G"] == 2 and second["WARP_SPEC"] is False
    with pytest.raises(SystemExit, match="expected keys"):
        qkv_bench.parse_configs("G=2,BLOCK_M=128")
