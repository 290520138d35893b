"""ropekit.hub (`python -m ropekit.hub`): ropekit's kernels as a Hugging Face kernels repository (the code lives in ropekit.integrations.hub)."""

import sys

from .integrations import hub as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
