"""Fused RoPE + KV-cache store: `apply_rope_and_store`, one launch of `rope_store_kernel`.

    apply_rope_and_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, ...)

Serving engines rotate q and k, then write k and v into the KV cache: two or three launches and a
round trip of k through memory. Here one kernel rotates q in place and writes rotated k and v
straight into the cache rows `slot_mapping` names. The call goes the one call path of every op
(signature -> memoized spec -> this call's checks -> one door, ropekit.core.dispatch): every
keyword (QK-RMSNorm weights, packed sequences, M-RoPE, fp8 caches, q_out, write_key) is a field of
the spec's Variant, not a second pipeline. CPU tensors without TRITON_INTERPRET=1 run
ropekit.core.cpu with the same semantics.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..core import checks, strict
from ..core.args import fail
from ..core.dispatch import STORE
from ..core.pipeline import prepare
from ..core.run import StoreOperands, scale_tensor
from ..core.variant import DIRECT, FUNCTION, RECORD, Signature

OP = "apply_rope_and_store"

Scale = Union[None, float, torch.Tensor]


def apply_rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    interleaved: bool = False,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    mrope_layout: Union[None, str, Sequence[int]] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    k_scale: Scale = None,
    v_scale: Scale = None,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
    l2_norm: bool = False,
    write_key: bool = False,
    q_out: Optional[torch.Tensor] = None,
    q_scale: Scale = None,
    k_nope: Optional[torch.Tensor] = None,
    q_nope: Optional[torch.Tensor] = None,
    rotary_position: str = "first",
    k_cache_scales: Optional[torch.Tensor] = None,
    v_cache_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Rotate q in place (or into q_out); write rotated k and unrotated v into the cache rows of
    their slots. One launch, whatever the keywords.

    Args:
        q: (*T, Hq, Dq) fp16/bf16/fp32, *T = (T,) or (B, S); any strides, last stride 1. Rotated
            in place (dims past rotary_dim untouched) unless q_out is given; with q_out, q is
            only read and may have any last stride (then read through one copy).
        k: (*T, Hk, Dk), its own strides; rotated into k_cache (q and k are never mixed up:
            MLA's q_pe view of a 192-wide head and a separate k_pe are fine). A last stride other
            than 1 is read through one copy (not with write_key, which writes k).
        v: (*T, Hv, Dv), copied into v_cache; Dv may differ from Dk (MLA: latent 512, rope 64).
            Any strides, the last one included (read in place, no copy). None with MLA's k_nope.
        positions: (*T) int32/int64, (N, *T) with mrope_section, or None for arange over the
            last token dim (or for positions derived from cu_seqlens).
        cos_sin_cache: (max_position, rotary_dim) rows [cos | sin]; fp32 recommended.
        k_cache: (num_blocks, block_size, Hk, Dk) paged or (num_slots, Hk, Dk) flat, any strides
            with last stride 1: NHD as is, HND as `cache.permute(0, 2, 1, 3)`, the k half of a
            (num_blocks, 2, block_size, H, D) buffer as `buf[:, 0]`. fp16/bf16/fp32,
            float8_e4m3fn or float8_e5m2 (need not match k's dtype; values are cast).
        v_cache: like k_cache for v, with the same slot dims (num_blocks, block_size) or
            (num_slots,). MLA keeps one joint row [latent | rope]: pass views of one cache,
            `k_cache = cache[..., L:]`, `v_cache = cache[..., :L]`, or use k_nope. A 3-D cache
            beside a one-head k (v) is FlashInfer's paged MLA cache (num_blocks, block_size, D)
            unless its dim -2 is 1 (then flat (num_slots, 1, D), which addresses the same rows).
        slot_mapping: (*T) int32/int64; token i goes to slot slot_mapping[i] = block * block_size
            + offset. A slot < 0 is padding: nothing is stored for that token.
        interleaved: False rotates halves (Llama/NeoX), True pairs (2i, 2i+1) (GPT-J, DeepSeek).
        rotary_dim: must equal the width of cos_sin_cache (default); dims past it are kept.
        mrope_section, mrope_interleaved, mrope_layout: M-RoPE as in apply_rope: positions
            (N, *T), one row per section, mrope_section N ints summing to rotary_dim // 2, the
            rows laid over the pairs by mrope_layout (default chunked; mrope_interleaved=True:
            Qwen3-VL's).
        cu_seqlens, cp_size, cp_rank: packed sequences as in apply_rope: q, k, v (T, H, D),
            slot_mapping (T,), positions None, cu_seqlens (N+1,) int32/int64 cumulative local
            lengths on q's device; each token's position is derived inside the kernel (restarting
            at 0 per sequence; context parallelism's dual-chunk layout with cp_size > 1). No
            M-RoPE with it. Values checked only in strict mode (a sync), as apply_rope does.
        k_scale, v_scale: None, a float, or a 0-d/1-element float32 tensor on q's device: the
            cache stores value / scale (per-tensor fp8 scaling; also honoured for other caches).
            A tensor scale is read inside the kernel: no host sync, safe in CUDA graphs. A float
            is turned into a cached device tensor (1.0 means no scaling).
        write_key: True also writes the rotated (and normalized) k back into k, in place, for
            every token (padding ones included), as SGLang's fused set-kv-buffer does for engines
            that keep k for a local attention call. k's dims past rotary_dim stay as they are
            (normalized with k_norm_weight, like q's). k is then written: it must not overlap
            q, v, the caches or a read-only input, and needs a unit last stride.
        q_out: None, or a (*T, Hq, Dq) tensor in any of the cache dtypes (fp8 e4m3 / e5m2 for an
            FP8 attention's prologue), any strides with last stride 1: rotated (and normalized)
            q is written there, tail included, and q is left untouched (FlashInfer's
            rope_quantize_fp8 + paged append in one launch).
        q_scale: None, a float or a 1-element float32 tensor, only with q_out: q_out stores
            rotated q / q_scale (same rule as k_scale).
        k_nope: the key's no-rope part, a tensor of its own (k is then the rope part, (*T, Hk,
            R) with R = rotary_dim). Two forms, told apart by v:
            - v given (GQA / MHA, FlashInfer's rope_quantize_fp8_append_paged_kv_cache with
              no_rope_dim > 0): k_nope (*T, Hk, N), k_cache (..., Hk, R + N); each k cache row
              receives rotated k in dims [0, R) and k_nope in [R, R + N) (FlashInfer's order),
              v goes to v_cache as usual. Any strides, the last one included (read in place).
              Not with k_norm_weight (the norm covers a whole head).
            - v None (MLA, FlashInfer's append_paged_mla_kv_cache): k_nope (*T, Hk, L) is copied
              unrotated into v_cache, the nope cache (FlashInfer's ckv_cache, (num_blocks,
              block_size, Hk, L)), with k_cache the rope cache (kpe_cache, R wide); or v_cache
              None: k_cache is then the joint row (..., Hk, L + R) [nope | rope] (DeepSeek's
              layout) and is split at L.
            One launch either way; float dtypes, on q's device, token dims and heads of k.
        q_nope: only with q_out: q's no-rope part, a tensor of its own (*T, Hq, N), any strides
            (read in place); q is then the rope part (*T, Hq, R) with R = rotary_dim, and q_out
            (*T, Hq, R + N) receives rotated q in dims [0, R) and q_nope in [R, R + N), both
            divided by q_scale and saturated like the rotated dims (FlashInfer's q_rope_out and
            q_nope_out are the views q_out[..., :R] and q_out[..., R:]). Not with q_norm_weight.
        rotary_position: 'first' (dims [0, rotary_dim) rotated) or 'halves': the pairs (i, i + D/2)
            for i < rotary_dim / 2 (Gemma 4's p-RoPE, apply_rope's keyword), the other dims kept
            (untouched in q in place, copied into q_out and the cache rows, normalized with the
            norm); needs interleaved=False, an even D and q and k of one head size.

        k_cache_scales, v_cache_scales: NVFP4 caches (both caches together): k_cache / v_cache
            are then uint8 (..., H, D / 2), the e2m1 codes of a row's values two to a byte (element
            2j in the low nibble of byte j, 2j + 1 in the high one), and these their block scales,
            float8_e4m3fn (..., H, D / 16) with the caches' slot dims (one scale per 16 consecutive
            values of a head row), any strides with last stride 1. k_scale / v_scale are then the
            per-tensor global scales (None: 1.0): a block's scale is amax / 6 / global rounded to
            e4m3 (saturated at 448), each value |x| / (block scale * global) rounded to nearest even
            onto {0, 0.5, 1, 1.5, 2, 3, 4, 6} (saturated at 6), so x ~ e2m1 * block scale * global.
            D a multiple of 16; rotary_dim a multiple of 16 (interleaved) or 32 (halves);
            rotary_position 'first'; eager plain tensors only (docs/store.md, "NVFP4 caches").
            Example, vLLM-style views (num_blocks, block_size, H, D / 2) and (..., D / 16):
            `apply_rope_and_store(q, k, v, pos, cache, k_data, v_data, slots, k_scale=ks,
            v_scale=vs, k_cache_scales=k_sf, v_cache_scales=v_sf)`.

    Returns q (rotated in place), or q_out when given. Rows of the caches that no slot names are
    never touched. Duplicate slots (two tokens naming one slot) are a caller error: without
    strict mode the row holds an unspecified mix (its k row and its v row may come from different
    tokens); under `ropekit.strict()` they raise ValueError naming the slot and both tokens,
    before any write.

    Output layouts: every output is written where and how the caller laid it out (q and k in
    place keep their strides, q_out and the caches keep theirs; nothing is made contiguous). For
    a permuted q, `torch.empty_like(q, dtype=torch.float8_e4m3fn)` gives a q_out of q's layout.
    Inputs whose last dim is not contiguous (Transformer Engine's permuted tensors): v is read
    through its stride; k, and q with q_out, are read through one contiguous copy each (an extra
    pass over that input only); q rotated in place, and k with write_key, must have a unit last
    stride (refused with ValueError otherwise: rotating through a copy would need a second pass
    to copy back).

    Bad inputs never cause an out-of-bounds access, and nothing is synced by default:
    - a position outside [0, max_position): that token's rotated dims of q and of its k row are
      NaN (as in apply_rope);
    - a slot >= num_slots: nothing is stored for that token, and its rotated q dims (in q_out
      when given) are made NaN, so the mistake shows up in the attention output instead of
      corrupting someone else's row.
    Under `ropekit.strict()` (or ROPEKIT_STRICT=1) bad positions and slots, and tensor scales that
    are not finite and > 0, raise ValueError before anything is written (one device sync).

    fp8 outputs (caches, q_out; e4m3 or e5m2): values are divided by the scale in float32,
    saturated to the format's largest finite value (e4m3 448, e5m2 57344; NaN stays NaN) and
    cast once (round to nearest even).

    Inference only: tensors that require grad are refused while grad mode is on.

    q_norm_weight / k_norm_weight: None, or an RMSNorm weight (D,) (each head normalized: Qwen3)
    or (H*D,) (all heads of a token together: OLMo 2), fp32/bf16/fp16, unit stride, on q's device,
    not requiring grad: q / k normalized first, y = x * rsqrt(mean(x^2) + norm_eps) * (w +
    norm_weight_offset) in float32, same launch (q's whole head, tail included, normalized in
    place or into q_out; k's into its cache row, and with write_key into k). Every keyword above
    composes with the norm. DTensor: weights replicated; an (H*D,) weight with head-sharded q / k
    is refused (ropekit.distributed). l2_norm=True: each head of q and k normalized without a
    weight (Llama 4's qk L2 norm; apply_rope's l2_norm), not with q_norm_weight / k_norm_weight.
    """
    # the store's views first: MLA's parts, 3-D caches, strided last dims read through copies
    mla = k_nope is not None and v is None  # else k_nope (if any) is GQA / MHA's, beside v
    if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 3:
        k_cache = paged_mla(k_cache, k)
    if isinstance(v_cache, torch.Tensor) and v_cache.dim() == 3:
        v_cache = paged_mla(v_cache, k_nope if mla else v)
    if mla:
        v, k_cache, v_cache = mla_parts(k, v, k_cache, v_cache, k_nope)
        k_nope = None
    # strided last dims of read-only inputs: one copy each (q rotated in place is refused by validation)
    if isinstance(k, torch.Tensor) and write_key is False and k.dim() and k.stride(-1) != 1:
        k = unit_last(k)
    if q_out is not None and isinstance(q, torch.Tensor) and q.dim() and q.stride(-1) != 1:
        q = unit_last(q)
    spec, door = prepare(
        _STORE,
        (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping),
        (
            interleaved,
            rotary_dim,
            mrope_section,
            mrope_interleaved,
            mrope_layout,
            cu_seqlens,
            cp_size,
            cp_rank,
            k_scale,
            v_scale,
            q_norm_weight,
            k_norm_weight,
            norm_eps,
            norm_weight_offset,
            l2_norm,
            write_key,
            q_out,
            q_scale,
            k_nope,
            q_nope,
            rotary_position,
            k_cache_scales,
            v_cache_scales,
        ),
        checks.store,
    )
    ks = vs = qs = None
    if k_scale is not None or v_scale is not None or q_scale is not None:
        ks, vs, qs = _scales(q.device, k_scale, v_scale, q_scale)
    a = positions if cu_seqlens is None else cu_seqlens
    # the run's operands (StoreOperands' fields, in order)
    t = (q, k, v, a, cos_sin_cache, k_cache, v_cache, slot_mapping, ks, vs, q_out, qs)
    t += (q_norm_weight, k_norm_weight, q_nope, k_nope, k_cache_scales, v_cache_scales)
    if spec.record and not strict.mode.on and STORE[RECORD](spec, t):  # the steady state's launch record
        return q if q_out is None else q_out
    t = StoreOperands._make(t)
    if door is DIRECT or door is FUNCTION:  # the custom op checks its call when it runs
        checks.store_call(spec, t)
    STORE[door](spec, t)
    return q if q_out is None else q_out


_STORE = Signature.of(apply_rope_and_store)


def _scales(device, *scales) -> tuple:
    """Float32 scale tensors on the device (floats cached, 1.0 none: the run skips the division)."""
    return tuple(None if s is None else scale_tensor(s, device) for s in scales)


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim has stride 1 (or one element), else one contiguous copy: how the
    store reads a k (or, with q_out, a q) whose last dim is strided."""
    if x.stride(-1) == 1 or x.shape[-1] <= 1:
        return x
    return x.contiguous()


def paged_mla(cache, x):
    """A 3-D cache beside a one-head x whose dim -2 is not 1 is FlashInfer's paged MLA cache
    (num_blocks, block_size, D): the 4-D view (num_blocks, block_size, 1, D). A 3-D cache is flat
    (num_slots, H, D) otherwise; (num_blocks, 1, D) reads the same either way (slot = block)."""
    if (
        isinstance(cache, torch.Tensor)
        and isinstance(x, torch.Tensor)
        and cache.dim() == 3
        and x.dim() >= 2
        and x.shape[-2] == 1
        and cache.shape[-2] != 1
    ):
        return cache.unsqueeze(-2)
    return cache


def mla_parts(k, v, k_cache, v_cache, k_nope):
    """MLA's split key (v None) as the store's (v, k_cache, v_cache): k_nope takes v's place
    (copied unrotated into v_cache); with v_cache None, k_cache is the joint row [nope | rope] and
    is split at k_nope's width."""
    if not isinstance(k_nope, torch.Tensor):
        raise TypeError(f"{OP}: k_nope: expected a torch.Tensor or None, got {type(k_nope).__name__}")
    if v_cache is None and isinstance(k_cache, torch.Tensor) and isinstance(k, torch.Tensor) and k_cache.dim() > 0:
        nope, rope = k_nope.shape[-1], k.shape[-1]
        if k_cache.shape[-1] != nope + rope:
            fail(
                OP,
                "k_cache",
                f"a joint row of {nope} + {rope} = {nope + rope} dims (k_nope's, then k's; v_cache None)",
                f"shape {tuple(k_cache.shape)}",
            )
        k_cache, v_cache = k_cache[..., nope:], k_cache[..., :nope]
    return k_nope, k_cache, v_cache
