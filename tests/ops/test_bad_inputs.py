"""The bad-input matrix of docs/bad_inputs.md: one test per row, and a test that the two agree.

ROWS mirrors the doc's first table (every invalid input class of apply_rope, rotate_with_angles
and apply_rope_and_store, and of rope_qkv_projection's paged-cache write; its other arguments'
rows are in tests/triton_kernels/test_qkv_gemm.py): each row runs the op on fresh CPU tensors and checks the exception
type, the message fragment, that the message names the op, and that no tensor argument was
written (bit for bit). HANDLED mirrors the doc's second table: bad values that are not errors by
design (NaN rows, padding slots, ...), each checked for what the doc promises. GAPS mirrors the
third: aliasing the checks do not catch yet, each a strict xfail that turns into a failure (XPASS)
once the library refuses it, so the doc and the test get updated together.

On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1 without CUDA).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch

import ropekit
from ropekit.api.store import apply_rope_and_store
from ropekit.core import memo, pipeline, plans, strict
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md"
NAN = float("nan")
T, HQ, HK, D = 4, 3, 2, 64
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

OPS = {
    "apply_rope": ropekit.apply_rope,
    "rotate_with_angles": ropekit.rotate_with_angles,
    "apply_rope_and_store": apply_rope_and_store,
    "rope_qkv_projection": ropekit.rope_qkv_projection,
}


# ---------------------------------------------------------------------------------------------
# valid arguments of each op, and edits that make them invalid


def rope_args(**change):
    """apply_rope in place (so that "nothing written" means something) on valid arguments, edited."""
    a = dict(
        q=torch.randn(T, HQ, D),
        k=torch.randn(T, HK, D),
        positions=torch.randint(0, 16, (T,)),
        cos_sin_cache=make_cache(16, D),
        inplace=True,
    )
    return _edit(a, change)


def angles_args(**change):
    ang = torch.rand(T, D // 2) * 6
    a = dict(q=torch.randn(T, HQ, D), k=torch.randn(T, HK, D), cos=ang.cos(), sin=ang.sin())
    return _edit(a, change)


def store_args(**change):
    base = torch.full((2, 2, 4, HK, D), NAN)  # k and v halves of one paged buffer
    a = dict(
        q=torch.randn(T, HQ, D),
        k=torch.randn(T, HK, D),
        v=torch.randn(T, HK, D),
        positions=torch.randint(0, 16, (T,)),
        cos_sin_cache=make_cache(16, D),
        k_cache=base[:, 0],
        v_cache=base[:, 1],
        slot_mapping=torch.tensor([0, 3, -1, 6]),
    )
    return _edit(a, change)


def fp4_args(**change):
    """apply_rope_and_store into NVFP4 caches: uint8 codes (2, 4, HK, D / 2) and float8_e4m3fn
    block scales (2, 4, HK, D / 16), poisoned (0xFF, NaN)."""
    codes = torch.full((2, 2, 4, HK, D // 2), 0xFF, dtype=torch.uint8)
    scales = torch.full((2, 2, 4, HK, D // 16), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    a = store_args(k_cache=codes[0], v_cache=codes[1], k_cache_scales=scales[0], v_cache_scales=scales[1])
    return _edit(a, change)


R_ = D // 2  # the rope part's width in the two-part rows (rotary_dim), the no-rope part's too


def parts_args(**change):
    """apply_rope_and_store with both heads in two parts: q (T, HQ, R_) and q_nope into a float32
    q_out (T, HQ, 2 R_); k (T, HK, R_) and k_nope beside v into 2 R_-wide cache rows."""
    return _edit(
        store_args(
            q=torch.randn(T, HQ, R_),
            k=torch.randn(T, HK, R_),
            cos_sin_cache=make_cache(16, R_),
            q_nope=torch.randn(T, HQ, R_),
            k_nope=torch.randn(T, HK, R_),
            q_out=torch.full((T, HQ, D), NAN),
        ),
        change,
    )


def rope_parts_args(**change):
    """apply_rope out of place with q in two parts: q (T, HQ, R_) and q_nope into q_out (T, HQ, 2 R_)."""
    return _edit(
        rope_args(
            inplace=False,
            q=torch.randn(T, HQ, R_),
            k=torch.randn(T, HK, R_),
            cos_sin_cache=make_cache(16, R_),
            q_nope=torch.randn(T, HQ, R_),
            q_out=torch.full((T, HQ, D), NAN),
        ),
        change,
    )


def qkv_args(**change):
    """rope_qkv_projection writing a paged cache: x (T, 32) projected to HQ + 2 HK heads of D, k and
    v into the halves of one (2, 2, 4, HK, D) buffer (on CPU "auto" is the unfused path)."""
    base = torch.full((2, 2, 4, HK, D), NAN)
    a = dict(
        x=torch.randn(T, 32),
        weight=torch.randn((HQ + 2 * HK) * D, 32),
        positions=torch.randint(0, 16, (T,)),
        cos_sin_cache=make_cache(16, D),
        num_q_heads=HQ,
        num_kv_heads=HK,
        head_dim=D,
        k_cache=base[:, 0],
        v_cache=base[:, 1],
        slot_mapping=torch.tensor([0, 3, -1, 6]),
    )
    return _edit(a, change)


def head_table(heads: int) -> torch.Tensor:
    """A per-head [cos | sin] table (16, heads, D) of random angles."""
    ang = torch.rand(16, heads, D // 2) * 6
    return torch.cat((ang.cos(), ang.sin()), -1)


def _edit(a, change):
    for name, fn in change.items():
        a[name] = fn(a) if callable(fn) else fn
    return a


def bits(x):
    return x.view(INT_OF_SIZE[x.element_size()])


class Row(NamedTuple):
    id: str
    op: str
    input_class: str  # the doc's words
    example: str  # the doc's words
    exc: type
    fragment: str  # in the message, verbatim
    make: Callable[[], dict]  # the op's arguments, by name
    strict: bool = False  # run under ropekit.strict()


R = Row
ROWS = [
    # ---- apply_rope --------------------------------------------------------------------------
    R(
        "rope-q-type",
        "apply_rope",
        "q not a tensor",
        "q=[1.0]",
        TypeError,
        "q: expected a torch.Tensor, got list",
        lambda: rope_args(q=[1.0]),
    ),
    R(
        "rope-q-rank",
        "apply_rope",
        "q of the wrong rank",
        "q of shape (3, 64)",
        ValueError,
        "q: expected a 3-D or 4-D tensor",
        lambda: rope_args(q=lambda a: a["q"][0]),
    ),
    R(
        "rope-q-dtype",
        "apply_rope",
        "q of an unsupported dtype",
        "float64 q",
        ValueError,
        "q: expected dtype in (float16, bfloat16, float32), got float64",
        lambda: rope_args(q=lambda a: a["q"].double()),
    ),
    R(
        "rope-out-last-stride",
        "apply_rope",
        "destination's last dim not unit-stride",
        "q_out = x[..., ::2]",
        ValueError,
        "q_out: expected stride 1 in the last dimension",
        lambda: rope_args(inplace=False, q_out=torch.full((T, HQ, 2 * D), NAN)[..., ::2]),
    ),
    R(
        "rope-out-shape",
        "apply_rope",
        "destination of another shape",
        "k_out of shape (4, 3, 64), k (4, 2, 64)",
        ValueError,
        "k_out: expected shape (4, 2, 64) (that of k), got shape (4, 3, 64)",
        lambda: rope_args(inplace=False, k_out=torch.full((T, HQ, D), NAN)),
    ),
    R(
        "rope-out-dtype",
        "apply_rope",
        "destination not of the outputs' dtype",
        "float16 q_out, float32 q, no out_dtype",
        ValueError,
        "q_out: expected dtype in (float32), got float16",
        lambda: rope_args(inplace=False, q_out=torch.full((T, HQ, D), NAN).half()),
    ),
    R(
        "rope-out-in-place",
        "apply_rope",
        "destination with inplace=True",
        "q_out given, inplace=True",
        ValueError,
        "q_out: expected None when inplace=True (in place writes q and k themselves)",
        lambda: rope_args(q_out=torch.full((T, HQ, D), NAN)),
    ),
    R(
        "rope-out-without-k",
        "apply_rope",
        "k_out without k",
        "k=None, k_out given",
        ValueError,
        "k_out: expected None when k is None",
        lambda: rope_args(inplace=False, k=None, k_out=torch.full((T, HK, D), NAN)),
    ),
    R(
        "rope-out-grad",
        "apply_rope",
        "destination while autograd records the call",
        "q.requires_grad_(), q_out given",
        ValueError,
        "q_out: expected None while q or k requires grad (results written into given tensors are not "
        "differentiable, as with torch's out=)",
        lambda: rope_args(
            inplace=False, q=torch.randn(T, HQ, D, requires_grad=True), q_out=torch.full((T, HQ, D), NAN)
        ),
    ),
    R(
        "rope-out-self-overlap",
        "apply_rope",
        "destination whose elements overlap",
        "q_out = x.expand(4, 3, 64)",
        ValueError,
        "q_out: expected a tensor without broadcast (stride 0) or overlapping dims (it is written)",
        lambda: rope_args(inplace=False, q_out=torch.full((T, 1, D), NAN).expand(T, HQ, D)),
    ),
    R(
        "rope-out-is-input",
        "apply_rope",
        "destination overlapping an input",
        "q_out = q",
        ValueError,
        "q: expected memory disjoint from q_out (which is written), got a tensor overlapping q_out",
        lambda: rope_args(inplace=False, q_out=lambda a: a["q"]),
    ),
    R(
        "rope-out-is-table",
        "apply_rope",
        "destination overlapping cos_sin_cache",
        "k_out = cos_sin_cache[:8].view(4, 2, 64)",
        ValueError,
        "cos_sin_cache: expected memory disjoint from k_out (which is written)",
        lambda: rope_args(inplace=False, k_out=lambda a: a["cos_sin_cache"][:8].view(T, HK, D)),
    ),
    R(
        "rope-outs-overlap",
        "apply_rope",
        "q_out and k_out overlap",
        "q_out = buf[:, :3], k_out = buf[:, 2:4]",
        ValueError,
        "k_out: expected memory disjoint from q_out (both are written), got a tensor overlapping q_out",
        lambda: _outs_overlap(),
    ),
    R(
        "rope-sbhd-positions",
        "apply_rope",
        "positions not (S, B) with layout='sbhd'",
        "positions of shape (3, 4), q (4, 3, 2, 64)",
        ValueError,
        "positions: expected shape (4, 3) ((S, B) with layout='sbhd'; size-1 dims broadcast), got shape (3, 4)",
        lambda: rope_args(
            q=torch.randn(T, 3, 2, D), k=None, positions=torch.zeros(3, T, dtype=torch.long), layout="sbhd"
        ),
    ),
    R(
        "rope-flag-not-bool",
        "apply_rope",
        "a boolean flag's keyword not a bool",
        "inverse=1",
        TypeError,
        "inverse: expected a bool, got int",
        lambda: rope_args(inverse=1),
    ),
    R(
        "rope-rotary-position-value",
        "apply_rope",
        "rotary_position not 'first', 'last' or 'halves'",
        "rotary_position='end'",
        ValueError,
        "rotary_position: expected 'first', 'last' or 'halves', got 'end'",
        lambda: rope_args(cos_sin_cache=make_cache(16, 32), rotary_position="end"),
    ),
    R(
        "rope-rotary-position-norm",
        "apply_rope",
        "rotary_position='last' with a fused norm",
        "rotary_position='last', q_norm_weight given",
        ValueError,
        "rotary_position: expected 'first' with q_norm_weight / k_norm_weight (the fused norm covers the head "
        "from dim 0), got 'last'",
        lambda: rope_args(
            inplace=False, cos_sin_cache=make_cache(16, 32), rotary_position="last", q_norm_weight=torch.ones(D)
        ),
    ),
    R(
        "rope-halves-interleaved",
        "apply_rope",
        "rotary_position='halves' with interleaved pairs",
        "rotary_position='halves', interleaved=True",
        ValueError,
        "interleaved: expected False with rotary_position='halves' (its pairs are (i, i + D/2)), got True",
        lambda: rope_args(cos_sin_cache=make_cache(16, 16), rotary_position="halves", interleaved=True),
    ),
    R(
        "rope-halves-odd-head",
        "apply_rope",
        "rotary_position='halves' with an odd head size",
        "q and k of head size 63",
        ValueError,
        "q: expected an even head size with rotary_position='halves' (pairs (i, i + D/2)), got shape (4, 3, 63)",
        lambda: rope_args(
            q=torch.randn(T, HQ, 63),
            k=torch.randn(T, HK, 63),
            cos_sin_cache=make_cache(16, 16),
            rotary_position="halves",
        ),
    ),
    R(
        "rope-halves-head-sizes",
        "apply_rope",
        "rotary_position='halves' with q and k of different head sizes",
        "q of head size 64, k of 32",
        ValueError,
        "k: expected head size 64 (that of q) with rotary_position='halves' (one partner distance, D/2), "
        "got shape (4, 2, 32)",
        lambda: rope_args(k=torch.randn(T, HK, 32), cos_sin_cache=make_cache(16, 16), rotary_position="halves"),
    ),
    R(
        "rope-halves-rotary-dim",
        "apply_rope",
        "rotary_position='halves' with more pairs than D/2 (rotary_dim > D)",
        "a table of width 66, head size 64",
        ValueError,
        "q: expected a head size >= rotary_dim (66), got head size 64",
        lambda: rope_args(cos_sin_cache=make_cache(16, 66), rotary_position="halves"),
    ),
    R(
        "angles-q-last-stride",
        "rotate_with_angles",
        "q's last dim not unit-stride (apply_rope reads it through a copy)",
        "q = x[..., ::2]",
        ValueError,
        "q: expected stride 1 in the last dimension",
        lambda: angles_args(q=torch.randn(T, HQ, 2 * D)[..., ::2]),
    ),
    R(
        "angles-layout-sbhd",
        "rotate_with_angles",
        "layout='sbhd' (apply_rope's only)",
        "layout='sbhd'",
        ValueError,
        "layout: expected 'thd' or 'bshd' (tokens first), 'bhsd' (Hugging Face's (B, H, S, D)) or None, got 'sbhd'",
        lambda: angles_args(
            q=torch.randn(1, T, HQ, D),
            k=torch.randn(1, T, HK, D),
            cos=torch.ones(1, T, D // 2),
            sin=torch.zeros(1, T, D // 2),
            layout="sbhd",
        ),
    ),
    R(
        "rope-q-broadcast",
        "apply_rope",
        "broadcast (stride-0) q written in place",
        "q = x.expand(T, 3, 64)",
        ValueError,
        "q: expected a tensor without broadcast",
        lambda: rope_args(q=torch.randn(T, 1, D).expand(T, HQ, D)),
    ),
    R(
        "rope-k-token-dims",
        "apply_rope",
        "k's token dims differ from q's",
        "k of shape (5, 2, 64)",
        ValueError,
        "k: expected token dims (4,) (those of q)",
        lambda: rope_args(k=torch.randn(T + 1, HK, D)),
    ),
    R(
        "rope-k-rank",
        "apply_rope",
        "k's rank differs from q's",
        "k of shape (1, 4, 2, 64)",
        ValueError,
        "k: expected a 3-D tensor",
        lambda: rope_args(k=torch.randn(1, T, HK, D)),
    ),
    R(
        "rope-k-dtype",
        "apply_rope",
        "k's dtype differs from q's",
        "float16 k, float32 q",
        ValueError,
        "k: expected the dtype of q (float32), got float16",
        lambda: rope_args(k=lambda a: a["k"].half()),
    ),
    R(
        "rope-k-device",
        "apply_rope",
        "k on another device",
        "k on meta, q on cpu",
        ValueError,
        "k: expected a tensor on cpu (the device of q)",
        lambda: rope_args(k=lambda a: a["k"].to("meta")),
    ),
    R(
        "rope-table-rank",
        "apply_rope",
        "cos_sin_cache neither 2-D nor 3-D (per head)",
        "a (64,) row",
        ValueError,
        "cos_sin_cache: expected a 2-D or 3-D tensor (max_position, rotary_dim) or (max_position, heads, rotary_dim)",
        lambda: rope_args(cos_sin_cache=lambda a: a["cos_sin_cache"][0]),
    ),
    R(
        "rope-table-dtype",
        "apply_rope",
        "cos_sin_cache of an unsupported dtype",
        "float64 table",
        ValueError,
        "cos_sin_cache: expected dtype in (float32, bfloat16, float16), got float64",
        lambda: rope_args(cos_sin_cache=lambda a: a["cos_sin_cache"].double()),
    ),
    R(
        "rope-table-grad",
        "apply_rope",
        "cos_sin_cache requires grad",
        "table.requires_grad_()",
        ValueError,
        "cos_sin_cache: expected a tensor that does not require grad",
        lambda: rope_args(cos_sin_cache=lambda a: a["cos_sin_cache"].requires_grad_(), inplace=False),
    ),
    R(
        "rope-rotary-type",
        "apply_rope",
        "rotary_dim not an int",
        "rotary_dim=64.0",
        TypeError,
        "rotary_dim: expected an int or None, got float",
        lambda: rope_args(rotary_dim=64.0),
    ),
    R(
        "rope-rotary-odd",
        "apply_rope",
        "rotary_dim odd or not positive",
        "rotary_dim=63",
        ValueError,
        "rotary_dim: expected a positive even int, got 63",
        lambda: rope_args(rotary_dim=63),
    ),
    R(
        "rope-rotary-vs-table",
        "apply_rope",
        "rotary_dim differs from the table's width",
        "rotary_dim=32, table width 64",
        ValueError,
        "rotary_dim: expected the width of cos_sin_cache (64",
        lambda: rope_args(rotary_dim=32),
    ),
    R(
        "rope-head-too-small",
        "apply_rope",
        "head size smaller than rotary_dim",
        "k of head size 32, rotary_dim 64",
        ValueError,
        "k: expected a head size >= rotary_dim (64), got head size 32",
        lambda: rope_args(k=torch.randn(T, HK, 32)),
    ),
    R(
        "rope-positions-dtype",
        "apply_rope",
        "positions not int32/int64",
        "float32 positions",
        ValueError,
        "positions: expected dtype in (int32, int64), got float32",
        lambda: rope_args(positions=lambda a: a["positions"].float()),
    ),
    R(
        "rope-positions-shape",
        "apply_rope",
        "positions' shape differs from the token dims",
        "positions of shape (2,)",
        ValueError,
        "positions: expected shape (4,) (*T, the token dims of q), got shape (2,)",
        lambda: rope_args(positions=lambda a: a["positions"][:2]),
    ),
    R(
        "rope-positions-none",
        "apply_rope",
        "positions=None past the table",
        "4 tokens, a 3-row table",
        ValueError,
        "positions: expected explicit positions: None means arange(4)",
        lambda: rope_args(positions=None, cos_sin_cache=make_cache(3, D)),
    ),
    R(
        "rope-positions-strict",
        "apply_rope",
        "position out of range, strict mode",
        "positions [0, 16, 1, 2], 16 rows",
        ValueError,
        "positions: expected values in [0, 16) (the rows of cos_sin_cache), got positions[1] = 16",
        lambda: rope_args(positions=torch.tensor([0, 16, 1, 2])),
        True,
    ),
    R(
        "rope-mrope-sum",
        "apply_rope",
        "mrope_section not summing to rotary_dim // 2",
        "mrope_section=(8, 8, 8)",
        ValueError,
        "mrope_section: expected sections summing to rotary_dim // 2 = 32, got (8, 8, 8) (sum 24)",
        lambda: rope_args(mrope_section=[8, 8, 8], positions=torch.zeros(3, T, dtype=torch.long)),
    ),
    R(
        "rope-mrope-form",
        "apply_rope",
        "mrope_section not N >= 1 non-negative ints",
        "mrope_section=(16, -16)",
        ValueError,
        "mrope_section: expected N >= 1 non-negative ints (pairs per position row), got [16, -16]",
        lambda: rope_args(mrope_section=[16, -16]),
    ),
    R(
        "rope-mrope-rows",
        "apply_rope",
        "M-RoPE positions with a row count other than the sections'",
        "mrope_section=(8, 8, 8, 8), positions (3, 4)",
        ValueError,
        "positions: expected shape (4, 4) ((4, *T) for M-RoPE), got shape (3, 4)",
        lambda: rope_args(mrope_section=[8, 8, 8, 8], positions=torch.zeros(3, T, dtype=torch.long)),
    ),
    R(
        "rope-mrope-layout-name",
        "apply_rope",
        "mrope_layout an unknown preset",
        "mrope_layout='qwen'",
        ValueError,
        "mrope_layout: expected one of ('chunked', 'interleaved', 'ernie', 'bailing', 'pangu') or a sequence of row "
        "indices, got 'qwen'",
        lambda: rope_args(mrope_section=[16, 16], positions=torch.zeros(2, T, dtype=torch.long), mrope_layout="qwen"),
    ),
    R(
        "rope-mrope-layout-type",
        "apply_rope",
        "mrope_layout neither a name nor a sequence",
        "mrope_layout=3",
        ValueError,
        "mrope_layout: expected a preset name ('chunked', 'interleaved', 'ernie', 'bailing', 'pangu') or a sequence "
        "of row indices, got int",
        lambda: rope_args(mrope_section=[16, 16], positions=torch.zeros(2, T, dtype=torch.long), mrope_layout=3),
    ),
    R(
        "rope-mrope-layout-length",
        "apply_rope",
        "an explicit mrope_layout whose length is not rotary_dim // 2",
        "mrope_section=(16, 16), mrope_layout of 16 entries",
        ValueError,
        "mrope_layout: expected 32 row indices (one per rotary pair), got [0, 1, 0, 1, 0, 1, 0, 1] ... (16 entries)",
        lambda: rope_args(
            mrope_section=[16, 16], positions=torch.zeros(2, T, dtype=torch.long), mrope_layout=[0, 1] * 8
        ),
    ),
    R(
        "rope-mrope-layout-value",
        "apply_rope",
        "an explicit mrope_layout naming a row past the sections",
        "mrope_section=(16, 16), mrope_layout[31] = 2",
        ValueError,
        "mrope_layout: expected row indices in [0, 2) (one per section), got mrope_layout[31] = 2",
        lambda: rope_args(
            mrope_section=[16, 16], positions=torch.zeros(2, T, dtype=torch.long), mrope_layout=[0] * 31 + [2]
        ),
    ),
    R(
        "rope-mrope-layout-alone",
        "apply_rope",
        "mrope_layout without mrope_section",
        "mrope_layout='ernie'",
        ValueError,
        "mrope_layout: expected mrope_section to be given with it, got mrope_section=None",
        lambda: rope_args(mrope_layout="ernie"),
    ),
    R(
        "rope-mrope-layout-interleaved",
        "apply_rope",
        "mrope_interleaved=True with another mrope_layout",
        "mrope_interleaved=True, mrope_layout='ernie'",
        ValueError,
        "mrope_interleaved: expected False with mrope_layout (the layout names the order), got True",
        lambda: rope_args(
            mrope_section=[12, 12, 8],
            positions=torch.zeros(3, T, dtype=torch.long),
            mrope_layout="ernie",
            mrope_interleaved=True,
        ),
    ),
    R(
        "rope-mrope-ernie-sections",
        "apply_rope",
        "mrope_layout='ernie' (or 'bailing') with unequal spatial sections",
        "mrope_section=(10, 12, 10), mrope_layout='ernie'",
        ValueError,
        "mrope_section: expected equal spatial sections s_a for mrope_layout='ernie': (s_1, ..., s_{N-1}, t), "
        "got (10, 12, 10)",
        lambda: rope_args(
            mrope_section=[10, 12, 10], positions=torch.zeros(3, T, dtype=torch.long), mrope_layout="ernie"
        ),
    ),
    R(
        "rope-mrope-pangu-sections",
        "apply_rope",
        "mrope_layout='pangu' of 3 rows or more with an empty first section",
        "mrope_section=(0, 16, 16), mrope_layout='pangu'",
        ValueError,
        "mrope_section: expected a first section >= 1 for mrope_layout='pangu' with 3 rows or more, got (0, 16, 16)",
        lambda: rope_args(
            mrope_section=[0, 16, 16], positions=torch.zeros(3, T, dtype=torch.long), mrope_layout="pangu"
        ),
    ),
    R(
        "rope-mrope-positions",
        "apply_rope",
        "M-RoPE with (T,) positions",
        "mrope_section=(8, 12, 12), positions (4,)",
        ValueError,
        "positions: expected a 2-D tensor (3, 4), got shape (4,)",
        lambda: rope_args(mrope_section=[8, 12, 12]),
    ),
    R(
        "rope-mrope-interleaved-alone",
        "apply_rope",
        "mrope_interleaved without mrope_section",
        "mrope_interleaved=True",
        ValueError,
        "mrope_interleaved: expected mrope_section to be given with it",
        lambda: rope_args(mrope_interleaved=True),
    ),
    R(
        "rope-inplace-overlap",
        "apply_rope",
        "q and k overlap, in place",
        "k = q[:, 1:]",
        ValueError,
        "k: expected memory disjoint from q when inplace=True, got a tensor overlapping q",
        lambda: rope_args(k=lambda a: a["q"][:, 1:]),
    ),
    R(
        "rope-inplace-same",
        "apply_rope",
        "k is q, in place",
        "apply_rope(q, q, ..., inplace=True)",
        ValueError,
        "k: expected memory disjoint from q when inplace=True",
        lambda: rope_args(k=lambda a: a["q"]),
    ),
    R(
        "rope-inplace-grad-leaf",
        "apply_rope",
        "in place on a leaf tensor that requires grad",
        "q.requires_grad_()",
        ValueError,
        "q: expected a tensor that is not a leaf requiring grad (nor a view of one) when inplace=True",
        lambda: rope_args(q=lambda a: a["q"].requires_grad_()),
    ),
    R(
        "rope-norm-inverse",
        "apply_rope",
        "inverse=True with a norm weight",
        "inverse=True, q_norm_weight=w",
        ValueError,
        "inverse: expected False with q_norm_weight / k_norm_weight",
        lambda: rope_args(inplace=False, inverse=True, q_norm_weight=torch.ones(D)),
    ),
    R(
        "rope-norm-inplace-grad",
        "apply_rope",
        "in place with a norm weight while autograd records the call",
        "q = x * 1.0 of an x that requires grad, inplace=True, q_norm_weight=w",
        ValueError,
        "inplace: expected False with q_norm_weight / k_norm_weight while autograd records the call",
        lambda: rope_args(q=lambda a: a["q"].requires_grad_() * 1.0, q_norm_weight=torch.ones(D)),
    ),
    R(
        "rope-layout-value",
        "apply_rope",
        "layout not one of 'thd', 'bshd', 'bhsd', 'sbhd'",
        "layout='BHSD'",
        ValueError,
        "layout: expected 'thd' or 'bshd' (tokens first), 'bhsd' (Hugging Face's (B, H, S, D)), "
        "'sbhd' (Transformer Engine's (S, B, H, D)) or None, got 'BHSD'",
        lambda: rope_args(layout="BHSD"),
    ),
    R(
        "rope-layout-rank",
        "apply_rope",
        "layout that does not match q's rank",
        "layout='bshd', q of shape (4, 3, 64)",
        ValueError,
        "q: expected a 4-D tensor with layout='bshd', got shape (4, 3, 64)",
        lambda: rope_args(layout="bshd"),
    ),
    R(
        "rope-hf-layout",
        "apply_rope",
        "Hugging Face's (B, H, S, D) q without layout='bhsd' (H != S)",
        "q of shape (1, 3, 4, 64), positions (1, 4)",
        ValueError,
        "positions: expected shape (1, 3) (*T, the token dims of q), got shape (1, 4) (they fit q read as "
        "Hugging Face's (B, H, S, D): pass layout='bhsd')",
        lambda: rope_args(q=torch.randn(1, T, HQ, D).transpose(1, 2), k=None, positions=torch.arange(T)[None]),
    ),
    R(
        "rope-table-hf-cos",
        "apply_rope",
        "Hugging Face's cos (rows [f, f]) as cos_sin_cache",
        "cos_sin_cache = cat(f, f).cos() of 16 positions",
        ValueError,
        "got a (16, 64) tensor whose rows are [f, f], as Hugging Face's cos (and sin) are",
        lambda: rope_args(cos_sin_cache=lambda a: a["cos_sin_cache"][:, : D // 2].acos().repeat(1, 2).cos()),
    ),
    # ---- rotate_with_angles ------------------------------------------------------------------
    R(
        "angles-rotary-dim",
        "rotate_with_angles",
        "rotary_dim neither cos's width nor twice it",
        "rotary_dim=16, cos of width 32",
        ValueError,
        "rotary_dim: expected the width of cos (32: rotary_dim // 2, or rotary_dim for HF's [f, f] form) "
        "or twice it, got 16",
        lambda: angles_args(rotary_dim=16),
    ),
    R(
        "angles-full-width",
        "rotate_with_angles",
        "cos / sin of the head's width whose halves differ (not HF's [f, f])",
        "cos, sin of shape (4, 64), head size 64",
        ValueError,
        "q: expected a head size >= rotary_dim (128), got head size 64 (cos and sin are rotary_dim // 2 = 64 "
        "wide; Hugging Face's hold [f, f] over rotary_dim: pass rotary_dim=64, or cos[..., :32] and sin[..., :32])",
        lambda: angles_args(cos=torch.rand(T, D) + 0.1, sin=torch.rand(T, D) + 0.1),
    ),
    R(
        "angles-inplace-overlap",
        "rotate_with_angles",
        "q and k overlap, in place",
        "k = q, inplace=True",
        ValueError,
        "k: expected memory disjoint from q when inplace=True",
        lambda: angles_args(k=lambda a: a["q"], inplace=True),
    ),
    R(
        "angles-cos-type",
        "rotate_with_angles",
        "cos not a tensor",
        "cos=0.5",
        TypeError,
        "cos: expected a torch.Tensor, got float",
        lambda: angles_args(cos=0.5),
    ),
    R(
        "angles-cos-dtype",
        "rotate_with_angles",
        "cos of an unsupported dtype",
        "float64 cos",
        ValueError,
        "cos: expected dtype in (float32, bfloat16, float16), got float64",
        lambda: angles_args(cos=lambda a: a["cos"].double()),
    ),
    R(
        "angles-sin-mismatch",
        "rotate_with_angles",
        "sin's shape or dtype differs from cos's",
        "sin of shape (4, 16)",
        ValueError,
        "sin: expected the shape and dtype of cos (4, 32) float32, got (4, 16) float32",
        lambda: angles_args(sin=lambda a: a["sin"][:, :16]),
    ),
    R(
        "angles-broadcast",
        "rotate_with_angles",
        "cos/sin not broadcastable to the tokens",
        "cos, sin of shape (3, 32), 4 tokens",
        ValueError,
        "cos: expected a shape broadcastable to (4, 32), got shape (3, 32)",
        lambda: angles_args(cos=lambda a: a["cos"][:3], sin=lambda a: a["sin"][:3]),
    ),
    R(
        "angles-empty",
        "rotate_with_angles",
        "cos/sin with no frequency",
        "cos, sin of shape (4, 0)",
        ValueError,
        "cos: expected a last dim of rotary_dim // 2 >= 1",
        lambda: angles_args(cos=torch.ones(T, 0), sin=torch.ones(T, 0)),
    ),
    R(
        "angles-head-too-small",
        "rotate_with_angles",
        "head size smaller than 2 * cos.shape[-1]",
        "cos of shape (4, 40), head size 64",
        ValueError,
        "q: expected a head size >= rotary_dim (80), got head size 64",
        lambda: angles_args(cos=torch.rand(T, 40), sin=torch.rand(T, 40)),
    ),
    R(
        "angles-grad",
        "rotate_with_angles",
        "cos or sin requires grad",
        "cos.requires_grad_()",
        ValueError,
        "cos: expected a tensor that does not require grad",
        lambda: angles_args(cos=lambda a: a["cos"].requires_grad_()),
    ),
    R(
        "angles-mrope-sum",
        "rotate_with_angles",
        "mrope_section not summing to cos.shape[-1]",
        "mrope_section=(8, 8, 8), cos (3, 4, 32)",
        ValueError,
        "mrope_section: expected sections summing to rotary_dim // 2 = 32",
        lambda: angles_args(cos=torch.ones(3, T, 32), sin=torch.zeros(3, T, 32), mrope_section=[8, 8, 8]),
    ),
    R(
        "angles-mrope-layout-length",
        "rotate_with_angles",
        "an explicit mrope_layout whose length is not cos.shape[-1]",
        "mrope_section=(16, 16), cos (2, 4, 32), mrope_layout of 8 entries",
        ValueError,
        "mrope_layout: expected 32 row indices (one per rotary pair), got [0, 1, 0, 1, 0, 1, 0, 1] (8 entries)",
        lambda: angles_args(
            cos=torch.ones(2, T, 32), sin=torch.zeros(2, T, 32), mrope_section=[16, 16], mrope_layout=[0, 1] * 4
        ),
    ),
    # ---- apply_rope_and_store ----------------------------------------------------------------
    R(
        "store-k-none",
        "apply_rope_and_store",
        "k None",
        "k=None",
        TypeError,
        "k: expected a torch.Tensor, got NoneType",
        lambda: store_args(k=None),
    ),
    R(
        "store-head-table",
        "apply_rope_and_store",
        "a per-head table (max_position, heads, rotary_dim)",
        "a (16, 2, 64) table",
        ValueError,
        "cos_sin_cache: expected a (max_position, rotary_dim) table: the store's kernel reads one row per token "
        "(per-head tables are apply_rope's), got a per-head table of shape (16, 2, 64)",
        lambda: store_args(cos_sin_cache=head_table(2)),
    ),
    R(
        "store-rotary-position",
        "apply_rope_and_store",
        "rotary_position not 'first' or 'halves'",
        "rotary_position='last'",
        ValueError,
        "rotary_position: expected 'first' or 'halves', got 'last'",
        lambda: store_args(rotary_position="last"),
    ),
    R(
        "store-halves-interleaved",
        "apply_rope_and_store",
        "rotary_position='halves' with interleaved pairs",
        "rotary_position='halves', interleaved=True",
        ValueError,
        "interleaved: expected False with rotary_position='halves' (its pairs are (i, i + D/2)), got True",
        lambda: store_args(cos_sin_cache=make_cache(16, 16), rotary_position="halves", interleaved=True),
    ),
    R(
        "store-v-token-dims",
        "apply_rope_and_store",
        "v's token dims differ from q's",
        "v of shape (3, 2, 64)",
        ValueError,
        "v: expected token dims (4,) (those of q)",
        lambda: store_args(v=torch.randn(T - 1, HK, D)),
    ),
    R(
        "store-v-dtype",
        "apply_rope_and_store",
        "v of an unsupported dtype",
        "float64 v",
        ValueError,
        "v: expected dtype in (float16, bfloat16, float32), got float64",
        lambda: store_args(v=lambda a: a["v"].double()),
    ),
    R(
        "store-slots-dtype",
        "apply_rope_and_store",
        "slot_mapping not int32/int64",
        "float32 slot_mapping",
        ValueError,
        "slot_mapping: expected dtype in (int32, int64), got float32",
        lambda: store_args(slot_mapping=lambda a: a["slot_mapping"].float()),
    ),
    R(
        "store-slots-shape",
        "apply_rope_and_store",
        "slot_mapping's shape differs from the token dims",
        "slot_mapping of shape (3,)",
        ValueError,
        "slot_mapping: expected shape (4,) (the token dims of q), got shape (3,)",
        lambda: store_args(slot_mapping=lambda a: a["slot_mapping"][:3]),
    ),
    R(
        "store-cache-rank",
        "apply_rope_and_store",
        "cache not 3-D or 4-D",
        "k_cache of shape (2, 64)",
        ValueError,
        "k_cache: expected a 3-D or 4-D tensor (num_blocks, block_size, H, D) or (num_slots, H, D)",
        lambda: store_args(k_cache=lambda a: a["k_cache"][0, 0]),
    ),
    R(
        "store-cache-dtype",
        "apply_rope_and_store",
        "cache of an unsupported dtype",
        "int8 k_cache",
        ValueError,
        "k_cache: expected dtype in (float16, bfloat16, float32, float8_e4m3fn, float8_e5m2), got int8",
        lambda: store_args(k_cache=torch.zeros(2, 4, HK, D, dtype=torch.int8)),
    ),
    R(
        "store-cache-heads",
        "apply_rope_and_store",
        "cache head count differs from k's",
        "k_cache with 3 heads, k with 2",
        ValueError,
        "k_cache: expected (heads, head size) (2, 64), those of k, got shape (2, 4, 3, 64)",
        lambda: store_args(k_cache=torch.full((2, 4, HK + 1, D), NAN)),
    ),
    R(
        "store-cache-head-size",
        "apply_rope_and_store",
        "cache head size differs from v's",
        "v_cache head size 56, v 64",
        ValueError,
        "v_cache: expected (heads, head size) (2, 64), those of v, got shape (2, 4, 2, 56)",
        lambda: store_args(v_cache=torch.full((2, 4, HK, D - 8), NAN)),
    ),
    R(
        "store-cache-last-stride",
        "apply_rope_and_store",
        "cache's last dim not unit-stride",
        "k_cache = x[..., ::2]",
        ValueError,
        "k_cache: expected stride 1 in the last dimension",
        lambda: store_args(k_cache=torch.full((2, 4, HK, 2 * D), NAN)[..., ::2]),
    ),
    R(
        "store-cache-broadcast",
        "apply_rope_and_store",
        "broadcast (stride-0) cache",
        "k_cache = x.expand(2, 4, 2, 64)",
        ValueError,
        "k_cache: expected a tensor without broadcast",
        lambda: store_args(k_cache=torch.full((1, 4, HK, D), NAN).expand(2, 4, HK, D)),
    ),
    R(
        "store-cache-slot-dims",
        "apply_rope_and_store",
        "v_cache's slot dims differ from k_cache's",
        "flat v_cache (8, 2, 64), paged k_cache (2, 4, 2, 64)",
        ValueError,
        "v_cache: expected slot dims (2, 4), those of k_cache",
        lambda: store_args(v_cache=torch.full((8, HK, D), NAN)),
    ),
    R(
        "store-cache-device",
        "apply_rope_and_store",
        "cache on another device",
        "v_cache on meta",
        ValueError,
        "v_cache: expected a tensor on cpu (the device of q)",
        lambda: store_args(v_cache=lambda a: a["v_cache"].to("meta")),
    ),
    R(
        "store-q-broadcast",
        "apply_rope_and_store",
        "broadcast (stride-0) q (rotated in place)",
        "q = x.expand(4, 3, 64)",
        ValueError,
        "q: expected a tensor without broadcast",
        lambda: store_args(q=torch.randn(T, 1, D).expand(T, HQ, D)),
    ),
    R(
        "store-grad",
        "apply_rope_and_store",
        "a tensor that requires grad, grad mode on",
        "k_cache.requires_grad_()",
        ValueError,
        "k_cache: expected a tensor that does not require grad",
        lambda: store_args(k_cache=torch.full((2, 4, HK, D), NAN).requires_grad_()),
    ),
    R(
        "store-scale-type",
        "apply_rope_and_store",
        "scale of the wrong type",
        'v_scale="1.0" (or True)',
        TypeError,
        "v_scale: expected a float, a 1-element float32 tensor or None, got str",
        lambda: store_args(v_scale="1.0"),
    ),
    R(
        "store-scale-value",
        "apply_rope_and_store",
        "float scale not finite and > 0",
        "k_scale=-1.0 (or nan, inf, 0)",
        ValueError,
        "k_scale: expected a finite scale > 0, got -1.0",
        lambda: store_args(k_scale=-1.0),
    ),
    R(
        "store-scale-numel",
        "apply_rope_and_store",
        "tensor scale with more than one element",
        "v_scale=torch.ones(2)",
        ValueError,
        "v_scale: expected a 0-d or 1-element tensor (one per-tensor scale), got shape (2,)",
        lambda: store_args(v_scale=torch.ones(2)),
    ),
    R(
        "store-fp4-scales-missing",
        "apply_rope_and_store",
        "NVFP4 (uint8) caches without their block scales",
        "uint8 caches, v_cache_scales=None",
        ValueError,
        "v_cache_scales: expected the cache's float8_e4m3fn block scales (its cache is uint8: NVFP4), got None",
        lambda: fp4_args(v_cache_scales=None),
    ),
    R(
        "store-fp4-cache-dtype",
        "apply_rope_and_store",
        "block scales beside a cache that is not uint8",
        "k_cache_scales given, float32 caches",
        ValueError,
        "k_cache: expected dtype in (uint8), got float32",
        lambda: store_args(k_cache_scales=fp4_args()["k_cache_scales"], v_cache_scales=fp4_args()["v_cache_scales"]),
    ),
    R(
        "store-fp4-head-size",
        "apply_rope_and_store",
        "NVFP4 cache rows of a head size not a multiple of 16",
        "v and v_cache of head size 40",
        ValueError,
        "v_cache: expected NVFP4 rows of a head size that is a multiple of 16 (v: 40), got uint8",
        lambda: fp4_args(v=torch.randn(T, HK, 40), v_cache=torch.zeros(2, 4, HK, 20, dtype=torch.uint8)),
    ),
    R(
        "store-fp4-cache-width",
        "apply_rope_and_store",
        "NVFP4 cache rows not D / 2 bytes",
        "uint8 k_cache of D bytes",
        ValueError,
        "k_cache: expected (heads, head size) (2, 32), those of k as NVFP4 bytes (2 values a byte), got shape (2, 4, 2, 64)",
        lambda: fp4_args(k_cache=torch.zeros(2, 4, HK, D, dtype=torch.uint8)),
    ),
    R(
        "store-fp4-scales-dtype",
        "apply_rope_and_store",
        "block scales not float8_e4m3fn",
        "float16 k_cache_scales",
        ValueError,
        "k_cache_scales: expected dtype in (float8_e4m3fn), got float16",
        lambda: fp4_args(k_cache_scales=torch.zeros(2, 4, HK, D // 16, dtype=torch.float16)),
    ),
    R(
        "store-fp4-scales-shape",
        "apply_rope_and_store",
        "block scales not one per 16 values of the cache's rows",
        "k_cache_scales (2, 4, 2, 2) for 64-value rows",
        ValueError,
        "k_cache_scales: expected shape (2, 4, 2, 4) (one scale per 16 values of the cache's rows), got shape (2, 4, 2, 2)",
        lambda: fp4_args(k_cache_scales=fp4_args()["k_cache_scales"][..., :2]),
    ),
    R(
        "store-fp4-scales-overlap",
        "apply_rope_and_store",
        "block scales sharing memory with the other cache's",
        "v_cache_scales = k_cache_scales",
        ValueError,
        "v_cache_scales: expected memory disjoint from k_cache_scales (which is written)",
        lambda: fp4_args(v_cache_scales=lambda a: a["k_cache_scales"]),
    ),
    R(
        "store-fp4-rotary-dim",
        "apply_rope_and_store",
        "NVFP4 caches with a rotary_dim whose pairs split a 16-value block",
        "rotary_dim=16, halves",
        ValueError,
        "rotary_dim: expected a multiple of 32 with NVFP4 caches and halves (16-value blocks), got 16",
        lambda: fp4_args(cos_sin_cache=make_cache(16, 16), rotary_dim=16),
    ),
    R(
        "store-fp4-halves",
        "apply_rope_and_store",
        "NVFP4 caches with rotary_position='halves'",
        "rotary_position='halves'",
        ValueError,
        "rotary_position: expected 'first' with NVFP4 caches (p-RoPE's kept dims split the blocks), got 'halves'",
        lambda: fp4_args(cos_sin_cache=make_cache(16, 32), rotary_dim=32, rotary_position="halves"),
    ),
    R(
        "store-fp4-meta",
        "apply_rope_and_store",
        "NVFP4 caches through the custom ops (meta tensors, DTensor, torch.compile)",
        "every tensor on meta",
        ValueError,
        "k_cache: expected NVFP4 caches with plain tensors called eagerly (not DTensor, meta or compiled), got meta",
        lambda: {n: x.to("meta") if isinstance(x, torch.Tensor) else x for n, x in fp4_args().items()},
    ),
    R(
        "store-scale-dtype",
        "apply_rope_and_store",
        "tensor scale not float32",
        "float64 k_scale tensor",
        ValueError,
        "k_scale: expected dtype float32, got float64",
        lambda: store_args(k_scale=torch.ones(1, dtype=torch.float64)),
    ),
    R(
        "store-scale-device",
        "apply_rope_and_store",
        "tensor scale on another device",
        "v_scale on meta",
        ValueError,
        "v_scale: expected a tensor on cpu (the device of q)",
        lambda: store_args(v_scale=torch.ones(1, device="meta")),
    ),
    R(
        "store-scale-strict",
        "apply_rope_and_store",
        "tensor scale not finite and > 0, strict mode",
        "k_scale=torch.tensor(0.0)",
        ValueError,
        "k_scale: expected a finite scale > 0, got 0.0",
        lambda: store_args(k_scale=torch.tensor(0.0)),
        True,
    ),
    R(
        "store-slot-strict",
        "apply_rope_and_store",
        "slot past the cache, strict mode",
        "slot 8 of 8 slots",
        ValueError,
        "slot_mapping: expected values < 8 (num_blocks * block_size of the caches; < 0 skips a token), "
        "got slot_mapping[2] = 8",
        lambda: store_args(slot_mapping=torch.tensor([0, -1, 8, 3])),
        True,
    ),
    R(
        "store-positions-strict",
        "apply_rope_and_store",
        "position out of range, strict mode",
        "position -1",
        ValueError,
        "positions: expected values in [0, 16) (the rows of cos_sin_cache), got positions[3] = -1",
        lambda: store_args(positions=torch.tensor([0, 1, 2, -1])),
        True,
    ),
    R(
        "store-mrope-layout-name",
        "apply_rope_and_store",
        "mrope_layout an unknown preset",
        "mrope_section=(16, 16), mrope_layout='qwen'",
        ValueError,
        "mrope_layout: expected one of ('chunked', 'interleaved', 'ernie', 'bailing', 'pangu') or a sequence of row "
        "indices, got 'qwen'",
        lambda: store_args(positions=torch.zeros(2, T, dtype=torch.long), mrope_section=[16, 16], mrope_layout="qwen"),
    ),
    R(
        "store-caches-overlap",
        "apply_rope_and_store",
        "k_cache and v_cache overlap",
        "v_cache = k_cache",
        ValueError,
        "v_cache: expected memory disjoint from k_cache (which is written), got a tensor overlapping k_cache",
        lambda: store_args(v_cache=lambda a: a["k_cache"]),
    ),
    R(
        "store-caches-overlap-partly",
        "apply_rope_and_store",
        "k_cache and v_cache overlap partly",
        "v_cache = buf[1:], k_cache = buf[:2]",
        ValueError,
        "v_cache: expected memory disjoint from k_cache",
        lambda: _caches_overlap_partly(),
    ),
    R(
        "store-k-in-cache",
        "apply_rope_and_store",
        "k overlaps k_cache",
        "k = k_cache[0]",
        ValueError,
        "k: expected memory disjoint from k_cache (which is written)",
        lambda: store_args(k=lambda a: a["k_cache"][0]),
    ),
    R(
        "store-v-in-cache",
        "apply_rope_and_store",
        "v overlaps a cache",
        "v = v_cache[1]",
        ValueError,
        "v: expected memory disjoint from v_cache (which is written)",
        lambda: store_args(v=lambda a: a["v_cache"][1]),
    ),
    R(
        "store-k-in-v-cache",
        "apply_rope_and_store",
        "k overlaps v_cache",
        "k = v_cache[0]",
        ValueError,
        "k: expected memory disjoint from v_cache (which is written)",
        lambda: store_args(k=lambda a: a["v_cache"][0]),
    ),
    R(
        "store-q-in-cache",
        "apply_rope_and_store",
        "q overlaps a cache",
        "q = k_cache.view(8, 2, 64)[:4]",
        ValueError,
        "k_cache: expected memory disjoint from q (which is written)",
        lambda: _q_in_cache(),
    ),
    R(
        "store-k-overlaps-q",
        "apply_rope_and_store",
        "k or v overlaps q (rotated in place)",
        "k = q[:, 1:]",
        ValueError,
        "k: expected memory disjoint from q (which is written)",
        lambda: store_args(k=lambda a: a["q"][:, 1:]),
    ),
    # ---- apply_rope: heads in two parts (q_nope, k_nope) --------------------------------------
    R(
        "rope-q-nope-inplace",
        "apply_rope",
        "q_nope with inplace=True",
        "q_nope given, inplace=True",
        ValueError,
        "q_nope: expected None when inplace=True (the output is the whole head, a new tensor), got a tensor",
        lambda: rope_parts_args(inplace=True, q_out=None),
    ),
    R(
        "rope-k-nope-without-k",
        "apply_rope",
        "k_nope with k None",
        "k=None, k_nope given",
        ValueError,
        "k_nope: expected None when k is None, got a tensor",
        lambda: rope_parts_args(k=None, k_nope=torch.randn(T, HK, R_)),
    ),
    R(
        "rope-q-nope-norm",
        "apply_rope",
        "q_nope with q_norm_weight",
        "q_norm_weight=torch.ones(32)",
        ValueError,
        "q_nope: expected None with q_norm_weight (the norm covers a whole head, not one given in two parts)",
        lambda: rope_parts_args(q_norm_weight=torch.ones(R_)),
    ),
    R(
        "rope-q-nope-q-width",
        "apply_rope",
        "q wider than rotary_dim beside q_nope",
        "q of head size 64, rotary_dim 32",
        ValueError,
        "q: expected head size 32 (rotary_dim: with q_nope given, q is the rope part), got shape (4, 3, 64)",
        lambda: rope_parts_args(q=torch.randn(T, HQ, D), q_out=None),
    ),
    R(
        "rope-q-nope-heads",
        "apply_rope",
        "q_nope's head count differs from q's",
        "q_nope with 2 heads, q with 3",
        ValueError,
        "q_nope: expected token dims and heads (4, 3) (those of q), got shape (4, 2, 32)",
        lambda: rope_parts_args(q_nope=torch.randn(T, HQ - 1, R_)),
    ),
    R(
        "rope-q-nope-dtype",
        "apply_rope",
        "q_nope of an unsupported dtype",
        "float64 q_nope",
        ValueError,
        "q_nope: expected dtype in (float16, bfloat16, float32), got float64",
        lambda: rope_parts_args(q_nope=lambda a: a["q_nope"].double()),
    ),
    R(
        "rope-q-nope-out-shape",
        "apply_rope",
        "q_out not as wide as q and q_nope together",
        "q_out of shape (4, 3, 32)",
        ValueError,
        "q_out: expected shape (4, 3, 64) (q's head and q_nope's together), got shape (4, 3, 32)",
        lambda: rope_parts_args(q_out=torch.full((T, HQ, R_), NAN)),
    ),
    R(
        "rope-q-nope-in-out",
        "apply_rope",
        "q_nope overlaps q_out",
        "q_nope = q_out[..., 32:]",
        ValueError,
        "q_nope: expected memory disjoint from q_out (which is written)",
        lambda: rope_parts_args(q_nope=lambda a: a["q_out"][..., R_:]),
    ),
    R(
        "rope-q-nope-halves",
        "apply_rope",
        "q_nope with rotary_position='halves'",
        "q_nope given, rotary_position='halves'",
        ValueError,
        "q_nope: expected None with rotary_position='halves' (its pairs span the whole head), got a tensor",
        lambda: rope_parts_args(rotary_position="halves"),
    ),
    # ---- apply_rope: q_temperature (Llama 4's attention temperature: table angles by positions only)
    R(
        "rope-temperature-type",
        "apply_rope",
        "q_temperature not None nor a pair",
        "q_temperature=8192.0",
        ValueError,
        "q_temperature: expected None or a pair (floor_scale, attn_scale), got 8192.0",
        lambda: rope_args(q_temperature=8192.0),
    ),
    R(
        "rope-temperature-value",
        "apply_rope",
        "q_temperature with floor_scale <= 0 (or attn_scale < 0, or not finite)",
        "q_temperature=(0.0, 0.1)",
        ValueError,
        "q_temperature: expected floor_scale > 0 and attn_scale >= 0, both finite, got (0.0, 0.1)",
        lambda: rope_args(q_temperature=(0.0, 0.1)),
    ),
    R(
        "rope-temperature-freqs",
        "apply_rope",
        "q_temperature with inv_freq angles",
        "inv_freq given, q_temperature=(8192.0, 0.1)",
        ValueError,
        "q_temperature: expected None with inv_freq (table angles by positions only), got (8192.0, 0.1)",
        lambda: rope_args(cos_sin_cache=None, inv_freq=torch.ones(D // 2), q_temperature=(8192.0, 0.1)),
    ),
    R(
        "rope-temperature-packed",
        "apply_rope",
        "q_temperature with packed sequences",
        "cu_seqlens given, q_temperature=(8192.0, 0.1)",
        ValueError,
        "q_temperature: expected None with cu_seqlens (table angles by positions only), got (8192.0, 0.1)",
        lambda: rope_args(positions=None, cu_seqlens=torch.tensor([0, 2, T]), q_temperature=(8192.0, 0.1)),
    ),
    R(
        "rope-temperature-arange",
        "apply_rope",
        "q_temperature with positions None (arange)",
        "positions=None, q_temperature=(8192.0, 0.1)",
        ValueError,
        "q_temperature: expected None with positions None (table angles by positions only), got (8192.0, 0.1)",
        lambda: rope_args(positions=None, q_temperature=(8192.0, 0.1)),
    ),
    R(
        "rope-temperature-mrope",
        "apply_rope",
        "q_temperature with M-RoPE",
        "mrope_section given, q_temperature=(8192.0, 0.1)",
        ValueError,
        "q_temperature: expected None with mrope_section (table angles by positions only), got (8192.0, 0.1)",
        lambda: rope_args(
            mrope_section=[8, 12, 12], positions=torch.zeros(3, T, dtype=torch.long), q_temperature=(8192.0, 0.1)
        ),
    ),
    R(
        "rope-temperature-norm",
        "apply_rope",
        "q_temperature with a fused norm",
        "q_norm_weight given, q_temperature=(8192.0, 0.1)",
        ValueError,
        "q_temperature: expected None with q_norm_weight / k_norm_weight / l2_norm (table angles by positions only), got (8192.0, 0.1)",
        lambda: rope_args(q_norm_weight=torch.ones(D), q_temperature=(8192.0, 0.1)),
    ),
    R(
        "rope-temperature-fp8",
        "apply_rope",
        "q_temperature with fp8 outputs",
        "out_dtype=float8_e4m3fn, q_temperature=(8192.0, 0.1)",
        ValueError,
        "q_temperature: expected None with fp8 out_dtype or scales (table angles by positions only), got (8192.0, 0.1)",
        lambda: rope_args(inplace=False, out_dtype=torch.float8_e4m3fn, q_temperature=(8192.0, 0.1)),
    ),
    R(
        "rope-temperature-position",
        "apply_rope",
        "q_temperature with rotary_position other than 'first'",
        "rotary_position='last', q_temperature=(8192.0, 0.1)",
        ValueError,
        "q_temperature: expected None with rotary_position='last' (table angles by positions only), got (8192.0, 0.1)",
        lambda: rope_args(cos_sin_cache=make_cache(16, 32), rotary_position="last", q_temperature=(8192.0, 0.1)),
    ),
    R(
        "rope-temperature-nope",
        "apply_rope",
        "q_temperature with q_nope / k_nope",
        "q_nope given, q_temperature=(8192.0, 0.1)",
        ValueError,
        "q_temperature: expected None with q_nope / k_nope (table angles by positions only), got (8192.0, 0.1)",
        lambda: rope_parts_args(q_temperature=(8192.0, 0.1)),
    ),
    # ---- apply_rope / apply_rope_and_store: l2_norm (Llama 4's qk norm, no weight) ----------------
    R(
        "rope-l2-type",
        "apply_rope",
        "l2_norm not a bool",
        "l2_norm=1",
        TypeError,
        "l2_norm: expected a bool, got int",
        lambda: rope_args(l2_norm=1),
    ),
    R(
        "rope-l2-weight",
        "apply_rope",
        "l2_norm with a norm weight",
        "l2_norm=True, k_norm_weight=w",
        ValueError,
        "k_norm_weight: expected None with l2_norm=True (one norm a head: the weighted one, or l2_norm's), got a tensor",
        lambda: rope_args(l2_norm=True, k_norm_weight=torch.ones(D)),
    ),
    R(
        "rope-l2-offset",
        "apply_rope",
        "l2_norm with a weight offset",
        "l2_norm=True, norm_weight_offset=1.0",
        ValueError,
        "norm_weight_offset: expected 0.0 with l2_norm=True (it has no weight to offset), got 1.0",
        lambda: rope_args(l2_norm=True, norm_weight_offset=1.0),
    ),
    R(
        "rope-l2-inverse",
        "apply_rope",
        "l2_norm with inverse=True",
        "l2_norm=True, inverse=True",
        ValueError,
        "inverse: expected False with l2_norm=True (a de-rotation has no norm before it), got True",
        lambda: rope_args(l2_norm=True, inverse=True),
    ),
    R(
        "rope-l2-last",
        "apply_rope",
        "l2_norm with rotary_position='last'",
        "l2_norm=True, rotary_position='last'",
        ValueError,
        "rotary_position: expected 'first' with l2_norm=True (the fused norm covers the head from dim 0), got 'last'",
        lambda: rope_args(cos_sin_cache=make_cache(16, 32), l2_norm=True, rotary_position="last"),
    ),
    R(
        "rope-l2-nope",
        "apply_rope",
        "l2_norm with q_nope",
        "l2_norm=True, q_nope given",
        ValueError,
        "q_nope: expected None with l2_norm=True (the norm covers a whole head, not one given in two parts)",
        lambda: rope_parts_args(l2_norm=True),
    ),
    R(
        "store-l2-weight",
        "apply_rope_and_store",
        "l2_norm with a norm weight",
        "l2_norm=True, q_norm_weight=w",
        ValueError,
        "q_norm_weight: expected None with l2_norm=True (one norm a head: the weighted one, or l2_norm's), got a tensor",
        lambda: store_args(l2_norm=True, q_norm_weight=torch.ones(D)),
    ),
    # ---- apply_rope: eager_rounding (eager PyTorch's roundings in q's 16-bit dtype) ----------------
    R(
        "rope-eager-type",
        "apply_rope",
        "eager_rounding not a bool",
        "eager_rounding=1",
        TypeError,
        "eager_rounding: expected a bool, got int",
        lambda: rope_args(eager_rounding=1),
    ),
    R(
        "rope-eager-norm",
        "apply_rope",
        "eager_rounding with a fused norm",
        "q, k bf16, q_norm_weight given, eager_rounding=True",
        ValueError,
        "eager_rounding: expected False with q_norm_weight (it rounds the rotation only), got True",
        lambda: rope_args(
            q=torch.randn(T, HQ, D, dtype=torch.bfloat16),
            k=torch.randn(T, HK, D, dtype=torch.bfloat16),
            q_norm_weight=torch.ones(D),
            eager_rounding=True,
        ),
    ),
    R(
        "rope-eager-l2",
        "apply_rope",
        "eager_rounding with l2_norm",
        "q, k fp16, l2_norm=True, eager_rounding=True",
        ValueError,
        "eager_rounding: expected False with l2_norm=True (it rounds the rotation only), got True",
        lambda: rope_args(
            q=torch.randn(T, HQ, D, dtype=torch.float16),
            k=torch.randn(T, HK, D, dtype=torch.float16),
            l2_norm=True,
            eager_rounding=True,
        ),
    ),
    # ---- apply_rope: a per-head table (max_position, Ht, rotary_dim), FoPE's -------------------------
    R(
        "rope-head-table-heads",
        "apply_rope",
        "a per-head table whose heads do not divide q's (or k's)",
        "table of 2 heads, q of 3",
        ValueError,
        "q: expected a head count that the per-head table's 2 heads divide (head j reads table head "
        "j // (heads / 2)), got 3 heads",
        lambda: rope_args(cos_sin_cache=head_table(2)),
    ),
    R(
        "rope-head-table-arange",
        "apply_rope",
        "a per-head table with positions None",
        "positions=None, a (16, 1, 64) table",
        ValueError,
        "positions: expected a positions tensor with a per-head cos_sin_cache, got None",
        lambda: rope_args(positions=None, cos_sin_cache=head_table(1)),
    ),
    R(
        "rope-head-table-mrope",
        "apply_rope",
        "a per-head table with M-RoPE",
        "mrope_section given, a (16, 1, 64) table",
        ValueError,
        "mrope_section: expected None with a per-head cos_sin_cache, got (8, 12, 12)",
        lambda: rope_args(
            mrope_section=[8, 12, 12], positions=torch.zeros(3, T, dtype=torch.long), cos_sin_cache=head_table(1)
        ),
    ),
    R(
        "rope-head-table-packed",
        "apply_rope",
        "a per-head table with packed sequences",
        "cu_seqlens given, a (16, 1, 64) table",
        ValueError,
        "cu_seqlens: expected None with a per-head cos_sin_cache, got a tensor",
        lambda: rope_args(positions=None, cu_seqlens=torch.tensor([0, 2, T]), cos_sin_cache=head_table(1)),
    ),
    R(
        "rope-head-table-norm",
        "apply_rope",
        "a per-head table with a fused norm",
        "q_norm_weight given, a (16, 1, 64) table",
        ValueError,
        "q_norm_weight: expected None with a per-head cos_sin_cache, got a tensor",
        lambda: rope_args(q_norm_weight=torch.ones(D), cos_sin_cache=head_table(1)),
    ),
    R(
        "rope-head-table-l2",
        "apply_rope",
        "a per-head table with l2_norm",
        "l2_norm=True, a (16, 1, 64) table",
        ValueError,
        "l2_norm: expected False with a per-head cos_sin_cache, got True",
        lambda: rope_args(l2_norm=True, cos_sin_cache=head_table(1)),
    ),
    # ---- apply_rope_and_store: heads in two parts (q_nope, k_nope beside v) -----------------------
    R(
        "store-k-nope-halves",
        "apply_rope_and_store",
        "k_nope (beside v) with rotary_position='halves'",
        "k_nope given, rotary_position='halves'",
        ValueError,
        "k_nope: expected None with rotary_position='halves' (its pairs span the whole head), got a tensor",
        lambda: parts_args(q_nope=None, q_out=None, rotary_position="halves"),
    ),
    R(
        "store-k-nope-type",
        "apply_rope_and_store",
        "k_nope (beside v) not a tensor",
        "k_nope=[1.0]",
        TypeError,
        "k_nope: expected a torch.Tensor or None, got list",
        lambda: parts_args(k_nope=[1.0]),
    ),
    R(
        "store-k-nope-rank",
        "apply_rope_and_store",
        "k_nope of the wrong rank",
        "k_nope of shape (4, 64)",
        ValueError,
        "k_nope: expected a 3-D tensor (*T, H, N) with the token dims and heads (4, 2) of k",
        lambda: parts_args(k_nope=torch.randn(T, 2 * R_)),
    ),
    R(
        "store-k-nope-dtype",
        "apply_rope_and_store",
        "k_nope of an unsupported dtype",
        "float64 k_nope",
        ValueError,
        "k_nope: expected dtype in (float16, bfloat16, float32), got float64",
        lambda: parts_args(k_nope=lambda a: a["k_nope"].double()),
    ),
    R(
        "store-k-nope-device",
        "apply_rope_and_store",
        "k_nope on another device",
        "k_nope on meta",
        ValueError,
        "k_nope: expected a tensor on cpu (the device of q)",
        lambda: parts_args(k_nope=lambda a: a["k_nope"].to("meta")),
    ),
    R(
        "store-k-nope-token-dims",
        "apply_rope_and_store",
        "k_nope's token dims differ from k's",
        "k_nope of shape (3, 2, 32)",
        ValueError,
        "k_nope: expected token dims and heads (4, 2) (those of k), got shape (3, 2, 32)",
        lambda: parts_args(k_nope=torch.randn(T - 1, HK, R_)),
    ),
    R(
        "store-k-nope-heads",
        "apply_rope_and_store",
        "k_nope's head count differs from k's",
        "k_nope with 3 heads, k with 2",
        ValueError,
        "k_nope: expected token dims and heads (4, 2) (those of k), got shape (4, 3, 32)",
        lambda: parts_args(k_nope=torch.randn(T, HK + 1, R_)),
    ),
    R(
        "store-k-nope-k-width",
        "apply_rope_and_store",
        "k wider than rotary_dim beside k_nope",
        "k of head size 64, rotary_dim 32",
        ValueError,
        "k: expected head size 32 (rotary_dim: with k_nope given, k is the rope part), got shape (4, 2, 64)",
        lambda: parts_args(k=torch.randn(T, HK, 2 * R_)),
    ),
    R(
        "store-k-nope-cache-width",
        "apply_rope_and_store",
        "k_cache rows not as wide as k and k_nope together",
        "k_cache head size 32, k 32 + k_nope 32",
        ValueError,
        "k_cache: expected (heads, head size) (2, 64), those of k and k_nope together, got shape (2, 4, 2, 32)",
        lambda: parts_args(k_cache=torch.full((2, 4, HK, R_), NAN)),
    ),
    R(
        "store-k-nope-norm",
        "apply_rope_and_store",
        "k_nope (beside v) with k_norm_weight",
        "k_norm_weight=torch.ones(32)",
        ValueError,
        "k_nope: expected None with k_norm_weight (the norm covers a whole head, not one given in two parts)",
        lambda: parts_args(k_norm_weight=torch.ones(R_)),
    ),
    R(
        "store-k-nope-grad",
        "apply_rope_and_store",
        "k_nope that requires grad, grad mode on",
        "k_nope.requires_grad_()",
        ValueError,
        "k_nope: expected a tensor that does not require grad",
        lambda: parts_args(k_nope=lambda a: a["k_nope"].requires_grad_()),
    ),
    R(
        "store-k-nope-in-cache",
        "apply_rope_and_store",
        "k_nope overlaps a cache",
        "k_nope = k_cache[0, :, :, 32:]",
        ValueError,
        "k_nope: expected memory disjoint from k_cache (which is written)",
        lambda: parts_args(k_nope=lambda a: a["k_cache"][0, :, :, R_:]),
    ),
    R(
        "store-q-nope-without-q-out",
        "apply_rope_and_store",
        "q_nope without q_out",
        "q_nope given, q_out None",
        ValueError,
        "q_nope: expected None without q_out (q_out receives the rotated q and q_nope after it), got a tensor",
        lambda: parts_args(q_out=None),
    ),
    R(
        "store-q-nope-type",
        "apply_rope_and_store",
        "q_nope not a tensor",
        "q_nope=3",
        TypeError,
        "q_nope: expected a torch.Tensor or None, got int",
        lambda: parts_args(q_nope=3),
    ),
    R(
        "store-q-nope-heads",
        "apply_rope_and_store",
        "q_nope's head count differs from q's",
        "q_nope with 2 heads, q with 3",
        ValueError,
        "q_nope: expected token dims and heads (4, 3) (those of q), got shape (4, 2, 32)",
        lambda: parts_args(q_nope=torch.randn(T, HQ - 1, R_)),
    ),
    R(
        "store-q-nope-q-width",
        "apply_rope_and_store",
        "q wider than rotary_dim beside q_nope",
        "q of head size 64, rotary_dim 32",
        ValueError,
        "q: expected head size 32 (rotary_dim: with q_nope given, q is the rope part), got shape (4, 3, 64)",
        lambda: parts_args(q=torch.randn(T, HQ, 2 * R_)),
    ),
    R(
        "store-q-nope-q-out-shape",
        "apply_rope_and_store",
        "q_out not as wide as q and q_nope together",
        "q_out of shape (4, 3, 32)",
        ValueError,
        "q_out: expected shape (4, 3, 64) (q's head, then q_nope's), got shape (4, 3, 32)",
        lambda: parts_args(q_out=torch.full((T, HQ, R_), NAN)),
    ),
    R(
        "store-q-nope-norm",
        "apply_rope_and_store",
        "q_nope with q_norm_weight",
        "q_norm_weight=torch.ones(32)",
        ValueError,
        "q_nope: expected None with q_norm_weight (the norm covers a whole head, not one given in two parts)",
        lambda: parts_args(q_norm_weight=torch.ones(R_)),
    ),
    R(
        "store-q-nope-in-q-out",
        "apply_rope_and_store",
        "q_nope overlaps q_out",
        "q_nope = q_out[..., 32:]",
        ValueError,
        "q_nope: expected memory disjoint from q_out (which is written)",
        lambda: parts_args(q_nope=lambda a: a["q_out"][..., R_:]),
    ),
    # ---- rope_qkv_projection's paged-cache write -----------------------------------------------
    R(
        "qkv-cache-partial",
        "rope_qkv_projection",
        "k_cache and v_cache without slot_mapping",
        "slot_mapping=None",
        ValueError,
        "slot_mapping: expected a tensor when k_cache, v_cache or slot_mapping is given",
        lambda: qkv_args(slot_mapping=None),
    ),
    R(
        "qkv-cache-grad",
        "rope_qkv_projection",
        "paged-cache write while autograd records the call",
        "x.requires_grad_()",
        ValueError,
        "k_cache: expected a call autograd does not record (the paged-cache write is inference only",
        lambda: qkv_args(x=lambda a: a["x"].requires_grad_()),
    ),
    R(
        "qkv-cache-dtype",
        "rope_qkv_projection",
        "cache not of x's dtype",
        "bfloat16 k_cache, float32 x",
        ValueError,
        "k_cache: expected dtype float32 (x's: the write casts nothing), got bfloat16",
        lambda: qkv_args(k_cache=torch.full((2, 4, HK, D), NAN, dtype=torch.bfloat16)),
    ),
    R(
        "qkv-cache-heads",
        "rope_qkv_projection",
        "cache heads differ from num_kv_heads",
        "k_cache with 3 heads, num_kv_heads=2",
        ValueError,
        "k_cache: expected (heads, head size) (2, 64) (num_kv_heads, head_dim), got shape (2, 4, 3, 64)",
        lambda: qkv_args(k_cache=torch.full((2, 4, 3, D), NAN)),
    ),
    R(
        "qkv-cache-slot-dims",
        "rope_qkv_projection",
        "v_cache's slot dims differ from k_cache's",
        "flat v_cache (8, 2, 64), paged k_cache (2, 4, 2, 64)",
        ValueError,
        "v_cache: expected slot dims (2, 4), those of k_cache",
        lambda: qkv_args(v_cache=torch.full((8, HK, D), NAN)),
    ),
    R(
        "qkv-cache-broadcast",
        "rope_qkv_projection",
        "broadcast (stride-0) cache",
        "v_cache = x.expand(2, 4, 2, 64)",
        ValueError,
        "v_cache: expected a tensor without broadcast (stride 0) or overlapping dims (it is written)",
        lambda: qkv_args(v_cache=torch.full((2, 1, HK, D), NAN).expand(2, 4, HK, D)),
    ),
    R(
        "qkv-slots-shape",
        "rope_qkv_projection",
        "slot_mapping's shape differs from x's token dims",
        "slot_mapping of shape (3,)",
        ValueError,
        "slot_mapping: expected shape (4,) (x's token dims), got shape (3,)",
        lambda: qkv_args(slot_mapping=lambda a: a["slot_mapping"][:3]),
    ),
    R(
        "qkv-caches-overlap",
        "rope_qkv_projection",
        "v_cache overlaps k_cache",
        "v_cache = k_cache",
        ValueError,
        "v_cache: expected memory disjoint from k_cache (both are written)",
        lambda: qkv_args(v_cache=lambda a: a["k_cache"]),
    ),
    R(
        "qkv-cache-in-input",
        "rope_qkv_projection",
        "a cache overlaps an input",
        "x a view of k_cache's memory",
        ValueError,
        "x: expected memory disjoint from k_cache (which is written)",
        lambda: qkv_args(x=lambda a: a["k_cache"][0].reshape(-1)[: T * 32].view(T, 32).nan_to_num_()),
    ),
    R(
        "qkv-slot-strict",
        "rope_qkv_projection",
        "slot past the caches, strict mode",
        "slot 8 of 8 slots",
        ValueError,
        "slot_mapping: expected values < 8",
        lambda: qkv_args(slot_mapping=torch.tensor([0, 8, -1, 6])),
        strict=True,
    ),
    R(
        "qkv-slots-duplicate-strict",
        "rope_qkv_projection",
        "two tokens naming one slot, strict mode",
        "slot_mapping [0, 3, -1, 3]",
        ValueError,
        "slot_mapping: expected distinct slots",
        lambda: qkv_args(slot_mapping=torch.tensor([0, 3, -1, 3])),
        strict=True,
    ),
]


def _mla3d():
    return torch.full((2, 4, D + 32), NAN)


def _outs_overlap():
    buf = torch.full((T, 5, D), NAN)
    return rope_args(inplace=False, q_out=buf[:, :3], k_out=buf[:, 2:4])


def _caches_overlap_partly():
    """k_cache = blocks [0, 2) and v_cache = blocks [1, 3) of one (3, 4, H, D) buffer: block 1 is both."""
    buf = torch.full((3, 4, HK, D), NAN)
    return store_args(k_cache=buf[:2], v_cache=buf[1:])


def _q_in_cache():
    kc = torch.full((2, 4, HK, D), NAN)
    return store_args(q=kc.view(8, HK, D)[:T], k_cache=kc, v_cache=torch.full((2, 4, HK, D), NAN))


def snapshot(args):
    return {
        n: bits(v.detach()).clone() for n, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"
    }


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(row):
    args = row.make()
    before = snapshot(args)
    with strict.strict(row.strict):
        with pytest.raises(row.exc) as info:
            OPS[row.op](**args)
    message = str(info.value)
    assert row.fragment in message, message
    assert message.startswith(f"{row.op}: "), message
    for name, b in snapshot(args).items():
        assert torch.equal(b, before[name]), f"{name} was written before the error"


def test_rows_are_distinct():
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids))
    assert len({r.input_class for r in ROWS}) >= 15
    assert {r.op for r in ROWS} == set(OPS)


# ---------------------------------------------------------------------------------------------
# bad values that are not errors, by design (the doc's second table)


def _rope_nan_rows():
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    pos = torch.tensor([1, 16, -1, 2])
    qo, ko = ropekit.apply_rope(q, k, pos, make_cache(16, D, dtype=torch.float32), rotary_dim=D)
    for out in (qo, ko):
        assert out[[1, 2]].isnan().all() and not out[[0, 3]].isnan().any()


def _rope_nan_rows_partial():
    q = torch.randn(T, HQ, D)
    qo, _ = ropekit.apply_rope(q, None, torch.tensor([1, 99, 0, 2]), make_cache(16, 32))
    assert qo[1, :, :32].isnan().all() and torch.equal(qo[1, :, 32:], q[1, :, 32:])


def _store_nan_rows():
    a = store_args(positions=torch.tensor([0, 16, 1, 2]), slot_mapping=torch.tensor([0, 3, -1, 6]))
    apply_rope_and_store(**a)
    assert a["q"][1].isnan().all() and a["k_cache"][0, 3].isnan().all()
    assert not a["v_cache"][0, 3].isnan().any(), "v does not depend on the position"
    assert not a["q"][[0, 2, 3]].isnan().any()


def _negative_slots():
    a = store_args(slot_mapping=torch.tensor([-1, -5, -(2**31), 2]))
    before = bits(a["k_cache"]).clone()
    apply_rope_and_store(**a)
    written = torch.zeros(2, 4, dtype=torch.bool)
    written[0, 2] = True
    assert torch.equal(bits(a["k_cache"])[~written], before[~written])
    assert not a["k_cache"][0, 2].isnan().any() and not a["q"].isnan().any()


def _slot_past_cache():
    a = store_args(slot_mapping=torch.tensor([0, 8, 2**31 - 1, 3]))
    before = bits(a["k_cache"]).clone()
    apply_rope_and_store(**a)
    assert a["q"][[1, 2]].isnan().all() and not a["q"][[0, 3]].isnan().any()
    written = torch.zeros(2, 4, dtype=torch.bool)
    written[0, 0] = written[0, 3] = True
    assert torch.equal(bits(a["k_cache"])[~written], before[~written])


def _overlap_out_of_place():
    q = torch.randn(T, HQ, D)
    q0 = q.clone()
    qo, ko = ropekit.apply_rope(q, q[:, 1:], torch.arange(T), make_cache(16, D))
    assert torch.equal(q, q0) and torch.equal(ko, qo[:, 1:])


def _fused_in_place():
    qkv = torch.randn(T, (HQ + 2 * HK) * D)
    q = qkv[:, : HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D : (HQ + HK) * D].view(T, HK, D)
    v0 = qkv[:, (HQ + HK) * D :].clone()
    ropekit.apply_rope(q, k, torch.arange(T), make_cache(16, D), inplace=True)
    assert torch.equal(qkv[:, (HQ + HK) * D :], v0)


def _scale_on_float_cache():
    a = store_args(k_scale=2.0, v_scale=torch.tensor([0.5]))
    v = a["v"].clone()
    apply_rope_and_store(**a)
    assert torch.allclose(a["v_cache"][0, 3], v[1] / 0.5)


def _duplicate_slots():
    a = store_args(slot_mapping=torch.tensor([5, 5, -1, 5]))
    v = a["v"].clone()
    apply_rope_and_store(**a)
    row = a["v_cache"][1, 1]
    assert any(torch.equal(row, v[i]) for i in (0, 1, 3))


def _no_grad_mode():
    a = store_args(q=lambda a: a["q"].requires_grad_())
    want = ropekit.apply_rope(a["q"].detach(), a["k"], a["positions"], a["cos_sin_cache"])
    with torch.no_grad():
        apply_rope_and_store(**a)
    assert torch.allclose(a["q"].detach(), want[0], atol=1e-6)
    assert torch.allclose(a["k_cache"][0, 3], want[1][1], atol=1e-6)  # token 1 -> slot 3


def _empty():
    q = torch.randn(0, HQ, D)
    qo, ko = ropekit.apply_rope(q, None, torch.zeros(0, dtype=torch.long), make_cache(16, D))
    assert qo.shape == q.shape and ko is None


def _fused_in_place_decode_batch():
    """Fused qkv views with a size-1 token dim, as `unflatten` / `view` make them: the size-1 dim
    gets a different stride in q and in k (3 * 64 vs 2 * 64), which no element ever steps along."""
    qkv = torch.randn(2, 1, (HQ + 2 * HK) * D)
    q = qkv[..., : HQ * D].unflatten(-1, (HQ, D))
    k = qkv[..., HQ * D : (HQ + HK) * D].unflatten(-1, (HK, D))
    assert q.stride(1) != k.stride(1)
    q0, k0, v0 = q.clone(), k.clone(), qkv[..., (HQ + HK) * D :].clone()
    pos = torch.tensor([[3], [5]])
    want_q, want_k = ropekit.apply_rope(q0, k0, pos, make_cache(16, D))
    ropekit.apply_rope(q, k, pos, make_cache(16, D), inplace=True)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[..., (HQ + HK) * D :], v0)


def _last_stride_read():
    """q and k with last stride 2 are read through their stride (no copy): out of place the outputs
    are contiguous, in place the rotation is written back through the same strides (the other
    elements untouched)."""
    cache, pos = make_cache(16, D), torch.randint(0, 16, (T,))
    xq, xk = torch.randn(T, HQ, 2 * D), torch.randn(T, HK, 2 * D)
    q, k = xq[..., ::2], xk[..., ::2]
    want_q, want_k = ropekit.apply_rope(q.contiguous(), k.contiguous(), pos, cache)
    qo, ko = ropekit.apply_rope(q, k, pos, cache)
    assert qo.is_contiguous() and ko.is_contiguous() and torch.equal(qo, want_q) and torch.equal(ko, want_k)
    odd = xq[..., 1::2].clone()
    ropekit.apply_rope(q, k, pos, cache, inplace=True)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(xq[..., 1::2], odd)


def _store_mla_3d_cache():
    """A 3-D (num_blocks, block_size, D) cache beside a one-head k: FlashInfer's paged MLA cache."""
    args = store_args(
        k=torch.randn(T, 1, 32),
        v=torch.randn(T, 1, D),
        cos_sin_cache=make_cache(16, 32),
        k_cache=_mla3d(),
    )
    mla = args["k_cache"]
    args["k_cache"], args["v_cache"] = mla[..., D:], mla[..., :D]
    v = args["v"].clone()
    apply_rope_and_store(**args)
    rows = mla.view(8, D + 32)
    assert torch.equal(rows[3, :D], v[1, 0]) and not rows[3].isnan().any() and rows[1].isnan().all()


def _store_k_nope_v_none_is_mla():
    """k_nope with v None keeps MLA's meaning: k_nope goes to v_cache (the nope / ckv cache), not
    after k in the k_cache row (that needs v beside it)."""
    args = store_args(
        k=torch.randn(T, 1, R_),
        v=None,
        cos_sin_cache=make_cache(16, R_),
        k_cache=torch.full((2, 4, 1, R_), NAN),
        v_cache=torch.full((2, 4, 1, D), NAN),
        k_nope=torch.randn(T, 1, D),
    )
    apply_rope_and_store(**args)
    assert torch.equal(args["v_cache"][0, 3, 0], args["k_nope"][1, 0])  # token 1 -> slot 3
    assert not args["k_cache"][0, 3].isnan().any() and args["k_cache"][0, 1].isnan().all()


def _store_parts_strided():
    """No-rope parts whose last dim is strided are read in place (no copy) and give the bytes of
    contiguous ones."""
    outs = []
    for strided in (False, True):
        torch.manual_seed(0)  # the same values both times
        args = parts_args()
        if strided:
            for name in ("q_nope", "k_nope"):
                wide = torch.full((*args[name].shape, 3), NAN)
                wide[..., 1] = args[name]
                args[name] = wide[..., 1]
        apply_rope_and_store(**args)
        outs.append((args["q_out"], args["k_cache"]))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(*outs)) and not outs[1][0].isnan().any()


HANDLED = {
    "ok-position-out-of-range": _rope_nan_rows,
    "ok-position-out-of-range-partial": _rope_nan_rows_partial,
    "ok-store-position-out-of-range": _store_nan_rows,
    "ok-slot-negative": _negative_slots,
    "ok-slot-past-cache": _slot_past_cache,
    "ok-overlap-out-of-place": _overlap_out_of_place,
    "ok-fused-qkv-in-place": _fused_in_place,
    "ok-fused-qkv-in-place-size1-dim": _fused_in_place_decode_batch,
    "ok-scale-on-float-cache": _scale_on_float_cache,
    "ok-duplicate-slots": _duplicate_slots,
    "ok-requires-grad-no-grad-mode": _no_grad_mode,
    "ok-empty-tokens": _empty,
    "ok-last-stride": _last_stride_read,
    "ok-store-mla-3d-cache": _store_mla_3d_cache,
    "ok-store-k-nope-v-none-is-mla": _store_k_nope_v_none_is_mla,
    "ok-store-parts-strided": _store_parts_strided,
}


@pytest.mark.parametrize("case", list(HANDLED))
def test_handled_without_error(case):
    HANDLED[case]()


# ---------------------------------------------------------------------------------------------
# empty head, token and batch dimensions (rows of the doc's second table): every op on every path,
# the PyTorch path, the kernels interpreted (CPU) and the kernels compiled (CUDA)

PATHS = ["torch", "interpreter", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch, poison):
    """(device, launches): the path's device, and the grids of every kernel launched during the test."""
    if request.param == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    elif request.param == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    memo.clear()  # a spec records which path runs
    launches = []
    real = plans.launch_kernel

    def counted(kernel, compiled, variant, grid, *rest, **keywords):
        launches.append(grid)
        return real(kernel, compiled, variant, grid, *rest, **keywords)

    monkeypatch.setattr(plans, "launch_kernel", counted)
    monkeypatch.setattr(pipeline, "launch", counted)
    yield ("cuda" if request.param == "cuda" else "cpu"), launches
    memo.clear()


def _rand(*shape, device, dtype=torch.float32):
    return torch.randn(*shape, device=device).to(dtype)


def _same_shape_dtype(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)


def _check_rope(device, launches, hq, hk, *, dtype, inplace=False, norm=False, angles=False, rot=D):
    """One rotation call with hq / hk heads (0: empty; hk None: no k) on random inputs: outputs of
    the inputs' shapes and dtypes, a non-empty tensor rotated as the float64 oracle says, and no
    launch when nothing is to be written."""
    pos = torch.randint(0, 16, (T,), device=device)
    cache = make_cache(16, rot, device=device)
    q = _rand(T, hq, D, device=device, dtype=dtype)
    k = None if hk is None else _rand(T, hk, D, device=device, dtype=dtype)
    q0, k0 = q.clone(), None if k is None else k.clone()
    weights = dict(q_norm_weight=torch.rand(D, device=device) + 0.5) if norm else {}
    if angles:
        cos, sin = cache[pos, : rot // 2], cache[pos, rot // 2 :]
        outs = ropekit.rotate_with_angles(q, k, cos, sin, inplace=inplace, rotary_dim=rot, **weights)
    else:
        outs = ropekit.apply_rope(q, k, pos, cache, inplace=inplace, **weights)
    if norm:
        want = reference.rms_norm_rope(q0.double(), None if k0 is None else k0.double(), pos, cache.double(), **weights)
    else:
        want = reference.apply_rope(q0.double(), None if k0 is None else k0.double(), pos, cache.double())
    for got, x, x0, w in zip(outs, (q, k), (q0, k0), want):
        if x is None:
            assert got is None
            continue
        _same_shape_dtype(got, x0)
        assert (got.data_ptr() == x.data_ptr()) == inplace or x.numel() == 0
        if x.numel():
            assert rel_err(got, w) < TOL[dtype], (got.shape, rel_err(got, w))
        if not inplace:
            assert torch.equal(bits(x), bits(x0)), "an input was written out of place"
    if hq == 0 and not hk:
        assert launches == [], f"launched an empty call: grids {launches}"
    elif device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        assert launches and all(all(g) for g in launches), launches


HEADS = [(0, None), (0, 0), (0, HK), (HQ, 0)]


def _empty_heads(device, launches):
    for hq, hk in HEADS:
        for dtype in (torch.float32, torch.bfloat16):
            for inplace in (False, True):
                _check_rope(device, launches, hq, hk, dtype=dtype, inplace=inplace)
                _check_rope(device, launches, hq, hk, dtype=dtype, inplace=inplace, angles=True)
                launches.clear()
        _check_rope(device, launches, hq, hk, dtype=torch.float32, rot=D // 2)  # a kept tail
        _check_rope(device, launches, hq, hk, dtype=torch.float32, norm=True)  # the fused qk-norm
        _check_rope(device, launches, hq, hk, dtype=torch.float32, norm=True, inplace=True)
        launches.clear()


def _empty_batch(device, launches):
    """(B, S) token dims with B or S 0: positions given or None (arange), in place or not, the
    Hugging Face (B, H, S, D) form and the serving module's (T, H * D) too."""
    cache = make_cache(16, D, device=device)
    for b, s in ((0, 3), (2, 0)):
        for pos in (torch.zeros(b, s, dtype=torch.long, device=device), None):
            for inplace in (False, True):
                q, k = _rand(b, s, HQ, D, device=device), _rand(b, s, HK, D, device=device)
                qo, ko = ropekit.apply_rope(q, k, pos, cache, inplace=inplace)
                _same_shape_dtype(qo, q)
                _same_shape_dtype(ko, k)
        cos = sin = _rand(b, s, D, device=device)
        q, k = _rand(b, HQ, s, D, device=device), _rand(b, HK, s, D, device=device)
        qo, ko = ropekit.hf.apply_rotary_pos_emb(q, k, cos, sin)
        _same_shape_dtype(qo, q)
        _same_shape_dtype(ko, k)
    rope = ropekit.RotaryEmbedding(D, D, 16, device=device)
    for t, hq in ((0, HQ), (T, 0)):
        query, key = _rand(t, hq * D, device=device), _rand(t, 0, device=device)
        qo, ko = rope(torch.zeros(t, dtype=torch.long, device=device), query, key)
        _same_shape_dtype(qo, query)
        _same_shape_dtype(ko, key)
    assert launches == [], f"launched an empty call: grids {launches}"


def _store_forms(device, shape, hq, hk):
    """The store's forms on one shape: plain, into a NaN-filled q_out, with the fused qk-norm."""
    ones = torch.ones(D, device=device)
    return (
        {},
        dict(q_out=torch.full((*shape, hq, D), NAN, device=device)),
        dict(q_norm_weight=ones, k_norm_weight=ones),
    )


def _empty_store(device, launches):
    """apply_rope_and_store with 0 heads, 0 tokens, or a (0, S) batch: nothing stored (the
    NaN-filled caches keep their bits), q's shape kept; with q of 0 heads beside k's heads, k and v
    stored as the float64 oracle says. Plain, q_out and the qk-norm forms."""
    cache = make_cache(16, D, device=device)
    for shape, hq, hk in (((T,), 0, 0), ((0,), HQ, HK), ((0, 3), HQ, HK), ((T,), 0, HK)):
        for kw in _store_forms(device, shape, hq, hk):
            kc, vc = torch.full((2, 4, hk, D), NAN, device=device), torch.full((2, 4, hk, D), NAN, device=device)
            want_kc, want_vc = kc.double(), vc.double()
            q = _rand(*shape, hq, D, device=device)
            k, v = _rand(*shape, hk, D, device=device), _rand(*shape, hk, D, device=device)
            slots = torch.arange(math.prod(shape), device=device).reshape(shape)
            pos = torch.randint(0, 16, shape, device=device)
            norm = {n: w.double() for n, w in kw.items() if n.endswith("norm_weight")}
            reference.apply_rope_and_store(
                q.double(), k.double(), v.double(), pos, cache.double(), want_kc, want_vc, slots, **norm
            )
            k0 = k.clone()
            out = apply_rope_and_store(q, k, v, pos, cache, kc, vc, slots, **kw)
            _same_shape_dtype(out, q)
            assert out.data_ptr() == kw.get("q_out", q).data_ptr()
            assert torch.equal(k, k0), "k was written"
            if k.numel():
                assert rel_err(kc[0], want_kc[0]) < TOL[torch.float32] and torch.equal(vc[0], v)
                assert kc[1].isnan().all() and vc[1].isnan().all(), "a row past the slots was written"
            else:
                assert kc.isnan().all() and vc.isnan().all()
    assert len(launches) == 3 * int(os.environ.get("TRITON_INTERPRET") == "1" or device == "cuda"), launches


def _empty_cache_shift(device, launches):
    """rerotate_kv_cache with no slots, or a cache of 0 heads: the cache keeps its bits."""
    cache = make_cache(16, D, device=device)
    for heads, n in ((HK, 0), (0, 3)):
        kc = torch.full((2, 4, heads, D), NAN, device=device)
        before = bits(kc).clone()
        slots = torch.arange(n, device=device)
        ropekit.rerotate_kv_cache(kc, slots, 3, cache)
        ropekit.rerotate_kv_cache(kc, slots, torch.full((n,), -2, device=device), cache, dst_slots=slots + 4)
        assert torch.equal(bits(kc), before)
    assert launches == [], f"launched an empty call: grids {launches}"


EMPTY = {
    "ok-empty-heads": _empty_heads,
    "ok-empty-batch": _empty_batch,
    "ok-store-empty": _empty_store,
    "ok-empty-cache-shift": _empty_cache_shift,
}


@pytest.mark.parametrize("case", list(EMPTY))
def test_empty_dims(case, path):
    EMPTY[case](*path)


# ---------------------------------------------------------------------------------------------
# aliasing that must be refused (the doc's third table)


def _gap_two_token_dims():
    """q and k views of one buffer with (B, S) token strides (22, 20): the rows of q and of k are
    disjoint within a token, and the row window fits in the smallest token stride (a shortcut
    once took that as disjoint); but token (1, 0) of q and token (0, 1) of k share elements."""
    buf = torch.randn(100)
    q = buf.as_strided((2, 2, 1, 2), (22, 20, 2, 1), 0)
    k = buf.as_strided((2, 2, 1, 2), (22, 20, 2, 1), 2)
    assert q[1, 0].data_ptr() == k[0, 1].data_ptr()
    ropekit.apply_rope(q, k, torch.zeros(2, 2, dtype=torch.long), make_cache(4, 2), inplace=True)


def _gap_q_self_overlap():
    """q's heads overlap each other (head stride 32 < head size 64): an in-place write races with reads."""
    q = torch.randn(T * HQ * D).as_strided((T, HQ, D), (HQ * D, D // 2, 1))
    ropekit.apply_rope(q, None, torch.arange(T), make_cache(16, D), inplace=True)


def _gap_store_q_self_overlap():
    a = store_args(q=torch.randn(T * HQ * D).as_strided((T, HQ, D), (HQ * D, D // 2, 1)))
    apply_rope_and_store(**a)


def _gap_cache_self_overlap():
    """k_cache's slots overlap each other (block stride == slot stride): two tokens' rows collide."""
    kc = torch.full((4 * HK * D + 8 * HK * D,), NAN).as_strided((2, 4, HK, D), (HK * D, HK * D, D, 1))
    apply_rope_and_store(**store_args(k_cache=kc, v_cache=torch.full((2, 4, HK, D), NAN)))


def _gap_q_is_table():
    """In place, q is a view of cos_sin_cache: the kernel reads angles it is overwriting."""
    table = make_cache(16, D)
    q = table[: T * HQ].view(T, HQ, D)
    ropekit.apply_rope(q, None, torch.arange(T), table, inplace=True)


def _gap_q_is_positions():
    buf = torch.zeros(T * HQ * D)
    positions = buf.view(torch.int32)[:T]
    ropekit.apply_rope(buf.view(T, HQ, D), None, positions, make_cache(16, D), inplace=True)


def _gap_cache_is_table():
    buf = torch.full((2, 4, HK, D), NAN)
    buf.view(-1, D)[:16] = make_cache(16, D)
    apply_rope_and_store(
        **store_args(k_cache=buf, v_cache=torch.full((2, 4, HK, D), NAN), cos_sin_cache=buf.view(-1, D)[:16])
    )


def _gap_cache_is_slots():
    buf = torch.full((2, 4, HK, D), NAN)
    slots = buf.view(-1).view(torch.int32)[:T]
    slots.copy_(torch.tensor([0, 3, -1, 6], dtype=torch.int32))
    apply_rope_and_store(**store_args(k_cache=buf, v_cache=torch.full((2, 4, HK, D), NAN), slot_mapping=slots))


GAPS = {
    "gap-two-token-dims": (_gap_two_token_dims, "k: expected memory disjoint from q"),
    "gap-q-self-overlap": (
        _gap_q_self_overlap,
        "q: expected a tensor without broadcast (stride 0) or overlapping dims",
    ),
    "gap-store-q-self-overlap": (
        _gap_store_q_self_overlap,
        "q: expected a tensor without broadcast (stride 0) or overlapping dims",
    ),
    "gap-cache-self-overlap": (
        _gap_cache_self_overlap,
        "k_cache: expected a tensor without broadcast (stride 0) or overlapping dims",
    ),
    "gap-q-is-table": (_gap_q_is_table, "cos_sin_cache: expected memory disjoint from q (which is written)"),
    "gap-q-is-positions": (_gap_q_is_positions, "positions: expected memory disjoint from q (which is written)"),
    "gap-cache-is-table": (
        _gap_cache_is_table,
        "cos_sin_cache: expected memory disjoint from k_cache (which is written)",
    ),
    "gap-cache-is-slots": (
        _gap_cache_is_slots,
        "slot_mapping: expected memory disjoint from k_cache (which is written)",
    ),
}


@pytest.mark.parametrize("case", list(GAPS))
def test_aliasing_is_refused(case):
    fn, fragment = GAPS[case]
    with pytest.raises(ValueError) as info:
        fn()
    assert fragment in str(info.value)
    assert fragment in DOC.read_text(), "the doc's aliasing table names this message"


# ---------------------------------------------------------------------------------------------
# the doc and these tables agree


def doc_rows():
    """{id: [cells]} of every table row of docs/bad_inputs.md whose first cell is a `code` id."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\|\s*`([a-z0-9-]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def unquote(cell):
    return cell[1:-1] if cell.startswith("`") and cell.endswith("`") else cell


def test_doc_lists_every_row_and_nothing_else():
    doc = doc_rows()
    from test_rerotate import DOC_IDS as rerotate_ids  # rerotate_kv_cache's rows are tested there

    ids = [r.id for r in ROWS] + list(HANDLED) + list(EMPTY) + list(GAPS) + rerotate_ids
    assert sorted(doc) == sorted(ids), (
        f"in the tests, not the doc: {sorted(set(ids) - set(doc))}; in the doc, not the tests: "
        f"{sorted(set(doc) - set(ids))}"
    )


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_doc_row_matches(row):
    """The doc's op, exception and message fragment of each error row are the test's."""
    cells = doc_rows()[row.id]
    op, exc, fragment = unquote(cells[0]), unquote(cells[3]), unquote(cells[4])
    assert (op, exc, fragment) == (row.op, row.exc.__name__, row.fragment)
