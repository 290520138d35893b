"""ropekit.audit (`python -m ropekit.audit`): the static 32-bit index audit of Triton kernels (the code lives in ropekit.tools.audit)."""

import sys

from .tools import audit as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
