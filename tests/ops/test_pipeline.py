"""The call pipeline: a refused call is refused whatever calls came before; one validation per
signature; the memo is bounded; every door gives the reference's answer.

Values that compare equal across types (16.0 == 16, True == 1) must not share a memoized verdict,
nor may another value of the same type: each case below is called on a fresh memo, then after the
valid call has run three times (memoized, then among the op's recent signatures, whose entries
pick the values out by position), and must raise the same error both times.
"""

import pytest
import torch

import ropekit
from ropekit.core import checks, memo, tuning, variant
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err


def _error(fn):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    return None


def _q(T=3, H=2, D=16):
    return torch.randn(T, H, D)


CASES = {
    # name: (valid call, refused call)
    "rotary_dim 16.0 after 16": (
        lambda q, c, p: ropekit.apply_rope(q, None, p, c, rotary_dim=16),
        lambda q, c, p: ropekit.apply_rope(q, None, p, c, rotary_dim=16.0),
    ),
    "rotary_dim 8 after 16 (a value of the same type, in place)": (
        lambda q, c, p: ropekit.apply_rope(q, None, p, c, rotary_dim=16, inplace=True),
        lambda q, c, p: ropekit.apply_rope(q, None, p, c, rotary_dim=8, inplace=True),
    ),
    "rotary_dim True after 1-wide table": None,  # replaced below (needs a 2-wide table)
    "float in mrope_section after ints": (
        lambda q, c, p: ropekit.apply_rope(q, None, torch.zeros(3, 3, dtype=torch.long), c, mrope_section=[2, 3, 3]),
        lambda q, c, p: ropekit.apply_rope(q, None, torch.zeros(3, 3, dtype=torch.long), c, mrope_section=[2.0, 3, 3]),
    ),
    "True in mrope_section after 1": (
        lambda q, c, p: ropekit.apply_rope(q, None, torch.zeros(3, 3, dtype=torch.long), c, mrope_section=[1, 4, 3]),
        lambda q, c, p: ropekit.apply_rope(q, None, torch.zeros(3, 3, dtype=torch.long), c, mrope_section=[True, 4, 3]),
    ),
    "mrope_section as a tuple of floats after a list of ints (rotate_with_angles)": (
        lambda q, c, p: ropekit.rotate_with_angles(
            q, None, c[:3, :8].expand(3, 3, 8), c[:3, 8:].expand(3, 3, 8), mrope_section=[2, 3, 3]
        ),
        lambda q, c, p: ropekit.rotate_with_angles(
            q, None, c[:3, :8].expand(3, 3, 8), c[:3, 8:].expand(3, 3, 8), mrope_section=(2.0, 3.0, 3.0)
        ),
    ),
    "k_scale True after 1 (store)": (
        lambda q, c, p: _store(q, c, p, k_scale=1),
        lambda q, c, p: _store(q, c, p, k_scale=True),
    ),
    "rotary_dim 16.0 after 16 (store)": (
        lambda q, c, p: _store(q, c, p, rotary_dim=16),
        lambda q, c, p: _store(q, c, p, rotary_dim=16.0),
    ),
    "cp_size True after 1 (store, packed)": (
        lambda q, c, p: _store(q, c, None, cu_seqlens=torch.tensor([0, 1, 3]), cp_size=1),
        lambda q, c, p: _store(q, c, None, cu_seqlens=torch.tensor([0, 1, 3]), cp_size=True),
    ),
    "norm_eps True after 1 (store)": (
        lambda q, c, p: _store(q, c, p, k_norm_weight=torch.ones(16), norm_eps=1),
        lambda q, c, p: _store(q, c, p, k_norm_weight=torch.ones(16), norm_eps=True),
    ),
    "True in mrope_section after 1 (store)": (
        lambda q, c, p: _store(q, c, torch.zeros(3, 3, dtype=torch.long), mrope_section=[1, 4, 3]),
        lambda q, c, p: _store(q, c, torch.zeros(3, 3, dtype=torch.long), mrope_section=[True, 4, 3]),
    ),
    "rotary_dim 16.0 after 16 (rerotate)": (
        lambda q, c, p: ropekit.rerotate_kv_cache(torch.zeros(8, 2, 16), torch.tensor([1]), 1, c, rotary_dim=16),
        lambda q, c, p: ropekit.rerotate_kv_cache(torch.zeros(8, 2, 16), torch.tensor([1]), 1, c, rotary_dim=16.0),
    ),
    # the recent signatures' identity test of the keywords (pipeline.prepare): an equal value of
    # another type (the cases above), a list changed in place (the same object), a weight's shape
    # among tensors
    "mrope_section changed in place to a float": (
        lambda q, c, p: ropekit.apply_rope(q, None, torch.zeros(3, 3, dtype=torch.long), c, mrope_section=_section(2)),
        lambda q, c, p: ropekit.apply_rope(
            q, None, torch.zeros(3, 3, dtype=torch.long), c, mrope_section=_section(2.0)
        ),
    ),
    "q_norm_weight of 8 after 16, beside k's": (
        lambda q, c, p: ropekit.apply_rope(q, q, p, c, q_norm_weight=torch.ones(16), k_norm_weight=torch.ones(16)),
        lambda q, c, p: ropekit.apply_rope(q, q, p, c, q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(16)),
    ),
    # the exact signatures' marshal string of the keywords: an object marshal cannot write, equal
    # to None by its own __eq__, where the entry holds None; a str where the entry holds a dtype
    "rotary_dim an object equal to None": (
        lambda q, c, p: ropekit.apply_rope(q, None, p, c),
        lambda q, c, p: ropekit.apply_rope(q, None, p, c, rotary_dim=_EqualToAll()),
    ),
    "out_dtype a str after the dtype": (
        lambda q, c, p: ropekit.apply_rope(q, None, p, c, out_dtype=torch.float32),
        lambda q, c, p: ropekit.apply_rope(q, None, p, c, out_dtype="float32"),
    ),
}
del CASES["rotary_dim True after 1-wide table"]


class _EqualToAll:
    """A value equal to anything (None included) by its own __eq__, and unhashable."""

    def __eq__(self, other):
        return True

    __hash__ = None


_SECTION = [2, 3, 3]


def _section(first):
    """The one mrope_section list of its cases, its first entry set in place."""
    _SECTION[0] = first
    return _SECTION


def _store(q, c, p, **kw):
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    kc, vc = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    return ropekit.apply_rope_and_store(q.clone(), k, v, p, c, kc, vc, torch.tensor([0, 1, 2]), **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_refusal_does_not_depend_on_call_history(name):
    valid, refused = CASES[name]
    q, c, p = _q(), make_cache(10, 16), torch.tensor([0, 1, 2])
    memo.clear()
    fresh = _error(lambda: refused(q, c, p))
    assert fresh is not None, f"{name}: the refused call was accepted on a fresh memo"
    for _ in range(3):  # the memo, then the recent signatures
        assert _error(lambda: valid(q, c, p)) is None, f"{name}: the valid call was refused"
    again = _error(lambda: refused(q, c, p))
    assert again == fresh, f"{name}: after a valid call the error changed: {fresh} -> {again}"


def test_one_validation_per_signature(monkeypatch):
    calls = _count_validations(monkeypatch)
    c = make_cache(10, 16)
    for _ in range(3):
        ropekit.apply_rope(_q(), _q(H=1), torch.tensor([0, 1, 2]), c)
    assert len(calls) == 1
    ropekit.apply_rope(_q(T=4), None, torch.tensor([0, 1, 2, 3]), c)  # a new signature
    assert len(calls) == 2


def test_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(memo, "MEMO_CAPACITY", 8)
    memo.clear()
    c = make_cache(64, 16)
    for T in range(1, 30):
        ropekit.apply_rope(_q(T=T), None, torch.arange(T), c)
        assert len(memo.MEMO) <= 8


def test_variant_backward_is_the_inverse():
    v = variant.Variant(interleaved=True, out_interleaved=False, inverse=False)
    b = v.backward()
    assert (b.interleaved, b.out_interleaved, b.inverse) == (False, True, True)
    assert b.backward() == v


@pytest.mark.parametrize("door", ["direct", "function", "custom_op"])
def test_every_door_matches_the_reference(door, poison):
    """The same call through each door (no grad, grad, the dispatcher) gives the reference's
    output, and the grad doors the inverse rotation as gradient."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 3, 32, generator=g)
    k = torch.randn(4, 1, 32, generator=g)
    pos = torch.randint(0, 20, (4,), generator=g)
    c = make_cache(20, 32)
    rq, rk = reference.apply_rope(q.double(), k.double(), pos, c.double())
    if door == "custom_op":
        codes = variant.Variant().encode()
        qo, ko = torch.ops.ropekit.rotate(q, k, pos, c, None, None, None, None, codes, 32, [1, 0], [0.0, 0.0], None)
    else:
        qq, kk = (q.clone().requires_grad_(), k.clone().requires_grad_()) if door == "function" else (q, k)
        qo, ko = ropekit.apply_rope(qq, kk, pos, c)
        if door == "function":
            up = torch.randn_like(qo)
            (gq,) = torch.autograd.grad(qo, qq, up)
            ref_gq = reference.rotate(up.double(), *reference.angles_from_table(c.double(), pos, (4,)), inverse=True)
            assert rel_err(gq, ref_gq) < TOL[torch.float32]
    assert rel_err(qo, rq) < TOL[torch.float32] and rel_err(ko, rk) < TOL[torch.float32]


def test_tuning_override_replans():
    """A knob change drops the memo: the next call plans with the new value."""
    c = make_cache(10, 16)
    memo.clear()
    ropekit.apply_rope(_q(), None, torch.tensor([0, 1, 2]), c)
    assert memo.MEMO
    q = _q()
    with tuning.override(block_elems=64):
        assert not memo.MEMO
        out, _ = ropekit.apply_rope(q, None, torch.tensor([0, 1, 2]), c)
        assert memo.MEMO  # planned again under the new knob
    want = reference.rotate(q.double(), *reference.angles_from_table(c.double(), torch.tensor([0, 1, 2]), (3,)))
    assert rel_err(out, want) < TOL[torch.float32]
    with pytest.raises(ValueError, match="knobs"):
        with tuning.override(no_such_knob=1):
            pass


def _count_validations(monkeypatch) -> list:
    """A list that grows by one each time apply_rope's validation (checks.rope) runs; memo cleared."""
    calls = []
    real = checks.rope
    monkeypatch.setattr(checks, "rope", lambda *a: (calls.append(1), real(*a))[1])
    memo.clear()
    return calls


def test_recent_signatures_tell_none_parameter_and_subclass_from_a_tensor(monkeypatch):
    """prepare's identity test of the keywords leaves the arguments' types to the tensor guards
    (each tensor's exact type) and the other values' comparison: after three calls with plain
    tensors, k as None, as a Parameter or as a tensor subclass is a signature of its own (validated
    once more), and each call gives the reference's answer."""

    class Sub(torch.Tensor):
        pass

    calls = _count_validations(monkeypatch)
    c, p = make_cache(10, 16), torch.tensor([0, 1, 2])
    q, k = _q(), _q(H=1)
    for _ in range(3):
        ropekit.apply_rope(q, k, p, c)
    assert len(calls) == 1
    want_q, want_k = reference.apply_rope(q.double(), k.double(), p, c.double())
    for i, other in enumerate((None, torch.nn.Parameter(k.clone(), requires_grad=False), k.as_subclass(Sub))):
        got_q, got_k = ropekit.apply_rope(q, other, p, c)
        assert len(calls) == 2 + i, f"{type(other).__name__}: not validated as a signature of its own"
        assert rel_err(got_q, want_q) < TOL[torch.float32]
        if other is not None:
            assert rel_err(got_k, want_k) < TOL[torch.float32]


def test_exact_signatures_tell_keyword_types_dtypes_and_parameters_apart(monkeypatch):
    """prepare's exact signatures compare the keywords as one marshal string (exact types and
    values), dtypes by identity and tensors (a Parameter's type included) by the guards: True and
    1 (in place both), an equal float of another object, out_dtype float32 and bfloat16, and norm
    weights as Parameters and as plain tensors are each validated once as signatures of their own
    (an equal float object is the same signature), and each call gives the reference's answer."""
    calls = _count_validations(monkeypatch)
    c, p = make_cache(10, 16), torch.tensor([0, 1, 2])
    q, k = _q(), _q(H=1)
    want_q, want_k = reference.apply_rope(q.double(), k.double(), p, c.double())
    eps = 1e-6
    kinds = [
        ("inplace True", dict(inplace=True), True),
        ("inplace 1", dict(inplace=1), True),
        ("norm_eps as given", dict(norm_eps=eps), True),
        ("norm_eps an equal float of another object", dict(norm_eps=float(str(eps))), False),
        ("out_dtype float32", dict(out_dtype=torch.float32), True),
        ("out_dtype bfloat16", dict(out_dtype=torch.bfloat16), True),
    ]
    for _ in range(3):  # memoized, then an exact signature, each kind after all the others
        for name, kw, new in kinds:
            before = len(calls)
            q_in, k_in = q.clone(), k.clone()
            got_q, got_k = ropekit.apply_rope(q_in, k_in, p, c, **kw)
            if _ == 0:
                assert len(calls) == before + new, f"{name}: validated {len(calls) - before} times"
            else:
                assert len(calls) == before, f"{name}: validated again"
            dtype = kw.get("out_dtype", torch.float32)
            assert got_q.dtype == got_k.dtype == dtype, name
            tol = TOL[dtype]
            assert rel_err(got_q, want_q) < tol and rel_err(got_k, want_k) < tol, name
    # norm weights: Parameters, then plain tensors of the same shape, dtype and values
    w = torch.rand(16) + 0.5
    want_q, want_k = reference.rms_norm_rope(
        q.double(), k.double(), p, c.double(), q_norm_weight=w.double(), k_norm_weight=w.double()
    )
    weights = [("Parameter", torch.nn.Parameter(w.clone(), requires_grad=False)), ("tensor", w.clone())]
    for round_ in range(3):
        for name, weight in weights:
            before = len(calls)
            got_q, got_k = ropekit.apply_rope(q, k, p, c, q_norm_weight=weight, k_norm_weight=weight)
            assert len(calls) == before + (round_ == 0), f"norm weights as a {name}: validations"
            tol = TOL[torch.float32]
            assert rel_err(got_q, want_q) < tol and rel_err(got_k, want_k) < tol, name


def test_exact_signatures_serve_each_of_several_signatures_of_one_op(monkeypatch):
    """An op called with several signatures in turn (norm weights or none, k or none: a model's
    two kinds of layers) is served by the exact entries for each, whichever entry comes first: an
    entry whose keyword is None where the call passes a tensor is passed over (marshal cannot write
    a tensor), not the end of the search. Seen as no scan of the keywords (the next tier's
    `compress`) once each signature has its entry, and each answer the reference's."""
    from ropekit.core import pipeline

    memo.clear()
    c, p = make_cache(10, 16), torch.tensor([0, 1, 2])
    q, k, wq, wk = _q(), _q(H=1), torch.rand(16) + 0.5, torch.rand(16) + 0.5
    want = reference.apply_rope(q.double(), k.double(), p, c.double())
    want_normed = reference.rms_norm_rope(
        q.double(), k.double(), p, c.double(), q_norm_weight=wq.double(), k_norm_weight=wk.double()
    )
    calls = [
        (lambda: ropekit.apply_rope(q, k, p, c), want),
        (lambda: ropekit.apply_rope(q, k, p, c, q_norm_weight=wq, k_norm_weight=wk), want_normed),
        (lambda: ropekit.apply_rope(q, None, p, c), (want[0], None)),
    ]
    for call, _ in calls * 2:  # validated, then memoized and given an exact entry each
        call()
    scans = []
    real = pipeline.compress
    monkeypatch.setattr(pipeline, "compress", lambda *a: (scans.append(1), real(*a))[1])
    for call, (want_q, want_k) in calls * 2:
        got_q, got_k = call()
        assert rel_err(got_q, want_q) < TOL[torch.float32]
        if want_k is not None:
            assert rel_err(got_k, want_k) < TOL[torch.float32]
    assert not scans, f"{len(scans)} calls took the next tier"
