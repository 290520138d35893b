"""Inverse frequencies and [cos | sin] tables for every Hugging Face rope type.

Everything is computed in float64 and rounded once, at the end, to the dtype asked for (float32 by
default). Hugging Face computes the same quantities in float32, so its tables carry an error that
grows with the position (about 1e-2 at position 128k for the fastest frequency); ropekit's are
correctly rounded. Against HF's formulas evaluated in float64 they agree to float64 rounding.

`scaling` is the dict Hugging Face keeps on the model config: `config.rope_scaling` (transformers
4.x, rope type under "type" or "rope_type") or `config.rope_parameters` (5.x). Keys a rope type
does not use (mrope_section, partial_rotary_factor, ...) are ignored; `rope_theta`, when present,
gives the base. Rules that differ from a plain reading of HF's code, because a table is built
once for a fixed length instead of per forward call:

- dynamic: the frequencies are those HF computes for seq_len = max_position (the length of the
  table), as vLLM does. HF takes the original length from config.max_position_embeddings; here it
  is `scaling["original_max_position_embeddings"]` (RotaryEmbedding.from_hf_config fills it in).
- longrope: long_factor when max_position > original_max_position_embeddings, short_factor
  otherwise, as HF chooses for a sequence of that length. When `factor` is absent it is
  max_position / original_max_position_embeddings (HF: config.max_position_embeddings / original),
  so pass `factor` explicitly when building a table shorter than the model's context.
- yarn: a `factor` of None means max_position / original_max_position_embeddings, as in HF.
- proportional (Gemma 4's p-RoPE): `rotary_dim` is the whole head and `partial_rotary_factor` is
  read: the table is full width, its last pairs have frequency 0 (they are passed through by the
  rotation), HF's own table. `cos_sin_cache(..., rotated_only=True)` keeps the rotated pairs only,
  (max_position, 2 * int(partial_rotary_factor * rotary_dim // 2)), for the kernel layout that
  skips the others: apply_rope(..., rotary_position='halves').
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from .args import fail

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
# older spellings HF still accepts: Phi-3's "su" is longrope; Qwen2-VL's 4.x "mrope" is default
_ALIASES = {"su": "longrope", "mrope": "default"}
_DEFAULT_BASE = 10000.0
_CPU = torch.device("cpu")  # frequencies are computed here, whatever the default device


# ---------------------------------------------------------------------------------------------
# argument checks: every failure names the key, what was expected and what was given


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(op: str, name: str, value) -> float:
    if not _is_number(value) or value <= 0:
        fail(op, name, "a positive number", repr(value))
    return float(value)


def _positive_int(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fail(op, name, "a positive integer", repr(value))
    return value


def _key(params: dict, key: str, rope_type: str, op: str):
    if key not in params:
        fail(op, f"scaling[{key!r}]", f"a value (required for rope_type {rope_type!r})", "nothing (key missing)")
    return params[key]


def _check_rotary_dim(op: str, rotary_dim) -> int:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        fail(op, "rotary_dim", "a positive even integer", repr(rotary_dim))
    return rotary_dim


def parse_scaling(scaling: Optional[dict], op: str = "inv_freq") -> Tuple[str, dict]:
    """(rope_type, params) from an HF rope_scaling / rope_parameters dict, or None."""
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, dict):
        raise TypeError(f"{op}: scaling: expected a dict or None, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in _ROPE_FUNCTIONS:
        fail(op, "scaling['rope_type']", f"one of {', '.join(ROPE_TYPES)}", repr(rope_type))
    return rope_type, dict(scaling)


def _resolve_base(op: str, base: Optional[float], params: dict) -> float:
    theta = params.get("rope_theta")
    if base is None:
        base = _DEFAULT_BASE if theta is None else theta
    elif theta is not None and float(theta) != float(base):
        fail(op, "base", f"the same value as scaling['rope_theta'] = {theta!r} (or base=None)", repr(base))
    return _positive(op, "base" if theta is None else "scaling['rope_theta']", base)


# ---------------------------------------------------------------------------------------------
# one function per rope type: (rotary_dim, base, params, max_position, op) -> (float64 inv_freq,
# attention factor). `params` is the scaling dict; `max_position` the table length or None.


def _plain(rotary_dim: int, base: float) -> torch.Tensor:
    """base ** (-2i / rotary_dim), i = 0 .. rotary_dim/2 - 1, in float64."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=_CPU) / rotary_dim
    return 1.0 / (base**exponent)


def _default(rotary_dim, base, params, max_position, op):
    return _plain(rotary_dim, base), 1.0


def _linear(rotary_dim, base, params, max_position, op):
    factor = _positive(op, "scaling['factor']", _key(params, "factor", "linear", op))
    return _plain(rotary_dim, base) / factor, 1.0


def _dynamic(rotary_dim, base, params, max_position, op):
    factor = _positive(op, "scaling['factor']", _key(params, "factor", "dynamic", op))
    original = _positive_int(
        op,
        "scaling['original_max_position_embeddings']",
        _key(params, "original_max_position_embeddings", "dynamic", op),
    )
    if rotary_dim <= 2:
        fail(op, "rotary_dim", "at least 4 for rope_type 'dynamic' (the NTK exponent is d / (d - 2))", repr(rotary_dim))
    seq_len = original if max_position is None else max(max_position, original)
    # NTK-aware: grow the base so the lowest frequency stretches over seq_len
    stretch = factor * seq_len / original - (factor - 1.0)
    new_base = base * stretch ** (rotary_dim / (rotary_dim - 2))
    return _plain(rotary_dim, new_base), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim, base, params, max_position, op):
    original = _positive_int(
        op, "scaling['original_max_position_embeddings']", _key(params, "original_max_position_embeddings", "yarn", op)
    )
    factor = _key(params, "factor", "yarn", op)
    if factor is None:
        if max_position is None:
            fail(op, "scaling['factor']", "a number (or None with max_position given)", "None")
        factor = max_position / original
    factor = _positive(op, "scaling['factor']", factor)

    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _positive(op, "scaling['attention_factor']", attention_factor)
    else:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        for name, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
            if value is not None and (not _is_number(value) or value < 0):
                fail(op, f"scaling[{name!r}]", "a non-negative number", repr(value))
        if mscale and mscale_all_dim:  # DeepSeek: a ratio of two temperatures
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    # HF reads a missing or zero beta as its default (`or 32`, `or 1`)
    beta_fast = params.get("beta_fast") or 32.0
    beta_slow = params.get("beta_slow") or 1.0
    beta_fast = _positive(op, "scaling['beta_fast']", beta_fast)
    beta_slow = _positive(op, "scaling['beta_slow']", beta_slow)
    truncate = params.get("truncate", True)

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength completes `rotations` turns over the original context
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64, device=_CPU) - low) / (high - low)).clamp(0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1: keep the original frequency, 0: divide it by factor
    plain = _plain(rotary_dim, base)
    inv_freq = (plain / factor) * (1.0 - extrapolate) + plain * extrapolate
    return inv_freq, float(attention_factor)


def _factor_list(op, params, key, half):
    values = _key(params, key, "longrope", op)
    if not isinstance(values, (list, tuple)) or len(values) != half:
        fail(
            op,
            f"scaling[{key!r}]",
            f"a list of {half} numbers (rotary_dim // 2)",
            f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values),
        )
    for i, v in enumerate(values):
        if not _is_number(v) or v <= 0:
            fail(op, f"scaling[{key!r}][{i}]", "a positive number", repr(v))
    return torch.tensor([float(v) for v in values], dtype=torch.float64, device=_CPU)


def _longrope(rotary_dim, base, params, max_position, op):
    half = rotary_dim // 2
    short = _factor_list(op, params, "short_factor", half)
    long = _factor_list(op, params, "long_factor", half)
    original = _positive_int(
        op,
        "scaling['original_max_position_embeddings']",
        _key(params, "original_max_position_embeddings", "longrope", op),
    )
    factor = params.get("factor")
    if factor is None:
        factor = 1.0 if max_position is None else max_position / original
    factor = _positive(op, "scaling['factor']", factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _positive(op, "scaling['attention_factor']", attention_factor)
    elif factor <= 1.0:
        attention_factor = 1.0
    else:
        attention_factor = math.sqrt(1.0 + math.log(factor) / math.log(original))
    ext = long if max_position is not None and max_position > original else short
    return _plain(rotary_dim, base) / ext, float(attention_factor)


def _llama3(rotary_dim, base, params, max_position, op):
    factor = _positive(op, "scaling['factor']", _key(params, "factor", "llama3", op))
    low_ff = _positive(op, "scaling['low_freq_factor']", _key(params, "low_freq_factor", "llama3", op))
    high_ff = _positive(op, "scaling['high_freq_factor']", _key(params, "high_freq_factor", "llama3", op))
    original = _positive_int(
        op,
        "scaling['original_max_position_embeddings']",
        _key(params, "original_max_position_embeddings", "llama3", op),
    )
    if high_ff <= low_ff:
        fail(op, "scaling['high_freq_factor']", f"a number above low_freq_factor = {low_ff!r}", repr(high_ff))
    plain = _plain(rotary_dim, base)
    wavelen = 2 * math.pi / plain
    low_freq_wavelen, high_freq_wavelen = original / low_ff, original / high_ff
    # long wavelengths are interpolated (divided by factor), short ones kept, the band between blended
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1.0 - smooth) * plain / factor + smooth * plain
    inv_freq = torch.where(wavelen > low_freq_wavelen, plain / factor, plain)
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, inv_freq), 1.0


def rotated_pairs(rotary_dim: int, params: dict, op: str) -> int:
    """proportional: the pairs that turn, int(partial_rotary_factor * rotary_dim // 2), as HF counts them."""
    fraction = params.get("partial_rotary_factor", 1.0)
    if not _is_number(fraction) or not 0 <= fraction <= 1:
        fail(op, "scaling['partial_rotary_factor']", "a number in [0, 1]", repr(fraction))
    return int(fraction * rotary_dim // 2)


def _proportional(rotary_dim, base, params, max_position, op):
    # Gemma 4's p-RoPE: rotary_dim is the whole head; the first fraction of its pairs (i, i + D/2)
    # turn with the head's frequencies base ** (-2i / D), the rest have frequency 0 (cos 1, sin 0)
    rotated = rotated_pairs(rotary_dim, params, op)
    factor = _positive(op, "scaling['factor']", params.get("factor", 1.0))
    inv = torch.zeros(rotary_dim // 2, dtype=torch.float64, device=_CPU)
    inv[:rotated] = _plain(rotary_dim, base)[:rotated]
    return inv / factor, 1.0


_ROPE_FUNCTIONS: Dict[str, Callable] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
    "proportional": _proportional,
}


def _inv_freq64(op, rotary_dim, base, scaling, max_position):
    rotary_dim = _check_rotary_dim(op, rotary_dim)
    if max_position is not None:
        _positive_int(op, "max_position", max_position)
    rope_type, params = parse_scaling(scaling, op)
    base = _resolve_base(op, base, params)
    return _ROPE_FUNCTIONS[rope_type](rotary_dim, base, params, max_position, op)


# ---------------------------------------------------------------------------------------------
# public


def inv_freq(
    rotary_dim: int,
    base: Optional[float] = None,
    scaling: Optional[dict] = None,
    max_position: Optional[int] = None,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Tuple[torch.Tensor, float]:
    """Inverse frequencies of a rope type, and the attention factor its table is scaled by.

    Args:
        rotary_dim: number of rotated dims (even); the result has rotary_dim // 2 frequencies.
        base: rope theta; None means scaling["rope_theta"] if present, else 10000.0.
        scaling: None (plain RoPE) or an HF rope_scaling / rope_parameters dict whose rope type
            is one of default, linear, dynamic, yarn, longrope, llama3, proportional ("type" and "su" accepted).
        max_position: length of the table these frequencies are for; used by dynamic (seq_len),
            longrope (short or long factors) and yarn with factor None.
        dtype, device: of the returned tensor (computed in float64 on the CPU); device None
            means the current default device.

    Returns:
        (inv_freq of shape (rotary_dim // 2,), attention_factor: float). The attention factor
        (YaRN / LongRoPE mscale, 1.0 for the other types) multiplies cos and sin, as in HF.

    Raises ValueError naming the key for an unknown rope type, a missing or non-positive
    scaling value, a bad rotary_dim, or a dtype that is not floating point (frequencies below 1
    would truncate to 0).

    Example, YaRN at factor 4 over a 32768-position original context::

        f, attention_factor = ropekit.inv_freq(128, 10000.0, {"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768}, 131072)
        # f (64,) float32; attention_factor 1.1386... (cos_sin_cache folds it into its rows)
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        fail("inv_freq", "dtype", "a floating-point torch.dtype", repr(dtype))
    freqs, attention_factor = _inv_freq64("inv_freq", rotary_dim, base, scaling, max_position)
    device = torch.get_default_device() if device is None else device
    return freqs.to(device=device, dtype=dtype), attention_factor


def cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: Optional[float] = None,
    scaling: Optional[dict] = None,
    dtype: torch.dtype = torch.float32,
    device=None,
    *,
    rotated_only: bool = False,
) -> torch.Tensor:
    """The (max_position, rotary_dim) table whose row p is [cos(p * f) | sin(p * f)] * attention_factor.

    f = inv_freq(rotary_dim, base, scaling, max_position); see `inv_freq` for the arguments.
    Angles and cos/sin are computed in float64 and rounded once to `dtype` (float32 by default;
    keep it float32 for accuracy, bf16/fp16 tables are accepted by apply_rope). `device` None
    means the current default device; on "meta" only the shape is made.

    rotated_only: the pairs the rope type turns, and no others. For "proportional" (Gemma 4's
    p-RoPE, rotary_dim the head size D) that is the first R / 2 = int(partial_rotary_factor * D // 2)
    frequencies base ** (-2i / D): a (max_position, R) table for apply_rope(...,
    rotary_position='halves'), which rotates the pairs (i, i + D/2), i < R / 2, and keeps the rest
    (the same rotation as the full-width table, without reading or computing its zero-frequency
    pairs). Every other rope type turns all its pairs: the table is the same as without it.

    Example, Llama 3.1's table (128 rotated dims, theta 500000, its rope_scaling), float32
    (4096, 128), then a rotation by it::

        cache = ropekit.cos_sin_cache(128, 4096, base=500000.0, scaling={"rope_type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}, device="cuda")
        q, k = ropekit.apply_rope(q, k, positions, cache)  # q (T, 32, 128), k (T, 8, 128) bf16
    """
    op = "cos_sin_cache"
    _positive_int(op, "max_position", max_position)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        fail(op, "dtype", "a floating-point torch.dtype", repr(dtype))
    if not isinstance(rotated_only, bool):
        raise TypeError(f"{op}: rotated_only: expected a bool, got {type(rotated_only).__name__}")
    freqs, attention_factor = _inv_freq64(op, rotary_dim, base, scaling, max_position)
    if rotated_only:
        rope_type, params = parse_scaling(scaling, op)
        if rope_type == "proportional":
            freqs = freqs[: rotated_pairs(rotary_dim, params, op)]
    width = 2 * freqs.shape[0]
    target = torch.get_default_device() if device is None else torch.device(device)
    if target.type == "meta":
        return torch.empty(max_position, width, dtype=dtype, device=target)
    # float64 where the device has it (CPU, CUDA); elsewhere compute on the CPU and copy
    work = target if target.type in ("cpu", "cuda") else torch.device("cpu")
    positions = torch.arange(max_position, dtype=torch.float64, device=work)
    angles = torch.outer(positions, freqs.to(work))
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    if attention_factor != 1.0:
        table *= attention_factor
    return table.to(device=target, dtype=dtype)


def axial_inv_freq(axes_dim: Sequence[int], theta=10000.0, *, device=None) -> torch.Tensor:
    """Inverse frequencies of axial (N-D) RoPE: each axis's set from its own width, in axis order.

    Args:
        axes_dim: rotary dims of each axis (positive even ints), e.g. Flux's (16, 56, 56) for
            (text / image index, height, width) or Wan 2.1's (44, 42, 42) for (time, height, width).
        theta: the base, one number for every axis or a sequence of one per axis.
        device: of the result; None means the current default device.

    Returns a float32 tensor of shape (sum(axes_dim) // 2,): for axis i of width d_i and base
    theta_i, the d_i // 2 frequencies 1 / theta_i ** (2j / d_i), j = 0 .. d_i/2 - 1 (computed in
    float64, rounded once), concatenated in axis order: the convention of Flux's EmbedND and of
    the 3D RoPE of Wan, HunyuanVideo and Qwen-Image. Pass it as `inv_freq` to apply_rope with
    `axes = tuple(d // 2 for d in axes_dim)`.

    Example, Flux's three axes (text / image index, height, width): q and k (T, 24, 128), ids
    (3, T) int positions, one per axis, interleaved pairs as Flux rotates them::

        f = ropekit.axial_inv_freq((16, 56, 56), 10000.0, device="cuda")  # (64,) float32
        q, k = ropekit.apply_rope(q, k, ids, None, inv_freq=f, axes=(8, 28, 28), interleaved=True)
    """
    op = "axial_inv_freq"
    if not isinstance(axes_dim, (list, tuple)) or not axes_dim:
        fail(op, "axes_dim", "a non-empty list or tuple of positive even ints", repr(axes_dim))
    for d in axes_dim:
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0 or d % 2:
            fail(op, "axes_dim", "a non-empty list or tuple of positive even ints", repr(axes_dim))
    if isinstance(theta, (list, tuple)):
        if len(theta) != len(axes_dim):
            fail(op, "theta", f"a number or {len(axes_dim)} numbers (one per axis)", repr(theta))
        bases = [_positive(op, "theta", t) for t in theta]
    else:
        bases = [_positive(op, "theta", theta)] * len(axes_dim)
    freqs = torch.cat([_plain(d, base) for d, base in zip(axes_dim, bases)])
    device = torch.get_default_device() if device is None else device
    return freqs.to(device=device, dtype=torch.float32)


def pair_positions(positions: torch.Tensor, axes, half: int) -> torch.Tensor:
    """(*T, half): the position that drives each rotary pair, for angles computed from inverse
    frequencies. positions (*T) drives every pair (axes empty); with axes (pairs per axis), row a
    of positions (len(axes), *T) drives axis a's pairs."""
    if not axes:
        return positions.unsqueeze(-1).expand(*positions.shape, half)
    counts = torch.tensor(tuple(axes), device=positions.device)
    rows = torch.repeat_interleave(torch.arange(len(axes), device=positions.device), counts)
    return positions.index_select(0, rows).movedim(0, -1)
