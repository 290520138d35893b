"""diffusers' own transformer model tests, run unpatched and with ropekit.diffusers.patch(): the
tests a family loses when patched (passed unpatched, not passed patched; the target is none).

    python benchmarks/diffusers_model_tests.py TESTS_DIR [family ...] [--pytest-args "..."]

TESTS_DIR: a copy of diffusers' tests/ tree holding at least tests/__init__.py, conftest.py,
testing_utils.py, models/__init__.py, models/testing_utils/ and
models/transformers/test_models_transformer_<family>.py for each family (taken from a diffusers
checkout of the installed version; this script fetches nothing). Families: the file stems after
test_models_transformer_ (default: every such file in TESTS_DIR). Each run is a separate pytest
process (patched: this file loaded as a pytest plugin with ROPEKIT_DIFFUSERS_PATCH=1, which
calls ropekit.diffusers.patch() before collection); outcomes are read from its JUnit XML.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

PREFIX = "test_models_transformer_"
ENV = "ROPEKIT_DIFFUSERS_PATCH"


def pytest_configure(config):
    """The plugin side: patch every diffusers model before the tests import anything."""
    if os.environ.get(ENV) == "1":
        import ropekit.diffusers

        report = ropekit.diffusers.patch()
        config._ropekit_report = report
        print(f"ropekit.diffusers.patch(): {len(report.helpers)} helpers, families {sorted(report)}", file=sys.stderr)


def _outcomes(xml_path: pathlib.Path):
    """{test id: 'passed' | 'failed' | 'error' | 'skipped'} from a JUnit XML file."""
    out = {}
    if not xml_path.exists():
        return out
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[tid] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        out[tid] = {"failure": "failed"}.get(out[tid], out[tid])
    return out


def run(tests_dir: pathlib.Path, family: str, patched: bool, extra):
    test_file = tests_dir / "tests" / "models" / "transformers" / f"{PREFIX}{family}.py"
    with tempfile.TemporaryDirectory() as tmp:
        xml = pathlib.Path(tmp) / "junit.xml"
        env = {**os.environ, ENV: "1" if patched else "0"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pathlib.Path(__file__).parent), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", pathlib.Path(__file__).stem]
        cmd += [f"--junitxml={xml}", str(test_file.relative_to(tests_dir)), *extra]
        proc = subprocess.run(cmd, cwd=tests_dir, env=env, capture_output=True, text=True)
        outcomes = _outcomes(xml)
    if proc.returncode not in (0, 1) or not outcomes:  # 2: collection errors, 5: no tests
        tail = (proc.stdout + proc.stderr)[-3000:]
        mode = "patched" if patched else "unpatched"
        raise SystemExit(f"{family} ({mode}): pytest exited {proc.returncode} before running the tests:\n{tail}")
    return outcomes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests_dir", type=pathlib.Path)
    parser.add_argument("families", nargs="*")
    parser.add_argument("--pytest-args", default="", help="passed to each pytest run, e.g. \"-k 'not compile'\"")
    args = parser.parse_args(argv)
    root = args.tests_dir.resolve()
    found = sorted(p.stem[len(PREFIX) :] for p in (root / "tests/models/transformers").glob(f"{PREFIX}*.py"))
    families = args.families or found
    missing = [f for f in families if f not in found]
    if missing:
        raise SystemExit(f"diffusers_model_tests: families: expected test files in {root}, got none for {missing}")
    extra = shlex.split(args.pytest_args)
    print(f"{'family':<22} {'tests':>5} {'passed':>13} {'lost':>4}  (passed unpatched / patched)")
    total_lost = 0
    for family in families:
        base = run(root, family, False, extra)
        patched = run(root, family, True, extra)
        lost = sorted(t for t, o in base.items() if o == "passed" and patched.get(t) != "passed")
        gained = sorted(t for t, o in patched.items() if o == "passed" and base.get(t) != "passed")
        n_base = sum(o == "passed" for o in base.values())
        n_patched = sum(o == "passed" for o in patched.values())
        print(f"{family:<22} {len(base):>5} {n_base:>6} / {n_patched:<5} {len(lost):>4}", flush=True)
        for t in lost:
            print(f"    lost: {t} ({patched.get(t, 'not run')})")
        for t in gained:
            print(f"    passed only patched: {t}")
        total_lost += len(lost)
    return 1 if total_lost else 0


if __name__ == "__main__":
    sys.exit(main())
