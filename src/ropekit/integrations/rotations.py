"""The angle forms other libraries' rotary helpers take, as ropekit calls (public ops only).

Each reader turns one library form of the angles into per-token (cos, sin) of rotary_dim // 2
columns and says how the pairs are laid out; `rotate` then makes one ropekit call. A reader
returns None for inputs it does not take (the caller then runs the library's own helper, so
results never change silently). The library forms:

- pairs: real (cos, sin), each frequency repeated at 2i and 2i + 1 (complex-style pairs)
- halves: real (cos, sin) as [f, f] (rotate_half-style pairs (i, i + D / 2))
- complex: complex64 (or complex128: Lumina 2's) freqs_cis e^(i angle), pairs (2i, 2i + 1)
- matrix: real (..., D / 2, 2, 2) rotation matrices [[cos, -sin], [sin, cos]] per pair
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..api.ops import rotate_with_angles

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMPLEX = (torch.complex64, torch.complex128)


def takes(x, *angles) -> bool:
    """Whether ropekit computes this call as the helper does: a 3- or 4-D fp32 / bf16 / fp16 x with
    unit last stride, constant angles of those dtypes (a learnable angle keeps its own autograd)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES or x.dim() not in (3, 4) or x.stride(-1) != 1:
        return False
    for a in angles:
        if not isinstance(a, torch.Tensor) or (a.requires_grad and torch.is_grad_enabled()):
            return False
        if a.dtype not in DTYPES + COMPLEX:
            return False
    return True


def rotate(x, cos, sin, *, interleaved: bool, heads_first: bool = False):
    """x (B, S, H, D) or, heads_first, (B, H, S, D); cos / sin broadcastable to (B, S, R / 2) with
    R <= D (the leading R dims rotated, the rest passed through). Returns the rotated x."""
    cos, sin = cos.to(x.device), sin.to(x.device)
    layout = "bhsd" if heads_first else "bshd"
    out, _ = rotate_with_angles(x, None, cos, sin, interleaved=interleaved, layout=layout, rotary_dim=2 * cos.shape[-1])
    return out


def rotate_flat(x, cos, sin, *, interleaved: bool):
    """x (B, S, C) with the heads flattened and cos / sin (B, S, C / 2) over all C columns: one
    'head' of C dims (each head may then take its own angles)."""
    return rotate(x.unsqueeze(2), cos, sin, interleaved=interleaved).squeeze(2)


def rotate_heads(x, cos, sin, *, interleaved: bool):
    """x (B, H, S, D) with angles of its own per head: cos / sin broadcastable to (B, H, S, R / 2).
    Every (batch, head) becomes a sequence of one head (x copied when its strides do not allow
    the view); angles shared by the heads take the one-call path with no copy."""
    b, h, t, _ = x.shape
    if cos.shape[-2] != t or sin.shape != cos.shape:
        return None
    if cos.dim() < 3 or cos.shape[-3] == 1:
        lead = cos.reshape(-1, t, cos.shape[-1]) if cos.dim() > 2 else cos
        if lead.dim() == 3 and lead.shape[0] not in (1, b):
            return None
        return rotate(x, lead, sin.reshape(lead.shape), interleaved=interleaved, heads_first=True)
    r = cos.shape[-1]
    cos, sin = (a.expand(b, h, t, r).reshape(b * h, t, r) for a in (cos, sin))
    out = rotate(x.reshape(b * h, t, 1, x.shape[-1]), cos, sin, interleaved=interleaved)
    return out.view(b, h, t, x.shape[-1])


def pairs(cos, sin, width: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) of `width` columns, each frequency repeated in pairs: one of each pair."""
    if cos.shape[-1] != width or sin.shape != cos.shape or width % 2:
        return None
    return cos[..., 0::2], sin[..., 0::2]


def halves(cos, sin, width: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) of `width` columns as [f, f]: the first half."""
    if cos.shape[-1] != width or sin.shape != cos.shape or width % 2:
        return None
    return cos[..., : width // 2], sin[..., : width // 2]


def complex_parts(freqs) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Real and imaginary parts of complex freqs_cis: strided views of complex64, float32 copies of
    complex128 (ropekit's math is float32 either way)."""
    if freqs.dtype not in COMPLEX:
        return None
    parts = torch.view_as_real(freqs.resolve_conj())
    if parts.dtype == torch.float64:
        parts = parts.float()
    return parts[..., 0], parts[..., 1]


def matrix(freqs, x) -> Optional[Tuple[Tuple[torch.Tensor, torch.Tensor], bool]]:
    """((cos, sin) (B, S, D / 2), heads_first) of rotation matrices (..., D / 2, 2, 2) laid out as
    x (B, S, H, D) or (B, H, S, D) with a size-1 head dim, else None."""
    if freqs.dim() != x.dim() + 2 or freqs.shape[-2:] != (2, 2) or x.dim() != 4:
        return None
    cos, sin = freqs[..., 0, 0], freqs[..., 1, 0]
    if cos.shape[-1] != x.shape[-1] // 2:
        return None
    if cos.shape[2] == 1:
        return (cos[:, :, 0], sin[:, :, 0]), False
    if cos.shape[1] == 1:
        return (cos[:, 0], sin[:, 0]), True
    return None
