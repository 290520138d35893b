"""Static audit of Triton kernel sources for int32 index overflow.

Usage::

    python -m ropekit.audit PATH [PATH ...]      # files and/or directories (*.py, recursive)

Each finding is printed as::

    path:line: function: narrow (int32) index reaches a pointer offset: <expression>

followed by a summary line. Exit status: 0 clean, 1 findings, 2 usage or parse errors.
The checked code is parsed with :mod:`ast`, never imported; neither torch nor triton is needed.

The bug class
-------------
``tl.program_id``, ``tl.arange`` and loop counters are 32-bit integers, and so is a stride
argument that fits in 32 bits. ``program_id(0) * row_stride`` is therefore computed in
int32 and wraps once the tensor holds more than 2**31 elements; widening the *result*
afterwards (``(pid * stride).to(tl.int64)``) is too late. The fix is to widen an operand
*before* the multiplication (``pid.to(tl.int64) * stride``): int64 * int32 is computed in
int64.

The rule, exactly
-----------------
Inside every function decorated with ``jit`` (``@triton.jit``, ``@jit``, ``@triton.jit(...)``,
also under ``@triton.autotune(...)`` / ``@triton.heuristics(...)``), a forward analysis walks
the statements in order (both branches of an ``if``, loop bodies iterated to a fixed point)
and gives every value these properties:

* **narrow** -- possibly a 32-bit index. Sources:

  - *unbounded* indices: ``program_id(...)``, ``num_programs(...)`` (of ``triton.language``), the variable of a
    ``for`` over ``range``/``tl.range`` whose bounds are not all compile-time constants, and
    values loaded with ``tl.load``/``tl.atomic_*`` (a gathered index such as a slot mapping
    or a position may be an int32 tensor);
  - *bounded* indices: ``tl.arange(...)`` and the variable of a ``for`` over
    ``tl.static_range`` or over a range with compile-time bounds.

  Narrowness flows through arithmetic (``+ - * // % << >> & | ^``, unary ops), ``tl.where``,
  ``min``/``max``/``tl.minimum``/``tl.maximum``, broadcasting (``x[:, None]``, ``reshape``,
  ``broadcast_to``...), hints (``tl.multiple_of``...), ``.to(<not int64>)`` and assignments.
  Comparisons give masks, which are not indices.
* **wide** (int64) -- produced by ``x.to(tl.int64)``, ``tl.cast(x, tl.int64)``, ``x.to(tl.int64,
  ...)``, ``tl.full/zeros(..., tl.int64)``, a parameter annotated ``tl.int64``/``"i64"``, a
  loop whose bounds are wide, or arithmetic with a wide operand (int64 op int32 -> int64).
  ``tl.uint64`` counts as wide too.
* **compile-time constant** -- literals, ``tl.constexpr`` parameters, module-level constants
  and arithmetic on them. A constant is *small* unless it is a known integer with absolute
  value above 65536; ``constexpr`` parameters are assumed small (tile sizes, head sizes).

A **narrow product** is ``a * b`` (or ``a << b``) where neither operand is wide, at least one
operand is narrow and the other is not a small compile-time constant (a runtime stride, a
size, another index, a large literal). Any multiplication by something that is not a
literal or ``constexpr`` is treated as scaling by a stride.

A **scaled index** is an *unbounded* narrow value multiplied by a compile-time constant
other than 0/1/-1, e.g. ``pid * BLOCK`` (the flat ``pid * BLOCK + tl.arange(0, BLOCK)``
offset of an elementwise kernel, which wraps once the tensor holds 2**31 elements). It stops
being one when it is later multiplied by a non-constant (it is then a tile coordinate scaled
by a stride, and the product is judged by the narrow-product rule instead).

Findings: a narrow product, or a scaled index, that **reaches a pointer offset**. Widening
does not clear either one: once the int32 product exists it may have wrapped, so
``(pid * stride).to(tl.int64)`` is reported while ``pid.to(tl.int64) * stride`` is not. A
value reaches a pointer offset when it is

* added to (or subtracted from) a pointer: a parameter whose name ends in ``ptr`` (``x_ptr``,
  ``Xptr``), a parameter annotated as a pointer (``"*fp32"``, ``tl.pointer_type(...)``), or any
  value derived from one (``row = x_ptr + off``, ``x_ptr += off``);
* part of the pointer argument of ``tl.load``, ``tl.store`` or ``tl.atomic_*`` (whatever the
  pointer is called);
* an element of the ``offsets`` of ``tl.make_block_ptr`` / ``tl.advance`` or of a tensor
  descriptor's ``.load/.store/.atomic_*`` (narrow products only: those offsets are tile
  coordinates, which Triton keeps in int32 anyway).

Bounded indices alone are fine: ``x_ptr + row + tl.arange(0, BLOCK)`` adds an offset that is
smaller than a block. ``x_ptr + pid`` (a program id, unscaled) is fine too. But
``tl.arange(0, BLOCK_H)[:, None] * stride_h`` is a narrow product: ``BLOCK_H * stride_h`` can
exceed 2**31 when the head stride is large (a head-major layout with many tokens).

Each narrow product or scaled index is reported once, at the line of the multiplication,
with the multiplication's source text; a product of an already-reported product is not
reported again (``pid * H * D`` gives one finding, for ``pid * H``).

Calls between kernels: when a ``jit`` function calls another ``jit`` function defined in the
same file, or imported from a file of the same project (``from .rope import helper``,
``from ropekit.kernels import rope`` then ``rope.helper(...)``; such files are read and
analysed too, and their findings reported), the values passed at all call sites are joined
and used as that function's parameters (a parameter is narrow if any caller passes a narrow
value, wide only if every caller passes a wide one); the callee's return values flow back to
the callers. Parameters of functions that no analysed jit function calls (the launched
kernels) are runtime values: neither narrow nor wide. Calls to anything else are treated as
arithmetic on their arguments.

Suppression: a comment ``# int32-ok: <reason>`` on a line of the statement that does the
multiplication, or of the statement where it reaches the pointer, silences that finding. On an
assignment it also declares the assigned value a *small* index: it becomes bounded (like
``tl.arange``), so ``blk = tl.program_id(1)  # int32-ok: < 65536 head blocks`` lets
``blk * BLOCK_H`` reach a pointer, while ``blk * stride`` is still reported. The reason is
required; ``# int32-ok`` without one silences nothing and is warned about.

The audit is a lint, not a proof. Not tracked: helpers outside the project (their results are
arithmetic on their arguments), dtypes passed as ``constexpr`` parameters (``x.to(IDX_T)`` is
not a widening), the values of ``constexpr`` parameters (assumed small), and how large a
bounded index or a comparison-derived value (``(i >= n).to(tl.int32)``) really is.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import sys
import tokenize
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Sequence, Union

__all__ = ["Finding", "AuditWarning", "audit_source", "audit_file", "audit_paths", "main"]

#: Integer literals with an absolute value above this are "large" (treated like a stride).
SMALL_CONST_LIMIT = 1 << 16

# index kinds bounded by a compile-time constant, or declared small by an `# int32-ok:` assignment
_BOUNDED = frozenset({"arange", "static", "declared"})
_DTYPE_I64 = "<dtype:int64>"
_DTYPE_OTHER = "<dtype:other>"
_INT64_NAMES = frozenset({"int64", "uint64", "i64", "u64"})

_SUPPRESS_RE = re.compile(r"#\s*int32-ok\b(?P<rest>.*)$")
_REASON_RE = re.compile(r"^\s*:\s*(?P<reason>\S.*?)\s*$")


# ----------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class Finding:
    """One narrow product / scaled index that reaches a pointer offset."""

    path: str
    line: int
    col: int
    function: str
    expression: str
    rule: str  # "narrow-product" or "scaled-index"
    sink_line: int
    sink_function: str

    def format(self) -> str:
        return (
            f"{self.path}:{self.line}: {self.function}: "
            f"narrow (int32) index reaches a pointer offset: {self.expression}"
        )

    def explain(self) -> str:
        what = (
            "int32 product of an index and a non-constant (widen an operand with .to(tl.int64) before multiplying)"
            if self.rule == "narrow-product"
            else "program-id/loop/loaded index scaled by a constant and used as an element "
            "offset (widen it with .to(tl.int64) before scaling)"
        )
        return f"    {what}; reaches a pointer at line {self.sink_line} in {self.sink_function}"


@dataclass(frozen=True)
class AuditWarning:
    path: str
    line: int
    message: str

    def format(self) -> str:
        return f"{self.path}:{self.line}: warning: {self.message}"


# ----------------------------------------------------------------------------------------
# abstract values


@dataclass(frozen=True)
class _Origin:
    path: str
    function: str
    line: int
    col: int
    expression: str
    rule: str


@dataclass(frozen=True)
class _Val:
    kinds: frozenset = frozenset()  # narrow sources: pid, loop, load, arange, static
    wide: bool = False
    const: bool = False
    ptr: bool = False
    origins: frozenset = frozenset()  # narrow products
    scaled: frozenset = frozenset()  # scaled indices
    cvalue: object = None  # known literal value (int/float/str) or a dtype marker

    @property
    def narrow(self) -> bool:
        return bool(self.kinds) and not self.wide

    @property
    def unbounded(self) -> bool:
        return bool(self.kinds - _BOUNDED)

    @property
    def small_const(self) -> bool:
        if not self.const:
            return False
        v = self.cvalue
        if isinstance(v, bool) or not isinstance(v, int):
            return True
        return abs(v) <= SMALL_CONST_LIMIT


@dataclass(frozen=True)
class _Tup:
    elts: tuple


_AnyVal = Union[_Val, _Tup]
_UNKNOWN = _Val()
_CONST = _Val(const=True)


def _flat(v: _AnyVal | None) -> _Val:
    if v is None:
        return _UNKNOWN
    if isinstance(v, _Val):
        return v
    if not v.elts:
        return _CONST
    return _combine([_flat(e) for e in v.elts])


def _combine(vals: Sequence[_AnyVal]) -> _Val:
    """Arithmetic join: the result is wide if any operand is (int64 promotion)."""
    vs = [_flat(v) for v in vals]
    if not vs:
        return _UNKNOWN
    return _Val(
        kinds=frozenset().union(*(v.kinds for v in vs)),
        wide=any(v.wide for v in vs),
        const=all(v.const for v in vs),
        ptr=any(v.ptr for v in vs),
        origins=frozenset().union(*(v.origins for v in vs)),
        scaled=frozenset().union(*(v.scaled for v in vs)),
    )


def _merge(a: _AnyVal | None, b: _AnyVal | None) -> _AnyVal | None:
    """Control-flow join: wide/const only if both sides are."""
    if a is None:
        return b
    if b is None or a == b:
        return a
    if isinstance(a, _Tup) and isinstance(b, _Tup) and len(a.elts) == len(b.elts):
        return _Tup(tuple(_merge(x, y) for x, y in zip(a.elts, b.elts)))
    x, y = _flat(a), _flat(b)
    return _Val(
        kinds=x.kinds | y.kinds,
        wide=x.wide and y.wide,
        const=x.const and y.const,
        ptr=x.ptr or y.ptr,
        origins=x.origins | y.origins,
        scaled=x.scaled | y.scaled,
        cvalue=x.cvalue if x.cvalue == y.cvalue else None,
    )


def _merge_env(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out.get(k), v)
    return out


# ----------------------------------------------------------------------------------------
# helpers on syntax


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_jit(fn: ast.AST) -> bool:
    for dec in getattr(fn, "decorator_list", ()):
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = _dotted(target) or ""
        tail = name.rsplit(".", 1)[-1]
        if tail in ("jit", "autotune", "heuristics"):
            return True
    return False


def _ann_text(ann: ast.AST | None) -> str:
    if ann is None:
        return ""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        return ann.value.strip()
    try:
        return ast.unparse(ann)
    except Exception:  # pragma: no cover - defensive
        return ""


def _param_base(arg: ast.arg) -> _Val:
    ann = _ann_text(arg.annotation)
    tail = ann.rsplit(".", 1)[-1] if ann else ""
    if "constexpr" in ann:
        return _CONST
    v = _UNKNOWN
    if ann.startswith("*") or ann.endswith("*") or "pointer" in ann or ann.startswith("const *"):
        v = _Val(ptr=True)
    elif tail in _INT64_NAMES or ann in _INT64_NAMES:
        v = _Val(wide=True)
    if arg.arg.lower().endswith("ptr"):
        v = replace(v, ptr=True)
    return v


def _norm(text: str) -> str:
    return " ".join(text.split())


# ----------------------------------------------------------------------------------------
# per-module context


class _Module:
    def __init__(self, source: str, path: str, real: str | None = None):
        self.source = source
        self.path = path  # as displayed
        self.real = real  # real path on disk, None for source text without a file
        self._lines: list[bytes] | None = None
        self.tree = ast.parse(source, filename=path)
        self.warnings: list[AuditWarning] = []
        self.suppressed_lines = self._scan_comments()
        self.consts = self._module_consts()
        self.jit_fns = [
            n for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_jit(n)
        ]
        self.jit_by_name: dict[str, ast.FunctionDef] = {}
        for fn in self.jit_fns:
            self.jit_by_name.setdefault(fn.name, fn)
        # local name -> (module spec, level, imported name or None for `import x.y as z`)
        self.imports: dict[str, tuple[str, int, str | None]] = {}
        for st in self.tree.body:
            if isinstance(st, ast.ImportFrom):
                for a in st.names:
                    if a.name != "*":
                        self.imports[a.asname or a.name] = (st.module or "", st.level, a.name)
            elif isinstance(st, ast.Import):
                for a in st.names:
                    if a.asname:
                        self.imports[a.asname] = (a.name, 0, None)

    def _scan_comments(self) -> set[int]:
        lines: set[int] = set()
        comments: list[tuple[int, str]] = []
        if "int32-ok" not in self.source:
            return lines
        try:
            for tok in tokenize.generate_tokens(io.StringIO(self.source).readline):
                if tok.type == tokenize.COMMENT:
                    comments.append((tok.start[0], tok.string))
        except (tokenize.TokenError, IndentationError, SyntaxError):  # pragma: no cover
            for i, line in enumerate(self.source.splitlines(), 1):
                if "#" in line:
                    comments.append((i, line[line.index("#") :]))
        for lineno, text in comments:
            m = _SUPPRESS_RE.search(text)
            if not m:
                continue
            if _REASON_RE.match(m.group("rest")):
                lines.add(lineno)
            else:
                self.warnings.append(
                    AuditWarning(
                        self.path, lineno, "'# int32-ok' needs a reason ('# int32-ok: <reason>'); not suppressing"
                    )
                )
        return lines

    def _module_consts(self) -> dict[str, _Val]:
        out: dict[str, _Val] = {}
        for stmt in self.tree.body:
            if isinstance(stmt, ast.Assign):
                targets, value = stmt.targets, stmt.value
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                targets, value = [stmt.target], stmt.value
            else:
                continue
            v = _static_value(value)
            for t in targets:
                if isinstance(t, ast.Name):
                    out[t.id] = _merge(out.get(t.id), v) if t.id in out else v
        return out

    def segment(self, node: ast.AST) -> str:
        seg = None
        if self._lines is None:
            self._lines = [ln.encode("utf-8") for ln in self.source.splitlines(keepends=True)]
        lo, hi = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        if 0 <= lo <= hi < len(self._lines) and node.end_col_offset is not None:
            if lo == hi:
                seg = self._lines[lo][node.col_offset : node.end_col_offset].decode("utf-8", "replace")
            else:
                parts = [self._lines[lo][node.col_offset :]] + self._lines[lo + 1 : hi]
                parts.append(self._lines[hi][: node.end_col_offset])
                seg = b"".join(parts).decode("utf-8", "replace")
        if seg is None:
            try:
                seg = ast.unparse(node)
            except Exception:  # pragma: no cover
                seg = "<expression>"
        return _norm(seg)


class _Program:
    """The modules under analysis: the files given, plus project files they import jit helpers from."""

    def __init__(self) -> None:
        self.modules: dict[str, _Module] = {}
        self.roots: list[_Module] = []
        self._module_cache: dict[tuple[str, str, int], _Module | None] = {}

    def add_root(self, source: str, path: str) -> _Module:
        real = os.path.realpath(path) if os.path.isfile(path) else None
        key = real or path
        if key in self.modules:
            mod = self.modules[key]
        else:
            mod = _Module(source, path, real)
            self.modules[key] = mod
        if mod not in self.roots:
            self.roots.append(mod)
        return mod

    def _load(self, real: str) -> _Module | None:
        if real in self.modules:
            return self.modules[real]
        try:
            with open(real, encoding="utf-8") as fh:
                source = fh.read()
            rel = os.path.relpath(real)
            mod = _Module(source, real if rel.startswith("..") else rel, real)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            return None
        self.modules[real] = mod
        return mod

    def _find_module(self, mod: _Module, spec: str, level: int) -> _Module | None:
        """A module imported by `mod`, if it is a file of the same project (relative import, or
        an absolute one found below an ancestor directory of `mod`)."""
        key = (mod.real or "", spec, level)
        if key in self._module_cache:
            return self._module_cache[key]
        found = None
        if mod.real is not None:
            here = os.path.dirname(mod.real)
            if level > 0:
                bases = [here]
                for _ in range(level - 1):
                    bases = [os.path.dirname(bases[0])]
            else:
                bases = []
                d = here
                while True:
                    bases.append(d)
                    parent = os.path.dirname(d)
                    if parent == d:
                        break
                    d = parent
            parts = [x for x in spec.split(".") if x]
            for base in bases:
                stem = os.path.join(base, *parts) if parts else base
                for cand in ((stem + ".py") if parts else None, os.path.join(stem, "__init__.py")):
                    if cand and os.path.isfile(cand) and (parts or level > 0):
                        found = self._load(os.path.realpath(cand))
                        break
                if found is not None:
                    break
        self._module_cache[key] = found
        return found

    def resolve_call(self, mod: _Module, func: ast.AST, local: set) -> tuple[_Module, ast.FunctionDef] | None:
        """The jit function a call refers to: defined in `mod`, imported from a project file
        (`from .rope import helper`), or reached through an imported module (`rope.helper`)."""
        if isinstance(func, ast.Name):
            if func.id in local:
                return None
            if func.id in mod.jit_by_name:
                return mod, mod.jit_by_name[func.id]
            imp = mod.imports.get(func.id)
            if imp is not None and imp[2] is not None:
                other = self._find_module(mod, imp[0], imp[1])
                if other is not None and imp[2] in other.jit_by_name:
                    return other, other.jit_by_name[imp[2]]
            return None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id not in local:
            imp = mod.imports.get(func.value.id)
            if imp is None:
                return None
            spec, level, name = imp
            if name is not None:  # from pkg import submodule
                spec = f"{spec}.{name}" if spec else name
            other = self._find_module(mod, spec, level)
            if other is not None and func.attr in other.jit_by_name:
                return other, other.jit_by_name[func.attr]
        return None


def _static_value(node: ast.AST) -> _Val:
    """Value of a module-level expression (no environment)."""
    if isinstance(node, ast.Constant):
        return _const_val(node.value)
    if isinstance(node, ast.Attribute):
        return _dtype_or_const(node.attr)
    if isinstance(node, ast.Call):
        name = (_dotted(node.func) or "").rsplit(".", 1)[-1]
        if name == "constexpr" and node.args:
            return _static_value(node.args[0])
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        v = _static_value(node.operand)
        if isinstance(node.op, ast.USub) and isinstance(v.cvalue, (int, float)):
            return replace(v, cvalue=-v.cvalue)
        return v
    if isinstance(node, ast.BinOp):
        a, b = _static_value(node.left), _static_value(node.right)
        if a.const and b.const:
            return _Val(const=True, cvalue=_fold(node.op, a.cvalue, b.cvalue))
    return _UNKNOWN


def _const_val(value: object) -> _Val:
    if isinstance(value, str) and value in _INT64_NAMES:
        return _Val(const=True, cvalue=_DTYPE_I64)
    return _Val(const=True, cvalue=value)


def _dtype_or_const(attr: str) -> _Val:
    if attr in ("int64", "uint64"):
        return _Val(const=True, cvalue=_DTYPE_I64)
    return _Val(const=True, cvalue=_DTYPE_OTHER if attr.startswith(("int", "uint", "float", "bfloat")) else None)


def _trivial_factor(v: _Val) -> bool:
    c = v.cvalue
    return v.const and isinstance(c, int) and not isinstance(c, bool) and c in (0, 1, -1)


def _fold(op: ast.operator, a: object, b: object) -> object:
    if not (isinstance(a, int) and isinstance(b, int)) or isinstance(a, bool) or isinstance(b, bool):
        return None
    try:
        if isinstance(op, ast.Add):
            return a + b
        if isinstance(op, ast.Sub):
            return a - b
        if isinstance(op, ast.Mult):
            return a * b
        if isinstance(op, ast.FloorDiv):
            return a // b
        if isinstance(op, ast.Mod):
            return a % b
        if isinstance(op, ast.LShift) and 0 <= b < 128:
            return a << b
        if isinstance(op, ast.RShift) and 0 <= b < 128:
            return a >> b
        if isinstance(op, ast.Pow) and 0 <= b < 128:
            return a**b
    except (ZeroDivisionError, OverflowError):
        return None
    return None


# ----------------------------------------------------------------------------------------
# per-function analysis

_PASSTHROUGH = frozenset(
    {
        "multiple_of",
        "max_contiguous",
        "max_constancy",
        "broadcast_to",
        "reshape",
        "view",
        "expand_dims",
        "trans",
        "permute",
        "ravel",
        "flip",
        "int",
        "float",
        "abs",
        "assume",
        "reinterpret",
        "split",
        "join",
    }
)
_DTYPE_FACTORIES = frozenset({"zeros", "full", "zeros_like", "full_like", "empty"})
_NO_VALUE = frozenset(
    {"static_assert", "device_assert", "static_print", "device_print", "debug_barrier", "print", "assert"}
)
_DESCRIPTOR_METHODS = frozenset({"load", "store", "gather", "scatter"})


class _Function:
    def __init__(
        self,
        program: _Program,
        mod: _Module,
        fn: ast.FunctionDef,
        params: dict[str, _AnyVal] | None,
        returns: dict[tuple, _AnyVal],
    ):
        self.program = program
        self.mod = mod
        self.returns = returns
        self.fn = fn
        self.name = fn.name
        self.env: dict[str, _AnyVal] = {}
        self.findings: dict[_Origin, Finding] = {}
        self.calls: list[tuple[tuple, dict[str, _AnyVal]]] = []
        self.ret: _AnyVal | None = None
        self.span: dict[int, tuple[int, int]] = {}
        self._index_spans(fn.body)
        self._init_params(params)

    # -- setup ---------------------------------------------------------------------------

    def _index_spans(self, stmts: list[ast.stmt]) -> None:
        """Map every expression node to the line span of its enclosing simple statement."""
        for st in stmts:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            bodies = [getattr(st, a) for a in ("body", "orelse", "finalbody") if isinstance(getattr(st, a, None), list)]
            for h in getattr(st, "handlers", []) or []:
                bodies.append(h.body)
            if bodies:
                for b in bodies:
                    self._index_spans(b)
                continue
            span = (st.lineno, st.end_lineno or st.lineno)
            for n in ast.walk(st):
                self.span[id(n)] = span

    def _all_args(self) -> list[ast.arg]:
        a = self.fn.args
        return list(a.posonlyargs) + list(a.args) + list(a.kwonlyargs)

    def _init_params(self, summary: dict[str, _AnyVal] | None) -> None:
        a = self.fn.args
        positional = list(a.posonlyargs) + list(a.args)
        defaults = dict(zip([p.arg for p in positional[len(positional) - len(a.defaults) :]], a.defaults))
        for p, d in zip(a.kwonlyargs, a.kw_defaults):
            if d is not None:
                defaults[p.arg] = d
        for p in self._all_args():
            base = _param_base(p)
            if base.const or summary is None:
                self.env[p.arg] = base
                continue
            v = summary.get(p.arg)
            if v is None:
                v = _static_value(defaults[p.arg]) if p.arg in defaults else base
            elif base.ptr or base.wide:
                fv = _flat(v)
                v = replace(fv, ptr=fv.ptr or base.ptr, wide=fv.wide or base.wide)
            self.env[p.arg] = v
        for extra in (a.vararg, a.kwarg):
            if extra is not None:
                self.env[extra.arg] = _UNKNOWN

    # -- findings ------------------------------------------------------------------------

    def _lines(self, node: ast.AST) -> tuple[int, int]:
        if id(node) in self.span:
            return self.span[id(node)]
        return (node.lineno, getattr(node, "end_lineno", None) or node.lineno)

    def _suppressed(self, node: ast.AST) -> bool:
        lo, hi = self._lines(node)
        return any(line in self.mod.suppressed_lines for line in range(lo, hi + 1))

    def _origin(self, node: ast.AST, rule: str) -> _Origin:
        return _Origin(self.mod.path, self.name, node.lineno, node.col_offset, self.mod.segment(node), rule)

    def _sink(self, off: _AnyVal, node: ast.AST, products_only: bool = False) -> None:
        v = _flat(off)
        items = set(v.origins)
        if not products_only and not v.ptr:
            items |= v.scaled
        if not items or self._suppressed(node):
            return
        for o in items:
            if o not in self.findings:
                self.findings[o] = Finding(
                    o.path, o.line, o.col, o.function, o.expression, o.rule, node.lineno, self.name
                )

    # -- statements ----------------------------------------------------------------------

    def run(self) -> None:
        self._block(self.fn.body)

    def _block(self, stmts: list[ast.stmt]) -> None:
        for st in stmts:
            self._stmt(st)

    def _stmt(self, st: ast.stmt) -> None:
        if isinstance(st, ast.Assign):
            v = self._declared(st, self._ev(st.value))
            for t in st.targets:
                self._assign(t, v)
        elif isinstance(st, ast.AnnAssign):
            if st.value is not None:
                self._assign(st.target, self._declared(st, self._ev(st.value)))
        elif isinstance(st, ast.AugAssign):
            cur = self._ev(st.target) if isinstance(st.target, ast.Name) else _UNKNOWN
            v = self._binop(st.op, cur, self._ev(st.value), st)
            self._assign(st.target, self._declared(st, v))
        elif isinstance(st, ast.Expr):
            self._ev(st.value)
        elif isinstance(st, ast.Return):
            if st.value is not None:
                self.ret = _merge(self.ret, self._ev(st.value))
        elif isinstance(st, ast.If):
            self._ev(st.test)
            before = dict(self.env)
            self._block(st.body)
            after_body = self.env
            self.env = dict(before)
            self._block(st.orelse)
            self.env = _merge_env(after_body, self.env)
        elif isinstance(st, (ast.For, ast.AsyncFor)):
            loop_var = self._loop_var(st.iter)
            self._loop(st.body, target=st.target, target_val=loop_var)
            self._block(st.orelse)
        elif isinstance(st, ast.While):
            self._loop(st.body, test=st.test)
            self._block(st.orelse)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                v = self._ev(item.context_expr)
                if item.optional_vars is not None:
                    self._assign(item.optional_vars, v)
            self._block(st.body)
        elif isinstance(st, ast.Try):
            self._block(st.body)
            for h in st.handlers:
                self._block(h.body)
            self._block(st.orelse)
            self._block(st.finalbody)
        elif isinstance(st, ast.Assert):
            self._ev(st.test)
        # FunctionDef, ClassDef, Pass, Break, Continue, Global, Nonlocal, Import: nothing

    def _declared(self, st: ast.stmt, v: _AnyVal) -> _AnyVal:
        """`x = ...  # int32-ok: <reason>` declares x a small index: bounded, no longer scaled."""
        if not self._suppressed(st):
            return v
        if isinstance(v, _Tup):
            return _Tup(tuple(self._declared(st, e) for e in v.elts))
        if v.kinds - _BOUNDED:
            return replace(v, kinds=(v.kinds & _BOUNDED) | {"declared"}, scaled=frozenset())
        return replace(v, scaled=frozenset())

    def _loop(self, body, target=None, target_val=None, test=None) -> None:
        head = dict(self.env)
        for _ in range(50):
            self.env = dict(head)
            if test is not None:
                self._ev(test)
            if target is not None:
                self._assign(target, target_val)
            self._block(body)
            new_head = _merge_env(head, self.env)
            if new_head == head:
                break
            head = new_head
        self.env = head

    def _loop_var(self, it: ast.expr) -> _AnyVal:
        if isinstance(it, ast.Call):
            name = (_dotted(it.func) or "").rsplit(".", 1)[-1]
            if name in ("range", "static_range") and not self._is_local_method(it.func):
                args = [self._ev(a) for a in it.args] + [self._ev(k.value) for k in it.keywords]
                bounds = _combine(args) if args else _CONST
                bounded = name == "static_range" or bounds.const
                return _Val(
                    kinds=(bounds.kinds | {"static" if bounded else "loop"}),
                    wide=bounds.wide,
                    origins=bounds.origins,
                    scaled=bounds.scaled,
                )
        if isinstance(it, (ast.Tuple, ast.List)):
            v: _AnyVal | None = None
            for e in it.elts:
                v = _merge(v, self._ev(e))
            return v if v is not None else _UNKNOWN
        return _flat(self._ev(it))

    def _assign(self, target: ast.expr, v: _AnyVal) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = v
        elif isinstance(target, (ast.Tuple, ast.List)):
            if (
                isinstance(v, _Tup)
                and len(v.elts) == len(target.elts)
                and not any(isinstance(e, ast.Starred) for e in target.elts)
            ):
                for t, e in zip(target.elts, v.elts):
                    self._assign(t, e)
            else:
                fv = _flat(v)
                for t in target.elts:
                    self._assign(t.value if isinstance(t, ast.Starred) else t, fv)
        elif isinstance(target, ast.Starred):
            self._assign(target.value, _flat(v))
        else:  # subscript/attribute stores: evaluate the parts for side effects
            for child in ast.iter_child_nodes(target):
                if isinstance(child, ast.expr):
                    self._ev(child)

    # -- expressions ---------------------------------------------------------------------

    def _ev(self, node: ast.AST | None) -> _AnyVal:
        if node is None:
            return _CONST
        meth = getattr(self, "_ev_" + type(node).__name__, None)
        if meth is not None:
            return meth(node)
        vals = [self._ev(c) for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr)]
        return _combine(vals) if vals else _UNKNOWN

    def _ev_Constant(self, node: ast.Constant) -> _AnyVal:
        return _Val(const=True, cvalue=node.value)

    def _ev_Name(self, node: ast.Name) -> _AnyVal:
        if node.id in self.env:
            return self.env[node.id]
        if node.id in self.mod.consts:
            return self.mod.consts[node.id]
        if node.id in _INT64_NAMES:
            return _Val(const=True, cvalue=_DTYPE_I64)
        return _UNKNOWN

    def _is_local(self, node: ast.AST) -> bool:
        """True when the base of a dotted expression is a local value, not a module."""
        while isinstance(node, ast.Attribute):
            node = node.value
        if isinstance(node, ast.Name):
            return node.id in self.env
        return True  # a call, subscript, ... : a value

    def _is_local_method(self, func: ast.AST) -> bool:
        return isinstance(func, ast.Attribute) and self._is_local(func.value)

    def _ev_Attribute(self, node: ast.Attribute) -> _AnyVal:
        if not self._is_local(node.value):
            return _dtype_or_const(node.attr)  # tl.int64, tl.float32, triton.language.constexpr ...
        base = self._ev(node.value)
        if node.attr in ("shape", "dtype", "numel", "type", "ndim"):
            return _CONST
        return base  # x.T and similar

    def _ev_Subscript(self, node: ast.Subscript) -> _AnyVal:
        base = self._ev(node.value)
        idx = node.slice
        self._ev(idx)
        if isinstance(base, _Tup):
            if (
                isinstance(idx, ast.Constant)
                and isinstance(idx.value, int)
                and -len(base.elts) <= idx.value < len(base.elts)
            ):
                return base.elts[idx.value]
            return _flat(base)
        return base  # x[:, None] broadcasting keeps the value

    def _ev_Slice(self, node: ast.Slice) -> _AnyVal:
        for part in (node.lower, node.upper, node.step):
            if part is not None:
                self._ev(part)
        return _CONST

    def _ev_Tuple(self, node: ast.Tuple) -> _AnyVal:
        return _Tup(tuple(self._ev(e) for e in node.elts))

    _ev_List = _ev_Tuple

    def _ev_Starred(self, node: ast.Starred) -> _AnyVal:
        return _flat(self._ev(node.value))

    def _ev_IfExp(self, node: ast.IfExp) -> _AnyVal:
        self._ev(node.test)
        return _merge(self._ev(node.body), self._ev(node.orelse))

    def _ev_BoolOp(self, node: ast.BoolOp) -> _AnyVal:
        return _combine([self._ev(v) for v in node.values])

    def _ev_Compare(self, node: ast.Compare) -> _AnyVal:
        vals = [_flat(self._ev(node.left))] + [_flat(self._ev(c)) for c in node.comparators]
        return _Val(const=all(v.const for v in vals))  # a mask, not an index

    def _ev_UnaryOp(self, node: ast.UnaryOp) -> _AnyVal:
        v = _flat(self._ev(node.operand))
        if isinstance(node.op, ast.Not):
            return _Val(const=v.const)
        if isinstance(node.op, ast.UAdd):
            return v
        c = v.cvalue
        if isinstance(node.op, ast.USub) and isinstance(c, (int, float)) and not isinstance(c, bool):
            return replace(v, cvalue=-c)
        return replace(v, cvalue=None)

    def _ev_NamedExpr(self, node: ast.NamedExpr) -> _AnyVal:
        v = self._ev(node.value)
        self._assign(node.target, v)
        return v

    def _ev_BinOp(self, node: ast.BinOp) -> _AnyVal:
        return self._binop(node.op, self._ev(node.left), self._ev(node.right), node)

    def _ev_Lambda(self, node: ast.Lambda) -> _AnyVal:
        return _UNKNOWN

    def _ev_JoinedStr(self, node: ast.JoinedStr) -> _AnyVal:
        return _CONST

    # -- arithmetic ----------------------------------------------------------------------

    def _binop(self, op: ast.operator, left: _AnyVal, right: _AnyVal, node: ast.AST) -> _AnyVal:
        if isinstance(op, ast.Add) and isinstance(left, _Tup) and isinstance(right, _Tup):
            return _Tup(left.elts + right.elts)  # tuple concatenation keeps each element's value
        lhs, rhs = _flat(left), _flat(right)
        if isinstance(op, (ast.Add, ast.Sub)):
            if lhs.ptr and not rhs.ptr:
                self._sink(rhs, node)
                return _Val(ptr=True, origins=lhs.origins)
            if rhs.ptr and not lhs.ptr and isinstance(op, ast.Add):
                self._sink(lhs, node)
                return _Val(ptr=True, origins=rhs.origins)
            out = _combine([lhs, rhs])
            if out.const:
                out = replace(out, cvalue=_fold(op, lhs.cvalue, rhs.cvalue))
            return out
        if isinstance(op, (ast.Mult, ast.LShift)):
            return self._product(op, lhs, rhs, node)
        out = _combine([lhs, rhs])
        if out.const:
            out = replace(out, cvalue=_fold(op, lhs.cvalue, rhs.cvalue))
        return out

    def _product(self, op: ast.operator, lhs: _Val, rhs: _Val, node: ast.AST) -> _Val:
        if isinstance(op, ast.LShift):
            # x << k is x * 2**k
            k = rhs.cvalue
            factor = (1 << k) if isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 64 else None
            rhs = replace(rhs, cvalue=factor)
        origins = lhs.origins | rhs.origins
        wide = lhs.wide or rhs.wide
        const = lhs.const and rhs.const
        cvalue = _fold(ast.Mult(), lhs.cvalue, rhs.cvalue) if const else None
        # a scaled index stays one only when multiplied by a compile-time constant
        scaled = (lhs.scaled if rhs.const else frozenset()) | (rhs.scaled if lhs.const else frozenset())
        narrow_product = not wide and ((lhs.narrow and not rhs.small_const) or (rhs.narrow and not lhs.small_const))
        if narrow_product:
            scaled = frozenset()
            if not origins and not self._suppressed(node):
                origins = frozenset({self._origin(node, "narrow-product")})
        elif not wide:
            const_scaling = any(
                a.narrow and a.unbounded and b.small_const and not _trivial_factor(b)
                for a, b in ((lhs, rhs), (rhs, lhs))
            )
            if const_scaling and not scaled and not origins and not self._suppressed(node):
                scaled = frozenset({self._origin(node, "scaled-index")})
        return _Val(
            kinds=lhs.kinds | rhs.kinds,
            wide=wide,
            const=const,
            ptr=False,
            origins=origins,
            scaled=scaled,
            cvalue=cvalue,
        )

    # -- calls ---------------------------------------------------------------------------

    def _dtype_is_i64(self, node: ast.AST | None) -> bool:
        if node is None:
            return False
        if isinstance(node, ast.Attribute) and not self._is_local(node.value):
            return node.attr in ("int64", "uint64")
        v = _flat(self._ev(node))
        return v.cvalue == _DTYPE_I64

    @staticmethod
    def _arg(node: ast.Call, pos: int, kw: str) -> ast.expr | None:
        for k in node.keywords:
            if k.arg == kw:
                return k.value
        if pos < len(node.args) and not any(isinstance(a, ast.Starred) for a in node.args[: pos + 1]):
            return node.args[pos]
        return None

    def _ev_rest(self, node: ast.Call, skip: Iterable[ast.AST] = ()) -> list[_AnyVal]:
        skip_ids = {id(s) for s in skip if s is not None}
        out = []
        for a in node.args:
            if id(a) not in skip_ids:
                out.append(self._ev(a))
        for k in node.keywords:
            if id(k.value) not in skip_ids:
                out.append(self._ev(k.value))
        return out

    def _cast(self, value: _AnyVal, to_i64: bool) -> _Val:
        v = _flat(value)
        return replace(v, wide=to_i64, ptr=False, cvalue=None if not v.const else v.cvalue)

    def _ev_Call(self, node: ast.Call) -> _AnyVal:
        func = node.func
        # ---- methods on values: x.to(...), desc.load(...), x.reshape(...)
        if isinstance(func, ast.Attribute) and self._is_local(func.value):
            recv = self._ev(func.value)
            m = func.attr
            if m == "to":
                dt = self._arg(node, 0, "dtype")
                if isinstance(dt, ast.Call) and (_dotted(dt.func) or "").endswith("pointer_type"):
                    self._ev_rest(node)
                    return _Val(ptr=True, origins=_flat(recv).origins)  # an address loaded as int
                is64 = self._dtype_is_i64(dt)
                self._ev_rest(node, skip=[dt])
                return self._cast(recv, is64)
            if m in _DESCRIPTOR_METHODS or m.startswith("atomic_"):
                offs = self._arg(node, 0, "offsets")
                if offs is not None:
                    self._sink(self._ev(offs), node, products_only=True)
                self._ev_rest(node, skip=[offs])
                return _Val(kinds=frozenset({"load"})) if m != "store" else _CONST
            args = self._ev_rest(node)
            return _flat(recv) if not args else replace(_flat(recv), cvalue=None)

        target = self.program.resolve_call(self.mod, func, self.env.keys())
        if target is not None:
            return self._call_jit(target, node)
        name = (_dotted(func) or "").rsplit(".", 1)[-1]

        if name in ("program_id", "num_programs"):
            self._ev_rest(node)
            return _Val(kinds=frozenset({"pid"}))
        if name == "arange":
            self._ev_rest(node)
            return _Val(kinds=frozenset({"arange"}))
        if name in ("load", "store") or name.startswith("atomic_"):
            p = self._arg(node, 0, "pointer")
            if p is not None:
                self._sink(self._ev(p), node)
            self._ev_rest(node, skip=[p])
            return _CONST if name == "store" else _Val(kinds=frozenset({"load"}))
        if name == "make_block_ptr":
            base = self._arg(node, 0, "base")
            offs = self._arg(node, 3, "offsets")
            bv = _flat(self._ev(base)) if base is not None else _UNKNOWN
            if offs is not None:
                self._sink(self._ev(offs), node, products_only=True)
            self._ev_rest(node, skip=[base, offs])
            return _Val(ptr=True, origins=bv.origins)
        if name == "advance":
            base = self._arg(node, 0, "base")
            offs = self._arg(node, 1, "offsets")
            bv = _flat(self._ev(base)) if base is not None else _UNKNOWN
            if offs is not None:
                self._sink(self._ev(offs), node, products_only=True)
            self._ev_rest(node, skip=[base, offs])
            return replace(bv, ptr=True)
        if name == "cast":
            x = self._arg(node, 0, "input")
            dt = self._arg(node, 1, "dtype")
            xv = self._ev(x) if x is not None else _UNKNOWN
            is64 = self._dtype_is_i64(dt)
            self._ev_rest(node, skip=[x, dt])
            return self._cast(xv, is64)
        if name in _DTYPE_FACTORIES:
            dt = self._arg(node, 2 if name in ("full", "full_like") else 1, "dtype")
            fill = self._arg(node, 1, "value") if name in ("full", "full_like") else None
            fv = _flat(self._ev(fill)) if fill is not None else _CONST
            self._ev_rest(node, skip=[dt, fill])
            return self._cast(fv, self._dtype_is_i64(dt))
        if name == "constexpr":
            vals = self._ev_rest(node)
            return _Val(const=True, cvalue=_flat(vals[0]).cvalue if vals else None)
        if name in _NO_VALUE:
            self._ev_rest(node)
            return _CONST
        if name == "where":
            vals = self._ev_rest(node)
            return _combine(vals[1:]) if len(vals) >= 2 else _combine(vals)
        if name in _PASSTHROUGH:
            vals = self._ev_rest(node)
            first = self._arg(node, 0, "input")
            return _flat(vals[0]) if vals and first is not None else _combine(vals)
        vals = self._ev_rest(node)
        return _combine(vals) if vals else _UNKNOWN

    def _call_jit(self, callee: tuple[_Module, ast.FunctionDef], node: ast.Call) -> _AnyVal:
        cmod, target = callee
        key = _fkey(cmod, target)
        a = target.args
        positional = [p.arg for p in list(a.posonlyargs) + list(a.args)]
        bound: dict[str, _AnyVal] = {}
        for i, arg in enumerate(node.args):
            v = self._ev(arg)
            if isinstance(arg, ast.Starred):
                for p in positional[i:]:
                    bound[p] = _merge(bound.get(p), _flat(v))
                break
            if i < len(positional):
                bound[positional[i]] = v
        for k in node.keywords:
            v = self._ev(k.value)
            if k.arg is not None:
                bound[k.arg] = v
        self.calls.append((key, bound))
        return self.returns.get(key) or _UNKNOWN


# ----------------------------------------------------------------------------------------
# drivers


def _fkey(mod: _Module, fn: ast.FunctionDef) -> tuple[str, str]:
    return (mod.real or mod.path, fn.name)


def _analyze(program: _Program) -> list[Finding]:
    """Analyse every jit function of the program. Parameter summaries (joined over call sites)
    and return values are iterated to a fixed point; a function is analysed again only when its
    parameters or the return value of a function it calls changed."""
    params: dict[tuple, dict[str, _AnyVal]] = {}
    returns: dict[tuple, _AnyVal] = {}
    results: dict[tuple, _Function] = {}
    dirty: set[tuple] | None = None  # None: everything
    for _ in range(100):
        fns = [(mod, fn) for mod in list(program.modules.values()) for fn in mod.jit_fns]
        todo = [(m, f) for m, f in fns if dirty is None or _fkey(m, f) in dirty or _fkey(m, f) not in results]
        if not todo:
            break
        for mod, fn in todo:
            key = _fkey(mod, fn)
            an = _Function(program, mod, fn, params.get(key), returns)
            an.run()
            results[key] = an
        new_params: dict[tuple, dict[str, _AnyVal]] = {}
        new_returns: dict[tuple, _AnyVal] = {}
        for key, an in results.items():
            if an.ret is not None:
                new_returns[key] = _merge(new_returns.get(key), an.ret)
            for callee, bound in an.calls:
                slot = new_params.setdefault(callee, {})
                for p, v in bound.items():
                    slot[p] = _merge(slot.get(p), v)
        changed_params = {k for k in set(params) | set(new_params) if params.get(k) != new_params.get(k)}
        changed_returns = {k for k in set(returns) | set(new_returns) if returns.get(k) != new_returns.get(k)}
        dirty = set(changed_params)
        for key, an in results.items():
            if any(callee in changed_returns for callee, _ in an.calls):
                dirty.add(key)
        params, returns = new_params, new_returns
    findings: dict[_Origin, Finding] = {}
    for an in results.values():
        for o, f in an.findings.items():
            findings.setdefault(o, f)
    return sorted(findings.values(), key=lambda f: (f.path, f.line, f.col, f.expression))


def audit_source(source: str, path: str = "<string>") -> tuple[list[Finding], list[AuditWarning]]:
    """Audit Python source text. Raises SyntaxError if it does not parse.

    If `path` names a file on disk, jit helpers it imports from files of the same project are
    analysed with it (and findings in them reported too).
    """
    program = _Program()
    mod = program.add_root(source, path)
    return _analyze(program), list(mod.warnings)


def audit_file(path: str) -> tuple[list[Finding], list[AuditWarning]]:
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    return audit_source(source, path)


def _iter_files(paths: Sequence[str]) -> Iterator[str]:
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                for f in sorted(files):
                    if f.endswith(".py"):
                        yield os.path.join(root, f)
        else:
            yield p


def audit_paths(paths: Sequence[str]) -> tuple[list[Finding], list[AuditWarning], list[str], int]:
    """Audit files/directories together (a helper in one file called from a kernel in another
    is analysed with the caller's arguments). Returns (findings, warnings, errors, number of
    files)."""
    program = _Program()
    errors: list[str] = []
    nfiles = 0
    for p in paths:
        if not os.path.exists(p):
            errors.append(f"{p}: error: no such file or directory")
    for f in _iter_files([p for p in paths if os.path.exists(p)]):
        nfiles += 1
        try:
            with open(f, encoding="utf-8") as fh:
                source = fh.read()
            program.add_root(source, f)
        except SyntaxError as e:
            errors.append(f"{f}:{e.lineno or 0}: error: cannot parse: {e.msg}")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            errors.append(f"{f}: error: cannot read: {e}")
    findings = _analyze(program)
    warnings = [w for mod in program.roots for w in mod.warnings]
    return findings, warnings, errors, nfiles


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ropekit.audit",
        description="Report int32 indices (program ids, loop counters, loaded indices, aranges) "
        "that are multiplied in 32 bits and reach a pointer offset in Triton kernels.",
        epilog="Rule: see the ropekit.audit module docstring. Silence a reviewed line with '# int32-ok: <reason>'.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Python files or directories")
    parser.add_argument("--explain", action="store_true", help="print the rule and the pointer use under each finding")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage error (2) or --help (0)
        return int(e.code) if isinstance(e.code, int) else 2

    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:  # a wrong path is a usage error: say only that, audit nothing
        for p in missing:
            print(f"{p}: error: no such file or directory", file=sys.stderr)
        return 2
    findings, warnings, errors, nfiles = audit_paths(args.paths)
    for w in warnings:
        print(w.format(), file=sys.stderr)
    for e in errors:
        print(e, file=sys.stderr)
    for f in findings:
        print(f.format())
        if args.explain:
            print(f.explain())
    if nfiles == 0 and not errors:
        print("ropekit.audit: warning: no Python files found", file=sys.stderr)
    nfound = len(findings)
    if nfound:
        print(
            f"ropekit.audit: {nfound} finding(s) in {nfiles} file(s): widen the index with "
            f".to(tl.int64) before it is multiplied, or mark a reviewed line "
            f"'# int32-ok: <reason>'"
        )
    else:
        print(f"ropekit.audit: no findings in {nfiles} file(s)")
    if errors:
        return 2
    return 1 if nfound else 0


if __name__ == "__main__":
    sys.exit(main())
