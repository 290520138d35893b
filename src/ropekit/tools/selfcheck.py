"""python -m ropekit.selfcheck: every public op against the float64 reference, as a table.

Each row of CHECKS runs one op (or one variant of it) on fresh random inputs and compares with
ropekit.tools.reference in float64; the row prints the inputs' dtype and its threshold. A row whose
feature is missing says "not available" (never PASS); a public name of ropekit that no row
covers is a failure. A new op is one more Check in CHECKS.

On a CUDA machine the compiled kernels run, followed by a short speed table (via ropekit.bench
--quick). Without CUDA the checks run the path CPU users get: ropekit.core.cpu's PyTorch ops on CPU
tensors. `--interpreter` checks the Triton kernels instead, run by Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1, set before the kernels load; slow). Exit status 1 if any check fails.

    python -m ropekit.selfcheck [--interpreter] [--no-bench]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, List, NamedTuple, Tuple

import torch


def _wants_interpreter(argv) -> bool:
    """--interpreter on the command line (read before ropekit loads its kernels)."""
    return "--interpreter" in (sys.argv[1:] if argv is None else argv)


if __name__ == "__main__" and _wants_interpreter(None):
    os.environ["TRITON_INTERPRET"] = "1"

import ropekit  # noqa: E402
from ropekit.core import memo  # noqa: E402
from ropekit.tools import reference  # noqa: E402


def _cache(max_position, rotary_dim, device):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    f = torch.arange(max_position, dtype=torch.float64)[:, None] * inv
    return torch.cat((f.cos(), f.sin()), -1).float().to(device)


def _rel(out, ref):
    out = out.double().cpu()
    ref = ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


class Check(NamedTuple):
    """One row of the self-check.

    name: what is checked; dtype: the inputs' dtype as printed; threshold: the largest relative
    error (norm of the difference over norm of the float64 reference) that passes; covers: the
    public names of ropekit it exercises; run(device) returns a list of (output, reference) pairs,
    or raises NotAvailable when the installed ropekit lacks the feature.
    """

    name: str
    dtype: str
    threshold: float
    covers: Tuple[str, ...]
    run: Callable


class NotAvailable(Exception):
    """The feature a row checks is not in this ropekit: reported as 'not available', never a pass."""


BF16, FP32 = 1e-2, 1e-5  # thresholds: one bf16 rounding of the output / float32 math
FP8 = 1e-1  # one e4m3 rounding (3 mantissa bits: up to 1/8 relative when truncated)


def _gen():
    return torch.Generator().manual_seed(0)


def _rnd(g, *shape, dtype=torch.bfloat16, device="cpu"):
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _rope(T, Hq, Hk, D, rot, *, dtype=torch.bfloat16, **kw):
    """apply_rope on (T, H, D) tensors with random positions into a 4096-row table."""

    def run(device):
        g = _gen()
        q, k = _rnd(g, T, Hq, D, dtype=dtype, device=device), _rnd(g, T, Hk, D, dtype=dtype, device=device)
        cache = _cache(4096, rot, device)
        shape = (3, T) if kw.get("mrope_section") else (T,)
        pos = torch.randint(0, 4096, shape, generator=g).to(device)
        rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double(), **kw)
        qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
        return [(qo, rq), (ko, rk)]

    return run


def _in_place(device):
    g = _gen()
    q, k = _rnd(g, 32, 8, 128, device=device), _rnd(g, 32, 2, 128, device=device)
    cache = _cache(4096, 128, device)
    pos = torch.randint(0, 4096, (32,), generator=g).to(device)
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double())
    qo, ko = ropekit.apply_rope(q, k, pos, cache, inplace=True)
    if qo.data_ptr() != q.data_ptr() or ko.data_ptr() != k.data_ptr():
        raise AssertionError("inplace=True returned new tensors")
    return [(q, rq), (k, rk)]


def _hf_layout(device):
    """Two token dims: (B, S, H, D) views of (B, H, S, D) storage, positions None (arange)."""
    g = _gen()
    B, S, H, D = 2, 16, 8, 128
    q = _rnd(g, B, H, S, D, device=device).transpose(1, 2)
    k = _rnd(g, B, 2, S, D, device=device).transpose(1, 2)
    cache = _cache(S, D, device)
    rq, rk = reference.apply_rope(q.double(), k.double(), None, cache.double())
    qo, ko = ropekit.apply_rope(q, k, None, cache, layout="bshd")
    return [(qo, rq), (ko, rk)]


def _mla(device):
    """A strided slice (the last 64 of 192 dims) rotated in place, interleaved (DeepSeek MLA)."""
    g = _gen()
    T = 16
    q = _rnd(g, T, 16, 192, device=device)
    k = _rnd(g, T, 1, 64, device=device)
    cache = _cache(4096, 64, device)
    pos = torch.randint(0, 4096, (T,), generator=g).to(device)
    untouched = q[..., :128].clone()
    rq, rk = reference.apply_rope(q[..., 128:].double(), k.double(), pos, cache.double(), interleaved=True)
    ropekit.apply_rope(q[..., 128:], k, pos, cache, interleaved=True, inplace=True)
    if not torch.equal(q[..., :128], untouched):
        raise AssertionError("dims outside the slice were written")
    return [(q[..., 128:], rq), (k, rk)]


def _store(cache_dtype, scale):
    """apply_rope_and_store into a paged cache (shuffled slots, one padding token): q rotated in
    place, k rotated and v copied into their rows; fp8 caches hold value / scale."""

    def run(device):
        g = _gen()
        T, Hq, Hk, D, blocks, bs = 24, 8, 2, 128, 4, 16
        q, k, v = (_rnd(g, T, h, D, device=device) for h in (Hq, Hk, Hk))
        cache = _cache(4096, D, device)
        pos = torch.randint(0, 4096, (T,), generator=g).to(device)
        slots = torch.randperm(blocks * bs, generator=g)[:T].to(device)
        slots[5] = -1
        kc = torch.full((blocks, bs, Hk, D), float("nan"), device=device).to(cache_dtype)
        vc = torch.full((blocks, bs, Hk, D), float("nan"), device=device).to(cache_dtype)
        rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double())
        ropekit.apply_rope_and_store(q, k, v, pos, cache, kc, vc, slots, k_scale=scale, v_scale=scale)
        keep = slots >= 0
        rows = slots[keep].long()
        got_k, got_v = kc.view(-1, Hk, D)[rows].double(), vc.view(-1, Hk, D)[rows].double()
        # the cache holds value / scale, rounded once to its dtype (compared unrounded: e4m3 keeps 3
        # mantissa bits, and the Triton interpreter truncates where the GPU rounds)
        want_k, want_v = (x / (scale or 1.0) for x in (rk[keep], v[keep].double()))
        return [(q, rq), (got_k, want_k), (got_v, want_v)]

    return run


def _angles(device):
    """rotate_with_angles with HF's per-token cos / sin (halves of the duplicated tensors)."""
    g = _gen()
    B, S, H, D = 2, 16, 4, 64
    q, k = _rnd(g, B, S, H, D, device=device), _rnd(g, B, S, 2, D, device=device)
    ang = torch.rand(B, S, D // 2, generator=g, dtype=torch.float64) * 100
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    rq = reference.rotate(q.double(), ang.cos(), ang.sin())
    rk = reference.rotate(k.double(), ang.cos(), ang.sin())
    qo, ko = ropekit.rotate_with_angles(q, k, cos, sin)
    return [(qo, rq), (ko, rk)]


def _axial(device):
    """apply_rope with angles computed in the kernel: Flux's axial frequencies, (3, T) positions
    (text rows at 0, an image grid), against float64 angles."""
    g = _gen()
    T, H, D = 48, 4, 128
    axes_dim = (16, 56, 56)
    f = ropekit.axial_inv_freq(axes_dim, device=device)
    pos = torch.randint(-64, 64, (3, T), generator=g).to(device)
    q, k = _rnd(g, T, H, D, device=device), _rnd(g, T, 2, D, device=device)
    axes = tuple(d // 2 for d in axes_dim)
    c, s = reference.angles_from_freqs(pos.cpu(), f.cpu(), axes, torch.float64)
    rq = reference.rotate(q.double().cpu(), c, s, interleaved=True)
    rk = reference.rotate(k.double().cpu(), c, s, interleaved=True)
    qo, ko = ropekit.apply_rope(q, k, pos, None, inv_freq=f, axes=axes, interleaved=True)
    return [(qo.cpu(), rq), (ko.cpu(), rk)]


def _backward(device):
    """Gradients through apply_rope (autograd) against the float64 inverse rotation of the
    incoming gradient (a rotation's transpose is its inverse)."""
    g = _gen()
    T, Hq, Hk, D = 32, 8, 2, 128
    q = _rnd(g, T, Hq, D, dtype=torch.float32, device=device).requires_grad_()
    k = _rnd(g, T, Hk, D, dtype=torch.float32, device=device).requires_grad_()
    cache = _cache(4096, D, device)
    pos = torch.randint(0, 4096, (T,), generator=g).to(device)
    gq, gk = (
        _rnd(g, T, Hq, D, dtype=torch.float32, device=device),
        _rnd(g, T, Hk, D, dtype=torch.float32, device=device),
    )
    qo, ko = ropekit.apply_rope(q, k, pos, cache)
    torch.autograd.backward((qo, ko), (gq, gk))
    c, s = reference.angles_from_table(cache.double(), pos, (T,))
    want_q = reference.rotate(gq.double(), c, s, inverse=True)
    want_k = reference.rotate(gk.double(), c, s, inverse=True)
    return [(q.grad, want_q), (k.grad, want_k)]


def _tiny_llama(device, dtype=None, attention=None):
    """(transformers, a tiny random HF Llama on device, in dtype, eval mode), seeded; NotAvailable
    without transformers. attention: the config's attention implementation (None: HF's default)."""
    try:
        import transformers
    except ImportError as e:
        raise NotAvailable(f"transformers not installed ({e}): pip install -e '.[hf]'")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if attention is not None:
        cfg._attn_implementation = attention
    return transformers, transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _hf_llama(device):
    """ropekit.hf drop-ins in a tiny random HF Llama: patched logits against unpatched ones."""
    transformers, model = _tiny_llama(device)
    cfg = model.config
    from ropekit.integrations import hf as ropekit_hf

    ids = torch.randint(0, 128, (2, 24), generator=_gen()).to(device)
    from transformers.models.llama import modeling_llama

    with torch.no_grad():
        want = model(ids).logits.double()
        with ropekit_hf.patched(model) as done:
            drop_in = modeling_llama.apply_rotary_pos_emb
            if not done or not getattr(drop_in, "__module__", "").startswith("ropekit"):
                raise AssertionError(
                    f"ropekit.hf.patched(model) did not patch modeling_llama (transformers "
                    f"{transformers.__version__}): left {done.left}; the supported transformers range "
                    "is in docs/hf.md, pip install -e '.[hf]' installs it"
                )
            calls = []
            modeling_llama.apply_rotary_pos_emb = lambda *a, **kw: calls.append(1) or drop_in(*a, **kw)
            try:
                got = model(ids).logits
            finally:
                modeling_llama.apply_rotary_pos_emb = drop_in
            if len(calls) != cfg.num_hidden_layers:
                raise AssertionError(f"the drop-in ran {len(calls)} times, expected once per layer")
    return [(got, want)]


def _hf_rounding(device):
    """ropekit.hf.patch(model, hf_rounding=True) in a tiny random bf16 HF Llama: the patched logits
    equal the unpatched ones bit for bit (the row's threshold is 0)."""
    _, model = _tiny_llama(device, torch.bfloat16, attention="eager")
    from ropekit.integrations import hf as ropekit_hf

    ids = torch.randint(0, 128, (2, 24), generator=_gen()).to(device)
    with torch.no_grad():
        want = model(ids).logits
        with ropekit_hf.patched(model, hf_rounding=True) as done:
            if done.rounding.get("llama", {}).get("apply_rotary_pos_emb") != "eager":
                raise AssertionError(f"hf_rounding found {done.rounding} for Llama, expected 'eager'")
            got = model(ids).logits
    return [(got, want)]


def _qknorm(device):
    """apply_rope with per-head RMSNorm of q and k (Qwen3) and its weight gradient, against float64
    autograd of the reference (norm, then rotation)."""
    g = _gen()
    T, Hq, Hk, D = 16, 8, 2, 128
    q = _rnd(g, T, Hq, D, dtype=torch.float32, device=device).requires_grad_()
    k = _rnd(g, T, Hk, D, dtype=torch.float32, device=device)
    wq = (1 + 0.2 * _rnd(g, D, dtype=torch.float32)).to(device).requires_grad_()
    wk = (1 + 0.2 * _rnd(g, D, dtype=torch.float32)).to(device)
    cache = _cache(4096, D, device)
    pos = torch.randint(0, 4096, (T,), generator=g).to(device)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, q_norm_weight=wq, k_norm_weight=wk)
    up = _rnd(g, T, Hq, D, dtype=torch.float32, device=device)
    dq, dwq = torch.autograd.grad(qo, (q, wq), up)
    q64, wq64 = q.detach().double().requires_grad_(), wq.detach().double().requires_grad_()
    rq, rk = reference.rms_norm_rope(
        q64, k.double(), pos, cache.double(), q_norm_weight=wq64, k_norm_weight=wk.double()
    )
    want_dq, want_dwq = torch.autograd.grad(rq, (q64, wq64), up.double())
    return [(qo, rq.detach()), (ko, rk), (dq, want_dq), (dwq, want_dwq)]


def _qkv_projection(device):
    """rope_qkv_projection (Qwen3-style: per-head q/k norm, then RoPE) against the float64 projection
    normalized and rotated by the reference; the fused kernel wherever Triton runs, unfused elsewhere."""
    g = _gen()
    T, hidden, Hq, Hk, D = 16, 64, 4, 2, 128
    x = _rnd(g, T, hidden, dtype=torch.float32, device=device)
    w = _rnd(g, (Hq + 2 * Hk) * D, hidden, dtype=torch.float32, device=device) / hidden**0.5
    wq = (1 + 0.2 * _rnd(g, D, dtype=torch.float32)).to(device)
    wk = (1 + 0.2 * _rnd(g, D, dtype=torch.float32)).to(device)
    cache = _cache(4096, D, device)
    pos = torch.randint(0, 4096, (T,), generator=g).to(device)
    fused = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    q, k, v = ropekit.rope_qkv_projection(
        x, w, pos, cache, num_q_heads=Hq, num_kv_heads=Hk, head_dim=D, q_norm_weight=wq, k_norm_weight=wk,
        impl="fused" if fused else "unfused",
    )  # fmt: skip
    y = (x.double() @ w.double().T).unflatten(-1, (Hq + 2 * Hk, D))
    rq, rk = reference.rms_norm_rope(
        y[:, :Hq], y[:, Hq : Hq + Hk], pos, cache.double(), q_norm_weight=wq.double(), k_norm_weight=wk.double()
    )
    return [(q, rq), (k, rk), (v, y[:, Hq + Hk :])]


def _rerotate(device):
    """rerotate_kv_cache: rows of a paged cache stored at p re-rotated by delta (some negative)
    equal keys rotated at p + delta; rows not named stay bit-identical."""
    g = _gen()
    blocks, bs, H, D, n = 4, 16, 2, 128, 20
    cache = _cache(4096, D, device)
    k = _rnd(g, blocks * bs, H, D, dtype=torch.float32)
    pos = torch.randint(1024, 3072, (blocks * bs,), generator=g)
    stored = reference.rotate(k.double(), *reference.angles_from_table(cache.double().cpu(), pos, (blocks * bs,)))
    kc = stored.float().to(device).view(blocks, bs, H, D)
    before = kc.clone()
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    delta = torch.randint(-1000, 1000, (n,), generator=g)
    ropekit.rerotate_kv_cache(kc, slots.to(device), delta.to(device), cache)
    flat, old = kc.view(-1, H, D), before.view(-1, H, D)
    others = torch.ones(blocks * bs, dtype=torch.bool)
    others[slots] = False
    if not torch.equal(flat[others.to(device)], old[others.to(device)]):
        raise AssertionError("rows not named were written")
    want = reference.rotate(
        k[slots].double(), *reference.angles_from_table(cache.double().cpu(), pos[slots] + delta, (n,))
    )
    return [(flat[slots.to(device)], want)]


def _packed(device):
    """apply_rope(cu_seqlens=) on 5 packed sequences (one empty), plain and context-parallel rank 1
    of 2, against the reference at positions_from_cu_seqlens' positions and an independent
    restart-at-0 count."""
    g = _gen()
    lens = [6, 0, 10, 2, 14]
    T, Hq, Hk, D = sum(lens), 4, 2, 64
    q, k = _rnd(g, T, Hq, D, device=device), _rnd(g, T, Hk, D, device=device)
    cache = _cache(256, D, device)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device=device)
    pairs = []
    restart = torch.cat([torch.arange(n) for n in lens])
    if not torch.equal(ropekit.positions_from_cu_seqlens(cu.cpu()), restart):
        raise AssertionError("positions_from_cu_seqlens does not restart at 0 per sequence")
    for cp_size, cp_rank in ((1, 0), (2, 1)):
        pos = ropekit.positions_from_cu_seqlens(cu, cp_size=cp_size, cp_rank=cp_rank)
        rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double())
        qo, ko = ropekit.apply_rope(q, k, None, cache, cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank)
        pairs += [(qo, rq), (ko, rk)]
    return pairs


CHECKS: List[Check] = [
    Check("apply_rope half-split (Llama)", "bf16", BF16, ("apply_rope",), _rope(32, 8, 2, 128, 128)),
    Check(
        "apply_rope interleaved (GPT-J, Llama 4)",
        "bf16",
        BF16,
        ("apply_rope",),
        _rope(32, 8, 2, 128, 128, interleaved=True),
    ),
    Check("apply_rope partial rotary 64/128", "bf16", BF16, ("apply_rope",), _rope(32, 8, 2, 128, 64)),
    Check("apply_rope head size 80, 28 heads", "bf16", BF16, ("apply_rope",), _rope(16, 28, 4, 80, 80)),
    Check("apply_rope fp32", "fp32", FP32, ("apply_rope",), _rope(16, 8, 2, 128, 128, dtype=torch.float32)),
    Check(
        "apply_rope M-RoPE chunked (Qwen2-VL)",
        "bf16",
        BF16,
        ("apply_rope",),
        _rope(16, 4, 2, 128, 128, mrope_section=[16, 24, 24]),
    ),
    Check(
        "apply_rope M-RoPE interleaved (Qwen3-VL)",
        "bf16",
        BF16,
        ("apply_rope",),
        _rope(16, 4, 2, 128, 128, mrope_section=[24, 20, 20], mrope_interleaved=True),
    ),
    Check("apply_rope in place", "bf16", BF16, ("apply_rope",), _in_place),
    Check("apply_rope two token dims, HF (B,S,H,D) views", "bf16", BF16, ("apply_rope",), _hf_layout),
    Check("apply_rope strided MLA slice, in place", "bf16", BF16, ("apply_rope",), _mla),
    Check("apply_rope backward (autograd)", "fp32", FP32, ("apply_rope",), _backward),
    Check("rotate_with_angles (HF cos/sin)", "bf16", BF16, ("rotate_with_angles",), _angles),
    Check("apply_rope axial (Flux axes), angles in the kernel", "bf16", BF16, ("apply_rope", "axial_inv_freq"), _axial),
    Check("apply_rope_and_store, bf16 cache", "bf16", BF16, ("apply_rope_and_store",), _store(torch.bfloat16, None)),
    Check(
        "apply_rope_and_store, fp8 e4m3 cache, scale 0.5",
        "bf16->fp8",
        FP8,
        ("apply_rope_and_store",),
        _store(torch.float8_e4m3fn, 0.5),
    ),
    Check("ropekit.hf drop-ins, tiny Llama logits", "fp32", 1e-4, ("hf",), _hf_llama),
    Check("ropekit.hf hf_rounding, bf16 Llama, bit for bit", "bf16", 0.0, ("hf",), _hf_rounding),
    Check("apply_rope QK-RMSNorm (Qwen3) + grads of q, w", "fp32", 1e-4, ("apply_rope",), _qknorm),
    Check("rope_qkv_projection, q/k norm + RoPE epilogue", "fp32", 1e-5, ("rope_qkv_projection",), _qkv_projection),
    Check("rerotate_kv_cache, paged, +-deltas", "fp32", 1e-5, ("rerotate_kv_cache",), _rerotate),
    Check(
        "apply_rope cu_seqlens packed, cp 1 and 2", "bf16", BF16, ("apply_rope", "positions_from_cu_seqlens"), _packed
    ),
]

# public names that need no row of their own: tables, modules, a mode and a warning class around the checked ops
_NOT_OPS = {"cos_sin_cache", "inv_freq", "RotaryEmbedding", "strict", "LayoutWarning"}


def unchecked_public_names() -> List[str]:
    covered = {name for c in CHECKS for name in c.covers}
    return [n for n in getattr(ropekit, "__all__", []) if n not in covered and n not in _NOT_OPS]


def backend_name(device) -> str:
    if device == "cuda":
        return "triton (CUDA)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton kernels in the interpreter (CPU tensors)"
    return "ropekit.core.cpu: PyTorch ops on CPU tensors (what CPU users run)"


def use_cpu_path(interpreter: bool) -> None:
    """Pick what CPU tensors run: the Triton interpreter, or the pure-PyTorch CPU path (the
    default: TRITON_INTERPRET removed). Specs memoized under the other choice are forgotten."""
    if interpreter:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    memo.clear()


def run_checks(device, checks=None, out=print) -> Tuple[int, int, int]:
    """Run the rows, print one line each. Returns (passed, failed, not available)."""
    checks = CHECKS if checks is None else checks
    unchecked = ["ropekit." + name for name in unchecked_public_names()]
    w = max(len(name) for name in ["check", *(c.name for c in checks), *unchecked])  # the name column
    out(f"{'check':{w}s} {'dtype':9s} {'threshold':>9s} {'rel. error':>10s} {'time':>7s}  result")
    passed = failed = missing = 0
    for c in checks:
        t0 = time.perf_counter()
        detail = ""
        try:
            pairs = c.run(device)
            err = max(_rel(o, r) for o, r in pairs)
            result = "PASS" if err <= c.threshold else "FAIL"  # NaN fails too
        except NotAvailable as e:
            err, result, detail = float("nan"), "not available", str(e)
        except Exception as e:  # a crash is a failed check, reported, not hidden
            err, result, detail = float("nan"), "FAIL", f"{type(e).__name__}: {e}"
        dt = time.perf_counter() - t0
        passed += result == "PASS"
        failed += result == "FAIL"
        missing += result == "not available"
        line = f"{c.name:{w}s} {c.dtype:9s} {c.threshold:9.0e} {err:10.2e} {dt:6.2f}s  {result}"
        out(line + (f"  ({detail})" if detail else ""))
    for name in unchecked:
        failed += 1
        out(f"{name:{w}s} {'-':9s} {'-':>9s} {'-':>10s} {'-':>7s}  FAIL  (public, no row checks it)")
    return passed, failed, missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropekit.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true", help="skip the speed table on CUDA")
    parser.add_argument(
        "--interpreter",
        action="store_true",
        help="without CUDA: check the Triton kernels in Triton's interpreter instead of the CPU path",
    )
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        use_cpu_path(args.interpreter)
    print(f"ropekit {ropekit.__version__} self-check on {device}: {backend_name(device)}; torch {torch.__version__}")
    print("rel. error: norm(output - float64 reference) / norm(reference); a row passes at or below its threshold")
    passed, failed, missing = run_checks(device)
    summary = f"{passed} passed, {failed} failed, {missing} not available"
    print(("all checks passed: " if not failed else "FAILED: ") + summary)
    if device == "cuda" and not args.no_bench and not failed:
        try:
            from ropekit.bench.__main__ import main as bench_main
        except ImportError as e:
            print(f"speed table skipped: {e}")
        else:
            bench_main(["--quick"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
