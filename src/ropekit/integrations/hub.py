"""ropekit as a Hugging Face kernel repository (the `kernels` package), built from this package.

    python -m ropekit.hub build DIR        # writes the repository under DIR; upload DIR as it is

transformers marks `apply_rotary_pos_emb` with `use_kernel_forward_from_hub("rotary_pos_emb")`
and the attention classes with `use_kernelized_func(...)`; `kernels.kernelize(model, ...)` swaps
in the layer a kernel mapping names. The repository's layer `ApplyRotaryTransformers` is
ropekit's drop-in for that function. From the local directory, without the network:

    from kernels import Mode, kernelize, use_kernel_mapping
    import ropekit.hub

    path = ropekit.hub.build_kernel_repo("ropekit-rope")
    with use_kernel_mapping(ropekit.hub.kernel_mapping(path, device="cuda")):
        model = kernelize(model, mode=Mode.TRAINING, device="cuda")

Layout (the Hub's kernel-repository layout, the one `kernels` resolves):

    DIR/README.md                              the repository card
    DIR/build/torch-<backend>/metadata.json    name, id, version, license, python-depends, backend
    DIR/build/torch-<backend>/__init__.py      the kernel module (re-exports the package below)
    DIR/build/torch-<backend>/ropekit_rope/    a copy of ropekit's runtime modules, plus layers.py

One "noarch" variant per backend ropekit is tested on (`torch-cuda`: the Triton kernels;
`torch-cpu`: the PyTorch path); the code is the same Python in each. `ropekit_rope/` is also the
directory older `kernels` releases import. The copy is self-contained (the Hub's kernels may
depend on no package but the few `kernels` allows, so it cannot import an installed ropekit), and
its `torch.library` ops live in a namespace named after the build's id, so the kernel loads next
to an installed ropekit without the two registering the same op.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterable, Optional

NAME = "ropekit-rope"  # kernel name; its Python name is ropekit_rope
PACKAGE = NAME.replace("-", "_")
LAYER = "ApplyRotaryTransformers"  # the layer_name a kernel mapping asks for
BACKENDS = ("cuda", "cpu")  # the backends ropekit is tested on: one build variant each
# The kernel's interface version (the Hub's `version=` argument): the layer's forward signature
# and the exported names. Raise it when either changes incompatibly.
KERNEL_VERSION = 1
UPSTREAM = "https://github.com/ropekit/ropekit"

# Modules of ropekit that are tools, not runtime: left out of the kernel.
TOOLS = ("tools", "bench.py", "selfcheck.py", "audit.py", "hub.py", "integrations/hub.py")

LAYERS_MODULE = '''"""Layers for `kernels.kernelize` (written by ropekit.hub).

ApplyRotaryTransformers replaces transformers' apply_rotary_pos_emb(q, k, cos, sin,
unsqueeze_dim=1): q (B, Hq, S, D), k (B, Hk, S, D), cos / sin (B, S, D) as transformers' rotary
module returns them; fp16 / bf16 / fp32. It is stateless, as `kernels` requires: no constructor,
no members beyond has_backward (True: the backward is the exact inverse rotation) and
can_torch_compile (False: `kernels` keeps transformers' function under torch.compile).
"""

from torch import nn

from . import hf


class ApplyRotaryTransformers(nn.Module):
    has_backward = True
    can_torch_compile = False

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
'''

ENTRY_MODULE = f'''"""ropekit's RoPE kernels as a `kernels` kernel (written by ropekit.hub)."""

from .{PACKAGE} import *  # noqa: F401,F403
from .{PACKAGE} import __all__, __version__, layers  # noqa: F401
'''

CARD = f"""---
license: apache-2.0
tags:
  - kernels
---

# {NAME}

Rotary position embedding (RoPE) kernels in Triton from [ropekit]({UPSTREAM}), built with
`python -m ropekit.hub build DIR` from ropekit @VERSION@. Upload the directory as it is to a
kernel-type repository, on the branch `v{KERNEL_VERSION}` (what `version={KERNEL_VERSION}` resolves to).

The layer `{LAYER}` replaces transformers' `apply_rotary_pos_emb`:

```python
from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping

repo = LayerRepository(repo_id="<owner>/{NAME}", layer_name="{LAYER}", version={KERNEL_VERSION},
                       trust_remote_code=True)  # needed unless <owner> is a publisher kernels trusts
with use_kernel_mapping({{"rotary_pos_emb": {{"cuda": {{Mode.TRAINING: repo, Mode.INFERENCE: repo}}}}}}):
    model = kernelize(model, mode=Mode.TRAINING, device="cuda")
```

`kernels.get_kernel("<owner>/{NAME}", version={KERNEL_VERSION}, trust_remote_code=True)` gives the
module, with ropekit's functions (`apply_rope`, `apply_rope_and_store`, `rotate_with_angles`,
`rerotate_kv_cache`, ...). Build variants: {", ".join(f"`torch-{b}`" for b in BACKENDS)}.
"""


def package_root() -> Path:
    """The directory of the installed ropekit package, the source the kernel is built from."""
    return Path(__file__).resolve().parents[1]


def runtime_sources(root: Path) -> list:
    """The .py files under `root` that the kernel ships, as paths relative to `root`, sorted."""
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] not in TOOLS and rel.as_posix() not in TOOLS and "__pycache__" not in rel.parts:
            files.append(rel)
    return files


def source_digest(root: Path, files: Iterable[Path]) -> str:
    """Seven hex digits of sha256 over the shipped files' paths and contents."""
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.as_posix().encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()[:7]


def build_id(backend: str, digest: str) -> str:
    """The variant's module id and op namespace, e.g. `_ropekit_rope_cuda_1a2b3c4`."""
    return f"_{PACKAGE}_{backend}_{digest}"


def rename_op_namespace(source: str, namespace: str) -> str:
    """`source` with ropekit's torch.library namespace replaced by `namespace`."""
    return source.replace('"ropekit::', f'"{namespace}::').replace("torch.ops.ropekit", f"torch.ops.{namespace}")


def metadata(backend: str, digest: str) -> dict:
    """The variant's metadata.json contents."""
    return {
        "name": NAME,
        "id": build_id(backend, digest),
        "version": KERNEL_VERSION,
        "license": "Apache-2.0",
        "upstream": UPSTREAM,
        "python-depends": [],
        "backend": {"type": backend},
    }


def write_variant(variant: Path, root: Path, files: list, backend: str, digest: str) -> None:
    """One build variant: metadata.json, the entry module and the package copy under `variant`."""
    if variant.exists():
        shutil.rmtree(variant)
    package = variant / PACKAGE
    namespace = build_id(backend, digest)
    for rel in files:
        target = package / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(rename_op_namespace((root / rel).read_text(), namespace))
    (package / "layers.py").write_text(LAYERS_MODULE)
    (variant / "__init__.py").write_text(ENTRY_MODULE)
    (variant / "metadata.json").write_text(json.dumps(metadata(backend, digest), indent=2) + "\n")


def build_kernel_repo(path, backends: Iterable[str] = BACKENDS) -> str:
    """Write the kernel repository under `path` (created if needed; the variants are replaced).

    Returns the absolute path: what to upload to the Hub, and the `repo_path` of a
    `kernels.LocalLayerRepository` (see `kernel_mapping`)."""
    repo = Path(os.fspath(path)).resolve()
    root = package_root()
    files = runtime_sources(root)
    digest = source_digest(root, files)
    for backend in backends:
        write_variant(repo / "build" / f"torch-{backend}", root, files, backend, digest)
    from .. import __version__

    (repo / "README.md").write_text(CARD.replace("@VERSION@", __version__))
    return str(repo)


def kernel_mapping(path, device: str = "cuda", modes=None) -> dict:
    """The mapping for `kernels.use_kernel_mapping`: transformers' "rotary_pos_emb" layer on
    `device` served by the repository at `path`, for `modes` (default: inference and training)."""
    from kernels import LocalLayerRepository, Mode

    repo = LocalLayerRepository(repo_path=Path(os.fspath(path)), layer_name=LAYER)
    if modes is None:
        modes = (Mode.INFERENCE, Mode.TRAINING)
    return {"rotary_pos_emb": {device: {mode: repo for mode in modes}}}


USAGE = "usage: python -m ropekit.hub build DIRECTORY  (writes the Hugging Face kernel repository there)"


def main(argv: Optional[list] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 2 or args[0] != "build" or args[1].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    print(build_kernel_repo(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
