"""Census of the installed diffusers' RoPE, enumerated independently of ropekit.diffusers' scan.

Every module of diffusers.models.transformers (with diffusers.models.embeddings and
.attention_processor) is imported and parsed; every function it defines (module level, class
methods, functions nested in them) is flagged when its own syntax rotates by one of the idioms
in `_idioms` (the production scan reads names from code objects, never these shapes). Each
flagged function must be:

- patched: its module-level binding, or its class's __call__, is another object after patch()
  (snapshot taken before), in every module that binds it;
- only a step of patched or left code: every function of its module that calls it is one; or
- left with a reason: report.left names it, or the function it is defined in.

A transformer file uses RoPE when its code reaches a flagged function: its own, or one that a
function, block or processor class it calls defines (any diffusers module, followed
transitively; a class through what building and running it runs, RUN). It is reached when every
such function is patched, and report.modules must then name it: the same files for patch() and
patch(model). Prints the table (pytest -s).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import ropekit.diffusers as rd  # noqa: E402

FLOOR = 0.9  # reached / using RoPE, measured on diffusers 0.42.1: 56 of 62
PKG = "diffusers.models.transformers"
HOSTS = ("diffusers.models.embeddings", "diffusers.models.attention_processor")
RUN = ("__init__", "forward", "__call__")  # what building and running a class a file calls runs


def _words(node, words):
    """Whether a Name or Attribute under node spells one of words."""
    for n in ast.walk(node):
        s = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if any(w in s.lower() for w in words):
            return True
    return False


def _callee(node) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _idioms(body) -> set:
    """The rotation idioms in a function's own statements (nested defs excluded)."""
    found = set()
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Call):
            name, args = _callee(node), node.args
            if name in ("stack", "cat", "concat") and args and isinstance(args[0], (ast.List, ast.Tuple)):
                negated = [isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub) for e in args[0].elts]
                if len(negated) == 2 and sum(negated) == 1:
                    found.add("(-x2, x1) pair")
            if name == "view_as_complex":
                found.add("complex product")
            if name.startswith("addcmul") and any(_words(a, ("sin",)) for a in args):
                found.add("addcmul by sin")
            if name == "sum" and isinstance(node.func, ast.Attribute):
                inner = node.func.value
                if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Mult) and _words(inner, ("rope", "freq")):
                    found.add("rotation matrix product")
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            terms = (node.left, node.right)
            if not all(isinstance(t, ast.BinOp) and isinstance(t.op, ast.Mult) for t in terms):
                continue
            if any(isinstance(n, ast.Call) and _callee(n) == "cross" for n in ast.walk(node)):
                continue  # a 3-D vector rotation (Rodrigues), not a rotary embedding
            a, b = terms
            if (_words(a, ("cos",)) and _words(b, ("sin",))) or (_words(a, ("sin",)) and _words(b, ("cos",))):
                found.add("x cos + y sin")
            elif _words(a, ("freq", "rope", "cis")) and _words(b, ("freq", "rope", "cis")):
                found.add("matrix rows by freqs")
    return found


class Def:
    """One function a module's source defines."""

    def __init__(self, module, qualname, node):
        self.module, self.qualname, self.node = module, qualname, node
        nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        own = [s for s in node.body if not isinstance(s, nested)]
        self.idioms = _idioms(own)
        self.calls = {_callee(n) for n in ast.walk(node) if isinstance(n, ast.Call)} - {""}
        self.imports = [n for n in ast.walk(node) if isinstance(n, ast.ImportFrom)]

    @property
    def name(self):
        return f"{self.module.__name__}.{self.qualname}"

    @property
    def outer(self):
        """The module-level function or class method it is (or is defined in)."""
        return self.qualname.split(".<locals>.")[0]


def _defs(module):
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = Def(module, prefix + child.name, child)
                visit(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(inspect.getsource(module)), "")
    return out


def _modules():
    pkg = importlib.import_module(PKG)
    names = list(HOSTS) + [f"{PKG}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    out = {}
    for name in names:
        try:
            out[name] = importlib.import_module(name)
        except Exception:  # an optional dependency of one model: report.left names it (checked below)
            out[name] = None
    return out


def _bindings(modules):
    """{(module, attr): object} of every module attribute and class __call__, to compare after patch()."""
    out = {}
    for module in (m for m in modules.values() if m is not None):
        for attr, obj in list(vars(module).items()):
            out[(module.__name__, attr)] = obj
            if isinstance(obj, type) and "__call__" in vars(obj):
                out[(module.__name__, f"{attr}.__call__")] = vars(obj)["__call__"]
    return out


def _resolve(d: Def, name: str, modules):
    """The object a name read in d is: a local `from X import name`, else the module's global."""
    for imp in d.imports:
        for alias in imp.names:
            if (alias.asname or alias.name) == name:
                base = d.module.__package__ if imp.level else ""
                try:
                    source = importlib.import_module("." * imp.level + (imp.module or ""), base or None)
                except ImportError:
                    return None
                return getattr(source, alias.name, None)
    return vars(d.module).get(name)


def census():
    """(rows {file: (reached, [why not], [flagged functions it reaches])}, {flagged: status}, report)."""
    rd.unpatch()
    modules = _modules()
    before = _bindings(modules)
    defs = {name: _defs(m) for name, m in modules.items() if m is not None}
    by_object = {}  # original function object -> its Def (module-level functions and class methods)
    for name, module in modules.items():
        for q, d in defs.get(name, {}).items():
            obj = module
            for part in q.split("."):
                obj = vars(obj).get(part) if isinstance(obj, type) or inspect.ismodule(obj) else None
            if inspect.isfunction(obj):
                by_object[obj] = d
    report = rd.patch()
    after = _bindings(modules)

    def changed(module, attr):
        key = (module, attr)
        return key in before and after.get(key) is not before[key]

    def patched(d: Def) -> bool:
        outer = d.outer
        if "." in outer:  # a method: its class's __call__ replaced
            cls = outer.split(".")[0]
            return outer.endswith(".__call__") and changed(d.module.__name__, f"{cls}.__call__")
        fn = before.get((d.module.__name__, outer))
        bound = [k for k, v in before.items() if v is fn]  # every module binding it
        return bool(bound) and all(changed(*k) for k in bound)

    def left(d: Def):
        parts = d.qualname.split(".<locals>.")
        for i in range(len(parts), 0, -1):
            reason = report.left.get(f"{d.module.__name__}.{'.<locals>.'.join(parts[:i])}")
            if reason:
                return reason
        return None

    status = {}

    def covered(d: Def, stack=()) -> str:
        """'patched', 'left: reason', or 'NOT COVERED'."""
        if d.name in status:
            return status[d.name]
        if patched(d):
            return "patched"
        reason = left(d)
        if reason:
            return f"left: {reason}"
        name = d.qualname.rsplit(".", 1)[-1]
        callers = [c for c in defs[d.module.__name__].values() if name in c.calls and c is not d and c not in stack]
        inner = [covered(c, stack + (d,)) for c in callers]
        if callers and all(s != "NOT COVERED" for s in inner):
            return "patched" if all(s == "patched" for s in inner) else "left: its callers are"
        return "NOT COVERED"

    flagged = [d for ds in defs.values() for d in ds.values() if d.idioms]
    for d in flagged:
        status[d.name] = covered(d)

    def reached_flagged(start):
        """The flagged functions a file's code reaches, following calls into any diffusers module."""
        seen, todo, found = set(), list(start), []
        while todo:
            d = todo.pop()
            if d.name in seen:
                continue
            seen.add(d.name)
            if d.idioms:
                found.append(d)
            for sub in defs[d.module.__name__].values():  # its nested defs run with it
                if sub.qualname.startswith(d.qualname + ".<locals>."):
                    todo.append(sub)
            for name in d.calls:
                obj = _resolve(d, name, modules)
                obj = getattr(obj, "ropekit_original", obj)
                if inspect.isfunction(obj) and obj in by_object:
                    todo.append(by_object[obj])
                elif isinstance(obj, type) and obj.__module__.startswith("diffusers.models."):
                    host = defs.get(obj.__module__, {})
                    todo += [host[f"{obj.__qualname__}.{m}"] for m in RUN if f"{obj.__qualname__}.{m}" in host]
        return found

    rows = {}
    for name, module in modules.items():
        if not name.startswith(PKG + "."):
            continue
        if module is None:
            rows[name] = (False, [report.left.get(name, "NOT COVERED: does not import, and not in report.left")], [])
            continue
        uses = reached_flagged(defs[name].values())
        if uses:
            why = [f"{d.name}: {status[d.name]}" for d in uses if status[d.name] != "patched"]
            rows[name] = (not why, why, sorted(d.name for d in uses))
    return rows, status, report


@pytest.fixture(autouse=True)
def _unpatched():
    rd.unpatch()
    yield
    rd.unpatch()


def test_census():
    rows, status, report = census()
    for name, s in sorted(status.items()):
        print(f"{s[:60]:60s} {name}")
    reached = [f for f, (ok, _, _) in rows.items() if ok]
    for f, (ok, why, _) in sorted(rows.items()):
        print(f"{'reached' if ok else 'LEFT   '} {f.rsplit('.', 1)[1]}" + (f"  ({'; '.join(why)})" if why else ""))
    print(f"reached {len(reached)} / {len(rows)} transformer files that use RoPE")
    missed = [n for n, s in status.items() if s == "NOT COVERED"]
    assert not missed, f"rotating functions neither patched nor left with a reason: {missed}"
    assert not [f for f, (_, why, _) in rows.items() if any("NOT COVERED" in w for w in why)]
    assert set(reached) <= set(report.modules), "reached files report.modules does not name"
    assert set(report.modules) <= set(rows), "report.modules names a file that does not use RoPE"
    assert len(reached) >= FLOOR * len(rows) or diffusers.__version__ != "0.42.1"


def test_patch_and_patch_model_name_the_same_files():
    from helpers.diffusers_models import BUILDERS

    model, _ = BUILDERS["flux"]()
    plain = rd.patch()
    rd.unpatch()
    with_model = rd.patch(model)
    assert with_model.modules == plain.modules and len(plain.modules) > 0
    # the model's own entries of what is left are the plain report's (patch(model) names no others)
    assert with_model.left.items() <= plain.left.items()


def test_a_binding_the_scan_misses_fails_the_census(monkeypatch):
    """A rotating helper ropekit.diffusers does not find (its regex and code-object names see
    none) is flagged by the census as neither patched nor left."""
    import diffusers.models.transformers.transformer_ltx as ltx

    src = (
        "def spin(x, freqs):\n"
        "    cos, sin = freqs\n"
        "    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)\n"
        "    return x * cos + torch.stack([-b, a], -1).flatten(-2) * sin\n"
    )
    namespace = {"torch": torch}
    exec(compile(src, ltx.__file__, "exec"), namespace)  # noqa: S102
    monkeypatch.setattr(ltx, "spin", namespace["spin"], raising=False)
    monkeypatch.setattr(inspect, "getsource", _with_source(inspect.getsource, ltx, src))
    _, status, _ = census()
    assert status[f"{ltx.__name__}.spin"] == "NOT COVERED"


def _with_source(getsource, module, extra):
    def source(obj):
        text = getsource(obj)
        return text + "\n\n" + extra if obj is module else text

    return source
