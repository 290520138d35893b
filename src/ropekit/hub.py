"""ropekit through Hugging Face's `kernels` package, from a local directory, without the network.

transformers marks `apply_rotary_pos_emb` with `use_kernel_forward_from_hub("rotary_pos_emb")`
and the attention classes with `use_kernelized_func(...)`; `kernels.kernelize(model, ...)` then
swaps in the layer a kernel mapping names. This module writes a kernel repository whose layer is
ropekit's drop-in (ropekit.hf.apply_rotary_pos_emb), and builds the mapping for it:

    from kernels import Mode, kernelize, use_kernel_mapping
    import ropekit.hub

    path = ropekit.hub.write_kernel_repo("ropekit-kernel")          # once; any directory
    with use_kernel_mapping(ropekit.hub.kernel_mapping(path, device="cuda")):
        model = kernelize(model, mode=Mode.TRAINING, device="cuda")

Layout (what `kernels.get_local_kernel` resolves): <path>/build/torch-universal/ holding
metadata.json and the Python package ropekit_rope/ (pure Python over Triton: one universal
variant serves every backend). The package imports the installed ropekit; it holds no copy.

The layer, `layers.ApplyRotaryTransformers`, is stateless, as `kernels` requires: no constructor,
no members beyond `has_backward` (True: ropekit's backward is the exact inverse rotation) and
`can_torch_compile` (False: the drop-in is not checked under torch.compile, so `kernels` falls
back to HF's function in that mode). Its forward has the signature of transformers 5.x's
`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`, which `kernels` compares with the
function it replaces.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

NAME = "ropekit-rope"  # kernel name: the package is its python name, ropekit_rope
LAYER = "ApplyRotaryTransformers"  # the layer_name a kernel mapping asks for
VARIANT = "torch-universal"

_PACKAGE = '''"""ropekit's RoPE as a `kernels` layer (written by ropekit.hub.write_kernel_repo)."""

from types import SimpleNamespace

import torch
from torch import nn

import ropekit.hf


class ApplyRotaryTransformers(nn.Module):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1), computed by ropekit."""

    has_backward = True
    can_torch_compile = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim=1):
        return ropekit.hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


layers = SimpleNamespace(ApplyRotaryTransformers=ApplyRotaryTransformers)
'''


def _metadata() -> dict:
    import ropekit

    major = int(str(ropekit.__version__).split(".")[0] or 0)
    return {
        "id": NAME,
        "name": NAME,
        "version": max(major, 1),
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": {"type": "cuda"},
    }


def write_kernel_repo(path: str) -> str:
    """Write the kernel repository under `path` (created if needed; files overwritten). Returns
    the absolute path, the `repo_path` of a kernels.LocalLayerRepository."""
    root = os.path.abspath(os.fspath(path))
    variant = os.path.join(root, "build", VARIANT)
    package = os.path.join(variant, NAME.replace("-", "_"))
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(variant, "metadata.json"), "w") as f:
        json.dump(_metadata(), f, indent=2)
        f.write("\n")
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(_PACKAGE)
    return root


def kernel_mapping(path: str, device: str = "cuda", modes=None) -> dict:
    """The mapping for `kernels.use_kernel_mapping`: transformers' "rotary_pos_emb" layer on
    `device` served by the repository at `path`, for `modes` (default: inference and training)."""
    from pathlib import Path

    from kernels import LocalLayerRepository, Mode

    repo = LocalLayerRepository(repo_path=Path(path), layer_name=LAYER)
    if modes is None:
        modes = (Mode.INFERENCE, Mode.TRAINING)
    return {"rotary_pos_emb": {device: {mode: repo for mode in modes}}}


def main(argv: Optional[list] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m ropekit.hub DIRECTORY  (writes the kernels-package repository there)", file=sys.stderr)
        return 2
    print(write_kernel_repo(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
