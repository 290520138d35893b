"""The forms whose HF calls are rewritten onto the kernel's plans (ropekit.integrations.hf_forms.call):
GPT-J's (x, sin, cos), one tensor with tables already broadcast (GPT-OSS's and the Privacy Filter's
helpers, MusicFlamingo's 3-D time embedding), DINOv3's prefix tokens, NanoChat's reversed
rotate_half, DeepSeek-V4's trailing rope dims, DeepSeek-V2's complex (B, H, S, D) call, Llama 4
vision's complex freqs_ci of one row per token.

Each patched function is compared with HF's own on float64 copies of fresh random inputs (the
reference), in float32 and bf16, with a spy showing that the kernel path ran; inputs it must
decline give HF's result and launch nothing.
"""

import importlib
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from ropekit import hf  # noqa: E402
from ropekit.api import ops  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


pytestmark = pytest.mark.usefixtures("hf_unpatched")  # transformers unpatched around every test


def _patched(family, name):
    report = hf.patch(families=[family])
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    fn = getattr(module, name)
    assert name in report[family], (report, report.left)
    return fn, fn.ropekit_original


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _angles(*shape, pairs=False, halves=False):
    a = (torch.rand(*shape, dtype=torch.float64) * 2 - 1) * 3
    if pairs:
        a = a.repeat_interleave(2, dim=-1)
    if halves:
        a = torch.cat((a, a), dim=-1)
    return a.cos().float(), a.sin().float()


def _check(fn, original, args, dtype, device, calls=True):
    """fn(*args) equals original on float64 copies (tensor args of `dtype` are the q / k / x), on device."""
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    ref = original(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        got = fn(*args)
    assert (spy.call_count > 0) == calls, spy.call_count
    got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
    assert len(got) == len(ref)
    for g, r, x in zip(got, ref, args):
        assert g.shape == r.shape and g.dtype == x.dtype, (g.shape, r.shape, g.dtype, x.dtype)
        assert _rel(g, r) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptj_one_tensor_sin_before_cos(dtype, device):
    fn, original = _patched("gptj", "apply_rotary_pos_emb")
    x = torch.randn(2, 5, 3, 8).to(dtype)  # (B, S, H, D)
    cos, sin = _angles(2, 5, 4)  # (B, S, D/2)
    if dtype is torch.bfloat16:
        cos, sin = cos.to(dtype), sin.to(dtype)
    _check(fn, original, (x, sin, cos), dtype, device)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("family", ["gpt_oss", "openai_privacy_filter"])
def test_one_tensor_with_broadcast_tables(family, heads, device):
    fn, original = _patched(family, "_apply_rotary_emb")
    x = torch.randn(2, 3, 5, 8) if heads == 1 else torch.randn(2, 5, 3, 8)
    cos, sin = _angles(2, 5, 4)
    _check(fn, original, (x, cos.unsqueeze(heads), sin.unsqueeze(heads)), torch.float32, device)
    # tables without a size-1 head dim are not a form of this kind: HF's result, no launch
    full = (-1, 3, -1, -1) if heads == 1 else (-1, -1, 3, -1)
    wide = (cos.unsqueeze(heads).expand(*full), sin.unsqueeze(heads).expand(*full))
    _check(fn, original, (x, *wide), torch.float32, device, calls=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_d_time_embedding_partial_pairs(dtype, device):
    fn, original = _patched("musicflamingo", "apply_rotary_time_emb")
    x = torch.randn(2, 5, 16).to(dtype)  # (B, S, hidden): no head dim
    cos, sin = _angles(2, 5, 4, pairs=True)  # (B, S, 8): a pair table over the first 8 dims
    _check(fn, original, (x, cos, sin), dtype, device)


@pytest.mark.parametrize("family", ["dinov3_vit", "eomt_dinov3", "sapiens2"])
@pytest.mark.parametrize("prefix", [0, 2])
def test_prefix_tokens_pass_through(family, prefix, device):
    fn, original = _patched(family, "apply_rotary_pos_emb")
    q = torch.randn(2, 6, 3, 8).transpose(1, 2)  # (B, H, N, D) views
    k = torch.randn(2, 6, 3, 8).transpose(1, 2)
    cos, sin = _angles(6 - prefix, 4, halves=True)  # (P, D)
    _check(fn, original, (q, k, cos, sin), torch.float32, device)


def test_reversed_rotate_half(device):
    fn, original = _patched("nanochat", "apply_rotary_pos_emb")
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = _angles(2, 5, 4, halves=True)
    _check(fn, original, (q, k, cos, sin), torch.float32, device)


@pytest.mark.parametrize("rope", [8, 16])
def test_trailing_rope_dims(rope, device):
    fn, original = _patched("deepseek_v4", "apply_rotary_pos_emb")
    x = torch.randn(2, 3, 5, 16)
    cos, sin = _angles(2, 5, rope // 2)  # half-sized tables: one entry per pair
    _check(fn, original, (x, cos, sin), torch.float32, device)


def test_complex_heads_first(device):
    fn, original = _patched("deepseek_v2", "apply_rotary_emb")
    q = torch.randn(2, 5, 4, 24)[..., 16:].transpose(1, 2)  # the rope part of (B, H, S, D) views
    k = torch.randn(2, 5, 1, 8).transpose(1, 2)
    angles = (torch.rand(2, 5, 4) * 2 - 1) * 3
    freqs = torch.polar(torch.ones_like(angles), angles)
    q, k, freqs = q.to(device), k.to(device), freqs.to(device)
    ref = original(q.double(), k.double(), freqs.to(torch.complex128))
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        got = fn(q, k, freqs)
    assert spy.call_count == 1
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == torch.float32 and _rel(g, r) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_complex_flat_freqs_per_token(dtype, device):
    """Llama 4 vision: q / k (B, S, H, D), freqs_ci (S, 1, D/2) broadcast over batch and heads;
    outputs in each input's dtype. Declined, with HF's result: freqs that require grad."""
    fn, original = _patched("llama4", "vision_apply_rotary_emb")
    q = torch.randn(2, 5, 4, 16).to(dtype).to(device)
    k = torch.randn(2, 5, 2, 16).to(dtype).to(device)
    angles = (torch.rand(5, 1, 8, dtype=torch.float64) * 2 - 1) * 3
    exact = torch.polar(torch.ones_like(angles), angles)  # complex128: the float64 reference's
    freqs = exact.to(torch.complex64).to(device)

    def reference(x):  # pairs (2i, 2i + 1) times freqs, in complex128
        xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * exact.to(device).reshape(1, x.shape[1], 1, -1)).flatten(3)

    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        got = fn(q, k, freqs)
    assert spy.call_count == 1
    for g, x in zip(got, (q, k)):
        assert g.shape == x.shape and g.dtype == dtype
        assert _rel(g, reference(x)) <= TOL[dtype]
    grad = freqs.clone().requires_grad_(True)
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        got = fn(q, k, grad)
    assert spy.call_count == 0
    want = original(q, k, grad)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("excluded, repeat", [(0, False), (2, False), (2, True)], ids=["plain", "excluded", "tiled"])
def test_pairs_2d_keys_excluded_or_tiled(dtype, excluded, repeat, device):
    """SAM 2 video's 2-D rotation: q / k (B, H, S, D) views, a (1, S, D) pair table; k's last
    `excluded` tokens passed through, and with repeat_freqs_k keys three times q's length rotated
    by the table tiled."""
    fn, original = _patched("sam2_video", "apply_rotary_pos_emb_2d")
    n_q = 6
    n_k = 3 * n_q if repeat else n_q
    q = torch.randn(2, n_q, 4, 16).to(dtype).transpose(1, 2)
    k = torch.randn(2, n_k + excluded, 4, 16).to(dtype).transpose(1, 2)
    cos, sin = _angles(1, n_q, 8, pairs=True)
    _check(fn, original, (q, k, cos, sin, excluded, repeat), dtype, device)


def test_pairs_2d_refuses_as_hf_does(device):
    """Keys longer than the table without tiling: HF's broadcast error, and nothing launched."""
    fn, _ = _patched("sam2_video", "apply_rotary_pos_emb_2d")
    q = torch.randn(1, 4, 6, 16, device=device)
    k = torch.randn(1, 4, 12, 16, device=device)
    cos, sin = (t.to(device) for t in _angles(1, 6, 8, pairs=True))
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        with pytest.raises(RuntimeError):
            fn(q, k, cos, sin, num_k_exclude_rope=0, repeat_freqs_k=False)
    assert spy.call_count == 0


def test_adapted_call_by_position_or_by_name(device):
    """An adapted replacement takes a call that gives every argument by position without binding it
    to the signature, and one by name with the binding: the same kernel result either way (both
    launch), and a call HF would refuse gets HF's own TypeError."""
    fn, original = _patched("gpt_oss", "_apply_rotary_emb")
    x = torch.randn(2, 3, 5, 8, device=device)  # (B, H, S, D)
    cos, sin = (t.to(device)[:, None] for t in _angles(2, 5, 4))  # (B, 1, S, D/2)
    with mock.patch.object(ops, "rotate_angles", wraps=ops.rotate_angles) as spy:
        by_position = fn(x, cos, sin)
        by_name = fn(x, sin=sin, cos=cos)
    assert spy.call_count == 2
    assert torch.equal(by_position, by_name)
    assert _rel(by_position, original(x.double(), cos.double(), sin.double())) <= TOL[torch.float32]
    with pytest.raises(TypeError):
        fn(x, cos, sin, bogus=1)
    with pytest.raises(TypeError):
        original(x, cos, sin, bogus=1)
