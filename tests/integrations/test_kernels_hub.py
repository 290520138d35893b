"""ropekit as a Hugging Face kernel repository (ropekit.hub) and the `kernels` route into it.

The repository is built into tmp_path from the package and loaded with `kernels`' own loader
(`get_local_kernel`); the layer is swapped in with `kernels`' own `kernelize`. Loading and
kernelizing run in subprocesses: they import a second copy of ropekit (under the build's own op
namespace), replace module-level functions and import transformers' models (which changes how
Triton builds kernels later in the process), none of which may leak into other tests. Nothing here
patches transformers: the transformers route runs only where transformers' own gate accepts the
installed `kernels`, and otherwise skips saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ropekit
from ropekit import hub

SRC = os.path.dirname(os.path.dirname(os.path.abspath(ropekit.__file__)))
ENV = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")


def run_script(script: str, *args: str) -> dict:
    """Run `script` in a fresh interpreter; its last stdout line is JSON."""
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return hub.build_kernel_repo(tmp_path_factory.mktemp("hub") / "ropekit-rope")


def shipped_files(repo):
    variant = os.path.join(repo, "build", "torch-cpu")
    for dirpath, _, names in os.walk(variant):
        for name in names:
            yield os.path.relpath(os.path.join(dirpath, name), variant)


def test_layout_has_one_variant_per_backend_with_metadata(repo):
    assert sorted(os.listdir(os.path.join(repo, "build"))) == ["torch-cpu", "torch-cuda"]
    assert os.path.exists(os.path.join(repo, "README.md"))
    for backend in ("cpu", "cuda"):
        variant = os.path.join(repo, "build", f"torch-{backend}")
        with open(os.path.join(variant, "metadata.json")) as f:
            meta = json.load(f)
        assert meta["name"] == "ropekit-rope" and meta["backend"] == {"type": backend}
        assert meta["id"].startswith(f"_ropekit_rope_{backend}_") and meta["python-depends"] == []
        for entry in ("__init__.py", "ropekit_rope/__init__.py", "ropekit_rope/layers.py", "ropekit_rope/api/ops.py"):
            assert os.path.exists(os.path.join(variant, entry)), entry


def test_metadata_parses_with_kernels_own_reader(repo):
    kernels = pytest.importorskip("kernels")
    m = kernels.Metadata.read_from_file(os.path.join(repo, "build", "torch-cuda", "metadata.json"))
    assert str(m.name) == "ropekit-rope" and m.version == hub.KERNEL_VERSION and m.python_depends == []


def test_copy_has_its_own_op_namespace_and_no_tools(repo):
    files = list(shipped_files(repo))
    assert not any(f.startswith(os.path.join("ropekit_rope", "bench")) for f in files)
    for tool in ("selfcheck.py", "hub.py", "audit.py"):
        assert os.path.join("ropekit_rope", tool) not in files
    with open(os.path.join(repo, "build", "torch-cpu", "metadata.json")) as f:
        namespace = json.load(f)["id"]
    seen = 0
    for rel in files:
        with open(os.path.join(repo, "build", "torch-cpu", rel)) as f:
            text = f.read()
        assert '"ropekit::' not in text and "torch.ops.ropekit" not in text, rel
        seen += text.count(f'"{namespace}::')
    assert seen > 0  # the custom ops were renamed, not dropped


def test_build_is_deterministic(tmp_path):
    a = hub.build_kernel_repo(tmp_path / "a")
    b = hub.build_kernel_repo(tmp_path / "b")
    for rel in shipped_files(a):
        with (
            open(os.path.join(a, "build", "torch-cpu", rel)) as fa,
            open(os.path.join(b, "build", "torch-cpu", rel)) as fb,
        ):
            assert fa.read() == fb.read(), rel


LOAD = r"""
import inspect, json, sys
from pathlib import Path
import torch, kernels, ropekit

m = kernels.get_local_kernel(Path(sys.argv[1]))


def hf_kinds():
    # the parameter kinds of transformers' function, which kernels compares with the layer's forward
    try:
        from transformers.models.llama import modeling_llama
    except ImportError:
        return None
    fn = modeling_llama.apply_rotary_pos_emb
    fn = getattr(fn, "forward", fn)  # a Func module where transformers' kernels hook is on
    return [str(p.kind) for n, p in inspect.signature(fn).parameters.items() if n != "self"]


torch.manual_seed(0)
cache = ropekit.cos_sin_cache(32, 64)
q, k = torch.randn(2, 7, 4, 32), torch.randn(2, 7, 2, 32)
pos = torch.randint(0, 64, (2, 7))
want = ropekit.apply_rope(q, k, pos, cache)
got = m.apply_rope(q, k, pos, cache)
layer = m.layers.ApplyRotaryTransformers
params = inspect.signature(layer.forward).parameters.values()
print(json.dumps({
    "module": m.__name__, "version": m.__version__,
    "equal": all(torch.equal(a, b) for a, b in zip(want, got)),
    "op_namespace": hasattr(getattr(torch.ops, m.__name__), "rotate"),
    "has_backward": layer.has_backward, "can_torch_compile": layer.can_torch_compile,
    "kinds": [str(p.kind) for p in params if p.name != "self"],
    "hf_kinds": hf_kinds(),
}))
"""


def test_kernels_loads_the_build_beside_the_installed_ropekit(repo):
    pytest.importorskip("kernels")
    out = run_script(LOAD, repo)
    assert out["module"].startswith("_ropekit_rope_cpu_") and out["version"] == ropekit.__version__
    assert out["equal"] and out["op_namespace"], out
    assert out["has_backward"] is True and out["can_torch_compile"] is False
    if out["hf_kinds"] is not None:  # transformers installed: kernels swaps only on equal kinds
        assert out["kinds"] == out["hf_kinds"], out


SWAP_IN = r"""
import json, sys
from pathlib import Path
import torch
from kernels import Mode, get_local_kernel, kernelize, use_kernel_mapping
import ropekit.hub

path, device = sys.argv[1], sys.argv[2]


def swap_in_ropekit(model, path, device):
    # kernelize `model` with the repository at `path`; `calls` counts the layer's calls of the
    # build's drop-in (the layer looks the function up at call time)
    module = get_local_kernel(Path(path))
    calls = []
    real = module.layers.hf.apply_rotary_pos_emb
    module.layers.hf.apply_rotary_pos_emb = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    with use_kernel_mapping(ropekit.hub.kernel_mapping(path, device=device)):
        return kernelize(model, mode=Mode.TRAINING, device=device), calls
"""

KERNELIZE = (
    SWAP_IN
    + r"""
from torch import nn
from kernels import use_kernel_forward_from_hub, use_kernelized_func


@use_kernel_forward_from_hub("rotary_pos_emb")
def rope(q, k, cos, sin, unsqueeze_dim=1):  # transformers' formula and signature, written out
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    half = lambda x: torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)
    return q * cos + half(q) * sin, k * cos + half(k) * sin


@use_kernelized_func(rope)
class Attention(nn.Module):
    def forward(self, q, k, cos, sin):
        return rope(q, k, cos, sin)


torch.manual_seed(0)
B, H, S, D = 2, 4, 9, 32
q = torch.randn(B, H, S, D, device=device, requires_grad=True)
k = torch.randn(B, 2, S, D, device=device, requires_grad=True)
angles = torch.arange(S, device=device)[:, None] * 0.1 ** torch.linspace(0, 3, D // 2, device=device)
emb = torch.cat([angles, angles], dim=-1).expand(B, S, D)
cos, sin = emb.cos(), emb.sin()

def run(model):
    q.grad = k.grad = None
    qo, ko = model(q, k, cos, sin)
    (qo.square().sum() + ko.pow(3).sum()).backward()
    return [t.detach().double() for t in (qo, ko, q.grad, k.grad)]

model = Attention()
want = run(model)
model, calls = swap_in_ropekit(model, path, device)
got = run(model)
err = max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
print(json.dumps({"calls": len(calls), "err": err}))
"""
)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernelize_swaps_in_ropekit_through_kernels_own_api(repo, device):
    """kernels' use_kernel_forward_from_hub / use_kernelized_func / kernelize, as transformers
    uses them, with ropekit's layer mapped to "rotary_pos_emb"."""
    pytest.importorskip("kernels")
    out = run_script(KERNELIZE, repo, device)
    assert out["calls"] == 1, out  # the forward ran through ropekit (its backward is ropekit's too)
    assert out["err"] <= 1e-5, out


def transformers_gate_skip_reason():
    """None when transformers enables its hub layers for the installed kernels, else why not."""
    pytest.importorskip("kernels")
    pytest.importorskip("transformers")
    import importlib.metadata

    from transformers.utils import import_utils

    if import_utils.is_kernels_available():
        return None
    low = getattr(import_utils, "KERNELS_MIN_VERSION", "?")
    high = getattr(import_utils, "KERNELS_MAX_VERSION", "?")
    return (
        f"transformers {importlib.metadata.version('transformers')} enables its hub layers only for "
        f"kernels >= {low}, < {high}; installed kernels {importlib.metadata.version('kernels')} "
        "(the package index serves none in that range; `pip install -e '.[hub]'` asks for it)"
    )


LLAMA = (
    SWAP_IN
    + r"""
import transformers

torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = transformers.LlamaForCausalLM(cfg).to(device).train()
ids = torch.randint(0, 128, (2, 24), device=device)

def run():
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach().double(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}

want_logits, want_grads = run()
model, calls = swap_in_ropekit(model, path, device)
got_logits, got_grads = run()
rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))
print(json.dumps({"calls": len(calls), "logits": rel(got_logits, want_logits),
                  "grads": max(rel(got_grads[n], want_grads[n]) for n in want_grads)}))
"""
)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernelized_llama_matches_hf(repo, device):
    reason = transformers_gate_skip_reason()
    if reason:
        pytest.skip(reason)
    out = run_script(LLAMA, repo, device)
    assert out["calls"] == 2, out  # once per decoder layer
    assert out["logits"] <= 1e-5 and out["grads"] <= 1e-5, out


def test_cli_builds_the_repository_and_refuses_other_arguments(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "ropekit.hub", "build", str(tmp_path / "k")],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert os.path.exists(tmp_path / "k" / "build" / "torch-cuda" / "metadata.json")
    for args in ([], [str(tmp_path / "k")], ["build"], ["build", "--help"]):
        r = subprocess.run([sys.executable, "-m", "ropekit.hub", *args], capture_output=True, text=True, env=ENV)
        assert r.returncode == 2 and "usage: python -m ropekit.hub build" in r.stderr, args
