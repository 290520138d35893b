"""ropekit.bench (`python -m ropekit.bench`, console script `ropekit-bench`): the benchmark CLI
(the code lives in ropekit.tools.bench)."""

import sys

from .tools import bench as _module

if __name__ == "__main__":
    from .tools.bench.__main__ import main

    sys.exit(main())
sys.modules[__name__] = _module
