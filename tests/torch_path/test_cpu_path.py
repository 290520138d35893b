"""The CPU path users get (CPU tensors, no TRITON_INTERPRET): ropekit.core.cpu through the public ops,
against the float64 oracle ropekit.tools.reference.

conftest sets TRITON_INTERPRET=1 for the kernel tests; the `cpu_path` fixture removes it and
forgets memoized specs (they record which path runs) before and after each test here.
"""

from __future__ import annotations

import importlib
import threading

import pytest
import torch

# Triton loaded while conftest's TRITON_INTERPRET=1 is set: its own jit helpers keep the mode they
# were made in, and tests here remove the variable
import triton.language  # noqa: F401

import ropekit
import ropekit.hf
from ropekit.core import cpu, memo
from ropekit.tools import reference

from conftest import make_cache, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 1e-12}


@pytest.fixture
def cpu_path(monkeypatch, poison):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    memo.clear()
    yield
    memo.clear()


def rnd(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------------
# cpu.rotate against reference.rotate: every layout, in and out of place, small and blocked


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_il, out_il", [(False, False), (True, True), (False, True), (True, False)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("where", ["out", "inplace"])
@pytest.mark.parametrize("layout", ["bshd_view", "thd", "big"])
def test_rotate_matches_oracle(monkeypatch, dtype, in_il, out_il, inverse, where, layout):
    D, rot = 48, 32
    if layout == "bshd_view":  # HF's (B, S, H, D) view of (B, H, S, D) storage, partial rotary
        x = rnd(2, 3, 5, D, dtype=dtype).transpose(1, 2)
        cos = rnd(2, 5, rot // 2, seed=1)
    elif layout == "thd":
        x = rnd(7, 3, D, dtype=dtype)
        cos = rnd(7, rot // 2, seed=1)
    else:  # blocks made small: the blocked paths, several blocks and a short last one
        monkeypatch.setattr(cpu, "BLOCK_ELEMS", 1 << 10)
        monkeypatch.setattr(cpu, "PARALLEL_BLOCK_ELEMS", 1 << 11)
        n = 3 * cpu.block_elems() // (8 * rot) + 5
        x = rnd(2, 8, n, D, dtype=dtype).transpose(1, 2)  # (2, n, 8, D)
        cos = rnd(n, rot // 2, seed=1)  # broadcast over B
    sin = rnd(*cos.shape, seed=2)
    want = reference.rotate(
        x.double(), cos.double(), sin.double(), interleaved=in_il, out_interleaved=out_il, inverse=inverse
    )
    src = x.clone()
    out = x if where == "inplace" else torch.full_like(x, float("nan"))
    got = cpu.rotate(x, out, cos, sin, interleaved=in_il, out_interleaved=out_il, inverse=inverse)
    assert got is out
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 4)
    assert torch.equal(got[..., rot:], src[..., rot:]), "tail copied / kept"


def test_rotate_float64_computes_in_float64():
    x, cos, sin = rnd(4, 2, 8, dtype=torch.float64), rnd(4, 4, seed=1).double(), rnd(4, 4, seed=2).double()
    got = cpu.rotate(x, torch.empty_like(x), cos, sin)
    torch.testing.assert_close(got, reference.rotate(x, cos, sin), rtol=1e-14, atol=1e-14)


def test_rotate_nan_angles_stay_in_their_token():
    x = torch.randn(3, 2, 8)
    cos, sin = torch.randn(3, 4), torch.randn(3, 4)
    cos[1] = float("nan")
    sin[1] = float("nan")
    out = cpu.rotate(x, torch.empty_like(x), cos, sin)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()


def test_rotate_odd_offset_slice_interleaved():
    """An interleaved slice that starts at an odd element cannot be viewed as complex: still right."""
    x = rnd(5, 2, 17)
    view = x[..., 1:]  # offset 1: pairs do not start on an even element
    cos, sin = rnd(5, 8, seed=1), rnd(5, 8, seed=2)
    want = reference.rotate(view.double(), cos.double(), sin.double(), interleaved=True)
    out = torch.empty_like(view)
    cpu.rotate(view, out, cos, sin, interleaved=True)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the public ops on the CPU path


CASES = {
    "halves": dict(),
    "interleaved": dict(interleaved=True),
    "partial": dict(rotary_dim=32),
    "mrope": dict(mrope_section=[8, 12, 12]),
    "mrope_interleaved": dict(mrope_section=[12, 10, 10], mrope_interleaved=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rope(cpu_path, dtype, case, inplace):
    kw = CASES[case]
    rot = kw.get("rotary_dim", 64)
    T, Hq, Hk, D = 9, 4, 2, 64
    q, k = rnd(T, Hq, D, dtype=dtype), rnd(T, Hk, D, dtype=dtype, seed=1)
    cache = make_cache(64, rot)
    shape = (3, T) if "mrope_section" in kw else (T,)
    pos = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(3))
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double(), **kw)
    qi, ki = q.clone(), k.clone()
    qo, ko = ropekit.apply_rope(qi, ki, pos, cache, inplace=inplace, **kw)
    assert (qo.data_ptr() == qi.data_ptr()) == inplace
    assert rel_err(qo, rq) < TOL[dtype] and rel_err(ko, rk) < TOL[dtype]
    if not inplace:
        assert torch.equal(qi, q) and torch.equal(ki, k), "inputs untouched"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_in_blocks(cpu_path, monkeypatch, dtype, inplace, interleaved):
    """q and k (other head counts and head sizes, partial rotary) staged together in several
    blocks of tokens, and rotated directly in blocks."""
    monkeypatch.setattr(cpu, "BLOCK_ELEMS", 1 << 9)
    monkeypatch.setattr(cpu, "PARALLEL_BLOCK_ELEMS", 1 << 10)
    B, S, rot = 2, 37, 16
    q, k = rnd(B, S, 4, 32, dtype=dtype), rnd(B, S, 1, 24, dtype=dtype, seed=1)
    cache = make_cache(64, rot)
    pos = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(2))
    kw = dict(interleaved=interleaved, rotary_dim=rot)
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double(), **kw)
    qo, ko = ropekit.apply_rope(q.clone(), k.clone(), pos, cache, inplace=inplace, **kw)
    assert rel_err(qo, rq) < TOL[dtype] and rel_err(ko, rk) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_two_token_dims_arange(cpu_path, dtype):
    """positions None: rows 0..S-1 of the table, on HF's storage order."""
    B, S, H, D = 2, 12, 3, 32
    q = rnd(B, H, S, D, dtype=dtype).transpose(1, 2)  # HF's storage, (B, S, H, D) view
    k = rnd(B, S, 1, D, dtype=dtype, seed=1)
    cache = make_cache(S, D)
    rq, rk = reference.apply_rope(q.double(), k.double(), None, cache.double())
    qo, ko = ropekit.apply_rope(q, k, None, cache, layout="bshd")
    assert rel_err(qo, rq) < TOL[dtype] and rel_err(ko, rk) < TOL[dtype]


def test_angles_kept_between_calls_follow_in_place_writes(cpu_path):
    """Prepared angles are reused for the same table (positions None) or the same cos / sin, and
    made again when that tensor is written in place or is another tensor at the same address."""
    q = rnd(2, 8, 2, 32, dtype=torch.bfloat16)
    table = make_cache(8, 32)
    for step in range(3):
        rq, _ = reference.apply_rope(q.double(), None, None, table.double())
        assert rel_err(ropekit.apply_rope(q, None, None, table)[0], rq) < 8e-3, step
        table[:, :16] = table[:, :16].roll(1, 0)  # written in place: a new version
    ang = torch.rand(2, 8, 16, dtype=torch.float64) * 9
    cos, sin = ang.cos().float(), ang.sin().float()
    for step in range(3):
        want = reference.rotate(q.double(), cos.double(), sin.double())
        assert rel_err(ropekit.rotate_with_angles(q, None, cos, sin)[0], want) < 8e-3, step
        cos.mul_(-1.0)
        if step == 1:  # a new tensor, possibly at the freed one's address
            del cos
            cos = (-ang).cos().float()


def test_table_angles_past_the_table_are_nan():
    """Rows past the table (positions None with a short table, or out-of-range positions) are NaN."""
    table = make_cache(8, 16)
    cos, sin = cpu.table_angles(table, None, (2, 12), 16)
    assert cos.shape == (12, 8) and torch.isnan(cos[8:]).all() and torch.isnan(sin[8:]).all()
    torch.testing.assert_close(cos[:8], table[:, :8])
    cos, _ = cpu.table_angles(table, torch.tensor([[1, 8], [-1, 7]]), (2, 2), 16)
    assert torch.isnan(cos[0, 1]).all() and torch.isnan(cos[1, 0]).all() and not torch.isnan(cos[0, 0]).any()


def test_apply_rope_positions_out_of_range_give_nan_rows(cpu_path):
    q, k = rnd(4, 2, 32), rnd(4, 1, 32, seed=1)
    cache = make_cache(16, 16)  # partial: 16 of 32 dims rotated
    pos = torch.tensor([0, 16, -1, 5])
    qo, ko = ropekit.apply_rope(q, k, pos, cache, rotary_dim=16)
    for out in (qo, ko):
        assert torch.isnan(out[[1, 2], :, :16]).all()
        assert not torch.isnan(out[[0, 3]]).any() and not torch.isnan(out[..., 16:]).any()


def test_apply_rope_packed(cpu_path):
    lens = [6, 0, 8, 2]
    T, D = sum(lens), 32
    q, k = rnd(T, 2, D, dtype=torch.bfloat16), rnd(T, 1, D, dtype=torch.bfloat16, seed=1)
    cache = make_cache(64, D)
    cu = torch.tensor([0, 6, 6, 14, 16])
    pos = ropekit.positions_from_cu_seqlens(cu, cp_size=2, cp_rank=1)
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double())
    qo, ko = ropekit.apply_rope(q, k, None, cache, cu_seqlens=cu, cp_size=2, cp_rank=1)
    assert rel_err(qo, rq) < 8e-3 and rel_err(ko, rk) < 8e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mrope", [False, True])
def test_rotate_with_angles_per_token(cpu_path, dtype, mrope):
    B, S, H, D = 2, 6, 3, 32
    q, k = rnd(B, S, H, D, dtype=dtype), rnd(B, S, 2, D, dtype=dtype, seed=1)
    kw = dict(mrope_section=[4, 6, 6]) if mrope else {}
    ang = torch.rand(*((3,) if mrope else ()), B, S, D // 2, dtype=torch.float64) * 50
    qo, ko = ropekit.rotate_with_angles(q, k, ang.cos().float(), ang.sin().float(), **kw)
    c, s = ang.cos(), ang.sin()
    if mrope:
        pick = reference.mrope_sections_of_frequencies(D // 2, kw["mrope_section"], False)
        c, s = (t.gather(0, pick.expand(1, B, S, D // 2)).squeeze(0) for t in (c, s))
    assert rel_err(qo, reference.rotate(q.double(), c, s)) < TOL[dtype]
    assert rel_err(ko, reference.rotate(k.double(), c, s)) < TOL[dtype]


@pytest.mark.parametrize(
    "sections, layout",
    [((16,), "chunked"), ((6, 10), "pangu"), ((4, 4, 4, 4), "ernie"), ((4, 6, 6), "bailing"), ((8, 8), [1, 0] * 8)],
    ids=["n1", "n2-pangu", "n4-ernie", "n3-bailing", "n2-map"],
)
def test_mrope_layouts(cpu_path, sections, layout):
    """M-RoPE of N rows and any layout: table angles (with the norm too), per-token angles, the store."""
    T, D = 5, 32
    q, k = rnd(T, 2, D), rnd(T, 1, D, seed=1)
    cache = make_cache(64, D)
    pos = torch.randint(0, 64, (len(sections), T))
    kw = dict(mrope_section=sections, mrope_layout=layout)
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double(), **kw)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
    assert rel_err(qo, rq) < TOL[torch.float32] and rel_err(ko, rk) < TOL[torch.float32]
    qo, ko = ropekit.rotate_with_angles(q, k, cache[pos, : D // 2], cache[pos, D // 2 :], **kw)
    assert rel_err(qo, rq) < TOL[torch.float32] and rel_err(ko, rk) < TOL[torch.float32]
    w = torch.rand(D) + 0.5
    nq, nk = reference.rms_norm_rope(
        q.double(), k.double(), pos, cache.double(), q_norm_weight=w.double(), k_norm_weight=w.double(), **kw
    )
    qo, ko = ropekit.apply_rope(q, k, pos, cache, q_norm_weight=w, k_norm_weight=w, **kw)
    assert rel_err(qo, nq) < TOL[torch.float32] and rel_err(ko, nk) < TOL[torch.float32]
    v = rnd(T, 1, D, seed=2)
    k_cache, v_cache = torch.full((8, 1, D), float("nan")), torch.full((8, 1, D), float("nan"))
    slots = torch.tensor([3, 0, 6, 1, 5])
    q_in = q.clone()
    ropekit.apply_rope_and_store(q_in, k, v, pos, cache, k_cache, v_cache, slots, **kw)
    assert rel_err(q_in, rq) < TOL[torch.float32] and rel_err(k_cache[slots], rk) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_drop_in(cpu_path, dtype):
    """ropekit.hf.apply_rotary_pos_emb on HF's (B, H, S, D) views with HF's [f, f] cos / sin."""
    B, H, S, D = 2, 4, 10, 32
    q, k = rnd(B, S, H, D, dtype=dtype).transpose(1, 2), rnd(B, S, 2, D, dtype=dtype, seed=1).transpose(1, 2)
    f = torch.arange(S, dtype=torch.float64)[:, None] * (1e4 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D))
    emb = torch.cat((f, f), -1)[None]
    qo, ko = ropekit.hf.apply_rotary_pos_emb(q, k, emb.cos().to(dtype), emb.sin().to(dtype))
    c, s = emb.cos().to(dtype).double()[..., : D // 2], emb.sin().to(dtype).double()[..., : D // 2]
    want_q = reference.rotate(q.double().transpose(1, 2), c, s).transpose(1, 2)
    want_k = reference.rotate(k.double().transpose(1, 2), c, s).transpose(1, 2)
    assert rel_err(qo, want_q) < TOL[dtype] and rel_err(ko, want_k) < TOL[dtype]


@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_is_the_inverse_rotation(cpu_path, interleaved):
    T, D = 6, 32
    q = rnd(T, 3, D).requires_grad_()
    k = rnd(T, 1, D, seed=1).requires_grad_()
    cache = make_cache(32, D)
    pos = torch.randint(0, 32, (T,), generator=torch.Generator().manual_seed(2))
    qo, ko = ropekit.apply_rope(q, k, pos, cache, interleaved=interleaved)
    gq, gk = rnd(T, 3, D, seed=4), rnd(T, 1, D, seed=5)
    torch.autograd.backward((qo, ko), (gq, gk))
    c, s = reference.angles_from_table(cache.double(), pos, (T,))
    assert rel_err(q.grad, reference.rotate(gq.double(), c, s, interleaved=interleaved, inverse=True)) < 1e-6
    assert rel_err(k.grad, reference.rotate(gk.double(), c, s, interleaved=interleaved, inverse=True)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["halves", "interleaved", "partial", "mrope"])
def test_inverse(cpu_path, dtype, case):
    """apply_rope(inverse=True): rotation by the negative angle, and back to the inputs in place."""
    kw = CASES[case]
    rot = kw.get("rotary_dim", 64)
    q, k = rnd(2, 7, 4, 64, dtype=dtype), rnd(2, 7, 2, 64, dtype=dtype, seed=1)
    cache = make_cache(64, rot)
    pos = torch.randint(
        0, 64, (3, 2, 7) if "mrope_section" in kw else (2, 7), generator=torch.Generator().manual_seed(2)
    )
    half = rot // 2
    if "mrope_section" in kw:
        c, s = reference.angles_from_table(cache.double(), pos, (2, 7), mrope_section=kw["mrope_section"])
    else:
        c, s = reference.angles_from_table(cache.double(), pos, (2, 7))
    il = kw.get("interleaved", False)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, inverse=True, **kw)
    assert c.shape[-1] == half
    assert rel_err(qo, reference.rotate(q.double(), c, s, interleaved=il, inverse=True)) < TOL[dtype]
    assert rel_err(ko, reference.rotate(k.double(), c, s, interleaved=il, inverse=True)) < TOL[dtype]
    ropekit.apply_rope(qo, ko, pos, cache, inplace=True, **kw)
    assert rel_err(qo, q) < 2 * TOL[dtype] and rel_err(ko, k) < 2 * TOL[dtype]


@pytest.mark.parametrize("interleaved", [False, True])
def test_in_place_under_autograd_on_views_of_one_projection(cpu_path, interleaved):
    """q and k, non-leaf views of one qkv projection, rotated in place (staged together, copied
    back into the shared buffer): output and gradients match the out-of-place rotation."""
    cache = make_cache(32, 32)
    pos = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    w, g = rnd(2, 5, 16, seed=2), rnd(2, 5, 6, 48, seed=3)
    proj = rnd(16, 6 * 48, seed=4).requires_grad_()

    def run(inplace):
        proj.grad = None
        qkv = (w @ proj).view(2, 5, 6, 48)
        q, k = qkv[:, :, :4], qkv[:, :, 4:]
        qo, ko = ropekit.apply_rope(q, k, pos, cache, interleaved=interleaved, inplace=inplace, rotary_dim=32)
        out = qkv if inplace else torch.cat((qo, ko), dim=2)
        (out * g).sum().backward()
        return out.detach(), proj.grad.clone()

    (out_in, grad_in), (out_ref, grad_ref) = run(True), run(False)
    assert rel_err(out_in, out_ref) < 1e-6 and rel_err(grad_in, grad_ref) < 1e-6


@pytest.mark.parametrize("cache_dtype, scale", [(torch.bfloat16, None), (torch.float8_e4m3fn, 0.5)])
@pytest.mark.parametrize("paged", [True, False])
def test_store(cpu_path, cache_dtype, scale, paged):
    T, Hq, Hk, D = 10, 4, 2, 32
    q, k, v = (rnd(T, h, D, dtype=torch.bfloat16, seed=i) for i, h in enumerate((Hq, Hk, Hk)))
    cache = make_cache(64, D)
    pos = torch.randint(0, 64, (T,), generator=torch.Generator().manual_seed(3))
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(4))[:T]
    slots[3] = -1
    shape = (4, 8, Hk, D) if paged else (32, Hk, D)
    kc, vc = (torch.zeros(shape).to(cache_dtype) for _ in range(2))
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q = q.clone()
    reference.apply_rope_and_store(
        want_q, k.clone(), v.clone(), pos, cache, want_kc, want_vc, slots, k_scale=scale, v_scale=scale
    )
    ropekit.apply_rope_and_store(q, k, v, pos, cache, kc, vc, slots, k_scale=scale, v_scale=scale)
    assert rel_err(q, want_q) < 8e-3
    assert rel_err(kc.float(), want_kc.float()) < (1e-1 if scale else 8e-3)
    assert torch.equal(vc.float(), want_vc.float())


@pytest.mark.parametrize("q_out_dtype, q_scale", [(None, None), (torch.bfloat16, None), (torch.float8_e4m3fn, 0.25)])
@pytest.mark.parametrize("write_key", [False, True])
def test_store_q_out_and_write_key(cpu_path, q_out_dtype, q_scale, write_key):
    """q into q_out (fp8 with a scale: value / scale, saturated), rotated k back into k, against
    the oracle; the token of a slot past the cache is NaN in q's rotated dims."""
    T, Hq, Hk, D = 6, 2, 1, 32
    q, k, v = (rnd(T, h, D, dtype=torch.bfloat16, seed=i) * 300 for i, h in enumerate((Hq, Hk, Hk)))
    cache = make_cache(32, D)
    pos, slots = torch.tensor([1, 7, 3, 0, 31, 9]), torch.tensor([0, 3, -1, 5, 99, 2])
    qi, ki = q.clone(), k.clone()
    kc, vc = torch.zeros(8, Hk, D, dtype=torch.bfloat16), torch.zeros(8, Hk, D, dtype=torch.bfloat16)
    q_out = None if q_out_dtype is None else torch.zeros(T, Hq, D).to(q_out_dtype)
    ropekit.apply_rope_and_store(
        qi, ki, v, pos, cache, kc, vc, slots, q_out=q_out, q_scale=q_scale, write_key=write_key
    )
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double())
    got_q = qi if q_out is None else q_out
    want_q = rq / (q_scale or 1.0)
    if q_out_dtype == torch.float8_e4m3fn:
        want_q = want_q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        assert (got_q.float().abs() == 448.0).any(), "saturated values"
    good = torch.tensor([True, True, True, True, False, True])
    tol = 0.07 if q_out_dtype == torch.float8_e4m3fn else 8e-3
    assert rel_err(got_q[good], want_q[good]) < tol
    assert torch.isnan(got_q[4].float()).all()
    assert rel_err(ki, rk if write_key else k) < 8e-3
    rows = slots[[0, 1, 3, 5]]
    assert rel_err(kc[rows], rk[[0, 1, 3, 5]]) < 8e-3 and torch.equal(vc[rows], v[[0, 1, 3, 5]])


def test_store_slot_past_the_cache_flags_q(cpu_path):
    q, k, v = rnd(3, 2, 16), rnd(3, 1, 16, seed=1), rnd(3, 1, 16, seed=2)
    kc, vc = torch.zeros(4, 1, 16), torch.zeros(4, 1, 16)
    ropekit.apply_rope_and_store(q, k, v, torch.arange(3), make_cache(8, 16), kc, vc, torch.tensor([0, 9, 2]))
    assert torch.isnan(q[1]).all() and not torch.isnan(q[[0, 2]]).any()
    assert kc[1].abs().sum() == 0 and kc[2].abs().sum() > 0


@pytest.mark.parametrize("dst", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rerotate(cpu_path, dst, interleaved):
    blocks, bs, H, D, rot = 3, 4, 2, 32, 16
    kc = rnd(blocks, bs, H, D, dtype=torch.bfloat16)
    table = make_cache(64, rot)
    slots = torch.tensor([0, 5, 7, 11, -1])
    delta = torch.tensor([3, -2, 70, 0, 1])  # 70: past the table, NaN rows
    dst_slots = torch.tensor([1, 2, 3, 4, 6]) if dst else None
    want = kc.clone()
    reference.rerotate_kv_cache(want, slots, delta, table, interleaved=interleaved, rotary_dim=rot, dst_slots=dst_slots)
    ropekit.rerotate_kv_cache(kc, slots, delta, table, interleaved=interleaved, rotary_dim=rot, dst_slots=dst_slots)
    torch.testing.assert_close(kc.float(), want.float(), rtol=8e-3, atol=8e-3, equal_nan=True)
    assert torch.isnan(kc.view(-1, H, D)[3 if dst else 7, :, :rot]).all()


def test_rerotate_int_delta_and_scale(cpu_path):
    kc = rnd(8, 2, 32)
    table = make_cache(32, 32)
    slots = torch.tensor([1, 4, 6])
    want = kc.clone()
    reference.rerotate_kv_cache(want, slots, -5, table, k_scale=torch.tensor([0.25]))
    ropekit.rerotate_kv_cache(kc, slots, -5, table, k_scale=torch.tensor([0.25]))
    torch.testing.assert_close(kc, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("across_heads", [False, True])
def test_qk_norm_forward_and_grads(cpu_path, dtype, interleaved, across_heads):
    T, Hq, Hk, D, rot = 5, 4, 2, 32, 16
    q = rnd(T, Hq, D, dtype=dtype).requires_grad_()
    k = rnd(T, Hk, D, dtype=dtype, seed=1)
    wq = (1 + 0.1 * rnd(Hq * D if across_heads else D, seed=2)).requires_grad_()
    wk = 1 + 0.1 * rnd(D, seed=3)
    cache = make_cache(32, rot)
    pos = torch.randint(0, 32, (T,), generator=torch.Generator().manual_seed(4))
    kw = dict(interleaved=interleaved, rotary_dim=rot, norm_weight_offset=0.5, norm_eps=1e-5)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, q_norm_weight=wq, k_norm_weight=wk, **kw)
    up = rnd(T, Hq, D, seed=5)
    dq, dwq = torch.autograd.grad(qo, (q, wq), up.to(dtype))
    q64, w64 = q.detach().double().requires_grad_(), wq.detach().double().requires_grad_()
    rq, rk = reference.rms_norm_rope(
        q64, k.double(), pos, cache.double(), q_norm_weight=w64, k_norm_weight=wk.double(), **kw
    )
    want_dq, want_dw = torch.autograd.grad(rq, (q64, w64), up.to(dtype).double())
    tol = TOL[dtype] * (1 if dtype == torch.float32 else 2)
    assert rel_err(qo, rq.detach()) < tol and rel_err(ko, rk) < tol
    assert rel_err(dq, want_dq) < 10 * tol and rel_err(dwq, want_dw) < 10 * tol


def test_qk_norm_store(cpu_path):
    T, Hq, Hk, D = 4, 2, 1, 32
    q, k, v = (rnd(T, h, D, dtype=torch.bfloat16, seed=i) for i, h in enumerate((Hq, Hk, Hk)))
    wq, wk = 1 + 0.1 * rnd(D, seed=3), 1 + 0.1 * rnd(D, seed=4)
    cache = make_cache(16, D)
    pos = torch.tensor([3, 0, 9, 15])
    kc, vc = torch.zeros(8, Hk, D), torch.zeros(8, Hk, D)
    rq, rk = reference.rms_norm_rope(q.double(), k.double(), pos, cache.double(), q_norm_weight=wq, k_norm_weight=wk)
    ropekit.apply_rope_and_store(q, k, v, pos, cache, kc, vc, torch.arange(T), q_norm_weight=wq, k_norm_weight=wk)
    assert rel_err(q, rq) < 8e-3 and rel_err(kc[:T], rk) < 1e-6


@pytest.mark.parametrize("angles", ["packed_cp", "mrope_interleaved"])
@pytest.mark.parametrize("cache_dtype, scale", [(torch.bfloat16, None), (torch.float8_e4m3fn, 0.5)])
def test_store_packed_mrope_norm(cpu_path, angles, cache_dtype, scale):
    """The store's angle sources with the norm (k across heads) and fp8 caches on the CPU path."""
    T, Hq, Hk, D = 6, 2, 2, 32
    q, k, v = (rnd(T, h, D, seed=i) for i, h in enumerate((Hq, Hk, Hk)))
    wq, wk = 1 + 0.1 * rnd(D, seed=5), 1 + 0.1 * rnd(Hk * D, seed=6)
    cache = make_cache(32, D)
    if angles == "packed_cp":
        cu = torch.tensor([0, 2, 6])
        pos, want_pos = None, ropekit.positions_from_cu_seqlens(cu, cp_size=2, cp_rank=1)
        kw, ref_kw = dict(cu_seqlens=cu, cp_size=2, cp_rank=1), {}
    else:
        pos = want_pos = torch.randint(0, 32, (3, T), generator=torch.Generator().manual_seed(7))
        kw = ref_kw = dict(mrope_section=(8, 4, 4), mrope_interleaved=True)
    slots = torch.tensor([7, 0, -1, 3, 5, 1])
    kc, vc = (torch.full((2, 4, Hk, D), float("nan")).to(cache_dtype) for _ in range(2))
    rq, rk = reference.rms_norm_rope(
        q.double(), k.double(), want_pos, cache.double(), q_norm_weight=wq, k_norm_weight=wk, **ref_kw
    )
    ropekit.apply_rope_and_store(
        q, k, v, pos, cache, kc, vc, slots, q_norm_weight=wq, k_norm_weight=wk, k_scale=scale, **kw
    )
    keep = slots >= 0
    s = slots[keep]
    assert rel_err(q, rq) < 1e-6
    assert rel_err(kc[s // 4, s % 4].float() * (scale or 1.0), rk[keep]) < (4e-2 if scale else 8e-3)
    assert rel_err(vc[s // 4, s % 4].float(), v[keep]) < (4e-2 if scale else 8e-3)
    assert torch.isnan(kc.float().view(8, Hk, D)[[2, 4, 6]]).all(), "a row no slot names was written"


# ---------------------------------------------------------------------------------------------
# inference mode, threads, and the oracle kept out of the run path


def _every_cpu_call():
    """One call of each CPU path that uses scratch memory: bf16 / fp16 out of place, in place,
    interleaved, the HF drop-in, the store (bf16 cache), re-rotation and the QK-norm."""
    cache = make_cache(32, 32)
    pos = torch.arange(6)
    for dtype in (torch.bfloat16, torch.float16):
        q, k = rnd(6, 4, 32, dtype=dtype), rnd(6, 2, 32, dtype=dtype, seed=1)
        for il in (False, True):
            rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double(), interleaved=il)
            qo, ko = ropekit.apply_rope(q, k, pos, cache, interleaved=il)
            assert rel_err(qo, rq) < TOL[dtype] and rel_err(ko, rk) < TOL[dtype]
    q, k = rnd(6, 4, 32), rnd(6, 2, 32, seed=1)
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, cache.double())
    ropekit.apply_rope(q, k, pos, cache, inplace=True)
    assert rel_err(q, rq) < 1e-6 and rel_err(k, rk) < 1e-6
    hq = rnd(1, 6, 4, 32, dtype=torch.bfloat16).transpose(1, 2)
    emb = torch.rand(1, 6, 32)
    ropekit.hf.apply_rotary_pos_emb(hq, hq, emb.bfloat16(), emb.bfloat16())
    kc, vc = torch.zeros(8, 2, 32, dtype=torch.bfloat16), torch.zeros(8, 2, 32, dtype=torch.bfloat16)
    qs = rnd(6, 4, 32, dtype=torch.bfloat16)
    ropekit.apply_rope_and_store(qs, k.bfloat16(), k.bfloat16(), pos, cache, kc, vc, torch.arange(6))
    ropekit.rerotate_kv_cache(kc, torch.arange(3), 2, cache)
    w = torch.ones(32)
    ropekit.apply_rope(q.bfloat16(), k.bfloat16(), pos, cache, q_norm_weight=w, k_norm_weight=w)


@pytest.mark.parametrize("first", ["inference_mode", "normal"])
def test_calls_after_inference_mode(cpu_path, first):
    """Scratch first made under torch.inference_mode() must serve later calls outside it (and the
    other way round): this raised 'Inplace update to inference tensor outside InferenceMode'."""
    cpu.forget_scratch()
    modes = (
        [torch.inference_mode, torch.no_grad] if first == "inference_mode" else [torch.no_grad, torch.inference_mode]
    )
    for mode in modes:
        with mode():
            _every_cpu_call()
    _every_cpu_call()  # grad mode on, after both


def test_training_step_after_inference_mode(cpu_path):
    """A patched model evaluated under inference_mode, then trained: bf16 with autograd."""
    cpu.forget_scratch()
    cache = make_cache(16, 32)
    with torch.inference_mode():
        ropekit.apply_rope(rnd(4, 2, 32, dtype=torch.bfloat16), None, torch.arange(4), cache)
    q = rnd(4, 2, 32, dtype=torch.bfloat16).requires_grad_()
    qo, _ = ropekit.apply_rope(q, None, torch.arange(4), cache)
    qo.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


def test_threads_have_their_own_scratch(cpu_path):
    cache = make_cache(64, 64)
    errors = []

    def work(seed):
        try:
            for i in range(20):
                q = rnd(16, 4, 64, dtype=torch.bfloat16, seed=seed * 100 + i)
                rq, _ = reference.apply_rope(q.double(), None, torch.arange(16), cache.double())
                qo, _ = ropekit.apply_rope(q, None, torch.arange(16), cache)
                assert rel_err(qo, rq) < 8e-3
        except Exception as e:  # reported below: an assertion in a thread does not fail the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize(
    "module", ["core.cpu", "core.run", "core.dispatch", "api.ops", "api.store", "api.rerotate", "hf"]
)
def test_run_path_does_not_use_the_oracle(module):
    """reference.py is the tests' oracle only: no module the ops run imports it."""
    try:
        mod = importlib.import_module(f"ropekit.{module}")
    except ImportError:  # a module that another change removed
        pytest.skip(f"ropekit.{module} does not exist")
    assert getattr(mod, "reference", None) is not reference
