"""ropekit.diffusers: the diffusers attention-processor patch (the code lives in ropekit.integrations.diffusers)."""

import sys

from .integrations import diffusers as _module

sys.modules[__name__] = _module
