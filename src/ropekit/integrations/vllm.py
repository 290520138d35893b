"""ropekit.vllm: a vLLM general plugin that computes vLLM's rotary embeddings through ropekit.

vLLM calls `register()` in each of its processes when the plugin is selected (entry point
`vllm.general_plugins: ropekit`; every installed plugin loads unless VLLM_PLUGINS names others).
`register()` installs, with `CustomOp.register_oot`, a subclass of each vLLM rotary class whose
forward is a rotation by its own `[cos | sin]` rows: same constructor, same buffers (vLLM builds
its table as before), only the forward computes through `ropekit.apply_rope(..., inplace=True)`.
Classes whose forward is something else keep vLLM's own, and the report says why.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Dict, Optional

import torch

import ropekit

logger = logging.getLogger("ropekit.vllm")

ROTARY_PACKAGE = "vllm.model_executor.layers.rotary_embedding"

# A file path: every replacement appends "init <vLLM class>" when constructed and "call <vLLM class>"
# per forward, so a test can prove from inside vLLM's engine process that ropekit ran.
TRACE_ENV = "ROPEKIT_VLLM_TRACE"

# vLLM class -> how its forward maps onto apply_rope. "table": rows of `cos_sin_cache` indexed by
# positions (+ offsets); "mrope": the same, and (3, T) positions pick sections (Qwen2-VL chunks or
# Qwen3-VL interleaving, vLLM's `mrope_interleaved`; offsets ignored, as vLLM does); "longrope":
# Phi-3's short|long table, the long rows chosen once at construction (vLLM's `use_long_rope`).
SERVED = {
    "RotaryEmbedding": "table",
    "LinearScalingRotaryEmbedding": "table",
    "NTKScalingRotaryEmbedding": "table",
    "DynamicNTKScalingRotaryEmbedding": "table",
    "DynamicNTKAlphaRotaryEmbedding": "table",
    "YaRNScalingRotaryEmbedding": "table",
    "Llama3RotaryEmbedding": "table",
    "Gemma4RotaryEmbedding": "table",
    "DeepseekScalingRotaryEmbedding": "table",
    "MRotaryEmbedding": "mrope",
    "Phi3LongRoPEScaledRotaryEmbedding": "longrope",
}

# vLLM classes left as they are, and why (their forward is not one rotation by table rows).
LEFT = {
    "DeepseekV4ScalingRotaryEmbedding": "rotates the last rotary_dim dims with a per-call head size and "
    "an inverse= flag; not covered by this plugin",
    "FourierRotaryEmbedding": "FoPE: per-head Fourier-mixed cos/sin (a 3-D table filled from checkpoint "
    "weights on the first call), not one [cos | sin] row per position",
    "DualChunkRotaryEmbedding": "dual-chunk attention: the query is rotated by three tables (intra, "
    "successive, inter chunk) and returned concatenated",
    "Llama4VisionRotaryEmbedding": "a complex 2-D vision table applied by forward(query, key), no positions",
    "MRotaryEmbeddingInterleaved": "openPangu's own section order (get_mrope_interleaved_id_list), not "
    "ropekit's chunked or Qwen3-VL layout",
    "BailingMRotaryEmbedding": "Bailing's own per-section position selection (select_cos_sin)",
    "Ernie4_5_VLRotaryEmbedding": "Ernie 4.5-VL's [h w h w ... t t t] section layout",
    "RotaryEmbeddingBase": "abstract base (no forward)",
}

QK_NORM = (
    "not fused: vLLM 0.32 applies q_norm / k_norm as separate RMSNorm modules in the model's forward "
    "and fuses them with RoPE only in a torch.compile pass on its own CUDA ops (enable_qk_norm_rope_fusion); "
    "there is no module seam for a plugin, so q/k RMSNorm stays vLLM's and RoPE is ropekit's"
)

_report: Optional[Dict[str, object]] = None


def _trace(module, event: str) -> None:
    # the path is read at construction: forwards traced by torch.compile see a constant, no I/O when unset
    path = getattr(module, "_ropekit_trace", None)  # None on a module that is not a replacement (the bench's)
    if path:
        with open(path, "a") as f:
            f.write(f"{event} {module._ropekit_of.__name__} {os.getpid()}\n")


def _table(module: torch.nn.Module, name: str, query: torch.Tensor) -> torch.Tensor:
    """The module's own table on the query's device, in its own dtype (ropekit computes in fp32)."""
    table = getattr(module, name)
    if table.device != query.device:
        table = table.to(query.device)
        if not torch.compiler.is_compiling():
            setattr(module, name, table)
    return table


def _rotate(module, positions, query, key, table, mrope: bool):
    """apply_rope in place on query / key viewed as (T, H, head_size); returns them as given."""
    n_tok = positions.shape[-1]
    if not mrope:
        positions = positions.flatten()
    q = query.view(n_tok, -1, module.head_size)
    k = None if key is None else key.view(n_tok, -1, module.head_size)
    ropekit.apply_rope(
        q,
        k,
        positions,
        table,
        interleaved=not getattr(module, "is_neox_style", True),  # Phi-3's class is neox-only, keeps no flag
        rotary_dim=module.rotary_dim,
        mrope_section=module.mrope_section if mrope else None,
        mrope_interleaved=bool(module.mrope_interleaved) if mrope else False,
        inplace=True,
    )
    return query, key


def _forward_table(self, positions, query, key=None, offsets=None):
    _trace(self, "call")
    if offsets is not None:
        positions = positions + offsets
    return _rotate(self, positions, query, key, _table(self, "cos_sin_cache", query), mrope=False)


def _forward_mrope(self, positions, query, key=None, offsets=None):
    # vLLM's MRotaryEmbedding takes `offsets` and does not use them (0.32, every path): neither does
    # this, so the results stay vLLM's
    _trace(self, "call")
    mrope = positions.dim() == 2
    return _rotate(self, positions, query, key, _table(self, "cos_sin_cache", query), mrope=mrope)


def _forward_longrope(self, positions, query, key=None, offsets=None):
    _trace(self, "call")
    if self.use_long_rope:
        positions = positions + self.original_max_position_embeddings
    if offsets is not None:
        positions = positions + offsets
    return _rotate(self, positions, query, key, _table(self, "long_short_cos_sin_cache", query), mrope=False)


# form -> the forward its replacement classes run: forward(module, positions, query, key=None, offsets=None),
# module holding vLLM's attributes (head_size, rotary_dim, is_neox_style, cos_sin_cache, ...)
FORWARDS = {"table": _forward_table, "mrope": _forward_mrope, "longrope": _forward_longrope}


def _init(self, *args, **kwargs):
    self._ropekit_of.__init__(self, *args, **kwargs)
    self._ropekit_trace = os.environ.get(TRACE_ENV)
    _trace(self, "init")


def replacement(vllm_cls: type, form: str) -> type:
    """The ropekit-backed subclass of a vLLM rotary class: its constructor, its buffers, ropekit's
    forward for every path vLLM may dispatch to (native, CUDA, CPU)."""
    forward = FORWARDS[form]
    namespace = {
        "__init__": _init,
        "_ropekit_of": vllm_cls,
        "__module__": __name__,
        "__doc__": f"vLLM's {vllm_cls.__name__} computed through ropekit.apply_rope (in place).",
    }
    if form == "longrope":  # a plain nn.Module in vLLM 0.32: forward itself
        namespace["forward"] = forward
    else:
        namespace.update(forward_native=forward, forward_cuda=forward, forward_cpu=forward)
    return type(f"Ropekit{vllm_cls.__name__}", (vllm_cls,), namespace)


def _rotary_classes(package) -> Dict[str, type]:
    """The rotary classes the installed vLLM exports (its get_rope constructs them by these names)."""
    return {
        name: obj
        for name, obj in vars(package).items()
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and "Rotary" in name
    }


def register() -> Dict[str, object]:
    """Install ropekit's replacements in vLLM (idempotent); log and return what was done.

    Returns {"replaced": {vLLM class: ropekit class}, "left": {vLLM class: reason}, "qk_norm":
    reason}. CustomOp classes are replaced through `CustomOp.register_oot(name=...)` (vLLM then
    constructs the replacement wherever it would construct its class); Phi-3's LongRoPE class,
    a plain nn.Module, through the name get_rope constructs it by.
    """
    global _report
    if _report is None:
        _report = _install()
    replaced, left = _report["replaced"], _report["left"]
    logger.info("ropekit.vllm: replaced %s", ", ".join(replaced) or "nothing")
    for name, reason in left.items():
        logger.info("ropekit.vllm: left %s: %s", name, reason)
    logger.info("ropekit.vllm: q/k norm %s", QK_NORM)
    return _report


def _install() -> Dict[str, object]:
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    package = importlib.import_module(ROTARY_PACKAGE)
    replaced, left = {}, {}
    for name, cls in sorted(_rotary_classes(package).items()):
        form = SERVED.get(name)
        if form is None:
            left[name] = LEFT.get(name, "unknown to this ropekit version (its forward was not checked)")
            continue
        if getattr(package, name).__module__ == __name__:  # already installed in this process
            replaced[name] = getattr(package, name).__name__
            continue
        if form == "longrope":
            if issubclass(cls, CustomOp):
                left[name] = "a CustomOp in this vLLM; this plugin knows it as a plain module (vLLM 0.32)"
                continue
            new = replacement(cls, form)
            setattr(package, name, new)
        elif not issubclass(cls, CustomOp):
            left[name] = "not a CustomOp in this vLLM, so register_oot cannot replace it"
            continue
        elif name in op_registry_oot:
            new = op_registry_oot[name]
            if new.__module__ != __name__:
                left[name] = f"another plugin registered {new.__module__}.{new.__name__} for it"
                continue
        else:
            new = CustomOp.register_oot(name=name)(replacement(cls, form))
        replaced[name] = new.__name__
    return {"replaced": replaced, "left": left, "qk_norm": QK_NORM}
