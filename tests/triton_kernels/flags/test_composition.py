"""The composition matrix: every feature of the rotation ops against every other, generated.

    layout  x  norm  x  angle source  x  write  x  mode
    {half-split, interleaved, partial, M-RoPE} x {none, q, k, both per head, both across heads,
    both with weight offset} x {positions, cu_seqlens, cu_seqlens with CP, per-token angles} x
    {out of place, in place, store into a paged cache, store into a flat cache} x {eager, grad,
    torch.compile fullgraph (forward and backward)}

Each cell is one call through the public ops on fresh random inputs (outputs poisoned with NaN),
compared with the float64 oracle: outputs, cache rows, and with grad the gradients of q and k.
A cell is one of:
- supported: it must match the oracle;
- meaningless (a gradient through the KV-cache store, M-RoPE's 3-D positions from 1-D packed
  sequences, ...): it must be refused with a ValueError naming the op, and nothing written;
- a known gap: a combination with a meaning that the ops do not take yet: marked xfail(strict),
  so the cell turns red the day it starts working and must then move to supported.

CI runs a pairwise cover of the cells (every pair of factor values at least once) on the Triton
interpreter; on CUDA (marked gpu) every cell runs (torch.compile cells pairwise).
"""

from __future__ import annotations

import itertools
import re
import zlib

import pytest
import torch

import ropekit
from ropekit.tools import reference

from conftest import make_cache

pytestmark = pytest.mark.usefixtures("poison")

LAYOUTS = ("half", "interleaved", "partial", "mrope")
NORMS = ("none", "q", "k", "both_head", "both_across", "offset")
ANGLES = ("positions", "packed", "packed_cp", "per_token")
WRITES = ("out", "inplace", "store_paged", "store_flat")
MODES = ("eager", "grad", "compile")
FACTORS = (LAYOUTS, NORMS, ANGLES, WRITES, MODES)

T, HQ, HK, D, MAXPOS = 8, 4, 2, 32, 64
CU = (0, 3, 8)  # two packed sequences
CU_CP = (0, 2, 8)  # even local lengths: context-parallel shards
SECTIONS = (8, 4, 4)  # M-RoPE frequencies per position row (rotary half 16)


def pairwise(factors):
    """A small set of cells covering every pair of values of every two factors (greedy)."""
    want = set()
    for (i, a), (j, b) in itertools.combinations(enumerate(factors), 2):
        want |= {(i, x, j, y) for x in a for y in b}
    cells = []
    everything = list(itertools.product(*factors))
    while want:

        def gain(cell):
            return sum((i, cell[i], j, cell[j]) in want for i, j in itertools.combinations(range(len(cell)), 2))

        best = max(everything, key=gain)
        cells.append(best)
        want -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(best)), 2)}
    return cells


def verdict(layout, norm, angles, write, mode):
    """("ok" | "refused" | "gap", why) for one cell."""
    store = write.startswith("store")
    # what the ops cannot be asked yet comes first: such a call fails on its keywords
    if store and angles == "per_token":
        return "gap", "the fused store takes positions and a table, not per-token angles"
    if store and mode == "grad":
        return "refused", "a gradient through the KV-cache store"
    if layout == "mrope" and angles.startswith("packed"):
        return "refused", "M-RoPE needs (3, T) positions; cu_seqlens derives 1-D positions"
    if write == "inplace" and norm != "none" and mode in ("grad", "compile"):
        return "refused", "in place with the norm under autograd (the norm's backward needs its input)"
    return "ok", ""


def _norm_weights(norm, g):
    if norm == "none":
        return None, None, 0.0
    across = norm == "both_across"
    wq = torch.randn((HQ * D) if across else D, generator=g) * 0.5 + 1.0 if norm != "k" else None
    wk = torch.randn((HK * D) if across else D, generator=g) * 0.5 + 1.0 if norm != "q" else None
    return wq, wk, (1.0 if norm == "offset" else 0.0)


def _inputs(cell, device):
    layout, norm, angles, write, mode = cell
    g = torch.Generator().manual_seed(zlib.crc32("-".join(cell).encode()))  # the same inputs in every process
    rot = 16 if layout == "partial" else D
    table = make_cache(MAXPOS, rot)
    q = torch.randn(T, HQ, D, generator=g)
    k = torch.randn(T, HK, D, generator=g)
    v = torch.randn(T, HK, D, generator=g)
    cu = None
    if angles == "packed":
        cu = torch.tensor(CU)
        positions = ropekit.positions_from_cu_seqlens(cu)
    elif angles == "packed_cp":
        cu = torch.tensor(CU_CP)
        positions = ropekit.positions_from_cu_seqlens(cu, cp_size=2, cp_rank=1)
    elif layout == "mrope":
        positions = torch.randint(0, MAXPOS, (3, T), generator=g)
    else:
        positions = torch.randint(0, MAXPOS, (T,), generator=g)
    wq, wk, offset = _norm_weights(norm, g)
    slots = torch.randperm(24, generator=g)[:T]
    slots[2] = -1  # padding: not stored
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return dict(
        q=to(q),
        k=to(k),
        v=to(v),
        positions=to(positions),
        cu=to(cu),
        table=to(table),
        wq=to(wq),
        wk=to(wk),
        offset=offset,
        slots=to(slots),
        rot=rot,
    )


def _angles64(cell, a):
    layout = cell[0]
    kw = dict(mrope_section=SECTIONS) if layout == "mrope" else {}
    return reference.angles_from_table(a["table"].double().cpu(), a["positions"].cpu(), (T,), rotary_dim=a["rot"], **kw)


def _oracle(cell, a, q, k):
    """float64 outputs of q and k (differentiable in q and k when they require grad)."""
    c, s = _angles64(cell, a)
    il = cell[0] == "interleaved"
    outs = []
    for x, w in ((q, a["wq"]), (k, a["wk"])):
        y = x if w is None else reference.rms_norm(x, w.double().cpu(), eps=1e-6, offset=a["offset"])
        outs.append(reference.rotate(y, c, s, interleaved=il))
    return outs


def _call(cell, a, q, k, v=None, caches=None):
    """The public op for the cell: (q_out, k_out) (or q for the store)."""
    layout, norm, angles, write, mode = cell
    kw = dict(interleaved=layout == "interleaved")
    if a["wq"] is not None or a["wk"] is not None:
        kw.update(q_norm_weight=a["wq"], k_norm_weight=a["wk"], norm_weight_offset=a["offset"])
    if write.startswith("store"):
        k_cache, v_cache = caches
        positions = a["positions"]
        if layout == "mrope":
            kw.update(mrope_section=SECTIONS)
        if angles.startswith("packed"):  # the store's own form of each angle source
            positions = None
            kw.update(cu_seqlens=a["cu"], **(dict(cp_size=2, cp_rank=1) if angles == "packed_cp" else {}))
        if angles == "per_token":
            half = a["rot"] // 2
            kw.update(cos=a["table"][positions, :half], sin=a["table"][positions, half : a["rot"]])
        return ropekit.apply_rope_and_store(q, k, v, positions, a["table"], k_cache, v_cache, a["slots"], **kw)
    if angles == "per_token":
        half = a["rot"] // 2
        c, s = a["table"][:, :half], a["table"][:, half : a["rot"]]
        if layout == "mrope":
            c, s = c[a["positions"]], s[a["positions"]]  # (3, T, half)
            kw.update(mrope_section=SECTIONS)
        else:
            c, s = c[a["positions"]], s[a["positions"]]
        return ropekit.rotate_with_angles(q, k, c, s, inplace=write == "inplace", **kw)
    if layout == "mrope":
        kw.update(mrope_section=SECTIONS)
    if angles == "positions":
        positions = a["positions"]
    else:
        positions = None
        kw.update(cu_seqlens=a["cu"])
        if angles == "packed_cp":
            kw.update(cp_size=2, cp_rank=1)
    return ropekit.apply_rope(q, k, positions, a["table"], inplace=write == "inplace", **kw)


def _close(got, want, what, tol=2e-5):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN (an element left unwritten?)"
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.2e}"


def _run_store(cell, a):
    paged = cell[3] == "store_paged"
    shape = (3, 8, HK, D) if paged else (24, HK, D)
    k_cache = torch.full(shape, float("nan"), device=a["q"].device)
    v_cache = torch.full(shape, float("nan"), device=a["q"].device)
    q = a["q"].clone().requires_grad_(cell[4] == "grad")
    want_q, want_k = _oracle(cell, a, a["q"].double().cpu(), a["k"].double().cpu())

    def f(q, k, v, k_cache, v_cache):
        _call(cell, a, q, k, v, (k_cache, v_cache))

    if cell[4] == "compile":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="eager")
    f(q, a["k"], a["v"], k_cache, v_cache)
    q = q.detach()
    _close(q, want_q, "q (rotated in place)")
    k_rows, v_rows = k_cache.view(24, HK, D), v_cache.view(24, HK, D)
    for t, slot in enumerate(a["slots"].tolist()):
        if slot >= 0:
            _close(k_rows[slot], want_k[t], f"k cache row of token {t}")
            assert torch.equal(v_rows[slot], a["v"][t]), f"v cache row of token {t}"
    unused = torch.ones(24, dtype=torch.bool)
    unused[a["slots"][a["slots"] >= 0].cpu()] = False
    assert torch.isnan(k_rows[unused.to(k_rows.device)]).all(), "a cache row no slot names was written"


def _run_rotation(cell, a):
    mode, write = cell[4], cell[3]
    grad = mode in ("grad", "compile")
    q_leaf = a["q"].clone().requires_grad_(grad)
    k_leaf = a["k"].clone().requires_grad_(grad)

    def f(q_leaf, k_leaf):
        # in place under autograd writes non-leaf tensors (autograd's rule), as a model's q/k are
        q, k = (q_leaf * 1.0, k_leaf * 1.0) if write == "inplace" else (q_leaf, k_leaf)
        qo, ko = _call(cell, a, q, k)
        if write == "inplace":
            assert qo is q and ko is k
        return qo, ko

    if mode == "compile":
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="eager")
    qo, ko = f(q_leaf, k_leaf)
    q64 = a["q"].double().cpu().requires_grad_(grad)
    k64 = a["k"].double().cpu().requires_grad_(grad)
    want_q, want_k = _oracle(cell, a, q64, k64)
    _close(qo, want_q, "q")
    _close(ko, want_k, "k")
    if grad:
        gq, gk = torch.randn_like(want_q), torch.randn_like(want_k)
        ((qo * gq.to(qo)).sum() + (ko * gk.to(ko)).sum()).backward()
        ((want_q * gq).sum() + (want_k * gk).sum()).backward()
        _close(q_leaf.grad, q64.grad, "grad of q")
        _close(k_leaf.grad, k64.grad, "grad of k")


def run_cell(cell, device):
    kind, why = verdict(*cell)
    a = _inputs(cell, device)
    if kind == "refused":
        before = {n: x.clone() for n, x in a.items() if isinstance(x, torch.Tensor)}
        # under torch.compile(fullgraph=True) Dynamo reports the op's ValueError inside its own error
        with pytest.raises((ValueError, torch._dynamo.exc.Unsupported)) as info:
            if cell[3].startswith("store"):
                _run_store(cell, a)
            else:
                _run_rotation(cell, a)
        msg = str(info.value)
        if isinstance(info.value, ValueError):
            assert msg.startswith(("apply_rope", "rotate_with_angles")), msg
        else:
            # the ValueError's text inside Dynamo's report (its wrapping differs between torch versions)
            assert cell[4] == "compile" and re.search(r"ValueError\(.*(apply_rope|rotate_with_angles)\w*: ", msg), msg
        for n, x in before.items():
            assert torch.equal(a[n].nan_to_num(), x.nan_to_num()), f"{n} written before the refusal"
        return
    if cell[3].startswith("store"):
        _run_store(cell, a)
    else:
        _run_rotation(cell, a)


def _param(cell, gpu=False):
    kind, why = verdict(*cell)
    marks = [pytest.mark.gpu] if gpu else []
    if kind == "gap":
        marks.append(pytest.mark.xfail(strict=True, reason=f"known gap: {why}"))
    return pytest.param(cell, marks=marks, id="-".join(cell))


PAIRWISE = pairwise(FACTORS)
EVERY = [c for c in itertools.product(*FACTORS) if c[4] != "compile" or c in PAIRWISE]


@pytest.mark.parametrize("cell", [_param(c) for c in PAIRWISE])
def test_cell_pairwise_cpu(cell):
    run_cell(cell, "cpu")


@pytest.mark.parametrize("cell", [_param(c, gpu=True) for c in EVERY])
def test_cell_every_cuda(cell):
    run_cell(cell, "cuda")


def test_pairwise_cover_is_complete():
    for (i, a), (j, b) in itertools.combinations(enumerate(FACTORS), 2):
        for x in a:
            for y in b:
                assert any(c[i] == x and c[j] == y for c in PAIRWISE), (x, y)
