"""Plain-PyTorch RoPE and attention in float64, which the examples check ropekit against.

Not an example itself: the scripts beside it import it (they run as `python examples/NAME.py`,
which puts this folder on sys.path).
"""

import torch


def rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x (*T, H, D) rotated half-split (Llama / NeoX) by table rows `positions` (*T), in float64."""
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache.double()[positions.long()].unsqueeze(-2)  # (*T, 1, rotary_dim)
    cos, sin = rows[..., :half], rows[..., half:]
    x = x.double()
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query token over L cached tokens, grouped-query heads, in float64.

    q (Hq, D), k (L, Hk, D), v (L, Hk, Dv) -> (Hq, Dv)."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # (L, Hq, D)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """Raise when the largest difference of got from want, relative to want's largest value,
    is above tol; return that difference."""
    got, want = got.detach().double(), want.detach().double()
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    if not err <= tol:
        raise AssertionError(f"{name}: relative difference {err:.3g} > {tol:g}")
    return err
