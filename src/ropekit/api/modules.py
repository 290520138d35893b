"""RotaryEmbedding: the serving-engine module (vLLM / SGLang calling convention) over apply_rope."""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from ..core.args import INDEX_DTYPES, fail
from ..core.freqs import cos_sin_cache, parse_scaling, rotated_pairs
from ..core.rules import mrope_args, rotary_position_arg
from ..integrations.hf_config import hf_rope_args
from .ops import apply_rope
from .store import apply_rope_and_store

# Errors of the ops called through the module, in the caller's words: the module's argument
# names for the op's (query for q, ...), and its max_position for the op's table rows.
_CALLER_NAMES = {"q": "query", "k": "key", "v": "value"}


def _in_callers_words(error: Exception, op: str, caller: str, max_position: int) -> Exception:
    """The same exception type, its message saying `caller: query:` where the op said `op: q:`."""
    msg = str(error)
    if not msg.startswith(op + ": "):
        return error
    name, _, rest = msg[len(op) + 2 :].partition(": ")
    name = _CALLER_NAMES.get(name, name)
    rest = re.sub(r"\b([qkv])\b", lambda m: _CALLER_NAMES[m.group(1)], rest)
    rest = rest.replace("(the rows of cos_sin_cache)", f"(max_position = {max_position})")
    return type(error)(f"{caller}: {name}: {rest}")


def _int_arg(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fail(op, name, "a positive integer", repr(value))
    return value


def _table_length(op: str, max_position, max_position_embeddings) -> int:
    """The table length, given by ropekit's name or by vLLM's / SGLang's (not both)."""
    if max_position is None and max_position_embeddings is None:
        raise TypeError(f"{op}: max_position: expected a positive integer (or max_position_embeddings=), got None")
    if max_position is not None and max_position_embeddings is not None:
        fail(
            op,
            "max_position_embeddings",
            "None when max_position is given (two names of one length)",
            repr(max_position_embeddings),
        )
    name = "max_position" if max_position is not None else "max_position_embeddings"
    return _int_arg(op, name, max_position if max_position is not None else max_position_embeddings)


def _dtype_and_device(op: str, dtype, device) -> None:
    """dtype (the 6th positional argument, as in vLLM / SGLang) and device have the right types;
    a dict there is a rope_scaling passed positionally (ropekit 0.1's 6th argument)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        moved = " (rope_scaling is keyword-only: pass rope_scaling=...)" if isinstance(dtype, dict) else ""
        raise TypeError(
            f"{op}: dtype: expected a torch.dtype or None (the 6th positional argument, as in vLLM and "
            f"SGLang), got {type(dtype).__name__}{moved}"
        )
    if isinstance(device, torch.dtype):
        raise TypeError(f"{op}: device: expected a device, got torch.dtype {device} (dtype is the 6th argument)")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with the vLLM / SGLang calling convention.

        rope = RotaryEmbedding(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)
        query, key = rope(positions, query, key)            # or rope(positions, query, key, offsets)

    Args:
        head_size: D, the size of each query/key head.
        rotary_dim: dims [0, rotary_dim) of each head are rotated, the rest kept (partial rotary);
            even, at most head_size.
        max_position: length of the cos/sin table (vLLM's `max_position_embeddings`, accepted by
            that keyword too). Positions must lie in [0, max_position): this
            is a hard limit (checking it would cost a device sync per call). An out-of-range
            position follows apply_rope's contract: NaN in that token's rotated dims, or a
            ValueError under `ropekit.strict()`. For scaled rope types pass the extended length.
        base: rope theta; None means rope_scaling["rope_theta"] if present, else 10000.0.
        is_neox_style: True rotates halves (Llama, NeoX); False rotates pairs (2i, 2i+1)
            (GPT-J, DeepSeek, Llama 4), i.e. apply_rope's interleaved=True.
        dtype: dtype of the table (default float32, recommended whatever the model dtype;
            `module.to(dtype)` / `.half()` leave it unchanged). The 6th positional argument, as
            in vLLM and SGLang.
        device: where the table is built (default: the current default device). Under a meta
            device it is built lazily, on the device of the first query.
        rope_scaling: (keyword only) None or an HF rope_scaling / rope_parameters dict; see
            ropekit.inv_freq.
        inplace: True (default) rotates query and key in place and returns them; False returns
            new tensors and leaves the inputs untouched (what training needs: autograd keeps the
            inputs).
        rotary_position: (keyword only) 'first' (default: dims [0, rotary_dim) rotated) or
            'halves': the pairs (i, i + head_size/2), i < rotary_dim / 2 (Gemma 4's p-RoPE;
            apply_rope's keyword), the other dims kept; needs is_neox_style and an even head_size.
            With rope_type 'proportional' the table then holds the rotated pairs only, frequencies
            base ** (-2i / head_size) (cos_sin_cache(head_size, ..., rotated_only=True)), and
            rotary_dim must be its width, 2 * int(partial_rotary_factor * head_size // 2):
            from_hf_config builds Gemma 4's modules so.
        mrope_section, mrope_interleaved, mrope_layout: (keyword only) M-RoPE as apply_rope takes
            it (N sections summing to rotary_dim // 2, a layout preset or per-pair row map);
            mrope_section and mrope_interleaved default to rope_scaling's entries. Forward then
            reads (N, *T) positions as the rows.

    LongRoPE tables longer than original_max_position_embeddings hold two segments, the short
    factors' rows then the long factors' rows, and each call picks one for the whole batch as HF
    does: long when any position >= original_max_position_embeddings (one reduction over the
    positions, no device sync).
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: Optional[int] = None,
        base: Optional[float] = None,
        is_neox_style: bool = True,
        dtype: Optional[torch.dtype] = None,
        device=None,
        *,
        rope_scaling: Optional[dict] = None,
        inplace: bool = True,
        mrope_section=None,
        mrope_interleaved: Optional[bool] = None,
        mrope_layout=None,
        max_position_embeddings: Optional[int] = None,
        rotary_position: str = "first",
    ):
        super().__init__()
        op = "RotaryEmbedding"
        max_position = _table_length(op, max_position, max_position_embeddings)
        _dtype_and_device(op, dtype, device)
        self.head_size = _int_arg(op, "head_size", head_size)
        if (
            isinstance(rotary_dim, bool)
            or not isinstance(rotary_dim, int)
            or rotary_dim <= 0
            or rotary_dim % 2
            or rotary_dim > head_size
        ):
            fail(op, "rotary_dim", f"an even integer in [2, head_size = {head_size}]", repr(rotary_dim))
        self.rotary_dim = rotary_dim
        self.max_position = _int_arg(op, "max_position", max_position)
        self.base = base
        self.is_neox_style = bool(is_neox_style)
        self.inplace = bool(inplace)
        self.rope_scaling = None if rope_scaling is None else dict(rope_scaling)
        self.rope_type, params = parse_scaling(self.rope_scaling, op)
        # M-RoPE (N sections; Qwen2-VL / 2.5-VL chunked, Qwen3-VL interleaved, or any mrope_layout):
        # given here or in the scaling dict; checked as apply_rope checks them
        scaling = self.rope_scaling or {}
        if mrope_section is None:
            mrope_section = scaling.get("mrope_section")
        if mrope_interleaved is None:
            mrope_interleaved = bool(scaling.get("mrope_interleaved", False))
        if mrope_section is not None:
            mrope_section = mrope_args(op, mrope_section, mrope_interleaved, rotary_dim // 2, mrope_layout).sections
        elif mrope_layout is not None:
            fail(op, "mrope_layout", "mrope_section to be given with it", "mrope_section=None")
        self.mrope_section = mrope_section
        self.mrope_interleaved = bool(mrope_interleaved) and mrope_section is not None
        self.mrope_layout = mrope_layout if isinstance(mrope_layout, (str, type(None))) else tuple(mrope_layout)
        self.cache_dtype = torch.float32 if dtype is None else dtype
        self.rotary_position = rotary_position_arg(op, rotary_position, allowed=("first", "halves"))
        if self.rotary_position == "halves":
            if not self.is_neox_style:
                fail(op, "is_neox_style", "True with rotary_position='halves' (pairs (i, i + head_size/2))", False)
            if head_size % 2:
                fail(op, "head_size", "an even integer with rotary_position='halves'", head_size)
            if self.rope_type == "proportional":
                width = 2 * rotated_pairs(head_size, params, op)
                if rotary_dim != width:
                    fail(
                        op,
                        "rotary_dim",
                        f"2 * int(partial_rotary_factor * head_size // 2) = {width} (the rotated pairs of "
                        "rope_type 'proportional' with rotary_position='halves')",
                        rotary_dim,
                    )

        # LongRoPE: a short segment [0, original) before the long one when the table is longer
        self._long_offset = 0
        self._segments = [(max_position, params)]
        if self.rope_type == "longrope":
            original = params.get("original_max_position_embeddings")
            if isinstance(original, int) and 0 < original < max_position:
                if params.get("factor") is None:  # keep one attention factor for both segments
                    params = dict(params, factor=max_position / original)
                self._long_offset = original
                self._segments = [(original, params), (max_position, params)]

        device = torch.get_default_device() if device is None else torch.device(device)
        self.register_buffer("cos_sin_cache", self._build(device), persistent=False)

    # -- the table ---------------------------------------------------------------------------

    def _build(self, device) -> torch.Tensor:
        """The table on `device` (computed in float64, stored in cache_dtype); empty on meta.
        p-RoPE with rotary_position='halves': the rotated pairs of the head's frequencies only."""
        narrow = self.rotary_position == "halves" and self.rope_type == "proportional"
        width = self.head_size if narrow else self.rotary_dim
        tables = [
            cos_sin_cache(width, length, self.base, params, dtype=self.cache_dtype, device=device, rotated_only=narrow)
            for length, params in self._segments
        ]
        return tables[0] if len(tables) == 1 else torch.cat(tables, dim=0)

    def _apply(self, fn, recurse=True):
        # .to(device) / .cuda() / .half() / .to_empty(): recompute the table where it now lives,
        # in its own dtype, instead of converting (or leaving uninitialised) the old one
        super()._apply(fn, recurse)
        self.cos_sin_cache = self._build(self.cos_sin_cache.device)
        return self

    def _table_for(self, query: torch.Tensor) -> torch.Tensor:
        cache = self.cos_sin_cache
        if cache.device != query.device:
            # first call on a new device (or after a meta-device construction): build it there once
            cache = self._build(query.device)
            self.cos_sin_cache = cache
        return cache

    # -- forward -----------------------------------------------------------------------------

    def _heads(self, name: str, x: torch.Tensor, n_tok: int) -> torch.Tensor:
        """(*T, H * D) -> (*T, H, D) as a view (never a copy); (*T, H, D) passes through."""
        op = "RotaryEmbedding.forward"
        D = self.head_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() == n_tok + 1:
            if x.shape[-1] % D:
                fail(op, name, f"a last dimension that is a multiple of head_size = {D}", f"shape {tuple(x.shape)}")
            return x.view(*x.shape[:-1], x.shape[-1] // D, D)
        if x.dim() == n_tok + 2:
            if x.shape[-1] != D:
                fail(op, name, f"a last dimension of head_size = {D}", f"shape {tuple(x.shape)}")
            return x
        fail(
            op,
            name,
            f"(*T, H * {D}) or (*T, H, {D}), *T being the {n_tok} dims of positions",
            f"shape {tuple(x.shape)}",
        )

    def _long_or_short(self, positions: torch.Tensor) -> torch.Tensor:
        """LongRoPE: shift every position into the long segment when any reaches the original
        length (HF: seq_len > original), else keep the short one. Negative positions stay
        negative (out of range -> NaN)."""
        if positions.numel() == 0:
            return positions
        use_long = positions.max() >= self._long_offset
        shift = (use_long & (positions >= 0)).to(positions.dtype) * self._long_offset
        return positions + shift

    def _is_mrope(self, positions, query) -> bool:
        """Whether positions are M-RoPE rows (N, *T), N = len(mrope_section), rather than plain
        (T,) / (B, S) positions.

        Only an M-RoPE module reads them that way. (N, B, S) can only be M-RoPE. An (N, X) tensor
        is M-RoPE rows for query (X, H * D) or (X, H, D), and a plain batch of N for query
        (N, X, H * D) or (N, X, H, D); when the query fits both readings (query (N, N, head_size))
        that is an error, never a guess.
        """
        if (
            self.mrope_section is None
            or not isinstance(positions, torch.Tensor)
            or not isinstance(query, torch.Tensor)
            or positions.dim() not in (2, 3)
            or positions.shape[0] != len(self.mrope_section)
        ):
            return False
        N = len(self.mrope_section)
        if positions.dim() == 3:
            return True
        D, X = self.head_size, positions.shape[1]
        qs = tuple(query.shape)
        as_mrope = (len(qs) == 2 and qs[0] == X and qs[1] % D == 0) or (len(qs) == 3 and qs[0] == X and qs[2] == D)
        as_plain = (len(qs) == 3 and qs[:2] == (N, X) and qs[2] % D == 0) or (
            len(qs) == 4 and qs[:2] == (N, X) and qs[3] == D
        )
        if as_mrope and as_plain:
            fail(
                "RotaryEmbedding.forward",
                "positions",
                f"a shape that tells M-RoPE rows from a batch: ({N}, {X}) with query {qs} reads both as ({N}, T) "
                f"M-RoPE rows (query (T, H, D)) and as a (B, S) batch (query (B, S, H * D)); pass query as "
                f"({X}, H * {D}) for M-RoPE or as ({N}, {X}, H, {D}) for plain positions",
                f"shape {tuple(positions.shape)}",
            )
        return as_mrope

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
        *,
        q_norm_weight=None,
        k_norm_weight=None,
        norm_eps=1e-6,
        norm_weight_offset=0.0,
    ):
        """Rotate query (and key) by the angles of their positions.

        positions: (T,) or (B, S) int32/int64; with mrope_section of N sections also (N, T) or
        (N, B, S) (e.g. temporal, height, width rows; text-only tokens may pass plain positions). query:
        (*T, Hq * D) or (*T, Hq, D); key: the same with Hk heads, or None. Any strides with a unit
        last stride (views of a fused qkv buffer are fine). offsets: None, or int32/int64 added to
        positions (SGLang's and older vLLM's argument; positions' shape, or broadcastable to it).
        Returns (query, key) in their input shapes: the inputs themselves when inplace (the
        default), new tensors otherwise; key None when key is None. q_norm_weight, k_norm_weight,
        norm_eps, norm_weight_offset: RMSNorm of query / key first, in the same launch
        (apply_rope's keywords).
        """
        if offsets is not None:
            positions = _offset_positions("RotaryEmbedding.forward", positions, offsets)
        mrope = self._is_mrope(positions, query)
        if not isinstance(positions, torch.Tensor) or positions.dim() - mrope not in (1, 2):
            got = f"shape {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else type(positions).__name__
            n = len(self.mrope_section or ())
            want = "a (T,) or (B, S) tensor" + (f", or ({n}, T) / ({n}, B, S) for M-RoPE" if n else "")
            fail("RotaryEmbedding.forward", "positions", want, got)
        n_tok = positions.dim() - mrope
        q = self._heads("query", query, n_tok)
        k = None if key is None else self._heads("key", key, n_tok)
        cache = self._table_for(query)
        if self._long_offset:
            positions = self._long_or_short(positions)
        try:
            q_out, k_out = apply_rope(
                q,
                k,
                positions,
                cache,
                interleaved=not self.is_neox_style,
                rotary_dim=self.rotary_dim,
                inplace=self.inplace,
                mrope_section=self.mrope_section if mrope else None,
                mrope_interleaved=self.mrope_interleaved if mrope else False,
                mrope_layout=self.mrope_layout if mrope else None,
                q_norm_weight=q_norm_weight,
                k_norm_weight=k_norm_weight,
                norm_eps=norm_eps,
                norm_weight_offset=norm_weight_offset,
                rotary_position=self.rotary_position,
            )
        except (ValueError, TypeError) as e:
            error = _in_callers_words(e, "apply_rope", "RotaryEmbedding.forward", self.max_position)
            if str(error).startswith("RotaryEmbedding.forward: inplace:") or "when inplace=True" in str(error):
                error = type(error)(
                    f"{error}; this module rotates in place (inplace=True, the default): construct it "
                    "with RotaryEmbedding(..., inplace=False) to keep its inputs"
                )
            raise error from None
        if self.inplace:
            return query, key
        return q_out.reshape(query.shape), (None if key is None else k_out.reshape(key.shape))

    def forward_and_store(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale=None,
        v_scale=None,
        q_norm_weight=None,
        k_norm_weight=None,
        norm_eps=1e-6,
        norm_weight_offset=0.0,
    ) -> torch.Tensor:
        """Fused serving path: rotate query in place and write rotated key and value into the KV
        cache rows slot_mapping names, in one launch (ropekit.apply_rope_and_store).

        positions: (T,) or (B, S). query: (*T, Hq * D) or (*T, Hq, D); key: (*T, Hk * D) or
        (*T, Hk, D); value: (*T, Hv * Dv) or (*T, Hv, Dv), Dv being v_cache's head size (it may
        differ from D: MLA's latent). k_cache / v_cache: (num_blocks, block_size, H, D) paged
        (NHD, or HND as a permuted view; any strides) or (num_slots, H, D) flat; fp16/bf16/fp32
        or float8_e4m3fn. slot_mapping: (*T) int32/int64, a slot < 0 skips the token (padding).
        k_scale / v_scale: None, a float or a 1-element float32 tensor (fp8 caches store
        value / scale). Bad positions and slots follow apply_rope_and_store's contract.

        query is always rotated in place, whatever `inplace` says (the fused path writes once);
        key and value are read only. Returns query. q_norm_weight, k_norm_weight, norm_eps,
        norm_weight_offset: RMSNorm of query / key first (apply_rope_and_store's keywords).
        """
        op = "RotaryEmbedding.forward_and_store"
        if not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2):
            got = f"shape {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else type(positions).__name__
            fail(op, "positions", "a (T,) or (B, S) tensor", got)
        n_tok = positions.dim()
        q = self._heads("query", query, n_tok)
        k = self._heads("key", key, n_tok)
        v = value
        if (
            isinstance(value, torch.Tensor)
            and isinstance(v_cache, torch.Tensor)
            and value.dim() == n_tok + 1
            and v_cache.dim() >= 3
        ):
            dv = v_cache.shape[-1]
            if dv == 0 or value.shape[-1] % dv:
                fail(
                    op,
                    "value",
                    f"a last dimension that is a multiple of v_cache's head size {dv}",
                    f"shape {tuple(value.shape)}",
                )
            v = value.view(*value.shape[:-1], value.shape[-1] // dv, dv)
        cache = self._table_for(query)
        if self._long_offset:
            positions = self._long_or_short(positions)
        try:
            apply_rope_and_store(
                q,
                k,
                v,
                positions,
                cache,
                k_cache,
                v_cache,
                slot_mapping,
                interleaved=not self.is_neox_style,
                rotary_dim=self.rotary_dim,
                k_scale=k_scale,
                v_scale=v_scale,
                q_norm_weight=q_norm_weight,
                k_norm_weight=k_norm_weight,
                norm_eps=norm_eps,
                norm_weight_offset=norm_weight_offset,
                rotary_position=self.rotary_position,
            )
        except (ValueError, TypeError) as e:
            raise _in_callers_words(e, "apply_rope_and_store", op, self.max_position) from None
        return query

    def extra_repr(self) -> str:
        base = self.base if self.base is not None else (self.rope_scaling or {}).get("rope_theta", 10000.0)
        s = (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
            f"base={base}, is_neox_style={self.is_neox_style}, rope_type={self.rope_type!r}"
        )
        if self._long_offset:
            s += f", long_from={self._long_offset}"
        if self.rotary_position != "first":
            s += f", rotary_position={self.rotary_position!r}"
        return s + f", inplace={self.inplace}, cache_dtype={str(self.cache_dtype).replace('torch.', '')}"

    # -- Hugging Face configs ----------------------------------------------------------------

    @classmethod
    def from_hf_config(
        cls,
        config,
        *,
        max_position: Optional[int] = None,
        is_neox_style: Optional[bool] = None,
        layer_type: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
        device=None,
        inplace: bool = True,
    ) -> "RotaryEmbedding":
        """Build the module an HF model config describes (a PretrainedConfig or its config.json dict).

        Reads head_dim (qk_rope_head_dim for MLA models, else head_dim, else hidden_size //
        num_attention_heads), the rotated fraction (partial_rotary_factor, rotary_pct, or GPT-J's
        rotary_dim), rope_theta and the scaling dict (rope_parameters in transformers 5.x,
        rope_scaling + rope_theta in 4.x), max_position_embeddings, and the pair layout
        (rope_interleave, or the family: GPT-J, DeepSeek, Llama 4, GLM, Cohere rotate pairs).

        Table length (override with max_position): max_position_embeddings, or for linear,
        dynamic and yarn max(max_position_embeddings, original * factor), as vLLM sizes them.
        Dynamic NTK's frequencies are those for that length. `layer_type` picks one entry of a
        per-layer-type rope_parameters dict (e.g. "sliding_attention"), and that layer type's head
        size where the config sets one per layer (Gemma 4's full-attention layers: per_layer_config,
        or global_head_dim in a config.json dict). rope_type 'proportional' (Gemma 4's p-RoPE)
        rotates the pairs (i, i + head_size/2) of its rotated fraction only: rotary_position=
        'halves', rotary_dim 2 * int(partial_rotary_factor * head_size // 2), a table of those pairs.
        """
        args = hf_rope_args(config, layer_type=layer_type)
        if max_position is not None:
            args["max_position"] = max_position
        if is_neox_style is not None:
            args["is_neox_style"] = is_neox_style
        return cls(**args, dtype=dtype, device=device, inplace=inplace)

    # -- re-rotation of cached keys ------------------------------------------------------------

    def rerotate_kv_cache(
        self,
        k_cache: torch.Tensor,
        slots: torch.Tensor,
        delta,
        *,
        k_scale=None,
        dst_slots: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Move cached keys by a position shift with this module's table, layout and rotary_dim
        (ropekit.rerotate_kv_cache): the key stored at position p ends as if stored at p + delta.

        k_cache: (num_blocks, block_size, H, head_size) paged (NHD, or HND as a permuted view; any
        strides) or (num_slots, H, head_size) flat; fp16/bf16/fp32 or float8_e4m3fn (MLA: the rope
        part of the joint cache, e.g. `cache[..., 512:]`). slots: (N,) int32/int64, < 0 is padding.
        delta: (N,) int32/int64 or an int, may be negative; |delta| < max_position. k_scale: the
        cache holds value / k_scale. dst_slots: (N,) rows to write into, sources untouched (they
        must not be source rows). Returns k_cache, written in place.

        LongRoPE modules (two table segments) are refused: the rows to use depend on which segment
        rotated the cached keys, which the module does not know.
        """
        from .rerotate import rerotate_kv_cache

        op = "RotaryEmbedding.rerotate_kv_cache"
        if not isinstance(k_cache, torch.Tensor):
            raise TypeError(f"{op}: k_cache: expected a torch.Tensor, got {type(k_cache).__name__}")
        if k_cache.dim() in (3, 4) and k_cache.shape[-1] != self.head_size:
            fail(op, "k_cache", f"a head size of head_size = {self.head_size}", f"shape {tuple(k_cache.shape)}")
        if self._long_offset:
            fail(
                op,
                "self",
                "a module with one table segment (LongRoPE's short and long segments make the "
                "rows of a shift ambiguous: call ropekit.rerotate_kv_cache with the segment's table)",
                f"rope_type {self.rope_type!r}",
            )
        cache = self._table_for(k_cache)
        return rerotate_kv_cache(
            k_cache,
            slots,
            delta,
            cache,
            interleaved=not self.is_neox_style,
            rotary_dim=self.rotary_dim,
            k_scale=k_scale,
            dst_slots=dst_slots,
            rotary_position=self.rotary_position,
        )


def _offset_positions(op: str, positions, offsets) -> torch.Tensor:
    """positions + offsets (SGLang / older vLLM): integer tensors on one device, offsets
    broadcastable to positions' shape."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{op}: offsets: expected a torch.Tensor or None, got {type(offsets).__name__}")
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{op}: positions: expected a torch.Tensor, got {type(positions).__name__}")
    if offsets.dtype not in INDEX_DTYPES:
        fail(op, "offsets", "dtype in (int32, int64)", str(offsets.dtype).replace("torch.", ""))
    if offsets.device != positions.device:
        fail(op, "offsets", f"a tensor on {positions.device} (the device of positions)", f"one on {offsets.device}")
    try:
        fits = torch.broadcast_shapes(positions.shape, offsets.shape) == positions.shape
    except RuntimeError:
        fits = False
    if not fits:
        fail(
            op,
            "offsets",
            f"a shape broadcastable to positions' {tuple(positions.shape)}",
            f"shape {tuple(offsets.shape)}",
        )
    return positions + offsets
