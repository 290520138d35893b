"""ropekit.vllm: the vLLM general plugin (the code lives in ropekit.integrations.vllm)."""

import sys

from .integrations import vllm as _module

sys.modules[__name__] = _module
