"""ropekit through Hugging Face's `kernels` package from a local directory (ropekit.hub).

A tiny random HF Llama is kernelized with ropekit's layer for transformers' "rotary_pos_emb" and
must give HF's logits and parameter gradients. Runs in a subprocess: the kernelization replaces
a module-level function of transformers, and transformers' gate on the kernels version has to
be opened before transformers is imported when the installed kernels is older than the one
transformers asks for (the package index here has kernels 0.17.x; transformers 5.24 asks for
0.18.2+); the mechanism used (use_kernel_forward_from_hub, use_kernelized_func, kernelize,
LocalLayerRepository) is the same.
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


def test_repository_layout_and_metadata(tmp_path):
    root = hub.write_kernel_repo(str(tmp_path / "repo"))
    variant = os.path.join(root, "build", "torch-universal")
    with open(os.path.join(variant, "metadata.json")) as f:
        meta = json.load(f)
    assert meta["name"] == "ropekit-rope" and meta["license"] == "Apache-2.0" and meta["python-depends"] == []
    assert os.path.exists(os.path.join(variant, "ropekit_rope", "__init__.py"))
    kernels = pytest.importorskip("kernels")
    from kernels._rust import Metadata  # the parser kernels itself uses

    m = Metadata.read_from_file(os.path.join(variant, "metadata.json"))
    assert str(m.name) == "ropekit-rope"
    module = kernels.get_local_kernel(__import__("pathlib").Path(root))
    layer = module.layers.ApplyRotaryTransformers
    assert layer.has_backward is True and layer.can_torch_compile is False


def test_layer_signature_matches_transformers_function(tmp_path):
    """kernels compares the number and kinds of forward's parameters with the function's."""
    import importlib.util
    import inspect

    pytest.importorskip("transformers")
    root = hub.write_kernel_repo(str(tmp_path / "repo"))
    path = os.path.join(root, "build", "torch-universal", "ropekit_rope", "__init__.py")
    spec = importlib.util.spec_from_file_location("ropekit_rope_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from transformers.models.llama import modeling_llama

    fn = modeling_llama.apply_rotary_pos_emb
    fn = getattr(fn, "forward", fn)  # a Func module when transformers' kernels hook is on
    ref = [p.kind for n, p in inspect.signature(fn).parameters.items() if n != "self"]
    ours = [p.kind for n, p in inspect.signature(mod.ApplyRotaryTransformers.forward).parameters.items() if n != "self"]
    assert ours == ref


_SCRIPT = r"""
import sys, json, torch
import transformers.utils as _u, transformers.utils.import_utils as _iu
_u.is_kernels_available = _iu.is_kernels_available = lambda *a, **k: True   # open the version gate
import transformers
import transformers.integrations.hub_kernels as hk
assert hk._kernels_enabled
from kernels import Mode, kernelize, use_kernel_mapping
import ropekit.hf, ropekit.hub

device, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               partial_rotary_factor=1.0)
model = transformers.LlamaForCausalLM(cfg).to(device).train()
ids = torch.randint(0, 128, (2, 24), device=device)

def run():
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach().double(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}

want_logits, want_grads = run()
calls = []
real = ropekit.hf.apply_rotary_pos_emb
ropekit.hf.apply_rotary_pos_emb = lambda *a, **k: calls.append(1) or real(*a, **k)
with use_kernel_mapping(ropekit.hub.kernel_mapping(path, device=device)):
    model = kernelize(model, mode=Mode.TRAINING, device=device)
got_logits, got_grads = run()
rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))
print(json.dumps({"calls": len(calls), "logits": rel(got_logits, want_logits),
                  "grads": max(rel(got_grads[n], want_grads[n]) for n in want_grads)}))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kernelized_llama_matches_hf(tmp_path, device):
    pytest.importorskip("kernels")
    pytest.importorskip("transformers")
    root = hub.write_kernel_repo(str(tmp_path / "repo"))
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, device, root], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["calls"] == 2, out  # ropekit ran once per layer (the forward; backward is ropekit's)
    assert out["logits"] <= 1e-5 and out["grads"] <= 1e-5, out


def test_cli_writes_the_repository(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "ropekit.hub", str(tmp_path / "k")], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert os.path.exists(tmp_path / "k" / "build" / "torch-universal" / "metadata.json")
    r = subprocess.run([sys.executable, "-m", "ropekit.hub"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "usage" in r.stderr
