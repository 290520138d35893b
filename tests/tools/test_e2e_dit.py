"""benchmarks/e2e_dit.py in --quick mode (tiny configs of every model, float32): its rows exist for
the training and the inference step, ropekit ran inside every patched model (as many calls as the
model has rotations), the patched losses and outputs equal the unpatched ones, and its checks
flag a patch that rotates the wrong way and a patch that did nothing. On CPU; the CUDA path and
torch.compile of both variants in a test marked gpu.

The CPU tests run ropekit's CPU path (TRITON_INTERPRET removed for the run: the interpreted
kernels are covered by tests/integrations/test_vision_diffusers.py, and take seconds per step here). The
diffusers models are left out when diffusers is not installed (the ViT needs transformers only).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from ropekit.core import dispatch, memo  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_dit.py"
HAS_DIFFUSERS = importlib.util.find_spec("diffusers") is not None
DIFFUSERS_MODELS = ("flux", "wan", "flux2", "hunyuan_video15", "ltx2")
MODELS = (DIFFUSERS_MODELS if HAS_DIFFUSERS else ()) + ("dinov3", "qwen3", "qwen3_qkv")

# ropekit calls in one patched forward of each tiny model, and how many of them fuse the QK-RMSNorm:
# Flux.1, 1 double + 1 single block: the 4 + 2 norms of q / k, each its own call; Wan, 1 block: its
# self-attention's q and k norms; Flux 2, 1 double + 1 single: q and k of each attention through
# apply_rotary_emb; HunyuanVideo 1.5, 1 block: the video q and k; LTX-2, 1 block: q and k of the
# video and audio self-attention and of the audio-to-video and video-to-audio attention (the text
# cross-attentions have no rotation); DINOv3, 1 layer: one call for q and k; Qwen3, 1 layer: one
# call for q and k with both norms fused (fuse_qkv: the same call, after the layer's one projection).
CALLS = {
    "flux": (6, 6),
    "wan": (2, 2),
    "flux2": (4, 0),
    "hunyuan_video15": (2, 0),
    "ltx2": (8, 0),
    "dinov3": (1, 0),
    "qwen3": (1, 1),
    "qwen3_qkv": (1, 1),
}


def unpatch_all():
    import ropekit.hf as rh

    rh.unpatch()
    if HAS_DIFFUSERS:
        import ropekit.diffusers as rd

        rd.unpatch()


@pytest.fixture
def e2e(monkeypatch):
    """The benchmark script as a module, on the CPU path, one CPU thread (the tiny models' ops are
    far too small to share; with a busy host, several threads made steps 10x slower), with every
    patch undone afterwards. The memo is emptied on both sides: a spec holds its backend (Triton
    or the PyTorch path), decided when it was made, so specs an earlier test made under
    TRITON_INTERPRET=1 would send these calls to the interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    memo.clear()
    spec = importlib.util.spec_from_file_location("e2e_dit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield module
    finally:
        torch.set_num_threads(threads)
        unpatch_all()
        memo.clear()


def quick(e2e, *extra):
    return e2e.main(["--quick", "--device", "cpu", "--models", ",".join(MODELS), *extra])


def test_quick_rows(e2e, tmp_path):
    out = tmp_path / "e2e.json"
    rows = quick(e2e, "--out", str(out))
    assert [(r["model"], r["step"], r["mode"]) for r in rows] == [
        (m, step, "eager") for m in MODELS for step in ("train", "infer")
    ]
    for r in rows:
        assert "error" not in r
        assert (r["ropekit_calls"], r["fused_norm_calls"]) == CALLS[r["model"]], r["model"]
        assert r["unpatched"]["ropekit_calls"] == 0
        assert (r["patched_modules"] > 0) == (CALLS[r["model"]][1] > 0)
        assert r["unpatched_ms"] > 0 and r["patched_ms"] > 0
        assert r["output_rel_diff"] < 1e-5 and r["output_ok"]
        assert r["output_err_patched"] < 1e-5
        if r["step"] == "train":
            assert r["loss_rel_diff"] < 1e-5 and r["loss_ok"]
            assert r["grad_norm_rel_diff"] < 1e-4
        else:
            assert r["loss_patched"] is None and r["loss_ok"] is None
    assert not e2e.failed(rows)
    saved = json.loads(out.read_text())
    assert saved["size"] == "quick" and len(saved["rows"]) == len(rows)
    assert saved["environment"]["transformers"]
    text = e2e.table(rows)
    assert "| dinov3 | train | eager |" in text and "| dinov3 | infer | eager |" in text


def test_wrong_rotation_fails_the_check(e2e, monkeypatch):
    """Rotating by the negated angle inside every patched model must fail the parity checks. The
    wrong sign is armed only after the patch is in place: the patches verify each rotary helper
    against ropekit first, and a helper that disagrees is left alone (nothing would then rotate
    wrongly)."""
    real_set = e2e.set_patched
    armed = []

    def backwards(door):
        def negated(spec, q, k, a, b, *args, **kwargs):
            if armed and spec.variant.angles == "tokens":  # (cos, sin) per token: b is sin
                b = -b
            elif armed:  # fuse_qkv's table of one row a token, [cos | sin]
                assert spec.variant.angles == "table"
                half = b.shape[-1] // 2
                b = torch.cat((b[..., :half], -b[..., half:]), dim=-1)
            return door(spec, q, k, a, b, *args, **kwargs)

        return negated

    def set_then_arm(model, library, patched):
        armed.clear()
        report = real_set(model, library, patched)
        armed.extend([True] if patched else [])
        return report

    for name, door in list(dispatch.ROTATE.items()):
        monkeypatch.setitem(dispatch.ROTATE, name, backwards(door))
    monkeypatch.setattr(e2e, "set_patched", set_then_arm)
    rows = quick(e2e)
    for r in rows:
        assert r["ropekit_calls"] == CALLS[r["model"]][0]
        # NaN (a training step the wrong rotation made diverge) fails the check too
        assert not r["output_rel_diff"] <= 5e-4, (r["model"], r["step"])
        assert not r["output_ok"]
        assert r["loss_ok"] is (False if r["step"] == "train" else None)
    assert e2e.failed(rows) == rows


def test_a_patch_that_does_nothing_fails(e2e, monkeypatch):
    """A patched step that makes no ropekit call is a failed row, though its outputs agree."""
    monkeypatch.setattr(e2e, "set_patched", lambda model, library, patched: {})
    rows = e2e.main(["--quick", "--device", "cpu", "--models", "dinov3"])
    assert [r["ropekit_calls"] for r in rows] == [0, 0]
    assert all(r["output_ok"] for r in rows)
    assert e2e.failed(rows) == rows


def test_vit_alone_does_not_import_diffusers(tmp_path):
    """The GPU host may lack diffusers: a run of the transformers model alone must not import it
    (a fresh process: after the run, diffusers is not among its imported modules)."""
    code = (
        "import sys, importlib.util, torch\n"
        "torch.set_num_threads(1)\n"
        f"spec = importlib.util.spec_from_file_location('e2e', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"rows = m.main(['--quick', '--device', 'cpu', '--models', 'dinov3', '--step', 'infer', "
        f"'--out', {str(tmp_path / 'vit.json')!r}])\n"
        "assert not m.failed(rows) and len(rows) == 1\n"
        "assert 'diffusers' not in sys.modules, 'the ViT run imported diffusers'\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "diffusers" not in json.loads((tmp_path / "vit.json").read_text())["environment"]


def test_unknown_names_are_refused(e2e):
    with pytest.raises(SystemExit):
        e2e.parse_args(["--models", "flux,sd3"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--step", "train,sample"])


def check_cuda_rows(e2e, rows, models, modes):
    assert [(r["model"], r["step"], r["mode"]) for r in rows] == [
        (m, step, mode) for m in models for step in ("train", "infer") for mode in modes
    ]
    for r in rows:
        assert "error" not in r, r["error"]
        assert r["output_ok"] and r["loss_ok"] is not False, (r["model"], r["step"], r["output_err_patched"])
        assert r["unpatched"]["peak_gib"] > 0 and r["patched"]["peak_gib"] > 0
    assert not e2e.failed(rows)


@pytest.mark.gpu
def test_quick_on_cuda(e2e):
    """The CUDA path (CUDA events, peak memory, the Triton kernels), every model, training and
    inference, tiny configs: as many ropekit calls as on the CPU, outputs within the check."""
    rows = e2e.main(["--quick", "--device", "cuda", "--models", ",".join(MODELS)])
    check_cuda_rows(e2e, rows, MODELS, ("eager",))
    assert all((r["ropekit_calls"], r["fused_norm_calls"]) == CALLS[r["model"]] for r in rows)


@pytest.mark.gpu
def test_quick_on_cuda_with_compile(e2e):
    """torch.compile of both variants, training and inference, for one model of each patch: the
    fused norm (Flux.1), diffusers' rotary helpers (Flux 2), transformers' rotary function (DINOv3) and
    its fused QK-norm (Qwen3)."""
    models = [m for m in ("flux", "flux2", "dinov3", "qwen3") if m in MODELS]
    rows = e2e.main(["--quick", "--device", "cuda", "--compile", "--models", ",".join(models)])
    check_cuda_rows(e2e, rows, models, ("eager", "compile"))
