"""Habits users bring from Hugging Face never give a silent wrong answer.

- HF's (B, H, S, D) q / k: `layout='bhsd'` takes them (apply_rope and rotate_with_angles, every
  door); without it, a shape error says to pass it, and a q whose layout reads both ways warns.
- HF's cos (rows [f, f]) given as a [cos | sin] table is refused (checked once per table).
- HF's cos / sin as HF returns them (full width, halves [f, f]) are taken by rotate_with_angles.
- HF's (1, S) position_ids broadcast over the batch.

Oracles: ropekit.tools.reference in float64 on the tokens-first view, or HF's formula written out here
in float64. Outputs are poisoned (NaN) before each run.
"""

import warnings

import pytest
import torch

import ropekit
from ropekit.core import memo
from ropekit.core.forms import LayoutWarning
from ropekit.tools import reference

from conftest import make_cache, rel_err

pytestmark = pytest.mark.usefixtures("poison")

B, S, HQ, HK, D = 2, 5, 4, 2, 32


def _rand(*shape, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


def _hf_qk(h=HQ, s=S, seed=0, device="cpu"):
    """q, k as HF holds them: (B, H, S, D) transposed views of (B, S, H, D) projections."""
    q = _rand(B, s, h, D, seed=seed, device=device).transpose(1, 2)
    return q, _rand(B, s, HK, D, seed=seed + 1, device=device).transpose(1, 2)


def _hf_cos_sin(positions, dim=D, base=10000.0):
    """HF's rotary embedding output: (B or 1, S, dim) with halves [f, f]."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    f = positions.double()[..., None] * inv
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().float(), emb.sin().float()


def _hf_rotate(x, cos, sin):
    """HF's apply_rotary_pos_emb on (B, H, S, D), partial rotary as Phi-3 / GPT-NeoX do it, float64."""
    x, cos, sin = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    half = torch.cat((-xr[..., r // 2 :], xr[..., : r // 2]), dim=-1)
    return torch.cat((xr * cos + half * sin, xp), dim=-1)


def _no_layout_warning():
    return warnings.catch_warnings(record=True)


# --- (B, H, S, D): layout='bhsd' ---------------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rope_takes_hf_layout(inplace, device):
    q, k = _hf_qk(device=device)
    q0, k0 = q.clone(), k.clone()
    pos = torch.randint(0, 32, (B, S), device=device)
    cache = make_cache(32, D, device=device)
    rq, rk = reference.apply_rope(q0.transpose(1, 2).double(), k0.transpose(1, 2).double(), pos, cache.double())
    qo, ko = ropekit.apply_rope(q, k, pos, cache, layout="bhsd", inplace=inplace)
    assert qo.shape == (B, HQ, S, D) and ko.shape == (B, HK, S, D)
    assert rel_err(qo.transpose(1, 2), rq) < 1e-6 and rel_err(ko.transpose(1, 2), rk) < 1e-6
    if inplace:
        assert qo is q and ko is k
    else:
        assert torch.equal(q, q0) and torch.equal(k, k0)


def test_apply_rope_hf_layout_positions_none_and_grad():
    """positions=None is arange over S (not H); gradients come back in HF's layout."""
    q, k = _hf_qk()
    q.requires_grad_()
    k.requires_grad_()
    cache = make_cache(S, D)
    qo, ko = ropekit.apply_rope(q, k, None, cache, layout="bhsd")
    pos = torch.arange(S).expand(B, S)
    q64 = q.detach().transpose(1, 2).double().requires_grad_()
    k64 = k.detach().transpose(1, 2).double().requires_grad_()
    rq, rk = reference.apply_rope(q64, k64, pos, cache.double())
    assert rel_err(qo.transpose(1, 2), rq) < 1e-6 and rel_err(ko.transpose(1, 2), rk) < 1e-6
    gq, gk = _rand(*qo.shape, seed=5), _rand(*ko.shape, seed=6)
    ((qo * gq).sum() + (ko * gk).sum()).backward()
    want_q, want_k = torch.autograd.grad(
        (rq, rk), (q64, k64), (gq.transpose(1, 2).double(), gk.transpose(1, 2).double())
    )
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert rel_err(q.grad.transpose(1, 2), want_q) < 1e-6 and rel_err(k.grad.transpose(1, 2), want_k) < 1e-6


def test_apply_rope_hf_layout_with_norm_and_broadcast_positions():
    """The q/k-norm path takes layout='bhsd' and (1, S) positions too."""
    q, k = _hf_qk()
    wq, wk = torch.rand(D) + 0.5, torch.rand(D) + 0.5
    pos = torch.arange(S)[None]
    cache = make_cache(16, D)
    qo, ko = ropekit.apply_rope(q, k, pos, cache, layout="bhsd", q_norm_weight=wq, k_norm_weight=wk)
    qt, kt = ropekit.apply_rope(
        q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(),
        pos.expand(B, S),
        cache,
        q_norm_weight=wq,
        k_norm_weight=wk,
    )
    assert qo.shape == q.shape and torch.allclose(qo.transpose(1, 2), qt, atol=1e-6)
    assert torch.allclose(ko.transpose(1, 2), kt, atol=1e-6)


def test_hf_layout_composes_with_inverse_out_dtype_and_in_place_grad():
    q, _ = _hf_qk()
    pos = torch.arange(S)[None]
    cache = make_cache(16, D)
    rotated, _ = ropekit.apply_rope(q, None, pos, cache, layout="bhsd")
    back, _ = ropekit.apply_rope(rotated, None, pos, cache, layout="bhsd", inverse=True)
    assert back.shape == q.shape and torch.allclose(back, q, atol=1e-5)
    low, _ = ropekit.apply_rope(q, None, pos, cache, layout="bhsd", out_dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16 and rel_err(low, rotated) < 8e-3
    # in place under autograd, on HF's (B, H, S, D) view of an activation
    w = _rand(B, S, HQ, D).requires_grad_()
    x = (w * 2.0).transpose(1, 2)
    ropekit.apply_rope(x, None, pos, cache, layout="bhsd", inplace=True)
    assert torch.allclose(x, 2.0 * rotated, atol=1e-5)
    g = _rand(*x.shape, seed=7)
    (x * g).sum().backward()
    want, _ = ropekit.apply_rope(g, None, pos, cache, layout="bhsd", inverse=True)
    assert torch.allclose(w.grad, 2.0 * want.transpose(1, 2), atol=1e-5)


def test_rotate_with_angles_takes_hf_layout_and_hf_tables():
    """HF's call as HF makes it: (B, H, S, D) q / k, (B, S, D) cos / sin with halves [f, f]."""
    q, k = _hf_qk()
    pos = torch.randint(0, 64, (B, S))
    cos, sin = _hf_cos_sin(pos)
    qo, ko = ropekit.rotate_with_angles(q, k, cos, sin, layout="bhsd")
    assert qo.shape == q.shape
    assert rel_err(qo, _hf_rotate(q, cos, sin)) < 1e-6 and rel_err(ko, _hf_rotate(k, cos, sin)) < 1e-6


def test_layout_bhsd_under_torch_compile():
    """The custom-op door (what torch.compile traces, and DTensor takes) handles the layout too."""
    q, k = _hf_qk()
    pos = torch.randint(0, 32, (1, S))
    cache = make_cache(32, D)
    cos, sin = _hf_cos_sin(pos)

    def f(q, k, pos, cache, cos, sin):
        a = ropekit.apply_rope(q, k, pos, cache, layout="bhsd")
        b = ropekit.rotate_with_angles(q, k, cos, sin, layout="bhsd", rotary_dim=D)
        return a[0], a[1], b[0], b[1]

    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(q, k, pos, cache, cos, sin)
    want = f(q, k, pos, cache, cos, sin)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-6)
    assert rel_err(got[2], _hf_rotate(q, cos, sin)) < 1e-6


def test_hf_layout_without_layout_names_it():
    """H != S: the shape error says what to pass."""
    q, k = _hf_qk()
    with pytest.raises(ValueError, match=r"apply_rope: k: expected token dims \(2, 4\).*pass layout='bhsd'"):
        ropekit.apply_rope(q, k, torch.arange(S)[None], make_cache(16, D))
    with pytest.raises(ValueError, match=r"apply_rope: positions: expected shape \(2, 4\).*pass layout='bhsd'"):
        ropekit.apply_rope(q, None, torch.arange(S)[None].expand(B, S), make_cache(16, D))
    cos, sin = _hf_cos_sin(torch.arange(S)[None])
    with pytest.raises(
        ValueError, match=r"rotate_with_angles: cos: expected a shape broadcastable.*pass layout='bhsd'"
    ):
        ropekit.rotate_with_angles(q, None, cos[..., : D // 2], sin[..., : D // 2])


def test_ambiguous_layout_warns_once_and_layout_silences_it():
    """H == S: HF's (B, H, S, D) view and a (B, S, H, D) view of a head-major buffer have the same
    shape and strides; ropekit cannot refuse either, so it warns (from validation, once per call
    signature) unless the layout is said."""
    memo.clear()
    q = _rand(B, S, S, D).transpose(1, 2)  # (B, H=S, S, D)
    pos = torch.arange(S)[None]
    cache = make_cache(16, D)
    cos, sin = _hf_cos_sin(pos)
    with pytest.warns(LayoutWarning, match=r"apply_rope: q: .*dims 1 and 2 are both 5.*layout='bhsd'"):
        ropekit.apply_rope(q, None, pos, cache)
    with pytest.warns(LayoutWarning, match=r"rotate_with_angles: q: .*layout='bhsd'"):
        ropekit.rotate_with_angles(q, None, cos, sin)
    with pytest.warns(LayoutWarning, match=r"positions=None is arange over dim 1"):
        ropekit.apply_rope(_hf_qk()[0], None, None, cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ropekit.apply_rope(q, None, pos, cache)  # the same signature: validated once, no warning
        for layout in ("bshd", "bhsd"):
            ropekit.apply_rope(q, None, pos, cache, layout=layout)
            ropekit.rotate_with_angles(q, None, cos, sin, layout=layout)
        ropekit.apply_rope(q.transpose(1, 2).contiguous(), None, pos, cache)  # plain (B, S, H, D)
        ropekit.apply_rope(q.transpose(1, 2).contiguous(), None, None, cache)


def test_layout_argument_is_checked():
    q, k = _hf_qk()
    cache = make_cache(16, D)
    with pytest.raises(ValueError, match=r"apply_rope: layout: expected 'thd' or 'bshd'.*got 'BHSD'"):
        ropekit.apply_rope(q, k, None, cache, layout="BHSD")
    with pytest.raises(TypeError, match=r"rotate_with_angles: layout: expected a str or None, got int"):
        ropekit.rotate_with_angles(q, k, torch.ones(S, D // 2), torch.zeros(S, D // 2), layout=1)
    with pytest.raises(ValueError, match=r"apply_rope: q: expected a 3-D tensor with layout='thd', got shape"):
        ropekit.apply_rope(q, k, None, cache, layout="thd")
    with pytest.raises(ValueError, match=r"apply_rope: q: expected a 4-D tensor with layout='bhsd'"):
        ropekit.apply_rope(q[0], None, None, cache, layout="bhsd")


# --- HF's cos as a [cos | sin] table -----------------------------------------------------------


@pytest.mark.parametrize("which", ["cos", "sin", "cos at later positions"])
def test_hf_cos_as_table_is_refused(which, device):
    q, k = _rand(S, HQ, D, device=device), _rand(S, HK, D, device=device)
    q0 = q.clone()
    pos = torch.arange(S) + (7 if which == "cos at later positions" else 0)
    cos, sin = _hf_cos_sin(pos)
    table = (sin if which == "sin" else cos).to(device)
    with pytest.raises(ValueError) as info:
        ropekit.apply_rope(q, k, torch.arange(S, device=device), table, inplace=True)
    message = str(info.value)
    assert message.startswith("apply_rope: cos_sin_cache: expected a [cos | sin] table"), message
    assert "rows are [f, f]" in message and "rotate_with_angles" in message
    assert torch.equal(q, q0)


def test_hf_cos_as_table_is_refused_on_the_norm_path():
    q = _rand(S, HQ, D)
    cos, _ = _hf_cos_sin(torch.arange(S))
    with pytest.raises(ValueError, match=r"apply_rope: cos_sin_cache: expected a \[cos \| sin\] table"):
        ropekit.apply_rope(q, None, torch.arange(S), cos, q_norm_weight=torch.ones(D))


def test_hf_cos_after_a_real_table_of_the_same_signature_is_refused():
    """The table is read per new tensor, not per call signature: HF's cos with the shape, strides
    and dtype of a table used before is still refused."""
    q = _rand(S, HQ, D)
    cache = make_cache(S, D)
    ropekit.apply_rope(q, None, torch.arange(S), cache)
    cos, _ = _hf_cos_sin(torch.arange(S))
    assert cos.shape == cache.shape and cos.stride() == cache.stride()
    with pytest.raises(ValueError, match=r"apply_rope: cos_sin_cache: expected a \[cos \| sin\] table"):
        ropekit.apply_rope(q, None, torch.arange(S), cos)
    ropekit.apply_rope(q, None, torch.arange(S), cache)  # the real one again


def test_real_tables_are_not_refused():
    """Row 0 of a table is [cos 0 | sin 0] = [1 | 0]: never [f, f]. Offset tables (rows from p0),
    bf16 tables, tables of one frequency and placeholder zero tables pass."""
    q = _rand(S, HQ, D)
    for table in (
        make_cache(16, D),
        make_cache(64, D)[20:],
        make_cache(16, D, dtype=torch.bfloat16),
        torch.zeros(16, D),
    ):
        ropekit.apply_rope(q, None, torch.arange(S), table)
    ropekit.apply_rope(_rand(S, HQ, 2), None, torch.arange(S), make_cache(16, 2))


def test_hf_cos_as_rerotation_table_is_refused():
    k_cache = _rand(2, 4, 2, D)
    before = k_cache.clone()
    cos, _ = _hf_cos_sin(torch.arange(16))
    with pytest.raises(ValueError, match=r"rerotate_kv_cache: cos_sin_cache: expected a \[cos \| sin\] table"):
        ropekit.rerotate_kv_cache(k_cache, torch.tensor([0, 3]), 2, cos)
    assert torch.equal(k_cache, before)


# --- HF's full-width cos / sin in rotate_with_angles -------------------------------------------


@pytest.mark.parametrize("rot", [D, D // 2, D // 4], ids=["full", "half", "quarter"])
@pytest.mark.parametrize("say", [False, True], ids=["recognised", "rotary_dim"])
def test_rotate_with_angles_takes_hf_full_width_angles(rot, say, device):
    """HF's cos / sin (B, S, R), halves [f, f], R <= D: dims [0, R) rotated as HF does (partial
    rotary included: R = D/2 and D/4 fit rotary_dim // 2 columns too, and read that way would be
    silently wrong), recognised from their values or said with rotary_dim=R."""
    q, k = _hf_qk(device=device)
    pos = torch.randint(1, 64, (1, S))
    cos, sin = (t.to(device) for t in _hf_cos_sin(pos, rot))
    kw = {"rotary_dim": rot} if say else {}
    memo.clear()
    qo, ko = ropekit.rotate_with_angles(q, k, cos, sin, layout="bhsd", **kw)
    assert rel_err(qo, _hf_rotate(q, cos, sin)) < 1e-6 and rel_err(ko, _hf_rotate(k, cos, sin)) < 1e-6
    # tokens first, the (B, S, 1, D)-style unsqueeze done by broadcasting
    qt = q.transpose(1, 2)
    qo2, _ = ropekit.rotate_with_angles(qt, None, cos, sin, **kw)
    assert rel_err(qo2.transpose(1, 2), _hf_rotate(q, cos, sin)) < 1e-6


def test_half_width_angles_are_unchanged():
    """The documented form (rotary_dim // 2 columns) is read as before, said or not."""
    q = _rand(S, HQ, D)
    pos = torch.randint(0, 64, (S,))
    cache = make_cache(64, D)
    want, _ = ropekit.apply_rope(q, None, pos, cache)
    cos, sin = cache[pos, : D // 2], cache[pos, D // 2 :]
    for kw in ({}, {"rotary_dim": D}):
        got, _ = ropekit.rotate_with_angles(q, None, cos, sin, **kw)
        assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match=r"rotate_with_angles: rotary_dim: expected the width of cos \(16"):
        ropekit.rotate_with_angles(q, None, cos, sin, rotary_dim=8)


def test_zero_angles_do_not_settle_the_reading():
    """Position 0 alone (cos all 1, sin all 0) reads the same either way, so that verdict is not
    remembered: the next call of the same signature, at other positions, is read right."""
    memo.clear()
    q = _rand(1, HQ, 1, D)
    rot = D // 2  # HF partial rotary: would fit rotary_dim // 2 columns of a full rotation
    for p in (0, 3):
        cos, sin = _hf_cos_sin(torch.tensor([[p]]), rot)
        qo, _ = ropekit.rotate_with_angles(q, None, cos, sin, layout="bhsd")
        assert rel_err(qo, _hf_rotate(q, cos, sin)) < 1e-6, p


def test_full_width_angles_that_are_not_hf_say_what_to_pass():
    q = _rand(S, HQ, D)
    cos, sin = _rand(S, D, seed=3), _rand(S, D, seed=4)  # full width, halves not repeated
    with pytest.raises(ValueError) as info:
        ropekit.rotate_with_angles(q, None, cos, sin)
    message = str(info.value)
    assert message.startswith("rotate_with_angles: q: expected a head size >= rotary_dim (64), got head size 32")
    assert "pass rotary_dim=32, or cos[..., :16] and sin[..., :16]" in message


# --- HF's (1, S) position_ids ------------------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True])
def test_positions_broadcast_over_the_batch(inplace, device):
    q, k = _rand(B, S, HQ, D, device=device), _rand(B, S, HK, D, seed=1, device=device)
    pos = torch.randint(0, 32, (1, S), device=device)
    cache = make_cache(32, D, device=device)
    rq, rk = reference.apply_rope(q.double(), k.double(), pos.expand(B, S), cache.double())
    qo, ko = ropekit.apply_rope(q, k, pos, cache, inplace=inplace)
    assert rel_err(qo, rq) < 1e-6 and rel_err(ko, rk) < 1e-6


def test_positions_broadcast_with_grad_and_mrope():
    q = _rand(B, S, HQ, D).requires_grad_()
    pos = torch.randint(0, 32, (1, S))
    cache = make_cache(32, D)
    qo, _ = ropekit.apply_rope(q, None, pos, cache)
    qe, _ = ropekit.apply_rope(q, None, pos.expand(B, S).contiguous(), cache)
    assert torch.equal(qo, qe)
    g = _rand(*qo.shape, seed=9)
    (ga,) = torch.autograd.grad(qo, q, g)
    (gb,) = torch.autograd.grad(qe, q, g)
    assert torch.equal(ga, gb)
    pos3 = torch.randint(0, 32, (3, 1, S))
    sec = [4, 6, 6]
    m1, _ = ropekit.apply_rope(q.detach(), None, pos3, cache, mrope_section=sec)
    m2, _ = ropekit.apply_rope(q.detach(), None, pos3.expand(3, B, S).contiguous(), cache, mrope_section=sec)
    assert torch.equal(m1, m2)


def test_positions_that_do_not_broadcast_are_refused():
    q = _rand(3, S, HQ, D)
    with pytest.raises(ValueError, match=r"apply_rope: positions: expected shape \(3, 5\) .*got shape \(2, 5\)"):
        ropekit.apply_rope(q, None, torch.zeros(2, S, dtype=torch.long), make_cache(16, D))
    with pytest.raises(ValueError, match=r"apply_rope: positions: expected a 2-D tensor"):
        ropekit.apply_rope(q, None, torch.zeros(S, dtype=torch.long), make_cache(16, D))
