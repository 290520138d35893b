"""ropekit.selfcheck (`python -m ropekit.selfcheck`): every public op against the float64 reference (the code lives in ropekit.tools.selfcheck)."""

import sys

from .tools import selfcheck as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
