"""Launch plans: from a validated call's tensors to the kernels' grid, runtime ints and constexprs.

A plan is made once per call signature (ropekit.core.variant.Spec keeps it); a launch then needs only the
tensors' addresses (ropekit.core.pipeline's run steps fill the pointer slots), passed to Triton's compiled launcher directly
(ropekit.core.launch). Tile sizes and warps come from ropekit.core.tuning's table.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from . import tuning
from .launch import launch as launch_kernel
from .variant import FLAGS, MROPE_MAP, NORM_NONE, NORM_TOKEN


def variant_flags(kernel_name: str, variant) -> dict:
    """The record's flags as the kernel's constexprs, as the flag table (variant.FLAGS) names them
    per kernel: INTERLEAVED <- variant.interleaved, NORM_Q <- variant.norm_q, ... Flags that are
    not a field of the record (GAP, the tiles, PACK) are planned here."""
    return {f.constexpr[kernel_name]: getattr(variant, f.name) for f in FLAGS if kernel_name in f.constexpr}


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pair_gap(variant, half: int, head_size: int) -> int:
    """The kernels' GAP: columns from a half-split pair's first member to its second. half, or with
    rotary_position='halves' (variant.rope_halves) half the head, pairs (i, i + D/2)."""
    return head_size // 2 if variant.rope_halves else half


def token_strides(x: torch.Tensor, n_tok: int):
    """(stride of b, stride of s) of the token dims; b's stride is 0 when there is one token dim."""
    return (x.stride(0), x.stride(1)) if n_tok == 2 else (0, x.stride(0))


class AngleLayout(NamedTuple):
    """Where the kernel reads cos and sin, as ints: built from the call's angle tensors.

    Table and arange angles: row p of cos at cos + p * row stride, sin `sin_off` elements further.
    Per-token angles: rows addressed by the token's own (sec, b, s) indices, any stride 0 for
    broadcast; cos and sin are separate tensors with these strides."""

    half: int
    max_pos: int  # table rows (0: no positions, nothing to bound)
    sin_off: int
    strides: tuple  # (sec, b, s, col)
    pos_strides: tuple  # positions' (sec, b, s) strides
    packed: tuple = (0, 1, 0)  # packed sequences: (sequences, cp_size, cp_rank)
    search: tuple = (1, 1)  # packed sequences: the two-level search's (stride, blocks)
    heads: tuple = (0, 1)  # a per-head table (max_position, Ht, width): (its head stride, Ht)


def angle_layout(variant, rot: int, a, b, token_strides_of_angles, packed=(1, 0)) -> AngleLayout:
    half = rot // 2
    if variant.angles == "tokens":
        return AngleLayout(half, 0, 0, token_strides_of_angles, (0, 0, 0))
    if variant.angles == "freqs":  # a: positions (*T) or (axes, *T); b: the inverse frequencies
        axial = len(variant.sections) > 0  # axes given: positions carry an axis dim
        n_tok = a.dim() - (1 if axial else 0)
        pos = a[0] if axial else a
        return AngleLayout(
            half, 0, 0, (0, 0, 0, b.stride(0)), (a.stride(0) if axial else 0, *token_strides(pos, n_tok))
        )
    row, col = b.stride(0), b.stride(-1)
    if variant.angles == "packed":  # a: cu_seqlens; positions derived in the kernel
        n_seqs = a.shape[0] - 1
        cp_size, cp_rank = packed
        # two levels of ~sqrt(n) entries each: every STRIDE-th entry, then one block of STRIDE
        stride = next_pow2(max(2, math.isqrt(n_seqs + 1) + 1))
        blocks = next_pow2(-(-(n_seqs + 1) // stride))
        return AngleLayout(
            half, b.shape[0], half * col, (0, 0, row, col), (0, 0, 1), (n_seqs, cp_size, cp_rank), (stride, blocks)
        )
    if a is None:  # arange over the last token dim
        return AngleLayout(half, 0, half * col, (0, 0, row, col), (0, 0, 0))
    n_tok = a.dim() - (1 if variant.mrope else 0)
    pos = a[0] if variant.mrope else a
    sec = a.stride(0) if variant.mrope else 0
    heads = (b.stride(1), b.shape[1]) if variant.head_table else (0, 1)
    return AngleLayout(half, b.shape[0], half * col, (0, 0, row, col), (sec, *token_strides(pos, n_tok)), heads=heads)


def per_token_strides(cos: torch.Tensor, n_tok: int, mrope: bool) -> tuple:
    """(sec, b, s, col) strides of per-token angle views (*T, half) or (3, *T, half)."""
    sec = cos.stride(0) if mrope else 0
    return (sec, *token_strides(cos[0] if mrope else cos, n_tok), cos.stride(-1))


def _tiles(half: int, n_q: int, n_k: int, tail: int, block_elems: int):
    """Compile-time tile sizes for a problem shape: one head-block size serves q and k (they share
    the kernel's code path), each program ~block_elems elements."""
    half_pad = next_pow2(half)
    rows = max(1, block_elems // (2 * half_pad))
    block_h = min(next_pow2(max(n_q, n_k)), next_pow2(rows))
    tail_pad = next_pow2(tail) if tail > 0 else 0
    n_q_blocks = -(-n_q // block_h)
    n_k_blocks = -(-n_k // block_h) if n_k else 0
    return half_pad, block_h, tail_pad, n_q_blocks, n_k_blocks


def head_tiles(n_heads: int) -> tuple:
    """(BLOCK_H, BLOCK_H2, BLOCK_H3): n_heads in at most three power-of-two tiles, largest first, by
    the binary decomposition of n_heads (40 = 32 + 8, 24 = 16 + 8, 7 = 4 + 2 + 1: no padded rows), the
    third rounded up to a power of two when more bits remain (15 = 8 + 4 + 4); 0 for an absent tile."""
    tiles = []
    rest = int(n_heads)
    while rest > 0 and len(tiles) < 2:
        tiles.append(1 << (rest.bit_length() - 1))
        rest -= tiles[-1]
    if rest > 0:
        tiles.append(next_pow2(rest))
    return tuple(tiles + [0] * (3 - len(tiles)))


def _whole_heads(mode_across: bool, n_heads: int, other_heads: int, block_h: int) -> bool:
    """The whole_heads knob, or its rule (tuning.py): across heads, or per head when the tensors have
    one head count (other_heads: k's, or 0 without k) that per-head blocks of block_h would pad."""
    whole = tuning.get("whole_heads")
    if whole is not None:
        return bool(whole)
    return mode_across or (other_heads in (0, n_heads) and n_heads % block_h != 0)


def empty_call(n_tokens: int, n_heads: int) -> bool:
    """No element to write (no token, or no head in any tensor): the plan is None and nothing is
    launched (a grid with a 0 dimension is not a valid CUDA launch)."""
    return n_tokens == 0 or n_heads == 0


class Plan(NamedTuple):
    """A kernel launch minus its tensors."""

    grid: tuple
    args: tuple  # the runtime ints, in kernel order after the pointers
    meta: dict  # constexprs and num_warps
    pack_bytes: int  # alignment the packed-pairs path needs of base pointers (0: none)
    compiled: dict  # ropekit.core.launch's cache of compiled kernels for this plan


def _pair_bits(*xs) -> int:
    """PACK for tensors read or written as (2i, 2i+1) pairs: the bits of one pair when every one
    keeps pairs word-aligned (one element size of 2 or 4 bytes, even strides, a unit last stride),
    else 0. Base-pointer alignment is checked per launch."""
    xs = [x for x in xs if x is not None]
    sizes = {x.element_size() for x in xs}
    if len(sizes) != 1 or not sizes <= {2, 4}:
        return 0
    if any(st % 2 for x in xs for st in x.stride()[:-1]) or any(col_strided(x) for x in xs):
        return 0
    return 16 * sizes.pop()


def col_strided(x: Optional[torch.Tensor]) -> bool:
    """Does x's last dim have a stride other than 1 that addressing must follow (more than one
    element)? The kernels' STRIDED_IN / STRIDED_OUT: a planned constexpr, like PACK, since it is a
    fact of the tensors' strides (part of the call signature and of a gradient's layout key), not
    of the call's keywords."""
    return x is not None and x.shape[-1] > 1 and x.stride(-1) != 1


@functools.lru_cache(maxsize=None)
def _has_gdc(device_index: int) -> bool:
    """Programmatic dependent launch and its griddepcontrol instructions: NVIDIA compute capability
    9+ (ROCm reports its own architecture numbers there, and has no such launch)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_meta(x: torch.Tensor, n_tokens: int) -> dict:
    """The PDL constexpr, and Triton's launch option with it: on for decode-sized CUDA calls on
    Hopper and later (the `pdl` knob), never on CPU (the interpreter has no such launch)."""
    on = tuning.get("pdl")
    if on is None:
        on = tuning.decode_sized(n_tokens)
    on = bool(on) and x.is_cuda and _has_gdc(x.device.index if x.device.index is not None else 0)
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


def plan_rotate(q, k, q_out, k_out, angles: AngleLayout, variant, temperature=(1.0, 0.0)) -> Optional[Plan]:
    """rope_kernel's launch for (*T, H, D) tensors (None for an empty call: nothing to launch).
    temperature: (floor_scale, attn_scale), read with variant.q_temperature."""
    n_tok = q.dim() - 2
    n_tokens = q.shape[:n_tok].numel()
    half = angles.half
    rot = 2 * half
    n_q, d_q = q.shape[-2], q.shape[-1]
    n_k, d_k = (k.shape[-2], k.shape[-1]) if k is not None else (0, rot)
    if empty_call(n_tokens, n_q + n_k):
        return None
    S = q.shape[n_tok - 1]
    normed = variant.norm_q != 0 or variant.norm_k != 0
    # the tail is written out of place (copied), and with a norm in place too (it is normalized);
    # in place or not, told by a tensor with elements (an empty one's address says nothing)
    x, x_out = (k, k_out) if n_q == 0 and n_k else (q, q_out)
    # (q's temperature scales its tail: written in place too)
    rewrite = normed or variant.q_temperature
    copy_tail = (rewrite or x_out.data_ptr() != x.data_ptr()) and max(d_q, d_k) > rot
    tail = max(d_q, d_k) - rot if copy_tail else 0
    mrope = variant.mrope != 0
    across = variant.norm_q == 2 or variant.norm_k == 2
    head_loop = tuning.get("head_loop")
    if head_loop is None:
        # one program per token when its angles cost a table read or a cos / sin each: once per token;
        # across-heads norms too (the program then sums a tensor's heads before normalizing them)
        head_loop = (variant.angles in ("table", "freqs") or mrope or across) and not tuning.decode_sized(n_tokens)
    if tuning.decode_sized(n_tokens):
        block_elems = tuning.get("decode_block_elems")
    else:
        block_elems = tuning.get("across_block_elems" if across else "block_elems")
    # column strides: 1 for a tensor of one column too (its column 0 is at offset 0 whatever the stride)
    cols = tuple(x.stride(-1) if col_strided(x) else 1 for x in (q, k, q_out, k_out))
    # the plain rotation's head loop: its card's own launch where a sweep found one (tuning.CARD_PLAIN)
    # (a strided last dim: small blocks of its own, tuning.strided_plain)
    plain = head_loop and not (normed or mrope or variant.head_table) and variant.angles == "table"
    card = None
    if plain and not tuning.decode_sized(n_tokens):
        if cols != (1, 1, 1, 1):
            card = tuning.strided_plain()
        else:
            card = tuning.card_plain(q.device, (n_q + n_k) * 2 * next_pow2(half))
    if card is not None:
        block_elems = card[0]
    half_pad, block_h, tail_pad, nqb, nkb = _tiles(half, n_q, n_k, tail, block_elems)
    # whole heads: a block is all of a tensor's heads, in tiles. Required across heads without the
    # head loop (a program per head block: the norm group must be one block); with the head loop the
    # alternative is small blocks and a pre-pass over the token's blocks (whole_heads=False).
    whole = normed and ((across and not head_loop) or _whole_heads(across, n_q, n_k, block_h))
    tiles = (block_h, 0, 0)
    if whole:
        tiles = head_tiles(max(n_q, n_k))
        block_h = tiles[0]
        nqb, nkb = 1, (1 if n_k else 0)
    prefetch = tuning.get("prefetch")
    # M-RoPE's three masked row loads, a norm's tiles and angles computed in the kernel already hold
    # the registers: a prefetch there costs programs an SM (the knob's entry in .tuning gives why)
    if prefetch is None:
        prefetch = not (mrope or normed or variant.angles == "freqs")
    prefetch = head_loop and prefetch
    pack = 0
    if variant.interleaved or variant.out_interleaved:
        ins = (q, k) if variant.interleaved else ()
        outs = (q_out, k_out) if variant.out_interleaved else ()
        pack = _pair_bits(*ins, *outs)
    sk = (*token_strides(k, n_tok), k.stride(-2)) if k is not None else (0, 0, 0)
    sko = (*token_strides(k_out, n_tok), k_out.stride(-2)) if k is not None else (0, 0, 0)
    sec_t, sec_h, sec_w = section_args(variant, half, q.device)
    args = (
        n_tokens,
        S,
        n_q,
        n_k,
        d_q - rot,
        d_k - rot,
        angles.max_pos,
        nqb,
        nqb + nkb,
        angles.sin_off,
        *token_strides(q, n_tok),
        q.stride(-2),
        *sk,
        *token_strides(q_out, n_tok),
        q_out.stride(-2),
        *sko,
        *cols,
        *angles.pos_strides,
        *angles.strides,
        sec_t,
        sec_h,
        sec_w,
        *angles.packed,  # sequences, cp_size, cp_rank (read only when PACKED)
        *head_table_args(angles, n_q, n_k),  # read only when HEAD_TABLE
        *temperature,  # floor_scale, attn_scale (read only when Q_TEMPERATURE)
    )
    if not normed:
        args += (0, 0, 0.0, 0.0)  # the norm's weights, eps, offset: never read (pipeline.run_rotate appends them)
    meta = dict(
        HALF=half,
        HALF_PAD=half_pad,
        GAP=pair_gap(variant, half, d_q),
        BLOCK_H=block_h,
        TAIL_PAD=tail_pad,
        **angle_meta(angles, variant),
        **variant_flags("rope_kernel", variant),
        PACK=pack,
        HEAD_LOOP=head_loop,
        PREFETCH=prefetch,
        **pdl_meta(q, n_tokens),
        WHOLE=whole,
        BLOCK_H2=tiles[1],
        BLOCK_H3=tiles[2],
        W_PAIRS=normed and variant.interleaved and bool(tuning.get("weight_pairs")),
        STRIDED_IN=cols[0] != 1 or cols[1] != 1,
        STRIDED_OUT=cols[2] != 1 or cols[3] != 1,
        num_warps=tuning.warps(head_loop, mrope, n_tokens, elems=block_h * (2 * half_pad + tail_pad)),
    )
    if normed and not tuning.get("num_warps"):
        meta["num_warps"] = tuning.get("norm_warps") or norm_warps(sum(tiles), half_pad, tail_pad, whole)
    if card is not None:
        meta["num_warps"] = card[1]
    return Plan((n_tokens, 1 if head_loop else nqb + nkb), args, meta, pack // 8, {})


def head_table_args(angles: AngleLayout, n_q: int, n_k: int) -> tuple:
    """rope_kernel's (stride_table_head, q_group, k_group): a per-head table's head stride and the
    heads of q and of k per table head (validation made both multiples of the table's heads)."""
    stride, table_heads = angles.heads
    return stride, max(1, n_q // table_heads), max(1, n_k // table_heads)


def norm_warps(block_h: int, half_pad: int, tail_pad: int, whole: bool = False) -> int:
    """Warps of a normed launch: one per 1024 elements of a head block, 2 to 8 (W13's per-head
    blocks of 2048 ran fastest with 2). Whole heads (block_h: all of a tensor's heads): 2, 8 past
    8192 elements (the H200 sweep: W14's 40 heads 83% of copy at 2 warps, 82% at 4; W13's short
    forward is bound by host time there, so its rows do not rank the counts; ptxas, sm_90, Wan's 40
    heads of 128: 2 / 4 / 8 / 16 warps take 154 / 96 / 79 / 62 registers a thread, 6 / 5 / 3 / 2
    programs an SM)."""
    elems = block_h * (2 * half_pad + tail_pad)
    if whole:
        return 2 if elems <= 8192 else 8
    return max(2, min(8, next_pow2(max(1, elems // 1024))))


def section_args(variant, half: int, device=None) -> tuple:
    """The kernel's SEC_T, SEC_H, SEC_W: M-RoPE's (t, h, w) sections, or with an axis map
    (MROPE_MAP) the map as an int32 tensor on the tensors' device (then 0, 0), or for angles
    computed from inverse frequencies the pairs of the first three axes (one axis: all `half` of
    them; the fourth axis takes what the first three leave)."""
    if variant.mrope == MROPE_MAP:
        return axis_map_tensor(variant.axis_map, device), 0, 0
    if variant.angles != "freqs":
        return variant.sections
    return (tuple(variant.sections[:3]) + (0, 0, 0))[:3] if variant.sections else (half, 0, 0)


@functools.lru_cache(maxsize=256)
def axis_map_tensor(axis_map: tuple, device) -> torch.Tensor:
    """An M-RoPE axis map as the kernels read it: int32, on `device`; one tensor per map and device
    (the plans of every spec with that map share it, and it outlives them: CUDA graphs keep its address)."""
    return torch.tensor(axis_map, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def kernel(name: str):
    """The Triton kernel of that name (rope_kernel, rope_store_kernel, rerotate_kernel,
    rope_norm_backward_kernel), imported once."""
    # imported on first use: Triton loads lazily, and CPU-only calls never need it
    if name == "rope_kernel":
        from ..kernels.rope import rope_kernel as kernel
    elif name == "rerotate_kernel":
        from ..kernels.rerotate import rerotate_kernel as kernel
    elif name == "rope_norm_backward_kernel":
        from ..kernels.backward import rope_norm_backward_kernel as kernel
    else:
        from ..kernels.store import rope_store_kernel as kernel
    return kernel


# ---------------------------------------------------------------------------------------------
# the fused store


def slot_geometry(cache: torch.Tensor):
    """(block_size, stride of a block, stride of a slot within a block, stride of a head)."""
    if cache.dim() == 4:
        return cache.shape[1], cache.stride(0), cache.stride(1), cache.stride(2)
    return 1, cache.stride(0), 0, cache.stride(1)  # flat: every slot is a block of one


def _store_tiles(half: int, n_q: int, n_k: int, k_tail: int, n_v: int, d_v: int, block_elems: int, variant):
    """Tile sizes of rope_store_kernel: BLOCK_HQ / BLOCK_HK heads of the rotated dims (the rule of
    _tiles; all heads in one block for a norm across heads, which needs a whole token), BLOCK_HV
    heads of v, each ~block_elems elements."""
    half_pad = next_pow2(half)
    rows = max(1, block_elems // (2 * half_pad))
    bhq = next_pow2(n_q) if variant.norm_q == NORM_TOKEN else min(next_pow2(n_q), next_pow2(rows))
    bhk = next_pow2(n_k) if variant.norm_k == NORM_TOKEN else min(next_pow2(n_k), next_pow2(rows))
    tail_pad = next_pow2(k_tail) if k_tail > 0 else 0
    dv_pad = next_pow2(d_v)
    bhv = min(next_pow2(n_v), next_pow2(max(1, block_elems // dv_pad)))
    nqb, nkb, nvb = -(-n_q // bhq), -(-n_k // bhk), -(-n_v // bhv)
    return half_pad, bhq, bhk, bhv, tail_pad, dv_pad, nqb, nkb, nvb


def block_warps(block_h: int, half_pad: int, tail_pad: int, warps: int) -> int:
    """Warps for a head block of block_h heads: blocks holding a whole token (a norm across up to
    64 heads of 128) need more warps to stay in registers; smaller ones keep `warps`."""
    elems = block_h * (2 * half_pad + tail_pad)
    return max(warps, min(8, next_pow2(max(1, elems // 1024))))


def plan_store(t, variant, rot: int, packed=(1, 0)):
    """rope_store_kernel's launch for a store run's operands t (ropekit.core.run.StoreOperands;
    None for an empty call). t.a: the variant's angle source (positions (*T) or (3, *T) with
    M-RoPE, cu_seqlens for packed angles, None for arange); packed: (cp_size, cp_rank). The
    variant says the rest: q into t.q_out (its tail copied) or in place, k written back
    (write_key), which caches and outputs are scaled, q / k normalized first (tails too), and with
    nope_q / nope_k the heads' no-rope parts t.qn / t.kn (q, k then hold the rotary dims only): the
    tails of q_out / the k cache rows are read from them."""
    q, k, v, q_nope, k_nope = t.q, t.k, t.v, t.qn, t.kn
    n_tok = q.dim() - 2
    n_tokens = q.shape[:n_tok].numel()
    n_q, n_k, n_v = q.shape[-2], k.shape[-2], v.shape[-2]
    if empty_call(n_tokens, n_q + n_k + n_v):
        return None
    S = q.shape[n_tok - 1]
    half = rot // 2
    d_v = v.shape[-1]
    # the widths past the rotary dims: q's / k's own tails, or the no-rope parts given apart
    q_tail = q_nope.shape[-1] if variant.nope_q else q.shape[-1] - rot
    k_tail = k_nope.shape[-1] if variant.nope_k else k.shape[-1] - rot
    head_loop = tuning.get("store_head_loop")
    if head_loop is None:
        head_loop = not tuning.decode_sized(n_tokens)
    half_pad, bhq, bhk, bhv, tail_pad, dv_pad, nqb, nkb, nvb = _store_tiles(
        half,
        n_q,
        n_k,
        k_tail,
        n_v,
        d_v,
        tuning.get("decode_block_elems" if tuning.decode_sized(n_tokens) else "store_block_elems"),
        variant,
    )
    angles = angle_layout(variant, rot, t.a, t.table, None, packed)
    block_size, skc_blk, skc_off, skc_h = slot_geometry(t.k_cache)
    _, svc_blk, svc_off, svc_h = slot_geometry(t.v_cache)
    qo = q if t.q_out is None else t.q_out
    args = (
        S,
        n_q,
        n_k,
        n_v,
        k_tail,
        d_v,
        angles.max_pos,
        angles.sin_off,
        block_size,
        t.k_cache.shape[0] * block_size,
        nqb,
        nkb,
        nqb + nkb + nvb,
        *token_strides(q, n_tok),
        q.stride(-2),
        *token_strides(k, n_tok),
        k.stride(-2),
        *token_strides(v, n_tok),
        v.stride(-2),
        *angles.pos_strides,  # (row, b, s)
        *angles.strides[2:],  # (table row, column)
        *section_args(variant, half, q.device),
        *angles.packed,  # sequences, cp_size, cp_rank (read only when PACKED)
        *token_strides(t.slot_mapping, n_tok),
        skc_blk,
        skc_off,
        skc_h,
        svc_blk,
        svc_off,
        svc_h,
        *token_strides(qo, n_tok),
        qo.stride(-2),
        v.stride(-1),
        q_tail,
        *nope_strides(q_nope if variant.nope_q else None, n_tok),
        *nope_strides(k_nope if variant.nope_k else None, n_tok),
        *(slot_geometry(t.kcs)[1:] if variant.fp4 else (0, 0, 0)),
        *(slot_geometry(t.vcs)[1:] if variant.fp4 else (0, 0, 0)),
    )  # then the norm's eps and offset, per launch (pipeline.run_store)
    il = variant.interleaved
    # q's tail is written when it moves (a separate q_out) or changes (normalized, in place too)
    q_tail_written = q_tail > 0 and (variant.q_out or variant.norm_q != NORM_NONE)
    meta = dict(
        HALF=half,
        HALF_PAD=half_pad,
        GAP=pair_gap(variant, half, k.shape[-1]),
        BLOCK_HQ=bhq,
        BLOCK_HK=bhk,
        BLOCK_HV=bhv,
        TAIL_PAD=tail_pad,
        DV_PAD=dv_pad,
        **angle_meta(angles, variant, ("HAS_POS", "PACKED", "SEARCH_STRIDE", "SEARCH_COARSE")),
        **variant_flags("rope_store_kernel", variant),
        PACK_Q=_pair_bits(q, t.q_out) if il else 0,
        PACK_K=_pair_bits(k, t.k_cache) if il else 0,
        TAIL_PAD_Q=next_pow2(q_tail) if q_tail_written else 0,
        HEAD_LOOP=head_loop,
        **pdl_meta(q, n_tokens),
        num_warps=tuning.warps(head_loop, variant.mrope != 0, n_tokens, store=True),
    )
    if variant.normed:
        tails = max(tail_pad, meta["TAIL_PAD_Q"])
        meta["num_warps"] = block_warps(max(bhq, bhk), half_pad, tails, meta["num_warps"])
    return Plan((n_tokens, 1 if head_loop else nqb + nkb + nvb), args, meta, 0, {})


def nope_strides(x, n_tok: int) -> tuple:
    """(b, s, head, dim) strides of a no-rope part (q_nope, k_nope); zeros when there is none."""
    if x is None:
        return 0, 0, 0, 0
    return (*token_strides(x, n_tok), x.stride(-2), x.stride(-1))


# ---------------------------------------------------------------------------------------------
# re-rotation of cached keys


def _rerotate_tiles(half: int, n_heads: int, tail: int, block_elems: int, elem_bytes: int):
    """(HALF_PAD, BLOCK_H, ROWS, TAIL_PAD, head blocks, num_warps) for a cache shape: a program takes
    ROWS rows of BLOCK_H heads, ~block_elems rotated elements (MLA's 64-dim rows: 32 rows a program;
    W12's 8 heads x 128: 2 rows). Warps: rerotate_warps, or where it is 0 as many as give each
    thread one 16-byte vector of each pair half (block_elems / 2 x elem_bytes / 16 / 32), at most 4:
    4 for a 2048-element program of a bf16 cache, 2 for an fp8 one."""
    half_pad = next_pow2(half)
    block_h = min(next_pow2(n_heads), next_pow2(max(1, block_elems // (2 * half_pad))))
    rows = next_pow2(max(1, block_elems // (block_h * 2 * half_pad)))
    tail_pad = next_pow2(tail) if tail > 0 else 0
    warps = tuning.get("rerotate_warps") or max(1, min(4, block_elems * elem_bytes // 1024))
    return half_pad, block_h, rows, tail_pad, -(-n_heads // block_h), warps


def plan_rerotate(
    k_cache, slots, delta, table, dst_slots, variant, rot: int, positions=None, to_table=None
) -> Optional[Plan]:
    """rerotate_kernel's launch (delta: a tensor, or None for one int shift passed per launch;
    positions and to_table with variant.two_tables). None when there is nothing to launch."""
    n_heads, d = k_cache.shape[-2], k_cache.shape[-1]
    if empty_call(slots.shape[0], n_heads):
        return None
    half = rot // 2
    tail = d - rot if dst_slots is not None else 0  # in place, the tail already sits where it belongs
    half_pad, block_h, rows, tail_pad, n_blocks, num_warps = _rerotate_tiles(
        half, n_heads, tail, tuning.get("rerotate_block_elems"), k_cache.element_size()
    )
    block_size, stride_block, stride_offset, stride_head = slot_geometry(k_cache)
    args = (
        n_heads,
        d - rot,
        table.shape[0],
        half * table.stride(1),
        0 if to_table is None else to_table.shape[0],
        0 if to_table is None else half * to_table.stride(1),
        block_size,
        k_cache.shape[0] * block_size,
        slots.shape[0],
        slots.stride(0),
        0 if dst_slots is None else dst_slots.stride(0),
        0 if delta is None else delta.stride(0),
        0 if positions is None else positions.stride(0),
        table.stride(0),
        table.stride(1),
        0 if to_table is None else to_table.stride(0),
        0 if to_table is None else to_table.stride(1),
        stride_block,
        stride_offset,
        stride_head,
    )
    meta = dict(
        HALF=half,
        HALF_PAD=half_pad,
        GAP=pair_gap(variant, half, d),
        BLOCK_H=block_h,
        ROWS=rows,
        TAIL_PAD=tail_pad,
        **variant_flags("rerotate_kernel", variant),
        DELTA_SCALAR=delta is None,
        num_warps=num_warps,
    )
    return Plan((-(-slots.shape[0] // rows), n_blocks), args, meta, 0, {})


# ---------------------------------------------------------------------------------------------
# the backward of q/k RMSNorm + rotation: one launch per tensor (q or k)

# position of dw_row in a norm-backward plan's args (norm_backward_rows reads it back)
_NORM_BWD_DW_ROW = 8


def angle_args(angles: AngleLayout, variant, device=None) -> tuple:
    """The kernels' runtime angle arguments, in their order: positions' (row, b, s) strides, the
    angles' (row, b, s, col) strides, SEC_T / SEC_H / SEC_W (section_args, on `device`), then
    n_seqs, cp_size, cp_rank."""
    sections = section_args(variant, angles.half, device)
    return (*angles.pos_strides, *angles.strides, *sections, *angles.packed)


_ANGLE_META = ("HAS_POS", "PACKED", "SEARCH_STRIDE", "SEARCH_COARSE", "FREQS")


def angle_meta(angles: AngleLayout, variant, names=_ANGLE_META) -> dict:
    """The kernels' constexprs of where the angles come from (see ropekit.language.load_angles); names:
    those the kernel takes (the store's computes no angles: no FREQS). M-RoPE's layout is a field
    of the record (variant_flags)."""
    meta = dict(
        HAS_POS=angles.max_pos > 0,
        PACKED=variant.angles == "packed",
        SEARCH_STRIDE=angles.search[0],
        SEARCH_COARSE=angles.search[1],
        FREQS=variant.angles == "freqs",
    )
    return meta if names is _ANGLE_META else {n: meta[n] for n in names}


def _check_norm_weight(x: torch.Tensor, w: Optional[torch.Tensor], mode: int) -> None:
    """The weight a norm mode needs: none for mode 0 and 3 (unweighted), (D,) per head, (H*D,) across heads."""
    n_heads, d = x.shape[-2], x.shape[-1]
    want = {0: None, 1: d, 2: n_heads * d, 3: None}.get(mode, -1)
    given = None if w is None else w.numel()
    if want == -1 or given != want:
        from .args import fail  # imported here: validation is not needed to launch

        fail(
            "plan_norm_backward",
            "w",
            f"no weight for mode 0 or 3, {d} elements for mode 1, {n_heads * d} for mode 2",
            f"{given} for mode {mode}",
        )


def plan_norm_backward(x, g, gx, w, angles: AngleLayout, variant, mode: int) -> Optional[Plan]:
    """rope_norm_backward_kernel's launch for one tensor of a forward y = rotate(rmsnorm(x) * (w +
    offset)) (None for an empty call: nothing to launch; the weight gradient is then zero).

    x: the forward's input (q or k), (*T, H, D) tokens-first, in variant.interleaved's layout
    (mode 0: only its shape is used). g: the output gradient, x's shape, in variant.out_interleaved's
    layout. gx: the input gradient to write, x's shape and layout. All three of any last stride
    (STRIDED: addressed through it), float32 / bf16 / fp16 (computed in float32). w: the norm
    weight (float32 / bf16 / fp16, unit stride), None for mode 0 (the plain inverse rotation), (D,)
    for mode 1 (per head), (H*D,) for mode 2 (across heads). angles: angle_layout(variant, rot, a,
    b, ...) as for the forward. The weight-gradient partial sums: a float32 buffer of
    norm_backward_rows(plan) (norm_partials).
    A plan holds the shapes and strides of x, g, gx and the AngleLayout: reuse it while they match."""
    n_tok = x.dim() - 2
    n_tokens = x.shape[:n_tok].numel()
    n_heads, d = x.shape[-2], x.shape[-1]
    if empty_call(n_tokens, n_heads):
        return None
    _check_norm_weight(x, w, mode)
    half = angles.half
    half_pad = next_pow2(half)
    tail = d - 2 * half
    tail_pad = next_pow2(tail) if tail > 0 else 0
    block_elems = tuning.get("across_block_elems" if mode == 2 else "block_elems")
    block_h = min(next_pow2(n_heads), next_pow2(max(1, block_elems // (2 * half_pad))))
    # across heads (mode 2) each program walks all head blocks of its tokens (the norm group is the
    # token): one program along heads. Whole heads: one block of every head, in tiles
    knob = tuning.get("whole_heads")
    whole = mode != 0 and (mode == 2 if knob is None else bool(knob))
    tiles = head_tiles(n_heads) if whole else (block_h, 0, 0)
    block_h = tiles[0]
    n_blocks = 1 if (mode == 2 or whole) else -(-n_heads // block_h)
    per_program = -(-n_tokens // max(1, tuning.get("norm_bwd_programs")))
    pack = 0
    if variant.interleaved or variant.out_interleaved:
        pack = _pair_bits(*((x, gx) if variant.interleaved else ()), *((g,) if variant.out_interleaved else ()))
    cols = tuple(t.stride(-1) if col_strided(t) else 1 for t in (x, g, gx))  # column strides (rope_kernel's rule)
    args = (
        n_tokens,
        x.shape[n_tok - 1],
        n_heads,
        tail,
        angles.max_pos,
        n_blocks,
        angles.sin_off,
        per_program,
        n_heads * d if mode == 2 else d,  # dw_row: at _NORM_BWD_DW_ROW
        *token_strides(x, n_tok),
        x.stride(-2),
        *token_strides(g, n_tok),
        g.stride(-2),
        *token_strides(gx, n_tok),
        gx.stride(-2),
        *cols,
        *angle_args(angles, variant, x.device),
    )
    meta = dict(
        HALF=half,
        HALF_PAD=half_pad,
        GAP=pair_gap(variant, half, d),
        BLOCK_H=block_h,
        TAIL_PAD=tail_pad,
        **variant_flags("rope_norm_backward_kernel", variant),
        NORM=mode,
        **angle_meta(angles, variant),
        PACK=pack,
        WHOLE=whole,
        STRIDED=cols != (1, 1, 1),
        BLOCK_H2=tiles[1],
        BLOCK_H3=tiles[2],
        W_PAIRS=mode in (1, 2) and variant.interleaved and bool(tuning.get("weight_pairs")),
        num_warps=tuning.get("norm_bwd_warps") or norm_bwd_warps(sum(tiles), half_pad, tail_pad, whole),
    )
    return Plan((-(-n_tokens // per_program), n_blocks), args, meta, pack // 8, {})


def norm_bwd_warps(block_h: int, half_pad: int, tail_pad: int, whole: bool) -> int:
    """Warps of the norm's backward: norm_warps' rule, at least 4; whole heads 4 up to 6144 elements
    (ptxas, sm_90, Wan's 40 heads of 128 across heads: 243 registers a thread at 4 warps, 2 programs
    an SM; 165 at 8 and 109 at 16, one program; 2 warps spill), else 8."""
    if whole:
        return 4 if block_h * (2 * half_pad + tail_pad) <= 6144 else 8
    return max(4, norm_warps(block_h, half_pad, tail_pad))


def norm_backward_rows(plan: Plan) -> tuple:
    """(rows, row length): the shape of the float32 weight-gradient partial sums a launch of this
    plan writes, one row per program (the rows' sum is the weight's gradient, norm_weight_grad)."""
    return plan.grid[0] * plan.grid[1], plan.args[_NORM_BWD_DW_ROW]


def norm_partials(plan: Plan, device) -> torch.Tensor:
    """An uninitialized float32 buffer of norm_backward_rows(plan) on device: the weight-gradient
    partial sums fire_norm_backward writes (every element)."""
    return torch.empty(norm_backward_rows(plan), dtype=torch.float32, device=device)


def angle_pointers(meta: dict, a, b) -> tuple:
    """(positions, cos, sin) pointer tensors of a launch from the angle operands (a, b) as
    ropekit.core.pipeline.run_rotate takes them; a slot the plan never reads gets one of them (a valid address)."""
    if meta["HAS_POS"] or meta["FREQS"]:  # positions (or cu_seqlens); a table, or the inverse frequencies
        return a, b, b
    if a is None:  # arange: the table alone
        return b, b, b
    return a, a, b  # per-token cos and sin


def fire_norm_backward(plan: Optional[Plan], x, g, gx, w, dw, a, b, eps: float, offset: float) -> None:
    """Launch rope_norm_backward_kernel: gx written, and with a weight the float32 partial sums dw
    (norm_backward_rows(plan), every row written; None for mode 0). Tensors as plan_norm_backward
    took them, (a, b) the forward's angle operands (ropekit.core.pipeline.run_rotate's), eps and offset the
    forward norm's. Nothing to do for an empty call (plan None)."""
    if plan is None:
        return
    meta = plan.meta
    if plan.pack_bytes and (x.data_ptr() | g.data_ptr() | gx.data_ptr()) % plan.pack_bytes:
        meta = dict(meta, PACK=0)  # a base pointer off the pair alignment: the element path
    if meta["W_PAIRS"] and w.data_ptr() % 16:
        meta = dict(meta, W_PAIRS=False)  # a weight off the 16-byte grid: its element loads
    # mode 0 never reads the weight nor writes the partial sums: those slots get g (a valid address)
    ptrs = (x, g, gx, g if w is None else w, g if dw is None else dw, *angle_pointers(meta, a, b))
    launch_kernel(
        kernel("rope_norm_backward_kernel"),
        plan.compiled,
        (meta["PACK"], meta["W_PAIRS"]),
        plan.grid,
        ptrs,
        (*plan.args, float(eps), float(offset)),
        meta,
    )


def norm_weight_grad(dw_rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The norm weight's gradient, w's shape and dtype, from the float32 partial sums
    (norm_backward_rows(plan)) a launch wrote: their sum over rows, in float32 then cast."""
    return dw_rows.sum(0).to(w.dtype)
