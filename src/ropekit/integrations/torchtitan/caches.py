"""torchtitan's RoPE caches as ropekit tables, and q / k rotated by them as torchtitan's RoPE modules
rotate them. Needs torch only (not torchtitan): the overrides in overrides.py call it.

    cos_sin_table(cache)   CosSinRoPE's (max_seq_len, 2 D) rows [cos f, cos f, sin f, sin f]
    complex_table(cache)   ComplexRoPE's (max_seq_len, D / 2) complex64 e^(i f)
                           -> ropekit's (max_seq_len, D) float32 [cos f | sin f]
    Table(convert)         that conversion kept for one cache tensor, redone for a new or written one
    rotate(q, k, positions, table, interleaved=, mrope_hw=)   (q_out, k_out) by ropekit.apply_rope
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import ropekit

OP = "ropekit.torchtitan"


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def cos_sin_table(cache: torch.Tensor) -> torch.Tensor:
    """[cos f | sin f] from CosSinRoPE's rows (a copy: the two halves are not one strided view)."""
    half = cache.shape[-1] // 4
    return torch.cat((cache[:, :half], cache[:, 2 * half : 3 * half]), dim=-1)


def complex_table(cache: torch.Tensor) -> torch.Tensor:
    """[cos f | sin f] from ComplexRoPE's e^(i f)."""
    return torch.cat((cache.real, cache.imag), dim=-1)


class Table:
    """The table of one cache tensor, made on first use and kept (a copy of max_seq_len rows per
    layer is too much to redo every step); a replaced cache (`.to()`, torchtitan's `init_states`)
    or one written in place (its version moves) gets a new table."""

    def __init__(self, convert: Callable[[torch.Tensor], torch.Tensor]):
        self.convert = convert
        self.source = None
        self.version = None
        self.table = None

    def __call__(self, cache: torch.Tensor) -> torch.Tensor:
        if isinstance(cache, DTensor) and not all(isinstance(p, Replicate) for p in cache.placements):
            raise ValueError(f"{OP}: cache: expected a tensor or a replicated DTensor, got {cache.placements}")
        cache = _local(cache)
        if self.source is None or self.source() is not cache or self.version != cache._version:
            with torch.no_grad():
                self.table = self.convert(cache).float().contiguous()
            self.source, self.version = weakref.ref(cache), cache._version
        return self.table


def check_max_pos(positions: torch.Tensor, max_valid_pos: int) -> None:
    """torchtitan's bounds check, kept (ropekit alone writes NaN for such a token): async, no host
    sync, skipped under torch.compile, as torchtitan's RoPE does it."""
    if torch.compiler.is_compiling():
        return
    torch._assert_async(torch.all(_local(positions) <= max_valid_pos), f"position_ids exceed {max_valid_pos=}")


def positions_like(positions: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Plain positions beside a DTensor q become a DTensor on q's mesh, as torchtitan's RoPE wraps
    them: q's shards of the dims positions have (batch, sequence) kept, the others (heads) replicated."""
    if not isinstance(query, DTensor) or isinstance(positions, DTensor):
        return positions
    ndim = positions.ndim
    placements = tuple(Replicate() if isinstance(p, Shard) and p.dim >= ndim else p for p in query.placements)
    return DTensor.from_local(positions, query.device_mesh, placements, run_check=False)


def rotate(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: Optional[torch.Tensor],
    table: torch.Tensor,
    *,
    interleaved: bool,
    mrope_hw: Optional[Tuple[int, int]] = None,
):
    """q (B, S, Hq, D), k (B, S, Hk, D), positions None, (B or 1, S), or with mrope_hw (B, S, 3) t / h / w
    rows, as torchtitan passes them. mrope_hw: Qwen3.5 MRoPE's (h, w) sections, interleaved; torchtitan
    reads only those two (t drives every other frequency), so t's count is what is left of D / 2."""
    mrope_section = None
    if positions is not None:
        check_max_pos(positions, table.shape[0] - 1)
        positions = positions_like(positions, query)
        if mrope_hw is not None:
            h, w = mrope_hw
            mrope_section = (table.shape[-1] // 2 - h - w, h, w)
            positions = positions.permute(2, 0, 1)  # ropekit's (3, B, S): a view
    return ropekit.apply_rope(
        query,
        key,
        positions,
        table,
        interleaved=interleaved,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_section is not None,
    )
