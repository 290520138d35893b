"""ropekit.hf: the Hugging Face transformers drop-ins and patch (the code lives in ropekit.integrations.hf)."""

import sys

from .integrations import hf as _module

sys.modules[__name__] = _module
