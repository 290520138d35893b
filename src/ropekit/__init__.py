"""ropekit: rotary position embedding kernels in Triton, every variant, 64-bit safe.

Public names only; see README.md for shapes, dtypes and examples.
"""

from . import hf  # noqa: F401  (ropekit.hf: the Hugging Face drop-ins, imported with the package)
from .freqs import cos_sin_cache, inv_freq
from .modules import RotaryEmbedding
from .ops import apply_rope, rotate_with_angles
from .packed import positions_from_cu_seqlens
from .rerotate import rerotate_kv_cache
from .store import apply_rope_and_store
from .validate import strict

__all__ = [
    "apply_rope",
    "apply_rope_and_store",
    "rotate_with_angles",
    "rerotate_kv_cache",
    "positions_from_cu_seqlens",
    "cos_sin_cache",
    "inv_freq",
    "RotaryEmbedding",
    "strict",
]
__version__ = "0.2.0"

# DTensor sharding rules for the custom ops: registered when torch.distributed.tensor is imported
from . import distributed as _distributed  # noqa: E402

_distributed.install()
