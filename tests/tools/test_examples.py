"""Every script in examples/ runs to completion on the CPU and passes its own checks.

Each example checks its results (against Hugging Face's unpatched model or against float64
RoPE and attention in examples/rope_math.py) and raises when they differ, so a zero exit status
means the example's claim held. They run as a user runs them, `python examples/NAME.py`, on the
CPU path (no GPU, no Triton interpreter).
"""

import os
import subprocess
import sys

import pytest

import ropekit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SRC = os.path.dirname(os.path.dirname(os.path.abspath(ropekit.__file__)))
SCRIPTS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py") and f != "rope_math.py")


def test_the_four_workflows_have_examples():
    assert SCRIPTS == [
        "hf_training.py",
        "packed_context_parallel.py",
        "serving_paged_cache.py",
        "sink_window_eviction.py",
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script):
    if script == "hf_training.py":
        pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=SRC + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "cpu" in r.stdout, r.stdout
