"""torch.compile with changing shapes: every op under fullgraph=True, in three dynamic modes.

Modes: "auto" (torch's automatic dynamic shapes: the first call specializes, the second shape
recompiles with symbolic sizes), "dynamic" (`dynamic=True`: symbolic from the first call) and
"marked" (`torch._dynamo.mark_dynamic` on the token dims of every input). After the warm-up calls
(two shapes in "auto", one in the others) `torch._dynamo.config.error_on_recompile` is set and two
more shapes run: a recompile fails the test, as does a graph break (fullgraph=True). Every result,
and in the "grad" cases every gradient, is compared with the same op run eagerly. The backend is
aot_eager: Dynamo and AOT autograd trace the checks, the fakes and the backward exactly as Inductor
would see them (a few Inductor cases are in test_compile.py).
"""

import pytest
import torch

import ropekit

from conftest import make_cache

pytest.importorskip("torch._dynamo")

H, HK, D, MAXPOS = 2, 1, 16, 64
SIZES = (6, 10, 12)  # token counts (none equal to another dim: duck sizing would tie them): warm-up first


def _qk(t, *, grad, lead=()):
    q = torch.randn(*lead, t, H, D, requires_grad=grad)
    k = torch.randn(*lead, t, HK, D, requires_grad=grad)
    return q, k


# Each case: make(t, grad) -> (args tuple on the CPU, dims to mark dynamic per arg (None = none)), and
# fn(*args) -> outputs; fn reads its tables from _on(device) (made once per device, outside the compiled region).
_TABLES = {}


def _on(device):
    device = torch.empty(0, device=device).device  # "cuda" and "cuda:0" are one key
    if device not in _TABLES:
        gen = torch.Generator().manual_seed(0)
        _TABLES[device] = {
            "cache": make_cache(MAXPOS, D, device=device),
            "half_cache": make_cache(MAXPOS, D // 2, device=device),
            "w": (torch.rand(D, generator=gen) + 0.5).to(device),
            "inv_freq": ropekit.axial_inv_freq((8, 8), device=device),
            "module": ropekit.RotaryEmbedding(D, D, MAXPOS, 10000.0, True, dtype=torch.float32, device=device),
        }
    return _TABLES[device]


def _plain(t, grad):
    q, k = _qk(t, grad=grad)
    return (q, k, torch.randint(0, MAXPOS, (t,))), (0, 0, 0)


def _batched(t, grad):
    q, k = _qk(t, grad=grad, lead=(2,))
    return (q, k, torch.randint(0, MAXPOS, (2, t))), (1, 1, 1)


def _mrope(t, grad):
    q, k = _qk(t, grad=grad)
    return (q, k, torch.randint(0, MAXPOS, (3, t))), (0, 0, 1)


def _mrope_rows(n):
    """M-RoPE positions of n rows (mrope_section of n sections)."""

    def make(t, grad):
        q, k = _qk(t, grad=grad)
        return (q, k, torch.randint(0, MAXPOS, (n, t))), (0, 0, 1)

    return make


def _packed(t, grad):
    q, k = _qk(t, grad=grad)
    return (q, k, torch.tensor([0, t // 2, t], dtype=torch.int32)), (0, 0, None)


def _axes(t, grad):
    q, k = _qk(t, grad=grad)
    return (q, k, torch.rand(2, t) * 10), (0, 0, 1)


def _bhsd(t, grad):
    q = torch.randn(1, t, H, D).transpose(1, 2).requires_grad_(grad)
    k = torch.randn(1, t, HK, D).transpose(1, 2).requires_grad_(grad)
    return (q, k, torch.arange(t)[None]), (2, 2, 1)


def _sbhd(t, grad):
    q = torch.randn(t, 2, H, D, requires_grad=grad)
    k = torch.randn(t, 2, HK, D, requires_grad=grad)
    return (q, k, torch.randint(0, MAXPOS, (t, 2))), (0, 0, 0)


def _strided(t, grad):
    """q and k whose last dim has stride 2 (read through one contiguous copy)."""
    q = torch.randn(t, H, 2 * D)[..., ::2].requires_grad_(grad)
    k = torch.randn(t, HK, 2 * D)[..., ::2].requires_grad_(grad)
    return (q, k, torch.randint(0, MAXPOS, (t,))), (0, 0, 0)


def _destinations(t, grad):
    q, k = _qk(t, grad=False)
    q_out = torch.full((t, H, 2 * D), float("nan"))[..., D // 2 : D // 2 + D]  # a strided destination
    k_out = torch.full((t, HK, D), float("nan"))
    return (q, k, torch.randint(0, MAXPOS, (t,)), q_out, k_out), (0, 0, 0, 0, 0)


def _parts(t, grad):
    """q and k as rope halves with their no-rope halves given apart (q_nope / k_nope)."""
    q, k = _qk(t, grad=grad)
    q_nope = torch.randn(t, H, D // 2, requires_grad=grad)
    k_nope = torch.randn(t, HK, D // 2, requires_grad=grad)
    return (q[..., : D // 2], q_nope, k[..., : D // 2], k_nope, torch.randint(0, MAXPOS, (t,))), (0, 0, 0, 0, 0)


def _parts_fn(q, q_nope, k, k_nope, p, **kw):
    return ropekit.apply_rope(q, k, p, _on(q.device)["half_cache"], q_nope=q_nope, k_nope=k_nope, **kw)


def _angles(t, grad):
    q, k = _qk(t, grad=grad)
    ang = torch.rand(t, D // 2) * 6
    return (q, k, ang.cos(), ang.sin()), (0, 0, 0, 0)


def _cis(t, grad):
    q, k = _qk(t, grad=grad)
    return (q, k, torch.polar(torch.ones(t, D // 2), torch.rand(t, D // 2) * 6)), (0, 0, 0)


def _norm(q, k, p, k_norm=True, **kw):
    w = _on(q.device)["w"]
    return ropekit.apply_rope(
        q, k, p, _on(q.device)["cache"], q_norm_weight=w, k_norm_weight=w if k_norm else None, **kw
    )


ROTATIONS = {
    "plain": (_plain, lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"])),
    "k_none": (_plain, lambda q, k, p: ropekit.apply_rope(q, None, p, _on(q.device)["cache"])),
    "interleaved_partial": (
        _plain,
        lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["half_cache"], interleaved=True, rotary_dim=D // 2),
    ),
    "arange": (_plain, lambda q, k, p: ropekit.apply_rope(q, k, None, _on(q.device)["cache"])),
    "batched": (_batched, lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"])),
    "mrope": (_mrope, lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"], mrope_section=(2, 3, 3))),
    "mrope_n4_ernie": (
        _mrope_rows(4),
        lambda q, k, p: ropekit.apply_rope(
            q, k, p, _on(q.device)["cache"], mrope_section=(2, 2, 2, 2), mrope_layout="ernie"
        ),
    ),
    "mrope_n2_map": (
        _mrope_rows(2),
        lambda q, k, p: ropekit.apply_rope(
            q, k, p, _on(q.device)["cache"], mrope_section=(4, 4), mrope_layout=(1, 0, 0, 1, 1, 0, 0, 1)
        ),
    ),
    "mrope_n3_pangu_norm": (_mrope, lambda q, k, p: _norm(q, k, p, mrope_section=(4, 2, 2), mrope_layout="pangu")),
    "inverse": (_plain, lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"], inverse=True)),
    "norm": (_plain, lambda q, k, p: _norm(q, k, p)),
    "norm_eps": (
        _plain,
        lambda q, k, p: _norm(q, k, p, k_norm=False, norm_eps=1e-5, norm_weight_offset=1.0),
    ),
    "packed": (_packed, lambda q, k, cu: ropekit.apply_rope(q, k, None, _on(q.device)["cache"], cu_seqlens=cu)),
    "axes": (_axes, lambda q, k, p: ropekit.apply_rope(q, k, p, None, inv_freq=_on(q.device)["inv_freq"], axes=(4, 4))),
    "bhsd": (_bhsd, lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"], layout="bhsd")),
    "sbhd": (_sbhd, lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"], layout="sbhd")),
    "sbhd_arange": (_sbhd, lambda q, k, p: ropekit.apply_rope(q, k, None, _on(q.device)["cache"], layout="sbhd")),
    "strided": (_strided, lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"])),
    "strided_norm": (
        _strided,
        lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"], q_norm_weight=_on(q.device)["w"]),
    ),
    "rope_last": (
        _plain,
        lambda q, k, p: ropekit.apply_rope(
            q, k, p, _on(q.device)["half_cache"], rotary_dim=D // 2, rotary_position="last"
        ),
    ),
    "parts": (_parts, _parts_fn),
    "parts_last": (_parts, lambda *a: _parts_fn(*a, rotary_position="last")),
    "halves": (
        _plain,
        lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["half_cache"], rotary_position="halves"),
    ),
    "halves_norm": (
        _plain,
        lambda q, k, p: ropekit.apply_rope(
            q, k, p, _on(q.device)["half_cache"], q_norm_weight=_on(q.device)["w"], rotary_position="halves"
        ),
    ),
    "angles": (_angles, lambda q, k, c, s: ropekit.rotate_with_angles(q, k, c, s)),
    "freqs_cis": (_cis, lambda q, k, fc: ropekit.rotate_with_angles(q, k, freqs_cis=fc)),
}
BLOCKS, BLOCK = 4, 8  # a paged cache of 32 slots


def _store(t, grad):
    q, k = _qk(t, grad=False)
    v = torch.randn(t, HK, D)
    k_cache = torch.full((BLOCKS, BLOCK, HK, D), float("nan"))
    v_cache = torch.full((BLOCKS, BLOCK, HK, D), float("nan"))
    slots = torch.randperm(BLOCKS * BLOCK)[:t]
    return (q, k, v, torch.randint(0, MAXPOS, (t,)), k_cache, v_cache, slots), (0, 0, 0, 0, None, None, 0)


def _store_fn(q, k, v, p, k_cache, v_cache, slots):
    ropekit.apply_rope_and_store(q, k, v, p, _on(q.device)["cache"], k_cache, v_cache, slots)
    return q, k_cache, v_cache


def _store_mrope(t, grad):
    args, dims = _store(t, grad)
    return args[:3] + (torch.randint(0, MAXPOS, (4, t)),) + args[4:], dims[:3] + (1,) + dims[4:]


def _store_mrope_fn(q, k, v, p, k_cache, v_cache, slots):
    cache = _on(q.device)["cache"]
    ropekit.apply_rope_and_store(
        q, k, v, p, cache, k_cache, v_cache, slots, mrope_section=(1, 2, 2, 3), mrope_layout="pangu"
    )
    return q, k_cache, v_cache


def _store_mla(t, grad):
    """FlashInfer's 3-D paged MLA cache (num_blocks, block_size, L + R), one kv head."""
    q, k = _qk(t, grad=False)
    latent = torch.randn(t, 1, 2 * D)
    mla = torch.full((BLOCKS, BLOCK, 3 * D), float("nan"))
    slots = torch.randperm(BLOCKS * BLOCK)[:t]
    return (q, k[:, :1], latent, torch.randint(0, MAXPOS, (t,)), mla, slots), (0, 0, 0, 0, None, 0)


def _store_mla_fn(q, k, latent, p, mla, slots):
    ropekit.apply_rope_and_store(q, k, None, p, _on(q.device)["cache"], mla, None, slots, k_nope=latent)
    return q, mla


def _store_parts(t, grad):
    """Heads in two parts (FlashInfer's rope / no-rope inputs): q and k the rope halves, q_nope into
    q_out after rotated q, k_nope beside v into the k cache rows after rotated k."""
    q, k = _qk(t, grad=False)
    q_nope, k_nope = torch.randn(t, H, D // 2), torch.randn(t, HK, D // 2)
    v = torch.randn(t, HK, D)
    k_cache = torch.full((BLOCKS, BLOCK, HK, D), float("nan"))
    v_cache = torch.full((BLOCKS, BLOCK, HK, D), float("nan"))
    q_out = torch.full((t, H, D), float("nan"))
    slots = torch.randperm(BLOCKS * BLOCK)[:t]
    args = (q[..., : D // 2], q_nope, k[..., : D // 2], k_nope, v, torch.randint(0, MAXPOS, (t,)))
    return args + (k_cache, v_cache, q_out, slots), (0, 0, 0, 0, 0, 0, None, None, 0, 0)


def _store_parts_fn(q, q_nope, k, k_nope, v, p, k_cache, v_cache, q_out, slots):
    cache = _on(q.device)["half_cache"]
    ropekit.apply_rope_and_store(
        q, k, v, p, cache, k_cache, v_cache, slots, q_out=q_out, q_scale=0.5, q_nope=q_nope, k_nope=k_nope
    )
    return q_out, k_cache, v_cache


def _store_split_k_fn(q, q_nope, k, k_nope, v, p, k_cache, v_cache, q_out, slots):
    ropekit.apply_rope_and_store(q, k, v, p, _on(q.device)["half_cache"], k_cache, v_cache, slots, k_nope=k_nope)
    return q, k_cache, v_cache


def _rerotate(t, grad):
    k_cache = torch.randn(BLOCKS, BLOCK, HK, D)
    return (k_cache, torch.randperm(BLOCKS * BLOCK)[:t], torch.randint(-MAXPOS + 1, MAXPOS, (t,))), (None, 0, 0)


def _rerotate_fn(k_cache, slots, delta):
    ropekit.rerotate_kv_cache(k_cache, slots, delta, _on(k_cache.device)["cache"])
    return k_cache


def _store_halves_fn(q, k, v, p, k_cache, v_cache, slots):
    table = _on(q.device)["half_cache"]
    ropekit.apply_rope_and_store(q, k, v, p, table, k_cache, v_cache, slots, rotary_position="halves")
    return q, k_cache, v_cache


def _rerotate_halves_fn(k_cache, slots, delta):
    ropekit.rerotate_kv_cache(k_cache, slots, delta, _on(k_cache.device)["half_cache"], rotary_position="halves")
    return k_cache


def _module(t, grad):
    q, k = _qk(t, grad=False)
    return (torch.randint(0, MAXPOS, (t,)), q.flatten(1), k.flatten(1)), (0, 0, 0)


NO_GRAD_ONLY = {
    "fp8": (
        _plain,
        lambda q, k, p: ropekit.apply_rope(
            q, k, p, _on(q.device)["cache"], out_dtype=torch.float8_e4m3fn, q_scale=0.5, k_scale=2.0
        ),
    ),
    "inplace": (_plain, lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"], inplace=True)),
    "inplace_strided": (_strided, lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"], inplace=True)),
    "inplace_sbhd": (
        _sbhd,
        lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["cache"], layout="sbhd", inplace=True),
    ),
    "inplace_rope_last": (
        _plain,
        lambda q, k, p: ropekit.apply_rope(q, k, p, _on(q.device)["half_cache"], rotary_position="last", inplace=True),
    ),
    "destinations": (
        _destinations,
        lambda q, k, p, qo, ko: ropekit.apply_rope(q, k, p, _on(q.device)["cache"], q_out=qo, k_out=ko),
    ),
    "destinations_rope_last": (
        _destinations,
        lambda q, k, p, qo, ko: ropekit.apply_rope(
            q, k, p, _on(q.device)["half_cache"], q_out=qo, k_out=ko, rotary_position="last"
        ),
    ),
    "fp8_rope_last": (
        _plain,
        lambda q, k, p: ropekit.apply_rope(
            q, k, p, _on(q.device)["half_cache"], out_dtype=torch.float8_e4m3fn, q_scale=0.5, rotary_position="last"
        ),
    ),
    "inplace_halves": (
        _plain,
        lambda q, k, p: ropekit.apply_rope(
            q, k, p, _on(q.device)["half_cache"], rotary_position="halves", inplace=True
        ),
    ),
    "store_halves": (_store, _store_halves_fn),
    "rerotate_halves": (_rerotate, _rerotate_halves_fn),
    "store_mla_3d": (_store_mla, _store_mla_fn),
    "store": (_store, _store_fn),
    "store_mrope_n4": (_store_mrope, _store_mrope_fn),
    "parts_fp8": (_parts, lambda *a: _parts_fn(*a, out_dtype=torch.float8_e4m3fn, q_scale=0.5, k_scale=2.0)),
    "store_parts": (_store_parts, _store_parts_fn),
    "store_split_k": (_store_parts, _store_split_k_fn),
    "rerotate": (_rerotate, _rerotate_fn),
    "module": (_module, lambda p, q, k: _on(q.device)["module"](p, q, k)),
}


def _to(a, device):
    if not isinstance(a, torch.Tensor):
        return a
    return a.detach().to(device).requires_grad_(a.requires_grad)


def _run_compiled(fn, make, mode, grad, compare, device="cpu"):
    torch._dynamo.reset()
    _on(device)
    kwargs = {"dynamic": True} if mode == "dynamic" else {}
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", **kwargs)
    warm = 2 if mode == "auto" else 1
    for i, t in enumerate(SIZES):
        torch.manual_seed(t)
        args, dims = make(t, grad)
        args = tuple(_to(a, device) for a in args)
        eager_args = [a.detach().clone().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in args]
        if mode == "marked":
            for a, d in zip(args, dims):
                if d is not None:
                    torch._dynamo.mark_dynamic(a, d)
        with torch._dynamo.config.patch(error_on_recompile=i >= warm):
            got = compiled(*args)
        want = fn(*eager_args)
        compare(got, want, args, eager_args, grad)


def _outputs(x):
    return [o for o in (x if isinstance(x, (tuple, list)) else (x,)) if isinstance(o, torch.Tensor)]


def _compare(got, want, args, eager_args, grad):
    got, want = _outputs(got), _outputs(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-5, atol=1e-5, equal_nan=True)
    if grad:
        ups = [torch.randn(w.shape, device=w.device) for w in want]
        sum(((g.float() * u).sum() for g, u in zip(got, ups))).backward()
        sum(((w.float() * u).sum() for w, u in zip(want, ups))).backward()
        for a, e in zip(args, eager_args):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                torch.testing.assert_close(a.grad, e.grad, rtol=1e-5, atol=1e-5)


MODES = ("auto", "dynamic", "marked")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grad", (False, True), ids=("eager", "grad"))
@pytest.mark.parametrize("case", sorted(ROTATIONS))
def test_rotation_compiles_over_shapes(case, grad, mode, device):
    make, fn = ROTATIONS[case]
    _run_compiled(fn, make, mode, grad, _compare, device)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(NO_GRAD_ONLY))
def test_inference_forms_compile_over_shapes(case, mode, device):
    make, fn = NO_GRAD_ONLY[case]
    _run_compiled(fn, make, mode, False, _compare, device)


# --- patched Hugging Face models: the same modes over three sequence lengths ---

transformers = pytest.importorskip("transformers")


def _tiny_qwen3():
    cfg = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=MAXPOS,
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fuse", (False, True), ids=("rotation", "fused_qk_norm"))
def test_patched_hf_model_compiles_over_shapes(mode, fuse, device):
    from ropekit import hf

    model = _tiny_qwen3().to(device)
    try:
        hf.patch(model, fuse_qk_norm=fuse)
        compiled = torch.compile(
            lambda ids: model(ids).logits,
            fullgraph=True,
            backend="aot_eager",
            **({"dynamic": True} if mode == "dynamic" else {}),
        )
        torch._dynamo.reset()
        for i, s in enumerate(SIZES):
            ids = torch.randint(0, 64, (1, s), device=device)
            if mode == "marked":
                torch._dynamo.mark_dynamic(ids, 1)
            with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=i >= (2 if mode == "auto" else 1)):
                got = compiled(ids)
            with torch.no_grad():
                want = model(ids).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        hf.unpatch(fuse_qk_norm=True)
        hf.unpatch()
