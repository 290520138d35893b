"""Property-based fuzzing of every op against the float64 reference (hypothesis, CPU, in CI).

Valid configurations: random token dims ((T,) or (B, S)), head counts, head sizes, rotary dims
(partial included), rotations, M-RoPE sections, dtypes, tables, positions (int32/int64, strided,
out of range: NaN rows), and random layouts: q, k (and v) placed in one flat buffer, each with its
own storage order (transposes), padding and offset, or as views of fused rows; caches in every
layout of test_store. Each call is checked against `ropekit.tools.reference` in float64: written
elements within tolerance with NaN exactly where the reference has NaN, every other element of
every buffer bit-identical. Out-of-place outputs are NaN-poisoned (conftest's `poison`), so an
element the kernel skips fails.

Invalid configurations: a valid one plus one mutation from a list (wrong dtype, rank, shape,
stride, rotary dim, sections, overlapping in-place views, overlapping caches, strict-mode bad
positions and slots, bad scales, ...): each must raise the documented exception with the
documented message, and leave every buffer bit-identical.

On CPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1 without CUDA).
Example budgets are fixed and derandomized: the file runs in well under 90 s on two cores.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store import Caches, check_store, flat, hnd, kv_joint, mla, nhd, padded

import ropekit
from ropekit.api.store import apply_rope_and_store
from ropekit.tools import reference

from conftest import make_cache

NAN = float("nan")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# elementwise |got - want| <= TOL * (1 + |want|): one rounding to the dtype plus float32 math
TOL = {F32: 2e-6, F16: 2e-3, BF16: 1.6e-2}
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SETTINGS = dict(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


def bits(x):
    return x.view(INT_OF_SIZE[x.element_size()])


def assert_close(got, want, dtype, what):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    ok = (got - want).abs() <= TOL[dtype] * (1 + want.abs())
    ok |= got.isnan() & want.isnan()
    assert ok.all(), (
        f"{what}: {int((~ok).sum())} of {ok.numel()} off; got {got[~ok][:4].tolist()} want {want[~ok][:4].tolist()}"
    )


# ---------------------------------------------------------------------------------------------
# strategies


dtypes = st.sampled_from([F32, F16, BF16])
index_dtypes = st.sampled_from([torch.int32, torch.int64])


@st.composite
def token_dims(draw):
    if draw(st.booleans()):
        return (draw(st.integers(1, 4)),)
    return (draw(st.integers(1, 2)), draw(st.integers(1, 3)))


@st.composite
def placements(draw, shapes):
    """Disjoint places for tensors of `shapes` (each (*T, H, D), one token shape) in one flat buffer.

    Returns (buffer size, [(shape, stride, offset)]). Either each tensor gets its own region, in
    its own storage order (a permutation of the dims before the last: transposed, head-major,
    (S, B)-major), with padding in every dim and an offset inside it; or all are views of fused
    rows, one row per token holding every tensor's heads (a fused qkv projection; MLA's q_pe
    slice when a tensor sits after a gap)."""
    n_tok = len(shapes[0]) - 2
    if draw(st.booleans()):  # fused rows
        gaps = [draw(st.integers(0, 3)) for _ in shapes]
        offs, width = [], 0
        for shape, gap in zip(shapes, gaps):
            width += gap
            offs.append(width)
            width += shape[-2] * shape[-1]
        width += draw(st.integers(0, 3))
        if n_tok == 1:
            tok = (width,)
        else:
            S = shapes[0][1]
            tok = (S * width + draw(st.integers(0, 3)), width)
        total = (shapes[0][0] - 1) * tok[0] + (shapes[0][1] - 1) * tok[1] if n_tok == 2 else (shapes[0][0] - 1) * tok[0]
        return total + width, [(shape, (*tok, shape[-1], 1), off) for shape, off in zip(shapes, offs)]
    order = draw(st.permutations(list(range(len(shapes)))))
    places = [None] * len(shapes)
    cursor = 0
    for i in order:
        shape = shapes[i]
        nd = len(shape)
        perm = draw(st.permutations(list(range(nd - 1)))) + [nd - 1]  # storage order, outer first
        pads = [draw(st.integers(0, 2)) for _ in range(nd - 1)] + [draw(st.integers(0, 3))]
        sizes = [n + p for n, p in zip(shape, pads)]
        stride = [0] * nd
        step = 1
        for d in reversed(perm):
            stride[d] = step
            step *= sizes[d]
        inner = sum(draw(st.integers(0, p)) * s for p, s in zip(pads, stride))
        cursor += draw(st.integers(0, 3))  # gap before the region
        places[i] = (tuple(shape), tuple(stride), cursor + inner)
        cursor += step
    return cursor + draw(st.integers(0, 3)), places


@st.composite
def sections(draw, half):
    t = draw(st.integers(0, half))
    h = draw(st.integers(0, half - t))
    return (t, h, half - t - h)


def extremes(dtype):
    return [-(2**31), 2**31 - 1] if dtype == torch.int32 else [-(2**62), 2**40]


@st.composite
def positions_st(draw, shape, max_pos, dtype, bad):
    n = math.prod(shape)
    if bad:
        values = (
            st.integers(0, max_pos - 1)
            | st.integers(-3, -1)
            | st.integers(max_pos, max_pos + 3)
            | st.sampled_from(extremes(dtype))
        )
    else:
        values = st.integers(0, max_pos - 1)
    p = torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype).view(shape)
    how = draw(st.sampled_from(["contig", "strided", "transposed"]))
    if how == "strided":
        wide = torch.full((*shape[:-1], 2 * shape[-1]), -7, dtype=dtype)
        wide[..., ::2] = p
        return wide[..., ::2]
    if how == "transposed" and p.dim() >= 2:
        return p.transpose(-1, -2).contiguous().transpose(-1, -2)
    return p


@st.composite
def tables(draw, max_pos, rot):
    dtype = draw(st.sampled_from([F32, F32, BF16, F16]))
    t = make_cache(max_pos, rot, dtype=dtype)
    pad = draw(st.integers(0, 3))
    if pad:  # a column slice of a wider buffer
        off = draw(st.integers(0, pad))
        wide = torch.zeros(max_pos, rot + pad, dtype=dtype)
        wide[:, off : off + rot] = t
        t = wide[:, off : off + rot]
    return t


@st.composite
def rope_configs(draw):
    """A valid apply_rope call: arguments and a seed for the values."""
    tok = draw(token_dims())
    half = draw(st.integers(1, 8))
    rot = 2 * half
    Hq, Hk = draw(st.integers(1, 3)), draw(st.integers(0, 2))
    Dq, Dk = rot + draw(st.integers(0, 4)), rot + draw(st.integers(0, 4))
    dtype = draw(dtypes)
    mrope = draw(st.none() | sections(half))
    max_pos = draw(st.integers(1, 12))
    bad = draw(st.booleans())
    use_none = mrope is None and tok[-1] <= max_pos and draw(st.integers(0, 4)) == 0
    pdt = draw(index_dtypes)
    positions = None if use_none else draw(positions_st(((3,) if mrope else ()) + tok, max_pos, pdt, bad))
    shapes = [(*tok, Hq, Dq)] + ([(*tok, Hk, Dk)] if Hk else [])
    size, places = draw(placements(shapes))
    return dict(
        tok=tok,
        rot=rot,
        dtype=dtype,
        size=size,
        places=places,
        positions=positions,
        table=draw(tables(max_pos, rot)),
        interleaved=draw(st.booleans()),
        mrope=mrope,
        mrope_interleaved=mrope is not None and draw(st.booleans()),
        inplace=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
    )


def buffer(size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, generator=g).to(dtype)


def views(buf, places):
    return [buf.as_strided(*p) for p in places]


def brute_disjoint(places, size):
    """No element is shared between the placed tensors, nor within one (as_strided can self-overlap)."""
    seen = torch.zeros(size, dtype=torch.int64)
    for p in places:
        idx = torch.arange(size).as_strided(*p).flatten()
        seen.index_add_(0, idx, torch.ones_like(idx))
    return bool((seen <= 1).all())


# ---------------------------------------------------------------------------------------------
# valid configurations against the reference


@settings(max_examples=180, **SETTINGS)
@given(cfg=rope_configs())
def test_apply_rope_matches_reference(cfg, poison):
    assert brute_disjoint(cfg["places"], cfg["size"])
    dtype, rot, positions, table = cfg["dtype"], cfg["rot"], cfg["positions"], cfg["table"]
    buf = buffer(cfg["size"], dtype, cfg["seed"])
    before = buf.clone()
    q, *rest = views(buf, cfg["places"])
    k = rest[0] if rest else None
    kw = dict(
        interleaved=cfg["interleaved"],
        rotary_dim=rot,
        mrope_section=cfg["mrope"],
        mrope_interleaved=cfg["mrope_interleaved"],
    )
    rq, rk = reference.apply_rope(q.double(), None if k is None else k.double(), positions, table.double(), **kw)
    pos_before = None if positions is None else positions.clone()
    table_before = table.clone()

    qo, ko = ropekit.apply_rope(q, k, positions, table, inplace=cfg["inplace"], **kw)

    assert (ko is None) == (k is None)
    assert_close(qo, rq, dtype, "q")
    if k is not None:
        assert_close(ko, rk, dtype, "k")
    if positions is not None:
        assert torch.equal(positions, pos_before)
    assert torch.equal(bits(table), bits(table_before))
    if not cfg["inplace"]:
        assert torch.equal(bits(buf), bits(before)), "out of place wrote into its inputs"
        return
    assert qo is q and ko is k
    written = torch.zeros(cfg["size"], dtype=torch.bool)
    for place in cfg["places"]:
        written.as_strided(*place)[..., :rot] = True
    assert torch.equal(bits(buf)[~written], bits(before)[~written]), "in place wrote outside the rotated dims"


@st.composite
def angle_configs(draw):
    tok = draw(token_dims())
    half = draw(st.integers(1, 8))
    rot = 2 * half
    Hq, Hk = draw(st.integers(1, 3)), draw(st.integers(0, 2))
    shapes = [(*tok, Hq, rot + draw(st.integers(0, 4)))] + ([(*tok, Hk, rot + draw(st.integers(0, 4)))] if Hk else [])
    size, places = draw(placements(shapes))
    mrope = draw(st.none() | sections(half))
    sec = (3,) if mrope else ()
    # angles broadcast over any subset of the token dims, given as (.., half) or as a view of
    # Hugging Face's duplicated (.., rot) halves
    bshape = tuple(1 if draw(st.booleans()) else n for n in tok)
    if not mrope and draw(st.booleans()):
        bshape = bshape[draw(st.integers(0, len(bshape))) :]  # fewer leading dims
    return dict(
        tok=tok,
        half=half,
        size=size,
        places=places,
        mrope=mrope,
        sec=sec,
        bshape=bshape,
        hf=draw(st.booleans()),
        cdtype=draw(st.sampled_from([F32, BF16, F16])),
        dtype=draw(dtypes),
        interleaved=draw(st.booleans()),
        out_interleaved=draw(st.booleans()),
        mrope_interleaved=mrope is not None and draw(st.booleans()),
        seed=draw(st.integers(0, 2**31)),
    )


@settings(max_examples=70, **SETTINGS)
@given(cfg=angle_configs())
def test_rotate_with_angles_matches_reference(cfg, poison):
    dtype, half, tok, sec = cfg["dtype"], cfg["half"], cfg["tok"], cfg["sec"]
    buf = buffer(cfg["size"], dtype, cfg["seed"])
    before = buf.clone()
    q, *rest = views(buf, cfg["places"])
    k = rest[0] if rest else None
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    ang = torch.rand((*sec, *cfg["bshape"], half), generator=g, dtype=torch.float64) * 6.3 - 3.15
    cos, sin = ang.cos().to(cfg["cdtype"]), ang.sin().to(cfg["cdtype"])
    if cfg["hf"]:
        cos, sin = torch.cat((cos, cos), -1)[..., :half], torch.cat((sin, sin), -1)[..., :half]
    qo, ko = ropekit.rotate_with_angles(
        q,
        k,
        cos,
        sin,
        interleaved=cfg["interleaved"],
        out_interleaved=cfg["out_interleaved"],
        mrope_section=cfg["mrope"],
        mrope_interleaved=cfg["mrope_interleaved"],
    )
    want = (*sec, *tok, half)
    c, s = cos.double().broadcast_to(want), sin.double().broadcast_to(want)
    if cfg["mrope"]:
        pick = reference.mrope_sections_of_frequencies(half, cfg["mrope"], cfg["mrope_interleaved"])
        pick = pick.view(1, *([1] * len(tok)), half).expand(1, *tok, half)
        c, s = c.gather(0, pick).squeeze(0), s.gather(0, pick).squeeze(0)
    rot_kw = dict(interleaved=cfg["interleaved"], out_interleaved=cfg["out_interleaved"])
    assert_close(qo, reference.rotate(q.double(), c, s, **rot_kw), dtype, "q")
    if k is not None:
        assert_close(ko, reference.rotate(k.double(), c, s, **rot_kw), dtype, "k")
    assert torch.equal(bits(buf), bits(before)), "rotate_with_angles wrote into its inputs"


LAYOUTS = {"nhd": nhd, "hnd": hnd, "kv_joint": kv_joint, "flat": flat, "padded": padded, "mla": mla}


@st.composite
def store_configs(draw):
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    tok = draw(token_dims())
    half = draw(st.integers(1, 8))
    rot = 2 * half
    Hq = draw(st.integers(1, 3))
    Hk = 1 if layout == "mla" else draw(st.integers(1, 2))
    Dq, Dk = rot + draw(st.integers(0, 3)), rot + draw(st.integers(0, 3))
    Dv = Dk if layout == "kv_joint" else draw(st.integers(1, 12))
    NB, BS = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    size, places = draw(placements([(*tok, Hq, Dq), (*tok, Hk, Dk), (*tok, Hk, Dv)]))
    n = math.prod(tok)
    num_slots = NB * BS
    sdt = draw(index_dtypes)
    # distinct slots, some padding (< 0), some past the cache
    slot_values = (
        st.integers(0, num_slots - 1)
        | st.integers(-3, -1)
        | st.just(-(2**31))
        | st.integers(num_slots, num_slots + 2)
        | st.sampled_from(extremes(sdt)[1:])
    )
    slots = draw(
        st.lists(slot_values, min_size=n, max_size=n, unique_by=lambda s: s if 0 <= s < num_slots else object())
    )
    max_pos = draw(st.integers(1, 12))
    use_none = tok[-1] <= max_pos and draw(st.integers(0, 4)) == 0
    pdt = draw(index_dtypes)
    positions = None if use_none else draw(positions_st(tok, max_pos, pdt, draw(st.booleans())))
    scale = draw(st.sampled_from([None, 0.5, 2.0, "tensor"]))
    return dict(
        layout=layout,
        tok=tok,
        rot=rot,
        Hk=Hk,
        Dk=Dk,
        Dv=Dv,
        NB=NB,
        BS=BS,
        size=size,
        places=places,
        slots=torch.tensor(slots, dtype=sdt).view(tok),
        positions=positions,
        table=draw(tables(max_pos, rot)),
        dtype=draw(dtypes),
        cache_dtype=draw(st.sampled_from([F32, F16, BF16])),
        interleaved=draw(st.booleans()),
        scale=scale,
        seed=draw(st.integers(0, 2**31)),
    )


@settings(max_examples=120, **SETTINGS)
@given(cfg=store_configs())
def test_apply_rope_and_store_matches_reference(cfg):
    """test_store's check_store: q rotated in place, written cache rows against the reference,
    every other cache element bit-identical; here also everything around q, k and v."""
    buf = buffer(cfg["size"], cfg["dtype"], cfg["seed"])
    before = buf.clone()
    q, k, v = views(buf, cfg["places"])
    caches = Caches(
        LAYOUTS[cfg["layout"]], cfg["NB"], cfg["BS"], cfg["Hk"], cfg["Dk"], cfg["Dv"], cfg["cache_dtype"], "cpu"
    )
    scale = torch.tensor([0.25]) if cfg["scale"] == "tensor" else cfg["scale"]
    check_store(
        q,
        k,
        v,
        cfg["positions"],
        cfg["table"],
        caches,
        cfg["slots"],
        interleaved=cfg["interleaved"],
        k_scale=scale,
        v_scale=scale,
    )
    written = torch.zeros(cfg["size"], dtype=torch.bool)
    written.as_strided(*cfg["places"][0])[..., : cfg["rot"]] = True
    assert torch.equal(bits(buf)[~written], bits(before)[~written]), "wrote outside q's rotated dims"


# ---------------------------------------------------------------------------------------------
# invalid configurations: the documented error, nothing written


def _rope_base(draw):
    tok = draw(token_dims())
    half = draw(st.integers(1, 6))
    rot = 2 * half
    Hq, Hk = draw(st.integers(2, 3)), draw(st.integers(1, 2))
    dtype = draw(dtypes)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    Dq, Dk = rot + draw(st.integers(0, 3)), rot + draw(st.integers(0, 3))
    max_pos = draw(st.integers(2, 12))
    return dict(
        q=torch.randn((*tok, Hq, Dq), generator=g).to(dtype),
        k=torch.randn((*tok, Hk, Dk), generator=g).to(dtype),
        positions=torch.randint(0, max_pos, tok, generator=g),
        cos_sin_cache=make_cache(max_pos, rot),
        inplace=draw(st.booleans()),
    ), dict(tok=tok, rot=rot, half=half, Hq=Hq, Hk=Hk, Dq=Dq, Dk=Dk, max_pos=max_pos, dtype=dtype)


def _overlapping_k(draw, a, m):
    """k sharing memory with q: q itself, a range of q's heads, or q's memory with tokens and heads swapped."""
    q = a["q"]
    how = draw(st.sampled_from(["same", "heads", "swapped"]))
    if how == "heads":
        h0 = draw(st.integers(0, m["Hq"] - 1))
        return q[..., h0 : h0 + draw(st.integers(1, m["Hq"] - h0)), :]
    if how == "swapped" and q.dim() == 3 and q.shape[0] == q.shape[1]:
        return q.transpose(0, 1)
    return q


ROPE_MUTATIONS = {
    # name: (mutate(draw, args, meta) -> args, exception, message fragment)
    "q-dtype": (
        lambda d, a, m: {**a, "q": a["q"].to(d(st.sampled_from([torch.float64, torch.int32])))},
        ValueError,
        "q: expected dtype in",
    ),
    "k-dtype": (
        lambda d, a, m: {**a, "k": a["k"].to(F16 if m["dtype"] != F16 else F32)},
        ValueError,
        "k: expected the dtype of q",
    ),
    "q-rank": (lambda d, a, m: {**a, "q": a["q"].flatten(0, -2)[0]}, ValueError, "q: expected a 3-D or 4-D tensor"),
    "k-tokens": (
        lambda d, a, m: {**a, "k": torch.randn(m["tok"][0] + 1, *a["k"].shape[1:]).to(m["dtype"])},
        ValueError,
        "k: expected",
    ),
    "q-out-last-stride": (
        lambda d, a, m: {
            **a,
            "inplace": False,
            "q_out": torch.randn(*a["q"].shape[:-1], 2 * m["Dq"]).to(m["dtype"])[..., ::2],
        },
        ValueError,
        "q_out: expected stride 1 in the last dimension",
    ),
    "rotary-odd": (
        lambda d, a, m: {**a, "rotary_dim": m["rot"] - 1},
        ValueError,
        "rotary_dim: expected a positive even int",
    ),
    "rotary-width": (
        lambda d, a, m: {**a, "rotary_dim": m["rot"] + 2},
        ValueError,
        "rotary_dim: expected the width of cos_sin_cache",
    ),
    "head-small": (
        lambda d, a, m: {**a, "k": a["k"][..., : m["rot"] - d(st.integers(1, m["rot"]))]},
        ValueError,
        "k: expected a head size >= rotary_dim",
    ),
    "positions-dtype": (
        lambda d, a, m: {**a, "positions": a["positions"].float()},
        ValueError,
        "positions: expected dtype in (int32, int64)",
    ),
    "positions-shape": (
        lambda d, a, m: {**a, "positions": torch.zeros(m["tok"][-1] + 1, dtype=torch.long)},
        ValueError,
        "positions: expected",
    ),
    "table-dtype": (
        lambda d, a, m: {**a, "cos_sin_cache": a["cos_sin_cache"].double()},
        ValueError,
        "cos_sin_cache: expected dtype",
    ),
    "mrope-sum": (
        lambda d, a, m: {
            **a,
            "positions": torch.zeros(3, *m["tok"], dtype=torch.long),
            "mrope_section": [m["half"], 1, 0],
        },
        ValueError,
        "mrope_section: expected sections summing to rotary_dim // 2",
    ),
    "mrope-positions": (lambda d, a, m: {**a, "mrope_section": [m["half"], 0, 0]}, ValueError, "positions: expected"),
    "inplace-overlap": (
        lambda d, a, m: {**a, "k": _overlapping_k(d, a, m), "inplace": True},
        ValueError,
        "k: expected memory disjoint from q when inplace=True",
    ),
    "inplace-broadcast": (
        lambda d, a, m: {**a, "q": a["q"][..., :1, :].expand_as(a["q"]), "inplace": True},
        ValueError,
        "q: expected a tensor without broadcast",
    ),
    "strict-position": (
        lambda d, a, m: {
            **a,
            "positions": a["positions"]
            .flatten()
            .index_fill(
                0,
                torch.tensor([d(st.integers(0, a["positions"].numel() - 1))]),
                d(st.sampled_from([-1, m["max_pos"], 2**40])),
            )
            .view(m["tok"]),
            "strict": True,
        },
        ValueError,
        "positions: expected values in [0, ",
    ),
}


@st.composite
def bad_rope_calls(draw):
    a, m = _rope_base(draw)
    name = draw(st.sampled_from(sorted(ROPE_MUTATIONS)))
    mutate, exc, fragment = ROPE_MUTATIONS[name]
    return name, mutate(draw, a, m), exc, fragment


def _snapshot(args):
    return [
        (x, bits(x.detach()).clone()) for x in args.values() if isinstance(x, torch.Tensor) and x.device.type != "meta"
    ]


def _raises(op, fn, args, exc, fragment):
    strict_mode = args.pop("strict", False)
    snap = _snapshot(args)
    with ropekit.strict(strict_mode):
        with pytest.raises(exc) as info:
            fn(**args)
    msg = str(info.value)
    assert msg.startswith(f"{op}: ") and fragment in msg, msg
    for x, b in snap:
        assert torch.equal(bits(x.detach()), b), "written before the error"


@settings(max_examples=300, **SETTINGS)
@given(call=bad_rope_calls())
def test_apply_rope_refuses_invalid(call):
    name, args, exc, fragment = call
    _raises("apply_rope", ropekit.apply_rope, args, exc, fragment)


ANGLE_MUTATIONS = {
    "sin-shape": (
        lambda d, a, m: {**a, "sin": a["sin"][..., : max(1, m["half"] - 1)] if m["half"] > 1 else a["sin"][..., :0]},
        ValueError,
        "sin: expected the shape and dtype of cos",
    ),
    "sin-dtype": (
        lambda d, a, m: {**a, "sin": a["sin"].half()},
        ValueError,
        "sin: expected the shape and dtype of cos",
    ),
    "cos-dtype": (
        lambda d, a, m: {**a, "cos": a["cos"].double(), "sin": a["sin"].double()},
        ValueError,
        "cos: expected dtype",
    ),
    "not-broadcastable": (
        lambda d, a, m: {
            **a,
            "cos": torch.ones(m["tok"][-1] + 1, m["half"]),
            "sin": torch.zeros(m["tok"][-1] + 1, m["half"]),
        },
        ValueError,
        "cos: expected a shape broadcastable to",
    ),
    "head-small": (
        lambda d, a, m: {
            **a,
            "cos": torch.ones(*m["tok"], m["half"] + m["Dq"]),
            "sin": torch.zeros(*m["tok"], m["half"] + m["Dq"]),
        },
        ValueError,
        "expected a head size >= rotary_dim",
    ),
    "cos-type": (lambda d, a, m: {**a, "cos": a["cos"].tolist()}, TypeError, "cos: expected a torch.Tensor"),
    "k-tokens": (
        lambda d, a, m: {**a, "k": torch.randn(m["tok"][0] + 1, *a["k"].shape[1:]).to(m["dtype"])},
        ValueError,
        "k: expected",
    ),
}


@st.composite
def bad_angle_calls(draw):
    a, m = _rope_base(draw)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    ang = torch.rand((*m["tok"], m["half"]), generator=g)
    args = dict(q=a["q"], k=a["k"], cos=ang.cos(), sin=ang.sin())
    name = draw(st.sampled_from(sorted(ANGLE_MUTATIONS)))
    mutate, exc, fragment = ANGLE_MUTATIONS[name]
    return name, mutate(draw, args, m), exc, fragment


@settings(max_examples=100, **SETTINGS)
@given(call=bad_angle_calls())
def test_rotate_with_angles_refuses_invalid(call):
    name, args, exc, fragment = call
    _raises("rotate_with_angles", ropekit.rotate_with_angles, args, exc, fragment)


def _store_base(draw):
    a, m = _rope_base(draw)
    del a["inplace"]
    NB, BS = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    n = math.prod(m["tok"])
    layout = draw(st.sampled_from(["nhd", "hnd", "flat", "kv_joint"]))
    Dv = m["Dk"]
    caches = Caches(LAYOUTS[layout], NB, BS, m["Hk"], m["Dk"], Dv, m["dtype"], "cpu")  # k may be a view of it
    slots = torch.randperm(max(n, NB * BS))[:n].view(m["tok"])
    slots = torch.where(slots < NB * BS, slots, -1)
    a.update(
        v=torch.randn(*m["tok"], m["Hk"], Dv).to(m["dtype"]), k_cache=caches.k, v_cache=caches.v, slot_mapping=slots
    )
    m.update(NB=NB, BS=BS, num_slots=NB * BS, caches=caches)
    return a, m


def _overlapping_caches(draw, a, m):
    """k_cache and v_cache of the right shapes sharing memory: the same tensor, or two contiguous
    views of one buffer `shift` elements apart (0 < shift < their size)."""
    shape = (m["NB"], m["BS"], m["Hk"], m["Dk"])
    n = math.prod(shape)
    if n == 1 or draw(st.booleans()):
        kc = torch.full(shape, NAN)
        return {**a, "k_cache": kc, "v_cache": kc}
    shift = draw(st.integers(1, n - 1))
    buf = torch.full((n + shift,), NAN)
    return {**a, "k_cache": buf[:n].view(shape), "v_cache": buf[shift:].view(shape)}


STORE_MUTATIONS = {
    "k-none": (lambda d, a, m: {**a, "k": None}, TypeError, "k: expected a torch.Tensor"),
    "v-dtype": (lambda d, a, m: {**a, "v": a["v"].double()}, ValueError, "v: expected dtype"),
    "slots-dtype": (
        lambda d, a, m: {**a, "slot_mapping": a["slot_mapping"].float()},
        ValueError,
        "slot_mapping: expected dtype in (int32, int64)",
    ),
    "slots-shape": (
        lambda d, a, m: {**a, "slot_mapping": torch.zeros(m["tok"][-1] + 1, dtype=torch.long)},
        ValueError,
        "slot_mapping: expected",
    ),
    "cache-heads": (
        lambda d, a, m: {**a, "k_cache": torch.zeros(m["NB"], m["BS"], m["Hk"] + 1, m["Dk"])},
        ValueError,
        "k_cache: expected (heads, head size)",
    ),
    "cache-head-size": (
        lambda d, a, m: {**a, "v_cache": torch.zeros(m["NB"], m["BS"], m["Hk"], m["Dk"] + 1)},
        ValueError,
        "v_cache: expected (heads, head size)",
    ),
    "cache-dtype": (
        lambda d, a, m: {
            **a,
            "k_cache": torch.zeros(
                m["NB"], m["BS"], m["Hk"], m["Dk"], dtype=d(st.sampled_from([torch.float64, torch.int8]))
            ),
        },
        ValueError,
        "k_cache: expected dtype",
    ),
    "cache-slot-dims": (
        lambda d, a, m: {**a, "v_cache": torch.zeros(m["NB"] + 1, m["BS"], m["Hk"], m["Dk"])},
        ValueError,
        "v_cache: expected slot dims",
    ),
    "caches-overlap": (_overlapping_caches, ValueError, "v_cache: expected memory disjoint from k_cache"),
    # a read-only k may broadcast: one cache row, seen by every token
    "k-in-cache": (
        lambda d, a, m: {**a, "k": a["k_cache"][(0,) * (a["k_cache"].dim() - 2)].expand_as(a["k"])},
        ValueError,
        "k: expected memory disjoint from k_cache",
    ),
    "q-is-k": (
        lambda d, a, m: {**a, "q": a["k"][..., : d(st.integers(1, m["Hk"])), :]},
        ValueError,
        "k: expected memory disjoint from q",
    ),
    "scale-value": (
        lambda d, a, m: {
            **a,
            d(st.sampled_from(["k_scale", "v_scale"])): d(st.sampled_from([-1.0, 0.0, math.inf, math.nan])),
        },
        ValueError,
        "_scale: expected a finite scale > 0",
    ),
    "scale-type": (
        lambda d, a, m: {**a, "k_scale": d(st.sampled_from(["2", True, [1.0]]))},
        TypeError,
        "k_scale: expected a float",
    ),
    "strict-slot": (
        lambda d, a, m: {
            **a,
            "slot_mapping": torch.full(m["tok"], m["num_slots"] + d(st.integers(0, 3))),
            "strict": True,
        },
        ValueError,
        "slot_mapping: expected values <",
    ),
    "strict-position": (
        lambda d, a, m: {
            **a,
            "positions": torch.full(m["tok"], d(st.sampled_from([-1, m["max_pos"]]))),
            "strict": True,
        },
        ValueError,
        "positions: expected values in [0, ",
    ),
    "strict-scale": (
        lambda d, a, m: {**a, "v_scale": torch.tensor([d(st.sampled_from([0.0, -2.0, math.inf]))]), "strict": True},
        ValueError,
        "v_scale: expected a finite scale > 0",
    ),
}


@st.composite
def bad_store_calls(draw):
    a, m = _store_base(draw)
    name = draw(st.sampled_from(sorted(STORE_MUTATIONS)))
    mutate, exc, fragment = STORE_MUTATIONS[name]
    return name, mutate(draw, a, m), exc, fragment


@settings(max_examples=300, **SETTINGS)
@given(call=bad_store_calls())
def test_apply_rope_and_store_refuses_invalid(call):
    name, args, exc, fragment = call
    _raises("apply_rope_and_store", apply_rope_and_store, args, exc, fragment)
