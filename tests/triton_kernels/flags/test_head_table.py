"""apply_rope with a per-head table: cos_sin_cache (max_position, Ht, rotary_dim), one [cos | sin]
row per (position, head) (FoPE). Head j of a tensor of H heads reads table head j // (H / Ht): per
KV head with q's heads grouped (Ht = Hk), or per q head (Ht = Hq = Hk).

Forward and backward against the float64 oracle on fresh random tables and inputs, outputs
poisoned with NaN, the kernel (the Triton interpreter on CPU) and the PyTorch path; the oracle's
own head mapping against the 2-D oracle; a CUDA case (decode-sized and large token counts).
"""

import pytest
import torch

import ropekit
from ropekit.core import tuning
from ropekit.tools import reference

from conftest import TOL, fp8_close, rel_err

pytestmark = pytest.mark.usefixtures("poison")

P = 24  # table rows

CASES = [
    # (token shape, Hq, Hk, Ht, D, rotary_dim, keywords)
    ((6,), 4, 2, 2, 64, 64, {}),  # GQA: per KV head, q's heads in groups of 2
    ((6,), 4, 2, 2, 64, 64, {"interleaved": True}),
    ((2, 3), 4, 4, 4, 96, 32, {}),  # per q head; partial rotary (a kept tail), (B, S) positions
    ((5,), 6, 2, 1, 48, 32, {"rotary_position": "last"}),  # one table head; DeepSeek's [nope | rope]
    ((5,), 4, 2, 2, 32, 32, {"inverse": True}),
]


def head_table(heads, rot, *, rows=P, dtype=torch.float32, device="cpu"):
    """A per-head [cos | sin] table of random values (not unit pairs: FoPE's mixed rows are not)."""
    return torch.randn(rows, heads, rot, dtype=torch.float64).to(dtype=dtype, device=device)


def _inputs(shape, hq, hk, d, dtype, grad=False, device="cpu"):
    q = torch.randn(*shape, hq, d, dtype=dtype, device=device, requires_grad=grad)
    k = torch.randn(*shape, hk, d, dtype=dtype, device=device, requires_grad=grad)
    return q, k, torch.randint(0, P, shape, device=device)


@pytest.mark.parametrize("shape,hq,hk,ht,d,rot,kw", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_forward_matches_the_oracle(path, shape, hq, hk, ht, d, rot, kw, dtype, inplace):
    q, k, positions = _inputs(shape, hq, hk, d, dtype)
    table = head_table(ht, rot)
    want_q, want_k = reference.apply_rope(q.double(), k.double(), positions, table.double(), **kw)
    qi, ki = q.clone(), k.clone()
    qo, ko = ropekit.apply_rope(qi, ki, positions, table, inplace=inplace, **kw)
    assert (qo is qi) == inplace and (ko is ki) == inplace
    assert rel_err(qo, want_q) < TOL[dtype]
    assert rel_err(ko, want_k) < TOL[dtype]
    if not inplace:
        assert torch.equal(qi, q) and torch.equal(ki, k)


@pytest.mark.parametrize("shape,hq,hk,ht,d,rot,kw", CASES)
def test_backward_matches_the_oracle(path, shape, hq, hk, ht, d, rot, kw):
    q, k, positions = _inputs(shape, hq, hk, d, torch.float32, grad=True)
    table = head_table(ht, rot)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qo, ko = ropekit.apply_rope(q, k, positions, table, **kw)
    torch.autograd.backward((qo, ko), (gq, gk))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    wq, wk = reference.apply_rope(q64, k64, positions, table.double(), **kw)
    torch.autograd.backward((wq, wk), (gq.double(), gk.double()))
    assert rel_err(q.grad, q64.grad) < TOL[torch.float32]
    assert rel_err(k.grad, k64.grad) < TOL[torch.float32]


def test_in_place_views_of_one_projection_under_autograd(path):
    """q and k as views of one (T, Hq + Hk, D) projection, rotated in place while it requires grad."""
    x = torch.randn(5, 6, 32, requires_grad=True)
    table, positions = head_table(2, 32), torch.randint(0, P, (5,))
    y = x * 1.0
    ropekit.apply_rope(y[:, :4], y[:, 4:], positions, table, inplace=True)
    g = torch.randn_like(y)
    y.backward(g)
    x64 = x.detach().double().requires_grad_()
    wq, wk = reference.apply_rope(x64[:, :4], x64[:, 4:], positions, table.double())
    want = torch.cat((wq, wk), 1)
    want.backward(g.double())
    assert rel_err(y, want) < TOL[torch.float32]
    assert rel_err(x.grad, x64.grad) < TOL[torch.float32]


def test_position_outside_the_table_gives_nan(path):
    """A position past the table: that token's rotated dims NaN, its tail kept, other tokens exact."""
    q, k, _ = _inputs((4,), 4, 2, 48, torch.float32)
    table = head_table(2, 32)
    positions = torch.tensor([0, P, 3, P - 1])
    qo, ko = ropekit.apply_rope(q, k, positions, table)
    for out, x in ((qo, q), (ko, k)):
        assert torch.isnan(out[1, :, :32]).all() and torch.equal(out[1, :, 32:], x[1, :, 32:])
    good = torch.tensor([0, 2, 3])
    want_q, want_k = reference.apply_rope(q[good].double(), k[good].double(), positions[good], table.double())
    assert rel_err(qo[good], want_q) < TOL[torch.float32] and rel_err(ko[good], want_k) < TOL[torch.float32]


def test_oracle_head_mapping():
    """The oracle's per-head rotation is, head by head, the 2-D oracle with table head j // (H / Ht);
    a table of one head is the 2-D table's rotation."""
    q = torch.randn(5, 6, 16, dtype=torch.float64)
    table, positions = head_table(3, 16).double(), torch.randint(0, P, (5,))
    got, _ = reference.apply_rope(q, None, positions, table)
    for j in range(6):
        want, _ = reference.apply_rope(q[:, j : j + 1], None, positions, table[:, j // 2])
        assert torch.equal(got[:, j : j + 1], want)
    one, _ = reference.apply_rope(q, None, positions, table[:, :1])
    flat, _ = reference.apply_rope(q, None, positions, table[:, 0])
    assert torch.equal(one, flat)


def test_table_views_and_strides(path):
    """A table that is a strided view (heads sliced, a permuted (Ht, max_position, R) tensor); q alone."""
    q, k, positions = _inputs((5,), 4, 2, 32, torch.float32)
    base = head_table(4, 32)
    for table in (base[:, 1:3], head_table(2, 32).transpose(0, 1).contiguous().transpose(0, 1)):
        want_q, want_k = reference.apply_rope(q.double(), k.double(), positions, table.double())
        qo, ko = ropekit.apply_rope(q, k, positions, table)
        assert rel_err(qo, want_q) < TOL[torch.float32] and rel_err(ko, want_k) < TOL[torch.float32]
        alone, none = ropekit.apply_rope(q, None, positions, table)  # q alone (no k)
        assert none is None and rel_err(alone, want_q) < TOL[torch.float32]


def test_torch_compile(path):
    """Through the custom op (fullgraph, dynamic shapes): forward and backward."""
    table = head_table(2, 32)

    def f(q, k, positions):
        return ropekit.apply_rope(q, k, positions, table)

    compiled = torch.compile(f, dynamic=True, backend="eager", fullgraph=True)
    for n in (5, 9):
        q, k, positions = _inputs((n,), 4, 2, 32, torch.float32, grad=True)
        got = compiled(q, k, positions)
        q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
        want = reference.apply_rope(q64, k64, positions, table.double())
        for x, y in zip(got, want):
            assert rel_err(x, y) < TOL[torch.float32]
        g = torch.randn_like(got[0])
        got[0].backward(g)
        want[0].backward(g.double())
        assert rel_err(q.grad, q64.grad) < TOL[torch.float32]


@pytest.mark.parametrize("n_tokens", [7, 3000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_forward_and_backward(device, n_tokens, dtype):
    """Decode-sized calls (a program per head block) and large ones (a program per token walking its
    head blocks): FoPE's shape (32 q heads over 8 KV heads, head size 128), forward and backward."""
    if device == "cpu" and n_tokens > 64:
        pytest.skip("a large call runs on CUDA (the interpreter's cost)")
    torch.manual_seed(n_tokens)
    q, k, positions = _inputs((n_tokens,), 32, 8, 128, dtype, grad=True, device=device)
    table = head_table(8, 128, rows=4096, device=device)
    positions = torch.randint(0, 4096, (n_tokens,), device=device)
    qo, ko = ropekit.apply_rope(q, k, positions, table)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    wq, wk = reference.apply_rope(q64, k64, positions, table.double())
    assert rel_err(qo, wq) < TOL[dtype] and rel_err(ko, wk) < TOL[dtype]
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward((qo, ko), (gq, gk))
    torch.autograd.backward((wq, wk), (gq.double(), gk.double()))
    assert rel_err(q.grad, q64.grad) < TOL[dtype] and rel_err(k.grad, k64.grad) < TOL[dtype]


@pytest.mark.parametrize("knobs", [dict(head_loop=True, prefetch=True), dict(head_loop=True, block_elems=64)])
def test_head_loop_launch(knobs):
    """The large-call launch on a small call (the knobs force it): a program walks its token's head
    blocks (next block prefetched, or blocks of one head each), each reading its heads' rows."""
    q, k, positions = _inputs((5,), 8, 4, 32, torch.float32)
    table = head_table(4, 32)
    want_q, want_k = reference.apply_rope(q.double(), k.double(), positions, table.double())
    with tuning.override(**knobs):
        qo, ko = ropekit.apply_rope(q, k, positions, table)
    assert rel_err(qo, want_q) < TOL[torch.float32] and rel_err(ko, want_k) < TOL[torch.float32]


def test_composes_with_layouts_destinations_and_parts(path):
    """'bhsd' and 'sbhd' layouts, destinations, rotary_position='halves', q_nope, q_temperature."""
    table, table16 = head_table(2, 32), head_table(2, 16)
    q, k, positions = _inputs((2, 5), 4, 2, 32, torch.float32)
    want_q, want_k = reference.apply_rope(q.double(), k.double(), positions, table.double())
    qo, ko = ropekit.apply_rope(q.transpose(1, 2), k.transpose(1, 2), positions, table, layout="bhsd")
    assert rel_err(qo.transpose(1, 2), want_q) < TOL[torch.float32]
    assert rel_err(ko.transpose(1, 2), want_k) < TOL[torch.float32]
    qs, ks = q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous()  # (S, B, H, D)
    q_buf, k_buf = torch.full_like(qs, float("nan")), torch.full_like(ks, float("nan"))
    got = ropekit.apply_rope(qs, ks, positions.t(), table, layout="sbhd", q_out=q_buf, k_out=k_buf)
    assert got[0] is q_buf and got[1] is k_buf
    assert rel_err(q_buf.transpose(0, 1), want_q) < TOL[torch.float32]
    assert rel_err(k_buf.transpose(0, 1), want_k) < TOL[torch.float32]
    # halves: the pairs (i, i + D/2), i < 8, of 32-wide heads
    want_q, want_k = reference.apply_rope(q.double(), k.double(), positions, table16.double(), rotary_position="halves")
    qo, ko = ropekit.apply_rope(q, k, positions, table16, rotary_position="halves")
    assert rel_err(qo, want_q) < TOL[torch.float32] and rel_err(ko, want_k) < TOL[torch.float32]
    # q in two parts: [rotated q_rope | q_nope]
    q_nope = torch.randn(2, 5, 4, 8)
    qo, _ = ropekit.apply_rope(q, k, positions, table, q_nope=q_nope)
    want_q, _ = reference.apply_rope(q.double(), None, positions, table.double())
    assert rel_err(qo, torch.cat((want_q, q_nope.double()), -1)) < TOL[torch.float32]
    temp = (4.0, 0.25)
    want_q, want_k = reference.apply_rope(q.double(), k.double(), positions, table.double(), q_temperature=temp)
    qo, ko = ropekit.apply_rope(q, k, positions, table, q_temperature=temp)
    assert rel_err(qo, want_q) < TOL[torch.float32] and rel_err(ko, want_k) < TOL[torch.float32]


def test_fp8_outputs(path):
    """fp8 outputs with a per-tensor scale: each stored value within an fp8 ulp of the oracle's."""
    q, k, positions = _inputs((6,), 4, 2, 32, torch.float32)
    table = head_table(2, 32)
    f8 = torch.float8_e4m3fn
    qo, ko = ropekit.apply_rope(q, k, positions, table, out_dtype=f8, q_scale=0.5, k_scale=0.25)
    want_q, want_k = reference.apply_rope(q.double(), k.double(), positions, table.double())
    fp8_close(qo, (want_q / 0.5).to(f8).double(), f8)
    fp8_close(ko, (want_k / 0.25).to(f8).double(), f8)
