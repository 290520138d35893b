"""ropekit: rotary position embedding kernels in Triton, every variant, 64-bit safe.

Public names only; see README.md for shapes, dtypes and examples. The integrations are imported
when first named: `ropekit.hf`, `ropekit.diffusers`, `ropekit.distributed`, `ropekit.hub`,
`ropekit.torchtitan`, `ropekit.vllm`.

Layout: kernels/ (Triton only) <- core/ (the record, checks, plans, launch, doors, CPU path) <-
api/ (the public ops) <- integrations/ (other libraries, public ops only); tools/ beside them.
"""

import importlib

from .api.modules import RotaryEmbedding
from .api.ops import apply_rope, rotate_with_angles
from .api.qkv import rope_qkv_projection
from .api.rerotate import rerotate_kv_cache
from .api.store import apply_rope_and_store
from .core.forms import LayoutWarning
from .core.freqs import axial_inv_freq, cos_sin_cache, inv_freq
from .core.packed import positions_from_cu_seqlens
from .core.strict import strict

__all__ = [
    "apply_rope",
    "apply_rope_and_store",
    "rope_qkv_projection",
    "rotate_with_angles",
    "rerotate_kv_cache",
    "positions_from_cu_seqlens",
    "cos_sin_cache",
    "inv_freq",
    "axial_inv_freq",
    "RotaryEmbedding",
    "strict",
    "LayoutWarning",
]
__version__ = "0.2.0"

_LAZY = ("hf", "diffusers", "distributed", "hub", "torchtitan", "vllm", "timm")


def __getattr__(name):
    """`ropekit.hf` and the other integrations, imported on first use (each imports its host
    library only when called)."""
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
