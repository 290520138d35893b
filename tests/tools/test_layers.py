"""The package's architecture as a table, and the import rules it implies (CONTRIBUTING.md, "Layout").

Layers, bottom to top: a module imports modules of its own layer or of lower ones only; the import
graph (lazy imports inside functions included) has no cycle; no module reads another's private
names (`_x`). A new module must be placed in the table.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "src" / "ropekit"

LAYERS = (
    # kernels: the entry points (rope, backward, store, rerotate), the norm helpers and the prologue
    # they share, and ropekit.language, the public device functions they are built from
    (
        "kernels",
        ("kernels.rope", "kernels.backward", "kernels.store", "kernels.rerotate", "kernels.qkv_gemm")
        + ("kernels.norm", "kernels.prologue", "language"),
    ),
    # core, bottom: the memo, the Triton launch internals, the knobs, the record, the rules, the math
    (
        "core base",
        ("core.memo", "core.launch", "core.tuning", "core.variant", "core.args", "core.freqs"),
    ),
    # the checks by job (arguments, byte ranges, other libraries' forms, values), the CPU path, the plans
    (
        "core rules",
        ("core.rules", "core.aliasing", "core.forms", "core.strict", "core.packed", "core.cpu", "core.plans"),
    ),
    # one entry per op; the PyTorch path's glue; the call pipeline; the DTensor rules; the doors and custom ops
    ("core dispatch", ("core.checks", "core.run", "core.pipeline", "core.sharding", "core.dispatch")),
    # HF model configs read into RotaryEmbedding's arguments: an integration by what it knows, below
    # the api because it needs core.freqs only and RotaryEmbedding.from_hf_config calls it
    ("hf configs", ("integrations.hf_config",)),
    ("api", ("api.ops", "api.store", "api.rerotate", "api.modules", "api.qkv")),
    (
        "integrations",
        ("integrations.rotations", "integrations.seams", "integrations.diffusers_forms")
        + ("integrations.hf_forms", "integrations.hf_census", "integrations.hf")
        + ("integrations.hf_qknorm", "integrations.hf_qknorm_detect", "integrations.hf_qkv", "integrations.diffusers")
        + ("integrations.distributed", "integrations.hub", "integrations.torchtitan.caches")
        + ("integrations.torchtitan.overrides", "integrations.vllm", "integrations.timm"),
    ),
    # the public paths of the integrations (each aliases the module it names)
    ("public paths", ("hf", "diffusers", "distributed", "hub", "torchtitan", "vllm", "timm")),
    (
        "tools",
        ("tools.reference", "tools.audit", "tools.selfcheck", "tools.hf_table", "tools.bench", "tools.bench.__main__")
        + ("tools.bench.peers", "tools.bench.report", "tools.bench.runner", "tools.bench.timing")
        + ("tools.bench.workloads", "tools.call_path"),
    ),
    ("entry points", ("selfcheck", "audit", "bench")),  # `python -m ropekit.selfcheck` and the others
)
# packages: their __init__ holds a docstring only (the root package, which imports the api, is not ranked)
PACKAGES = ("kernels", "core", "api", "integrations", "integrations.torchtitan", "tools")
LEVEL = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
# the oracle sits with the tools (tests import it) but imports nothing of ropekit
LEAVES = ("tools.reference",)


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            yield ".".join(parts), path


def _imports(name: str, path: pathlib.Path):
    """(ropekit modules imported by `name`, private names it reads from them)."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    tree = ast.parse(path.read_text())
    deps, aliases, private = set(), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                target = ".".join(base + node.module.split("."))
                if target in LEVEL:
                    deps.add(target)
                    private += [f"{target}.{a.name}" for a in node.names if a.name.startswith("_")]
                for a in node.names:  # `from .kernels import rope`: a module
                    sub = f"{target}.{a.name}"
                    if sub in LEVEL:
                        deps.add(sub)
                        aliases[a.asname or a.name] = sub
            else:
                for a in node.names:
                    target = ".".join(base + [a.name])
                    if target in LEVEL:
                        deps.add(target)
                        aliases[a.asname or a.name] = target
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ropekit":
            target = node.module[len("ropekit.") :] if "." in node.module else ""
            if target in LEVEL:
                deps.add(target)
                private += [f"{target}.{a.name}" for a in node.names if a.name.startswith("_")]
            for a in node.names:
                sub = f"{target}.{a.name}".lstrip(".")
                if sub in LEVEL:
                    deps.add(sub)
                    aliases[a.asname or a.name] = sub
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ropekit."):
                    target = a.name[len("ropekit.") :]
                    if target in LEVEL:
                        deps.add(target)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{aliases[node.value.id]}.{node.attr}")
    deps.discard(name)
    return deps, private


GRAPH = {name: _imports(name, path) for name, path in _modules() if name}


def test_every_module_has_a_layer():
    missing = sorted(set(GRAPH) - set(LEVEL) - set(PACKAGES))
    assert not missing, f"modules missing from LAYERS: {missing}"
    gone = sorted(set(LEVEL) - set(GRAPH))
    assert not gone, f"LAYERS names modules that do not exist: {gone}"


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n in LEVEL))
def test_imports_point_down(name):
    deps, private = GRAPH[name]
    up = sorted(d for d in deps if LEVEL[d] > LEVEL[name])
    assert not up, f"{name} ({LAYERS[LEVEL[name]][0]}) imports higher layers: {up}"
    assert not private, f"{name} reads private names of other modules: {private}"
    if name in LEAVES:
        assert not deps, f"{name} must import nothing of ropekit, imports {sorted(deps)}"


def test_no_import_cycle():
    state, path = {}, []

    def visit(n):
        state[n] = 1
        path.append(n)
        for d in sorted(GRAPH.get(n, ((), ()))[0]):
            if state.get(d) == 1:
                cycle = path[path.index(d) :] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        path.pop()
        state[n] = 2

    for n in sorted(GRAPH):
        if n not in state:
            visit(n)


def test_the_checker_sees_a_violation(tmp_path):
    """Can these tests fail? An upward import and a private read, as a module would write them."""
    bad = tmp_path / "checks.py"
    bad.write_text("from ..api import ops\nfrom .plans import _tiles\nx = ops._views\n")
    deps, private = _imports("core.checks", bad)
    assert "api.ops" in deps and LEVEL["api.ops"] > LEVEL["core.checks"]
    assert "core.plans._tiles" in private and "api.ops._views" in private
    absolute = tmp_path / "cpu.py"
    absolute.write_text("from ropekit import hf\nfrom ropekit.api.store import _run\n")
    deps, private = _imports("core.cpu", absolute)
    assert {"hf", "api.store"} <= deps and "api.store._run" in private


def test_packages_hold_no_code():
    for name in PACKAGES:
        tree = ast.parse(ROOT.joinpath(*name.split("."), "__init__.py").read_text())
        assert all(isinstance(n, ast.Expr) for n in tree.body), f"ropekit.{name}/__init__.py holds code"


# Modules in the longest import chain: the depth today, so a new link fails here. What a reader
# follows through a call is held by tests/test_call_path.py (functions and files from the op to the
# launch); the chain here grew by one when the direct doors moved into core.pipeline.
MAX_DEPTH = 12  # entry point -> tools -> HF forms -> api -> dispatch -> pipeline -> run -> cpu -> ...


def longest_chain(graph) -> list:
    """The longest chain of ropekit modules, each importing the next (lazy imports included), as a
    list of names; graph: {name: (deps, private)} with no cycle."""
    best = {}

    def chain(n):
        if n not in best:
            tails = [chain(d) for d in sorted(graph.get(n, ((), ()))[0])]
            best[n] = [n] + max(tails, key=len, default=[])
        return best[n]

    return max((chain(n) for n in sorted(graph)), key=len, default=[])


def test_import_depth():
    path = longest_chain(GRAPH)
    assert len(path) <= MAX_DEPTH, f"import chain of {len(path)} modules (at most {MAX_DEPTH}): " + " -> ".join(path)


def test_longest_chain_sees_a_deep_graph():
    """Can the depth test fail? A chain of ten modules beside a short branch."""
    graph = {f"m{i}": ({f"m{i + 1}"}, []) for i in range(9)} | {"m9": (set(), []), "x": ({"m9"}, [])}
    assert longest_chain(graph) == [f"m{i}" for i in range(10)]


def test_import_loads_no_kernel():
    """`import ropekit` loads no Triton kernel (ropekit.kernels, ropekit.language): Triton reads
    TRITON_INTERPRET when a kernel is decorated, so a kernel imported with the package would fix the
    backend before a user (or the self-check's --interpreter) chose it."""
    import subprocess
    import sys

    code = (
        "import sys, ropekit; "
        "print([m for m in sys.modules if m.startswith('ropekit.kernels') or m == 'ropekit.language'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
