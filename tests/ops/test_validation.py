"""Every invalid input raises before anything is written, with a message naming the argument.

Each case runs apply_rope in place on fresh tensors and checks that q and k are unchanged after
the error (validation happens before any launch).
"""

import pytest
import torch

import ropekit

from conftest import make_cache

T, HQ, HK, D = 4, 3, 2, 64


def good():
    return dict(
        q=torch.randn(T, HQ, D),
        k=torch.randn(T, HK, D),
        positions=torch.randint(0, 16, (T,)),
        cos_sin_cache=make_cache(16, D),
    )


def bad(**change):
    args = good()
    for name, fn in change.items():
        args[name] = fn(args) if callable(fn) else fn
    return args


CASES = [
    # (id, arguments, keyword overrides, exception, message fragment)
    ("q-not-tensor", bad(q=[1.0]), {}, TypeError, "q: expected a torch.Tensor"),
    ("q-rank", bad(q=lambda a: a["q"][0]), {}, ValueError, "q: expected a 3-D or 4-D"),
    ("q-dtype-int", bad(q=lambda a: a["q"].to(torch.int32)), {}, ValueError, "q: expected dtype"),
    ("q-dtype-f64", bad(q=lambda a: a["q"].double()), {}, ValueError, "got float64"),
    ("q-out-in-place", good(), {"q_out": torch.zeros(T, HQ, D)}, ValueError, "q_out: expected None when inplace=True"),
    ("k-token-dims", bad(k=lambda a: torch.randn(T + 1, HK, D)), {}, ValueError, "k: expected token dims"),
    ("k-rank", bad(k=lambda a: torch.randn(1, T, HK, D)), {}, ValueError, "k: expected a 3-D"),
    ("k-device", bad(k=lambda a: a["k"].to("meta")), {}, ValueError, "k: expected a tensor on cpu"),
    ("k-not-tensor", bad(k="k"), {}, TypeError, "k: expected a torch.Tensor"),
    ("cache-rank", bad(cos_sin_cache=lambda a: a["cos_sin_cache"][0]), {}, ValueError, "cos_sin_cache: expected a 2-D"),
    (
        "cache-dtype",
        bad(cos_sin_cache=lambda a: a["cos_sin_cache"].double()),
        {},
        ValueError,
        "cos_sin_cache: expected dtype",
    ),
    ("rotary-odd", good(), {"rotary_dim": 63}, ValueError, "rotary_dim: expected a positive even int"),
    ("rotary-not-int", good(), {"rotary_dim": 64.0}, TypeError, "rotary_dim: expected an int"),
    ("rotary-vs-cache", good(), {"rotary_dim": 32}, ValueError, "rotary_dim: expected the width of cos_sin_cache"),
    (
        "head-smaller-than-rotary",
        bad(k=lambda a: torch.randn(T, HK, 32)),
        {},
        ValueError,
        "k: expected a head size >= rotary_dim (64)",
    ),
    ("positions-dtype", bad(positions=lambda a: a["positions"].float()), {}, ValueError, "positions: expected dtype"),
    ("positions-shape", bad(positions=lambda a: a["positions"][:2]), {}, ValueError, "positions: expected shape"),
    (
        "positions-none-too-long",
        bad(cos_sin_cache=lambda a: make_cache(3, D), positions=None),
        {},
        ValueError,
        "positions: expected explicit positions",
    ),
    (
        "mrope-sum",
        bad(positions=lambda a: torch.zeros(3, T, dtype=torch.long)),
        {"mrope_section": [8, 8, 8]},
        ValueError,
        "mrope_section: expected sections summing to rotary_dim // 2 = 32",
    ),
    (
        "mrope-form",
        good(),
        {"mrope_section": [16, -16]},
        ValueError,
        "mrope_section: expected N >= 1 non-negative ints",
    ),
    (
        "mrope-positions-shape",
        good(),
        {"mrope_section": [8, 12, 12]},
        ValueError,
        "positions: expected a 2-D tensor (3, 4), got shape (4,)",
    ),
    (
        "mrope-interleaved-alone",
        good(),
        {"mrope_interleaved": True},
        ValueError,
        "mrope_interleaved: expected mrope_section",
    ),
    ("inplace-overlap", bad(k=lambda a: a["q"][:, :HK]), {}, ValueError, "k: expected memory disjoint from q"),
    (
        "inplace-broadcast",
        bad(q=lambda a: torch.randn(T, 1, D).expand(T, HQ, D)),
        {},
        ValueError,
        "q: expected a tensor without broadcast",
    ),
    (
        "inplace-leaf-requires-grad",
        bad(q=lambda a: a["q"].requires_grad_()),
        {},
        ValueError,
        "q: expected a tensor that is not a leaf requiring grad",
    ),
    (
        "cache-requires-grad",
        bad(cos_sin_cache=lambda a: a["cos_sin_cache"].requires_grad_()),
        {},
        ValueError,
        "cos_sin_cache: expected a tensor that does not require grad",
    ),
]


@pytest.mark.parametrize("args,kw,exc,msg", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_input_raises_and_writes_nothing(args, kw, exc, msg):
    snapshot = {
        n: v.detach().clone() for n, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"
    }
    with pytest.raises(exc) as info:
        ropekit.apply_rope(args["q"], args["k"], args["positions"], args["cos_sin_cache"], inplace=True, **kw)
    assert msg in str(info.value)
    assert str(info.value).startswith("apply_rope: ") or exc is TypeError
    for name, before in snapshot.items():
        assert torch.equal(args[name].detach(), before), f"{name} was written before the error"


def test_fused_qkv_slices_are_not_overlap():
    """Views of one fused buffer are disjoint element-wise: in place is allowed."""
    qkv = torch.randn(T, (HQ + 2 * HK) * D)
    q = qkv[:, : HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D : (HQ + HK) * D].view(T, HK, D)
    v0 = qkv[:, (HQ + HK) * D :].clone()
    want_q, want_k = ropekit.apply_rope(q.clone(), k.clone(), torch.arange(T), make_cache(16, D))
    ropekit.apply_rope(q, k, torch.arange(T), make_cache(16, D), inplace=True)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (HQ + HK) * D :], v0)


def test_out_of_place_accepts_overlap_and_grad():
    """Overlap and requires_grad only matter when writing in place."""
    q = torch.randn(T, HQ, D, requires_grad=True)
    qo, ko = ropekit.apply_rope(q, q[:, :HK], torch.arange(T), make_cache(16, D))
    assert qo.requires_grad and ko.requires_grad
