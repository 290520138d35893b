"""Hugging Face: a model's q/k/v projections, q/k RMSNorm and RoPE as one ropekit.rope_qkv_projection
call per attention layer (`ropekit.hf.fuse_qkv(model)`).

The attention forwards this fits keep their code: those that call `self.q_proj(hidden_states)`,
`self.k_proj(...)`, `self.v_proj(...)` (bias-free), then only views and optionally a per-head
`self.q_norm` / `self.k_norm`, then the modeling module's `apply_rotary_pos_emb(q, k, cos, sin)`,
which computes the half-split rotation (Llama, Mistral, Gemma, Granite, Qwen3, Qwen3-MoE, ...).
What changes, per fused layer of this model only:

- the attention module's class becomes a subclass whose forward marks the call (thread-local): its
  hidden states and HF's (cos, sin);
- its three projections become `_FusedLinear` (an nn.Linear): the first of them called with the
  marked hidden states runs the whole prologue, rope_qkv_projection(x, [W_q; W_k; W_v], ...), and
  each returns its part of the answer, already normalized and rotated;
- its q_norm / k_norm modules become subclasses that return those parts unchanged;
- the modeling module's `apply_rotary_pos_emb` is wrapped (once, for every model): given the fused
  q and k of the marked call it returns them; anything else goes to what it wrapped.

Class swaps keep the modules' parameters, names and state_dict, and copy.deepcopy keeps a model
fused; pickling the module objects (torch.save(model)) needs unfuse_qkv first (the fused classes
are made at run time; state_dict is unaffected). After the forward, the call checks that each part
was taken once, the norms skipped and the rotation skipped, in that order: a transformers release
whose attention calls these differently raises RuntimeError instead of returning a result computed
twice or not at all.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
import threading
import warnings
import weakref
from typing import Dict, List, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from ..api.qkv import fused_path, project
from ..core import forms

OP = "ropekit.hf.fuse_qkv"
_IMPLS = ("auto", "fused", "unfused")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class Layout(NamedTuple):
    """What a fused attention layer's prologue needs (plain values: deepcopy and pickling copy it)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    normed: bool  # q_norm and k_norm (per head) applied before the rotation
    eps: float
    impl: str


class QKVFusion(NamedTuple):
    """fuse_qkv's answer: the attention modules fused (qualified names) and those left, with why."""

    fused: List[str]
    left: Dict[str, str]


class _Call:
    """One fused attention call: its inputs, its outputs once computed, and what was taken."""

    def __init__(self, attn, x, cos, sin):
        self.attn, self.x, self.cos, self.sin = attn, x, cos, sin
        self.out = None  # (q, k, v) as rope_qkv_projection returns them
        self.taken = set()  # "q", "k", "v"
        self.normed = set()  # "q", "k": norms skipped
        self.rotated = False


class _State(threading.local):
    def __init__(self):
        self.stack: List[_Call] = []


_STATE = _State()
# modeling module name -> the attention modules fused there (the rope wrapper stays while any lives)
_FUSED: Dict[str, "weakref.WeakSet"] = {}
# (cos, sin, table, positions): the last table built, replaced as one tuple (the layers of one
# forward share HF's cos and sin)
_TABLE: tuple = (None, None, None, None)


def _top() -> Optional[_Call]:
    stack = _STATE.stack
    return stack[-1] if stack else None


# ---------------------------------------------------------------------------------------------
# the swapped classes


class _FusedLinear(torch.nn.Linear):
    """A q/k/v projection of a fused layer: inside its attention's marked call, its part of the fused
    prologue; everywhere else torch.nn.Linear."""

    def forward(self, input):  # noqa: A002 (torch.nn.Linear's parameter name)
        x = input
        call = _top()
        if call is None or x is not call.x:
            return F.linear(x, self.weight, self.bias)
        attn = call.attn
        role = "q" if self is attn.q_proj else "k" if self is attn.k_proj else "v" if self is attn.v_proj else None
        if role is None:
            return F.linear(x, self.weight, self.bias)
        if role in call.taken:
            raise RuntimeError(f"{OP}: {type(attn).__name__} called {role}_proj twice in one forward: {_UNFIT}")
        if call.out is None:
            call.out = _prologue(call)
        call.taken.add(role)
        return call.out["qkv".index(role)].flatten(-2)


_UNFIT = "this transformers version's attention does not fit fuse_qkv (call ropekit.hf.unfuse_qkv(model))"
_NORM_CLASSES: Dict[type, type] = {}
_ATTENTION_CLASSES: Dict[type, type] = {}


def _norm_class(cls: type) -> type:
    """cls's subclass whose forward returns a fused layer's q or k unchanged (normalized already)."""
    sub = _NORM_CLASSES.get(cls)
    if sub is None:

        def forward(self, x, *args, **kwargs):
            call = _top()
            if call is not None and call.out is not None and not args and not kwargs:
                attn = call.attn
                role = "q" if self is attn.q_norm else "k" if self is attn.k_norm else None
                if role is not None and x.data_ptr() == call.out["qk".index(role)].data_ptr():
                    if call.rotated or role in call.normed:
                        raise RuntimeError(
                            f"{OP}: {type(attn).__name__} applied {role}_norm after the rotation or twice: {_UNFIT}"
                        )
                    call.normed.add(role)
                    return x
            return super(sub, self).forward(x, *args, **kwargs)

        sub = _NORM_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "_ropekit_base": cls})
    return sub


def _attention_class(cls: type) -> type:
    """cls's subclass whose forward marks the call for its projections, then checks what they took."""
    sub = _ATTENTION_CLASSES.get(cls)
    if sub is None:

        def forward(self, *args, **kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            pe = args[1] if len(args) > 1 else kwargs.get("position_embeddings")
            layout = self._ropekit_qkv
            if torch.compiler.is_compiling() or not _fits_call(x, pe, self, layout):
                return super(sub, self).forward(*args, **kwargs)  # HF's own prologue, HF's numbers
            _wrap_rope(cls.__module__, self)
            call = _Call(self, x, pe[0], pe[1])
            _STATE.stack.append(call)
            try:
                out = super(sub, self).forward(*args, **kwargs)
            finally:
                _STATE.stack.pop()
            want = {"q", "k"} if layout.normed else set()
            if call.taken != {"q", "k", "v"} or call.normed != want or not call.rotated:
                raise RuntimeError(
                    f"{OP}: {type(self).__name__} took {sorted(call.taken)} of q/k/v, skipped the norms of "
                    f"{sorted(call.normed)} (expected {sorted(want)}) and {'' if call.rotated else 'never '}"
                    f"skipped apply_rotary_pos_emb: {_UNFIT}"
                )
            return out

        sub = _ATTENTION_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "_ropekit_base": cls})
    return sub


def _fits_call(x, pe, attn, layout: Layout) -> bool:
    """Does this call go to the fused prologue? Otherwise HF's prologue runs (the same answer HF
    gives): hidden states (B, S, hidden) of the weights' float dtype and device, HF's (cos, sin)
    (B or 1, S, head_dim) constants on that device, no autocast."""
    if not isinstance(x, torch.Tensor) or not isinstance(pe, (tuple, list)) or len(pe) != 2:
        return False
    cos, sin = pe
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor) or x.dim() != 3:
        return False
    weight = attn.q_proj.weight
    if x.dtype not in _FLOATS or x.dtype != weight.dtype or x.device != weight.device:
        return False
    if torch.is_autocast_enabled(x.device.type):
        return False
    if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[-1] != layout.head_dim or cos.shape[1] != x.shape[1]:
        return False
    if cos.shape[0] not in (1, x.shape[0]) or cos.requires_grad or sin.requires_grad:
        return False
    return cos.dtype in _FLOATS and cos.device == x.device


def _rope_wrapper(previous):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        call = _top()
        if (
            call is not None
            and call.out is not None
            and not call.rotated
            and cos is call.cos
            and sin is call.sin
            and q.data_ptr() == call.out[0].data_ptr()
            and k.data_ptr() == call.out[1].data_ptr()
        ):
            call.rotated = True
            return q, k  # rotated by the fused prologue
        return previous(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.ropekit_wraps = previous  # what it passes other calls to
    apply_rotary_pos_emb.ropekit_fuse_qkv = True
    apply_rotary_pos_emb.__wrapped__ = previous
    return apply_rotary_pos_emb


def _wrap_rope(module_name: str, attn) -> None:
    """The modeling module's apply_rotary_pos_emb wrapped, if it is not (again: another patch, or
    unfuse_qkv of another model, may have bound another function since; a deepcopy of a fused model
    comes here on its first call), and attn counted among the module's fused layers."""
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    bound = module.apply_rotary_pos_emb
    if not getattr(bound, "ropekit_fuse_qkv", False):
        module.apply_rotary_pos_emb = _rope_wrapper(bound)
        _FUSED.setdefault(module_name, weakref.WeakSet()).add(attn)


# ---------------------------------------------------------------------------------------------
# the prologue


def _prologue(call: _Call):
    """(q, k, v) of the marked call: (B, S, H, D) views, q and k normalized and rotated. The op's
    argument checks are the ones fuse_qkv made of the layer (shapes, dtypes, devices of the weights
    and norms) and _fits_call makes of each call (the hidden states, cos and sin); the rest of
    rope_qkv_projection runs as it is (api.qkv.project)."""
    attn, x = call.attn, call.x
    layout: Layout = attn._ropekit_qkv
    table, positions = _table(call.cos, call.sin, x.shape[0])
    qn = attn.q_norm.weight if layout.normed else None
    kn = attn.k_norm.weight if layout.normed else None
    weight = _weight(attn)
    n_q, n_kv, d = layout.num_q_heads, layout.num_kv_heads, layout.head_dim
    fused = fused_path(layout.impl, x, weight, qn, kn, n_q, n_kv, d)
    return project(fused, x, weight, positions, table, qn, kn, (n_q, n_kv, d, d, False, layout.eps))


def _table(cos, sin, batch: int):
    """HF's per-token (B or 1, S, D) cos / sin (rows [f, f]) as a table of one row a token, rows
    [cos | sin] over the first half of the columns, and the (B, S) positions reading it. The layers of
    one forward share HF's tensors, so the table is built once a forward."""
    global _TABLE
    last = _TABLE
    if last[0] is cos and last[1] is sin and last[3].shape[0] == batch:
        return last[2], last[3]
    rows, seq, width = cos.shape
    half = width // 2
    table = torch.cat((cos[..., :half], sin[..., :half]), dim=-1).reshape(rows * seq, width)
    positions = torch.arange(rows * seq, device=cos.device).view(rows, seq).expand(batch, seq)
    forms.known_table(table)  # its rows are [cos | sin] by construction: no read of its values
    _TABLE = (cos, sin, table, positions)
    return table, positions


def _weight(attn) -> torch.Tensor:
    """[W_q; W_k; W_v]: a new concatenation while autograd records (gradients reach each weight),
    else the layer's kept copy, rebuilt when a weight's tensor or version changes."""
    ws = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
        return torch.cat(ws)
    try:
        key = tuple((w.data_ptr(), w._version) for w in ws)
    except RuntimeError:  # inference tensors keep no version: concatenated every call
        return torch.cat(ws)
    kept = attn.__dict__.get("_ropekit_qkv_weight")
    if kept is None or kept[0] != key:
        kept = (key, torch.cat(ws).detach())
        attn.__dict__["_ropekit_qkv_weight"] = kept
    return kept[1]


# ---------------------------------------------------------------------------------------------
# fuse / unfuse


def _fit(attn, rope_form, impl: str) -> Union[Layout, str]:
    """The layer's Layout when this attention module fits, else why it does not."""
    projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if not all(type(p) in (torch.nn.Linear, _FusedLinear) for p in projs):
        return "no separate torch.nn.Linear q_proj / k_proj / v_proj"
    if any(p.bias is not None for p in projs):
        return "q_proj / k_proj / v_proj have a bias (rope_qkv_projection has none)"
    ws = [p.weight for p in projs]
    if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1:
        return "q_proj / k_proj / v_proj differ in input size, dtype or device"
    if ws[0].device.type == "meta":
        return "its weights are on the meta device (load the model first)"
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int) or any(w.shape[0] % head_dim for w in ws) or ws[1].shape != ws[2].shape:
        return "no int head_dim dividing the projections' widths, or k_proj and v_proj of other widths"
    cls = getattr(type(attn), "_ropekit_base", type(attn))
    if not callable(getattr(importlib.import_module(cls.__module__), "apply_rotary_pos_emb", None)):
        return f"{cls.__module__} has no apply_rotary_pos_emb"
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return "its forward's source cannot be read"
    if "apply_rotary_pos_emb(" not in src or not all(
        f"self.{n}(hidden_states)" in src for n in ("q_proj", "k_proj", "v_proj")
    ):
        return "its forward does not call q_proj / k_proj / v_proj(hidden_states), then apply_rotary_pos_emb"
    extra = _calls_between(src)
    if extra:
        return f"its forward calls {', '.join(extra)} between the projections and apply_rotary_pos_emb"
    form = rope_form(cls.__module__)
    if form not in _HALF_SPLIT:
        return f"its apply_rotary_pos_emb is not a half-split rotation ({form})"
    names = ("q_norm", "k_norm")
    normed = any(f"self.{n}(" in src for n in names)
    if normed:
        why = _norm_unfit(attn, head_dim)
        if why is not None:
            return why
    elif any(getattr(attn, n, None) is not None for n in (*names, "qk_norm")):
        return "it has q/k norm modules its forward is not seen to call before the rotation"
    eps = _eps(attn.q_norm) if normed else 1e-6
    return Layout(ws[0].shape[0] // head_dim, ws[1].shape[0] // head_dim, head_dim, normed, eps, impl)


# what an attention forward may call between its projections and apply_rotary_pos_emb: layout views
# and the norms the fused prologue applies (anything else, e.g. OLMo's clip_qkv clamp_, would act on
# q and k already normalized and rotated)
_BETWEEN = frozenset({"view", "reshape", "transpose", "contiguous", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm"})


# hf_census's forms of an apply_rotary_pos_emb that the fused prologue computes: half-split pairs
# over cos's width (per call, only a full-width cos is fused)
_HALF_SPLIT = ("llama", "neox", "olmo")


def _calls_between(src: str) -> List[str]:
    """The names called by the forward's statements from its first projection up to the statement
    that calls apply_rotary_pos_emb, other than _BETWEEN's (sorted; the source parsed, not matched)."""
    body = ast.parse(textwrap.dedent(src)).body[0].body
    names, started = set(), False
    for stmt in body:
        called = [
            n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "?")
            for n in ast.walk(stmt)
            if isinstance(n, ast.Call)
        ]
        started = started or "q_proj" in called or "k_proj" in called or "v_proj" in called
        if not started:
            continue
        if "apply_rotary_pos_emb" in called:
            break
        names.update(called)
    return sorted(names - _BETWEEN)


def _norm_unfit(attn, head_dim: int) -> Optional[str]:
    """Why the layer's q_norm / k_norm are not rope_qkv_projection's per-head RMSNorm, or None."""
    norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
    if not all(isinstance(n, torch.nn.Module) and isinstance(getattr(n, "weight", None), torch.Tensor) for n in norms):
        return "its q_norm / k_norm are not modules with a weight"
    if any(n.weight.shape != (head_dim,) for n in norms):
        return f"its q_norm / k_norm weights are not per head ({head_dim},) (a norm across heads)"
    eps = {_eps(n) for n in norms}
    if None in eps or len(eps) != 1:
        return "its q_norm and k_norm have no eps attribute, or two different ones"
    (e,) = eps
    for n in norms:  # the norm's math, checked on a random input: y * rsqrt(mean(y^2) + eps) * w
        base = getattr(type(n), "_ropekit_base", type(n))
        y = torch.randn(3, head_dim, generator=torch.Generator().manual_seed(0)).to(n.weight.device, n.weight.dtype)
        with torch.no_grad():
            got = base.forward(n, y).double()
            yd = y.double()
            want = yd * torch.rsqrt(yd.pow(2).mean(-1, keepdim=True) + e) * n.weight.double()
        tol = 1e-5 if n.weight.dtype == torch.float32 else 2e-2
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            return f"{type(n).__name__} is not y * rsqrt(mean(y^2) + eps) * weight (a weight offset, or another norm)"
    return None


def _eps(norm) -> Optional[float]:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _candidates(model):
    """(qualified name, module) of the attention modules fuse_qkv considers: the modules of a class
    named *Attention whose modeling module binds apply_rotary_pos_emb."""
    for name, mod in model.named_modules():
        cls = getattr(type(mod), "_ropekit_base", type(mod))
        if cls.__name__.endswith("Attention") and cls.__module__.startswith("transformers.models."):
            module = importlib.import_module(cls.__module__)
            if hasattr(module, "apply_rotary_pos_emb"):
                yield name, mod


def fuse(model, impl: str, strict: bool, rope_form) -> QKVFusion:
    """ropekit.hf.fuse_qkv (its docstring says what it does); rope_form(module name) -> the form
    name of what that modeling module's apply_rotary_pos_emb computes (ropekit.integrations.hf's
    census, which this module does not import)."""
    if impl not in _IMPLS:
        raise ValueError(f"{OP}: impl: expected one of {_IMPLS}, got {impl!r}")
    if type(strict) is not bool:
        raise TypeError(f"{OP}: strict: expected a bool, got {type(strict).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{OP}: model: expected a torch.nn.Module, got {type(model).__name__}")
    fit, left = [], {}
    for name, attn in _candidates(model):
        layout = _fit(attn, rope_form, impl)
        if isinstance(layout, Layout):
            fit.append((name, attn, layout))
        else:
            left[name] = layout
    if not fit and not left:
        raise ValueError(
            f"{OP}: model: expected a transformers model with rotary attention layers, got none in "
            f"{type(model).__name__}"
        )
    if left and strict:
        raise ValueError(f"{OP}: strict: expected every rotary attention layer to fit, got {_listing(left)}")
    for name, attn, layout in fit:
        attn._ropekit_qkv = layout
        attn.__dict__.pop("_ropekit_qkv_weight", None)
        base = getattr(type(attn), "_ropekit_base", type(attn))
        attn.__class__ = _attention_class(base)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.__class__ = _FusedLinear
        if layout.normed:
            for norm in (attn.q_norm, attn.k_norm):
                norm.__class__ = _norm_class(getattr(type(norm), "_ropekit_base", type(norm)))
        _FUSED.setdefault(base.__module__, weakref.WeakSet()).add(attn)
        _wrap_rope(base.__module__, attn)
    if left:
        warnings.warn(f"{OP}: these attention layers keep HF's prologue: {_listing(left)}", stacklevel=2)
    return QKVFusion([name for name, _, _ in fit], left)


def unfuse(model) -> List[str]:
    """ropekit.hf.unfuse_qkv."""
    restored = []
    for name, attn in model.named_modules():
        base = getattr(type(attn), "_ropekit_base", None)
        if base is None or type(attn) is not _ATTENTION_CLASSES.get(base):
            continue
        attn.__class__ = base
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            if type(proj) is _FusedLinear:
                proj.__class__ = torch.nn.Linear
        for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
            if norm is not None and getattr(type(norm), "_ropekit_base", None) is not None:
                norm.__class__ = type(norm)._ropekit_base
        del attn._ropekit_qkv
        attn.__dict__.pop("_ropekit_qkv_weight", None)
        fused = _FUSED.get(base.__module__)
        if fused is not None:
            fused.discard(attn)
            if not len(fused):
                module = importlib.import_module(base.__module__)
                bound = module.apply_rotary_pos_emb
                if getattr(bound, "ropekit_fuse_qkv", False):
                    module.apply_rotary_pos_emb = bound.ropekit_wraps
                del _FUSED[base.__module__]
        restored.append(name)
    return restored


def _listing(left: Dict[str, str]) -> str:
    reasons: Dict[str, List[str]] = {}
    for name, why in left.items():
        reasons.setdefault(why, []).append(name)
    return "; ".join(f"{', '.join(names)} ({why})" for why, names in reasons.items())
