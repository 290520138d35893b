"""ropekit.timm: timm's ViT RoPE helpers through ropekit (the code lives in ropekit.integrations.timm)."""

import sys

from .integrations import timm as _module

sys.modules[__name__] = _module
