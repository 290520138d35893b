"""Meta tensors: a model built under torch.device("meta") and run for shapes.

Every op, given meta tensors only, returns meta outputs of the shapes and dtypes the same call
returns on CPU tensors (the custom ops' fakes give them), or raises a named ValueError; never an
internal error from reading data that meta tensors do not hold. Each case builds its tensors with
a `make(device)` function, runs once on CPU (real data) and once on meta, and compares.
"""

import pytest
import torch

import ropekit

META = torch.device("meta")
T, HQ, HK, D = 6, 4, 2, 32


def _qk(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, HQ, D, generator=g, dtype=dtype)
    k = torch.randn(T, HK, D, generator=g, dtype=dtype)
    return q.to(device), k.to(device)


def _table(device, rot=D, rows=64):
    f = torch.arange(rows, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(rot // 2) / (rot // 2))
    return torch.cat((f.cos(), f.sin()), -1).float().to(device)


def _apply_rope(device, **kw):
    q, k = _qk(device)
    return ropekit.apply_rope(q, k, torch.arange(T, device=device), _table(device), **kw)


def _apply_rope_norm(device):
    q, k = _qk(device)
    w = torch.ones(D, device=device)
    return ropekit.apply_rope(q, k, torch.arange(T, device=device), _table(device), q_norm_weight=w, k_norm_weight=w)


def _apply_rope_packed(device):
    q, k = _qk(device)
    cu = torch.tensor([0, 2, T], device=device)
    return ropekit.apply_rope(q, k, None, _table(device), cu_seqlens=cu)


def _apply_rope_freqs(device):
    q, k = _qk(device)
    axes = (4, 6, 6)
    pos = torch.arange(3 * T, device=device).view(3, T)
    return ropekit.apply_rope(q, k, pos, None, inv_freq=ropekit.axial_inv_freq((8, 12, 12)).to(device), axes=axes)


def _apply_rope_mrope(device):
    q, k = _qk(device)
    pos = torch.arange(3 * T, device=device).view(3, T) % 64
    return ropekit.apply_rope(q, k, pos, _table(device), mrope_section=(4, 6, 6))


def _apply_rope_mrope_layout(device):
    q, k = _qk(device)
    pos = torch.arange(4 * T, device=device).view(4, T) % 64
    return ropekit.apply_rope(q, k, pos, _table(device), mrope_section=(4, 4, 4, 4), mrope_layout="ernie")


def _apply_rope_bhsd(device):
    q = torch.randn(1, T, HQ, D).to(device).transpose(1, 2)
    k = torch.randn(1, T, HK, D).to(device).transpose(1, 2)
    return ropekit.apply_rope(q, k, torch.arange(T, device=device)[None], _table(device), layout="bhsd")


def _apply_rope_inplace(device):
    q, k = _qk(device)
    return ropekit.apply_rope(q, k, torch.arange(T, device=device), _table(device), inplace=True)


def _apply_rope_backward(device):
    q, k = _qk(device)
    q.requires_grad_()
    qo, ko = ropekit.apply_rope(q, k, torch.arange(T, device=device), _table(device))
    (qo.sum() + ko.sum()).backward()
    return qo, ko, q.grad


def _rotate_with_angles(device, **kw):
    q, k = _qk(device)
    angles = torch.arange(T * D // 2, dtype=torch.float32).view(T, D // 2).to(device) / 100
    return ropekit.rotate_with_angles(q, k, angles.cos(), angles.sin(), **kw)


def _rotate_with_angles_hf(device):
    """HF's cos / sin ((B, S, D), halves [f, f]) on (B, H, S, D) q / k."""
    q, k = (x[None].transpose(1, 2) for x in _qk(device))
    f = torch.arange(T * D // 2, dtype=torch.float32).view(1, T, D // 2).to(device) / 100
    cos, sin = torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()
    return ropekit.rotate_with_angles(q, k, cos, sin, layout="bhsd")


def _rotate_with_freqs_cis(device):
    q, k = _qk(device)
    angles = torch.arange(T * D // 2, dtype=torch.float32).view(T, D // 2) / 100
    return ropekit.rotate_with_angles(q, k, freqs_cis=torch.polar(torch.ones_like(angles), angles).to(device))


def _caches(device, dtype=torch.float32):
    return torch.zeros(3, 4, HK, D, dtype=dtype).to(device), torch.zeros(3, 4, HK, D, dtype=dtype).to(device)


def _store(device, **kw):
    q, k = _qk(device)
    v = torch.randn(T, HK, D).to(device)
    k_cache, v_cache = _caches(device)
    slots = torch.arange(T, device=device)
    out = ropekit.apply_rope_and_store(
        q, k, v, torch.arange(T, device=device), _table(device), k_cache, v_cache, slots, **kw
    )
    return out, k_cache, v_cache


def _store_q_out(device):
    q, _ = _qk(device)
    return _store(device, q_out=torch.empty(T, HQ, D, dtype=torch.float8_e4m3fn).to(device), q_scale=2.0)


def _store_parts(device, q_nope=True):
    """Heads in two parts: q and k the rope halves; k_nope beside v after rotated k in the k rows,
    q_nope (when given) after rotated q in an fp8 q_out."""
    q, k = _qk(device)
    g = torch.Generator().manual_seed(1)
    k_nope = torch.randn(T, HK, D // 2, generator=g).to(device)
    v = torch.randn(T, HK, D, generator=g).to(device)
    k_cache, v_cache = _caches(device)
    kw = dict(k_nope=k_nope)
    if q_nope:
        kw.update(
            q_nope=torch.randn(T, HQ, D // 2, generator=g).to(device),
            q_out=torch.empty(T, HQ, D, dtype=torch.float8_e4m3fn).to(device),
            q_scale=2.0,
        )
    out = ropekit.apply_rope_and_store(
        q[..., : D // 2], k[..., : D // 2], v, torch.arange(T, device=device), _table(device, rot=D // 2), k_cache,
        v_cache, torch.arange(T, device=device), **kw,
    )  # fmt: skip
    return out, k_cache, v_cache


def _rerotate(device, delta=3):
    k_cache, _ = _caches(device)
    if isinstance(delta, torch.Tensor):
        delta = delta.to(device)
    return ropekit.rerotate_kv_cache(k_cache, torch.arange(5, device=device), delta, _table(device))


def _module(device):
    with torch.device(device):  # the module's table is built on that device, as a meta model's is
        rope = ropekit.RotaryEmbedding(D, D, 64, 10000.0, True, torch.float32)
    q, k = _qk(device)
    return rope(torch.arange(T, device=device), q.reshape(T, -1), k.reshape(T, -1))


def _module_store(device):
    with torch.device(device):
        rope = ropekit.RotaryEmbedding(D, D, 64, 10000.0, True, torch.float32)
    q, k = _qk(device)
    v = torch.randn(T, HK, D).to(device)
    k_cache, v_cache = _caches(device)
    out = rope.forward_and_store(
        torch.arange(T, device=device), q.reshape(T, -1), k.reshape(T, -1), v, k_cache, v_cache,
        torch.arange(T, device=device),
    )  # fmt: skip
    return out, k_cache, v_cache


CASES = {
    "apply_rope": _apply_rope,
    "apply_rope arange": lambda d: ropekit.apply_rope(*_qk(d), None, _table(d)),
    "apply_rope partial": lambda d: ropekit.apply_rope(*_qk(d), torch.arange(T, device=d), _table(d, rot=16)),
    "apply_rope interleaved": lambda d: _apply_rope(d, interleaved=True),
    "apply_rope inverse": lambda d: _apply_rope(d, inverse=True),
    "apply_rope fp8": lambda d: _apply_rope(d, out_dtype=torch.float8_e4m3fn, q_scale=2.0, k_scale=0.5),
    "apply_rope norm": _apply_rope_norm,
    "apply_rope packed": _apply_rope_packed,
    "apply_rope freqs": _apply_rope_freqs,
    "apply_rope mrope": _apply_rope_mrope,
    "apply_rope mrope 4 rows ernie": _apply_rope_mrope_layout,
    "apply_rope bhsd": _apply_rope_bhsd,
    "apply_rope inplace": _apply_rope_inplace,
    "apply_rope backward": _apply_rope_backward,
    "apply_rope q_nope k_nope": lambda d: ropekit.apply_rope(
        *(x[..., : D // 2] for x in _qk(d)),
        torch.arange(T, device=d),
        _table(d, rot=D // 2),
        q_nope=_qk(d)[0][..., D // 2 :],
        k_nope=_qk(d)[1],
        rotary_position="last",
    ),  # fmt: skip
    "rotate_with_angles": _rotate_with_angles,
    "rotate_with_angles rotary_dim": lambda d: _rotate_with_angles(d, rotary_dim=D),
    "rotate_with_angles inplace": lambda d: _rotate_with_angles(d, inplace=True),
    "rotate_with_angles hf": _rotate_with_angles_hf,
    "rotate_with_angles freqs_cis": _rotate_with_freqs_cis,
    "apply_rope_and_store": _store,
    "apply_rope_and_store write_key": lambda d: _store(d, write_key=True),
    "apply_rope_and_store q_out": _store_q_out,
    "apply_rope_and_store k_nope beside v": lambda d: _store_parts(d, q_nope=False),
    "apply_rope_and_store q_nope k_nope": _store_parts,
    "rerotate_kv_cache": _rerotate,
    "rerotate_kv_cache tensor delta": lambda d: _rerotate(d, torch.tensor(3)),
    "RotaryEmbedding": _module,
    "RotaryEmbedding.forward_and_store": _module_store,
}


def _tensors(out):
    out = out if isinstance(out, tuple) else (out,)
    return [x for x in out if x is not None]


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_outputs_have_the_shapes_and_dtypes_of_real_ones(case):
    want = _tensors(CASES[case]("cpu"))
    got = _tensors(CASES[case](META))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device == META, case
        assert (g.shape, g.dtype) == (w.shape, w.dtype), case


def test_a_meta_call_mixed_with_real_tensors_is_a_named_error():
    q, k = _qk(META)
    with pytest.raises(ValueError, match=r"^apply_rope: cos_sin_cache: expected a tensor on meta"):
        ropekit.apply_rope(q, k, torch.arange(T, device=META), _table("cpu"))


def test_bad_meta_arguments_are_named_as_on_cpu():
    """Validation reads shapes, not data: a wrong rotary_dim is refused on meta as on CPU."""
    q, k = _qk(META)
    with pytest.raises(ValueError, match=r"^apply_rope: rotary_dim: expected"):
        ropekit.apply_rope(q, k, torch.arange(T, device=META), _table(META), rotary_dim=8)
