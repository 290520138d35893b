"""Strict mode and the checks that read values (positions, slots, cu_seqlens, scales): one device
sync each, so they run only in strict mode (`ropekit.strict()` or ROPEKIT_STRICT=1). By default a
bad value never reads out of bounds; its output is NaN (or the row is skipped) instead.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading

import torch

from .args import fail

# the environment is read once: every call asks, and os.environ costs more than the rest of a check
_ENV_STRICT = os.environ.get("ROPEKIT_STRICT", "0") not in ("", "0", "false", "False")


class _Mode(threading.local):
    """Per-thread strict mode, read by the per-call checks as `mode.on` (an attribute read: no
    call on the hot path). The class attribute is the default a new thread sees: ROPEKIT_STRICT as
    read at import (a missing attribute of a thread-local would cost a raised and caught
    AttributeError on every check)."""

    on = _ENV_STRICT


mode = _Mode()


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Within this context, positions (and slots) are checked against their bounds before launch.

    Costs one device sync per call; the default (off) makes a bad position's output NaN instead.
    `ROPEKIT_STRICT=1` in the environment turns it on globally.

    Example (a 4096-row table, one position past it)::

        with ropekit.strict():
            ropekit.apply_rope(q, k, torch.tensor([0, 1, 5000]), cache)
        # ValueError: apply_rope: positions: expected values in [0, 4096) (the rows of
        # cos_sin_cache), got positions[2] = 5000
    """
    previous = mode.on
    mode.on = bool(enabled)
    try:
        yield
    finally:
        mode.on = previous


def is_strict() -> bool:
    """Strict mode on? (the `strict()` context of this thread, else ROPEKIT_STRICT as read at import)"""
    return mode.on


def positions_finite(op: str, positions: torch.Tensor) -> None:
    """Strict mode, float positions: name the first that is not finite (one device sync)."""
    if positions.is_floating_point():
        bad = ~torch.isfinite(positions)
        if bool(bad.any()):
            index = first_index(bad)
            fail(op, "positions", "finite values", f"positions{list(index)} = {float(positions[index])}")


def cu_seqlens_order(op, vals, cp_size) -> None:
    """cu_seqlens' values (a list) start at 0, never decrease, and have even lengths under context
    parallelism (each local sequence holds two equal half-chunks)."""
    if vals[0] != 0:
        fail(op, "cu_seqlens", "cu_seqlens[0] == 0", f"cu_seqlens[0] = {vals[0]}")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            fail(
                op,
                "cu_seqlens",
                "non-decreasing values (cumulative lengths)",
                f"cu_seqlens[{i}] = {vals[i]} < cu_seqlens[{i - 1}] = {vals[i - 1]}",
            )
        if cp_size > 1 and (vals[i] - vals[i - 1]) % 2:
            fail(
                op,
                "cu_seqlens",
                f"even local lengths when cp_size > 1 (cp_size = {cp_size}: "
                "each local sequence holds two equal half-chunks)",
                f"length {vals[i] - vals[i - 1]} for sequence {i - 1}",
            )


def packed_values(op, cu_seqlens, n_tokens, cp_size) -> None:
    """Strict mode: cu_seqlens' order (cu_seqlens_order), and its end at the token count (one
    device sync)."""
    vals = cu_seqlens.tolist()
    cu_seqlens_order(op, vals, cp_size)
    if vals[-1] != n_tokens:
        fail(op, "cu_seqlens", f"cu_seqlens[-1] == {n_tokens} (the tokens of q)", f"cu_seqlens[-1] = {vals[-1]}")


def first_index(bad: torch.Tensor) -> tuple:
    """The index of the first True element of a bool tensor (row-major order)."""
    flat = int(bad.flatten().nonzero()[0, 0])
    return tuple(int(v) for v in torch.unravel_index(torch.tensor(flat), tuple(bad.shape)))


def positions_in_range(op: str, positions: torch.Tensor, max_position: int) -> None:
    """Strict mode: name the first out-of-range position (one device sync)."""
    bad = (positions < 0) | (positions >= max_position)
    if bool(bad.any()):
        index = first_index(bad)
        value = int(positions[index])
        fail(
            op,
            "positions",
            f"values in [0, {max_position}) (the rows of cos_sin_cache)",
            f"positions{list(index)} = {value}",
        )


def slots_in_range(op: str, slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Strict mode: name the first slot past the cache (one device sync). Negative slots are padding."""
    bad = slot_mapping >= num_slots
    if bool(bad.any()):
        flat = int(bad.flatten().nonzero()[0, 0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(slot_mapping.shape)))
        fail(
            op,
            "slot_mapping",
            f"values < {num_slots} (num_blocks * block_size of the caches; < 0 skips a token)",
            f"slot_mapping{list(index)} = {int(slot_mapping[index])}",
        )


def scale_value(op: str, name: str, scale: torch.Tensor) -> None:
    """Strict mode: a tensor scale must be finite and > 0 (one device sync)."""
    value = float(scale.reshape(()))
    if not (math.isfinite(value) and value > 0):
        fail(op, name, "a finite scale > 0", value)


def int_shift(op, delta: int, max_position: int, to_rows=None) -> None:
    """A Python int delta is a host value: |delta| < max_position is checked for free, every call.
    to_rows (a move to another table of that many rows): a position p in [0, max_position) and
    p + delta in [0, to_rows) bound delta to (-max_position, to_rows)."""
    if to_rows is not None:
        if not -max_position < delta < to_rows:
            fail(
                op,
                "delta",
                f"an int in (-{max_position}, {to_rows}) (positions are rows of cos_sin_cache, positions + "
                "delta rows of to_cache)",
                delta,
            )
    elif not -max_position < delta < max_position:
        fail(op, "delta", f"an int in (-{max_position}, {max_position}) (the rows of cos_sin_cache)", delta)


def _first(op, name, bad, values, expected) -> None:
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        fail(op, name, expected, f"{name}[{i}] = {int(values[i])}")


def rerotate_values(op, slots, delta, dst_slots, num_slots, max_position, positions=None, to_rows=None) -> None:
    """Strict mode (one device sync): slots and dst_slots below num_slots, |delta| below the table's rows
    for every row that is not padding, and no destination row that is also a source row. With
    positions (a move to a table of to_rows rows): positions in [0, max_position) and positions +
    delta in [0, to_rows) instead of the |delta| bound."""
    _first(
        op,
        "slots",
        slots >= num_slots,
        slots,
        f"values < {num_slots} (num_blocks * block_size of k_cache; < 0 skips a row)",
    )
    live = slots >= 0
    if dst_slots is not None:
        _first(
            op,
            "dst_slots",
            dst_slots >= num_slots,
            dst_slots,
            f"values < {num_slots} (num_blocks * block_size of k_cache; < 0 skips a row)",
        )
        live = live & (dst_slots >= 0)
    if positions is not None:
        two_table_values(op, live, positions, delta, max_position, to_rows)
    elif isinstance(delta, torch.Tensor):
        # no abs(): it wraps at the most negative int
        _first(
            op,
            "delta",
            live & ((delta >= max_position) | (delta <= -max_position)),
            delta,
            f"values in (-{max_position}, {max_position}) (the rows of cos_sin_cache) where slots >= 0",
        )
    else:
        int_shift(op, delta, max_position)
    if dst_slots is not None:
        sources = slots[live]
        _first(
            op,
            "dst_slots",
            live & torch.isin(dst_slots, sources),
            dst_slots,
            "rows that are not source rows (slots) of the same call",
        )


def two_table_values(op, live, positions, delta, max_position: int, to_rows: int) -> None:
    """Strict mode, a move between tables: the first live row whose position is not a row of
    cos_sin_cache, then the first whose positions + delta is not a row of to_cache (bounded
    without forming the sum: no int64 wrap)."""
    _first(
        op,
        "positions",
        live & ((positions < 0) | (positions >= max_position)),
        positions,
        f"values in [0, {max_position}) (the rows of cos_sin_cache) where slots >= 0",
    )
    p = positions.long()
    d = delta.long() if isinstance(delta, torch.Tensor) else torch.full_like(p, delta)
    bad = live & ((d < -p) | (d >= to_rows - p))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        fail(
            op,
            "delta",
            f"positions + delta in [0, {to_rows}) (the rows of to_cache) where slots >= 0",
            f"delta[{i}] = {int(d[i])} at positions[{i}] = {int(p[i])}",
        )


def slots_unique(op: str, slot_mapping: torch.Tensor) -> None:
    """Strict mode: no two tokens may name one slot (the k and v rows of a slot could come from
    different tokens). Names the first duplicated slot and two tokens holding it (one device sync).
    Negative slots are padding and may repeat."""
    flat = slot_mapping.reshape(-1).long()
    if flat.numel() < 2:
        return
    order = torch.sort(flat, stable=True)
    ranks, values = order.indices, order.values
    dup = (values[1:] == values[:-1]) & (values[1:] >= 0)
    if not bool(dup.any()):
        return
    hits = dup.nonzero().flatten()
    # among duplicated pairs, the one whose second token comes first in token order
    second = ranks[hits + 1]
    j = int(second.argmin())
    first_tok, second_tok = int(ranks[hits[j]]), int(second[j])
    shape = tuple(slot_mapping.shape)
    a = [int(i) for i in torch.unravel_index(torch.tensor(first_tok), shape)]
    b = [int(i) for i in torch.unravel_index(torch.tensor(second_tok), shape)]
    fail(
        op,
        "slot_mapping",
        "distinct slots (each cache row written by one token; < 0 skips a token)",
        f"slot {int(flat[second_tok])} at slot_mapping{a} and slot_mapping{b}",
    )
