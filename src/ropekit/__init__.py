"""ropekit: rotary position embedding kernels in Triton, every variant, 64-bit safe.

Public names only; see README.md and DESIGN.md for the contract.
"""

from .ops import apply_rope, rotate_with_angles
from .validate import strict

__all__ = ["apply_rope", "rotate_with_angles", "strict"]
__version__ = "0.1.0"
