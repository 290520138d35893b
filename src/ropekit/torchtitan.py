"""ropekit.torchtitan: torchtitan RoPE overrides (the code lives in ropekit.integrations.torchtitan.overrides).

--override.imports ropekit.torchtitan.cos_sin_rope,ropekit.torchtitan.complex_rope,ropekit.torchtitan.mrope
"""

import sys

from .integrations.torchtitan import overrides as _module

sys.modules[__name__] = _module
