"""benchmarks/hf_decode.py on its tiny CPU configuration (2 layers, hidden 64, 2 new tokens, batches 1
and 2): a row per batch and configuration, the same greedy tokens in the three, ropekit called once
per layer and token in the patched ones (the norm-fused calls in the fused one), and the JSON it
writes. ropekit's CPU path (TRITON_INTERPRET removed for the run), one CPU thread."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "hf_decode.py"
LAYERS = 2


@pytest.fixture
def hf_decode(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = importlib.util.spec_from_file_location("hf_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield module
    finally:
        torch.set_num_threads(threads)
        import ropekit.hf as rh

        rh.unpatch()


def test_tiny_cpu_run(hf_decode, tmp_path, capsys):
    from ropekit.core import dispatch

    doors = dict(dispatch.ROTATE)
    out = tmp_path / "hf_decode.json"
    argv = ["--device", "cpu", "--layers", str(LAYERS), "--tiny", "--new-tokens", "2", "--batches", "1,2"]
    rows = hf_decode.main(argv + ["--rounds", "2", "--keep-tokens", "--out", str(out)])
    assert dispatch.ROTATE == doors  # the counting wrappers are gone

    assert [(r["batch"], r["configuration"]) for r in rows] == [(b, c) for b in (1, 2) for c in hf_decode.CONFIGS]
    for r in rows:
        assert r["check_ok"] and r["first_logits_ok"]
        assert r["tokens_equal_unpatched"] and r["first_divergence"] is None
        assert len(r["tokens"]) == r["batch"] and all(len(seq) == 2 for seq in r["tokens"])
        assert r["first_logits_rel_diff_unpatched"] < 1e-5 and r["first_logits_err_fp32"] is None
        assert len(r["ms_rounds"]) == 2 and r["ms_min"] <= r["ms_per_token"] <= r["ms_max"]
        # a tiny run's ms per token is the difference of two noisy generate times (one decode
        # step): on a busy host it can come out negative, so only its being a number is checked
        assert math.isfinite(r["speedup"])
        fused = r["configuration"] in ("patched+qknorm", "fused-qkv")  # the qkv prologue's one normed call
        calls = 0 if r["configuration"] == "unpatched" else 2 * LAYERS  # 2 forwards (tokens) x one per layer
        assert (r["ropekit_calls"], r["fused_norm_calls"]) == (calls, calls if fused else 0)
        assert r["calls_per_token"] == calls / 2
    for batch in (1, 2):
        same = [r["tokens"] for r in rows if r["batch"] == batch]
        assert same[0] == same[1] == same[2] == same[3]
    assert not hf_decode.failed(rows)

    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert saved["config"]["qwen3_config"]["num_hidden_layers"] == LAYERS and saved["config"]["new_tokens"] == 2
    assert {"torch", "transformers", "ropekit", "gpu"} <= set(saved["versions"])
    printed = capsys.readouterr().out
    assert "| 2 | patched+qknorm |" in printed and "checks: ok" in printed


def tiny(hf_decode, layers=1):
    return hf_decode.main(["--device", "cpu", "--layers", str(layers), "--tiny", "--new-tokens", "2", "--batches", "1"])


def test_a_patch_that_does_nothing_fails(hf_decode, monkeypatch):
    """A patched configuration that makes no ropekit call fails its check, though it agrees."""
    import ropekit.hf as rh

    def unpatched_only(model, name):
        rh.unpatch()
        rh.unfuse_qkv(model)
        return {}

    monkeypatch.setattr(hf_decode, "set_config", unpatched_only)
    rows = tiny(hf_decode)
    assert [r["configuration"] for r in hf_decode.failed(rows)] == ["patched", "patched+qknorm", "fused-qkv"]
    assert all(r["tokens_equal_unpatched"] and r["first_logits_ok"] for r in rows)


def test_wrong_rotation_fails(hf_decode, monkeypatch):
    """ropekit rotating by the negated angle (sin negated at every door) fails the logit check of
    every patched configuration, whatever the few greedy tokens do."""
    from ropekit.core import dispatch

    def backwards(door):
        def negated(spec, q, k, a, b, *args, **kwargs):
            if spec.variant.angles == "tokens":  # HF's (cos, sin) per token: b is sin
                b = -b
            else:  # fuse_qkv's table of one row a token, [cos | sin]
                assert spec.variant.angles == "table"
                half = b.shape[-1] // 2
                b = torch.cat((b[..., :half], -b[..., half:]), dim=-1)
            return door(spec, q, k, a, b, *args, **kwargs)

        return negated

    for name, door in list(dispatch.ROTATE.items()):
        monkeypatch.setitem(dispatch.ROTATE, name, backwards(door))
    rows = tiny(hf_decode)
    assert [r["configuration"] for r in hf_decode.failed(rows)] == ["patched", "patched+qknorm", "fused-qkv"]
    assert all(r["first_logits_rel_diff_unpatched"] > 1e-3 for r in rows[1:])
