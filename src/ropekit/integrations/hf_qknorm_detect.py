"""Which families of a model norm q and k with RMSNorm right before the rotation, found from the
model itself (beyond the hand-written rows of hf_qknorm.FAMILIES) and verified numerically.

For a family whose modeling module has an attention module with `q_norm` / `k_norm` of one class
of that module:
- the norm class: its forward on random input must be RMSNorm, x * rsqrt(mean(x^2) + eps) * (w + c),
  with eps its `variance_epsilon` / `eps` attribute and c = 0 or 1 (Gemma's 1 + w) found by trying both;
- the attention: one of the model's own attention modules runs on random hidden states and random
  halves tables, HF's way and fused (the q/k norm deferred into ropekit's op); the outputs must
  agree (relative L2 1e-5 in float32, 2e-2 in bf16 / fp16). Anything the forward does between the
  norms and the rotation that the fusion would skip shows up here.
A family that fails either check is not fused, and the reason is given.
"""

from __future__ import annotations

import importlib
from typing import Dict, Tuple, Union

import torch

from . import hf_qknorm

_TOL = {torch.float32: 1e-5}
# (modeling module, attention class) -> the row, or why there is none
_FOUND: Dict[Tuple[str, str], Union[hf_qknorm.Family, str]] = {}


def _offset(norm, eps_attr: str):
    """0.0 or 1.0 when norm's forward is RMSNorm with weight offset c, else None."""
    w = norm.weight
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, w.shape[-1], generator=g).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        got = norm(x).double()
    x64, eps = x.double(), float(getattr(norm, eps_attr))
    xn = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    tol = _TOL.get(w.dtype, 2e-2)
    for c in (0.0, 1.0):
        want = xn * (w.double() + c)
        if (got - want).norm() <= tol * want.norm():
            return c
    return None


def _hidden_size(attn):
    for name in ("q_proj", "qkv_proj", "Wqkv"):
        lin = getattr(attn, name, None)
        if isinstance(lin, torch.nn.Linear):
            return lin.in_features
    return None


def _attention_agrees(attn, family: str, spec: hf_qknorm.Family):
    """Run attn HF's way and fused on random input: None when they agree, else the reason."""
    hidden, head_dim = _hidden_size(attn), getattr(attn, "head_dim", None)
    if hidden is None or not isinstance(head_dim, int):
        return "its attention has no q_proj / head_dim to build a test input from"
    w = attn.q_norm.weight
    g = torch.Generator().manual_seed(11)
    h = torch.randn(1, 3, hidden, generator=g).to(device=w.device, dtype=w.dtype)
    angles = torch.rand(1, 3, head_dim // 2, generator=g, dtype=torch.float64) * 6 - 3
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(device=w.device, dtype=w.dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(device=w.device, dtype=w.dtype)

    def run():
        with torch.no_grad():
            out = attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    try:
        want = run()
        hf_qknorm.patch([family], {family: spec})
        try:
            got = run()
        finally:
            hf_qknorm.unpatch([family])
    except Exception as e:  # noqa: BLE001  a forward this check cannot call: not fused
        return f"its attention could not be run on a test input ({type(e).__name__}: {e})"
    if (got.double() - want.double()).norm() > _TOL.get(w.dtype, 2e-2) * want.double().norm():
        return "fused, its attention gives another result (checked on random inputs)"
    return None


def detect(model, family: str, module_name: str) -> Union[hf_qknorm.Family, str]:
    """The fusion row for the family's attention in this model, or why it has none."""
    module = importlib.import_module(module_name)
    attn = next(
        (
            m
            for m in model.modules()
            if type(m).__module__ == module_name
            and isinstance(getattr(m, "q_norm", None), torch.nn.Module)
            and isinstance(getattr(m, "k_norm", None), torch.nn.Module)
        ),
        None,
    )
    if attn is None:
        return "no attention with q_norm / k_norm"
    key = (module_name, type(attn).__name__)
    if key in _FOUND:
        return _FOUND[key]
    norm = attn.q_norm
    eps_attr = next((a for a in ("variance_epsilon", "eps") if isinstance(getattr(norm, a, None), float)), None)
    if (
        type(attn.k_norm) is not type(norm)
        or getattr(module, type(norm).__name__, None) is not type(norm)
        or not isinstance(getattr(norm, "weight", None), torch.Tensor)
        or eps_attr is None
        or getattr(module, type(attn).__name__, None) is not type(attn)
        or not hasattr(module, "apply_rotary_pos_emb")
    ):
        found: Union[hf_qknorm.Family, str] = (
            "q_norm / k_norm are not one RMSNorm class of the module with eps and weight"
        )
    else:
        offset = _offset(norm, eps_attr)
        if offset is None:
            found = f"{type(norm).__name__} is not RMSNorm with weight w or 1 + w (checked on random inputs)"
        else:
            found = hf_qknorm.Family(type(attn).__name__, type(norm).__name__, eps_attr, offset)
            found = _attention_agrees(attn, family, found) or found
    _FOUND[key] = found
    return found
