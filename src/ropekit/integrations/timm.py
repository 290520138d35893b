"""ropekit inside timm's ViT RoPE models: timm.layers' rotary helpers become ropekit calls,
forward and backward, each verified numerically when patched.

    ropekit.timm.patch()     Returns a Report: {helper: form and conventions patched}, with
                             .left {helper: reason} for those left as they were.
    ropekit.timm.unpatch()   undoes it; returns {module: [helper bindings restored]} (the shape
                             every integration's unpatch() returns, seams.Restored)

The helpers are those of timm.layers.pos_embed_sincos whose name says they apply a rotation
(apply_rot_embed(x, sin_emb, cos_emb, half), apply_rot_embed_cat(x, emb, half)); each is run
against ropekit on small random inputs of its form (seams.verify) and replaced, in every loaded
timm module that binds it (the EVA / ViT RoPE / SAM attention, the attention pools, and the
rotary embedding modules' own forward through pos_embed_sincos), by one wrapper: verified
conventions go to ropekit, any other call to the helper itself.

Forms (timm 1.0): x (B, H, N, D) heads first, or (B, N, C) as one head; sin / cos (or emb =
cat(sin, cos), sin first) of D columns, [f0, f0, f1, f1, ..] (half=False, pairs) or
[f0, f1, .., f0, f1, ..] (half=True), shaped (N, D), (H or 1, N, D) per head (RotaryEmbeddingMixed)
or (B or 1, H or 1, N, D). A learnable emb that requires grad keeps timm's own autograd.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys

import torch

from . import rotations as R
from . import seams
from .seams import Form

OP = "ropekit.timm"
_HOST = "timm.layers.pos_embed_sincos"
_HELPER = re.compile(r"apply.*rot|rot.*apply", re.IGNORECASE)
B, H, N, D = 2, 3, 5, 8  # verification sizes


def _rotate(x, sin, cos, half):
    """ropekit's result of timm's apply_rot_embed, or None for inputs it does not take."""
    if not isinstance(half, bool) or not R.takes(x, sin, cos) or sin.shape != cos.shape:
        return None
    if sin.dim() < 2 or sin.dim() > 4 or sin.is_complex() or sin.shape[-1] != x.shape[-1]:
        return None
    cs = (R.halves if half else R.pairs)(cos, sin, x.shape[-1])
    if cs is None:
        return None
    if x.dim() == 3:
        out = R.rotate_heads(x.unsqueeze(1), *cs, interleaved=not half) if sin.dim() < 4 else None
        return None if out is None else out.squeeze(1)
    return R.rotate_heads(x, *cs, interleaved=not half)


def _sep(a):
    return _rotate(a["x"], a["sin"], a["cos"], a["half"])


def _cat(a):
    emb = a["emb"]
    if not isinstance(emb, torch.Tensor) or emb.shape[-1] % 2:
        return None
    sin, cos = emb.chunk(2, -1)
    return _rotate(a["x"], sin, cos, a["half"])


def _angles(gen, half, *shape):
    theta = torch.randn(*shape, D // 2, generator=gen) * 3
    theta = torch.cat((theta, theta), -1) if half else theta.repeat_interleave(2, -1)
    return theta.sin(), theta.cos()


_SHAPES = ((N,), (H, N), (1, N), (B, 1, N), (B, H, N))  # the emb's leading dims


def _samples(gen):
    """[(x, sin, cos, half), (half, emb dims, x dims)]."""
    out = []
    for half in (False, True):
        for lead in _SHAPES:
            x = torch.randn(B, H, N, D, generator=gen)
            out.append(((x, *_angles(gen, half, *lead), half), (half, len(lead) + 1, 4)))
        x = torch.randn(B, N, D, generator=gen)
        out.append(((x, *_angles(gen, half, N), half), (half, 2, 3)))
    return out


def _cat_samples(gen):
    return [((x, torch.cat((sin, cos), -1), half), key) for (x, sin, cos, half), key in _samples(gen)]


def _key(x, emb, half):
    if not all(isinstance(t, torch.Tensor) for t in (x, emb)):
        return None
    return (half, emb.dim(), x.dim())


FORMS = (
    Form("sep", ("x", "sin", "cos", "half"), lambda a: _key(a["x"], a["sin"], a["half"]), _sep, _samples),
    Form("cat", ("x", "emb", "half"), lambda a: _key(a["x"], a["emb"], a["half"]), _cat, _cat_samples),
)
BY_ARITY = {len(f.roles): f for f in FORMS}

_swaps = seams.Swaps()


class Report(dict):
    """{helper: 'form conventions'} patched; .left {helper: reason} left as it was."""

    def __init__(self, helpers, left):
        super().__init__(helpers)
        self.left = left


def _qualname(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _names(code) -> set:
    """The global names a function's code (and the code nested in it: comprehensions) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def patch() -> Report:
    """Route timm's rotary helpers through ropekit, in every timm module that binds them."""
    try:
        host = importlib.import_module(_HOST)
        importlib.import_module("timm.models")  # every model module, so each binding is found
    except ImportError as e:
        raise ImportError(f"{OP}: timm: expected an importable timm (>= 1.0), got {type(e).__name__}: {e}") from e
    helpers, left, verified = {}, {}, {}
    for attr, obj in list(vars(host).items()):
        fn = seams.original(obj)
        if not (inspect.isfunction(fn) and _HELPER.search(attr)) or fn.__module__ != _HOST:
            continue
        form = BY_ARITY.get(len(inspect.signature(fn).parameters))
        conventions = seams.verify(fn, form) if form is not None else frozenset()
        if conventions:
            verified[fn] = (form, conventions)
            helpers[_qualname(fn)] = f"{form.name} {sorted(conventions, key=repr)}"
        else:
            left[_qualname(fn)] = f"no known form agrees with it on random inputs (signature {inspect.signature(fn)})"
    for name in list(left):
        # a helper that calls a patched one through its module's globals goes to ropekit through it
        fn = seams.original(getattr(host, name.rsplit(".", 1)[1]))
        via = [v.__name__ for v in verified if v.__name__ in _names(fn.__code__)]
        if via:
            left[name] = f"not replaced: it calls {', '.join(via)} (patched) for each input"
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "timm" or name.startswith("timm.")):
            continue
        for attr, obj in list(vars(module).items()):
            fn = seams.original(obj) if callable(obj) else None
            if fn in verified:
                _swaps.swap(module, attr, fn, *verified[fn])
    return Report(helpers, left)


def unpatch() -> seams.Restored:
    """Restore every helper binding patch() replaced; returns {module: [attributes restored]}."""
    return _swaps.restore()
