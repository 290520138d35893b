"""When ropekit's kernel reproduces a Hugging Face rotary call, and how HF's layouts map onto it.

The drop-ins of ropekit.hf and the forms of ropekit.integrations.hf_forms share these: a call is
planned (heads dim, rotary width) or declined (None), and a planned call is one ops.rotate_angles.
"""

from __future__ import annotations

import functools

import torch

from ..api import ops
from ..core import memo

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# when the kernel applies, and how HF's layouts map onto it


def unsqueeze_dim(position_ids, unsqueeze_dim):
    # transformers 5.x dropped position_ids from the signature: a 5th positional int is unsqueeze_dim
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        return position_ids
    return unsqueeze_dim


def heads_dim(unsqueeze_dim, table_token_rank=3):
    """Where HF's unsqueeze puts the head dim of q for a (*, B, S, D) table: 1 or 2, else None."""
    if not isinstance(unsqueeze_dim, int) or isinstance(unsqueeze_dim, bool):
        return None
    ud = unsqueeze_dim + table_token_rank + 1 if unsqueeze_dim < 0 else unsqueeze_dim
    return ud if ud in (1, 2) else None


def fits(shape, target) -> bool:
    """shape broadcasts to target without growing it."""
    return len(shape) == len(target) and all(s == t or s == 1 for s, t in zip(shape, target))


def kernel_takes(q, k, tables, *, promote_to_q: bool) -> bool:
    """Dtype / device / stride / grad conditions under which ropekit's kernel reproduces HF."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return False
    if q.dim() != 4 or k.dim() != 4 or q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype:
        return False
    t0 = tables[0]
    for t in tables:
        if not isinstance(t, torch.Tensor) or t.dtype != t0.dtype or t.shape != t0.shape:
            return False
        if t.device != q.device:
            return False
        if t.requires_grad and torch.is_grad_enabled():
            return False  # ropekit treats angles as constants: HF's math
    if t0.dtype not in KERNEL_DTYPES or k.device != q.device:
        return False
    if promote_to_q and (
        torch.promote_types(q.dtype, t0.dtype) != q.dtype or torch.promote_types(k.dtype, t0.dtype) != k.dtype
    ):
        return False  # HF's result would be wider than q: keep HF's dtype
    for x in (q, k):
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            return False
    return True


def tokens_first(x, hd):
    return x.transpose(1, 2) if hd == 1 else x


def rotate_hf_layout(q, k, cos, sin, hd, *, interleaved, out_interleaved=None, mrope_section=None, columns=None):
    """Rotate HF-layout q/k with ropekit: cos/sin are (…, B, S, ·) tables of which the first
    `columns` columns (None: all) hold the rotary_dim // 2 frequencies."""
    return ops.rotate_angles(
        q,
        k,
        cos,
        sin,
        interleaved=interleaved,
        out_interleaved=interleaved if out_interleaved is None else out_interleaved,
        mrope_section=mrope_section,
        heads_first=hd == 1,
        columns=columns,
    )


def plain_plan(q, k, cos, sin, unsqueeze_dim, *, promote_to_q, need_full=False):
    """(heads dim, rotary width) when the kernel can take a (B, S, D)-table call, else None;
    remembered per call signature in ropekit's memo in eager mode (a training step asks once per layer)."""
    decide = functools.partial(
        decide_plain_plan, q, k, cos, sin, unsqueeze_dim, promote_to_q=promote_to_q, need_full=need_full
    )
    if torch.compiler.is_compiling():
        return decide()
    try:
        key = (
            "hf plan",
            torch.is_grad_enabled(),
            memo.tensor_key(q),
            memo.tensor_key(k),
            memo.tensor_key(cos),
            memo.tensor_key(sin),
            unsqueeze_dim,
            promote_to_q,
            need_full,
        )
        plan = memo.lookup(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: decide afresh
        return decide()
    if plan is None:
        plan = memo.remember(key, decide() or False)
    return plan or None


def decide_plain_plan(q, k, cos, sin, unsqueeze_dim, *, promote_to_q, need_full):
    if not kernel_takes(q, k, (cos, sin), promote_to_q=promote_to_q) or cos.dim() != 3:
        return None
    hd = heads_dim(unsqueeze_dim)
    if hd is None:
        return None
    qt, kt = tokens_first(q, hd), tokens_first(k, hd)
    tokens = tuple(qt.shape[:2])
    if tuple(kt.shape[:2]) != tokens or not fits(tuple(cos.shape[:2]), tokens):
        return None
    r = cos.shape[-1]
    if r < 2 or r % 2 or r > q.shape[-1] or r > k.shape[-1]:
        return None
    if need_full and not (q.shape[-1] == r and k.shape[-1] == r):
        return None
    return hd, r
