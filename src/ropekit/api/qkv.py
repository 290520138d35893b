"""The QKV projection whose GEMM epilogue rotates: rope_qkv_projection.

    q, k, v = rope_qkv_projection(x, weight, positions, cos_sin_cache, num_q_heads=..., ...)

is `y = x @ weight^T` split into q, k and v heads, q and k RMS-normalized per head (optional) and
rotated by their token's position, in one Triton GEMM (kernels/qkv_gemm.py) whose epilogue does
the norm and the rotation on the float32 accumulator; or, unfused, torch.nn.functional.linear
(cuBLAS) then ropekit.apply_rope. `impl="auto"` picks one by `AUTO_TABLE`, keyed by the device
kind and the shape class, which benchmarks/qkv_gemm.py fills; docs/qkv.md.

The backward of the fused path is the projection's (dx = dy @ W, dW = dy^T @ x, by torch.matmul)
after the rotation's: without a norm, ropekit.apply_rope(inverse=True) on the q and k gradients,
written into dy directly; with one, apply_rope's own norm backward step (one launch per tensor)
on the q and k heads before the norm, which the forward kernel saved.

With k_cache / v_cache / slot_mapping the call is the paged-cache write (inference only): the
epilogue stores k and v heads into their slot rows and q alone is returned; unfused, the
projection then ropekit.apply_rope_and_store. Under torch.compile (and for tensor subclasses and
meta tensors) the fused path is the custom ops defined below, each beside its fake:
ropekit::qkv_rope (autograd through ropekit::qkv_rope_backward) and ropekit::qkv_rope_store.
"""

from __future__ import annotations

import inspect
from typing import List, Optional

import torch
import torch.nn.functional as F

from ..core import checks, pipeline, run
from ..core.aliasing import has_internal_overlap, may_alias, written_vs_read
from ..core.args import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    INDEX_DTYPES,
    NUMBERS,
    TABLE_DTYPES,
    addresses_known,
    dtype_name,
    fail,
    tensor,
)
from ..core.memo import lookup, remember
from ..core.strict import is_strict, positions_in_range, slots_in_range, slots_unique
from ..core.variant import CUSTOM_OP, arg_key
from .ops import apply_rope
from .store import apply_rope_and_store

OP = "rope_qkv_projection"
IMPLS = ("auto", "fused", "unfused")

# impl="auto": (device kind, shape class) -> "fused" or "unfused". A key not here is "unfused".
# device kind: `device_kind(x.device)`, e.g. "H100"; shape class: `shape_class(...)`, e.g.
# (4096, 32, 8, 128, "norm", "train", 16384). Filled from benchmarks/qkv_gemm.py's "auto_table"
# (measured on the device kind it names); CPU tensors are always unfused under "auto".
AUTO_TABLE: dict = {}

_TOKEN_CLASSES = (4096, 8192, 16384, 32768)


def device_kind(device: torch.device) -> str:
    """The auto table's device key: "cpu", or the CUDA card's model as its name gives it ("H100",
    "H200", "A100", ...; the whole name when no known model is in it)."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    for model in ("H100", "H200", "H20", "GH200", "B200", "GB200", "A100", "L40S", "L4"):
        if model in name.split() or f" {model} " in f" {name} " or name.endswith(model):
            return model
    return name


def shape_class(tokens: int, hidden: int, n_q: int, n_kv: int, head_dim: int, normed: bool, train: bool) -> tuple:
    """The auto table's shape key: the projection's sizes, "norm"/"plain", "train"/"infer", and the
    token count rounded down to one of 4096, 8192, 16384, 32768 (0 below 4096)."""
    bucket = max((c for c in _TOKEN_CLASSES if tokens >= c), default=0)
    return (hidden, n_q, n_kv, head_dim, "norm" if normed else "plain", "train" if train else "infer", bucket)


def rope_qkv_projection(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: Optional[int] = None,
    interleaved: bool = False,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    impl: str = "auto",
    k_cache: Optional[torch.Tensor] = None,
    v_cache: Optional[torch.Tensor] = None,
    slot_mapping: Optional[torch.Tensor] = None,
):
    """The QKV projection with RoPE (and optionally per-head q/k RMSNorm) in its epilogue.

    Args:
        x: (*T, hidden) fp16/bf16/fp32 hidden states, *T = (T,) or (B, S); any strides.
        weight: (N, hidden), N = (num_q_heads + 2 * num_kv_heads) * head_dim, x's dtype and device:
            torch.nn.Linear's weight layout (out_features, in_features), rows [q heads | k heads |
            v heads] (a fused qkv_proj; torch.cat of separate q/k/v weights along dim 0). Any strides.
        positions: (*T) int32/int64, each token's row of the table; None means arange over the last
            token dim.
        cos_sin_cache: (max_position, rotary_dim) rows [cos | sin] as ropekit.cos_sin_cache builds
            them; fp32 recommended, bf16/fp16 accepted; last stride 1.
        num_q_heads, num_kv_heads, head_dim: Hq, Hk, D (GQA: Hk < Hq).
        rotary_dim: dims [0, rotary_dim) of each q/k head rotated, the rest kept; default (and must
            equal) the table's width; even, at most head_dim.
        interleaved: False rotates halves (i, i + rotary_dim/2) (Llama/NeoX); True pairs (2i, 2i+1).
        q_norm_weight, k_norm_weight: (head_dim,) float weights of a per-head RMSNorm applied to q /
            k before the rotation (Qwen3's q_norm / k_norm): y * rsqrt(mean(y^2) + norm_eps) * w
            over the whole head, in float32. Either may be given alone.
        norm_eps: the RMSNorm's epsilon.
        impl: "fused" (the Triton GEMM; CUDA, or CPU tensors under TRITON_INTERPRET=1), "unfused"
            (torch.nn.functional.linear + ropekit.apply_rope), or "auto": the fused kernel on CUDA
            for the (device kind, shape class) entries of ropekit.api.qkv.AUTO_TABLE that say so,
            unfused otherwise (always on CPU).
        k_cache, v_cache, slot_mapping: the paged-cache write (all three, or none), inference only:
            rotated (normed) k and v are written straight into the cache rows slot_mapping names
            instead of being returned, as ropekit.apply_rope_and_store writes them (docs/store.md).
            Caches (num_blocks, block_size, Hk, D) paged or (num_slots, Hk, D) flat, x's dtype, on
            x's device, any strides with last stride 1 (HND as `cache.permute(0, 2, 1, 3)`), not
            overlapping each other or an input; slot_mapping (*T) int32/int64, slot = block *
            block_size + offset, < 0 for padding (nothing stored). A slot >= num_slots stores
            nothing and makes that token's rotated q dims NaN; under ropekit.strict() it raises,
            as do duplicate slots. Refused while autograd records the call. Unfused: the
            projection then ropekit.apply_rope_and_store (q rotated in place in the projection).

    Returns (q, k, v): (*T, Hq, D), (*T, Hk, D), (*T, Hk, D) in x's dtype, last stride 1 (views
    of one (*T, Hq + 2 Hk, D) buffer on the fused path; q and k new tensors and v a view of the
    projection on the unfused one). Math in float32 (fp32 accumulation; fp32 inputs in IEEE
    float32). A position outside [0, max_position) gives NaN in that token's rotated q/k dims;
    under ropekit.strict() it raises ValueError first. Differentiable in x, weight and the norm
    weights. With k_cache: q alone, (*T, Hq, D) (k and v are in the caches).

    Example::

        cache = ropekit.cos_sin_cache(128, 8192, base=500000.0, device="cuda")
        qkv = torch.nn.Linear(4096, (32 + 2 * 8) * 128, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        positions = torch.arange(4096, device="cuda")
        q, k, v = ropekit.rope_qkv_projection(
            x, qkv.weight, positions, cache, num_q_heads=32, num_kv_heads=8, head_dim=128
        )   # q (4096, 32, 128), k and v (4096, 8, 128)

        # serving: k and v straight into a paged cache (16-token blocks), q returned
        k_cache = torch.zeros(1024, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        with torch.no_grad():
            q = ropekit.rope_qkv_projection(
                x, qkv.weight, positions, cache, num_q_heads=32, num_kv_heads=8, head_dim=128,
                k_cache=k_cache, v_cache=v_cache, slot_mapping=positions,
            )   # q (4096, 32, 128); token t's k and v in block t // 16, row t % 16
    """
    rot = _check(
        x, weight, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, rotary_dim,
        interleaved, q_norm_weight, k_norm_weight, norm_eps, impl,
    )  # fmt: skip
    cached = _check_kv_cache(x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight,
                             k_cache, v_cache, slot_mapping, num_kv_heads, head_dim)  # fmt: skip
    if is_strict() and positions is not None and positions.numel():
        positions_in_range(OP, positions, cos_sin_cache.shape[0])
    if cached and is_strict() and slot_mapping.numel():
        slots_in_range(OP, slot_mapping, _num_slots(k_cache))
        slots_unique(OP, slot_mapping)
    fused = fused_path(impl, x, weight, q_norm_weight, k_norm_weight, num_q_heads, num_kv_heads, head_dim)
    shape = (num_q_heads, num_kv_heads, head_dim, rot, bool(interleaved), float(norm_eps))
    if cached:
        return _project_and_store(
            fused, x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, k_cache, v_cache,
            slot_mapping, shape,
        )  # fmt: skip
    return project(fused, x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, shape)


def project(fused: bool, x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, shape: tuple):
    """rope_qkv_projection's (q, k, v) after its argument checks, for a caller that checked the
    layout once and each call's tensors itself (ropekit.hf.fuse_qkv): fused as `fused_path` decides,
    shape (num_q_heads, num_kv_heads, head_dim, rotary_dim, interleaved, norm_eps)."""
    num_q_heads, num_kv_heads, head_dim, rot, interleaved, norm_eps = shape
    splits = (num_q_heads, num_kv_heads, num_kv_heads)
    tokens = tuple(x.shape[:-1])
    if not fused:
        y = F.linear(x, weight).unflatten(-1, (sum(splits), head_dim))
        q, k, v = y.split(splits, dim=-2)
        q, k = apply_rope(
            q, k, positions, cos_sin_cache, interleaved=interleaved, rotary_dim=rot,
            q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps,
        )  # fmt: skip
        return q, k, v
    x2 = x.reshape(-1, x.shape[-1])
    if positions is None:
        positions = torch.arange(tokens[-1], device=x.device).expand(tokens)
    pos = positions.reshape(-1)
    grad = checks.records_grad(x, weight, q_norm_weight, k_norm_weight)
    if torch.compiler.is_compiling() or checks.door_for(x, grad) == CUSTOM_OP:
        # traced (torch.compile) or a tensor subclass / meta tensor: the custom op and its fake
        normed = q_norm_weight is not None or k_norm_weight is not None
        sizes = [num_q_heads, num_kv_heads, head_dim, rot, int(bool(interleaved))]
        out = torch.ops.ropekit.qkv_rope(
            x2, weight, pos, cos_sin_cache, q_norm_weight, k_norm_weight, sizes, float(norm_eps), grad and normed
        )[0]
    elif grad:
        out = QKVRopeFunction.apply(x2, weight, pos, cos_sin_cache, q_norm_weight, k_norm_weight, shape)
    else:
        out = _forward(x2, weight, pos, cos_sin_cache, q_norm_weight, k_norm_weight, shape, save_pre=False)[0]
    q, k, v = out.unflatten(0, tokens).split(splits, dim=-2)
    return q, k, v


def _project_and_store(fused, x, weight, positions, table, wq, wk, k_cache, v_cache, slots, shape):
    """The paged-cache write: q (*T, Hq, D) returned, k and v into their slot rows. Unfused: the
    projection, then apply_rope_and_store (q rotated in place in the projection's buffer)."""
    n_q, n_kv, d, rot, interleaved, eps = shape
    tokens = tuple(x.shape[:-1])
    if not fused:
        y = F.linear(x, weight).unflatten(-1, (n_q + 2 * n_kv, d))
        q, k, v = y.split((n_q, n_kv, n_kv), dim=-2)
        return apply_rope_and_store(
            q, k, v, positions, table, k_cache, v_cache, slots, interleaved=interleaved, rotary_dim=rot,
            q_norm_weight=wq, k_norm_weight=wk, norm_eps=eps,
        )  # fmt: skip
    x2 = x.reshape(-1, x.shape[-1])
    if positions is None:
        positions = torch.arange(tokens[-1], device=x.device).expand(tokens)
    pos, slots = positions.reshape(-1), slots.reshape(-1)
    if torch.compiler.is_compiling() or checks.door_for(x, False) == CUSTOM_OP:
        sizes = [n_q, n_kv, d, rot, int(interleaved)]
        out = torch.ops.ropekit.qkv_rope_store(x2, weight, pos, table, wq, wk, k_cache, v_cache, slots, sizes, eps)
    else:
        out = _forward(x2, weight, pos, table, wq, wk, shape, False, (k_cache, v_cache, slots))[0]
    return out.unflatten(0, tokens)


def _num_slots(cache) -> int:
    return cache.shape[0] * cache.shape[1] if cache.dim() == 4 else cache.shape[0]


def fused_path(impl, x, weight, wq, wk, n_q, n_kv, head_dim) -> bool:
    """Does this call take the fused kernel? impl as given; "auto" by AUTO_TABLE (CUDA only)."""
    if impl == "unfused":
        return False
    if impl == "fused":
        if not checks.triton_runs(x):
            fail(OP, "impl", "'auto' or 'unfused' for CPU tensors (the fused kernel runs on CUDA)", "'fused'")
        return True
    if not x.is_cuda or not AUTO_TABLE:
        return False
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    train = checks.records_grad(x, weight, wq, wk)
    key = (
        device_kind(x.device),
        shape_class(tokens, x.shape[-1], n_q, n_kv, head_dim, wq is not None or wk is not None, train),
    )
    return AUTO_TABLE.get(key) == "fused"


def _forward(x, weight, pos, cache, wq, wk, shape, save_pre: bool, kv=None):
    """One launch: (out (T, Hq + 2 Hk, D), pre (T, Hq + Hk, D) or None); with kv (k_cache,
    v_cache, slot_mapping (T,)): out (T, Hq, D), k and v into the caches."""
    n_q, n_kv, d, rot, interleaved, eps = shape
    T = x.shape[0]
    out = run.empty_like(x.new_empty((T, n_q if kv else n_q + 2 * n_kv, d)))
    pre = run.empty_like(x.new_empty((T, n_q + n_kv, d))) if save_pre else None
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):  # launch on the tensors' device, not the current one
            _launch(x, weight, pos, cache, out, pre, wq, wk, shape, kv)
    else:
        _launch(x, weight, pos, cache, out, pre, wq, wk, shape, kv)
    return out, pre


def _launch(x, weight, pos, cache, out, pre, wq, wk, shape, kv=None) -> None:
    # imported on first use: `import ropekit` loads no Triton kernel, so TRITON_INTERPRET set after
    # the import (the self-check's --interpreter, a test's conftest) still decides how they run
    from ..kernels.qkv_gemm import qkv_rope_gemm

    n_q, n_kv, d, rot, interleaved, eps = shape
    k_cache, v_cache, slots = kv if kv else (None, None, None)
    qkv_rope_gemm(
        x, weight, pos, cache, out, pre, n_q_heads=n_q, n_k_heads=n_kv, head_dim=d, rotary_dim=rot,
        interleaved=interleaved, q_norm_weight=wq, k_norm_weight=wk, eps=eps,
        k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
    )  # fmt: skip


class QKVRopeFunction(torch.autograd.Function):
    """The fused path under autograd: out = rope(norm(x @ W^T)) as (T, Hq + 2 Hk, D)."""

    @staticmethod
    def forward(ctx, x, weight, pos, cache, wq, wk, shape):
        normed = wq is not None or wk is not None
        out, pre = _forward(x, weight, pos, cache, wq, wk, shape, save_pre=normed)
        ctx.shape = shape
        ctx.save_for_backward(x, weight, pos, cache, wq, wk, pre)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, weight, pos, cache, wq, wk, pre = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, dw, dwq, dwk = _backward(g, x, weight, pos, cache, wq, wk, pre, ctx.shape, needs[:2] + needs[4:6])
        return dx, dw, None, None, dwq, dwk, None


def _backward(g, x, weight, pos, cache, wq, wk, pre, shape, needs):
    """(dx, dw, d wq, d wk) from the output's gradient g (T, Hq + 2 Hk, D), None where needs (x,
    weight, wq, wk) says no: the rotation's (and norm's) backward into dy, then the projection's."""
    n_q, n_kv, d, rot, interleaved, eps = shape
    g = run.unit_last_stride(g)
    gq, gk, gv = g.split((n_q, n_kv, n_kv), dim=1)
    dy = torch.empty(g.shape, dtype=x.dtype, device=x.device)
    dq, dk, dv = dy.split((n_q, n_kv, n_kv), dim=1)
    dv.copy_(gv)
    dwq = dwk = None
    if pre is None:  # the inverse rotation, straight into dy
        apply_rope(gq, gk, pos, cache, interleaved=interleaved, rotary_dim=rot, inverse=True, q_out=dq, k_out=dk)
    else:
        dwq, dwk = _norm_backward(pre, gq, gk, pos, cache, wq, wk, shape, needs[2], needs[3], dq, dk)
    dy2 = dy.view(dy.shape[0], dy.shape[1] * dy.shape[2])
    dx = dy2 @ weight if needs[0] else None
    dw = dy2.t() @ x if needs[1] else None
    return dx, dw, dwq, dwk


def _norm_backward(pre, gq, gk, pos, cache, wq, wk, shape, need_wq, need_wk, dq, dk):
    """The gradients of norm-then-rotate from the saved q and k heads before the norm: dq and dk
    written, (d wq, d wk) returned (None where not wanted). apply_rope's own backward step
    (ropekit.core.pipeline.run_norm_backward: one launch per tensor, the rms recomputed in it), under the
    spec apply_rope's checks give the same call (memoized by the call's layout)."""
    n_q, n_kv, d, rot, interleaved, eps = shape
    pq, pk = pre[:, :n_q], pre[:, n_q:]
    spec = _rope_spec(pq, pk, pos, cache, wq, wk, rot, interleaved, eps)
    v = spec.variant
    dws = []
    for x, g, w, mode, dst, need in ((pq, gq, wq, v.norm_q, dq, need_wq), (pk, gk, wk, v.norm_k, dk, need_wk)):
        gx, dw = pipeline.run_norm_backward(spec, v, x, g, w, mode, pos, cache)
        dst.copy_(gx)
        dws.append(dw if need and dw is not None else None)
    return dws[0], dws[1]


_ROPE_DEFAULTS = {n: p.default for n, p in inspect.signature(apply_rope).parameters.items()}


def _rope_spec(q, k, pos, cache, wq, wk, rot, interleaved, eps):
    """apply_rope's Spec for rotating (q, k) with these norm weights (validated by its checks)."""
    key = ("rope_qkv_projection norm backward", rot, interleaved, eps, *map(arg_key, (q, k, pos, cache, wq, wk)))
    spec = lookup(key)
    if spec is None:
        args = dict(_ROPE_DEFAULTS, q=q, k=k, positions=pos, cos_sin_cache=cache, interleaved=interleaved)
        args.update(rotary_dim=rot, q_norm_weight=wq, k_norm_weight=wk, norm_eps=eps)
        spec = remember(key, checks.rope(args))
    return spec


# ---------------------------------------------------------------------------------------------
# the custom ops: what torch.compile traces (and tensor subclasses / meta tensors dispatch) on the
# fused path, each beside its fake. They live here, not in ropekit.core.dispatch with the other
# ops: their bodies are this module's launch and backward (which call apply_rope), and the core
# layer imports nothing of the api one. sizes: [Hq, Hk, D, rotary_dim, interleaved].


def _shape(sizes, eps) -> tuple:
    n_q, n_kv, d, rot, interleaved = sizes
    return (n_q, n_kv, d, rot, bool(interleaved), float(eps))


@torch.library.custom_op("ropekit::qkv_rope", mutates_args=())
def _qkv_rope_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: Optional[torch.Tensor],
    k_norm_weight: Optional[torch.Tensor],
    sizes: List[int],
    norm_eps: float,
    save_pre: bool,
) -> List[torch.Tensor]:
    """[out (T, Hq + 2 Hk, D)] or, with save_pre, [out, pre (T, Hq + Hk, D)]: x (T, hidden)."""
    shape = _shape(sizes, norm_eps)
    out, pre = _forward(x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, shape, save_pre)
    return [out] if pre is None else [out, pre]


@_qkv_rope_op.register_fake
def _(x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, sizes, norm_eps, save_pre):
    n_q, n_kv, d = sizes[:3]
    out = x.new_empty((x.shape[0], n_q + 2 * n_kv, d))
    return [out, x.new_empty((x.shape[0], n_q + n_kv, d))] if save_pre else [out]


def _setup_qkv_rope(ctx, inputs, output):
    x, weight, pos, cache, wq, wk, sizes, eps, save_pre = inputs
    ctx.sizes, ctx.eps = sizes, eps
    ctx.save_for_backward(x, weight, pos, cache, wq, wk, output[1] if save_pre else None)


def _qkv_rope_backward(ctx, grads):
    x, weight, pos, cache, wq, wk, pre = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0], n[1], wq is not None and n[4], wk is not None and n[5]]
    g = grads[0] if grads[0] is not None else x.new_zeros((x.shape[0], ctx.sizes[0] + 2 * ctx.sizes[1], ctx.sizes[2]))
    got = torch.ops.ropekit.qkv_rope_backward(g, x, weight, pos, cache, wq, wk, pre, ctx.sizes, ctx.eps, needs)
    dx, dw, dwq, dwk = (t if need else None for t, need in zip(got, needs))
    return dx, dw, None, None, dwq, dwk, None, None, None


_qkv_rope_op.register_autograd(_qkv_rope_backward, setup_context=_setup_qkv_rope)


@torch.library.custom_op("ropekit::qkv_rope_backward", mutates_args=())
def _qkv_rope_backward_op(
    g: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: Optional[torch.Tensor],
    k_norm_weight: Optional[torch.Tensor],
    pre: Optional[torch.Tensor],
    sizes: List[int],
    norm_eps: float,
    needs: List[bool],
) -> List[torch.Tensor]:
    """[dx, dw, d q_norm_weight, d k_norm_weight]; one that needs says False (or an absent norm
    weight's) is an empty tensor. Not itself differentiable (as QKVRopeFunction's backward)."""
    shape = _shape(sizes, norm_eps)
    grads = _backward(g, x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, pre, shape, needs)
    return [t if t is not None else x.new_empty(0) for t in grads]


@_qkv_rope_backward_op.register_fake
def _(g, x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, pre, sizes, norm_eps, needs):
    like = (x, weight, q_norm_weight, k_norm_weight)
    return [torch.empty_like(t) if need and t is not None else x.new_empty(0) for t, need in zip(like, needs)]


@torch.library.custom_op("ropekit::qkv_rope_store", mutates_args=("k_cache", "v_cache"))
def _qkv_rope_store_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: Optional[torch.Tensor],
    k_norm_weight: Optional[torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    sizes: List[int],
    norm_eps: float,
) -> torch.Tensor:
    """The paged-cache write: q (T, Hq, D) returned, k and v written into their slot rows."""
    _cache_aliasing(x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping)
    shape = _shape(sizes, norm_eps)
    kv = (k_cache, v_cache, slot_mapping)
    return _forward(x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, shape, False, kv)[0]


@_qkv_rope_store_op.register_fake
def _(x, weight, positions, cos_sin_cache, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping, sizes, eps):
    return x.new_empty((x.shape[0], sizes[0], sizes[2]))


def _check_kv_cache(x, weight, positions, table, wq, wk, k_cache, v_cache, slots, n_kv, d) -> bool:
    """The paged-cache write's checks (shapes, dtypes, devices, addresses: no sync); True when the
    call writes the caches."""
    given = (("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slots))
    if all(t is None for _, t in given):
        return False
    for name, t in given:
        if t is None:
            fail(
                OP,
                name,
                "a tensor when k_cache, v_cache or slot_mapping is given (the cache write takes all three)",
                "None",
            )
    if checks.records_grad(x, weight, wq, wk, k_cache, v_cache):
        fail(
            OP,
            "k_cache",
            "a call autograd does not record (the paged-cache write is inference only: torch.no_grad(), "
            "or inputs that do not require grad)",
            "x, weight, a norm weight or a cache requiring grad with grad mode on",
        )
    for name, c in given[:2]:
        tensor(
            OP,
            name,
            c,
            ndims=(3, 4),
            dtypes=CACHE_DTYPES,
            shape_hint="(num_blocks, block_size, Hk, D) or (num_slots, Hk, D)",
        )
        _on(name, c, x.device)
        if c.dtype != x.dtype:
            fail(OP, name, f"dtype {dtype_name(x.dtype)} (x's: the write casts nothing)", dtype_name(c.dtype))
        if c.shape[-2] != n_kv or c.shape[-1] != d:
            fail(OP, name, f"(heads, head size) ({n_kv}, {d}) (num_kv_heads, head_dim)", f"shape {tuple(c.shape)}")
        if has_internal_overlap(c):
            fail(
                OP,
                name,
                "a tensor without broadcast (stride 0) or overlapping dims (it is written)",
                f"strides {tuple(c.stride())}",
            )
    if v_cache.shape[:-2] != k_cache.shape[:-2]:
        fail(OP, "v_cache", f"slot dims {tuple(k_cache.shape[:-2])}, those of k_cache", f"shape {tuple(v_cache.shape)}")
    tokens = tuple(x.shape[:-1])
    tensor(OP, "slot_mapping", slots, ndims=(x.dim() - 1,), dtypes=INDEX_DTYPES, last_stride_one=False,
           shape_hint=lambda: f"of x's token shape {tokens}")  # fmt: skip
    _on("slot_mapping", slots, x.device)
    if slots.shape != x.shape[:-1]:
        fail(OP, "slot_mapping", f"shape {tokens} (x's token dims)", f"shape {tuple(slots.shape)}")
    _cache_aliasing(x, weight, positions, table, wq, wk, k_cache, v_cache, slots)
    return True


def _cache_aliasing(x, weight, positions, table, wq, wk, k_cache, v_cache, slots) -> None:
    """The caches disjoint from each other and from every input: at the call, and (data pointers
    being unknown while tracing) again inside ropekit::qkv_rope_store when it runs."""
    if not (addresses_known(k_cache) and addresses_known(v_cache)):
        return
    if may_alias(k_cache, v_cache):
        fail(OP, "v_cache", "memory disjoint from k_cache (both are written)", "a tensor overlapping k_cache")
    read = (("x", x), ("weight", weight), ("positions", positions), ("cos_sin_cache", table))
    read += (("q_norm_weight", wq), ("k_norm_weight", wk), ("slot_mapping", slots))
    written_vs_read(OP, (("k_cache", k_cache), ("v_cache", v_cache)), read)


def _on(name, t, device) -> None:
    if t.device != device:
        fail(OP, name, f"a tensor on {device} (x's device)", f"one on {t.device}")


def _check(x, weight, positions, cache, n_q, n_kv, head_dim, rotary_dim, interleaved, wq, wk, eps, impl) -> int:
    """Every argument check (shapes, dtypes and devices only: no sync); returns the rotary dim."""
    if not isinstance(impl, str) or impl not in IMPLS:
        fail(OP, "impl", "one of 'auto', 'fused', 'unfused'", repr(impl))
    for name, n in (("num_q_heads", n_q), ("num_kv_heads", n_kv), ("head_dim", head_dim)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            fail(OP, name, "an int >= 1", repr(n))
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int)):
        fail(OP, "rotary_dim", "an int or None", repr(rotary_dim))
    if not isinstance(interleaved, bool):
        raise TypeError(f"{OP}: interleaved: expected a bool, got {type(interleaved).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, NUMBERS) or not eps >= 0:
        fail(OP, "norm_eps", "a number >= 0", repr(eps))
    tensor(OP, "x", x, ndims=(2, 3), dtypes=FLOAT_DTYPES, shape_hint="(*T, hidden)", last_stride_one=False)
    device, hidden = x.device, x.shape[-1]
    n_out = (n_q + 2 * n_kv) * head_dim
    tensor(OP, "weight", weight, ndims=(2,), dtypes=FLOAT_DTYPES, last_stride_one=False)
    _on("weight", weight, device)
    if weight.dtype != x.dtype:
        fail(OP, "weight", f"dtype {dtype_name(x.dtype)} (x's)", dtype_name(weight.dtype))
    if tuple(weight.shape) != (n_out, hidden):
        expected = f"shape ({n_out}, {hidden}): ((num_q_heads + 2 * num_kv_heads) * head_dim, hidden)"
        fail(OP, "weight", expected + ", nn.Linear's layout", f"shape {tuple(weight.shape)}")
    tokens = tuple(x.shape[:-1])
    if positions is not None:
        # hints are functions, formatted only when raising: under torch.compile the sizes may be
        # symbolic, and a traced f-string of one breaks the graph
        hint = lambda: f"of x's token shape {tokens}"  # noqa: E731
        tensor(
            OP,
            "positions",
            positions,
            ndims=(x.dim() - 1,),
            dtypes=INDEX_DTYPES,
            shape_hint=hint,
            last_stride_one=False,
        )
        _on("positions", positions, device)
        if tuple(positions.shape) != tokens:
            fail(OP, "positions", f"shape {tokens} (x's token dims)", f"shape {tuple(positions.shape)}")
    tensor(OP, "cos_sin_cache", cache, ndims=(2,), dtypes=TABLE_DTYPES, shape_hint="(max_position, rotary_dim)")
    _on("cos_sin_cache", cache, device)
    rot = cache.shape[-1] if rotary_dim is None else rotary_dim
    if rot < 2 or rot % 2 or rot > head_dim:
        fail(OP, "rotary_dim", f"an even int in [2, head_dim={head_dim}]", rot)
    if cache.shape[-1] != rot:
        fail(OP, "cos_sin_cache", f"width {rot} (rotary_dim): rows [cos | sin]", f"shape {tuple(cache.shape)}")
    for name, w in (("q_norm_weight", wq), ("k_norm_weight", wk)):
        if w is not None:
            tensor(OP, name, w, ndims=(1,), dtypes=FLOAT_DTYPES, shape_hint=lambda: f"({head_dim},)")
            _on(name, w, device)
            if w.shape[0] != head_dim:
                fail(OP, name, f"shape ({head_dim},) (head_dim)", f"shape {tuple(w.shape)}")
    return rot
