"""Launch-shape knobs of ropekit's kernels: one table, with the reason for each default.

The defaults are what the H200 sweeps picked (benchmarks/tune_core.py; the measurements and their
history are in benchmarks/PERF_LOG.md). `override(...)` changes them for a block (tests force each
program layout, the sweep tries each setting); `ROPEKIT_<NAME>` environment variables set them for
a process. Changing a knob drops every memoized plan, so the next call plans again.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, NamedTuple, Optional


class Knob(NamedTuple):
    default: object
    why: str


KNOBS: Dict[str, Knob] = {
    "block_elems": Knob(
        2048,
        "rope_kernel elements per program (heads x rotated dims): 2048 fills the "
        "H200's memory pipeline with 2-4 warps; 1024 and 4096 were slower on W1/W2",
    ),
    "program_block_elems": Knob(
        2048,
        "rope_kernel elements per program with a program per head block (decode-sized "
        "calls, per-token angles): the latency of one dependent position -> table chain per program",
    ),
    "store_block_elems": Knob(
        1024,
        "rope_store_kernel elements per program: its q, k and v programs "
        "each write scattered cache rows, smaller tiles keep more in flight",
    ),
    "store_loop_block_elems": Knob(
        4096,
        "rope_store_kernel elements per head block with the head loop (one program per token): "
        "a block of 32 heads of 128 takes Llama-3-8B's q in one step",
    ),
    "store_head_loop": Knob(
        None,
        "None: one program per token walking q's, k's and v's head blocks (slot and angles "
        "read once) from head_loop_min_tokens tokens; decode-sized calls keep a program per block",
    ),
    "rerotate_block_elems": Knob(
        2048,
        "rerotate_kernel rotated elements per program (rows x heads x dims): "
        "rows are gathered by slot, so a program takes several to overlap "
        "their dependent slot -> table -> cache loads",
    ),
    "pdl": Knob(
        None,
        "None: programmatic dependent launch for decode-sized calls (no head loop) on "
        "Hopper and later, so a call's launch overlaps the previous kernel's tail; "
        "large calls gain nothing from it",
    ),
    "num_warps": Knob(0, "0: the rule below; else force this many warps for every launch (sweeps)"),
    "head_loop": Knob(
        None,
        "None: one program per token walking all head blocks when angles come from "
        "a table (the position -> row chain runs once per token) and the call has "
        ">= 1024 tokens; decode-sized calls keep a program per head block (parallelism)",
    ),
    "head_loop_min_tokens": Knob(1024, "the token count from which the head loop is picked"),
    "prefetch": Knob(
        None,
        "None: with the head loop, issue the next head block's loads before this "
        "block's stores, except for M-RoPE, whose three masked row loads already "
        "hold the registers (prefetching there lowered occupancy and W4)",
    ),
}

_values: Dict[str, object] = {}


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


def warps(head_loop: bool, mrope: bool, store: bool = False) -> int:
    """Warps per program: 4 for the head loop (a program walks many blocks), 2 with M-RoPE's three
    table rows, and without the loop (more, smaller programs won on W3 and W7-T64)."""
    forced = get("num_warps")
    if forced:
        return int(forced)
    return 4 if head_loop and not mrope else 2


@contextlib.contextmanager
def override(**values):
    """Set knobs for a block: `with ropekit.tuning.override(head_loop=True): ...`."""
    unknown = [n for n in values if n not in KNOBS]
    if unknown:
        raise ValueError(f"ropekit.tuning.override: knobs: expected names from {sorted(KNOBS)}, got {unknown}")
    before: Dict[str, Optional[object]] = {n: _values.get(n) for n in values}
    had = {n: n in _values for n in values}
    _values.update(values)
    _changed()
    try:
        yield
    finally:
        for n in values:
            if had[n]:
                _values[n] = before[n]
            else:
                _values.pop(n, None)
        _changed()


def _changed() -> None:
    from . import pipeline

    pipeline.clear()
