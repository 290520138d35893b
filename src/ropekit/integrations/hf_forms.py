"""What Hugging Face's rotary functions compute, as a table of forms ropekit's kernel reproduces.

transformers defines its rotary function anew in every modeling module (~230 of them), in a
couple of dozen distinct bodies. They differ in a few independent choices, so a form is a row of
data, not a function: which tensors it takes (`kind`), how cos / sin lay out the frequencies
(`table`), whether the input and the output pairs are (i, i + R/2) or (2i, 2i + 1), whether a
cos narrower than the head rotates a prefix (`partial`), and the output dtype rule. `run(form, ...)`
returns the form's result through ops.rotate_angles, or None when the call is not one the kernel
reproduces exactly (then the caller runs HF's own function: nothing changes for such inputs).

Which HF function is which form is decided by running both (ropekit.integrations.hf_census); this
module says what each form means, and when the kernel reproduces a call (the plan: heads dim and
rotary width, or None), which ropekit.hf's drop-ins share.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from ..api import ops
from ..core import memo

# ---------------------------------------------------------------------------------------------
# when ropekit's kernel reproduces a Hugging Face rotary call, and how HF's layouts map onto it:
# the drop-ins of ropekit.hf and the forms below share these (a call is planned, heads dim and
# rotary width, or declined, None; a planned call is one ops.rotate_angles)

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# when the kernel applies, and how HF's layouts map onto it


def unsqueeze_dim(position_ids, unsqueeze_dim):
    # transformers 5.x dropped position_ids from the signature: a 5th positional int is unsqueeze_dim
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        return position_ids
    return unsqueeze_dim


def heads_dim(unsqueeze_dim, table_token_rank=3):
    """Where HF's unsqueeze puts the head dim of q for a (*, B, S, D) table: 1 or 2, else None."""
    if not isinstance(unsqueeze_dim, int) or isinstance(unsqueeze_dim, bool):
        return None
    ud = unsqueeze_dim + table_token_rank + 1 if unsqueeze_dim < 0 else unsqueeze_dim
    return ud if ud in (1, 2) else None


def fits(shape, target) -> bool:
    """shape broadcasts to target without growing it."""
    return len(shape) == len(target) and all(s == t or s == 1 for s, t in zip(shape, target))


def kernel_takes(q, k, tables, *, promote_to_q: bool) -> bool:
    """Dtype / device / stride / grad conditions under which ropekit's kernel reproduces HF."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return False
    if q.dim() != 4 or k.dim() != 4 or q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype:
        return False
    t0 = tables[0]
    for t in tables:
        if not isinstance(t, torch.Tensor) or t.dtype != t0.dtype or t.shape != t0.shape:
            return False
        if t.device != q.device:
            return False
        if t.requires_grad and torch.is_grad_enabled():
            return False  # ropekit treats angles as constants: HF's math
    if t0.dtype not in KERNEL_DTYPES or k.device != q.device:
        return False
    if promote_to_q and (
        torch.promote_types(q.dtype, t0.dtype) != q.dtype or torch.promote_types(k.dtype, t0.dtype) != k.dtype
    ):
        return False  # HF's result would be wider than q: keep HF's dtype
    for x in (q, k):
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            return False
    return True


def tokens_first(x, hd):
    return x.transpose(1, 2) if hd == 1 else x


def rotate_hf_layout(
    q, k, cos, sin, hd, *, interleaved, out_interleaved=None, mrope_section=None, columns=None, eager=False
):
    """Rotate HF-layout q/k with ropekit: cos/sin are (…, B, S, ·) tables of which the first
    `columns` columns (None: all) hold the rotary_dim // 2 frequencies. eager: rounded as eager
    PyTorch in q's dtype (ops' eager_rounding)."""
    return ops.rotate_angles(
        q,
        k,
        cos,
        sin,
        interleaved=interleaved,
        out_interleaved=interleaved if out_interleaved is None else out_interleaved,
        mrope_section=mrope_section,
        heads_first=hd == 1,
        columns=columns,
        eager_rounding=eager,
    )


def plain_plan(q, k, cos, sin, unsqueeze_dim, *, promote_to_q, need_full=False):
    """(heads dim, rotary width) when the kernel can take a (B, S, D)-table call, else None;
    remembered per call signature in ropekit's memo in eager mode (a training step asks once per layer)."""
    decide = functools.partial(
        decide_plain_plan, q, k, cos, sin, unsqueeze_dim, promote_to_q=promote_to_q, need_full=need_full
    )
    if torch.compiler.is_compiling():
        return decide()
    try:
        key = (
            "hf plan",
            torch.is_grad_enabled(),
            memo.tensor_key(q),
            memo.tensor_key(k),
            memo.tensor_key(cos),
            memo.tensor_key(sin),
            unsqueeze_dim,
            promote_to_q,
            need_full,
        )
        plan = memo.lookup(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: decide afresh
        return decide()
    if plan is None:
        plan = memo.remember(key, decide() or False)
    return plan or None


def decide_plain_plan(q, k, cos, sin, unsqueeze_dim, *, promote_to_q, need_full):
    if not kernel_takes(q, k, (cos, sin), promote_to_q=promote_to_q) or cos.dim() != 3:
        return None
    hd = heads_dim(unsqueeze_dim)
    if hd is None:
        return None
    qt, kt = tokens_first(q, hd), tokens_first(k, hd)
    tokens = tuple(qt.shape[:2])
    if tuple(kt.shape[:2]) != tokens or not fits(tuple(cos.shape[:2]), tokens):
        return None
    r = cos.shape[-1]
    if r < 2 or r % 2 or r > q.shape[-1] or r > k.shape[-1]:
        return None
    if need_full and not (q.shape[-1] == r and k.shape[-1] == r):
        return None
    return hd, r


class Form(NamedTuple):
    name: str
    kind: str  # "qk": (q, k, cos, sin, unsqueeze_dim) 4-D; "x": one tensor; "vision": 3-D (S, H, D), cos (S, D);
    # "complex": (xq, xk, freqs_cis), q / k (B, S, H, D), complex64 freqs_cis (B or 1, S, D/2);
    # "gptj", "x_bcast", "prefix", "complex_flat", "pairs_2d" (ADAPTED): rewritten onto "x" / "qk" /
    # "complex" by `call`
    table: str  # "repeated": cos rows [f, f] (width R); "pairs": [f0, f0, f1, f1, ...]; "narrow": [f] (width R/2)
    pairs_in: bool  # the input pairs are (2i, 2i + 1); else (i, i + R/2)
    pairs_out: bool  # the output pairs are (2i, 2i + 1)
    partial: bool  # a table narrower than the head rotates dims [0, R) and passes the rest through
    dtype: str  # "promote": HF's type promotion with cos; "own": each output in its input's dtype; "q": both in q's
    what: str  # one line for the docs
    reverse: bool = False  # HF's rotate_half is (x2, -x1): a rotation by -angle, run with sin negated
    rope_last: bool = False  # a table narrower than the head rotates the last dims, not the first


FORMS: Tuple[Form, ...] = (
    Form("llama", "qk", "repeated", False, False, False, "promote", "half-split (Llama)"),
    Form("neox", "qk", "repeated", False, False, True, "promote", "half-split, partial rotary (GPT-NeoX, Phi-3)"),
    # "own" and "q" agree on every call the kernel takes (it takes q and k of one dtype only): OLMo's
    # cast to each input's dtype and ESM / ModernBERT's float32 math cast to q's dtype are one form
    Form("olmo", "qk", "repeated", False, False, False, "own", "half-split, outputs in the inputs' dtype (OLMo, ESM)"),
    Form("glm", "qk", "repeated", True, True, True, "promote", "pairs, partial rotary (GLM)"),
    Form("pairs", "qk", "repeated", True, True, False, "promote", "pairs from a half-split table (Helium)"),
    Form("ernie", "qk", "repeated", True, True, False, "q", "pairs from a half-split table, q's dtype (ERNIE 4.5)"),
    Form("cohere", "qk", "pairs", True, True, False, "q", "pairs, pair table, q's dtype (Cohere)"),
    Form("pairs_table", "qk", "pairs", True, True, False, "promote", "pairs, pair table (BLT)"),
    Form("glm4v", "qk", "pairs", True, True, True, "promote", "pairs, pair table, partial rotary (GLM-4V)"),
    Form("deepseek", "qk", "repeated", True, False, False, "promote", "pairs in, half-split out (DeepSeek-V3)"),
    Form("narrow", "qk", "narrow", False, False, False, "promote", "half-split, table of R/2 columns (GPT-OSS)"),
    Form("gemma4", "x", "repeated", False, False, False, "promote", "half-split, one tensor (Gemma 3n / 4)"),
    Form("vision", "vision", "repeated", False, False, False, "own", "half-split vision tokens (S, H, D)"),
    Form("llama4", "complex", "complex", True, True, False, "own", "pairs times complex freqs_cis (Llama 4)"),
    Form("nanochat", "qk", "repeated", False, False, False, "promote", "half-split by -angle (NanoChat)", reverse=True),
    Form("narrow_pairs", "qk", "narrow", True, True, False, "promote", "pairs, table of R/2 columns (Privacy Filter)"),
    Form(
        "deepseek_v4",
        "x",
        "narrow",
        True,
        True,
        True,
        "own",
        "pairs, table of R/2 columns, the last R dims rotated (DeepSeek-V4)",
        rope_last=True,
    ),
    Form("gptj", "gptj", "narrow", True, True, False, "promote", "pairs, one tensor, (x, sin, cos) (GPT-J)"),
    Form("narrow_x", "x_bcast", "narrow", False, False, False, "promote", "half-split, one tensor, tables as given"),
    Form("narrow_pairs_x", "x_bcast", "narrow", True, True, False, "promote", "pairs, one tensor, tables as given"),
    Form("pairs_x", "x_bcast", "pairs", True, True, True, "own", "pairs, partial, one tensor (MusicFlamingo)"),
    Form("prefix", "prefix", "repeated", False, False, False, "promote", "half-split, prefix tokens passed (DINOv3)"),
    Form("deepseek_v2", "complex", "complex_bhsd", True, True, False, "own", "pairs times freqs_cis, (B, H, S, D)"),
    Form(
        "llama4_vision",
        "complex_flat",
        "complex",
        True,
        True,
        False,
        "own",
        "pairs times complex freqs_ci, one row per token (Llama 4 vision)",
    ),
    Form(
        "pairs_2d",
        "pairs_2d",
        "pairs",
        True,
        True,
        False,
        "own",
        "pairs, pair table, q and k of their own lengths, keys excluded or tiled (SAM 2 video)",
    ),
)
FORM = {f.name: f for f in FORMS}

# the parameter lists of HF functions a form's replacement can stand in for: names -> kind
SIGNATURES: Dict[Tuple[str, ...], str] = {
    ("q", "k", "cos", "sin", "unsqueeze_dim"): "qk",
    ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"): "qk",
    ("x", "cos", "sin", "unsqueeze_dim"): "x",
    ("q", "k", "cos", "sin"): "vision",
    ("xq", "xk", "freqs_cis"): "complex",
    ("tensor", "sin", "cos"): "gptj",  # x (B, S, H, D), tables (B, S, R/2) unsqueezed at dim 2 inside
    ("x", "cos", "sin"): "x_bcast",  # tables already broadcastable to x (a size-1 head dim), or 3-D x and tables
    ("hidden_states", "cos", "sin"): "x_bcast",
    ("q", "k", "cos", "sin", "kwargs"): "prefix",  # q / k (B, H, N, D), tables (P, D) for the last P tokens
    ("query", "key", "freqs_ci"): "complex_flat",  # q / k (B, S, H, D), complex freqs_ci of S * D/2 values
    # q / k (B, H, S, D) of their own lengths, a (1, S, D) table; the last keys passed, or the table tiled
    ("q", "k", "cos", "sin", "num_k_exclude_rope", "repeat_freqs_k"): "pairs_2d",
}
# kinds whose calls are rewritten onto the "x" / "qk" / "complex" kinds' plans (see `call`)
ADAPTED = ("gptj", "x_bcast", "prefix", "complex_flat", "pairs_2d")


def signature_of(fn) -> Optional[Tuple[str, ...]]:
    """The parameter names of fn when they are one of SIGNATURES, all positional-or-keyword; else None."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    names = tuple(p.name for p in params)
    if names not in SIGNATURES:
        return None
    kinds = [p.kind for p in params]
    if names[-1] == "kwargs" and kinds[-1] is inspect.Parameter.VAR_KEYWORD:
        kinds = kinds[:-1]  # **kwargs that the body ignores (DINOv3's)
    if any(kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for kind in kinds):
        return None
    return names


def _vision_takes(q, k, cos, sin) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if q.dim() != 3 or k.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or cos.dtype != sin.dtype:
        return False
    if q.shape[0] != k.shape[0] or tuple(cos.shape) != (q.shape[0], q.shape[-1]) or k.shape[-1] != q.shape[-1]:
        return False
    dtypes = (q.dtype, k.dtype, cos.dtype)
    if any(d not in KERNEL_DTYPES for d in dtypes) or k.dtype != q.dtype or cos.shape[-1] % 2:
        return False
    if any(t.device != q.device for t in (k, cos, sin)) or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    return not ((cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled())


def _complex_plan(xq, xk, freqs_cis, heads_first=False):
    """freqs_cis's real and imaginary parts are cos and sin, read in place (column stride 2);
    heads_first: q / k are (B, H, S, D) and freqs_cis (B or 1, S, D/2) is unsqueezed at dim 1."""
    ok = (
        isinstance(freqs_cis, torch.Tensor)
        and freqs_cis.dtype == torch.complex64
        and freqs_cis.dim() == 3
        and isinstance(xq, torch.Tensor)
        and isinstance(xk, torch.Tensor)
        and xq.dim() == 4
        and xk.dim() == 4
    )
    if not ok:
        return None
    fr = torch.view_as_real(freqs_cis.resolve_conj())
    cos, sin = fr[..., 0], fr[..., 1]
    xqt, xkt = (xq.transpose(1, 2), xk.transpose(1, 2)) if heads_first else (xq, xk)
    tokens = tuple(xqt.shape[:2])
    ok = (
        kernel_takes(xq, xk, (cos, sin), promote_to_q=False)
        and tuple(xkt.shape[:2]) == tokens
        and fits(tuple(freqs_cis.shape[:2]), tokens)
        and xq.shape[-1] == 2 * freqs_cis.shape[-1]
        and xk.shape[-1] == 2 * freqs_cis.shape[-1]
    )
    return (None, cos.shape[-1], cos, sin) if ok else None


def plan(form: Form, q, k, cos, sin, unsqueeze_dim=None, kind=None):
    """How the kernel takes this call of the form: (heads dim, columns, cos, sin), or None when it
    does not reproduce HF's result for it. kind: the call's kind when an adapted call is planned
    as another ("x" / "qk"); None: the form's."""
    kind = kind or form.kind
    if kind == "vision":
        return (None, cos.shape[-1] // 2, cos, sin) if _vision_takes(q, k, cos, sin) else None
    if kind == "complex":
        return _complex_plan(q, k, cos, heads_first=form.table == "complex_bhsd")
    k_checked = q if kind == "x" else k
    if form.dtype == "q" and isinstance(k, torch.Tensor) and isinstance(q, torch.Tensor) and k.dtype != q.dtype:
        return None
    found = plain_plan(
        q,
        k_checked,
        cos,
        sin,
        unsqueeze_dim,
        promote_to_q=form.dtype == "promote",
        need_full=not form.partial and form.table != "narrow",
    )
    if found is None:
        return None
    hd, r = found
    if form.table == "narrow":
        full = 2 * r == q.shape[-1] == k_checked.shape[-1]
        fits = 2 * r <= min(q.shape[-1], k_checked.shape[-1])
        return (hd, r, cos, sin) if full or (form.partial and fits) else None
    if form.table == "pairs":
        return hd, r // 2, cos[..., 0::2], sin[..., 0::2]  # every frequency once (stride-2 views)
    return hd, r // 2, cos, sin


def execute(form: Form, planned, q, k, kind=None, eager=False):
    """Run a planned call: (q_out, k_out), or the output alone for kind "x". eager: rounded as
    eager PyTorch in q's dtype (ops' eager_rounding; hf.patch(hf_rounding=True) where HF's function
    rounds so)."""
    kind = kind or form.kind
    hd, columns, cos, sin = planned
    if kind == "complex":
        hf = form.table == "complex_bhsd"
        return ops.rotate_angles(
            q, k, cos, sin, interleaved=True, columns=columns, heads_first=hf or None, eager_rounding=eager
        )
    if kind == "vision":
        return ops.rotate_angles(q, k, cos, sin, columns=columns, eager_rounding=eager)
    if form.reverse:
        sin = -sin  # a (.., S, R) table, not q / k: R(-angle)
    k = None if kind == "x" else k
    if not form.rope_last:
        out = _rotate(form, hd, columns, cos, sin, q, k, eager)
        return out[0] if kind == "x" else out
    # rotate views of the last 2 * columns dims, pass the rest through
    width = 2 * columns
    rot = _rotate(form, hd, columns, cos, sin, q[..., -width:], None if k is None else k[..., -width:], eager)
    outs = tuple(torch.cat((x[..., :-width], r), dim=-1) for x, r in zip((q, k), rot) if x is not None)
    return outs[0] if kind == "x" else outs


def _rotate(form: Form, hd, columns, cos, sin, q, k, eager):
    return rotate_hf_layout(
        q, k, cos, sin, hd, interleaved=form.pairs_in, out_interleaved=form.pairs_out, columns=columns, eager=eager
    )


def run(form: Form, q, k, cos, sin, unsqueeze_dim=None, kind=None, eager=False):
    """The form's result by ropekit's kernel, or None when the kernel does not reproduce HF's."""
    planned = plan(form, q, k, cos, sin, unsqueeze_dim, kind)
    return None if planned is None else execute(form, planned, q, k, kind, eager)


def call(form: Form, args: tuple, eager: bool = False):
    """The result of an adapted kind's call (`args` in the HF function's parameter order), or None.

    gptj: (x, sin, cos), x (B, S, H, D), tables (B, S, R/2): the "x" kind at unsqueeze_dim 2.
    x_bcast: (x, cos, sin) with the head dim already in the tables (size 1 at dim 1 or 2), or a
        3-D x (B, S, D) with (B, S, R) tables (no heads: run as one head).
    prefix: (q, k, cos, sin), q / k (B, H, N, D), tables (P, D): the last P tokens rotated, the
        N - P prefix tokens (class and register tokens) passed through.
    complex_flat: (query, key, freqs_ci), q / k (B, S, H, D), complex freqs_ci of S * D/2 values
        (Llama 4 vision's (S, 1, D/2), viewed as (1, S, 1, D/2)): the "complex" kind's (1, S, D/2).
    """
    if form.kind == "complex_flat":
        q, k, freqs = args
        if not all(isinstance(t, torch.Tensor) for t in (q, k, freqs)) or q.dim() != 4 or q.shape[-1] % 2:
            return None
        if freqs.numel() != q.shape[1] * q.shape[-1] // 2:
            return None
        return run(form, q, k, freqs.reshape(1, q.shape[1], q.shape[-1] // 2), None, None, "complex", eager=eager)
    if form.kind == "pairs_2d":
        return _pairs_2d(form, *args, eager=eager)
    if form.kind == "gptj":
        x, sin, cos = args
        return run(form, x, None, cos, sin, 2, "x", eager=eager)
    if form.kind == "x_bcast":
        x, cos, sin = args
        if not all(isinstance(t, torch.Tensor) for t in (x, cos, sin)) or cos.dim() != x.dim():
            return None
        if x.dim() == 3:
            out = run(form, x.unsqueeze(2), None, cos, sin, 2, "x", eager=eager)
            return None if out is None else out.squeeze(2)
        heads = [d for d in (1, 2) if x.dim() == 4 and cos.shape[d] == 1 and sin.shape == cos.shape]
        if not heads:
            return None
        return run(form, x, None, cos.squeeze(heads[0]), sin.squeeze(heads[0]), heads[0], "x", eager=eager)
    q, k, cos, sin = args
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)) or cos.dim() != 2 or q.dim() != 4:
        return None
    n, p = q.shape[-2], cos.shape[0]
    if not (0 < p <= n and k.dim() == 4 and k.shape[-2] == n):
        return None
    out = run(form, q[..., n - p :, :], k[..., n - p :, :], cos[None], sin[None], 1, "qk", eager=eager)
    if out is None or p == n:
        return out
    return tuple(torch.cat((x[..., : n - p, :], r), dim=-2) for x, r in zip((q, k), out))


def _pairs_2d(form: Form, q, k, cos, sin, excluded, repeat, eager=False):
    """SAM 2 video's call: q and k (B, H, S, D) rotated apart by the table's rows ((1, S, D) or
    (S, D), pairs), k's last `excluded` tokens passed through, and with `repeat` a table of q's
    length tiled over k's rotated tokens (k_rot's length over q's, rounded down, as HF tiles).
    One launch when k's rotated tokens are as many as q's, else one each."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)) or q.dim() != 4 or k.dim() != 4:
        return None
    if cos.dim() not in (2, 3) or cos.shape != sin.shape or any(n != 1 for n in cos.shape[:-2]):
        return None
    if type(excluded) is not int or not 0 <= excluded < k.shape[-2] or type(repeat) is not bool:
        return None
    cos, sin = cos.reshape(cos.shape[-2:]), sin.reshape(sin.shape[-2:])
    n_q, n_k = q.shape[-2], k.shape[-2] - excluded
    if cos.shape[0] != n_q:
        return None
    cos_k, sin_k = cos, sin
    if repeat and n_k != n_q:
        times = n_k // n_q
        cos_k, sin_k = cos.repeat(times, 1), sin.repeat(times, 1)
    if cos_k.shape[0] != n_k:
        return None  # HF's broadcast fails: its own error
    k_part = k[..., :n_k, :]
    # keys as many as queries on the same rows (self-attention): one launch for both
    out = run(form, q, k_part, cos[None], sin[None], 1, "qk", eager=eager) if n_k == n_q else None
    if out is None:
        q_out = run(form, q, None, cos[None], sin[None], 1, "x", eager=eager)
        k_rot = run(form, k_part, None, cos_k[None], sin_k[None], 1, "x", eager=eager) if q_out is not None else None
        out = None if k_rot is None else (q_out, k_rot)
    if out is None:
        return None
    return (out[0], torch.cat((out[1], k[..., n_k:, :]), dim=-2)) if excluded else out


def _adapted_replacement(original: Callable, form: Form, eager: bool) -> Callable:
    """The replacement of an adapted kind: the original's parameters, bound by name."""
    sig = inspect.signature(original)
    fixed = [p.name for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    # a call giving every parameter by position needs no binding (Signature.bind costs microseconds)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    n_direct = len(fixed) if all(sig.parameters[n].kind in positional for n in fixed) else -1

    def fn(*args, **kwargs):
        if not kwargs and len(args) == n_direct:
            values = args
        else:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)  # HF's own error
            bound.apply_defaults()  # the original's defaults for what the call leaves out
            values = tuple(bound.arguments[n] for n in fixed)
        out = call(form, values, eager)
        return original(*args, **kwargs) if out is None else out

    fn.__signature__ = sig
    return fn


def replacement(
    original: Callable, form: Form, names: Tuple[str, ...], bound: object = None, eager: bool = False
) -> Callable:
    """A function with the original's parameters and defaults that returns the form's result, and
    the original's own where the kernel does not reproduce it (`run` returned None).
    bound: what the modeling module bound (the original, or the kernels hub `Func` module wrapping
    it); kept as `ropekit_original`, what `unpatch` puts back. eager: the rotation rounded as eager
    PyTorch in q's dtype (kept as `ropekit_eager`)."""
    kind = SIGNATURES[names]
    if kind in ADAPTED:
        fn = _adapted_replacement(original, form, eager)
    elif kind == "x":

        def fn(x, cos, sin, unsqueeze_dim=1):
            out = run(form, x, None, cos, sin, unsqueeze_dim, eager=eager)
            return original(x, cos, sin, unsqueeze_dim) if out is None else out

    elif kind == "complex":

        def fn(xq, xk, freqs_cis):
            out = run(form, xq, xk, freqs_cis, None, eager=eager)
            return original(xq, xk, freqs_cis) if out is None else out

    elif kind == "vision":

        def fn(q, k, cos, sin):
            out = run(form, q, k, cos, sin, eager=eager)
            return original(q, k, cos, sin) if out is None else out

    elif "position_ids" in names:

        def fn(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            out = run(form, q, k, cos, sin, unsqueeze_dim, eager=eager)
            return original(q, k, cos, sin, position_ids, unsqueeze_dim) if out is None else out

    else:

        def fn(q, k, cos, sin, unsqueeze_dim=1):
            out = run(form, q, k, cos, sin, unsqueeze_dim, eager=eager)
            return original(q, k, cos, sin, unsqueeze_dim) if out is None else out

    if kind not in ADAPTED:
        fn.__defaults__ = original.__defaults__  # the original's defaults (the names are the same)
    fn.__name__, fn.__qualname__, fn.__doc__ = original.__name__, original.__qualname__, original.__doc__
    fn.ropekit_form = form.name
    fn.ropekit_original = original if bound is None else bound
    fn.ropekit_eager = eager
    return fn
