"""Census of the installed diffusers' transformer files that use RoPE: each is patched by
ropekit.diffusers.patch() (every rotary helper it calls, directly or through the processors it
imports, goes to ropekit) or left, with the reason. Prints the table (pytest -s) and holds the
coverage at or above the floor measured on diffusers 0.42.

A helper call is patched when the name it calls is a ropekit wrapper in the module that calls it
(or in diffusers.models.embeddings, for a local import), or when it is defined inside a processor
whose norm + rotation ropekit fuses (that processor is handed no embedding). A file's processors
are those it imports and those the blocks it imports from another transformer module construct.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import ropekit.diffusers as rd  # noqa: E402

FLOOR = 0.9  # measured on diffusers 0.42.1: 56 of 62
HELPER = re.compile(r"apply.*(rot|rope)|(rot|rope).*apply", re.IGNORECASE)
ROPE = re.compile(r"rotary|rope|freqs_cis", re.IGNORECASE)
EMBEDDINGS = "diffusers.models.embeddings"
TRANSFORMERS = "diffusers.models.transformers."


def _calls(tree):
    """(helper names called, helper names defined inside a function or class)."""
    called, nested = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and HELPER.search(node.func.id):
            called.add(node.func.id)
    for top in tree.body:
        for node in ast.walk(top):
            if node is not top and isinstance(node, ast.FunctionDef) and HELPER.search(node.name):
                nested.add(node.name)
    return called, nested


def _fused(cls) -> bool:
    return hasattr(getattr(cls, "__call__", None), "__wrapped__")


def _status(module, tree, report):
    """[(helper, None when patched else the reason)] of the helpers one source calls."""
    called, nested = _calls(tree)
    classes = [getattr(module, n.name, None) for n in tree.body if isinstance(n, ast.ClassDef)]
    fused = any(isinstance(c, type) and _fused(c) for c in classes)
    out = []
    for name in sorted(called):
        fn = getattr(module, name, None)
        if fn is None:
            fn = getattr(importlib.import_module(EMBEDDINGS), name, None)
        if name in nested:
            out.append((name, None if fused else "defined inside a method or processor: no module-level seam"))
        elif hasattr(fn, "ropekit_form"):
            out.append((name, None))
        else:
            qual = f"{fn.__module__}.{fn.__qualname__}" if callable(fn) else name
            out.append((name, report.left.get(qual, "not a helper ropekit.diffusers found")))
    return out


def _processors_named(module, tree):
    """The processor classes a source names (by a Name node), resolved in its module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and "Processor" in node.id:
            cls = getattr(module, node.id, None)
            if isinstance(cls, type):
                yield cls


def _imported_processors(module, tree):
    """Processor classes imported from another module, and those that the blocks imported from
    another transformer module construct (HunyuanVideo-Framepack runs HunyuanVideo's blocks)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                cls = getattr(module, a.asname or a.name, None)
                if not isinstance(cls, type) or cls.__module__ == module.__name__:
                    continue
                if "Processor" in a.name:
                    found.append(cls)
                elif issubclass(cls, torch.nn.Module) and cls.__module__.startswith(TRANSFORMERS):
                    host = importlib.import_module(cls.__module__)
                    found += list(_processors_named(host, ast.parse(inspect.getsource(cls))))
    return list(dict.fromkeys(found))


def census():
    report = rd.patch()
    pkg = importlib.import_module("diffusers.models.transformers")
    rows = {}
    for path in sorted(pathlib.Path(pkg.__path__[0]).glob("*.py")):
        src = path.read_text()
        if path.name == "__init__.py" or not ROPE.search(src):
            continue
        name = f"{pkg.__name__}.{path.stem}"
        if name in report.left:
            rows[path.name] = [("import", report.left[name])]
            continue
        module = importlib.import_module(name)
        tree = ast.parse(src)
        found = _status(module, tree, report)
        for cls in _imported_processors(module, tree):
            host = importlib.import_module(cls.__module__)
            cls_tree = ast.parse(inspect.getsource(cls))
            if _fused(cls):
                found.append((cls.__name__, None))
            else:
                found += [(f"{cls.__name__}: {n}", r) for n, r in _status(host, cls_tree, report)]
        rows[path.name] = found or [("-", "no rotary helper call (the rotation is inline, or RoPE is only built here)")]
    return rows


@pytest.fixture(autouse=True)
def _unpatched():
    rd.unpatch()
    yield
    rd.unpatch()


def test_census():
    rows = census()
    patched = [f for f, found in rows.items() if all(r is None for _, r in found)]
    for f, found in rows.items():
        left = "; ".join(f"{n}: {r}" for n, r in found if r is not None)
        print(f"{'patched' if f in patched else 'LEFT   '} {f}" + (f"  ({left})" if left else ""))
    print(f"patched {len(patched)} / {len(rows)} RoPE transformer files")
    assert all(r is None or r for found in rows.values() for _, r in found)  # every left one has a reason
    assert len(patched) >= FLOOR * len(rows) or diffusers.__version__ != "0.42.1"
