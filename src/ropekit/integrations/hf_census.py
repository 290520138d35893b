"""Which modeling modules of the installed transformers define rotary functions, and which form
(ropekit.integrations.hf_forms) each function computes.

Finding: the modeling sources are scanned as text for module-level `def ...rotary...(` /
`def ...rope...(` before anything is imported, so only the modules that have one are imported
(with a model: only the modules its submodules come from).

Unwrapping: transformers decorates most rotary functions for Hugging Face's kernels hub
(`use_kernel_forward_from_hub("rotary_pos_emb")`). With `kernels` >= 0.18.2 installed (always with
transformers >= 5.25) the module then binds a `Func` `nn.Module` whose `forward(*args, **kwargs)`
calls the original function, a closure of that forward, unless `kernels.kernelize` activated a hub
kernel for the model. `unwrap` finds that function, so the same forms classify it; patch replaces
the module's binding either way (attention forwards look it up at call time) and says which route
each function took (`FUNCTION` or `HUB_FUNC`).

Classifying: the HF function and each form of its kind run on the same small inputs (`PROBES`:
full and partial tables, both unsqueeze dims, a per-batch table, bf16 / fp32 mixes, Hq != Hk,
shuffled position_ids, angles that require grad). A form matches when, on every probe, it either
declines the call (the replacement then runs HF's function) or gives HF's output: same structure,
shapes and dtypes, values within float rounding (relative L2 1e-5 in float32; bf16 allows HF's
own roundings). It must take the plain float32 probe, or it would only ever call HF's function.
Of the matching forms the one that takes the most probes wins. The rotary math is linear in q and
k for given angles, so one random input per shape agreeing means the maps agree. The inputs are
fixed (seeded): verdicts are deterministic, and each form's outputs are computed once per process.

A form whose tables hold pairs `[f0, f0, f1, f1, ...]` reads every other column; it is accepted
only where the module's source visibly builds such tables (`repeat_interleave(freqs, 2)` and the
like): the form of HF's default tables, halves `[f, f]`, is taken as the convention (docs/hf.md,
"Assumption").
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import pathlib
import re
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from . import hf_forms

_DEF = re.compile(r"^def (\w*(?:rotary|rope)\w*)\(", re.MULTILINE)
_PAIR_TABLES = re.compile(
    r"repeat_interleave\(\s*\w*(?:freq|emb|angle)\w*\s*,\s*2"
    r"|\b(?:\w*freq\w*|\w*emb\w*|\w*angle\w*|\w*keypoints|cos|sin)\.repeat_interleave\(\s*2"
)


FUNCTION = "function"  # the module binds the plain function
HUB_FUNC = "kernels hub Func module"  # the module binds kernels' Func module wrapping the function


def unwrap(bound) -> Tuple[object, str]:
    """(HF's function, route) of what a modeling module binds under a rotary function's name.

    A plain function is its own; a kernels hub `Func` module (a torch.nn.Module whose class carries
    `kernel_layer_name`) wraps the function as the free variable of its class's `forward`. When no
    closure cell of that forward holds a plain function, the module itself is returned: its
    `forward(*args, **kwargs)` signature then matches no form, and patch reports it as left."""
    if not (isinstance(bound, torch.nn.Module) and hasattr(type(bound), "kernel_layer_name")):
        return bound, FUNCTION
    forward = getattr(type(bound), "forward", None)
    cells = getattr(forward, "__closure__", None) or ()
    wrapped = [c.cell_contents for c in cells if inspect.isfunction(_contents(c))]
    return (wrapped[0] if len(wrapped) == 1 else bound), HUB_FUNC


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


class Entry(NamedTuple):
    family: str  # the folder under transformers/models
    module: str  # the modeling module's import name
    names: Tuple[str, ...]  # its module-level rotary functions, in source order


def _models_dir() -> pathlib.Path:
    import transformers.models

    return pathlib.Path(transformers.models.__file__).parent


def label(entry: Entry, name: str) -> str:
    """How reports name a function: the attribute, prefixed `modeling_x.` when the module is not the
    family's main one (modeling_<family>)."""
    main = entry.module == f"transformers.models.{entry.family}.modeling_{entry.family}"
    return name if main else f"{entry.module.rsplit('.', 1)[1]}.{name}"


@functools.lru_cache(maxsize=None)
def scan() -> Tuple[Entry, ...]:
    """Every modeling module of the installed transformers with a module-level rotary function
    (found by reading the sources; nothing is imported)."""
    found = []
    for path in sorted(_models_dir().glob("*/modeling_*.py")):
        names = tuple(dict.fromkeys(_DEF.findall(path.read_text(encoding="utf-8"))))
        if names:
            found.append(Entry(path.parent.name, f"transformers.models.{path.parent.name}.{path.stem}", names))
    return tuple(found)


@functools.lru_cache(maxsize=None)
def builds_pair_tables(module_name: str) -> bool:
    path = _models_dir() / module_name.split(".")[2] / (module_name.split(".")[3] + ".py")
    return bool(_PAIR_TABLES.search(path.read_text(encoding="utf-8")))


# ---------------------------------------------------------------------------------------------
# probes


class Probe(NamedTuple):
    name: str
    dtypes: Tuple[torch.dtype, torch.dtype, torch.dtype]  # q, k, cos / sin
    width: float = 1.0  # table width over the head
    unsqueeze_dim: int = 1
    table_batch: int = 1
    grad_angles: bool = False


F32, BF16 = torch.float32, torch.bfloat16
PROBES: Tuple[Probe, ...] = (
    Probe("float32", (F32, F32, F32)),  # the one a form must take
    Probe("partial", (F32, F32, F32), width=0.5),
    Probe("unsqueeze_dim=2, per-batch table", (F32, F32, F32), unsqueeze_dim=2, table_batch=2),
    Probe("bf16 q/k, float32 cos", (BF16, BF16, F32)),
    Probe("bf16", (BF16, BF16, BF16)),
    Probe("bf16 q, float32 k", (BF16, F32, BF16)),
    Probe("angles that require grad", (F32, F32, F32), grad_angles=True),
)
_S, _HQ, _HK, _D = 3, 3, 1, 8  # batch: the probe's table_batch (the interpreter's cost grows with tokens)
_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _table(layout: str, rows: torch.Tensor) -> torch.Tensor:
    if layout == "pairs":
        return rows.repeat_interleave(2, dim=-1)
    return rows if layout == "narrow" else torch.cat((rows, rows), dim=-1)


@functools.lru_cache(maxsize=None)
def probe_inputs(kind: str, layout: str, index: int):
    """(args of the normalized call (q, k, cos, sin, unsqueeze_dim), position_ids) for one probe."""
    p = PROBES[index]
    g = torch.Generator().manual_seed(1234 + index)
    dq, dk, dc = p.dtypes
    if kind == "complex":  # Llama 4: (B, S, H, D) q / k, complex64 freqs_cis (B or 1, S, D/2)
        q = torch.randn(p.table_batch, _S, _HQ, _D, generator=g).to(dq)
        k = torch.randn(p.table_batch, _S, _HK, _D, generator=g).to(dk)
        if layout == "complex_bhsd":  # DeepSeek-V2: (B, H, S, D) views
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        angles = (torch.rand(p.table_batch, _S, int(_D * p.width) // 2, generator=g) * 2 - 1) * 3.0
        freqs_cis = torch.polar(torch.ones_like(angles), angles)
        if p.grad_angles:
            freqs_cis.requires_grad_(True)
        return (q, k, freqs_cis, None, None), None
    if kind in hf_forms.ADAPTED:
        return _adapted_probe(kind, layout, index), None
    if kind == "vision":
        q = torch.randn(_S, _HQ, _D, generator=g).to(dq)
        k = torch.randn(_S, _HK, _D, generator=g).to(dk)
        tokens = (_S,)
    else:  # HF's (B, H, S, D) views of (B, S, H, D) projections, or (B, S, H, D) for unsqueeze_dim=2
        q = torch.randn(p.table_batch, _S, _HQ, _D, generator=g).to(dq)
        k = torch.randn(p.table_batch, _S, _HK, _D, generator=g).to(dk)
        if p.unsqueeze_dim == 1:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        tokens = (p.table_batch, _S)
    half = int(_D * p.width) // 2
    angles = (torch.rand(*tokens, half, generator=g, dtype=torch.float64) * 2 - 1) * 3.0
    cos, sin = _table(layout, angles.cos()).to(dc), _table(layout, angles.sin()).to(dc)
    if p.grad_angles:
        cos.requires_grad_(True)
        sin.requires_grad_(True)
    position_ids = torch.randperm(_S, generator=g)[None].expand(p.table_batch, _S)
    if kind == "x":
        k = None
    return (q, k, cos, sin, None if kind == "vision" else p.unsqueeze_dim), position_ids


def _adapted_probe(kind: str, layout: str, index: int) -> tuple:
    """A probe of an adapted kind, in the HF function's parameter order, made from the "x" / "qk"
    probe of the same index: gptj (x (B, S, H, D), sin, cos); x_bcast (x, cos, sin) with the
    head dim in the tables; prefix (q, k, cos, sin), (B, H, S, D) q / k and (S - 1, D) tables;
    complex_flat (query, key, freqs_ci), freqs_ci (S, 1, D/2) from the "complex" probe's (B, S, D/2)
    (as given when B > 1: the HF function then fails its view, and ropekit must decline too)."""
    if kind == "complex_flat":
        q, k, freqs, _, _ = probe_inputs("complex", "complex", index)[0]
        return q, k, (freqs[0].unsqueeze(1) if freqs.shape[0] == 1 else freqs)
    if kind == "pairs_2d":
        return _pairs_2d_probe(layout, index)
    q, k, cos, sin, ud = probe_inputs("qk" if kind == "prefix" else "x", layout, index)[0]
    if kind == "gptj":
        return (q.transpose(1, 2) if ud == 1 else q), sin, cos
    if kind == "x_bcast":
        return q, cos.unsqueeze(ud), sin.unsqueeze(ud)
    if ud == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q, k, cos[0, 1:], sin[0, 1:]  # one prefix token


def _pairs_2d_probe(layout: str, index: int, keys: Optional[int] = None) -> tuple:
    """(q, k, cos, sin, num_k_exclude_rope, repeat_freqs_k) from the "qk" probe of the same index:
    (B, H, S, D) q / k and its first batch's table as (1, S, D); keys of their own length by
    `keys` (default: the index): the last key excluded (2), keys twice as many with the table tiled
    (3), and keys twice as many with no tiling, which HF's broadcast refuses (4); else as many as q."""
    keys = index if keys is None else keys
    q, k, cos, sin, ud = probe_inputs("qk", layout, index)[0]
    if ud == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = cos[:1], sin[:1]
    if keys == 2:
        return q, torch.cat((k, k[..., :1, :]), dim=-2), cos, sin, 1, False
    if keys in (3, 4):
        return q, torch.cat((k, k), dim=-2), cos, sin, 0, keys == 3
    return q, k, cos, sin, 0, False


def _call_original(fn, names, args, position_ids):
    if hf_forms.SIGNATURES[names] in hf_forms.ADAPTED:
        return fn(*args)
    q, k, cos, sin, ud = args
    if hf_forms.SIGNATURES[names] == "complex":
        return fn(q, k, cos)
    if hf_forms.SIGNATURES[names] == "x":
        return fn(q, cos, sin, ud)
    if hf_forms.SIGNATURES[names] == "vision":
        return fn(q, k, cos, sin)
    if "position_ids" in names:
        return fn(q, k, cos, sin, position_ids, ud)
    return fn(q, k, cos, sin, ud)


_OUTPUTS: Dict[Tuple[str, int], object] = {}


def _form_output(form: hf_forms.Form, index: int, planned):
    """The form's output on probe `index` (computed once per process: the inputs are fixed)."""
    key = (form.name, index)
    if key not in _OUTPUTS:
        args, _ = probe_inputs(form.kind, form.table, index)
        with torch.no_grad(), _cpu_path():
            if form.kind in hf_forms.ADAPTED:
                _OUTPUTS[key] = planned  # computed by `_plan`
            else:
                _OUTPUTS[key] = hf_forms.execute(form, planned, args[0], args[1])
    return _OUTPUTS[key]


@contextlib.contextmanager
def _cpu_path():
    """The probes are CPU tensors: run them on ropekit's CPU path (ropekit.core.cpu, the kernel's
    math in PyTorch, held equal to it by tests/torch_path/test_cpu_path.py) even under TRITON_INTERPRET=1,
    where each interpreted launch would cost about half a second."""
    before = os.environ.get("TRITON_INTERPRET")
    if before is None:
        yield
        return
    os.environ.pop("TRITON_INTERPRET")
    try:
        yield
    finally:
        os.environ["TRITON_INTERPRET"] = before


def _plan(form: hf_forms.Form, args):
    """hf_forms.plan of a probe; for an adapted kind its output (`call` plans and runs in one)."""
    if form.kind not in hf_forms.ADAPTED:
        return hf_forms.plan(form, *args)
    with _cpu_path():  # grad mode as the call's: angles that require grad are declined
        return hf_forms.call(form, args)


def _same(got, want) -> bool:
    if isinstance(want, (tuple, list)):
        return isinstance(got, (tuple, list)) and len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    if not isinstance(want, torch.Tensor):
        return got is None and want is None
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    w, d = want.detach().double(), (got.detach().double() - want.detach().double())
    return bool(d.norm() <= _TOL.get(want.dtype, 1e-5) * w.norm().clamp_min(1e-30))


def _takes(form: hf_forms.Form, fn, names) -> Optional[int]:
    """How many probes the form takes when it matches fn on all of them, else None. HF's function
    runs first; ropekit's output is computed only where both answer."""
    taken = 0
    for index in range(len(PROBES)):
        args, position_ids = probe_inputs(form.kind, form.table, index)
        planned = _plan(form, args)
        if planned is None and index == 0:
            return None
        try:
            with torch.no_grad():
                theirs = _call_original(fn, names, args, position_ids)
        except Exception:  # noqa: BLE001  HF rejects this input: ropekit must not answer it either
            if planned is not None:
                return None
            continue
        if planned is None:
            continue
        if not _same(_form_output(form, index, planned), theirs):
            return None
        taken += 1
    return taken


# function object -> its form, or the reason it has none
_VERDICTS: Dict[object, Union[hf_forms.Form, str]] = {}


def classify(fn) -> Union[hf_forms.Form, str]:
    """The form HF function `fn` computes (the one taking the most probes), or why there is none."""
    if fn in _VERDICTS:
        return _VERDICTS[fn]
    names = hf_forms.signature_of(fn)
    if names is None:
        try:
            shown = str(inspect.signature(fn))
        except (TypeError, ValueError):
            shown = "unreadable"
        verdict: Union[hf_forms.Form, str] = f"signature {shown} is not one ropekit's forms take"
    else:
        kind = hf_forms.SIGNATURES[names]
        scored = [(_takes(f, fn, names), f) for f in hf_forms.FORMS if f.kind == kind]
        scored = [(n, f) for n, f in scored if n is not None]
        if scored:
            verdict = max(scored, key=lambda nf: nf[0])[1]
        else:
            verdict = "computes none of ropekit's forms (checked on random inputs)"
    _VERDICTS[fn] = verdict
    return verdict


_BF16_PROBE = 4  # PROBES' all-bfloat16 probe
# function object -> True (eager roundings), False (ropekit's one rounding), None (neither)
_ROUNDINGS: Dict[object, Optional[bool]] = {}


def rounding(form: hf_forms.Form, fn) -> Optional[bool]:
    """Which rounding reproduces HF function fn's bfloat16 output bit for bit on the all-bfloat16
    probe (its form's kind and tables): True, eager PyTorch's (fn rotates op by op in the inputs'
    dtype, as `q * cos + rotate_half(q) * sin`); False, ropekit's one rounding from float32 (fn
    computes in float32 and casts once); None when neither does, or the replacement declines the
    probe (the two roundings differ in about a third of the elements, so one of them at most)."""
    if fn in _ROUNDINGS:
        return _ROUNDINGS[fn]
    names = hf_forms.signature_of(fn)
    args, position_ids = probe_inputs(form.kind, form.table, _BF16_PROBE)
    if form.kind == "pairs_2d":  # that probe's keys are the ones HF refuses: keys as many as queries
        args = _pairs_2d_probe(form.table, _BF16_PROBE, keys=0)
    found = None
    try:
        with torch.no_grad(), _cpu_path():
            if _plan(form, args) is not None:  # the replacement takes the probe (else it calls fn)
                theirs = _call_original(fn, names, args, position_ids)
                for eager in (False, True):
                    mine = hf_forms.replacement(fn, form, names, eager=eager)
                    if _identical(_call_original(mine, names, args, position_ids), theirs):
                        found = eager
                        break
    except Exception:  # noqa: BLE001  HF rejects the probe: nothing to match
        found = None
    _ROUNDINGS[fn] = found
    return found


def _identical(got, want) -> bool:
    if isinstance(want, (tuple, list)):
        return isinstance(got, (tuple, list)) and len(got) == len(want) and all(map(_identical, got, want))
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)) or got.dtype != want.dtype:
        return False
    return got.shape == want.shape and torch.equal(got, want)


def verdict(module_name: str, fn) -> Union[hf_forms.Form, str]:
    """classify(fn) for HF function fn of that module, with the table-layout condition of pair-table forms."""
    if not callable(fn):
        return "not a function"
    form = classify(fn)
    if isinstance(form, hf_forms.Form) and form.table == "pairs" and not builds_pair_tables(module_name):
        return f"computes form {form.name!r} for pair tables, but the module does not visibly build pair tables"
    return form


def global_names(code) -> set:
    """The global names a code object reads, its comprehensions' and nested functions' included."""
    if code is None:
        return set()
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= global_names(const)
    return names


THROUGH = "its rotations run ropekit's kernel"  # a left function whose rotations are replaced calls


def left_reason(entry: Entry, reason: str, fn, originals: Dict[str, object]) -> str:
    """Why HF function fn of entry's module is left (reason), and, when it calls rotary functions
    of its module that ropekit replaces (read off its code; their verdict is a form), that its
    rotations still run ropekit's kernel once they are replaced: Gemma 4's
    apply_multidimensional_rope calls apply_rotary_pos_emb on each part of the head.
    originals: {name: HF's function} of the entry's names."""
    called = global_names(getattr(fn, "__code__", None))
    through = [
        n
        for n, original in originals.items()
        if n in called and original is not fn and isinstance(verdict(entry.module, original), hf_forms.Form)
    ]
    if not through:
        return reason
    return f"{reason}; it calls {', '.join(through)}, which ropekit replaces: {THROUGH}"


def entries(model=None, families=None) -> List[Entry]:
    """scan(), narrowed to the modules of the model's submodules and / or to families."""
    found = list(scan())
    if model is not None:
        used = {type(m).__module__ for m in model.modules()}
        found = [e for e in found if e.module in used]
    if families is not None:
        found = [e for e in found if e.family in families]
    return found


def load(entry: Entry):
    """The imported module, or the reason it cannot be imported."""
    try:
        return importlib.import_module(entry.module)
    except Exception as e:  # noqa: BLE001  an optional dependency of that model is missing
        return f"import failed: {type(e).__name__}: {e}"
