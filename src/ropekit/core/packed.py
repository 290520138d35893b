"""Positions of packed sequences (THD layout) and of context-parallel shards.

Transformer Engine's THD convention: the tokens of N sequences are concatenated along one token
dim, and `cu_seqlens` (N+1,) holds the cumulative lengths [0, L0, L0+L1, ...] of this rank's LOCAL
pieces. Positions restart at 0 in every sequence.

Context parallelism (cp_size > 1) with dual-chunk load balancing (TE, Megatron): a global sequence
of length G = L * cp_size is cut into 2 * cp_size chunks of L/2 tokens; rank r holds chunks r and
2*cp_size-1-r, concatenated, as one local sequence of length L. Local index s maps to

    s <  L/2:  s + r * L/2
    s >= L/2:  s + (2*cp_size - 2 - r) * L/2       (= s + L*cp_size - (r+1)*L/2 - L/2)

so every rank does the same amount of causal-attention work. `_cp_position` is that formula; the
Triton kernel's in-kernel derivation (apply_rope(..., cu_seqlens=...)) must use the same one.
"""

from __future__ import annotations

from typing import Optional

import torch

from .args import INDEX_DTYPES, fail, tensor
from .strict import cu_seqlens_order, is_strict

_OP = "positions_from_cu_seqlens"


def _cp_position(s_local, L, cp_size: int, cp_rank: int):
    """Global position of local index s_local in a local sequence of length L (even when cp_size > 1).

    s_local, L: ints or integer tensors of one shape (broadcastable), 0 <= s_local < L.
    With h = L // 2: s_local + cp_rank * h if s_local < h, else s_local + (2*cp_size - 2 - cp_rank) * h.
    cp_size == 1 gives s_local itself (both branches add 0). Integer arithmetic only; with tensors
    the result has the promoted dtype of s_local and L.
    """
    h = L // 2
    low = s_local + cp_rank * h
    high = s_local + (2 * cp_size - 2 - cp_rank) * h
    if isinstance(s_local, torch.Tensor) or isinstance(L, torch.Tensor):
        return torch.where(torch.as_tensor(s_local < h), low, high)
    return low if s_local < h else high


def _int_arg(name: str, value, lowest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_OP}: {name}: expected an int, got {type(value).__name__}")
    if value < lowest:
        fail(_OP, name, f"an int >= {lowest}", value)
    return value


def _check_values(cu: torch.Tensor, cp_size: int, total_tokens: Optional[int], start: Optional[torch.Tensor], op=_OP):
    """The data-dependent checks (read cu_seqlens' values: free on CPU, one sync on a device).
    op: the op the user called; another op than positions_from_cu_seqlens took q, not total_tokens."""
    vals = cu.tolist()
    cu_seqlens_order(op, vals, cp_size)
    if total_tokens is not None and total_tokens < vals[-1]:
        if op != _OP:
            fail(
                op, "cu_seqlens", f"cu_seqlens[-1] <= {total_tokens} (the tokens of q)", f"cu_seqlens[-1] = {vals[-1]}"
            )
        fail(op, "total_tokens", f"an int >= cu_seqlens[-1] = {vals[-1]}", total_tokens)
    if start is not None:
        low = start.min().item() if start.numel() else 0
        if low < 0:
            index = int((start < 0).nonzero()[0, 0])
            fail(_OP, "start_positions", "values >= 0", f"start_positions[{index}] = {int(start[index])}")


def positions_from_cu_seqlens(
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    start_positions: Optional[torch.Tensor] = None,
    total_tokens: Optional[int] = None,
) -> torch.Tensor:
    """Positions of the tokens of packed sequences (THD), optionally context-parallel shards.

    Args:
        cu_seqlens: (N+1,) int32/int64, any device: [0, L0, L0+L1, ...], this rank's cumulative
            LOCAL sequence lengths (Transformer Engine's THD convention). Empty sequences allowed.
        cp_size: context-parallel world size (>= 1). With cp_size > 1 every local length must be
            even: sequence i's local tokens are chunks cp_rank and 2*cp_size-1-cp_rank of the
            global sequence of length L_i * cp_size (see the module docstring for the mapping).
        cp_rank: this rank, 0 <= cp_rank < cp_size.
        start_positions: (N,) int32/int64 on cu_seqlens' device, or None: added to every position
            of sequence i (a sequence continued from a cache). Only with cp_size == 1.
        total_tokens: the token count T of the packed q/k, or None for cu_seqlens[-1]. Giving it
            avoids the one host read of cu_seqlens[-1] (a device sync when cu_seqlens is on a GPU).
            Tokens past cu_seqlens[-1] (padding at the end of the buffer) get position 0.

    Returns:
        (T,) positions in cu_seqlens' dtype on its device: within sequence i, local token s gets
        s + start_positions[i] (cp_size == 1) or `_cp_position(s, L_i, cp_size, cp_rank)`.

    Checks and syncs: types, ranks, dtypes, devices and the ints are always checked (no sync).
    The values of cu_seqlens (cu_seqlens[0] == 0, non-decreasing, even lengths under CP,
    total_tokens >= cu_seqlens[-1]) and start_positions >= 0 are checked when cu_seqlens is on the
    CPU (free), and on a device only in strict mode (`ropekit.strict()`, one sync). Unchecked on a
    device, a token of an odd-length sequence under CP, or one whose sequence has a negative
    length, gets position -1 (apply_rope then gives NaN for it, no out-of-bounds read). The only
    sync outside strict mode is the read of cu_seqlens[-1] when total_tokens is None and
    cu_seqlens is on a device. Vectorized: no Python loop over sequences.

    Example, three packed sequences of 3, 2 and 4 tokens::

        ropekit.positions_from_cu_seqlens(torch.tensor([0, 3, 5, 9]))
        # tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])
    """
    tensor(
        _OP,
        "cu_seqlens",
        cu_seqlens,
        ndims=(1,),
        dtypes=INDEX_DTYPES,
        shape_hint="(N+1,) cumulative lengths",
        last_stride_one=False,
    )
    if cu_seqlens.shape[0] < 1:
        fail(_OP, "cu_seqlens", "at least one element ([0] for no sequences)", f"shape {tuple(cu_seqlens.shape)}")
    cp_size = _int_arg("cp_size", cp_size, 1)
    cp_rank = _int_arg("cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        fail(_OP, "cp_rank", f"an int in [0, cp_size = {cp_size})", cp_rank)
    n_seq = cu_seqlens.shape[0] - 1
    if start_positions is not None:
        if cp_size > 1:
            fail(
                _OP,
                "start_positions",
                "None when cp_size > 1 (offsets of context-parallel shards are not defined)",
                f"a tensor with cp_size = {cp_size}",
            )
        tensor(
            _OP,
            "start_positions",
            start_positions,
            ndims=(1,),
            dtypes=INDEX_DTYPES,
            device=cu_seqlens.device,
            shape_hint=(n_seq,),
            last_stride_one=False,
        )
        if start_positions.shape[0] != n_seq:
            fail(
                _OP,
                "start_positions",
                f"shape ({n_seq},) (one offset per sequence of cu_seqlens)",
                f"shape {tuple(start_positions.shape)}",
            )
    if total_tokens is not None:
        total_tokens = _int_arg("total_tokens", total_tokens, 0)

    on_host = cu_seqlens.device.type == "cpu"
    if on_host or is_strict():
        _check_values(cu_seqlens, cp_size, total_tokens, start_positions)
    if total_tokens is None:
        total_tokens = int(cu_seqlens[-1])  # the one host read (a sync on a device)
    return _positions(cu_seqlens, cp_size, cp_rank, start_positions, total_tokens)


def packed_positions(op: str, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, n_tokens: int) -> torch.Tensor:
    """positions_from_cu_seqlens for an op that took cu_seqlens with q of n_tokens tokens (its
    arguments already checked by the op): errors about the values name that op and cu_seqlens."""
    if cu_seqlens.device.type == "cpu" or is_strict():
        _check_values(cu_seqlens, cp_size, n_tokens, None, op=op)
    return _positions(cu_seqlens, cp_size, cp_rank, None, n_tokens)


def _positions(cu_seqlens, cp_size: int, cp_rank: int, start_positions, total_tokens: int) -> torch.Tensor:
    """The (total_tokens,) positions of checked arguments; vectorized, no sync."""
    n_seq = cu_seqlens.shape[0] - 1
    device = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    token = torch.arange(total_tokens, device=device, dtype=torch.int64)
    # sequence of each token: how many sequence ends lie at or before it (empty sequences skipped)
    if n_seq == 0:  # no sequences: every token is padding
        return torch.zeros(total_tokens, dtype=cu_seqlens.dtype, device=device)
    seq = torch.searchsorted(cu[1:], token, right=True)
    past_end = seq >= n_seq  # padding after cu_seqlens[-1]
    seq = seq.clamp_max(n_seq - 1)
    start = cu[:-1][seq]
    length = cu[1:][seq] - start
    s = token - start
    pos = _cp_position(s, length, cp_size, cp_rank) if cp_size > 1 else s
    if start_positions is not None:
        pos = pos + start_positions.to(torch.int64)[seq]
    # tokens the unchecked device path cannot place: loud (-1 -> NaN in apply_rope), not wrong
    bad = (s < 0) | (s >= length)
    if cp_size > 1:
        bad = bad | (length % 2 == 1)
    pos = torch.where(bad, torch.full_like(pos, -1), pos)
    pos = torch.where(past_end, torch.zeros_like(pos), pos)
    return pos.to(cu_seqlens.dtype)
