"""Replacing another library's rotary helper functions by ropekit, each verified numerically first.

A `Form` is one known way a helper rotates: its arguments by position (`roles`), the conventions
its flag arguments select (`convention` of the bound arguments), ropekit's computation of each
(`rotate`, None for inputs it does not take) and small random inputs per convention (`samples`).
`verify(fn, form)` runs the helper and ropekit on those inputs (float32, without autograd) and
keeps the conventions on which they agree (cached per function object); `Swaps` replaces a
module attribute by one wrapper per helper (shared by every caller, so compiled blocks share it)
that sends verified conventions to ropekit and anything else to the helper itself, and restores
the attributes on `restore()`.

`Restored` is what every integration's `unpatch()` returns (ropekit.hf, .diffusers, .timm):
{family or module: [names that are the library's own again]}, each name once.

A helper's own argument names are read from its signature, so one form serves helpers that spell
them differently; its own defaults apply.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import torch

ATOL, RTOL = 1e-5, 1e-5  # float32 agreement of a verified convention

Restored = Dict[str, List[str]]  # unpatch()'s return: {family or module: [names restored]}


def add_restored(restored: Restored, key: str, name: str) -> None:
    """Record one restored name under its family or module (each name once)."""
    names = restored.setdefault(key, [])
    if name not in names:
        names.append(name)


class Form(NamedTuple):
    name: str
    roles: Tuple[str, ...]  # the helper's parameters, in order (its own names may differ)
    convention: Callable  # bound arguments {role: value} -> hashable convention key
    rotate: Callable  # bound arguments -> ropekit's result, or None when it does not take them
    samples: Callable  # torch.Generator -> [(positional args, convention key)] small random inputs


class Bound(NamedTuple):
    names: Tuple[str, ...]  # the helper's own parameter names for the form's roles
    defaults: Tuple  # their defaults (inspect.Parameter.empty when required)


_verdicts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # fn -> {form name: conventions}


def binding(fn, form: Form) -> Optional[Bound]:
    """The helper's parameters for the form's roles, when it takes exactly that many."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != len(form.roles) or any(p.kind not in kinds for p in params):
        return None
    return Bound(tuple(p.name for p in params), tuple(p.default for p in params))


def bind(form: Form, bound: Bound, args, kwargs) -> Optional[dict]:
    """{role: value} of one call, or None when an argument is missing or unknown."""
    if len(args) > len(form.roles) or any(k not in bound.names for k in kwargs):
        return None
    out = {}
    for i, (role, name, default) in enumerate(zip(form.roles, bound.names, bound.defaults)):
        value = args[i] if i < len(args) else kwargs.get(name, default)
        if value is inspect.Parameter.empty:
            return None
        out[role] = value
    return out


def close(a, b) -> bool:
    """Whether two results agree: same structure, shapes and dtypes, values within ATOL / RTOL."""
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a.double(), b.double(), atol=ATOL, rtol=RTOL)


def verify(fn, form: Form) -> FrozenSet:
    """The conventions of `form` on which `fn` and ropekit agree (cached per function object)."""
    cache = _verdicts.setdefault(fn, {})
    if form.name in cache:
        return cache[form.name]
    bound = binding(fn, form)
    agreed, failed = set(), set()
    if bound is not None:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a helper of another form may warn on these inputs
            for args, key in form.samples(gen):
                try:
                    want = fn(*args)
                    got = form.rotate(bind(form, bound, args, {}))
                except Exception:  # a helper of another form: its own error on these inputs
                    got, want = None, ()
                (agreed if got is not None and close(want, got) else failed).add(key)
    cache[form.name] = frozenset(agreed - failed)
    return cache[form.name]


def wrapper(fn, form: Form, conventions: FrozenSet) -> Callable:
    """fn's replacement: ropekit for the verified conventions, fn itself for any other call."""
    bound = binding(fn, form)

    @functools.wraps(fn)
    def rotary(*args, **kwargs):
        a = bind(form, bound, args, kwargs)
        if a is not None and form.convention(a) in conventions:
            out = form.rotate(a)
            if out is not None:
                return out
        return fn(*args, **kwargs)

    rotary.ropekit_form = form.name
    rotary.ropekit_original = fn
    return rotary


def original(fn):
    """The helper behind a ropekit wrapper (fn itself when it is none)."""
    return getattr(fn, "ropekit_original", fn)


class Swaps:
    """Module attributes replaced by wrappers, restored on `restore()`; one wrapper per helper."""

    def __init__(self):
        self.saved: Dict[Tuple[object, str], Callable] = {}
        self.wrappers: Dict[Callable, Callable] = {}

    def swap(self, module, attr: str, fn, form: Form, conventions: FrozenSet) -> None:
        if (module, attr) in self.saved:
            return
        if fn not in self.wrappers:
            self.wrappers[fn] = wrapper(fn, form, conventions)
        self.saved[(module, attr)] = fn
        setattr(module, attr, self.wrappers[fn])

    def restore(self) -> Restored:
        """Put every replaced attribute back; returns {module name: [attributes restored]}."""
        restored: Restored = {}
        for (module, attr), fn in self.saved.items():
            setattr(module, attr, fn)
            add_restored(restored, getattr(module, "__name__", repr(module)), attr)
        self.saved.clear()
        self.wrappers.clear()
        return restored
