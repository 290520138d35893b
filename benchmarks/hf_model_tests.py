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
runs, the tests lost (passing unpatched, not passing patched), and the proof that the patched run
ran ropekit: the plugin counts the calls into ropekit's replacements (`hf_forms.run`, which every
replacement calls, wrapped after `patch` so its own probes are not counted; calls traced by
torch.compile are not counted, so that the count adds no guard) and how many of them
ropekit's kernel answered (the rest fell back to HF's function), and prints them with the patch
report's `.routes` at session end. A family whose patched run called ropekit 0 times is marked `NOT RUN`.
"""

from __future__ import annotations

import argparse
import json
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
MARK = "ropekit-model-tests:"  # the plugin's session-end line: MARK {"calls": .., "answered": .., "routes": ..}
_SEEN = {"calls": 0, "answered": 0, "routes": {}}


def pytest_configure(config):  # the plugin side: runs inside the patched pytest process
    family = os.environ.get(ENV)
    if family:
        import torch

        import ropekit.hf
        from ropekit.integrations import hf_forms

        report = ropekit.hf.patch(families=[family])
        print(f"\nropekit.hf.patch: {dict(report)}; left: {report.left}", file=sys.stderr)
        _SEEN["routes"] = report.routes
        run = hf_forms.run  # every replacement calls it (adapted kinds through hf_forms.call)

        def counted(*args, **kwargs):
            out = run(*args, **kwargs)
            if not torch.compiler.is_compiling():  # dynamo would guard on the count: a recompile each call
                _SEEN["calls"] += 1
                _SEEN["answered"] += out is not None
            return out

        hf_forms.run = counted


def pytest_terminal_summary(terminalreporter):
    if os.environ.get(ENV):
        terminalreporter.write_line(f"{MARK} {json.dumps(_SEEN)}")


def _outcomes(xml_path: pathlib.Path) -> dict:
    """{test id: "passed" | "failed" | "skipped"} from a JUnit XML file."""
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        out[name] = "failed" if tags & {"failure", "error"} else ("skipped" if "skipped" in tags else "passed")
    return out


def _run(tests_dir: pathlib.Path, family: str, patched: bool, timeout: int) -> tuple:
    """({test id: outcome}, the plugin's session-end record or None)."""
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
            done = subprocess.run(cmd, cwd=tests_dir, env=env, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"<timeout>": "failed"}, None
        seen = [json.loads(line[len(MARK) :]) for line in done.stdout.splitlines() if line.startswith(MARK)]
        return (_outcomes(xml) if xml.exists() else {"<no report>": "failed"}), (seen[-1] if seen else None)


def _counts(outcomes: dict) -> str:
    return "/".join(str(sum(v == k for v in outcomes.values())) for k in ("passed", "failed", "skipped"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests_dir", type=pathlib.Path)
    parser.add_argument("--families", default=DEFAULT)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    args = parser.parse_args(argv)
    lost_total, not_run = 0, []
    print(f"{'family':<16} {'unpatched p/f/s':>16} {'patched p/f/s':>16} {'lost':>5} {'ropekit calls (kernel)':>24}")
    for family in [f for f in args.families.split(",") if f]:
        plain, _ = _run(args.tests_dir, family, False, args.timeout)
        patched, seen = _run(args.tests_dir, family, True, args.timeout)
        lost = sorted(t for t, v in plain.items() if v == "passed" and patched.get(t) != "passed")
        lost_total += len(lost)
        calls = f"{seen['calls']} ({seen['answered']})" if seen else "no record"
        if not seen or not seen["calls"]:
            not_run.append(family)
            calls += " NOT RUN"
        print(f"{family:<16} {_counts(plain):>16} {_counts(patched):>16} {len(lost):>5} {calls:>24}", flush=True)
        print(f"    routes: {seen['routes'] if seen else None}")
        for t in lost:
            print(f"    lost: {t}")
    print(f"tests lost patched vs unpatched: {lost_total}; patched runs that never called ropekit: {not_run or 0}")
    return 1 if lost_total or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
