"""ropekit.distributed: DTensor sharding rules of the custom ops (the code lives in ropekit.integrations.distributed)."""

import sys

from .integrations import distributed as _module

sys.modules[__name__] = _module
