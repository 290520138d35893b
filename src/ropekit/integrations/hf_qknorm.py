"""Hugging Face: q/k RMSNorm + RoPE in one ropekit launch, for the rows written here (Qwen3,
Qwen3-MoE, Gemma 3, OLMo 2; Llama 4's weightless norm after the rotation) and the families
hf_qknorm_detect finds in a model.

`ropekit.hf.patch(model, fuse_qk_norm=True)` ends here. These families' attention forwards call
`self.q_norm(...)` / `self.k_norm(...)` and then the modeling module's `apply_rotary_pos_emb`. The
patch leaves the forwards' code alone and swaps three things per family (one table row each):

- the attention class's forward: a wrapper that marks "this layer's q_norm / k_norm are deferred"
  for the duration of the call (thread-local state);
- the family's RMSNorm class forward: the layer's own q_norm / k_norm instances return their input
  unchanged while deferred (every other RMSNorm instance, and any call outside the attention, runs
  HF's forward);
- the module's `apply_rotary_pos_emb`: when both norms were deferred, one fused call
  (ropekit.api.ops.rotate_angles with norm weights) normalizes with the modules' own weights, eps and offset,
  then rotates. Otherwise, and when the fused op cannot take the arguments (float64, angles that
  require grad, other layouts), it runs HF's norms in PyTorch, then the function it replaced.

Where each family normalizes (transformers 5.x):
  qwen3, qwen3_moe  Qwen3RMSNorm(head_dim) on the (B, S, H, D) view, before the transpose;
                    weight * x_normed.to(dtype): per head, offset 0
  gemma3            Gemma3RMSNorm(head_dim) on (B, H, S, D), after the transpose; float32
                    x_normed * (1 + w): per head, offset 1 (the weight is stored as w, init 0)
  olmo2             Olmo2RMSNorm(H * D) on the (B, S, H * D) projection, before the view:
                    across all heads of a token (weight (H*D,))
  llama4            Llama4TextL2Norm (Llama4TextWeightlessRMSNorm from 5.25), one `qk_norm` module
                    applied to q and to k (B, S, H, D) AFTER apply_rotary_emb: the rope function
                    (called first) fuses it with l2_norm=True and the two norm calls return their
                    input (Family.after); layers without qk_norm (NoPE) are HF's
Per head the norm acts on the last dim, so before or after the transpose is the same math; OLMo 2's
weight shape selects the across-heads mode. The fused op rounds once, after the rotation (HF rounds
after the norm and after every rotation op in bf16): float32 models agree to float32 accuracy.
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from ..api import ops


class Family(NamedTuple):
    attention: str  # the attention class in the modeling module
    norm: str  # its RMSNorm class (q_norm / k_norm attributes of the attention)
    eps: str  # the RMSNorm attribute holding eps
    offset: float  # added to the weight (Gemma's 1 + w)
    rope: str = "apply_rotary_pos_emb"  # the module function the attention calls after the norms
    # True: one weightless norm (the attention's `qk_norm`) applied to q and to k AFTER the rotation
    # (Llama 4): the rope function runs first and fuses it (l2_norm=True), the two norm calls that
    # follow return their input
    after: bool = False


FAMILIES: Dict[str, Family] = {
    "qwen3": Family("Qwen3Attention", "Qwen3RMSNorm", "variance_epsilon", 0.0),
    "qwen3_moe": Family("Qwen3MoeAttention", "Qwen3MoeRMSNorm", "variance_epsilon", 0.0),
    "gemma3": Family("Gemma3Attention", "Gemma3RMSNorm", "eps", 1.0),
    "olmo2": Family("Olmo2Attention", "Olmo2RMSNorm", "variance_epsilon", 0.0),
    # Llama4TextL2Norm: the class's name up to transformers 5.24 (eps in `eps`), an alias of
    # Llama4TextWeightlessRMSNorm from 5.25 (eps in `variance_epsilon`)
    "llama4": Family("Llama4TextAttention", "Llama4TextL2Norm", "variance_epsilon", 0.0, "apply_rotary_emb", True),
}

# (module name, owner name or None for the module, attribute) -> the object replaced
_ORIGINALS: Dict[Tuple[str, Optional[str], str], object] = {}


class _State(threading.local):
    """Per thread: the stack of attention calls whose norms are deferred. Made when a thread first
    reads it, never after: torch.compile guards on this state, so a first call that created it
    would make the second call recompile."""

    def __init__(self):
        self.stack: List["_Deferred"] = []


_STATE = _State()


class _Deferred:
    """One attention call's deferred norms: the modules, and which of them were skipped."""

    def __init__(self, q_norm, k_norm, family: Family):
        self.q_norm, self.k_norm, self.family = q_norm, k_norm, family
        self.skipped = set()
        self.pending = 0  # a norm-after family: calls of its norm still to skip (2 once fused)


def _stack() -> List[_Deferred]:
    return _STATE.stack


def _module_name(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


def _attention_forward(original, family: Family, module):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        fused_rope = getattr(module, family.rope, None)
        if not getattr(fused_rope, "_ropekit_qk_norm", False):
            return original(self, *args, **kwargs)  # the rope function was swapped since: no deferral
        if family.after:
            norm = getattr(self, "qk_norm", None)
            if norm is None:  # a layer without the norm (Llama 4's NoPE layers): nothing to fuse
                return original(self, *args, **kwargs)
            entry = _Deferred(norm, norm, family)
        else:
            entry = _Deferred(getattr(self, "q_norm", None), getattr(self, "k_norm", None), family)
        _stack().append(entry)
        try:
            out = original(self, *args, **kwargs)
        finally:
            _stack().pop()
        if entry.skipped:
            raise RuntimeError(
                f"ropekit.hf: {family.attention} skipped {sorted(entry.skipped)} but never called "
                f"{family.rope}: this transformers version's attention does not fit "
                "fuse_qk_norm (unpatch it)"
            )
        if entry.pending:
            raise RuntimeError(
                f"ropekit.hf: {family.attention}: {family.rope} normalized q and k, but the attention "
                f"called its qk_norm {2 - entry.pending} time(s) after it, not twice: this transformers "
                "version's attention does not fit fuse_qk_norm (unpatch it)"
            )
        return out

    return forward


def _norm_forward(original):
    @functools.wraps(original)
    def forward(self, x, *args, **kwargs):
        st = _stack()
        if st and not args and not kwargs:
            entry = st[-1]
            if entry.family.after:
                if entry.pending and self is entry.q_norm:
                    entry.pending -= 1
                    return x  # applied by the fused rope call before it
                return original(self, x)
            for role, mod in (("q", entry.q_norm), ("k", entry.k_norm)):
                if mod is self and role not in entry.skipped:
                    entry.skipped.add(role)
                    return x  # applied by the fused rope call
        return original(self, x, *args, **kwargs)

    return forward


def _apply_norm(mod, x, original_norm):
    """HF's own norm on a (B, H, S, D) tensor: per head on the last dim, or across heads on (B, S, H*D)."""
    if mod.weight.shape[-1] == x.shape[-1]:
        return original_norm(mod, x)
    B, H, S, D = x.shape
    y = original_norm(mod, x.transpose(1, 2).reshape(B, S, H * D))
    return y.view(B, S, H, D).transpose(1, 2)


def _fusable(q, k, cos, sin, args, kwargs) -> bool:
    if args or kwargs:  # the attentions fused here pass (q, k, cos, sin) alone (unsqueeze_dim 1)
        return False
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    if q.dtype != k.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if cos.dtype not in (torch.float16, torch.bfloat16, torch.float32) or cos.requires_grad or sin.requires_grad:
        return False
    rot = cos.shape[-1]
    return rot % 2 == 0 and rot <= min(q.shape[-1], k.shape[-1]) and q.stride(-1) == 1 and k.stride(-1) == 1


def _rope_function(previous, family: Family, norm_cls, original_norm):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        st = _stack()
        entry = st[-1] if st else None
        if entry is None or entry.skipped != {"q", "k"}:
            return previous(q, k, cos, sin, *args, **kwargs)
        entry.skipped = set()
        qn, kn = entry.q_norm, entry.k_norm
        eps_q, eps_k = getattr(qn, family.eps), getattr(kn, family.eps)
        if eps_q != eps_k or not _fusable(q, k, cos, sin, args, kwargs) or qn.weight.dtype != kn.weight.dtype:
            q, k = _apply_norm(qn, q, original_norm), _apply_norm(kn, k, original_norm)
            return previous(q, k, cos, sin, *args, **kwargs)
        # HF's (B, H, S, D) views; cos/sin rows [f, f]: the first half of the columns
        return ops.rotate_angles(
            q,
            k,
            cos,
            sin,
            heads_first=True,
            columns=cos.shape[-1] // 2,
            q_norm_weight=qn.weight,
            k_norm_weight=kn.weight,
            norm_eps=float(eps_q),
            norm_weight_offset=family.offset,
        )

    apply_rotary_pos_emb._ropekit_qk_norm = True
    apply_rotary_pos_emb.ropekit_wraps = previous  # what it passes calls outside a fused attention to
    return apply_rotary_pos_emb


def _eps(norm, family: Family) -> float:
    """The norm module's eps: the family's attribute, or the other name a transformers release used."""
    for name in (family.eps, "eps", "variance_epsilon"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise AttributeError(f"ropekit.hf: {type(norm).__name__} has no eps attribute ({family.eps!r} or 'eps')")


def _complex_fits(xq, xk, freqs_cis) -> bool:
    """Does the kernel take Llama 4's (xq, xk, freqs_cis) as HF computes it? q / k (B, S, H, D) of
    one float dtype, unit last stride, D = 2 * freqs_cis's last dim; freqs_cis complex64 (B or 1,
    S, D/2), a constant."""
    if not all(isinstance(t, torch.Tensor) for t in (xq, xk, freqs_cis)):
        return False
    if xq.dim() != 4 or xk.dim() != 4 or freqs_cis.dim() != 3 or freqs_cis.dtype != torch.complex64:
        return False
    if xq.dtype != xk.dtype or xq.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if freqs_cis.requires_grad or xq.stride(-1) != 1 or xk.stride(-1) != 1 or xq.shape[:2] != xk.shape[:2]:
        return False
    half = freqs_cis.shape[-1]
    return xq.shape[-1] == xk.shape[-1] == 2 * half and freqs_cis.shape[1] == xq.shape[1]


def _rope_then_norm_function(previous, family: Family):
    """A norm-after family's rope function (Llama 4's apply_rotary_emb(xq, xk, freqs_cis), q / k
    (B, S, H, D), complex freqs_cis): inside a deferring attention, one call rotates and normalizes
    q and k (l2_norm=True, the qk_norm's eps) and the attention's two qk_norm calls after it return
    their input; otherwise, and for inputs the kernel does not take as HF computes them, the
    function it replaced (HF's norm then runs as HF's)."""

    def apply_rotary_emb(xq, xk, freqs_cis, *args, **kwargs):
        st = _stack()
        entry = st[-1] if st else None
        if entry is None or not entry.family.after or entry.pending or args or kwargs:
            return previous(xq, xk, freqs_cis, *args, **kwargs)
        if not _complex_fits(xq, xk, freqs_cis) or freqs_cis.shape[0] not in (1, xq.shape[0]):
            return previous(xq, xk, freqs_cis)
        out = ops.rotate_with_angles(
            xq, xk, freqs_cis=freqs_cis, layout="bshd", l2_norm=True, norm_eps=_eps(entry.q_norm, family)
        )
        entry.pending = 2
        return out

    apply_rotary_emb._ropekit_qk_norm = True
    apply_rotary_emb.ropekit_wraps = previous
    return apply_rotary_emb


def patch(families, specs: Optional[Dict[str, Family]] = None) -> Dict[str, List[str]]:
    """Fuse q/k norm + RoPE in these families (rows of `specs`, found from a model by
    hf_qknorm_detect, else of FAMILIES; others are ignored). Families whose module the installed
    transformers lacks are skipped. Returns {family: [swapped names]}."""
    done: Dict[str, List[str]] = {}
    for family in families:
        spec = (specs or {}).get(family) or FAMILIES.get(family)
        if spec is None or any(key[0] == _module_name(family) for key in _ORIGINALS):
            continue
        try:
            module = importlib.import_module(_module_name(family))
        except ImportError:
            continue
        attn, norm = getattr(module, spec.attention, None), getattr(module, spec.norm, None)
        if attn is None or norm is None or not hasattr(module, spec.rope):
            continue
        name = module.__name__
        if spec.after:
            rope = _rope_then_norm_function(getattr(module, spec.rope), spec)
        else:
            rope = _rope_function(getattr(module, spec.rope), spec, norm, norm.forward)
        swaps = [
            ((name, None, spec.rope), module, rope),
            ((name, spec.norm, "forward"), norm, _norm_forward(norm.forward)),
            ((name, spec.attention, "forward"), attn, _attention_forward(attn.forward, spec, module)),
        ]
        for key, owner, new in swaps:
            _ORIGINALS[key] = getattr(owner, key[2])
            setattr(owner, key[2], new)
        done[family] = [spec.rope, f"{spec.norm}.forward", f"{spec.attention}.forward"]
    return done


def unpatch(families=None) -> Dict[str, List[str]]:
    """Undo `patch` (all families, or these). Returns {family: [restored names]}."""
    restored: Dict[str, List[str]] = {}
    for key in list(_ORIGINALS):
        mod_name, owner, attr = key
        family = mod_name.split(".")[2]
        if families is not None and family not in families:
            continue
        module = importlib.import_module(mod_name)
        setattr(module if owner is None else getattr(module, owner), attr, _ORIGINALS.pop(key))
        restored.setdefault(family, []).append(attr if owner is None else f"{owner}.{attr}")
    return restored


def fused_families() -> List[str]:
    return sorted({key[0].split(".")[2] for key in _ORIGINALS})
