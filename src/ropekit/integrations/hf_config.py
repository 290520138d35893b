"""Hugging Face model configs read into RotaryEmbedding's constructor arguments (hf_rope_args).

Everything that knows HF's config field names lives here: the attribute spellings of config.json
dicts, the text config of multimodal models, rope_parameters per layer type (transformers 5.x)
or rope_scaling + rope_theta (4.x), the head size (per layer type where the config sets one), the
rotated fraction, the table length each rope type needs, and the families that rotate pairs. The
rope_scaling dict itself is parsed by ropekit.core.freqs, the public `scaling=` format.

It imports nothing above the core base (CONTRIBUTING.md, "Layout"), so the api's
RotaryEmbedding.from_hf_config can call it; it calls no op.
"""

from __future__ import annotations

from typing import Optional

from ..core.args import fail
from ..core.freqs import parse_scaling, rotated_pairs

# families whose checkpoints rotate pairs (2i, 2i+1) rather than halves (i, i + rotary_dim/2);
# configs with a `rope_interleave` field (DeepSeek-V3, GLM-4-MoE-Lite, Mistral 4, ...) say it there
_INTERLEAVED_FAMILIES = frozenset(
    {
        "gptj",
        "codegen",
        "cohere",
        "cohere2",
        "glm",
        "glm4",
        "llama4",
        "llama4_text",
        "deepseek_v2",
        "deepseek_v3",
    }
)


# config.json spellings that HF config classes map through attribute_map (GPT-2 / GPT-J lineage)
_DICT_ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"}


def _get(config, name: str, default=None):
    if isinstance(config, dict):
        value = config.get(name)
        if value is None and name in _DICT_ALIASES:
            value = config.get(_DICT_ALIASES[name])
    else:
        value = getattr(config, name, None)
    return default if value is None else value


def hf_rope_args(config, layer_type: Optional[str] = None) -> dict:
    """RotaryEmbedding's constructor arguments for an HF config (object or config.json dict).

    config: a transformers PretrainedConfig or its config.json as a dict (a multimodal model's text
    config is read). layer_type: the entry of a per-layer-type rope_parameters dict, and that
    layer type's head size where the config sets one per layer; required when the config has
    rope parameters per layer type. What each field means: RotaryEmbedding.from_hf_config.

    Returns a dict of plain values: head_size, rotary_dim, max_position (ints), base (float),
    is_neox_style (bool), rope_scaling (the dict ropekit.cos_sin_cache takes, rope_type filled in)
    and rotary_position ('first' or 'halves'). Raises ValueError naming the
    config field it could not read, as from_hf_config does.

        >>> args = hf_rope_args({"hidden_size": 4096, "num_attention_heads": 32,
        ...                      "max_position_embeddings": 4096, "rope_theta": 5e5})
        >>> args["head_size"], args["rotary_dim"], args["base"]
        (128, 128, 500000.0)
    """
    op = "RotaryEmbedding.from_hf_config"
    if isinstance(config, dict):
        if "text_config" in config and "num_attention_heads" not in config:
            config = config["text_config"]
    elif hasattr(config, "get_text_config"):
        config = config.get_text_config()

    params = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
    if not isinstance(params, dict):
        fail(op, "config.rope_parameters", "a dict", repr(params))
    nested = [key for key, value in params.items() if isinstance(value, dict)]
    if nested:
        if layer_type not in nested:
            fail(op, "layer_type", f"one of {nested} (the config has rope parameters per layer type)", repr(layer_type))
        params = params[layer_type]
    params = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in params.items()}
    base = params.pop("rope_theta", None) or _get(config, "rope_theta") or _get(config, "rotary_emb_base") or 10000.0
    rope_type, params = parse_scaling(params or None, op)
    params.pop("type", None)
    params["rope_type"] = rope_type

    head_size = _get(config, "qk_rope_head_dim") or _layer_head_dim(config, layer_type) or _get(config, "head_dim")
    if head_size is None:
        hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
        if not hidden or not heads:
            fail(op, "config", "head_dim, or hidden_size and num_attention_heads", "neither")
        head_size = hidden // heads
    position = "first"
    if _get(config, "rotary_dim") is not None:  # GPT-J / CodeGen: absolute
        rotary_dim = int(_get(config, "rotary_dim"))
    elif rope_type == "proportional":  # p-RoPE: the pairs (i, i + D/2) of the rotated fraction only
        rotated = rotated_pairs(int(head_size), params, op)
        if 0 < rotated < head_size // 2:
            rotary_dim, position = 2 * rotated, "halves"
        else:  # every pair turns, or none does: the whole head, as a full-width table says
            rotary_dim = int(head_size)
    else:
        fraction = (
            params.pop("partial_rotary_factor", None)
            or _get(config, "partial_rotary_factor")
            or _get(config, "rotary_pct")
            or 1.0
        )
        rotary_dim = int(head_size * fraction)

    max_pos = _get(config, "max_position_embeddings")
    if max_pos is None:
        fail(op, "config.max_position_embeddings", "a positive integer", "None")
    original_key = "original_max_position_embeddings"
    if rope_type == "dynamic":
        params[original_key] = max_pos  # HF measures dynamic NTK against this
    elif rope_type in ("yarn", "longrope", "llama3"):
        top = _get(config, original_key)  # Phi-3 keeps it next to, not in, the dict
        params[original_key] = top if top is not None else params.get(original_key, max_pos)
    elif rope_type == "linear":
        params.setdefault(original_key, max_pos)
    length = max_pos
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = max_pos / params[original_key]
    if rope_type in ("linear", "dynamic", "yarn"):
        factor = params.get("factor")
        if isinstance(factor, (int, float)) and factor > 0:
            length = max(max_pos, int(params[original_key] * factor))
        if rope_type == "linear":
            params.pop(original_key)

    interleave = _get(config, "rope_interleave")
    if interleave is None:
        interleave = _get(config, "model_type") in _INTERLEAVED_FAMILIES
    return dict(
        head_size=int(head_size),
        rotary_dim=rotary_dim,
        max_position=int(length),
        base=base,
        is_neox_style=not interleave,
        rope_scaling=params,
        rotary_position=position,
    )


def _layer_head_dim(config, layer_type: Optional[str]):
    """The head size of one layer type where the config sets it per layer (None elsewhere): an HF
    config object's per_layer_config view, a config.json dict's per_layer_config entry for the
    first layer of that type, or Gemma 4's global_head_dim for its full-attention layers."""
    if layer_type is None:
        return None
    if not isinstance(config, dict):
        if not getattr(config, "is_heterogeneous", False):
            return None
        try:
            return getattr(config.per_layer_config[layer_type], "head_dim", None)
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    per_layer, types = config.get("per_layer_config"), config.get("layer_types")
    if isinstance(per_layer, dict) and isinstance(types, list) and layer_type in types:
        index = types.index(layer_type)
        entry = per_layer.get(str(index), per_layer.get(index))
        if isinstance(entry, dict) and entry.get("head_dim") is not None:
            return entry["head_dim"]
    if layer_type == "full_attention":
        return config.get("global_head_dim")
    return None
