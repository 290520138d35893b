"""Run transformers' own modeling tests of some families unpatched and patched by ropekit.hf, and
count the outcomes (no test may pass unpatched and fail patched).

    python benchmarks/hf_model_tests.py TESTS_DIR [--families llama,qwen3,...] [--timeout 900]

TESTS_DIR holds a copy of transformers' test tree for the installed version (nothing is fetched
here): `tests/__init__.py`, `tests/test_modeling_common.py`, `tests/test_configuration_common.py`,
`tests/generation/`, `tests/utils/`, the mixins those import, and `tests/models/<family>/`
(`__init__.py`, `test_modeling_<family>.py`). Extract them from a clone, e.g.
`git --git-dir=<dir> show v5.24.0:tests/models/llama/test_modeling_llama.py > ...`.

Each family runs twice in its own pytest process: plain, then with this file loaded as a pytest
plugin (`-p hf_model_tests`) that calls `ropekit.hf.patch(families=[family])` before collection.
Outcomes are read from pytest's JUnit XML. Prints, per family, passed / failed / skipped for both
runs and the tests lost (passing unpatched, not passing patched).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

# families across the forms (ropekit.integrations.hf_forms): llama, neox, olmo, glm, cohere, ...
DEFAULT = (
    "llama,mistral,qwen2,qwen3,gemma,gemma2,granite,starcoder2,phi,stablelm,persimmon,gpt_neox,phi3,"
    "qwen3_next,olmo,olmo2,glm,glm4,helium,ernie4_5,cohere,cohere2,deepseek_v3,gpt_oss,modernbert,esm"
)
ENV = "ROPEKIT_HF_MODEL_TESTS_PATCH"


def pytest_configure(config):  # the plugin side: runs inside the patched pytest process
    family = os.environ.get(ENV)
    if family:
        import ropekit.hf

        report = ropekit.hf.patch(families=[family])
        print(f"\nropekit.hf.patch: {dict(report)}; left: {report.left}", file=sys.stderr)


def _outcomes(xml_path: pathlib.Path) -> dict:
    """{test id: "passed" | "failed" | "skipped"} from a JUnit XML file."""
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        out[name] = "failed" if tags & {"failure", "error"} else ("skipped" if "skipped" in tags else "passed")
    return out


def _run(tests_dir: pathlib.Path, family: str, patched: bool, timeout: int) -> dict:
    target = tests_dir / "tests" / "models" / family / f"test_modeling_{family}.py"
    if not target.exists():
        raise FileNotFoundError(f"hf_model_tests: {target}: expected transformers' test file, got nothing there")
    with tempfile.TemporaryDirectory() as tmp:
        xml = pathlib.Path(tmp) / "out.xml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pathlib.Path(__file__).parent), str(tests_dir)]))
        env.pop(ENV, None)
        cmd = [sys.executable, "-m", "pytest", str(target), "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        if patched:
            env[ENV] = family
            cmd += ["-p", "hf_model_tests"]
        try:
            subprocess.run(cmd, cwd=tests_dir, env=env, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"<timeout>": "failed"}
        return _outcomes(xml) if xml.exists() else {"<no report>": "failed"}


def _counts(outcomes: dict) -> str:
    return "/".join(str(sum(v == k for v in outcomes.values())) for k in ("passed", "failed", "skipped"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests_dir", type=pathlib.Path)
    parser.add_argument("--families", default=DEFAULT)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    args = parser.parse_args(argv)
    lost_total = 0
    print(f"{'family':<16} {'unpatched p/f/s':>16} {'patched p/f/s':>16} {'lost':>5}")
    for family in [f for f in args.families.split(",") if f]:
        plain = _run(args.tests_dir, family, False, args.timeout)
        patched = _run(args.tests_dir, family, True, args.timeout)
        lost = sorted(t for t, v in plain.items() if v == "passed" and patched.get(t) != "passed")
        lost_total += len(lost)
        print(f"{family:<16} {_counts(plain):>16} {_counts(patched):>16} {len(lost):>5}", flush=True)
        for t in lost:
            print(f"    lost: {t}")
    print(f"tests lost patched vs unpatched: {lost_total}")
    return 1 if lost_total else 0


if __name__ == "__main__":
    sys.exit(main())
