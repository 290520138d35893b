"""Recognition of the forms other libraries pass: Hugging Face's (B, H, S, D) views and its
duplicated [f, f] cos / sin, Transformer Engine's 'sbhd', the layout names. Warnings and refusals
for a form that would be read the wrong way.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .args import TABLE_DTYPES, broadcasts_to, data_readable, fail

LAYOUTS = ("thd", "bshd", "bhsd", "sbhd")


class LayoutWarning(UserWarning):
    """A 4-D q whose layout reads both as (B, S, H, D) and as Hugging Face's (B, H, S, D)."""


def layout_arg(op, layout, q, sbhd=False) -> bool:
    """layout: None or 'thd' / 'bshd' (tokens first: (T, H, D) / (B, S, H, D)) or 'bhsd' (Hugging
    Face's (B, H, S, D)); with sbhd also 'sbhd' (Transformer Engine's (S, B, H, D), apply_rope's).
    Returns True for 'bhsd' (Variant.heads_first)."""
    if layout is None:
        return False
    if not isinstance(layout, str):
        raise TypeError(f"{op}: layout: expected a str or None, got {type(layout).__name__}")
    if layout not in LAYOUTS or (layout == "sbhd" and not sbhd):
        te = ", 'sbhd' (Transformer Engine's (S, B, H, D))" if sbhd else ""
        fail(
            op,
            "layout",
            f"'thd' or 'bshd' (tokens first), 'bhsd' (Hugging Face's (B, H, S, D)){te} or None",
            repr(layout),
        )
    rank = 3 if layout == "thd" else 4
    if isinstance(q, torch.Tensor) and q.dim() != rank:
        fail(op, "q", f"a {rank}-D tensor with layout={layout!r}", f"shape {tuple(q.shape)}")
    return layout == "bhsd"


def sbhd_args(op, q, k, positions, mrope: int) -> None:
    """layout='sbhd': k's token dims and positions' shape in the caller's (S, B) terms (the rest is
    checked on the (B, S, H, D) views). mrope: M-RoPE's position rows (0: none)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return
    tokens = tuple(q.shape[:2])
    if isinstance(k, torch.Tensor) and k.dim() == 4 and tuple(k.shape[:2]) != tokens:
        fail(op, "k", f"token dims {tokens} ((S, B), those of q)", f"shape {tuple(k.shape)}")
    if isinstance(positions, torch.Tensor):
        want = ((mrope,) if mrope else ()) + tokens
        if not broadcasts_to(tuple(positions.shape), want):
            fail(
                op,
                "positions",
                f"shape {want} ({f'({mrope}, S, B)' if mrope else '(S, B)'} with layout='sbhd'; size-1 dims broadcast)",
                f"shape {tuple(positions.shape)}",
            )


def looks_heads_first(q) -> bool:
    """A 4-D q whose dim 1 lies inside dim 2 in memory (stride(1) < stride(2)): how HF's (B, H, S, D)
    views of (B, S, H, D) projections look, and equally how (B, S, H, D) views of head-major
    buffers look (the strides are the same), so this can only warn, never refuse."""
    return q.dim() == 4 and q.shape[1] > 1 and q.shape[2] > 1 and q.stride(1) < q.stride(2)


def warn_ambiguous_layout(op, q, positions_none: bool, stacklevel: int = 4) -> None:
    """layout not given: warn (once per signature, from validation) when a q laid out like HF's
    (B, H, S, D) view would be read as (B, S, H, D) with angles that fit either reading."""
    if not looks_heads_first(q):
        return
    if positions_none:
        why = "positions=None is arange over dim 1"
    elif q.shape[1] == q.shape[2]:
        why = f"dims 1 and 2 are both {q.shape[1]}, so the angles fit either reading"
    else:
        return
    warnings.warn(
        f"{op}: q: shape {tuple(q.shape)} with strides {tuple(q.stride())} is read as (B, S, H, D), "
        f"and {why}; it is laid out as Hugging Face's (B, H, S, D) views are: pass layout='bhsd' if "
        "it is (B, H, S, D), or layout='bshd' to say it is (B, S, H, D) (and silence this warning)",
        LayoutWarning,
        stacklevel=stacklevel,  # the caller of the public op
    )


def halves_repeat(x: torch.Tensor) -> bool:
    """x's last dim is [a, a] (one device sync)."""
    n = x.shape[-1]
    return n % 2 == 0 and torch.equal(x[..., : n // 2], x[..., n // 2 :])


# tables whose values were read (by id, while they live): each is read once
_READ_TABLES: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def read_new_table(spec, op, table) -> None:
    """A table that is not the last one this call signature's spec read (the caller tests that by
    identity on every call: a known signature can come with a new tensor): table_not_hf_cos, then
    remember it (weakly)."""
    table_not_hf_cos(op, table)
    spec.table = weakref.ref(table)


def known_table(table) -> None:
    """A table an integration built with rows [cos | sin] (from HF's cos and sin): never read for
    HF's [f, f] form (each read costs a device sync)."""
    _READ_TABLES[id(table)] = table


def table_not_hf_cos(op, table) -> None:
    """Refuse HF's cos (or sin) given as a [cos | sin] table: their rows are [f, f], while row 0 of a
    table is [cos 0 | sin 0] = [1 | 0] (times the attention factor). Reads a table once while it
    lives: one device sync, row 0 settling it for every real table."""
    if not data_readable(table) or table.dim() != 2 or table.shape[-1] % 2 or _READ_TABLES.get(id(table)) is table:
        return
    if halves_repeat(table[0]) and halves_repeat(table) and bool(table.any()):
        fail(
            op,
            "cos_sin_cache",
            "a [cos | sin] table (row p = [cos(p*f) | sin(p*f)], as ropekit.cos_sin_cache builds it)",
            f"a {tuple(table.shape)} tensor whose rows are [f, f], as Hugging Face's cos (and sin) are; build "
            "the table with ropekit.cos_sin_cache, or pass HF's cos and sin to "
            "ropekit.rotate_with_angles(q, k, cos, sin, layout='bhsd')",
        )
    _READ_TABLES[id(table)] = table


def full_width_angles(op, q, k, half) -> None:
    """cos / sin of width `half` too wide for the heads but fitting them as Hugging Face's full-width
    [f, f] form: say what to pass (a head-size error otherwise)."""
    for name, x in (("q", q), ("k", k)):
        if x is not None and half % 2 == 0 and half <= x.shape[-1] < 2 * half:
            fail(
                op,
                name,
                f"a head size >= rotary_dim ({2 * half})",
                f"head size {x.shape[-1]} (cos and sin are rotary_dim // 2 = {half} wide; Hugging Face's "
                f"hold [f, f] over rotary_dim: pass rotary_dim={half}, or cos[..., :{half // 2}] and "
                f"sin[..., :{half // 2}])",
            )


def angle_rotary_dim(op, cos, rotary_dim) -> int:
    """rotate_with_angles' rotary_dim: the number of cos / sin columns to read (rotary_dim // 2);
    cos may be rotary_dim // 2 wide or rotary_dim wide with halves [f, f] (HF's form)."""
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"{op}: rotary_dim: expected an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2:
        fail(op, "rotary_dim", "a positive even int", rotary_dim)
    width = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() > 0 else None
    if width not in (rotary_dim, rotary_dim // 2):
        fail(
            op,
            "rotary_dim",
            f"the width of cos ({width}: rotary_dim // 2, or rotary_dim for HF's [f, f] form) or twice it",
            rotary_dim,
        )
    return rotary_dim // 2


def duplicated_angles(cos, sin):
    """Are cos and sin (readable: see data_readable) HF's [f, f] form? True / False, or None when
    all angles are zero (both readings then rotate by nothing). One device sync."""
    if cos.shape != sin.shape or cos.dim() == 0 or cos.shape[-1] % 2:
        return False
    if cos.dtype not in TABLE_DTYPES or sin.dtype != cos.dtype or sin.device != cos.device:
        return False
    if not bool(sin.any()):
        return None if halves_repeat(cos) else False
    return halves_repeat(cos) and halves_repeat(sin)
