"""Hugging Face transformers drop-ins: HF's rotary functions, computed by ropekit's kernel.

Each function takes exactly what the HF modeling code passes and returns what HF returns (same
shapes, dtypes and semantics), so it can replace HF's function in a modeling module:

    apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)
        Llama, Mistral, Qwen2/3, Qwen2-VL/2.5-VL (5.x), Gemma, Phi-3, GPT-NeoX, Qwen3-Next, ... .
        Partial rotary as Phi-3 / GPT-NeoX / Qwen3-Next do it: when cos is narrower than the head,
        the first cos.shape[-1] dims are rotated (half-split) and the rest pass through.
    glm_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)
        GLM / GLM-4: pairs (2i, 2i+1) of the first cos.shape[-1] dims, rotated by frequency i.
    olmo_apply_rotary_pos_emb(...)      OLMo 1/2/3: like Llama, output cast to the input dtypes.
    cohere_apply_rotary_pos_emb(...)    Cohere 1/2: pairs, cos laid out [f0, f0, f1, f1, ...].
    apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)
        DeepSeek-V3: reads interleaved pairs, writes the half-split layout.
    apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1)
        Qwen2-VL / Qwen2.5-VL in transformers 4.x: cos is (3, B, S, D), sections in frequencies.
    llama4_apply_rotary_emb(xq, xk, freqs_cis)
        Llama 4 text: complex freqs_cis (B, S, D/2), q/k (B, S, H, D), pairs (2i, 2i+1).

`patch()` swaps these into transformers' modeling modules; `unpatch()` restores HF's functions.

How a call maps onto ropekit: HF's q/k are (B, H, S, D) views (unsqueeze_dim=1) of projections
laid out (B, S, H, D); ropekit gets `q.transpose(1, 2)`, a view, and its output is transposed back
(a view again: for full rotary these are the strides HF's own elementwise math gives; HF's partial
rotary returns a contiguous cat, a layout no caller relies on). HF's cos/sin are (B, S, D) with
duplicated halves [f, f] (they are built as `cat(freqs, freqs)`); ropekit reads the view
`cos[..., :D//2]`, so nothing is copied. The math runs in float32 and is rounded once to the
output dtype (HF's bf16/fp16 math rounds after every op, so low-precision results differ from HF's
by HF's own rounding error; in float32 they agree to float32 accuracy).

Autograd: q and k get gradients through ropekit's op (backward = the inverse rotation). ropekit
treats the angles as constants, so when cos/sin (or freqs_cis) require grad, the call falls back
to HF's math in PyTorch, as it does for anything the kernel does not take: float64 tensors, dtype
mixes where HF's type promotion would give a wider output than q, shapes other than the 4-D
layouts above, a non-unit last stride, or inputs HF itself would reject (the fallback then raises
HF's error). The fallback is HF's formula written out here, not a call into transformers.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import warnings
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch

from . import hf_census, hf_forms, hf_qkv
from .hf_qkv import QKVFusion

__all__ = [
    "apply_rotary_pos_emb",
    "glm_apply_rotary_pos_emb",
    "olmo_apply_rotary_pos_emb",
    "cohere_apply_rotary_pos_emb",
    "apply_rotary_pos_emb_interleave",
    "apply_multimodal_rotary_pos_emb",
    "llama4_apply_rotary_emb",
    "patch",
    "unpatch",
    "patched",
    "fuse_qkv",
    "unfuse_qkv",
    "QKVFusion",
    "FAMILIES",
    "PatchReport",
    "RotaryLeftWarning",
]

# ---------------------------------------------------------------------------------------------
# HF's math, written out: the fallback for inputs the kernel does not take


def _neg_half_swap(x):
    """[x1, x2] -> [-x2, x1] over the last dim (HF's rotate_half)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _neg_pair_swap(x):
    """pairs (a, b) -> (-b, a) over the last dim (GLM's / Cohere's rotate_half)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotate_prefix(q, k, cos, sin, swap):
    """HF's formula on the first cos.shape[-1] dims, the rest passed through (partial rotary)."""
    r = cos.shape[-1]

    def one(x):
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat((xr * cos + swap(xr) * sin, xp), dim=-1)

    return one(q), one(k)


def _math_half(q, k, cos, sin, ud):
    return _rotate_prefix(q, k, cos.unsqueeze(ud), sin.unsqueeze(ud), _neg_half_swap)


def _math_glm(q, k, cos, sin, ud):
    cos, sin = cos.unsqueeze(ud), sin.unsqueeze(ud)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    return _rotate_prefix(q, k, cos, sin, _neg_pair_swap)


def _math_olmo(q, k, cos, sin, ud):
    qo, ko = _math_half(q, k, cos, sin, ud)
    return qo.to(q.dtype), ko.to(k.dtype)


def _math_cohere(q, k, cos, sin, ud):
    dtype = q.dtype
    cos, sin = cos.unsqueeze(ud), sin.unsqueeze(ud)
    qf, kf = q.float(), k.float()
    qo = qf * cos + _neg_pair_swap(qf) * sin
    ko = kf * cos + _neg_pair_swap(kf) * sin
    return qo.to(dtype), ko.to(dtype)


def _math_deepseek(q, k, cos, sin, ud):
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(ud)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(ud)

    def one(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return one(q), one(k)


def _mrope_select(t, mrope_section):
    """(3, ..., D) -> (..., D): chunk j of the doubled sections comes from row j % 3."""
    chunks = t.split(list(mrope_section) * 2, dim=-1)
    return torch.cat([c[j % 3] for j, c in enumerate(chunks)], dim=-1)


def _math_mrope(q, k, cos, sin, mrope_section, ud):
    cos = _mrope_select(cos, mrope_section).unsqueeze(ud)
    sin = _mrope_select(sin, mrope_section).unsqueeze(ud)
    return q * cos + _neg_half_swap(q) * sin, k * cos + _neg_half_swap(k) * sin


def _math_llama4(xq, xk, freqs_cis):
    f = freqs_cis[:, :, None, :]

    def one(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * f).flatten(3).type_as(x)

    return one(xq), one(xk)


def _rotate_halves_table(q, k, cos, sin, ud, *, promote_to_q, need_full, interleaved, out_interleaved, math):
    """The drop-ins that rotate by cos[..., :R/2] / sin[..., :R/2] of HF's (B or 1, S, R) tables:
    HF's own math when the kernel cannot reproduce it, else ropekit (the tables passed unsliced)."""
    plan = hf_forms.plain_plan(q, k, cos, sin, ud, promote_to_q=promote_to_q, need_full=need_full)
    if plan is None:
        return math(q, k, cos, sin, ud)
    hd, r = plan
    return hf_forms.rotate_hf_layout(
        q, k, cos, sin, hd, interleaved=interleaved, out_interleaved=out_interleaved, columns=r // 2
    )


# ---------------------------------------------------------------------------------------------
# the drop-ins


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF's Llama-family `apply_rotary_pos_emb`, partial rotary included (Phi-3, GPT-NeoX, ...).

    q: (B, Hq, S, D), k: (B, Hk, S, Dk) (unsqueeze_dim=1) or (B, S, H, D) (unsqueeze_dim=2), any
    strides with a unit last stride; cos, sin: (B or 1, S, R) with halves [f, f], R <= D even.
    Rotates dims [0, R) half-split by frequencies cos[..., :R//2], passes dims [R, D) through.
    position_ids is ignored (as in transformers 4.x; 5.x removed it). Returns (q_embed, k_embed).
    """
    return _rotate_halves_table(
        q,
        k,
        cos,
        sin,
        hf_forms.unsqueeze_dim(position_ids, unsqueeze_dim),
        promote_to_q=True,
        need_full=False,
        interleaved=False,
        out_interleaved=False,
        math=_math_half,
    )


def olmo_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF's OLMo / OLMo-2 / OLMo-3 `apply_rotary_pos_emb`: Llama's, outputs cast to q's / k's dtype
    (OLMo-2 passes float32 cos/sin with bf16 q/k)."""
    return _rotate_halves_table(
        q,
        k,
        cos,
        sin,
        hf_forms.unsqueeze_dim(position_ids, unsqueeze_dim),
        promote_to_q=False,
        need_full=True,
        interleaved=False,
        out_interleaved=False,
        math=_math_olmo,
    )


def glm_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF's GLM / GLM-4 `apply_rotary_pos_emb`: interleaved partial rotary.

    cos, sin: (B or 1, S, R) halves [f, f] (only the first half is read, as HF does). Pairs
    (2i, 2i+1) of dims [0, R) are rotated by frequency i; dims [R, D) pass through.
    """
    return _rotate_halves_table(
        q,
        k,
        cos,
        sin,
        hf_forms.unsqueeze_dim(position_ids, unsqueeze_dim),
        promote_to_q=True,
        need_full=False,
        interleaved=True,
        out_interleaved=True,
        math=_math_glm,
    )


def cohere_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF's Cohere / Cohere2 `apply_rotary_pos_emb`: pairs (2i, 2i+1) over the whole head, with
    cos/sin laid out [f0, f0, f1, f1, ...] (read through the stride-2 view cos[..., 0::2]);
    math in float32, outputs in q's dtype."""
    ud = hf_forms.unsqueeze_dim(position_ids, unsqueeze_dim)
    plan = hf_forms.plain_plan(q, k, cos, sin, ud, promote_to_q=False, need_full=True)
    if plan is None or k.dtype != q.dtype:
        return _math_cohere(q, k, cos, sin, ud)
    hd, _ = plan
    half = cos.shape[-1] // 2  # the stride-2 views hold every frequency once: read them all
    return hf_forms.rotate_hf_layout(q, k, cos[..., 0::2], sin[..., 0::2], hd, interleaved=True, columns=half)


def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF's DeepSeek-V3 `apply_rotary_pos_emb_interleave`.

    q, k: (B, H, S, R) rope parts (MLA: slices of wider heads are fine); cos, sin: (B or 1, S, R)
    halves [f, f]. Pairs (2i, 2i+1) of the input are rotated by frequency i and written half-split:
    out[..., i] and out[..., i + R/2].
    """
    return _rotate_halves_table(
        q,
        k,
        cos,
        sin,
        hf_forms.unsqueeze_dim(position_ids, unsqueeze_dim),
        promote_to_q=True,
        need_full=True,
        interleaved=True,
        out_interleaved=False,
        math=_math_deepseek,
    )


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """HF 4.x Qwen2-VL / Qwen2.5-VL `apply_multimodal_rotary_pos_emb`.

    cos, sin: (3, B or 1, S, D) rows for temporal / height / width positions, halves [f, f];
    mrope_section: (t, h, w) frequencies per row, t + h + w = D // 2. Frequencies [0, t) take row 0,
    [t, t+h) row 1, the rest row 2; the rotation itself is Llama's over the whole head.
    (transformers 5.x merges the sections inside the rotary embedding and calls the plain
    `apply_rotary_pos_emb`; both are supported.)
    """
    ok = hf_forms.kernel_takes(q, k, (cos, sin), promote_to_q=True) and cos.dim() == 4 and cos.shape[0] == 3
    hd = hf_forms.heads_dim(unsqueeze_dim) if ok else None
    sections = None
    if hd is not None:
        try:
            sections = tuple(int(s) for s in mrope_section)
        except TypeError:
            sections = None
    if sections is not None:
        r = cos.shape[-1]
        qt, kt = hf_forms.tokens_first(q, hd), hf_forms.tokens_first(k, hd)
        tokens = tuple(qt.shape[:2])
        if not (
            len(sections) == 3
            and min(sections) >= 0
            and r % 2 == 0
            and sum(sections) == r // 2
            and q.shape[-1] == r
            and k.shape[-1] == r
            and tuple(kt.shape[:2]) == tokens
            and hf_forms.fits(tuple(cos.shape[1:3]), tokens)
        ):
            sections = None
    if sections is None:
        return _math_mrope(q, k, cos, sin, mrope_section, unsqueeze_dim)
    half = cos.shape[-1] // 2
    return hf_forms.rotate_hf_layout(q, k, cos, sin, hd, interleaved=False, mrope_section=sections, columns=half)


def llama4_apply_rotary_emb(xq, xk, freqs_cis):
    """HF's Llama 4 (text) `apply_rotary_emb`.

    xq: (B, S, Hq, D), xk: (B, S, Hk, D); freqs_cis: complex64 (B or 1, S, D/2). Pairs (2i, 2i+1)
    are multiplied by freqs_cis[..., i]; math in float32, outputs in the input dtypes. cos and sin
    are the real and imaginary parts, read in place through `view_as_real` (column stride 2).
    """
    out = hf_forms.run(hf_forms.FORM["llama4"], xq, xk, freqs_cis, None)
    return _math_llama4(xq, xk, freqs_cis) if out is None else out


# ---------------------------------------------------------------------------------------------
# patching transformers' modeling modules

_LLAMA = {"apply_rotary_pos_emb": apply_rotary_pos_emb}
_QWEN_VL = {
    "apply_rotary_pos_emb": apply_rotary_pos_emb,
    "apply_multimodal_rotary_pos_emb": apply_multimodal_rotary_pos_emb,
}  # 4.x has the latter

# family (transformers.models.<family>.modeling_<family>) -> {module attribute: ropekit drop-in}.
# Each entry was checked against that family's HF function (tests/integrations/test_hf.py compares every one).
FAMILIES: Dict[str, Dict[str, object]] = {
    # Llama's rotate_half formula (full, or partial by the width of cos)
    **{
        name: _LLAMA
        for name in (
            "llama",
            "mistral",
            "mixtral",
            "ministral",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_moe",
            "qwen3_next",
            "qwen3_vl",
            "qwen3_vl_moe",
            "phi3",
            "phi",
            "gpt_neox",
            "stablelm",
            "persimmon",
            "gemma",
            "gemma2",
            "gemma3",
            "granite",
            "granitemoe",
            "starcoder2",
            "smollm3",
            "glm4_moe",
        )
    },
    "qwen2_vl": _QWEN_VL,
    "qwen2_5_vl": _QWEN_VL,
    "deepseek_v3": {
        "apply_rotary_pos_emb": apply_rotary_pos_emb,
        "apply_rotary_pos_emb_interleave": apply_rotary_pos_emb_interleave,
    },
    "glm": {"apply_rotary_pos_emb": glm_apply_rotary_pos_emb},
    "glm4": {"apply_rotary_pos_emb": glm_apply_rotary_pos_emb},
    "olmo": {"apply_rotary_pos_emb": olmo_apply_rotary_pos_emb},
    "olmo2": {"apply_rotary_pos_emb": olmo_apply_rotary_pos_emb},
    "olmo3": {"apply_rotary_pos_emb": olmo_apply_rotary_pos_emb},
    "cohere": {"apply_rotary_pos_emb": cohere_apply_rotary_pos_emb},
    "cohere2": {"apply_rotary_pos_emb": cohere_apply_rotary_pos_emb},
    "llama4": {"apply_rotary_emb": llama4_apply_rotary_emb},
}

# (module name, attribute) -> HF's original object, recorded the first time it is replaced
_ORIGINALS: Dict[Tuple[str, str], object] = {}
# the keys of _ORIGINALS that only a fuse_qk_norm=True call asked for (unpatch(fuse_qk_norm=True) restores them)
_FUSE_ONLY: set = set()


# hf_census.rounding's verdict -> PatchReport.rounding's word
_ROUNDING_NAMES = {True: "eager", False: "once", None: "neither"}


class PatchReport(dict):
    """{family: [names replaced]} (a dict, as before), plus:

    left: {family: {name: reason}} for the rotary functions left as HF's;
    forms: {family: {name: form}} the form (ropekit.integrations.hf_forms.FORMS) each replacement computes;
    routes: {family: {name: route}} how the module bound each replaced function: hf_census.FUNCTION
        (the plain function) or hf_census.HUB_FUNC (a kernels hub Func module wrapping it); either
        way the module attribute now holds ropekit's function;
    unfused: {family: reason} with fuse_qk_norm=True and a model, the families whose q/k norm is not fused;
    unreached: {family: {name: reason}} with a model, the left functions that the model's own modules
        call (the ones patch warned about);
    rounding: {family: {name: "eager" | "once" | "neither"}} with hf_rounding=True, how each replaced
        function rounds to reproduce HF's bits (hf_census.rounding).
    Names are the module attribute, prefixed `modeling_x.` when the family's folder has several modules.
    """

    def __init__(self):
        super().__init__()
        self.left: Dict[str, Dict[str, str]] = {}
        self.forms: Dict[str, Dict[str, str]] = {}
        self.routes: Dict[str, Dict[str, str]] = {}
        self.unfused: Dict[str, str] = {}
        self.unreached: Dict[str, Dict[str, str]] = {}
        self.rounding: Dict[str, Dict[str, str]] = {}

    def __repr__(self):
        left = sum(len(v) for v in self.left.values())
        return f"PatchReport({dict.__repr__(self)}, left: {left} functions in {len(self.left)} families)"


class _Swap(NamedTuple):
    """One rotary function of one modeling module, decided before anything is swapped."""

    entry: hf_census.Entry
    name: str
    label: str
    module: object  # the imported module, or why it could not be imported
    bound: object  # what the module binds now (HF's function, its hub Func module, or ropekit's replacement)
    function: object  # HF's function (unwrapped)
    route: str
    form: object  # an hf_forms.Form, or the reason the function is left


def _module_name(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"ropekit.hf.patch: model: expected a torch.nn.Module (a transformers model) or None, "
            f"got {type(model).__name__}"
        )


def _check_families(families) -> List[str]:
    if isinstance(families, str):
        families = [families]
    families = list(families)
    installed = {e.family for e in hf_census.scan()}
    unknown = [f for f in families if f not in installed and f not in FAMILIES]
    if unknown:
        raise ValueError(
            f"ropekit.hf.patch: families: expected families of transformers with a rotary function "
            f"(e.g. {sorted(installed)[:6]}), got unknown {unknown}"
        )
    return families


def _decide(found) -> List[_Swap]:
    """Every rotary function of the found entries, with its form or the reason it is left."""
    swaps = []
    for entry in found:
        module = hf_census.load(entry)
        bound = {} if isinstance(module, str) else _hf_bindings(entry, module)
        functions = {n: hf_census.unwrap(b) for n, b in bound.items()}
        originals = {n: fr[0] for n, fr in functions.items()}
        for name in entry.names:
            label = hf_census.label(entry, name)
            if isinstance(module, str):
                swaps.append(_Swap(entry, name, label, module, None, None, hf_census.FUNCTION, module))
                continue
            function, route = functions[name]
            form = hf_census.verdict(entry.module, function)
            if isinstance(form, str):
                if route == hf_census.HUB_FUNC and function is bound[name]:
                    form = f"bound as a kernels hub Func module whose wrapped function ropekit cannot find ({form})"
                form = hf_census.left_reason(entry, form, function, originals)
            swaps.append(_Swap(entry, name, label, module, bound[name], function, route, form))
    return swaps


def _unreached(model, swaps: List[_Swap]) -> Dict[str, Dict[str, str]]:
    """{family: {label: reason}}: the left functions that a class of the model's modules reads as a
    global in one of its methods, and whose rotations do not run ropekit's kernel through another
    replaced function (hf_census.left_reason says so)."""
    called: Dict[str, set] = {}
    for cls in {type(m) for m in model.modules()}:
        for attr in vars(cls).values():
            fn = inspect.unwrap(attr) if callable(attr) else None
            called.setdefault(cls.__module__, set()).update(hf_census.global_names(getattr(fn, "__code__", None)))
    out: Dict[str, Dict[str, str]] = {}
    for s in swaps:
        if isinstance(s.form, str) and s.name in called.get(s.entry.module, ()) and hf_census.THROUGH not in s.form:
            out.setdefault(s.entry.family, {})[s.label] = s.form
    return out


def patch(
    model=None,
    families: Optional[Iterable[str]] = None,
    *,
    fuse_qk_norm: bool = False,
    strict: bool = False,
    hf_rounding: bool = False,
) -> PatchReport:
    """Swap HF's rotary functions for ropekit's in transformers' modeling modules.

    model=None, families=None: every modeling module of the installed transformers that defines a
    rotary function (found by scanning the sources; only those modules are imported).
    families: only these folders of transformers.models (an unknown name raises ValueError; a
    family of `FAMILIES` that the installed transformers lacks raises ImportError). model: the
    modules its submodules come from (intersected with `families` when both are given).

    Each function is classified by what it computes (hf_census: HF's function and ropekit's forms
    run on the same small random inputs); a match is replaced by a function with the same
    parameters that runs ropekit's kernel and calls HF's function for inputs outside the form. A
    function that matches no form is left as it is, with the reason in the report's `.left`.
    transformers binds a rotary function as the plain function or, with the `kernels` package
    (transformers >= 5.25 always has it), as a hub `Func` module wrapping it: either way the
    module attribute is replaced (attention forwards look it up at call time, so models already
    built are affected too) and `.routes` says which binding it was. Patching twice with the same arguments is a no-op;
    `unpatch()` restores what the modules bound.

    Never silent: with a model, a left function that the model's own modules call is named in a
    warning with its reason (and in `.unreached`); strict=True raises ValueError instead, before
    anything is swapped. Without a model, strict=True raises when any function in scope is left.

    fuse_qk_norm: also fuse q/k RMSNorm into the rotation (ropekit.integrations.hf_qknorm). With a
    model or families, a family without q/k norm is not silently skipped: ValueError when none of
    them has one (nothing patched), a warning naming those without when some have. Without both,
    it fuses every family that can be.

    hf_rounding: each replaced function rounds as HF's own does, so a patched model computes the
    unpatched model's rotations bit for bit: eager PyTorch's roundings in the inputs' dtype where
    HF's function rotates op by op in it (`q * cos + rotate_half(q) * sin`: Llama and most
    families; ropekit's `eager_rounding`), ropekit's one rounding where HF's computes in float32
    and casts once. Which one is found per function on a bfloat16 probe and said in `.rounding`
    ("eager", "once", or "neither": no bit-for-bit match found, ropekit's rounding kept, within
    HF's bf16 error as always). Off (the default), every replacement rounds once from float32:
    closer to the exact rotation than eager bf16 math, so bf16 outputs differ from HF's in the last
    bit of some elements. Not with fuse_qk_norm (the fused norm's roundings are not HF's).

    Returns a PatchReport: {family: [names replaced]}, `.left`, `.forms`, `.routes`, `.unreached`,
    `.rounding`.

    Example::

        model = transformers.AutoModelForCausalLM.from_config(config)
        report = ropekit.hf.patch(model)   # e.g. {'llama': ['apply_rotary_pos_emb']}
        report.routes                      # {'llama': {'apply_rotary_pos_emb': 'kernels hub Func module'}}
    """
    if type(hf_rounding) is not bool:
        raise TypeError(f"ropekit.hf.patch: hf_rounding: expected a bool, got {type(hf_rounding).__name__}")
    if hf_rounding and fuse_qk_norm:
        raise ValueError(
            "ropekit.hf.patch: hf_rounding: expected False with fuse_qk_norm=True (the fused norm's roundings "
            "are not HF's), got True"
        )
    explicit = families is not None
    wanted = _check_families(families) if explicit else None
    if model is not None:
        _check_model(model)
    found = hf_census.entries(model, wanted)
    if model is not None and not hf_census.entries(model):
        kinds = sorted({type(m).__module__ for m in model.modules()})[:8]
        raise ValueError(
            f"ropekit.hf.patch: model: expected a transformers model whose modeling module defines a "
            f"rotary function, got modules from {kinds}"
        )
    if explicit:
        missing = [f for f in wanted if f not in {e.family for e in hf_census.scan()}]
        if missing:
            raise ImportError(
                f"ropekit.hf.patch: families: the installed transformers has no modeling module for {missing}"
            )
    names = list(dict.fromkeys(e.family for e in found))
    swaps = _decide(found)
    unreached = _unreached(model, swaps) if model is not None else {}
    if strict:
        refused = unreached if model is not None else _left_of(swaps)
        if refused:
            raise ValueError(
                f"ropekit.hf.patch: strict: expected every rotary function {'the model calls ' if model is not None else ''}"
                f"to be replaced, got these left as HF's: {_listing(refused)}"
            )
    from . import hf_qknorm

    fused = sorted(set(hf_qknorm.fused_families()) & set(names))
    if hf_rounding and fused:
        raise ValueError(
            f"ropekit.hf.patch: hf_rounding: expected False while the q/k norms of {fused} are fused (their "
            "roundings are not HF's; unpatch(fuse_qk_norm=True) first), got True"
        )
    specs: Dict[str, object] = {}
    unfused: Dict[str, str] = {}
    if fuse_qk_norm and model is not None:  # beyond the hand-written rows: found in the model, verified
        from . import hf_qknorm_detect

        for entry in found:
            if entry.family not in hf_qknorm.FAMILIES and entry.module == _module_name(entry.family):
                row = hf_qknorm_detect.detect(model, entry.family, entry.module)
                if isinstance(row, str):
                    unfused[entry.family] = row
                else:
                    specs[entry.family] = row
    if fuse_qk_norm and (explicit or model is not None):
        _check_fusable(names, set(hf_qknorm.FAMILIES) | set(specs))

    if fuse_qk_norm:
        hf_qknorm.unpatch(names)  # re-applied below, around the functions swapped now
    report = PatchReport()
    report.unfused.update(unfused)
    report.unreached.update(unreached)
    for s in swaps:
        if isinstance(s.form, str):
            report.left.setdefault(s.entry.family, {})[s.label] = s.form
            continue
        key = (s.entry.module, s.name)
        eager = False
        if hf_rounding:
            found = hf_census.rounding(s.form, s.function)
            report.rounding.setdefault(s.entry.family, {})[s.label] = _ROUNDING_NAMES[found]
            eager = bool(found)
        names_ = hf_forms.signature_of(s.function)
        if key not in _ORIGINALS:
            _ORIGINALS[key] = s.bound
            setattr(s.module, s.name, hf_forms.replacement(s.function, s.form, names_, bound=s.bound, eager=eager))
            if fuse_qk_norm:
                _FUSE_ONLY.add(key)
        elif getattr(getattr(s.module, s.name), "ropekit_eager", eager) != eager:
            # patched before with the other rounding: replaced again (unpatch restores the same original)
            setattr(s.module, s.name, hf_forms.replacement(s.function, s.form, names_, bound=s.bound, eager=eager))
        elif not fuse_qk_norm:
            _FUSE_ONLY.discard(key)  # asked for by a plain patch too: unpatch(fuse_qk_norm=True) keeps it
        _add_names(report, s.entry.family, [s.label])
        report.forms.setdefault(s.entry.family, {})[s.label] = s.form.name
        report.routes.setdefault(s.entry.family, {})[s.label] = s.route
    if fuse_qk_norm:
        for family, swapped in hf_qknorm.patch([f for f in names if f in report], specs).items():
            _add_names(report, family, swapped)
    if unreached:
        warnings.warn(
            f"ropekit.hf.patch: model: these rotary functions the model calls are left as HF's (HF's math runs "
            f"there): {_listing(unreached)}; patch(model, strict=True) raises instead",
            RotaryLeftWarning,
            stacklevel=2,
        )
    return report


class RotaryLeftWarning(UserWarning):
    """ropekit.hf.patch left a rotary function that the model calls (HF's math runs there)."""


def _left_of(swaps: List[_Swap]) -> Dict[str, Dict[str, str]]:
    out: Dict[str, Dict[str, str]] = {}
    for s in swaps:
        if isinstance(s.form, str):
            out.setdefault(s.entry.family, {})[s.label] = s.form
    return out


def _listing(left: Dict[str, Dict[str, str]]) -> str:
    return "; ".join(
        f"{family}.{label} ({reason})" for family, names in left.items() for label, reason in names.items()
    )


def _hf_bindings(entry, module) -> Dict[str, object]:
    """{name: what the module bound before ropekit}: the one recorded when an earlier call replaced it."""
    return {name: _ORIGINALS.get((entry.module, name), getattr(module, name, None)) for name in entry.names}


def _add_names(report: Dict[str, List[str]], family: str, names) -> None:
    """Append names to report[family], each once (the fusion swaps the rotary function again)."""
    listed = report.setdefault(family, [])
    listed.extend(n for n in names if n not in listed)


def _check_fusable(names, fusable) -> None:
    """fuse_qk_norm asked for named families or a model: refuse when none of them has q/k norm,
    warn naming those that have none."""
    without = [f for f in names if f not in fusable]
    if names and len(without) == len(names):
        raise ValueError(
            f"ropekit.hf.patch: fuse_qk_norm: expected families with q/k RMSNorm "
            f"({', '.join(sorted(fusable))}), got {without} (no q/k norm to fuse: "
            "patch without fuse_qk_norm)"
        )
    if without:
        warnings.warn(
            f"ropekit.hf.patch: fuse_qk_norm: {without} have no q/k RMSNorm; only their rotary functions are patched",
            stacklevel=3,
        )


def _restore(keys) -> Dict[str, List[str]]:
    restored: Dict[str, List[str]] = {}
    for mod_name, attr in keys:
        setattr(importlib.import_module(mod_name), attr, _ORIGINALS.pop((mod_name, attr)))
        _FUSE_ONLY.discard((mod_name, attr))
        _add_names(restored, mod_name.split(".")[2], [attr])
    return restored


def unpatch(families: Optional[Iterable[str]] = None, *, fuse_qk_norm: bool = False) -> Dict[str, List[str]]:
    """Undo `patch()` (all of it, or what it did to `families`). Returns {family: [names that are
    HF's again]}, each name once. fuse_qk_norm=True undoes what the fuse_qk_norm=True calls did:
    the fusion (HF's norm and attention forwards come back) and the rotary functions that only
    those calls replaced; a rotary function that a plain `patch` call asked for stays ropekit's."""
    wanted = None if families is None else set(_check_families(families))
    from . import hf_qknorm

    def chosen(key) -> bool:
        return wanted is None or key[0].split(".")[2] in wanted

    restored: Dict[str, List[str]] = {}
    for family, names in hf_qknorm.unpatch(wanted).items():
        module = importlib.import_module(_module_name(family))
        # the fused rotary function gives way to the replacement it wrapped: that one is not HF's
        _add_names(restored, family, [n for n in names if "." in n or not hasattr(getattr(module, n), "ropekit_form")])
    keys = [key for key in _ORIGINALS if chosen(key) and (not fuse_qk_norm or key in _FUSE_ONLY)]
    for family, names in _restore(keys).items():
        _add_names(restored, family, names)
    return {family: names for family, names in restored.items() if names}


def fuse_qkv(model, *, impl: str = "auto", strict: bool = False) -> QKVFusion:
    """Run each fitting attention layer's q/k/v projections, q/k RMSNorm and RoPE as one
    ropekit.rope_qkv_projection call.

    Args:
        model: a transformers model (a torch.nn.Module) whose weights are loaded. Only this model's
            modules change (their classes become fused subclasses); other models of the same
            family are untouched.
        impl: rope_qkv_projection's impl for every fused call: "auto" (its AUTO_TABLE: cuBLAS +
            ropekit unless the fused GEMM was measured faster for the shape), "fused" (the Triton
            GEMM whose epilogue normalizes and rotates: CUDA), "unfused".
        strict: raise ValueError, before anything changes, when an attention layer with a rotary
            embedding does not fit; otherwise such layers keep HF's code and a warning names them.

    A layer fits when its q_proj / k_proj / v_proj are bias-free torch.nn.Linear of one input size
    and dtype, its forward calls them on the hidden states, then only views and the q / k norms,
    then the modeling module's apply_rotary_pos_emb, which computes the half-split rotation
    (checked numerically), and its q_norm / k_norm (if any) are per-head RMSNorms
    `y * rsqrt(mean(y^2) + eps) * w` of one eps (checked numerically). A call takes HF's
    own prologue (the same numbers unpatched HF gives) when its hidden states' dtype differs from
    the weights' (autocast included) or HF's cos / sin are not (B or 1, S, head_dim) constants.

    Numerics: float32 math and one rounding to the model's dtype (HF rounds after the projection,
    the norm and each rotation op): float32 models agree with HF to float32 accuracy, bf16 ones
    within HF's bf16 error. Autograd: gradients reach x, the three weights and the norm weights.
    Memory: calls without autograd keep one concatenated copy of each fused layer's q/k/v weights
    (rebuilt when a weight changes), the size of those weights.

    Returns QKVFusion(fused=[qualified names], left={qualified name: reason}).

    Example::

        model = transformers.AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-8B", dtype=torch.bfloat16).cuda()
        fusion = ropekit.hf.fuse_qkv(model)   # fusion.fused: ['model.layers.0.self_attn', ...]
        out = model.generate(ids, max_new_tokens=32)
        ropekit.hf.unfuse_qkv(model)          # HF's classes again
    """
    return hf_qkv.fuse(model, impl, strict, _rope_form)


def unfuse_qkv(model) -> List[str]:
    """Undo fuse_qkv on this model: its modules get HF's classes back (and the modeling module its
    apply_rotary_pos_emb once no fused layer of it is left). Returns the qualified names restored.

    Example::

        ropekit.hf.fuse_qkv(model)
        ropekit.hf.unfuse_qkv(model)   # ['model.layers.0.self_attn', ...]
    """
    return hf_qkv.unfuse(model)


def _rope_form(module_name: str) -> str:
    """The form name of what the modeling module's apply_rotary_pos_emb computes, or why it has
    none: past the wrappers (`ropekit_wraps`: fuse_qkv's, the fused norm's), ropekit.hf.patch's
    replacement says its form (`ropekit_form`); HF's function (or its kernels hub module) gets
    hf_census's verdict, on random inputs."""
    module = importlib.import_module(module_name)
    bound = module.apply_rotary_pos_emb
    while getattr(bound, "ropekit_wraps", None) is not None:
        bound = bound.ropekit_wraps
    if isinstance(getattr(bound, "ropekit_form", None), str):
        return bound.ropekit_form
    form = hf_census.verdict(module_name, hf_census.unwrap(bound)[0])
    return form.name if hasattr(form, "name") else str(form)


@contextlib.contextmanager
def patched(
    model=None, families: Optional[Iterable[str]] = None, *, fuse_qk_norm: bool = False, hf_rounding: bool = False
):
    """`with ropekit.hf.patched(model): ...` patches for the block (patch's arguments), then restores
    what it patched."""
    from . import hf_qknorm

    before = set(_ORIGINALS)
    fused_before = set(hf_qknorm.fused_families())
    done = patch(model, families, fuse_qk_norm=fuse_qk_norm, hf_rounding=hf_rounding)
    try:
        yield done
    finally:
        hf_qknorm.unpatch(set(hf_qknorm.fused_families()) - fused_before)
        _restore([key for key in _ORIGINALS if key not in before])
