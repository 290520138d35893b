"""The backward of q/k RMSNorm + rotation (rope_norm_backward_kernel, launched through
plans.plan_norm_backward / fire_norm_backward) for every angle source the forward takes, each
norm mode and every input / output pair layout, against autograd through a float64 reference of

    y = rotate(rmsnorm(x) * (w + offset))        (mode 0: y = rotate(x))

Input gradients come back NaN-poisoned and the weight-gradient partial sums start as NaN, so an
element the kernel skips fails.
"""

from __future__ import annotations

import pytest
import torch

from ropekit import positions_from_cu_seqlens
from ropekit.core import freqs, plans, run, tuning
from ropekit.core.variant import Variant
from ropekit.tools import reference

from conftest import make_cache, rel_err

EPS = 1e-6
OFFSET = 0.5


def strided(*shape, device="cpu", dtype=torch.float32, gen=None):
    """Random values in a view whose head and token strides are not the dense ones."""
    full = torch.randn(*shape[:-1], shape[-1] + 4, generator=gen, dtype=torch.float64)
    return full.to(device=device, dtype=dtype)[..., : shape[-1]]


class Case:
    """One angle source: the tensors' shape, the rotary width, the forward's angle operands (a, b)
    as pipeline.run_rotate takes them, and the float64 per-token cos / sin of the reference."""

    def __init__(self, token_shape, heads, dim, rot, angles, a, b, cos, sin, sections=(0, 0, 0), packed=(1, 0)):
        self.shape = (*token_shape, heads, dim)
        self.rot = rot
        self.angles, self.sections, self.packed = angles, sections, packed
        self.a, self.b = a, b
        self.cos, self.sin = cos, sin

    def variant(self, il_in, il_out, inverse=False) -> Variant:
        return Variant(il_in, il_out, 0, self.sections, self.angles, inverse)

    def angle_strides(self):
        """What a spec holds for per-token angles: the kernel's (sec, b, s, col) strides."""
        if self.angles != "tokens":
            return None
        return plans.per_token_strides(self.a, len(self.shape) - 2, False)


def table_case(positions, heads, dim, rot, rows=16):
    table = make_cache(rows, rot)
    cos, sin = reference.angles_from_table(table.double(), positions, tuple(positions.shape))
    return Case(tuple(positions.shape), heads, dim, rot, "table", positions, table, cos, sin)


def arange_case(token_shape, heads, dim, rot):
    table = make_cache(token_shape[-1] + 2, rot)
    cos, sin = reference.angles_from_table(table.double(), None, token_shape)
    return Case(token_shape, heads, dim, rot, "arange", None, table, cos, sin)


def packed_case(cu, cp_size, cp_rank, heads, dim, rot):
    cu = torch.tensor(cu, dtype=torch.int32)
    positions = positions_from_cu_seqlens(cu, cp_size=cp_size, cp_rank=cp_rank)
    table = make_cache(int(positions.max()) + 3, rot)
    cos, sin = reference.angles_from_table(table.double(), positions, tuple(positions.shape))
    return Case(tuple(positions.shape), heads, dim, rot, "packed", cu, table, cos, sin, packed=(cp_size, cp_rank))


def tokens_case(token_shape, heads, dim, rot):
    """Per-token cos / sin, shared by the batch (a stride-0 batch dim, as validation passes them)."""
    angle = torch.rand(1, token_shape[-1], rot // 2, dtype=torch.float64) * 6.0
    cos = angle.cos().float().expand(*token_shape, rot // 2)
    sin = angle.sin().float().expand(*token_shape, rot // 2)
    return Case(token_shape, heads, dim, rot, "tokens", cos, sin, cos.double(), sin.double())


def freqs_case(positions, axes_dim, heads, dim):
    """Angles computed in the kernel from positions x inverse frequencies: one axis (positions
    (*T), float) or axial (positions (len(axes_dim), *T))."""
    inv = freqs.axial_inv_freq(axes_dim)
    axes = tuple(d // 2 for d in axes_dim) if len(axes_dim) > 1 else ()
    token_shape = tuple(positions.shape[1:] if axes else positions.shape)
    cos, sin = reference.angles_from_freqs(positions, inv, axes, dtype=torch.float64)
    return Case(token_shape, heads, dim, sum(axes_dim), "freqs", positions, inv, cos, sin, sections=axes)


CASES = {
    "table-T": lambda: table_case(torch.tensor([3, 0, 15, 7, 7], dtype=torch.int32), 3, 32, 24),
    "table-BS": lambda: table_case(torch.tensor([[1, 4, 2], [9, 0, 5]]), 2, 16, 16),
    "arange": lambda: arange_case((2, 3), 4, 32, 32),
    "packed-cp1": lambda: packed_case([0, 2, 5, 6], 1, 0, 2, 16, 12),
    "packed-cp2": lambda: packed_case([0, 2, 6], 2, 1, 3, 16, 16),
    "tokens": lambda: tokens_case((2, 3), 2, 32, 24),
    "freqs-1axis": lambda: freqs_case(torch.tensor([0.0, 2.5, 7.25, 130.5, 11.0]), (12,), 2, 16),
    "freqs-3axes": lambda: freqs_case(torch.randint(0, 40, (3, 2, 3)), (4, 6, 6), 3, 32),
    "freqs-3axes-float": lambda: freqs_case(torch.rand(3, 4) * 50, (4, 4, 8), 2, 16),
}


def weight(case: Case, mode: int):
    """None (mode 0), a (D,) per-head weight or an (H*D,) across-heads one."""
    if mode == 0:
        return None
    h, d = case.shape[-2], case.shape[-1]
    return 0.5 + 0.3 * torch.randn(d if mode == 1 else h * d)


def backward(case: Case, variant: Variant, x, g, w, mode: int):
    """gx and the weight's gradient (None for mode 0) from one plan and launch."""
    gx = run.empty_like(x)
    angles = plans.angle_layout(variant, case.rot, case.a, case.b, case.angle_strides(), case.packed)
    plan = plans.plan_norm_backward(x, g, gx, w, angles, variant, mode)
    dw = None if w is None else plans.norm_partials(plan, x.device).fill_(float("nan"))
    plans.fire_norm_backward(plan, x, g, gx, w, dw, case.a, case.b, EPS, OFFSET)
    return gx, (None if w is None else plans.norm_weight_grad(dw, w))


def reference_grads(case: Case, variant: Variant, x, g, w):
    """Autograd through the float64 forward: (gx, gw)."""
    xd = x.double().requires_grad_(True)
    wd = None if w is None else w.double().requires_grad_(True)
    y = xd if wd is None else reference.rms_norm(xd, wd, eps=EPS, offset=OFFSET)
    cos, sin = case.cos.to(x.device), case.sin.to(x.device)
    y = reference.rotate(
        y, cos, sin, interleaved=variant.interleaved, out_interleaved=variant.out_interleaved, inverse=variant.inverse
    )
    y.backward(g.double())
    return xd.grad, (None if wd is None else wd.grad)


def check(case: Case, variant: Variant, mode: int, tol=1e-5):
    x = strided(*case.shape)
    g = strided(*case.shape)
    w = weight(case, mode)
    gx, gw = backward(case, variant, x, g, w, mode)
    want_gx, want_gw = reference_grads(case, variant, x, g, w)
    assert rel_err(gx, want_gx) < tol
    if mode:
        assert gw.dtype == w.dtype and gw.shape == w.shape
        assert rel_err(gw, want_gw) < tol
    else:
        assert gw is None


@pytest.mark.parametrize("layout", [(False, False), (True, True), (False, True), (True, False)], ids=str)
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("source", sorted(CASES))
def test_every_angle_source(poison, source, mode, layout):
    torch.manual_seed(0)
    case = CASES[source]()
    # two programs: each walks several tokens, the last one fewer
    with tuning.override(norm_bwd_programs=2):
        check(case, case.variant(*layout), mode)


@pytest.mark.parametrize("programs", [1, 3, 1024])
@pytest.mark.parametrize("mode", [1, 2])
def test_programs_split_tokens(poison, programs, mode):
    """One program for all tokens, a ragged split, and one program per token: the partial rows
    sum to the same weight gradient."""
    torch.manual_seed(1)
    case = CASES["table-BS"]()
    with tuning.override(norm_bwd_programs=programs):
        check(case, case.variant(False, False), mode)


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("source", ["table-T", "freqs-3axes"])
def test_inverse_forward(poison, source, mode):
    """A forward that rotated by -angle (apply_rope(inverse=True)) has its own backward."""
    torch.manual_seed(2)
    case = CASES[source]()
    check(case, case.variant(True, False, inverse=True), mode)


def test_mrope_table(poison):
    """M-RoPE positions (3, *T) with chunked sections through the same launch."""
    torch.manual_seed(3)
    positions = torch.randint(0, 16, (3, 2, 3))
    table = make_cache(16, 16)
    cos, sin = reference.angles_from_table(table.double(), positions, (2, 3), mrope_section=(2, 3, 3))
    case = Case((2, 3), 2, 16, 16, "table", positions, table, cos, sin, sections=(2, 3, 3))
    variant = Variant(False, False, 1, (2, 3, 3), "table")
    for mode in (0, 1, 2):
        check(case, variant, mode)


def test_out_of_range_position_gives_nan(poison):
    """A position past the table reads nothing: that token's rotated gradient is NaN, the others exact."""
    torch.manual_seed(4)
    case = table_case(torch.tensor([1, 99, 2]), 2, 16, 16)
    x, g = torch.randn(case.shape), torch.randn(case.shape)
    gx, _ = backward(case, case.variant(False, False), x, g, None, 0)
    assert gx[1].isnan().all()
    ok = torch.tensor([True, False, True])
    want, _ = reference_grads(case, case.variant(False, False), x, g, None)
    assert rel_err(gx[ok], want[ok]) < 1e-6


def test_empty_call_plans_nothing():
    case = table_case(torch.zeros(0, dtype=torch.long), 2, 16, 16)
    x = torch.randn(case.shape)
    w = torch.ones(16)
    angles = plans.angle_layout(case.variant(False, False), 16, case.a, case.b, None)
    plan = plans.plan_norm_backward(x, x, torch.empty_like(x), w, angles, case.variant(False, False), 1)
    assert plan is None
    plans.fire_norm_backward(plan, x, x, x, w, None, case.a, case.b, EPS, OFFSET)  # nothing to launch


@pytest.mark.parametrize(
    "mode, size, given",
    [
        (0, 16, "16 for mode 0"),
        (1, 32, "32 for mode 1"),
        (2, 16, "16 for mode 2"),
        (1, None, "None for mode 1"),
        (3, 16, "16 for mode 3"),
    ],
)
def test_weight_that_does_not_fit_the_mode(mode, size, given):
    case = CASES["table-BS"]()  # 2 heads of 16
    x = torch.randn(case.shape)
    w = None if size is None else torch.ones(size)
    variant = case.variant(False, False)
    angles = plans.angle_layout(variant, case.rot, case.a, case.b, None)
    with pytest.raises(ValueError) as err:
        plans.plan_norm_backward(x, x, torch.empty_like(x), w, angles, variant, mode)
    assert str(err.value) == (
        "plan_norm_backward: w: expected no weight for mode 0 or 3, 16 elements for mode 1, 32 for mode 2, got " + given
    )


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("source", ["table", "packed", "freqs"])
def test_large_on_gpu(poison, source, mode):
    """A training-sized call in bf16: several tokens per program, 16 heads of 128, a partial rotary
    width with a tail, interleaved input and half-split output."""
    gen = torch.Generator().manual_seed(5)
    B, S, H, D, rot = 4, 1536, 16, 128, 96
    if source == "table":
        case = table_case(torch.randint(0, 4096, (B, S), generator=gen), H, D, rot, rows=4096)
    elif source == "packed":
        case = packed_case([0, 1000, 1002, 4000, 6144], 2, 1, H, D, rot)
    else:
        case = freqs_case(torch.rand(3, B, S, generator=gen) * 1000, (32, 32, 32), H, D)
    dev = lambda t: None if t is None else t.cuda()  # noqa: E731
    case.a, case.b = dev(case.a), dev(case.b)
    variant = case.variant(True, False)
    x = strided(*case.shape, device="cuda", dtype=torch.bfloat16, gen=gen)
    g = strided(*case.shape, device="cuda", dtype=torch.bfloat16, gen=gen)
    w = None if mode == 0 else (0.5 + 0.3 * torch.randn(D if mode == 1 else H * D, generator=gen)).cuda()
    gx, gw = backward(case, variant, x, g, w, mode)
    want_gx, want_gw = reference_grads(case, variant, x, g, w)
    assert rel_err(gx, want_gx) < 1e-2
    if mode:
        assert rel_err(gw, want_gw) < 1e-4


@pytest.mark.gpu
@pytest.mark.bigmem
def test_past_2_31_elements_on_gpu(poison):
    """x, g and gx of more than 2^31 elements (per-head norm): the last tokens' gradients, past
    element 2^31, are right (every offset in int64)."""
    T, H, D = 262_145, 64, 128
    positions = torch.arange(T, device="cuda")
    table = make_cache(T, D, device="cuda")
    variant = Variant(angles="table")
    x = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    g = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    w = torch.rand(D, device="cuda") + 0.5
    gx, gw = backward(Case((T,), H, D, D, "table", positions, table, None, None), variant, x, g, w, 1)
    assert torch.isfinite(gw).all()
    last = slice(T - 3, T)
    cos, sin = reference.angles_from_table(table.double(), positions[last], (3,))
    tail_case = Case((3,), H, D, D, "table", positions[last], table, cos, sin)
    want_gx, _ = reference_grads(tail_case, variant, x[last], g[last], w)
    assert rel_err(gx[last], want_gx) < 1e-2


@pytest.mark.parametrize("layout", [(False, False), (True, True)], ids=str)
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("source", ["table-tail", "freqs-axial"])
def test_many_small_head_blocks(poison, source, mode, layout):
    """40 heads in blocks of 2 (block_elems 16, 4 rotated pairs a head, whole heads off): across
    heads, each token's sums run over all 20 blocks before any gradient is written, and the
    weight-gradient row accumulates in memory over several tokens a program; per head, blocks stay
    independent."""
    torch.manual_seed(5)
    if source == "table-tail":
        case = table_case(torch.tensor([[3, 0, 15], [7, 7, 1]]), 40, 16, 8)  # tail of 8 dims
    else:
        case = freqs_case(torch.randint(0, 40, (3, 5)), (2, 2, 4), 40, 16)
    with tuning.override(block_elems=16, across_block_elems=16, norm_bwd_programs=2, whole_heads=False):
        angles = plans.angle_layout(case.variant(*layout), case.rot, case.a, case.b, None, case.packed)
        x = torch.empty(case.shape)
        plan = plans.plan_norm_backward(x, x, x, weight(case, mode), angles, case.variant(*layout), mode)
        assert plan.meta["BLOCK_H"] == 2
        check(case, case.variant(*layout), mode)


@pytest.mark.gpu
def test_across_heads_wan_sized_on_gpu(poison):
    """Wan 2.1 14B's self-attention shape: 40 heads of 128 (blocks of 16 heads), 3-axis angles from
    inverse frequencies, bf16, across-heads weight of 40 * 128."""
    gen = torch.Generator().manual_seed(6)
    B, S, H, D = 1, 4096, 40, 128
    pos = torch.stack([torch.randint(0, 21, (B, S), generator=gen), *torch.randint(0, 90, (2, B, S), generator=gen)])
    case = freqs_case(pos, (44, 42, 42), H, D)
    case.a, case.b = case.a.cuda(), case.b.cuda()
    variant = case.variant(False, False)
    x = strided(*case.shape, device="cuda", dtype=torch.bfloat16, gen=gen)
    g = strided(*case.shape, device="cuda", dtype=torch.bfloat16, gen=gen)
    w = (0.5 + 0.3 * torch.randn(H * D, generator=gen)).cuda()
    gx, gw = backward(case, variant, x, g, w, 2)
    want_gx, want_gw = reference_grads(case, variant, x, g, w)
    assert rel_err(gx, want_gx) < 1e-2
    assert rel_err(gw, want_gw) < 1e-4
