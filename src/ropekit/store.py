"""Fused RoPE + KV-cache store: validation -> strides -> one launch of `rope_store_kernel`.

    apply_rope_and_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ...)

Serving engines rotate q and k, then write k and v into the KV cache: two or three launches and a
round trip of k through memory. Here one kernel rotates q in place and writes rotated k and v
straight into the cache rows `slot_mapping` names. CUDA tensors run the Triton kernel; CPU tensors
run it under TRITON_INTERPRET=1, otherwise the pure-PyTorch reference, with the same semantics.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional, Union

import torch

from . import ops, reference, validate
from .launch import launch as launch_kernel
from .ops import _next_pow2, _token_strides, _use_triton

OP = "apply_rope_and_store"

Scale = Union[None, float, torch.Tensor]


@functools.lru_cache(maxsize=None)
def _store_meta(half: int, n_q: int, n_k: int, k_tail: int, n_v: int, d_v: int, block_elems: int, warps: int):
    """Compile-time tile sizes; cached so decode pays for them once.

    Each program handles about block_elems elements: BLOCK_HQ / BLOCK_HK heads of the rotated
    dims (the rule of ops._meta), BLOCK_HV heads of v.
    """
    half_pad = _next_pow2(half)
    rows = max(1, block_elems // (2 * half_pad))
    bhq = min(_next_pow2(n_q), _next_pow2(rows))
    bhk = min(_next_pow2(n_k), _next_pow2(rows))
    tail_pad = _next_pow2(k_tail) if k_tail > 0 else 0
    dv_pad = _next_pow2(d_v)
    bhv = min(_next_pow2(n_v), _next_pow2(max(1, block_elems // dv_pad)))
    elems = max(max(bhq, bhk) * 2 * half_pad, bhv * dv_pad)
    num_warps = warps or 2          # H200 sweep (run 6): 2 warps 83% of copy on W7, 4 warps 66%
    nqb, nkb, nvb = -(-n_q // bhq), -(-n_k // bhk), -(-n_v // bhv)
    return half_pad, bhq, bhk, bhv, tail_pad, dv_pad, num_warps, nqb, nkb, nvb


def _slot_geometry(cache: torch.Tensor):
    """(block_size, stride of a block, stride of a slot within a block, stride of a head)."""
    if cache.dim() == 4:
        return cache.shape[1], cache.stride(0), cache.stride(1), cache.stride(2)
    return 1, cache.stride(0), 0, cache.stride(1)        # flat: every slot is a block of one


def _pair_bits(*xs) -> int:
    """_rotate_heads' PACK for tensors read or written as (2i, 2i+1) pairs: the bits of one pair
    when every one keeps pairs word-aligned (one element size of 2 or 4 bytes, even strides), else 0.
    Base-pointer alignment is checked per call (`_fire`)."""
    sizes = {x.element_size() for x in xs}
    if len(sizes) != 1 or not sizes <= {2, 4}:
        return 0
    if any(st % 2 for x in xs for st in x.stride()[:-1]):
        return 0
    return 16 * sizes.pop()


# Tile size of the store kernel, elements per program (the tuning sweep sets it with ops' own):
# run 8 measured W7 at 85.8% of copy with 1024, 83.1% with 2048 (2 warps both).
_BLOCK_ELEMS = int(os.environ.get("ROPEKIT_STORE_BLOCK_ELEMS", "1024"))


class Launch(NamedTuple):
    """A rope_store_kernel launch minus its tensors: planned once per call signature."""
    grid: tuple
    args: tuple             # the runtime ints, in kernel order after the pointers
    meta: dict              # constexprs and num_warps
    compiled: dict          # ropekit.launch's cache of compiled kernels for this plan


def _plan(q, k, v, positions, table, k_cache, v_cache, slot_mapping, interleaved, rot, k_scaled, v_scaled):
    n_tok = q.dim() - 2
    S = q.shape[n_tok - 1]
    n_tokens = q.shape[:n_tok].numel()
    half = rot // 2
    n_q, n_k, n_v = q.shape[-2], k.shape[-2], v.shape[-2]
    d_k, d_v = k.shape[-1], v.shape[-1]
    half_pad, bhq, bhk, bhv, tail_pad, dv_pad, num_warps, nqb, nkb, nvb = _store_meta(
        half, n_q, n_k, d_k - rot, n_v, d_v, _BLOCK_ELEMS, getattr(ops, "_NUM_WARPS", 0))
    row, col = table.stride(0), table.stride(1)
    block_size, skc_blk, skc_off, skc_h = _slot_geometry(k_cache)
    _, svc_blk, svc_off, svc_h = _slot_geometry(v_cache)
    has_pos = positions is not None
    args = (
        S, n_q, n_k, n_v, d_k - rot, d_v, table.shape[0] if has_pos else 0, half * col,
        block_size, k_cache.shape[0] * block_size, nqb, nkb,
        *_token_strides(q, n_tok), q.stride(-2),
        *_token_strides(k, n_tok), k.stride(-2),
        *_token_strides(v, n_tok), v.stride(-2),
        *(_token_strides(positions, n_tok) if has_pos else (0, 0)), row, col,
        *_token_strides(slot_mapping, n_tok),
        skc_blk, skc_off, skc_h, svc_blk, svc_off, svc_h,
    )
    meta = dict(
        HALF=half, HALF_PAD=half_pad, BLOCK_HQ=bhq, BLOCK_HK=bhk, BLOCK_HV=bhv,
        TAIL_PAD=tail_pad, DV_PAD=dv_pad, HAS_POS=has_pos, INTERLEAVED=interleaved,
        K_SCALED=k_scaled, V_SCALED=v_scaled,
        PACK_Q=_pair_bits(q) if interleaved else 0,
        PACK_K=_pair_bits(k, k_cache) if interleaved else 0,
        num_warps=num_warps,
    )
    return Launch((n_tokens, nqb + nkb + nvb), args, meta, {})


def _fire(launch: Launch, q, k, v, positions, table, k_cache, v_cache, slot_mapping, ks, vs) -> None:
    from .kernels.store import rope_store_kernel

    meta = launch.meta
    # packed pairs need word-aligned base pointers too (a view may start at an odd element)
    if meta["PACK_Q"] and q.data_ptr() % (meta["PACK_Q"] // 8):
        meta = dict(meta, PACK_Q=0)
    if meta["PACK_K"] and (k.data_ptr() | k_cache.data_ptr()) % (meta["PACK_K"] // 8):
        meta = dict(meta, PACK_K=0)
    ptrs = (q, k, v, table if positions is None else positions, table, slot_mapping, k_cache, v_cache,
            table if ks is None else ks, table if vs is None else vs)   # scales: never read unless scaled
    launch_kernel(rope_store_kernel, launch.compiled, (meta["PACK_Q"], meta["PACK_K"]), launch.grid, ptrs,
                  launch.args, meta)


def _fp8_scales(k_cache, v_cache, ks, vs, device):
    """fp8 caches always take the scaled path (scale 1.0 by default): the kernel then casts to fp8
    from float32 only, the one conversion every backend has (bf16 -> fp8 directly is not everywhere)."""
    if ks is None and k_cache.dtype in validate.FP8_DTYPES:
        ks = _scale_tensor(1.0, device, unit=True)
    if vs is None and v_cache.dtype in validate.FP8_DTYPES:
        vs = _scale_tensor(1.0, device, unit=True)
    return ks, vs


def _launch_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                   interleaved, rot, k_scale, v_scale):
    k_scale, v_scale = _fp8_scales(k_cache, v_cache, k_scale, v_scale, q.device)
    launch = _plan(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, interleaved, rot,
                   k_scale is not None, v_scale is not None)
    _fire(launch, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _run_reference(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                   interleaved, rot, k_scale, v_scale):
    """The CPU path, with the kernel's semantics: float32 math, one rounding into the cache dtype
    (no detour through k's dtype), slots past the cache skipped and flagged in q."""
    n_tok = q.dim() - 2
    block_size = k_cache.shape[1] if k_cache.dim() == 4 else 1
    slots = slot_mapping.long()
    bad = slots >= k_cache.shape[0] * block_size
    keep = (slots >= 0) & ~bad
    cos, sin = reference.angles_from_table(cos_sin_cache, positions, tuple(q.shape[:n_tok]), rotary_dim=rot)
    q.copy_(reference.rotate(q, cos, sin, interleaved=interleaved))
    if bool(bad.any()):
        q[..., :rot][bad] = float("nan")
    idx = slots[keep]
    k_rot = reference.rotate(k.float(), cos, sin, interleaved=interleaved)
    for cache, rows, scale in ((k_cache, k_rot, k_scale), (v_cache, v.float(), v_scale)):
        vals = rows[keep]
        if scale is not None:
            vals = vals / scale.reshape(()).float()
        vals = vals.to(cache.dtype)
        if cache.dim() == 4:
            cache[idx // block_size, idx % block_size] = vals
        else:
            cache[idx] = vals


def _checks(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
            extents=None, memo=None):
    """The checks that need real tensors (addresses; data in strict mode), before any write."""
    validate.store_aliasing(OP, q, k, v, k_cache, v_cache, extents=extents, memo=memo)
    validate.written_vs_read(OP, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)),
                             (("positions", positions), ("cos_sin_cache", cos_sin_cache), ("slot_mapping", slot_mapping),
                              ("k_scale", k_scale), ("v_scale", v_scale)))
    if validate.is_strict():
        if positions is not None:
            validate.positions_in_range(OP, positions, cos_sin_cache.shape[0])
        num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
        validate.slots_in_range(OP, slot_mapping, num_slots)
        validate.slots_unique(OP, slot_mapping)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                validate.scale_value(OP, name, scale)


def _run(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
         interleaved, rot, k_scale, v_scale):
    """Checks, then the kernel (or the reference on CPU): the body of the custom op."""
    _checks(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if q.shape[:-2].numel() == 0:
        return
    if _use_triton(q):
        _launch_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       interleaved, rot, k_scale, v_scale)
    else:
        _run_reference(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       interleaved, rot, k_scale, v_scale)


# ---------------------------------------------------------------------------------------------
# torch.library registration: what torch.compile sees


@torch.library.custom_op("ropekit::rope_and_store", mutates_args=("q", "k_cache", "v_cache"))
def _rope_and_store_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    interleaved: bool, rotary_dim: int, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
) -> None:
    _run(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
         interleaved, rotary_dim, k_scale, v_scale)


@_rope_and_store_op.register_fake
def _(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, interleaved, rotary_dim,
      k_scale, v_scale):
    return None


# Float scales become 1-element device tensors, read inside the kernel like a tensor scale. Eager
# calls reuse one tensor per (value, device), so steady state costs no launch or copy; during CUDA
# graph capture (or under torch.compile) a fresh one is filled by a kernel that the graph records.
_SCALES: dict = {}


def _scale_tensor(scale: Scale, device: torch.device, unit: bool = False) -> Optional[torch.Tensor]:
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    if scale == 1.0 and not unit:
        return None                                       # x / 1 == x: skip the division
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.full((1,), scale, dtype=torch.float32, device=device)
    key = (scale, str(device))
    t = _SCALES.get(key)
    if t is None:
        if len(_SCALES) >= 64:
            _SCALES.clear()
        t = _SCALES[key] = torch.full((1,), scale, dtype=torch.float32, device=device)
    return t


# ---------------------------------------------------------------------------------------------
# public op


def apply_rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:
    """Rotate q in place; write rotated k and unrotated v into the cache rows of their slots. One launch.

    Args:
        q: (*T, Hq, Dq) fp16/bf16/fp32, *T = (T,) or (B, S); any strides, last stride 1. Rotated
            in place (dims past rotary_dim untouched).
        k: (*T, Hk, Dk), its own strides; rotated into k_cache (q and k are never mixed up:
            MLA's q_pe view of a 192-wide head and a separate k_pe are fine).
        v: (*T, Hv, Dv), copied into v_cache; Dv may differ from Dk (MLA: latent 512, rope 64).
        positions: (*T) int32/int64, or None for arange over the last token dim.
        cos_sin_cache: (max_position, rotary_dim) rows [cos | sin]; fp32 recommended.
        k_cache: (num_blocks, block_size, Hk, Dk) paged or (num_slots, Hk, Dk) flat, any strides
            with last stride 1: NHD as is, HND as `cache.permute(0, 2, 1, 3)`, the k half of a
            (num_blocks, 2, block_size, H, D) buffer as `buf[:, 0]`. fp16/bf16/fp32 or
            float8_e4m3fn (need not match k's dtype; values are cast).
        v_cache: like k_cache for v, with the same slot dims (num_blocks, block_size) or
            (num_slots,). MLA keeps one joint row [latent | rope]: pass views of one cache,
            `k_cache = cache[..., L:]`, `v_cache = cache[..., :L]` (a 3-D MLA cache
            (num_blocks, block_size, L + R) as `cache.unsqueeze(-2)` first).
        slot_mapping: (*T) int32/int64; token i goes to slot slot_mapping[i] = block * block_size
            + offset. A slot < 0 is padding: nothing is stored for that token.
        interleaved: False rotates halves (Llama/NeoX), True pairs (2i, 2i+1) (GPT-J, DeepSeek).
        rotary_dim: must equal the width of cos_sin_cache (default); dims past it are kept.
        k_scale, v_scale: None, a float, or a 0-d/1-element float32 tensor on q's device: the
            cache stores value / scale (per-tensor fp8 scaling; also honoured for other caches).
            A tensor scale is read inside the kernel: no host sync, safe in CUDA graphs. A float
            is turned into a cached device tensor (1.0 means no scaling).

    Returns q (rotated in place). Rows of the caches that no slot names are never touched.
    Duplicate slots (two tokens naming one slot) are a caller error: without strict mode the row
    holds an unspecified mix (its k row and its v row may come from different tokens); under
    `ropekit.strict()` they raise ValueError naming the slot and both tokens, before any write.

    Bad inputs never cause an out-of-bounds access, and nothing is synced by default:
    - a position outside [0, max_position): that token's rotated dims of q and of its k row are
      NaN (as in apply_rope);
    - a slot >= num_slots: nothing is stored for that token, and its rotated q dims are made NaN,
      so the mistake shows up in the attention output instead of corrupting someone else's row.
    Under `ropekit.strict()` (or ROPEKIT_STRICT=1) bad positions and slots, and tensor scales that
    are not finite and > 0, raise ValueError before anything is written (one device sync).

    fp8: values are divided by the scale in float32 and cast once (round to nearest even); keep
    |value / scale| <= 448 (e4m3's range): ropekit does not clamp, and what a value out of range
    becomes depends on the backend's cast (the GPU saturates).

    Inference only: tensors that require grad are refused while grad mode is on.
    """
    if torch.compiler.is_compiling():
        rot, _, _, k_scale, v_scale = validate.store_args(
            OP, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
            rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale)
        torch.ops.ropekit.rope_and_store(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, bool(interleaved), rot,
            _scale_tensor(k_scale, q.device), _scale_tensor(v_scale, q.device))
        return q

    # eager: validation and the launch plan are made once per call signature (decode host time);
    # only the address-dependent checks run on every call
    key = _call_key(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                    interleaved, rotary_dim, k_scale, v_scale)
    spec = _SPECS.get(key) if key is not None else None
    if spec is None:
        rot, _, _, _, _ = validate.store_args(
            OP, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
            rotary_dim=rotary_dim, k_scale=k_scale, v_scale=v_scale)
        spec = _Spec(rot, validate.store_extents(q, k, v, k_cache, v_cache), {}, [None])
        if key is not None:
            if len(_SPECS) >= 1024:
                _SPECS.clear()
            _SPECS[key] = spec
    ks, vs = _scale_tensor(k_scale, q.device), _scale_tensor(v_scale, q.device)
    _checks(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs,
            extents=spec.extents, memo=spec.alias)
    if q.shape[:-2].numel() == 0:
        return q
    interleaved = bool(interleaved)
    if _use_triton(q):
        ks, vs = _fp8_scales(k_cache, v_cache, ks, vs, q.device)
        launch = spec.launch[0]
        if launch is None:
            launch = spec.launch[0] = _plan(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                            interleaved, spec.rot, ks is not None, vs is not None)
        _fire(launch, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs)
    else:
        _run_reference(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                       interleaved, spec.rot, ks, vs)
    # the kernel writes through raw pointers, which autograd does not see: bump the version counters
    # so that anything that saved q or a cache for a backward raises instead of reading new values
    for x in (q, k_cache, v_cache):
        torch.autograd.graph.increment_version(x)
    return q


class _Spec(NamedTuple):
    """What validation concluded about one call signature, and its launch plan once made."""
    rot: int
    extents: tuple          # validate.store_extents of the call's tensors
    alias: dict             # store_aliasing's memo: verdicts by pair and byte distance
    launch: list            # [Launch or None]


_SPECS: dict = {}


def _sig(x):
    return (x.shape, x.stride(), x.dtype, x.device)


def _scale_key(scale):
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        return _sig(scale)
    return type(scale), scale                   # the value: validation depends on it (> 0, finite)


def _call_key(q, k, v, positions, table, k_cache, v_cache, slot_mapping, interleaved, rotary_dim,
              k_scale, v_scale):
    """A hashable signature of a call (types, shapes, strides, dtypes, devices, flags: all that
    validation reads), or None when the call must be validated afresh: arguments of the wrong type,
    or anything requiring grad (which must raise)."""
    try:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or k_cache.requires_grad or v_cache.requires_grad):
            return None
        key = (_sig(q), _sig(k), _sig(v), None if positions is None else _sig(positions), _sig(table),
               _sig(k_cache), _sig(v_cache), _sig(slot_mapping), bool(interleaved),
               type(rotary_dim), rotary_dim, _scale_key(k_scale), _scale_key(v_scale))
        hash(key)
        return key
    except (AttributeError, TypeError):
        return None
