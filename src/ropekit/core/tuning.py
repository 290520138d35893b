"""Launch-shape knobs of ropekit's kernels: one table, with the reason for each default.

The defaults are what the H200 sweeps picked (benchmarks/scripts/tune_core.py; the measurements and
their history are in benchmarks/PERF_LOG.md); CARD_PLAIN holds another card's own launches of the
plain rotation where its sweep and the bench, both settings in one run, found the defaults behind.
`override(...)` changes them for a block (tests force each program layout, the sweep tries each
setting); `ROPEKIT_<NAME>` environment variables set them for a process. Changing a knob drops
every memoized plan, so the next call plans again.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from . import memo


class Knob(NamedTuple):
    default: object
    why: str


KNOBS: Dict[str, Knob] = {
    "block_elems": Knob(
        2048,
        "rope_kernel elements per program (heads x rotated dims): 2048 fills the "
        "H200's memory pipeline with 2-4 warps; 1024 and 4096 were slower on W1/W2",
    ),
    "across_block_elems": Knob(
        512,
        "rope_kernel and its norm backward, a norm across heads (a pre-pass sums the token's "
        "heads, then the head blocks are normalized and rotated): W14 (Wan, 40 heads x 128) "
        "ran at 18% / 34% / 54% / 62% of copy with blocks of 4096 / 2048 / 1024 / 512, and its "
        "forward + backward in 28.6 / 13.9 / 10.1 / 5.9 ms",
    ),
    "decode_tokens": Knob(
        1024,
        "calls with fewer tokens are decode-sized: latency-bound, launched with the decode "
        "knobs below (a program per head block, programmatic dependent launch); from this "
        "count on, table-driven calls use one program per token walking its head blocks",
    ),
    "decode_block_elems": Knob(
        1024,
        "elements per program of decode-sized calls (rope_kernel and the fused store): on W3 "
        "and W7-T64, 1024 was within noise of the best of 256-4096 under graph replay",
    ),
    "decode_warps": Knob(1, "warps per program of decode-sized calls: 1 was within noise of the best of 1-8 on W3"),
    "store_block_elems": Knob(
        2048,
        "rope_store_kernel elements per head block with one program per token (q's, k's "
        "and v's blocks walked in turn): 2048 with 2 warps led the W7 sweep; 4096 "
        "(64 registers, half the occupancy) was 7% slower",
    ),
    "store_head_loop": Knob(
        None,
        "None: one program per token walking its q, k and v head blocks (slot and angles "
        "read once) from decode_tokens tokens on; True / False force it (tests, sweeps)",
    ),
    "strided_block_elems": Knob(
        512,
        "rope_kernel elements per head block of a plain rotation's head loop when a last dim has "
        "a stride other than 1 (its columns read element by element, half of every sector "
        "unwanted): a Triton copy of W2-STRIDED's pattern reached 67% of copy with 4 heads of "
        "128 a program and 57% with 16 (benchmarks/scripts/stride2_ceiling.py, H100); W2-STRIDED "
        "itself went from 56.8% (2048) to 63.5% (PERF_LOG v55)",
    ),
    "strided_warps": Knob(2, "warps per program of those strided launches (the same copy: 2 and 4 equal, 8 slower)"),
    "rerotate_block_elems": Knob(
        2048,
        "rerotate_kernel rotated elements per program (rows x heads x dims): "
        "rows are gathered by slot, so a program takes several to overlap "
        "their dependent slot -> table -> cache loads",
    ),
    "rerotate_warps": Knob(
        0,
        "0: rerotate_kernel's rule, as many warps as give each thread one 16-byte vector of each "
        "pair half, at most 4 (a 2048-element program: 4 for bf16 caches, 2 for fp8, whose 8-byte "
        "loads with 4 warps left W12-fp8 at 64.7% of copy against 71.4% with 2 on an H100, PERF_LOG "
        "v56); else this many warps per program",
    ),
    "whole_heads": Knob(
        None,
        "None: a normed rope_kernel launch holds each tensor's heads of a token whole (one head "
        "block in up to three power-of-two tiles, the binary decomposition of H: 40 = 32 + 8, no "
        "padded rows; its loads all in flight before the norm's sums, no second read) when the norm "
        "is across heads, or per head when q and k have one head count that the per-head blocks "
        "would pad (Flux's 24 heads in blocks of 16); the norm's backward across heads (its "
        "weight-gradient row then stays in registers over a program's tokens); True / False force "
        "it, per-head backwards included (sweeps: benchmarks/scripts/tune_dit.py)",
    ),
    "norm_warps": Knob(0, "0: norm_warps' rule for a normed rope_kernel launch; else this many warps"),
    "norm_bwd_warps": Knob(
        0, "0: the rule of plan_norm_backward (4 to 8); else this many warps for the norm's backward"
    ),
    "weight_pairs": Knob(
        True,
        "interleaved norm weights read as one 32- or 64-bit word per (2i, 2i+1) pair when 16-byte "
        "aligned (vectorized), instead of two strided element loads; False: the element loads",
    ),
    "norm_bwd_programs": Knob(
        1024,
        "rope_norm_backward_kernel programs along tokens, each walking its share of them and "
        "writing one float32 weight-gradient row per head block (summed with torch after): "
        "1024 fills an H200 and leaves few rows to sum",
    ),
    "pdl": Knob(
        None,
        "None: programmatic dependent launch for decode-sized calls on Hopper and later: "
        "a call's programs wait, resident, for the previous kernel instead of being launched "
        "after it (W3 under graph replay: 2.0 -> 1.3-1.5 us); True / False force it",
    ),
    "num_warps": Knob(0, "0: the rule below; else force this many warps for every launch (sweeps)"),
    "card_tuning": Knob(
        True,
        "a plain rotation's head loop takes its card's own rows of CARD_PLAIN where the card has "
        "them; False: every card takes the defaults (ROPEKIT_CARD_TUNING=0, for A / B runs)",
    ),
    "head_loop": Knob(
        None,
        "None: one program per token walking all head blocks when angles come from "
        "a table (the position -> row chain runs once per token) and the call is not "
        "decode-sized; decode-sized calls keep a program per head block (parallelism)",
    ),
    "prefetch": Knob(
        None,
        "None: with the head loop, issue the next head block's loads before this "
        "block's stores, except for M-RoPE, whose three masked row loads already "
        "hold the registers (prefetching there lowered occupancy and W4), normed "
        "launches (W14's whole heads at 2 warps: 92% of copy without, 83% with k's "
        "tiles prefetched during q's norm, which costs two of six programs an SM) and "
        "angles computed in the kernel (W15 1-2% faster without; W2 and W6 1% slower "
        "without, so table-driven launches keep it)",
    ),
}

_values: Dict[str, object] = {}

# A card's own launches for the plain rotation's head loop (table angles, no norm, no M-RoPE, no
# per-head table, every column stride 1, not decode-sized), where its sweep and the bench found the
# defaults (block_elems, the warps rule) behind: by card-name prefix, rows of (rotated elements a
# token from, up to, block_elems, warps), the first row that holds the token's count wins; no row:
# the defaults. H100 (PERF_LOG v48, the bench with ROPEKIT_CARD_TUNING=0 / 1 in one call): W2 (9216
# elements a token) 95.3% -> 97.3% of copy with 4096 / 8 warps, W6 (8256) 87.5% -> 88.8%. W1 (5120),
# whose sweep preferred 1024 / 4 warps, gained nothing in the bench; a strided last dim (W2-STRIDED)
# fell from 57% to 30% with 4096 / 8, so strided calls take their own knobs (strided_plain).
CARD_PLAIN: Dict[str, Tuple[Tuple[int, int, int, int], ...]] = {
    "NVIDIA H100": ((8192, 1 << 62, 4096, 8),),
}
_CARD_NAMES: Dict[int, str] = {}
_OVERRIDDEN: Dict[str, int] = {}  # knobs set by the override blocks now open (nested blocks count)


def _from_env(name: str, knob: Knob):
    raw = os.environ.get(f"ROPEKIT_{name.upper()}")
    if raw is None or raw == "":
        return knob.default
    if knob.default is None or isinstance(knob.default, bool):
        return {"0": False, "1": True}.get(raw, knob.default)
    return type(knob.default)(raw)


def get(name: str):
    """The knob's value now (an override, else the environment, else the default)."""
    if name not in _values:
        _values[name] = _from_env(name, KNOBS[name])
    return _values[name]


def decode_sized(n_tokens: int) -> bool:
    return n_tokens < get("decode_tokens")


def warps(head_loop: bool, mrope: bool, n_tokens: int, store: bool = False, elems: int = 2048) -> int:
    """Warps per program: decode_warps for decode-sized calls; else for rope_kernel's head loop (a
    program walks many blocks) one per 512 elements of a head block, up to 4 (W1 / W2's blocks of
    2048 with 4; W15's of 1024, angles computed per token, 59% of copy with 4 and 92% with 2); 2 for
    the store's (its blocks are smaller), with M-RoPE's three table rows, and for large calls with a
    program per head block."""
    forced = get("num_warps")
    if forced:
        return int(forced)
    if decode_sized(n_tokens):
        return get("decode_warps")
    if head_loop and not mrope and not store:
        return max(1, min(4, elems // 512))
    return 2


def card_plain(device, elems: int) -> Optional[Tuple[int, int]]:
    """(block_elems, warps) of a plain rotation's head loop on this device from CARD_PLAIN, for a
    token of `elems` rotated elements (q's and k's heads x their padded pair width x 2); None for the
    defaults: no row for the card or the count, a CPU tensor, card_tuning off, or block_elems /
    num_warps set (an override or the environment: tests and sweeps choose the layout)."""
    if device.type != "cuda" or not get("card_tuning") or _is_set("block_elems") or _is_set("num_warps"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _CARD_NAMES.get(index)
    if name is None:
        name = _CARD_NAMES[index] = torch.cuda.get_device_name(index)
    return plain_rows(name, elems)


def strided_plain() -> Optional[Tuple[int, int]]:
    """(block_elems, warps) of a plain rotation's head loop that reads or writes a last dim of
    stride other than 1 (the knobs strided_block_elems / strided_warps); None when block_elems or
    num_warps is set (an override or the environment: tests and sweeps choose the layout)."""
    if _is_set("block_elems") or _is_set("num_warps"):
        return None
    return get("strided_block_elems"), get("strided_warps")


def plain_rows(card: str, elems: int) -> Optional[Tuple[int, int]]:
    """CARD_PLAIN's (block_elems, warps) for a card name and a token's rotated elements, or None."""
    for prefix, rows in CARD_PLAIN.items():
        if card.startswith(prefix):
            for lo, hi, block_elems, warps in rows:
                if lo <= elems <= hi:
                    return block_elems, warps
    return None


def _is_set(name: str) -> bool:
    """Is the knob set, by an override block or the environment?"""
    return _OVERRIDDEN.get(name, 0) > 0 or os.environ.get(f"ROPEKIT_{name.upper()}", "") != ""


@contextlib.contextmanager
def override(**values):
    """Set knobs for a block: `with ropekit.core.tuning.override(head_loop=True): ...`."""
    unknown = [n for n in values if n not in KNOBS]
    if unknown:
        raise ValueError(f"ropekit.core.tuning.override: knobs: expected names from {sorted(KNOBS)}, got {unknown}")
    before: Dict[str, Optional[object]] = {n: _values.get(n) for n in values}
    had = {n: n in _values for n in values}
    _values.update(values)
    for n in values:
        _OVERRIDDEN[n] = _OVERRIDDEN.get(n, 0) + 1
    _changed()
    try:
        yield
    finally:
        for n in values:
            _OVERRIDDEN[n] -= 1
            if had[n]:
                _values[n] = before[n]
            else:
                _values.pop(n, None)
        _changed()


def _changed() -> None:
    memo.clear()
