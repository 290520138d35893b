"""ropekit inside diffusers' transformers: their rotary helpers, and the QK-RMSNorm + rotation of
the processors that norm q / k right before rotating, become ropekit calls, forward and backward.

    ropekit.diffusers.patch(model=None)   model: a diffusers model (or any nn.Module holding its
                                          attention modules); None: every model, current and
                                          future. Returns a Report: {family: attention modules
                                          prepared}, with .helpers {helper: form and conventions
                                          patched}, .left {helper, function or module: reason}
                                          and .modules {transformer module: [seams its code
                                          runs]}, the same with or without a model (`reach`).
    ropekit.diffusers.unpatch()           undoes every patch; returns {family or module: [names
                                          restored]}, the shape of ropekit.hf.unpatch()

Two seams, both public:

1. The rotary helpers. Every module-level function of diffusers.models.embeddings,
   .attention_processor and each module of diffusers.models.transformers whose name says it
   applies a rotation (`apply` and `rot` / `rope`) is run against ropekit on small random inputs
   of each known form (ropekit.integrations.diffusers_forms) and replaced, in every module that
   binds it, by one wrapper per helper: the conventions that agreed go to ropekit, any other call
   to the helper itself. A helper of a later diffusers release is covered when it has a known
   form; any other is left as it is and named in the report with the reason.
2. The fused QK-RMSNorm + rotation (FAMILIES: Flux.1, Wan 2.x, HunyuanVideo, Qwen-Image, Z-Image,
   BRIA-FIBO 2, Mochi (angles per token and head)). The
   processor class's `__call__` is wrapped (its signature kept: diffusers filters keyword arguments
   by it): it turns the rotary embedding argument into per-token (cos, sin) views, calls the
   original processor with the embedding set to None, and the attention module's norms, whose
   class `forward` is one shared replacement, run RMSNorm + rotation in one ropekit launch with
   the norm's own weight and eps while that call is active. A norm ropekit cannot reproduce
   exactly (no weight, a bias, weights of another dtype, another norm class) runs as it was and
   ropekit rotates its output. An embedding that requires grad (Mochi's learnable frequencies,
   in training) is not taken: that call runs the processor as it was.

What neither seam takes is named in .left: a function of those modules (a processor's method
included) whose code reads a name a written-out rotation reads (view_as_complex, a rotate_half)
or defines a rotary helper inside it, outside a verified helper and a fused processor.

torch.compile: nothing Dynamo guards on changes after patch(): the modules patch(model) prepares
are marked then, patch() marks none (every module of the families is taken), the wrappers and
the shared norm forward are one object per helper / class (blocks compiled one by one share them),
and the active call is a module-level stack pushed and popped within the call.

The rotary rows a norm's tokens take are the family's `rows` rule: Flux's image stream holds the
last rows of the joint [text, image] embedding ("tail") and its text stream the first ("head");
HunyuanVideo rotates only the leading latent rows of a [latent, text] sequence ("prefix": the text
rows get the identity rotation). Weights, state_dict keys and module identities do not change.
"""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
import pkgutil
import re
import sys
import types
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..api.ops import rotate_with_angles
from ..core.args import fail
from . import seams
from .diffusers_forms import BY_ARITY

OP = "ropekit.diffusers"
_MARK = "ropekit_fused"  # on an attention module patch(model) prepared: its norms fuse the rotation


class Family(NamedTuple):
    """How one diffusers transformer family applies its norm and rotary embedding."""

    module: str  # the diffusers module holding the processor classes
    processors: Tuple[str, ...]  # processor classes whose norm + rotation ropekit takes over
    emb_arg: str  # the processor argument carrying the rotary embedding
    angles: Callable  # embedding -> {group: (cos, sin)}, per-token (S, rotary_dim // 2) views
    norms: Dict[str, Tuple[str, str]]  # norm attribute -> (group of angles, rows rule)
    flat_heads: bool  # the norms see (B, S, H * D) (normalized across heads), not (B, S, H, D)
    per_head: bool = False  # angles (S, H, rotary_dim // 2): each head its own (Mochi)
    check: Optional[Callable] = None  # processor class -> None when its rotation agrees, else the reason


def _repeated_pairs(emb):
    """Flux / HunyuanVideo: (cos, sin), each (S, D) with every frequency repeated at 2i and 2i + 1."""
    cos, sin = emb
    return {"rows": (cos[..., 0::2], sin[..., 0::2])}


def _wan_pairs(emb):
    """Wan: (freqs_cos, freqs_sin), each (1, S, 1, D), frequencies repeated in pairs."""
    cos, sin = emb
    return {"rows": (cos[0, :, 0, 0::2], sin[0, :, 0, 1::2])}


def _per_head_pairs(emb):
    """Mochi: (freqs_cos, freqs_sin), each (S, H, D / 2), one angle per pair (2i, 2i + 1) and head."""
    cos, sin = emb
    return {"rows": (cos, sin)}


def _nested(fn, name: str):
    """The function `name` defined inside fn, rebuilt from its code object (None when fn has none
    or it reads variables of fn)."""
    for const in getattr(getattr(fn, "__code__", None), "co_consts", ()):
        if isinstance(const, types.CodeType) and const.co_name == name and not const.co_freevars:
            return types.FunctionType(const, fn.__globals__)
    return None


def _check_per_head(cls) -> Optional[str]:
    """Mochi: the processor's own apply_rotary_emb(x, freqs_cos, freqs_sin), run next to ropekit's
    per-head rotation on random x (B, S, H, D) and angles (S, H, D / 2), float32."""
    helper = _nested(seams.original(cls.__call__), "apply_rotary_emb")
    if helper is None:
        return "no apply_rotary_emb(x, freqs_cos, freqs_sin) defined in its __call__"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=gen)
    theta = torch.randn(5, 3, 4, generator=gen) * 3
    with torch.no_grad():
        try:
            want = helper(x, theta.cos(), theta.sin())
        except Exception as e:  # another helper of that name
            return f"its apply_rotary_emb raised {type(e).__name__} on (x, freqs_cos, freqs_sin)"
        got = _rotate_per_head(x, (theta.cos(), theta.sin()), None, 0.0)
    if not seams.close(want, got):
        return "its apply_rotary_emb does not agree with the per-head pairs rotation on random inputs"
    return None


def _complex_parts(freqs_cis):
    parts = torch.view_as_real(freqs_cis)
    return parts[..., 0], parts[..., 1]


def _qwen_streams(emb):
    """Qwen-Image: (image freqs_cis (S_img, D / 2), text freqs_cis (S_txt, D / 2)), complex64."""
    img, txt = emb
    return {"img": _complex_parts(img), "txt": _complex_parts(txt)}


def _per_sample_complex(freqs_cis):
    """Z-Image, BRIA-FIBO 2: complex64 freqs_cis (B or 1, S, D / 2), each sample its own positions."""
    return {"rows": _complex_parts(freqs_cis)}


_TRANSFORMERS = "diffusers.models.transformers."
_JOINT = {"norm_q": ("rows", "tail"), "norm_k": ("rows", "tail")}

FAMILIES: Dict[str, Family] = {
    "flux": Family(
        _TRANSFORMERS + "transformer_flux",
        ("FluxAttnProcessor",),
        "image_rotary_emb",
        _repeated_pairs,
        {**_JOINT, "norm_added_q": ("rows", "head"), "norm_added_k": ("rows", "head")},
        False,
    ),
    # Wan 2.x and the models that carry a copy of its processor (same code, their own module)
    **{
        name: Family(_TRANSFORMERS + module, (cls,), "rotary_emb", _wan_pairs, _JOINT, True)
        for name, module, cls in (
            ("wan", "transformer_wan", "WanAttnProcessor"),
            ("chronoedit", "transformer_chronoedit", "WanAttnProcessor"),
            ("skyreels_v2", "transformer_skyreels_v2", "SkyReelsV2AttnProcessor"),
            ("wan_animate", "transformer_wan_animate", "WanAttnProcessor"),
        )
    },
    "hunyuan_video": Family(
        _TRANSFORMERS + "transformer_hunyuan_video",
        ("HunyuanVideoAttnProcessor2_0",),
        "image_rotary_emb",
        _repeated_pairs,
        {"norm_q": ("rows", "prefix"), "norm_k": ("rows", "prefix")},
        False,
    ),
    "qwen_image": Family(
        _TRANSFORMERS + "transformer_qwenimage",
        ("QwenDoubleStreamAttnProcessor2_0",),
        "image_rotary_emb",
        _qwen_streams,
        {
            "norm_q": ("img", "tail"),
            "norm_k": ("img", "tail"),
            "norm_added_q": ("txt", "tail"),
            "norm_added_k": ("txt", "tail"),
        },
        False,
    ),
    # Mochi: per-head MochiRMSNorm, then per-head angles (S, H, D / 2) on the video tokens only
    "mochi": Family(
        "diffusers.models.attention_processor",
        ("MochiAttnProcessor2_0",),
        "image_rotary_emb",
        _per_head_pairs,
        _JOINT,
        False,
        per_head=True,
        check=_check_per_head,
    ),
    # Z-Image and BRIA-FIBO 2: per-head RMSNorm, then complex freqs_cis (B, S, D / 2) inside the processor
    **{
        name: Family(_TRANSFORMERS + module, (cls,), "freqs_cis", _per_sample_complex, _JOINT, False)
        for name, module, cls in (
            ("z_image", "transformer_z_image", "ZSingleStreamAttnProcessor"),
            ("bria_fibo2", "transformer_bria_fibo2", "BriaFibo2AttnProcessor"),
        )
    },
}

_originals: Dict[type, Callable] = {}  # processor class -> its own __call__, while patched
_norm_forwards: Dict[type, Callable] = {}  # norm class -> its own forward, while patched
_prepared: "weakref.WeakSet" = weakref.WeakSet()  # attention modules marked by patch(model)
_active: list = []  # (attention module, family, {group: (cos, sin)}) of the processor call running
_swaps = seams.Swaps()
_lazy = False  # patch(None): every attention module of the families, no marks needed


class Report(dict):
    """{family: attention modules prepared now}; .helpers {helper: 'form conventions'} patched;
    .left {helper, function or module: reason} left as they were; .modules {transformer module:
    [ropekit seams its code runs]} (the same for patch() and patch(model): no family needs the
    model, see `reach`)."""

    def __init__(self, counts, helpers, left, modules=None):
        super().__init__(counts)
        self.helpers, self.left, self.modules = helpers, left, modules or {}


def _processor_classes():
    """(family name, Family, processor class) for every family the installed diffusers has."""
    found = []
    for name, family in FAMILIES.items():
        try:
            module = importlib.import_module(family.module)
        except ImportError:
            continue
        for cls_name in family.processors:
            cls = getattr(module, cls_name, None)
            if isinstance(cls, type):
                found.append((name, family, cls))
    return found


# ---------------------------------------------------------------------------------------------
# the norms: RMSNorm + rotation in one launch


def _rows(angles, n: int, rule: str):
    """The (cos, sin) rows of n tokens under the family's rows rule (see the module docstring);
    angles (S, R) or, per sample, (B, S, R)."""
    cos, sin = angles
    S = cos.shape[-2]
    if n == S:
        return cos, sin
    if rule == "tail" and n < S:
        return cos[..., S - n :, :], sin[..., S - n :, :]
    if rule == "head" and n < S:
        return cos[..., :n, :], sin[..., :n, :]
    if rule == "prefix" and n > S:
        pad = (*cos.shape[:-2], n - S, cos.shape[-1])
        return torch.cat((cos, cos.new_ones(pad)), -2), torch.cat((sin, sin.new_zeros(pad)), -2)
    fail(OP, "rotary embedding", f"rows for {n} tokens ({rule} rule)", f"{S} rows")


def _rms_classes():
    from diffusers.models.normalization import MochiRMSNorm, RMSNorm

    return (torch.nn.RMSNorm, RMSNorm, MochiRMSNorm)


def _fusable(norm, x) -> Optional[torch.Tensor]:
    """The norm's weight when ropekit computes the same RMSNorm (x * rsqrt(mean(x^2) + eps) * w over
    the last dim, output in x's dtype), else None."""
    w = getattr(norm, "weight", None)
    if w is None or getattr(norm, "bias", None) is not None or w.dtype != x.dtype or w.dim() != 1:
        return None
    if not isinstance(norm, _rms_classes()) or w.shape[0] != x.shape[-1]:
        return None
    return w


def _eps(norm, x) -> float:
    eps = getattr(norm, "eps", None)
    return torch.finfo(x.dtype).eps if eps is None else float(eps)


def _own_forward(norm):
    for cls in type(norm).__mro__:
        if cls in _norm_forwards:
            return _norm_forwards[cls]
    return type(norm).forward


def _norm_forward(self, x):
    """The shared forward of every patched norm class: RMSNorm and rotation of x (B, S, H, D), or
    (B, S, H * D) across heads, while a patched processor call of its attention module is active;
    the class's own forward otherwise."""
    own = _own_forward(self)
    if not _active:
        return own(self, x)
    attn, family, angles = _active[-1]
    for name, (group, rule) in family.norms.items():
        if getattr(attn, name, None) is self and group in angles:
            w = _fusable(self, x)
            y = x if w is not None else own(self, x)
            if family.per_head:
                return _rotate_per_head(y, angles[group], w, _eps(self, x))
            cos, sin = _rows(angles[group], x.shape[1], rule)
            heads = attn.heads if family.flat_heads else 0
            y4 = y.unflatten(-1, (heads, -1)) if heads else y
            out, _ = rotate_with_angles(y4, None, cos, sin, interleaved=True, q_norm_weight=w, norm_eps=_eps(self, x))
            return out.flatten(-2) if heads else out
    return own(self, x)


def _rotate_per_head(y, angles, w, eps):
    """y (B, S, H, D) with angles (S, H, R / 2) of their own per token and head: one ropekit call
    on the (B, S * H, 1, D) view, every head a token of one head (the norm per head as before)."""
    cos, sin = angles
    b, n, h, d = y.shape
    if cos.shape[:2] != (n, h) or sin.shape != cos.shape:
        fail(OP, "rotary embedding", f"per-head angles ({n}, {h}, R / 2) for {n} tokens of {h} heads", tuple(cos.shape))
    r = cos.shape[-1]
    flat = y.reshape(b, n * h, 1, d)
    out, _ = rotate_with_angles(
        flat, None, cos.reshape(n * h, r), sin.reshape(n * h, r), interleaved=True, q_norm_weight=w, norm_eps=eps
    )
    return out.view(b, n, h, d)


def _patch_norm_class(cls) -> None:
    if cls not in _norm_forwards and cls.__dict__.get("forward") is not _norm_forward:
        _norm_forwards[cls] = cls.__dict__.get("forward", cls.forward)
        cls.forward = _norm_forward


def _norms(attn, family: Family):
    return [n for n in (getattr(attn, name, None) for name in family.norms) if isinstance(n, torch.nn.Module)]


def _ready(attn, family: Family) -> bool:
    """Whether this module's norms fuse: marked by patch(model) or every module (patch()), none of
    the family's norms set to None (the processor would skip it, and the rotation with it), and
    every norm's class patched (else the processor rotates as it was)."""
    if not (_lazy or attn.__dict__.get(_MARK, False)):
        return False
    if any(getattr(attn, name, 0) is None for name in family.norms):
        return False
    return all(type(n).forward is _norm_forward for n in _norms(attn, family))


# ---------------------------------------------------------------------------------------------
# the processors


def _learnable(emb) -> bool:
    """Whether the embedding carries a gradient (Mochi's pos_frequencies are a parameter): ropekit
    takes constant angles, so such a call runs the processor as it was."""
    if not torch.is_grad_enabled():
        return False
    parts = emb if isinstance(emb, (tuple, list)) else (emb,)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in parts)


def _wrap(family: Family, call: Callable) -> Callable:
    """The processor __call__ that hands the rotary embedding to the norms (signature kept)."""
    index = list(inspect.signature(call).parameters).index(family.emb_arg) - 2  # after self, attn

    @functools.wraps(call)
    def patched(self, attn, *args, **kwargs):
        emb = args[index] if len(args) > index else kwargs.get(family.emb_arg)
        if emb is None or not _ready(attn, family) or _learnable(emb):
            return call(self, attn, *args, **kwargs)
        if len(args) > index:
            args = (*args[:index], None, *args[index + 1 :])
        else:
            kwargs = {**kwargs, family.emb_arg: None}
        _active.append((attn, family, family.angles(emb)))
        try:
            return call(self, attn, *args, **kwargs)
        finally:
            _active.pop()

    return patched


# ---------------------------------------------------------------------------------------------
# the rotary helpers

_HOSTS = ("diffusers.models.embeddings", "diffusers.models.attention_processor")
_TRANSFORMERS_PKG = "diffusers.models.transformers"
_HELPER = re.compile(r"apply.*(rot|rope)|(rot|rope).*apply", re.IGNORECASE)


def host_modules(left: Dict[str, str]):
    """diffusers' modules that hold rotary helpers: embeddings, attention_processor and every
    module of diffusers.models.transformers (one that does not import is named in `left`)."""
    pkg = importlib.import_module(_TRANSFORMERS_PKG)
    names = list(_HOSTS) + [f"{_TRANSFORMERS_PKG}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    found = []
    for name in names:
        try:
            found.append(importlib.import_module(name))
        except Exception as e:  # an optional dependency of one model
            left[name] = f"does not import: {type(e).__name__}: {e}"
    return found


def _helpers(module):
    for attr, obj in list(vars(module).items()):
        fn = seams.original(obj)
        if inspect.isfunction(fn) and _HELPER.search(attr):
            yield attr, fn


def _qualname(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _patch_helpers(helpers: Dict[str, str], left: Dict[str, str]) -> list:
    modules = host_modules(left)
    for module in modules:
        for attr, fn in _helpers(module):
            name = _qualname(fn)
            for form in BY_ARITY.get(len(inspect.signature(fn).parameters), ()):
                conventions = seams.verify(fn, form)
                if conventions:
                    _swaps.swap(module, attr, fn, form, conventions)
                    helpers[name] = f"{form.name} {sorted(conventions, key=repr)}"
                    break
            else:
                if name not in helpers:
                    sig = inspect.signature(fn)
                    left[name] = f"no known form agrees with it on random inputs (signature {sig})"
    return modules


# ---------------------------------------------------------------------------------------------
# reach: the seams each transformer module runs, and the rotations ropekit leaves (code objects)

_INLINE = ("view_as_complex", "rotate_half")  # names a rotation written out in place reads


def _codes(code):
    """code and every code object nested in it (nested defs, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _unwrapped(obj):
    """The function under ropekit's wrapper and any functools.wraps decorators (diffusers'
    register_to_config on __init__)."""
    obj = seams.original(obj)
    return inspect.unwrap(obj) if inspect.isfunction(obj) else obj


def _methods(cls):
    """{qualname: function} of the methods a class defines (a fused processor's own __call__)."""
    out = {}
    for name, member in list(vars(cls).items()):
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if name == "__call__" and cls in _originals:
            member = _originals[cls]
        member = _unwrapped(member)
        if inspect.isfunction(member):
            out[f"{cls.__qualname__}.{name}"] = member
    return out


def _defined(module) -> Dict[str, Callable]:
    """{qualname: function} of the module-level functions and class methods a module defines."""
    out = {}
    for obj in list(vars(module).values()):
        obj = _unwrapped(obj)
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            out[obj.__qualname__] = obj
        elif isinstance(obj, type):
            out.update(_methods(obj))
    return out


def _imports(code, package) -> dict:
    """{name: object} bound by the `from X import name` statements of one code object."""
    out, level, source = {}, 0, None
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_CONST" and type(ins.argval) is int:
            level = ins.argval
        elif ins.opname == "IMPORT_NAME":
            try:
                source = importlib.import_module("." * level + ins.argval, package)
            except Exception:  # an optional dependency: that import is not followed
                source = None
        elif ins.opname == "IMPORT_FROM" and source is not None:
            out[ins.argval] = getattr(source, ins.argval, None)
    return out


def _reads(fn) -> dict:
    """{name: object} of the names a function's code reads: its module's globals, and what its
    own `from X import name` statements import (diffusers' processors import the shared helper
    inside __call__, which then is whatever diffusers.models.embeddings binds at call time)."""
    found = {}
    package = fn.__globals__.get("__package__")
    for code in _codes(fn.__code__):
        found.update((n, fn.__globals__[n]) for n in code.co_names if n in fn.__globals__)
        found.update(_imports(code, package))
    return found


def _seam(obj) -> Optional[str]:
    """The ropekit seam an object is: a helper replaced by its wrapper, or a fused processor."""
    if hasattr(obj, "ropekit_form"):
        return _qualname(seams.original(obj))
    if isinstance(obj, type) and obj in _originals:
        return f"{_qualname(obj)} (fused)"
    return None


def _followed(obj) -> Dict[str, Callable]:
    """The functions of an object another transformer module's code reads that count as its own:
    functions and classes of the transformer modules (a block it builds), processor classes."""
    module = getattr(obj, "__module__", None) or ""
    if not module.startswith("diffusers.models."):
        return {}
    if inspect.isfunction(obj) and module.startswith(_TRANSFORMERS_PKG + "."):
        return {_qualname(obj): obj}
    if isinstance(obj, type) and (module.startswith(_TRANSFORMERS_PKG + ".") or "Processor" in obj.__name__):
        return {f"{module}.{q}": f for q, f in _methods(obj).items()}
    return {}


def reach(module) -> List[str]:
    """The ropekit seams a transformer module's code runs: the helpers and fused processors its
    functions and methods read, directly or through the blocks, functions and processor classes
    they take from other modules. Taken from the installed diffusers, not from a model: every
    attention module of a fused family fuses once patched (patch() marks none, patch(model) marks
    the model's ahead of torch.compile), so no family needs the model."""
    found = {_seam(c) for c in vars(module).values() if isinstance(c, type) and c in _originals}
    todo, seen = list(_defined(module).values()), set()
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for obj in _reads(fn).values():
            seam = _seam(obj)
            if seam is not None:
                found.add(seam)
            else:
                todo.extend(_followed(_unwrapped(obj)).values())
    return sorted(s for s in found if s is not None)


def _inline(fn) -> Optional[str]:
    """Why a function's own code rotates where ropekit has no seam, or None: it reads a name a
    written-out rotation reads, or defines a rotary helper inside it."""
    for code in _codes(fn.__code__):
        if code is not fn.__code__ and _HELPER.search(code.co_name):
            return f"rotates with {code.co_name}, defined inside it: no module-level seam to replace"
        names = [n for n in code.co_names if any(i in n for i in _INLINE)]
        for name in names:
            if not hasattr(fn.__globals__.get(name), "ropekit_form"):
                return f"rotates inline ({name}): no seam ropekit replaces"
    return None


def _census(modules, left: Dict[str, str]) -> Dict[str, List[str]]:
    """{module: seams} of every transformer module that runs one; the rotations no seam takes
    (outside a verified helper or a fused processor) named in `left`."""
    served = {seams.original(w) for w in _swaps.wrappers.values()}
    out = {}
    for module in modules:
        for qualname, fn in _defined(module).items():
            name = f"{module.__name__}.{qualname}"
            owner = getattr(module, qualname.split(".")[0], None)
            if fn in served or name in left or (isinstance(owner, type) and owner in _originals):
                continue
            why = _inline(fn)
            if why is not None:
                left[name] = why
        if module.__name__.startswith(_TRANSFORMERS_PKG + "."):
            found = reach(module)
            if found:
                out[module.__name__] = found
    return out


def patch(model: Optional[torch.nn.Module] = None) -> Report:
    """Route the rotary helpers and the fused QK-norm + rotation of the installed diffusers through
    ropekit.

    model: prepare its attention modules' fused norms now (call it before torch.compile), or None:
    every attention module of the families. The helpers are patched for every model either way.
    Returns a Report ({family: attention modules prepared now}, .helpers, .left); with a model,
    only what that model holds (`_found_in`).
    """
    global _lazy
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"{OP}: model: expected a torch.nn.Module or None, got {type(model).__name__}")
    counts, helpers, left = {}, {}, {}
    modules = _patch_helpers(helpers, left)
    for name, family, cls in _processor_classes():
        reason = None if cls in _originals or family.check is None else family.check(cls)
        if reason is not None:
            left[_qualname(cls)] = reason
            continue
        if cls not in _originals:
            _originals[cls] = cls.__call__
            cls.__call__ = _wrap(family, cls.__call__)
        counts.setdefault(name, 0)
        for module in model.modules() if model is not None else ():
            if isinstance(getattr(module, "processor", None), cls) and module not in _prepared:
                for norm in _norms(module, family):
                    _patch_norm_class(type(norm))
                module.__dict__[_MARK] = True
                _prepared.add(module)
                counts[name] += 1
    if model is None:
        for cls in _rms_classes():
            _patch_norm_class(cls)
        _lazy = True
    modules = _census(modules, left)  # what the patch reaches: the same with or without a model
    if model is None:
        return Report(counts, helpers, left, modules)
    return _found_in(model, counts, helpers, left, modules)


def _found_in(model: torch.nn.Module, counts, helpers, left, modules) -> Report:
    """patch(model)'s report: the families whose processors the model's attention modules hold, the
    helpers bound in the modules that define the model, its attention modules and their processors
    (where its rotations are called), and what was left among those (the patch itself covers every
    model: the other entries are not this model's). `.modules` stays the whole reach."""
    attns = [m for m in model.modules() if getattr(m, "processor", None) is not None]
    procs = {type(m.processor) for m in attns}
    hosts = {type(model).__module__} | {cls.__module__ for cls in procs} | {type(m).__module__ for m in attns}
    bound = {_qualname(fn) for name in hosts if name in sys.modules for _, fn in _helpers(sys.modules[name])}
    families = {name for name, _, cls in _processor_classes() if cls in procs}
    mine = bound | hosts | {_qualname(cls) for cls in procs}
    return Report(
        {f: n for f, n in counts.items() if f in families},
        {h: form for h, form in helpers.items() if h in bound},
        {what: why for what, why in left.items() if what in mine},
        modules,
    )


def unpatch() -> seams.Restored:
    """Undo every patch: helpers, processor classes and norm classes as they were. Returns
    {family or module: [names restored]} (the shape of ropekit.hf.unpatch()): a processor's
    `Class.__call__` under its family, a norm's `Class.forward` and a helper binding's attribute
    under their module."""
    global _lazy
    restored = _swaps.restore()
    family_of = {cls: name for name, _, cls in _processor_classes()}
    for cls, call in _originals.items():
        cls.__call__ = call
        seams.add_restored(restored, family_of.get(cls, cls.__module__), f"{cls.__qualname__}.__call__")
    _originals.clear()
    for cls, forward in _norm_forwards.items():
        cls.forward = forward
        seams.add_restored(restored, cls.__module__, f"{cls.__qualname__}.forward")
    _norm_forwards.clear()
    for attn in list(_prepared):
        attn.__dict__.pop(_MARK, None)
    _prepared.clear()
    _lazy = False
    return restored
