"""positions_from_cu_seqlens (THD packed sequences, context-parallel shards) and apply_rope on them.

The oracle here is written independently of ropekit.core.packed: it builds each GLOBAL sequence, cuts
it into 2 * cp_size chunks and hands rank r chunks r and 2*cp_size-1-r (Transformer Engine's and
Megatron's dual-chunk load balancing), in plain Python. The in-kernel derivation
(apply_rope(..., cu_seqlens=...)) is tested against the helper once apply_rope accepts it; until
then those tests skip with a reason.
"""

from __future__ import annotations

import random

import pytest
import torch

import ropekit
from ropekit.core import memo, packed
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err

# --- the oracle -------------------------------------------------------------------------------


def oracle_rank_positions(global_len: int, cp_size: int, cp_rank: int) -> list:
    """Global positions held by cp_rank, in local order: chunks r and 2c-1-r of range(global_len)."""
    n_chunks = 2 * cp_size
    assert global_len % n_chunks == 0
    size = global_len // n_chunks
    chunks = [list(range(i * size, (i + 1) * size)) for i in range(n_chunks)]
    return chunks[cp_rank] + chunks[n_chunks - 1 - cp_rank]


def oracle_positions(local_lens, cp_size=1, cp_rank=0, starts=None) -> list:
    out = []
    for i, n in enumerate(local_lens):
        if cp_size == 1:
            base = 0 if starts is None else starts[i]
            out += [base + s for s in range(n)]
        else:
            out += oracle_rank_positions(n * cp_size, cp_size, cp_rank)
    return out


def cu_of(lens, dtype=torch.int32, device="cpu"):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=dtype, device=device)


def random_lens(rng, n, *, even=False, max_len=40, empty_ok=True):
    lens = [rng.randint(0 if empty_ok else 1, max_len) for _ in range(n)]
    return [2 * (v // 2) for v in lens] if even else lens


# --- the helper against the oracle ------------------------------------------------------------


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
def test_cp_ranks_cover_every_global_position_once(cp_size):
    rng = random.Random(cp_size)
    for _ in range(5):
        L = 2 * rng.randint(1, 12)
        seen = []
        for r in range(cp_size):
            got = [packed._cp_position(s, L, cp_size, r) for s in range(L)]
            assert got == oracle_rank_positions(L * cp_size, cp_size, r)
            seen += got
        assert sorted(seen) == list(range(L * cp_size))


def test_cp_position_tensor_form_matches_int_form():
    s = torch.arange(0, 10).repeat(3)
    L = torch.tensor([10] * 10 + [10] * 10 + [10] * 10)
    for cp_size, r in ((1, 0), (2, 1), (4, 3), (4, 0)):
        got = packed._cp_position(s, L, cp_size, r).tolist()
        assert got == [packed._cp_position(int(a), 10, cp_size, r) for a in s]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n_seq", [0, 1, 2, 17, 150])
def test_random_packs(device, dtype, n_seq):
    rng = random.Random(n_seq * 7 + (dtype == torch.int64))
    lens = random_lens(rng, n_seq)
    pos = ropekit.positions_from_cu_seqlens(cu_of(lens, dtype, device))
    assert pos.dtype == dtype and pos.device.type == torch.device(device).type
    assert pos.tolist() == oracle_positions(lens)


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("n_seq", [1, 5, 64])
def test_random_packs_context_parallel(device, cp_size, n_seq):
    rng = random.Random(cp_size * 100 + n_seq)
    lens = random_lens(rng, n_seq, even=True)
    everything = [[] for _ in lens]
    for r in range(cp_size):
        pos = ropekit.positions_from_cu_seqlens(cu_of(lens, device=device), cp_size=cp_size, cp_rank=r).tolist()
        assert pos == oracle_positions(lens, cp_size, r)
        at = 0
        for i, n in enumerate(lens):
            everything[i] += pos[at : at + n]
            at += n
    for i, n in enumerate(lens):  # all ranks together: every global position exactly once
        assert sorted(everything[i]) == list(range(n * cp_size))


def test_start_positions(device):
    rng = random.Random(3)
    lens = random_lens(rng, 9)
    starts = [rng.randint(0, 1000) for _ in lens]
    pos = ropekit.positions_from_cu_seqlens(
        cu_of(lens, device=device), start_positions=torch.tensor(starts, dtype=torch.int32, device=device)
    )
    assert pos.tolist() == oracle_positions(lens, starts=starts)


def test_total_tokens_pads_with_zero_and_matches_without_it():
    lens = [3, 0, 5]
    cu = cu_of(lens)
    assert (
        ropekit.positions_from_cu_seqlens(cu, total_tokens=8).tolist() == ropekit.positions_from_cu_seqlens(cu).tolist()
    )
    assert ropekit.positions_from_cu_seqlens(cu, total_tokens=11).tolist() == oracle_positions(lens) + [0, 0, 0]
    assert ropekit.positions_from_cu_seqlens(torch.tensor([0]), total_tokens=2).tolist() == [0, 0]


@pytest.mark.gpu
def test_no_sync_with_total_tokens():
    cu = cu_of([4, 6, 2], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        pos = ropekit.positions_from_cu_seqlens(cu, cp_size=2, cp_rank=1, total_tokens=12)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pos.tolist() == oracle_positions([4, 6, 2], 2, 1)


@pytest.mark.gpu
def test_unchecked_device_path_marks_odd_lengths():
    """On a device outside strict mode odd CP lengths are not checked: their tokens get -1 (NaN)."""
    pos = ropekit.positions_from_cu_seqlens(cu_of([4, 3], device="cuda"), cp_size=2, cp_rank=0).tolist()
    assert pos[:4] == oracle_positions([4], 2, 0) and pos[4:] == [-1, -1, -1]
    with ropekit.strict(), pytest.raises(ValueError, match="even local lengths"):
        ropekit.positions_from_cu_seqlens(cu_of([4, 3], device="cuda"), cp_size=2, cp_rank=0)


# --- bad inputs: one test per class -----------------------------------------------------------

OP = "positions_from_cu_seqlens"


def raises(exc, fragment, fn):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(f"{OP}: "), msg
    assert fragment in msg, msg


def test_bad_cu_type():
    raises(
        TypeError, "cu_seqlens: expected a torch.Tensor, got list", lambda: ropekit.positions_from_cu_seqlens([0, 1])
    )


def test_bad_cu_rank():
    raises(
        ValueError,
        "cu_seqlens: expected a 1-D tensor",
        lambda: ropekit.positions_from_cu_seqlens(torch.zeros(2, 2, dtype=torch.int32)),
    )


def test_bad_cu_dtype():
    raises(
        ValueError,
        "cu_seqlens: expected dtype in (int32, int64), got float32",
        lambda: ropekit.positions_from_cu_seqlens(torch.tensor([0.0, 2.0])),
    )


def test_empty_cu():
    raises(
        ValueError,
        "cu_seqlens: expected at least one element",
        lambda: ropekit.positions_from_cu_seqlens(torch.zeros(0, dtype=torch.int32)),
    )


def test_cu_not_starting_at_zero():
    raises(
        ValueError,
        "cu_seqlens: expected cu_seqlens[0] == 0, got cu_seqlens[0] = 2",
        lambda: ropekit.positions_from_cu_seqlens(torch.tensor([2, 4])),
    )


def test_cu_decreasing():
    raises(
        ValueError,
        "cu_seqlens: expected non-decreasing values (cumulative lengths), got cu_seqlens[2] = 3 < cu_seqlens[1] = 5",
        lambda: ropekit.positions_from_cu_seqlens(torch.tensor([0, 5, 3])),
    )


def test_odd_length_under_cp():
    raises(
        ValueError,
        "cu_seqlens: expected even local lengths when cp_size > 1",
        lambda: ropekit.positions_from_cu_seqlens(torch.tensor([0, 4, 7]), cp_size=2, cp_rank=1),
    )


@pytest.mark.parametrize(
    "name,value,exc,fragment",
    [
        ("cp_size", 0, ValueError, "cp_size: expected an int >= 1, got 0"),
        ("cp_size", 2.0, TypeError, "cp_size: expected an int, got float"),
        ("cp_size", True, TypeError, "cp_size: expected an int, got bool"),
        ("cp_rank", -1, ValueError, "cp_rank: expected an int >= 0, got -1"),
        ("cp_rank", 2, ValueError, "cp_rank: expected an int in [0, cp_size = 2), got 2"),
        ("total_tokens", -1, ValueError, "total_tokens: expected an int >= 0, got -1"),
        ("total_tokens", 3, ValueError, "total_tokens: expected an int >= cu_seqlens[-1] = 4, got 3"),
    ],
)
def test_bad_ints(name, value, exc, fragment):
    kw = {"cp_size": 2, "cp_rank": 0}
    kw[name] = value
    raises(exc, fragment, lambda: ropekit.positions_from_cu_seqlens(torch.tensor([0, 4]), **kw))


def test_start_positions_with_cp():
    raises(
        ValueError,
        "start_positions: expected None when cp_size > 1",
        lambda: ropekit.positions_from_cu_seqlens(torch.tensor([0, 4]), cp_size=2, start_positions=torch.tensor([1])),
    )


def test_start_positions_shape():
    raises(
        ValueError,
        "start_positions: expected shape (2,)",
        lambda: ropekit.positions_from_cu_seqlens(torch.tensor([0, 4, 6]), start_positions=torch.tensor([1, 2, 3])),
    )


def test_start_positions_dtype():
    raises(
        ValueError,
        "start_positions: expected dtype in (int32, int64), got float32",
        lambda: ropekit.positions_from_cu_seqlens(torch.tensor([0, 4]), start_positions=torch.tensor([1.0])),
    )


def test_start_positions_negative():
    raises(
        ValueError,
        "start_positions: expected values >= 0, got start_positions[1] = -3",
        lambda: ropekit.positions_from_cu_seqlens(torch.tensor([0, 4, 6]), start_positions=torch.tensor([0, -3])),
    )


@pytest.mark.gpu
def test_start_positions_device():
    raises(
        ValueError,
        "start_positions: expected a tensor on cuda",
        lambda: ropekit.positions_from_cu_seqlens(
            torch.tensor([0, 4], device="cuda"), start_positions=torch.tensor([1])
        ),
    )


# --- apply_rope on packed positions -----------------------------------------------------------


def packed_inputs(lens, cp_size, *, hq=4, hk=2, d=64, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(t, hk, d, generator=g).to(dtype=dtype, device=device)
    cache = make_cache(max(1, max(lens, default=1)) * cp_size + 8, d, device=device)
    return q, k, cache


@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("cp_size,cp_rank", [(1, 0), (2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_on_packed_positions(device, cp_size, cp_rank, dtype):
    lens = [6, 0, 10, 2, 14]
    q, k, cache = packed_inputs(lens, cp_size, dtype=dtype, device=device, seed=cp_size + cp_rank)
    cu = cu_of(lens, device=device)
    pos = ropekit.positions_from_cu_seqlens(cu, cp_size=cp_size, cp_rank=cp_rank)
    oracle = torch.tensor(oracle_positions(lens, cp_size, cp_rank), device=device)
    rq, rk = reference.apply_rope(q.double(), k.double(), oracle, cache.double())
    qo, ko = ropekit.apply_rope(q, k, pos, cache)
    assert rel_err(qo, rq) < TOL[dtype] and rel_err(ko, rk) < TOL[dtype]


# --- the in-kernel derivation: apply_rope(..., cu_seqlens=...) (lead's kernel work) -----------

KERNEL_CASES = [([6, 0, 10, 2, 14], 1, 0), ([8, 4, 2], 2, 0), ([8, 4, 2], 2, 1), ([12, 4], 4, 3), ([5], 1, 0)]
# many sequences, empty ones among them: both levels of the kernel's search and its block edges
MANY_CASES = [
    (random_lens(random.Random(7), 300, max_len=6), 1, 0),
    (random_lens(random.Random(8), 130, even=True, max_len=8), 2, 1),
]


@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("lens,cp_size,cp_rank", KERNEL_CASES)
def test_kernel_cu_seqlens_forward_matches_helper(device, lens, cp_size, cp_rank):
    q, k, cache = packed_inputs(lens, cp_size, device=device, seed=11)
    cu = cu_of(lens, device=device)
    want = ropekit.apply_rope(q, k, ropekit.positions_from_cu_seqlens(cu, cp_size=cp_size, cp_rank=cp_rank), cache)
    got = ropekit.apply_rope(q, k, None, cache, cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("lens,cp_size,cp_rank", KERNEL_CASES)
def test_kernel_cu_seqlens_backward_matches_helper(device, lens, cp_size, cp_rank):
    q, k, cache = packed_inputs(lens, cp_size, device=device, seed=12)
    cu = cu_of(lens, device=device)
    pos = ropekit.positions_from_cu_seqlens(cu, cp_size=cp_size, cp_rank=cp_rank)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    grads = []
    for kwargs in ({"positions": pos}, {"positions": None, "cu_seqlens": cu, "cp_size": cp_size, "cp_rank": cp_rank}):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        p = kwargs.pop("positions")
        qo, ko = ropekit.apply_rope(qq, kk, p, cache, **kwargs)
        torch.autograd.backward((qo, ko), (gq, gk))
        grads.append((qq.grad, kk.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=0)


@pytest.mark.parametrize("lens,cp_size,cp_rank", KERNEL_CASES + MANY_CASES)
def test_kernel_positions_recovered_from_angles(device, lens, cp_size, cp_rank):
    """Rotate (1, 0) pairs and read the angle back: the kernel's position per token, exactly."""
    t, d = sum(lens), 2
    max_pos = max(lens) * cp_size + 8
    # one frequency of 1/1024 rad per position: atan2 recovers positions up to ~3000 unambiguously
    angle = torch.arange(max_pos, dtype=torch.float64) / 1024.0
    cache = torch.stack((angle.cos(), angle.sin()), dim=-1).float().to(device)
    q = torch.zeros(t, 1, d, device=device)
    q[..., 0] = 1.0
    cu = cu_of(lens, device=device)
    qo, _ = ropekit.apply_rope(q, None, None, cache, cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank)
    got = torch.round(torch.atan2(qo[:, 0, 1].double(), qo[:, 0, 0].double()) * 1024.0).long().cpu()
    assert got.tolist() == ropekit.positions_from_cu_seqlens(cu.cpu(), cp_size=cp_size, cp_rank=cp_rank).tolist()


def test_kernel_cu_seqlens_refuses_positions():
    lens = [4, 4]
    q, k, cache = packed_inputs(lens, 1)
    cu = cu_of(lens)
    with pytest.raises(ValueError, match=r"^apply_rope: positions: expected None when cu_seqlens is given"):
        ropekit.apply_rope(q, k, ropekit.positions_from_cu_seqlens(cu), cache, cu_seqlens=cu)


@pytest.mark.parametrize("cp_size,seq", [(2, 16), (4, 48), (3, 12)])
def test_matches_torch_context_parallel_load_balancer(cp_size, seq):
    """torch.distributed.tensor.experimental.context_parallel's head-tail load balancer (a private
    class, so skipped when absent) gives rank r the same global positions as the helper."""
    import importlib

    balancer = None
    for where in (
        "torch.distributed.tensor.experimental._context_parallel._load_balancer",  # newer torch
        "torch.distributed.tensor.experimental._load_balancer",
    ):  # older torch
        try:
            balancer = getattr(importlib.import_module(where), "_HeadTailLoadBalancer", None)
        except ImportError:
            continue
        if balancer is not None:
            break
    if balancer is None:
        pytest.skip("this torch has no _HeadTailLoadBalancer (context_parallel's load balancer)")
    order = balancer(seq, cp_size, "cpu")._generate_indices().reshape(-1)
    local = seq // cp_size
    for r in range(cp_size):
        want = order[r * local : (r + 1) * local].tolist()
        got = ropekit.positions_from_cu_seqlens(torch.tensor([0, local]), cp_size=cp_size, cp_rank=r).tolist()
        assert got == want


def test_cu_seqlens_under_torch_compile_forward_and_backward():
    """apply_rope(cu_seqlens=) compiles without graph breaks (the rotate_packed custom op and its
    inverse-rotation backward) and matches the eager call, values and gradients."""
    lens = [4, 0, 6, 4]  # even local lengths: context parallelism
    q, k, cache = packed_inputs(lens, 2, seed=21)
    cu = cu_of(lens)

    def f(q, k):
        qo, ko = ropekit.apply_rope(q, k, None, cache, cu_seqlens=cu, cp_size=2, cp_rank=1)
        return (qo * qo).sum() + ko.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (f, compiled):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        loss = fn(qq, kk)
        loss.backward()
        grads.append((loss.detach(), qq.grad, kk.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- errors in the words of the op the user called ---------------------------------------------


@pytest.mark.parametrize(
    "cu, fragment",
    [
        ([0, 4, 10], "cu_seqlens: expected cu_seqlens[-1]"),  # <= 8 (CPU path) or == 8 (kernel, strict)
        ([1, 4, 8], "cu_seqlens: expected cu_seqlens[0] == 0, got cu_seqlens[0] = 1"),
        ([0, 5, 3], "cu_seqlens: expected non-decreasing values"),
    ],
)
@pytest.mark.parametrize("path", ["norm", "reference"])
def test_apply_rope_cu_seqlens_errors_name_apply_rope(monkeypatch, cu, fragment, path):
    """Bad cu_seqlens values read where they are free (CPU) are reported as apply_rope's
    cu_seqlens, never as positions_from_cu_seqlens' total_tokens (arguments the user never passed):
    on the norm path (strict mode) and on the CPU reference path."""

    q = torch.randn(8, 2, 16)
    kw = {"q_norm_weight": torch.ones(16)} if path == "norm" else {}
    if path == "reference":  # the pure-PyTorch CPU path, not the interpreted kernel
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        memo.clear()
    try:
        # the norm derives positions in the kernel like every Triton path: values read in strict mode
        with pytest.raises(ValueError) as info, ropekit.strict(path == "norm"):
            ropekit.apply_rope(q, None, None, make_cache(16, 16), cu_seqlens=torch.tensor(cu), **kw)
    finally:
        memo.clear()
    message = str(info.value)
    assert message.startswith("apply_rope: cu_seqlens: "), message
    assert fragment in message, message
    assert "total_tokens" not in message and "positions_from_cu_seqlens" not in message
