"""ropekit inside diffusers' image and video transformers: the QK-RMSNorm and the rotary embedding
of their attention processors become ropekit's fused norm + rotation, forward and backward.

    ropekit.diffusers.patch(model=None)   model: a diffusers model (or any nn.Module holding its
                                          attention modules); None patches every model, current
                                          and future. Returns {family: attention modules prepared}.
    ropekit.diffusers.unpatch()           undoes every patch (processors and norms as they were)

Families (FAMILIES, those the installed diffusers has): Flux.1, Wan 2.x, HunyuanVideo, Qwen-Image.
Each processor normalizes q and k (attn.norm_q / norm_k, and norm_added_q / norm_added_k for the
text stream), then rotates them by the rotary embedding the transformer computed once per forward.
The seams used are public: the processor class's `__call__` and the norm modules' `forward`.

- The processor's `__call__` is wrapped: it takes the rotary embedding argument, turns it into
  per-token (cos, sin) views of rotary_dim // 2 columns (no copy) and hands them to the attention
  module's norms, then calls the original processor with the embedding set to None, so the
  processor's own rotation is skipped.
- Each norm's `forward` becomes RMSNorm + rotation in one ropekit launch
  (`ropekit.rotate_with_angles(x, None, cos, sin, interleaved=True, q_norm_weight=norm.weight)`),
  per head ((D,) weights: Flux, HunyuanVideo, Qwen-Image) or across heads ((H * D,): Wan). A norm
  ropekit cannot fuse (no weight, a bias, another norm type, weights of another dtype) runs as it
  was and ropekit rotates its output.

The rotary rows a norm's tokens take are the family's `rows` rule: Flux's image stream holds the
last rows of the joint [text, image] embedding ("tail") and its text stream the first ("head");
HunyuanVideo rotates only the leading latent rows of a [latent, text] sequence ("prefix": the text
rows get the identity rotation). Weights, state_dict keys and module identities do not change.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import weakref
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from ..api.ops import rotate_with_angles
from ..core.validate import fail

OP = "ropekit.diffusers"
_ANGLES = "ropekit_angles"  # per attention module: {group: (cos, sin)} during one processor call


class Family(NamedTuple):
    """How one diffusers transformer family applies its norm and rotary embedding."""

    module: str  # the diffusers module holding the processor classes
    processors: Tuple[str, ...]  # processor classes whose norm + rotation ropekit takes over
    emb_arg: str  # the processor argument carrying the rotary embedding
    angles: Callable  # embedding -> {group: (cos, sin)}, per-token (S, rotary_dim // 2) views
    norms: Dict[str, Tuple[str, str]]  # norm attribute -> (group of angles, rows rule)
    flat_heads: bool  # the norms see (B, S, H * D) (normalized across heads), not (B, S, H, D)


def _repeated_pairs(emb):
    """Flux / HunyuanVideo: (cos, sin), each (S, D) with every frequency repeated at 2i and 2i + 1."""
    cos, sin = emb
    return {"rows": (cos[..., 0::2], sin[..., 0::2])}


def _wan_pairs(emb):
    """Wan: (freqs_cos, freqs_sin), each (1, S, 1, D), frequencies repeated in pairs."""
    cos, sin = emb
    return {"rows": (cos[0, :, 0, 0::2], sin[0, :, 0, 1::2])}


def _complex_parts(freqs_cis):
    parts = torch.view_as_real(freqs_cis)
    return parts[..., 0], parts[..., 1]


def _qwen_streams(emb):
    """Qwen-Image: (image freqs_cis (S_img, D / 2), text freqs_cis (S_txt, D / 2)), complex64."""
    img, txt = emb
    return {"img": _complex_parts(img), "txt": _complex_parts(txt)}


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
    "wan": Family(_TRANSFORMERS + "transformer_wan", ("WanAttnProcessor",), "rotary_emb", _wan_pairs, _JOINT, True),
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
}

_originals: Dict[type, Callable] = {}  # processor class -> its own __call__, while patched
_prepared: "weakref.WeakSet" = weakref.WeakSet()  # attention modules whose norms are replaced
_lazy = False  # patch(None): attention modules are prepared on their first call


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
    """The (cos, sin) rows of n tokens under the family's rows rule (see the module docstring)."""
    cos, sin = angles
    S = cos.shape[0]
    if n == S:
        return cos, sin
    if rule == "tail" and n < S:
        return cos[S - n :], sin[S - n :]
    if rule == "head" and n < S:
        return cos[:n], sin[:n]
    if rule == "prefix" and n > S:
        pad = (n - S, cos.shape[1])
        return torch.cat((cos, cos.new_ones(pad))), torch.cat((sin, sin.new_zeros(pad)))
    fail(OP, "rotary embedding", f"rows for {n} tokens ({rule} rule)", f"{S} rows")


def _norm_classes():
    from diffusers.models.normalization import RMSNorm

    return (torch.nn.RMSNorm, RMSNorm)


def _fusable(norm, x) -> Optional[torch.Tensor]:
    """The norm's weight when ropekit computes the same RMSNorm (x * rsqrt(mean(x^2) + eps) * w over
    the last dim, output in x's dtype), else None."""
    w = getattr(norm, "weight", None)
    if w is None or getattr(norm, "bias", None) is not None or w.dtype != x.dtype or w.dim() != 1:
        return None
    if not isinstance(norm, _norm_classes()) or w.shape[0] != x.shape[-1]:
        return None
    return w


def _eps(norm, x) -> float:
    eps = getattr(norm, "eps", None)
    return torch.finfo(x.dtype).eps if eps is None else float(eps)


def _norm_rope(norm, original, angles, group, rule, heads, x):
    """The replaced norm forward: RMSNorm and rotation of x (B, S, H, D), or (B, S, H * D) with
    heads = H; the original norm alone when no rotary embedding is being applied."""
    a = angles.get(group)
    if a is None:
        return original(x)
    cos, sin = _rows(a, x.shape[1], rule)
    w = _fusable(norm, x)
    y = x if w is not None else original(x)
    y4 = y.unflatten(-1, (heads, -1)) if heads else y
    out, _ = rotate_with_angles(y4, None, cos, sin, interleaved=True, q_norm_weight=w, norm_eps=_eps(norm, x))
    return out.flatten(-2) if heads else out


def _prepare(attn, family: Family) -> None:
    """Replace the attention module's norms' forwards (once) and give it its angles dict."""
    if _ANGLES in attn.__dict__:
        return
    angles: dict = {}
    for name, (group, rule) in family.norms.items():
        norm = getattr(attn, name, None)
        if isinstance(norm, torch.nn.Module):
            heads = attn.heads if family.flat_heads else 0
            original = type(norm).forward.__get__(norm)
            norm.forward = functools.partial(_norm_rope, norm, original, angles, group, rule, heads)
    attn.__dict__[_ANGLES] = angles
    _prepared.add(attn)


def _restore(attn) -> None:
    attn.__dict__.pop(_ANGLES, None)
    for module in attn.children():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func is _norm_rope:
            del module.__dict__["forward"]


# ---------------------------------------------------------------------------------------------
# the processors


def _wrap(family: Family, call: Callable) -> Callable:
    """The processor __call__ that hands the rotary embedding to the norms (signature kept)."""
    index = list(inspect.signature(call).parameters).index(family.emb_arg) - 2  # after self, attn

    @functools.wraps(call)
    def patched(self, attn, *args, **kwargs):
        if _lazy:
            _prepare(attn, family)
        angles = attn.__dict__.get(_ANGLES)
        emb = args[index] if len(args) > index else kwargs.get(family.emb_arg)
        if angles is None or emb is None:
            return call(self, attn, *args, **kwargs)
        if len(args) > index:
            args = (*args[:index], None, *args[index + 1 :])
        else:
            kwargs = {**kwargs, family.emb_arg: None}
        angles.update(family.angles(emb))
        try:
            return call(self, attn, *args, **kwargs)
        finally:
            angles.clear()

    return patched


def patch(model: Optional[torch.nn.Module] = None) -> Dict[str, int]:
    """Route the QK-norm + rotary embedding of the installed diffusers families through ropekit.

    model: patch its attention modules (prepared now: call it before torch.compile), or None:
    every attention module of these families, prepared on its first call. Returns {family name:
    attention modules prepared now} for every family the installed diffusers has.
    """
    global _lazy
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"{OP}: model: expected a torch.nn.Module or None, got {type(model).__name__}")
    counts = {}
    for name, family, cls in _processor_classes():
        if cls not in _originals:
            _originals[cls] = cls.__call__
            cls.__call__ = _wrap(family, cls.__call__)
        counts.setdefault(name, 0)
        for module in model.modules() if model is not None else ():
            if isinstance(getattr(module, "processor", None), cls) and _ANGLES not in module.__dict__:
                _prepare(module, family)
                counts[name] += 1
    _lazy = _lazy or model is None
    return counts


def unpatch() -> None:
    """Undo every patch: processor classes and norm modules as they were."""
    global _lazy
    for cls, call in _originals.items():
        cls.__call__ = call
    _originals.clear()
    for attn in list(_prepared):
        _restore(attn)
    _prepared.clear()
    _lazy = False
