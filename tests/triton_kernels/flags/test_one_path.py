"""One record, one door: the norm, fp8 outputs, in place and every angle source are flags of the same
ops (docs/core.md, "How a call runs"). Each test compares against the float64 reference on fresh
random inputs, outputs poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

import ropekit
from ropekit.core import checks, packed, pipeline, sharding
from ropekit.core.variant import Variant
from ropekit.tools import reference

from conftest import fp8_close, make_cache

pytestmark = pytest.mark.usefixtures("poison")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _skip(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert not torch.isnan(a).any(), "NaN: an element left unwritten?"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _norm_ref(x, w, offset=0.0):
    return x if w is None else reference.rms_norm(x, w.double().cpu(), eps=1e-6, offset=offset)


def test_the_custom_ops_are_six_and_the_projections_three():
    """The rotations, the store and the re-rotation need six custom ops; the norm, fp8, packed and
    axial paths add none. rope_qkv_projection adds three of its own (forward, backward, the
    paged-cache write: ropekit.api.qkv)."""
    ours = {name for name in dir(torch.ops.ropekit) if not name.startswith("_")}
    ours = {n for n in ours if hasattr(getattr(torch.ops.ropekit, n), "default")}
    assert ours == {
        "rotate",
        "rotate_",
        "rotate_norm_backward",
        "rope_and_store",
        "rope_and_store_q_out",
        "rerotate_kv_cache",
        "qkv_rope",
        "qkv_rope_backward",
        "qkv_rope_store",
    }, ours


def test_variant_encoding_round_trips():
    for v in (
        Variant(),
        Variant(True, False, 2, (4, 6, 6), "table", True, False, True, 1, 2),
        Variant(True, True, 0, (8, 28, 28), "freqs", False, False, False, 2, 0),
        Variant(False, False, 0, (), "packed"),
    ):
        assert Variant.decode(v.encode()) == v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("across", [False, True])
def test_norm_with_packed_positions_in_the_kernel(device, across, monkeypatch):
    """The norm with cu_seqlens: positions derived in the kernel (no host positions per call)."""
    _skip(device)
    g = torch.Generator().manual_seed(5)
    T, Hq, Hk, D = 9, 3, 2, 32
    q = torch.randn(T, Hq, D, generator=g).to(device)
    k = torch.randn(T, Hk, D, generator=g).to(device)
    wq = (torch.rand((Hq * D) if across else D, generator=g) + 0.5).to(device)
    wk = (torch.rand(D, generator=g) + 0.5).to(device)
    cu = torch.tensor([0, 4, 9], device=device)
    cache = make_cache(16, D).to(device)
    if checks.triton_runs(q):  # the kernel derives them: the host helper must not run
        monkeypatch.setattr(packed, "packed_positions", lambda *a: pytest.fail("positions made on the host"))
    qo, ko = ropekit.apply_rope(q, k, None, cache, cu_seqlens=cu, q_norm_weight=wq, k_norm_weight=wk)
    pos = ropekit.positions_from_cu_seqlens(cu.cpu())
    c, s = reference.angles_from_table(cache.double().cpu(), pos, (T,))
    assert _rel(qo, reference.rotate(_norm_ref(q.double().cpu(), wq), c, s)) < 1e-5
    assert _rel(ko, reference.rotate(_norm_ref(k.double().cpu(), wk), c, s)) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_norm_with_fp8_outputs(device):
    """The FP8-attention prologue with the norm: normalized, rotated, divided, saturated, cast."""
    _skip(device)
    g = torch.Generator().manual_seed(6)
    T, H, D = 6, 4, 32
    q = (torch.randn(T, H, D, generator=g) * 3).to(device)
    w = (torch.rand(D, generator=g) * 4 + 0.5).to(device)
    cache = make_cache(16, D).to(device)
    pos = torch.randint(0, 16, (T,), generator=g).to(device)
    with torch.no_grad():
        q8, _ = ropekit.apply_rope(q, None, pos, cache, q_norm_weight=w, out_dtype=torch.float8_e4m3fn, q_scale=0.01)
    assert q8.dtype == torch.float8_e4m3fn
    c, s = reference.angles_from_table(cache.double().cpu(), pos.cpu(), (T,))
    want = (reference.rotate(_norm_ref(q.double().cpu(), w), c, s) / 0.01).clamp(-448, 448)
    assert (want.abs() == 448).any(), "the case must saturate somewhere"
    fp8_close(q8.cpu() if device == "cpu" else q8, want.to(torch.float8_e4m3fn).to(q8.device), torch.float8_e4m3fn)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normed", [False, True])
def test_rotate_with_angles_in_place(device, normed):
    _skip(device)
    g = torch.Generator().manual_seed(7)
    T, H, D = 5, 3, 16
    qkv = torch.randn(T, 2 * H, D, generator=g).to(device)
    q, k = qkv[:, :H], qkv[:, H:]
    q0, k0 = q.double().cpu(), k.double().cpu()
    cache = make_cache(16, D)
    pos = torch.randint(0, 16, (T,), generator=g)
    cos, sin = cache[pos, : D // 2].to(device), cache[pos, D // 2 :].to(device)
    w = (torch.rand(D, generator=g) + 0.5).to(device) if normed else None
    qo, ko = ropekit.rotate_with_angles(q, k, cos, sin, inplace=True, q_norm_weight=w)
    assert qo is q and ko is k
    c, s = cos.double().cpu(), sin.double().cpu()
    assert _rel(q, reference.rotate(_norm_ref(q0, w), c, s)) < 1e-6
    assert _rel(k, reference.rotate(k0, c, s)) < 1e-6


def test_rotate_with_angles_in_place_refusals():
    q = torch.randn(4, 2, 16)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="rotate_with_angles: q: expected a tensor without broadcast"):
        ropekit.rotate_with_angles(q.expand(4, 2, 16)[:, :1].expand(4, 2, 16), None, cos, sin, inplace=True)
    leaf = torch.randn(4, 2, 16, requires_grad=True)
    w = torch.ones(16)
    q0 = leaf.detach().clone()
    with pytest.raises(ValueError, match="rotate_with_angles: inplace: expected False with q_norm_weight"):
        ropekit.rotate_with_angles(leaf * 1.0, None, cos, sin, inplace=True, q_norm_weight=w)
    assert torch.equal(leaf.detach(), q0)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_with_m_rope_per_token_angles(device):
    """rotate_with_angles: M-RoPE's (3, T, half) angles with the norm, and gradients."""
    _skip(device)
    g = torch.Generator().manual_seed(8)
    T, H, D = 6, 2, 32
    sections = (8, 4, 4)
    cache = make_cache(32, D)
    pos = torch.randint(0, 32, (3, T), generator=g)
    cos, sin = cache[pos, : D // 2].to(device), cache[pos, D // 2 :].to(device)
    q = torch.randn(T, H, D, generator=g).to(device).requires_grad_(True)
    w = (torch.rand(D, generator=g) + 0.5).to(device).requires_grad_(True)
    qo, _ = ropekit.rotate_with_angles(q, None, cos, sin, mrope_section=sections, q_norm_weight=w)
    q64 = q.detach().double().cpu().requires_grad_(True)
    w64 = w.detach().double().cpu().requires_grad_(True)
    c, s = reference.angles_from_table(cache.double(), pos, (T,), mrope_section=sections)
    want = reference.rotate(reference.rms_norm(q64, w64, eps=1e-6, offset=0.0), c, s)
    assert _rel(qo, want) < 1e-5
    up = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    qo.backward(up.to(qo))
    want.backward(up)
    assert _rel(q.grad, q64.grad) < 1e-5 and _rel(w.grad, w64.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_norm_and_axial_angles_in_one_launch(device, monkeypatch):
    """The norm with angles from inv_freq: one rope_kernel launch (FREQS and NORM together), no
    separate angle launch."""
    _skip(device)
    g = torch.Generator().manual_seed(9)
    axes = (2, 3, 3)
    T, H, D = 7, 3, 16
    f = ropekit.axial_inv_freq((4, 6, 6))
    pos = torch.randint(-5, 20, (3, T), generator=g).float()
    q = torch.randn(T, H, D, generator=g).to(device)
    w = (torch.rand(H * D, generator=g) + 0.5).to(device)
    launches = []
    if checks.triton_runs(q):
        real = pipeline.launch
        monkeypatch.setattr(pipeline, "launch", lambda *a, **kw: (launches.append(1), real(*a, **kw)))
    qo, _ = ropekit.apply_rope(
        q, None, pos.to(device), None, inv_freq=f.to(device), axes=axes, interleaved=True, q_norm_weight=w
    )
    if checks.triton_runs(q):
        assert len(launches) == 1
    angle = ropekit.core.freqs.pair_positions(pos.double(), axes, 8) * f.double()
    want = reference.rotate(_norm_ref(q.double().cpu(), w), angle.cos(), angle.sin(), interleaved=True)
    assert _rel(qo, want) < 1e-5


def test_dtensor_rules_follow_the_variant():
    """The rotation ops' sharding roles are derived from the encoded Variant."""
    tokens = Variant(angles="tokens", norm_q=2).encode()
    rule = sharding.rule_of("rotate", {"variant": tokens})
    roles = dict(rule.args)
    assert roles["cos"] == sharding.ANGLES and roles["sin"] == sharding.ANGLES
    assert roles["q_norm_weight"] == sharding.WEIGHT_ALL and roles["k_norm_weight"] == sharding.WEIGHT
    packed_rule = sharding.rule_of("rotate_", [None] * 6 + [Variant(angles="packed").encode()])
    assert dict(packed_rule.args)["cu_seqlens"] == sharding.SEQLENS and packed_rule.written == ("q", "k")
    freqs_rule = sharding.rule_of("rotate", {"variant": Variant(angles="freqs", sections=(2, 2)).encode()})
    assert dict(freqs_rule.args)["positions"] == sharding.TOKENS
    assert dict(freqs_rule.args)["inv_freq"] == sharding.TABLE
    back = sharding.rule_of("rotate_norm_backward", {"variant": Variant(norm_k=1).encode()})
    assert back.outputs == ("x", sharding.GRAD_SUM)


@pytest.mark.parametrize("device", DEVICES)
def test_axial_angles_in_place_under_autograd(device):
    """Angles from inv_freq, in place on an activation (a view of a leaf's product), with the
    inverse rotation as gradient."""
    _skip(device)
    g = torch.Generator().manual_seed(10)
    axes = (2, 2)
    f = ropekit.axial_inv_freq((4, 4)).to(device)
    pos = (torch.randn(2, 6, generator=g) * 3).to(device)
    x = torch.randn(6, 2, 8, generator=g).to(device).requires_grad_(True)
    q = x * 1.0
    qo, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f, axes=axes, inplace=True)
    assert qo is q
    up = torch.randn(6, 2, 8, generator=g)
    (qo * up.to(device)).sum().backward()
    angle = ropekit.core.freqs.pair_positions(pos.double().cpu(), axes, 4) * f.double().cpu()
    x64 = x.detach().double().cpu().requires_grad_(True)
    want = reference.rotate(x64, angle.cos(), angle.sin())
    (want * up.double()).sum().backward()
    assert _rel(qo, want) < 1e-6 and _rel(x.grad, x64.grad) < 1e-6
