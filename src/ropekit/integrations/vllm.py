"""ropekit.vllm: a vLLM general plugin that computes vLLM's rotary embeddings through ropekit.

vLLM calls `register()` in each of its processes (entry point `vllm.general_plugins: ropekit`). vLLM
loads every installed general plugin when VLLM_PLUGINS is unset, so the plugin acts only when the
deployment asks for it: VLLM_PLUGINS naming `ropekit`, or ROPEKIT_VLLM=1. Not asked, `register()`
changes nothing and logs one line saying how to turn it on.

Asked, `register()` installs, with `CustomOp.register_oot`, a subclass of each vLLM rotary class whose
forward is a rotation by its own `[cos | sin]` rows: same constructor, same buffers (vLLM builds
its table as before), only the forward computes through `ropekit.apply_rope(..., inplace=True)`.
Classes whose forward is something else keep vLLM's own, and the report says why. Models that vLLM
runs through its Transformers backend (Hugging Face's modeling code) get `ropekit.hf.patch(model)`
as the backend builds them.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from typing import Dict, Optional

import torch

import ropekit

# under vLLM's logger: vLLM configures "vllm" (its own handler, no propagation to the root logger),
# so these lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL); a "ropekit" logger would not
logger = logging.getLogger("vllm.ropekit")

ROTARY_PACKAGE = "vllm.model_executor.layers.rotary_embedding"
# the class every model of vLLM's Transformers backend is built by (vLLM 0.32)
TRANSFORMERS_BACKEND = "vllm.model_executor.models.transformers.base"

PLUGIN = "ropekit"  # the entry point's name: what VLLM_PLUGINS lists
ENABLE_ENV = "ROPEKIT_VLLM"  # "1": the plugin acts although VLLM_PLUGINS is unset
HOW_TO_TURN_ON = (
    f"ropekit's vLLM plugin is installed and off (vLLM's rotary code runs); set {ENABLE_ENV}=1, or "
    f"VLLM_PLUGINS={PLUGIN} (with any other plugins, comma-separated), to compute it through ropekit"
)

# A file path: every replacement appends "init <vLLM class>" when constructed and "call <vLLM class>"
# per forward, so a test can prove from inside vLLM's engine process that ropekit ran. Through the
# Transformers backend, each HF rotary function patched for a model appends "init hf:<modeling
# module>.<name>" when the model is built and "call hf:<modeling module>.<name>" per call.
TRACE_ENV = "ROPEKIT_VLLM_TRACE"
# "eager": every replacement rounds as vLLM's forward_native does (x1 * cos - x2 * sin op by op in the
# model's dtype, cos / sin from its table in that dtype): apply_rope(eager_rounding=True), and
# ropekit.hf.patch(model, hf_rounding=True) for the Transformers backend; unset or "once": ropekit's
# one rounding from float32. Read when each replacement is constructed (or the backend's model patched).
ROUNDING_ENV = "ROPEKIT_VLLM_ROUNDING"


def eager_rounding() -> bool:
    """ROUNDING_ENV as a bool; any value but "", "once" and "eager" raises ValueError naming it."""
    value = os.environ.get(ROUNDING_ENV, "")
    if value not in ("", "once", "eager"):
        raise ValueError(f"ropekit.vllm: {ROUNDING_ENV}: expected 'once' or 'eager' (or unset), got {value!r}")
    return value == "eager"


# vLLM class -> how its forward maps onto apply_rope. "table": rows of `cos_sin_cache` indexed by
# positions (+ offsets); "mrope": the same, and (3, T) positions pick sections (Qwen2-VL chunks or
# Qwen3-VL interleaving, vLLM's `mrope_interleaved`; offsets ignored, as vLLM does); "mrope_ernie",
# "mrope_bailing", "mrope_pangu": (N, T) positions laid over the pairs by apply_rope's mrope_layout
# preset of that name (ERNIE 4.5-VL's (h, w, t) sections h w h w ... t t t; Bailing's (t, h, w), the
# same order; openPangu's get_mrope_interleaved_id_list order, 2 or 3 sections), 1-D positions a
# plain rotation (as ERNIE's and Bailing's classes do; openPangu's has no 1-D path: its forward
# fails on them); "longrope": Phi-3's short|long table, the long rows chosen once at construction
# (vLLM's `use_long_rope`).
# "fope": FoPE's per-KV-head table, filled from the checkpoint's coefficients on the first call, as
# a per-head table (rotary_dim = head_size, half-split pairs); "last": DeepSeek-V4's table rotating
# the last rotary_dim dims of heads whose size each call's query gives, by -angle with inverse=True.
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
    "Ernie4_5_VLRotaryEmbedding": "mrope_ernie",
    "BailingMRotaryEmbedding": "mrope_bailing",
    "MRotaryEmbeddingInterleaved": "mrope_pangu",
    "Phi3LongRoPEScaledRotaryEmbedding": "longrope",
    "FourierRotaryEmbedding": "fope",
    "DeepseekV4ScalingRotaryEmbedding": "last",
}

# vLLM classes left as they are, and why (their forward is not one rotation by table rows).
LEFT = {
    "DualChunkRotaryEmbedding": "dual-chunk attention: the query is rotated by three tables (intra, "
    "successive, inter chunk) and returned concatenated",
    "Llama4VisionRotaryEmbedding": "a complex 2-D vision table applied by forward(query, key), no positions",
    "RotaryEmbeddingBase": "abstract base (no forward)",
}

QK_NORM = (
    "not fused: vLLM 0.32 applies q_norm / k_norm as separate RMSNorm modules in the model's forward "
    "and fuses them with RoPE only in a torch.compile pass on its own CUDA ops (enable_qk_norm_rope_fusion); "
    "there is no module seam for a plugin, so q/k RMSNorm stays vLLM's and RoPE is ropekit's"
)

_report: Optional[Dict[str, object]] = None


def _trace_line(path: str, event: str, name: str) -> None:
    with open(path, "a") as f:
        f.write(f"{event} {name} {os.getpid()}\n")


def _trace(module, event: str) -> None:
    # the path is read at construction: forwards traced by torch.compile see a constant, no I/O when unset
    path = getattr(module, "_ropekit_trace", None)  # None on a module that is not a replacement (the bench's)
    if path:
        _trace_line(path, event, module._ropekit_of.__name__)


def _table(module: torch.nn.Module, name: str, query: torch.Tensor) -> torch.Tensor:
    """The module's own table on the query's device, in its own dtype (ropekit computes in fp32)."""
    table = getattr(module, name)
    if table.device != query.device:
        table = table.to(query.device)
        if not torch.compiler.is_compiling():
            setattr(module, name, table)
    return table


def _rotate(module, positions, query, key, table, mrope: bool, layout=None):
    """apply_rope in place on query / key viewed as (T, H, head_size); returns them as given.
    layout: an mrope_layout preset (M-RoPE by the module's mrope_section), else vLLM's own
    mrope_interleaved flag says chunked or Qwen3-VL."""
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
        mrope_interleaved=bool(module.mrope_interleaved) if mrope and layout is None else False,
        mrope_layout=layout if mrope else None,
        inplace=True,
        eager_rounding=getattr(module, "_ropekit_eager", False),  # False: not a replacement (the bench's)
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


def _layout_forward(layout: str):
    """The forward of a vLLM M-RoPE class whose sections follow apply_rope's mrope_layout preset
    `layout` ((N, T) positions; 1-D positions: a plain rotation, as the class does; offsets ignored,
    as vLLM's native forward of each does)."""

    def forward(self, positions, query, key=None, offsets=None):
        _trace(self, "call")
        mrope = positions.dim() == 2
        return _rotate(self, positions, query, key, _table(self, "cos_sin_cache", query), mrope=mrope, layout=layout)

    forward.__name__ = forward.__qualname__ = f"_forward_mrope_{layout}"
    return forward


def _forward_longrope(self, positions, query, key=None, offsets=None):
    _trace(self, "call")
    if self.use_long_rope:
        positions = positions + self.original_max_position_embeddings
    if offsets is not None:
        positions = positions + offsets
    return _rotate(self, positions, query, key, _table(self, "long_short_cos_sin_cache", query), mrope=False)


def fope_table(cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """FoPE's cache as apply_rope's table: vLLM's rows hold [cos, cos | sin, sin] over the whole head
    (head_size // 2 columns each, repeated for rotate_neox), per KV head (max_position, Hkv,
    2 * head_size); apply_rope's hold [cos | sin] once, (max_position, Hkv, head_size)."""
    half = head_size // 2
    return torch.cat((cache[..., :half], cache[..., head_size : head_size + half]), dim=-1)


def _forward_fope(self, positions, query, key=None, offsets=None):
    # vLLM's FourierRotaryEmbedding.forward_native: on the first call the table is computed from
    # cos_coef / sin_coef (loaded by then) into cos_sin_cache; every call rotates the whole head
    # (its half-split pairs, whatever is_neox_style says) by the rows of each KV head, q's heads in
    # groups of Hq / Hkv; `offsets` is taken and not used (as vLLM's)
    _trace(self, "call")
    if self.update_cache:
        self.cos_sin_cache.copy_(self._compute_cos_sin_cache().to(self.dtype))
        self.update_cache = False
        self._ropekit_table = None
    table = self.__dict__.get("_ropekit_table")
    if table is None or table.device != query.device:
        table = fope_table(_table(self, "cos_sin_cache", query), self.head_size)
        if not torch.compiler.is_compiling():
            self._ropekit_table = table
    positions = positions.flatten()
    n_tok = positions.shape[0]
    q = query.view(n_tok, -1, self.head_size)
    k = None if key is None else key.view(n_tok, -1, self.head_size)
    ropekit.apply_rope(
        q,
        k,
        positions,
        table,
        rotary_dim=self.head_size,
        inplace=True,
        eager_rounding=getattr(self, "_ropekit_eager", False),
    )
    return q, k  # (T, H, head_size) views, the shapes vLLM's forward_native returns


def _forward_last(self, positions, query, key=None, offsets=None, inverse=False):
    # vLLM's DeepseekV4ScalingRotaryEmbedding: the last rotary_dim dims of each head rotated, the
    # head size each call's tensors have (the indexer's and attention's differ), by -angle with
    # inverse=True; key may be None
    _trace(self, "call")
    if offsets is not None:
        positions = positions + offsets
    positions = positions.flatten()
    n_tok = positions.shape[0]
    q = query.view(n_tok, -1, query.shape[-1])
    k = None if key is None else key.view(n_tok, -1, key.shape[-1])
    ropekit.apply_rope(
        q,
        k,
        positions,
        _table(self, "cos_sin_cache", query),
        interleaved=not self.is_neox_style,
        rotary_dim=self.rotary_dim,
        rotary_position="last",
        inverse=bool(inverse),
        inplace=True,
        eager_rounding=getattr(self, "_ropekit_eager", False),
    )
    return query, key


# form -> the forward its replacement classes run: forward(module, positions, query, key=None, offsets=None),
# module holding vLLM's attributes (head_size, rotary_dim, is_neox_style, cos_sin_cache, ...)
FORWARDS = {
    "table": _forward_table,
    "mrope": _forward_mrope,
    "mrope_ernie": _layout_forward("ernie"),
    "mrope_bailing": _layout_forward("bailing"),
    "mrope_pangu": _layout_forward("pangu"),
    "longrope": _forward_longrope,
    "fope": _forward_fope,
    "last": _forward_last,
}


def _init(self, *args, **kwargs):
    self._ropekit_of.__init__(self, *args, **kwargs)
    self._ropekit_trace = os.environ.get(TRACE_ENV)
    self._ropekit_eager = eager_rounding()
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
        if "forward" in vars(vllm_cls):  # MRotaryEmbeddingInterleaved overrides CustomOp's dispatching forward
            namespace["forward"] = forward
    return type(f"Ropekit{vllm_cls.__name__}", (vllm_cls,), namespace)


# served classes that vLLM's package does not export: its models import them from these modules of
# the package and construct them directly (CustomOp's constructor still hands back a registered replacement)
SUBMODULES = {"Ernie4_5_VLRotaryEmbedding": "ernie45_vl_rope"}


def _rotary_classes(package) -> Dict[str, type]:
    """The rotary classes the installed vLLM exports (its get_rope constructs them by these names),
    and those of SUBMODULES it has."""
    found = {
        name: obj
        for name, obj in vars(package).items()
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and "Rotary" in name
    }
    for name, module in SUBMODULES.items():
        if name not in found:
            try:
                found[name] = getattr(importlib.import_module(f"{package.__name__}.{module}"), name)
            except (ImportError, AttributeError):
                pass  # not in this vLLM
    return found


def asked() -> Optional[str]:
    """How this process asks for the plugin ("VLLM_PLUGINS names ropekit", "ROPEKIT_VLLM=1"), or None.

    vLLM loads a plugin that VLLM_PLUGINS names, and every plugin when VLLM_PLUGINS is unset; only
    the first is a request. ROPEKIT_VLLM=1 is one too (a deployment that keeps VLLM_PLUGINS unset);
    "0" or unset asks nothing; any other value raises ValueError.
    """
    value = os.environ.get(ENABLE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"ropekit.vllm.register: {ENABLE_ENV}: expected '1' (on), '0' or unset (off), got {value!r}")
    # vLLM splits VLLM_PLUGINS on commas and compares the names as they are (no stripping): so does this
    if PLUGIN in os.environ.get("VLLM_PLUGINS", "").split(","):
        return f"VLLM_PLUGINS names {PLUGIN}"
    return f"{ENABLE_ENV}=1" if value == "1" else None


def register() -> Dict[str, object]:
    """The plugin's entry point: when the deployment asks (`asked()`), install ropekit's replacements
    in vLLM (idempotent); log and return what was done.

    Returns {"asked": how, "replaced": {vLLM class: ropekit class}, "left": {vLLM class: reason},
    "qk_norm": reason, "transformers_backend": what happens to models of vLLM's Transformers
    backend}. CustomOp classes are replaced through `CustomOp.register_oot(name=...)` (vLLM then
    constructs the replacement wherever it would construct its class); Phi-3's LongRoPE class, a
    plain nn.Module, through the name get_rope constructs it by. Models of the Transformers backend
    are patched with `ropekit.hf.patch(model)` as the backend builds them (`patch_hf_model`).

    Not asked: nothing in vLLM changes; one INFO line says how to turn it on, and the report has
    "asked": None and nothing replaced.
    """
    global _report
    how = asked()
    if how is None:
        logger.info(HOW_TO_TURN_ON)
        return {"asked": None, "replaced": {}, "left": {}, "qk_norm": QK_NORM, "transformers_backend": "off"}
    if _report is None:
        _report = _install()
        _report["transformers_backend"] = _hook_transformers_backend()
    _report["asked"] = how
    replaced, left = _report["replaced"], _report["left"]
    logger.info(
        "ropekit.vllm: on (%s); vLLM rotary classes computed by ropekit: %s; left as vLLM's: %s "
        "(why: this logger at DEBUG, or ropekit.vllm.register()['left'])",
        how,
        ", ".join(replaced) or "none",
        ", ".join(left) or "none",
    )
    logger.info("ropekit.vllm: Transformers backend: %s", _report["transformers_backend"])
    for name, reason in left.items():
        logger.debug("ropekit.vllm: left %s: %s", name, reason)
    logger.debug("ropekit.vllm: q/k norm %s", QK_NORM)
    return _report


def _hook_transformers_backend() -> str:
    """Make vLLM's Transformers backend call `patch_hf_model` on each model it builds: its models
    construct Hugging Face's modeling code in `Base.__init__` (`self.model`), which then calls HF's
    rotary functions in every forward, not vLLM's rotary classes."""
    try:
        base = importlib.import_module(TRANSFORMERS_BACKEND).Base
    except (ImportError, AttributeError) as e:
        return f"not reached: this vLLM has no {TRANSFORMERS_BACKEND}.Base ({type(e).__name__}: {e})"
    hooked = (
        f"each model's Hugging Face modeling code is patched with ropekit.hf.patch(model) ({base.__name__}.__init__)"
    )
    init = base.__init__
    if getattr(init, "_ropekit_hook", False):
        return hooked

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        patch_hf_model(self.model)

    __init__._ropekit_hook = True
    base.__init__ = __init__
    return hooked


def patch_hf_model(model: torch.nn.Module):
    """`ropekit.hf.patch(model)` for a model that vLLM's Transformers backend built; logs and returns
    the PatchReport (None when the model's modeling code has no rotary function, e.g. learned
    positions). With ROPEKIT_VLLM_TRACE set, each patched function also appends trace lines."""
    from . import hf

    name = type(model).__name__
    rounding = eager_rounding()
    try:
        report = hf.patch(model, hf_rounding=rounding)
    except ValueError as e:  # patch(model) without strict / fuse_qk_norm: no rotary function in its modules
        logger.info("ropekit.vllm: Transformers backend %s: Hugging Face's code kept: %s", name, e)
        return None
    done = [f"{family}.{label}" for family, labels in report.items() for label in labels]
    logger.info(
        "ropekit.vllm: Transformers backend %s: Hugging Face rotary functions computed by ropekit: %s; left: %s",
        name,
        ", ".join(done) or "none",
        "; ".join(f"{family}.{label} ({why})" for family, left in report.left.items() for label, why in left.items())
        or "none",
    )
    path = os.environ.get(TRACE_ENV)
    if path:
        _trace_hf(model, path)
    return report


def _trace_hf(model: torch.nn.Module, path: str) -> None:
    """Wrap each ropekit function bound in the model's modeling modules so that it appends trace lines."""
    for module in {sys.modules.get(type(m).__module__) for m in model.modules()} - {None}:
        for attr, fn in list(vars(module).items()):
            if not callable(fn) or not hasattr(fn, "ropekit_form"):  # ropekit.hf's replacements carry it
                continue
            label = f"hf:{module.__name__.rsplit('.', 1)[-1]}.{attr}"
            _trace_line(path, "init", label)
            if not getattr(fn, "_ropekit_traced", False):
                setattr(module, attr, _traced(fn, path, label))


def _traced(fn, path: str, label: str):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        _trace_line(path, "call", label)
        return fn(*args, **kwargs)

    traced._ropekit_traced = True
    return traced


def _install() -> Dict[str, object]:
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    package = importlib.import_module(ROTARY_PACKAGE)
    replaced, left = {}, {}
    for name, cls in sorted(_rotary_classes(package).items()):
        form = SERVED.get(name)
        if form is None:
            left[name] = LEFT.get(name, "unknown to this ropekit version (its forward was not checked)")
            continue
        if cls.__module__ == __name__:  # already installed in this process
            replaced[name] = cls.__name__
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
