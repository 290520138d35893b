"""apply_rope against the float64 reference: every variant, layout and dtype.

On CPU the real Triton kernel runs in the interpreter; on CUDA (marked gpu) it runs compiled.
Outputs are poisoned (NaN) before each run, inputs are fresh random numbers.
"""

import os

import pytest
import torch

import ropekit
from ropekit.tools import reference

from conftest import TOL, make_cache, rel_err

pytestmark = pytest.mark.usefixtures("poison")


def check(q, k, positions, cache, *, dtype, **kw):
    """Run out of place and in place; compare both with the float64 reference."""
    q0, k0 = q.clone(), None if k is None else k.clone()
    rq, rk = reference.apply_rope(
        q.double(),
        None if k is None else k.double(),
        positions,
        cache.double(),
        **{n: v for n, v in kw.items() if n != "inplace"},
    )
    qo, ko = ropekit.apply_rope(q, k, positions, cache, **kw)
    # out of place: inputs untouched, outputs right
    assert torch.equal(q, q0) and (k is None or torch.equal(k, k0))
    assert qo.dtype == q.dtype and qo.shape == q.shape
    assert rel_err(qo, rq) < TOL[dtype]
    if k is not None:
        assert ko.dtype == k.dtype and ko.shape == k.shape
        assert rel_err(ko, rk) < TOL[dtype]
    else:
        assert ko is None
    # in place: same values written into the inputs themselves
    qi, ki = ropekit.apply_rope(q, k, positions, cache, inplace=True, **kw)
    assert qi is q and ki is k
    assert rel_err(q, rq) < TOL[dtype]
    if k is not None:
        assert rel_err(k, rk) < TOL[dtype]
    # the tail past rotary_dim is kept bit for bit
    rot = cache.shape[1]
    assert torch.equal(qo[..., rot:], q0[..., rot:])
    assert torch.equal(q[..., rot:], q0[..., rot:])


SHAPES = [
    # (T, Hq, Hk, Dq, Dk, rotary_dim)
    (5, 4, 2, 64, 64, 64),
    (3, 28, 4, 128, 128, 128),  # heads not a power of two
    (2, 73, 1, 80, 80, 80),  # rotary half 40: not a power of two
    (3, 6, 3, 96, 96, 96),
    (2, 3, 2, 256, 256, 256),
    (4, 5, 2, 128, 128, 64),  # partial rotary: tail kept
    (3, 4, 1, 192, 64, 64),  # MLA-like: different head sizes for q and k
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
def test_shapes(device, shape, interleaved):
    T, Hq, Hk, Dq, Dk, rot = shape
    dtype = torch.bfloat16
    q = torch.randn(T, Hq, Dq, dtype=dtype, device=device)
    k = torch.randn(T, Hk, Dk, dtype=dtype, device=device)
    cache = make_cache(50, rot, device=device)
    pos = torch.randint(0, 50, (T,), device=device)
    check(q, k, pos, cache, dtype=dtype, interleaved=interleaved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=str)
def test_dtypes(device, dtype, table_dtype, pos_dtype):
    q = torch.randn(4, 3, 64, dtype=dtype, device=device)
    k = torch.randn(4, 2, 64, dtype=dtype, device=device)
    cache = make_cache(4096, 64, dtype=table_dtype, device=device)
    pos = torch.randint(0, 4096, (4,), dtype=pos_dtype, device=device)
    check(q, k, pos, cache, dtype=dtype)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
def test_two_token_dims_and_default_positions(device, interleaved):
    B, S = 2, 5
    q = torch.randn(B, S, 4, 64, device=device)
    k = torch.randn(B, S, 2, 64, device=device)
    cache = make_cache(16, 64, device=device)
    check(q, k, None, cache, dtype=torch.float32, interleaved=interleaved)
    pos = torch.randint(0, 16, (B, S), device=device)
    check(q, k, pos, cache, dtype=torch.float32, interleaved=interleaved)
    # positions with their own strides: a transposed (S, B) buffer
    pos_t = torch.randint(0, 16, (S, B), device=device).t()
    check(q, k, pos_t, cache, dtype=torch.float32, interleaved=interleaved)


def test_hf_layout_views(device):
    """q/k as HF holds them: (B, H, S, D) contiguous, passed as (B, S, H, D) transposed views."""
    B, S, Hq, Hk, D = 2, 6, 4, 2, 64
    q = torch.randn(B, Hq, S, D, dtype=torch.bfloat16, device=device).transpose(1, 2)
    k = torch.randn(B, Hk, S, D, dtype=torch.bfloat16, device=device).transpose(1, 2)
    check(q, k, None, make_cache(S, D, device=device), dtype=torch.bfloat16)


def test_fused_qkv_views(device):
    """q and k are slices of one (T, (Hq + 2 Hk) * D) buffer: each keeps its own strides."""
    T, Hq, Hk, D = 5, 4, 2, 64
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, dtype=torch.float16, device=device)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    v_before = qkv[:, (Hq + Hk) * D :].clone()
    cache = make_cache(32, D, device=device)
    pos = torch.randint(0, 32, (T,), device=device)
    check(q, k, pos, cache, dtype=torch.float16)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], v_before), "v part of the fused buffer was written"


def test_mla_strided_slice(device):
    """DeepSeek MLA: rotate q[..., 128:] of a (T, H, 192) tensor in place, k_pe its own tensor."""
    T, H = 4, 16
    q = torch.randn(T, H, 192, dtype=torch.bfloat16, device=device)
    k_pe = torch.randn(T, 1, 64, dtype=torch.bfloat16, device=device)
    cache = make_cache(64, 64, device=device)
    pos = torch.randint(0, 64, (T,), device=device)
    nope = q[..., :128].clone()
    rq, rk = reference.apply_rope(q[..., 128:].double(), k_pe.double(), pos, cache.double(), interleaved=True)
    ropekit.apply_rope(q[..., 128:], k_pe, pos, cache, interleaved=True, inplace=True)
    assert torch.equal(q[..., :128], nope)
    assert rel_err(q[..., 128:], rq) < TOL[torch.bfloat16]
    assert rel_err(k_pe, rk) < TOL[torch.bfloat16]


def test_non_contiguous_heads_and_tokens(device):
    """Every stride free: a head-strided, token-strided view (every other head, every other token)."""
    base_q = torch.randn(8, 6, 64, device=device)
    base_k = torch.randn(3, 8, 4, 96, device=device)[1].transpose(0, 0)
    q = base_q[::2, ::2]
    k = base_k[::2, 1::2, :64]
    cache = make_cache(40, 64, device=device)
    pos = torch.randint(0, 40, (4,), device=device)
    check(q, k, pos, cache, dtype=torch.float32)


def test_k_none(device):
    q = torch.randn(3, 5, 64, device=device)
    check(q, None, torch.tensor([0, 7, 3], device=device), make_cache(8, 64, device=device), dtype=torch.float32)


def test_empty_tokens(device):
    q = torch.randn(0, 4, 64, device=device)
    k = torch.randn(0, 2, 64, device=device)
    qo, ko = ropekit.apply_rope(q, k, torch.zeros(0, dtype=torch.long, device=device), make_cache(8, 64, device=device))
    assert qo.shape == q.shape and ko.shape == k.shape


@pytest.mark.parametrize("mrope_interleaved", [False, True], ids=["chunked", "interleaved"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
def test_mrope(device, mrope_interleaved, interleaved):
    T, Hq, Hk, D = 6, 4, 2, 128
    q = torch.randn(T, Hq, D, dtype=torch.bfloat16, device=device)
    k = torch.randn(T, Hk, D, dtype=torch.bfloat16, device=device)
    cache = make_cache(100, D, device=device)
    pos = torch.randint(0, 100, (3, T), device=device)
    check(
        q,
        k,
        pos,
        cache,
        dtype=torch.bfloat16,
        interleaved=interleaved,
        mrope_section=[16, 24, 24],
        mrope_interleaved=mrope_interleaved,
    )


@pytest.mark.parametrize("mrope_interleaved", [False, True], ids=["chunked", "interleaved"])
def test_mrope_text_tokens_equal_plain_rope(device, mrope_interleaved):
    """Three equal position rows reduce M-RoPE to plain RoPE."""
    B, S, D = 2, 4, 64
    q = torch.randn(B, S, 3, D, device=device)
    cache = make_cache(50, D, device=device)
    p = torch.randint(0, 50, (B, S), device=device)
    plain, _ = ropekit.apply_rope(q, None, p, cache)
    m, _ = ropekit.apply_rope(
        q, None, p.expand(3, B, S), cache, mrope_section=[8, 12, 12], mrope_interleaved=mrope_interleaved
    )
    # equal up to float32 rounding: the two are different kernel specializations, and the compiler
    # may contract a multiply-add into an FMA in one and not the other
    torch.testing.assert_close(m, plain, rtol=1e-6, atol=1e-6)


def test_mrope_sections_select_rows(device):
    """Each frequency follows the position row its section names (against a hand-built table)."""
    D, half = 32, 16
    q = torch.randn(1, 1, D, device=device, dtype=torch.float64).float()
    cache = make_cache(64, D, device=device)
    pos = torch.tensor([[3], [17], [41]], device=device)
    cases = (
        # chunked (4, 6, 6): [0, 4) t, [4, 10) h, [10, 16) w
        (False, [4, 6, 6], [0] * 4 + [1] * 6 + [2] * 6),
        # interleaved (8, 4, 4) as Qwen3-VL: i % 3 == 1 and i < 12 -> h, i % 3 == 2 and i < 12 -> w
        (True, [8, 4, 4], [0, 1, 2] * 4 + [0, 0, 0, 0]),
    )
    for interleaved_layout, section, sec in cases:
        rows = torch.tensor([pos[s, 0].item() for s in sec], device=device)
        cos = cache[rows, torch.arange(half, device=device)]
        sin = cache[rows, half + torch.arange(half, device=device)]
        ref = reference.rotate(q.double(), cos.double()[None], sin.double()[None])
        out, _ = ropekit.apply_rope(q, None, pos, cache, mrope_section=section, mrope_interleaved=interleaved_layout)
        assert rel_err(out, ref) < 1e-6


def test_out_of_range_positions_give_nan_not_a_read(device):
    T, H, D = 4, 3, 128
    q = torch.randn(T, H, D, device=device)
    cache = make_cache(16, 64, device=device)
    pos = torch.tensor([0, 16, -1, 5], device=device)
    out, _ = ropekit.apply_rope(q, None, pos, cache)
    assert torch.isnan(out[1, :, :64]).all() and torch.isnan(out[2, :, :64]).all()
    assert not torch.isnan(out[[0, 3]]).any()
    assert torch.equal(out[..., 64:], q[..., 64:]), "the tail is kept even for a bad position"
    ref, _ = reference.apply_rope(q[[0, 3]].double(), None, pos[[0, 3]], cache.double())
    assert rel_err(out[[0, 3]], ref) < 1e-6


def test_strict_mode_from_the_environment():
    """ROPEKIT_STRICT=1, read when ropekit is imported, turns strict mode on for the process."""
    import subprocess
    import sys

    code = (
        "import torch, ropekit\n"
        "cache = torch.zeros(10, 64)\n"
        "try:\n"
        "    ropekit.apply_rope(torch.zeros(2, 1, 64), None, torch.tensor([0, 12]), cache)\n"
        "except ValueError as e:\n"
        "    print('raised', e)\n"
    )
    env = dict(os.environ, ROPEKIT_STRICT="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "raised apply_rope: positions" in out.stdout, out.stdout + out.stderr


def test_strict_mode_names_first_bad_position(device):
    q = torch.randn(2, 3, 4, 64, device=device)
    q0 = q.clone()
    cache = make_cache(10, 64, device=device)
    pos = torch.tensor([[1, 2, 3], [4, 12, -1]], device=device)
    with ropekit.strict():
        with pytest.raises(ValueError, match=r"positions\[1, 1\] = 12"):
            ropekit.apply_rope(q, None, pos, cache, inplace=True)
    assert torch.equal(q, q0), "strict mode wrote before raising"
    with ropekit.strict(False):
        out, _ = ropekit.apply_rope(q, None, pos, cache)
        assert torch.isnan(out[1, 1]).any()


@pytest.mark.parametrize(
    "head_loop,prefetch",
    [(False, False), (True, True), (True, False)],
    ids=["block-programs", "token-programs", "token-programs-no-prefetch"],
)
@pytest.mark.parametrize("case", ["half", "pairs-partial", "mrope", "two-token-dims", "per-token", "q-only"])
def test_both_program_layouts(device, request, head_loop, prefetch, case):
    """The kernel's two grids (a program per head block, or per token walking its head blocks,
    with or without the next block's loads issued before this block's stores) give the reference's
    answer; the launcher picks by call size, so force each here."""
    from ropekit.core import tuning

    knobs = tuning.override(head_loop=head_loop, prefetch=prefetch)
    knobs.__enter__()
    request.addfinalizer(lambda: knobs.__exit__(None, None, None))
    T, Hq, Hk = 5, 37, 3  # 37 heads: several blocks, the last one partial
    kw = {}
    D, rot = 64, 64
    pos = torch.randint(0, 50, (T,), device=device)
    if case == "pairs-partial":
        D, kw = 96, dict(interleaved=True)
    elif case == "mrope":
        pos, kw = torch.randint(0, 50, (3, T), device=device), dict(mrope_section=[8, 12, 12])
    q = torch.randn(T, Hq, D, dtype=torch.bfloat16, device=device)
    k = torch.randn(T, Hk, D, dtype=torch.bfloat16, device=device)
    if case == "two-token-dims":
        q, k, pos = q[:4].view(2, 2, Hq, D), k[:4].view(2, 2, Hk, D), pos[:4].view(2, 2)
    if case == "per-token":
        pos = None
    if case == "q-only":
        k = None
    check(q, k, pos, make_cache(50, rot, device=device), dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize("head_loop", [False, True], ids=["block-programs", "token-programs"])
@pytest.mark.parametrize("interleaved_sections", [False, True], ids=["chunked", "interleaved"])
def test_per_token_mrope_both_program_layouts(device, request, head_loop, interleaved_sections):
    """Per-token (3, T, half) M-RoPE angles (the HF multimodal drop-in's form), one program per
    head block or per token: the same answer as the float64 reference fed the rows the positions
    pick from the same table."""
    from ropekit.core import tuning

    knobs = tuning.override(head_loop=head_loop)
    knobs.__enter__()
    request.addfinalizer(lambda: knobs.__exit__(None, None, None))
    T, Hq, Hk, D = 5, 37, 3, 64
    section = [8, 12, 12] if not interleaved_sections else [12, 10, 10]
    cache = make_cache(50, D, device=device)
    pos = torch.randint(0, 50, (3, T), device=device)
    q = torch.randn(T, Hq, D, dtype=torch.bfloat16, device=device)
    k = torch.randn(T, Hk, D, dtype=torch.bfloat16, device=device)
    cos, sin = cache[pos, : D // 2], cache[pos, D // 2 :]  # (3, T, half)
    qo, ko = ropekit.rotate_with_angles(q, k, cos, sin, mrope_section=section, mrope_interleaved=interleaved_sections)
    rq, rk = reference.apply_rope(
        q.double(), k.double(), pos, cache.double(), mrope_section=section, mrope_interleaved=interleaved_sections
    )
    assert rel_err(qo, rq) < TOL[torch.bfloat16] and rel_err(ko, rk) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain-launch", "pdl"])
def test_gpu_chained_in_place_calls_in_a_graph(pdl):
    """Twenty in-place decode calls captured back to back, each reading what the one before wrote:
    with programmatic dependent launch a call's programs start during the previous call, so a
    missing wait would read stale q / k. The result is q and k rotated twenty times."""
    from ropekit.core import tuning

    T, Hq, Hk, D, n = 64, 32, 8, 128, 20
    cache = make_cache(4096, D, device="cuda")
    pos = torch.randint(0, 4096, (T,), device="cuda")
    q = torch.randn(T, Hq, D, device="cuda")
    k = torch.randn(T, Hk, D, device="cuda")
    cos, sin = reference.angles_from_table(cache.double(), pos, (T,))
    want_q, want_k = q.double(), k.double()
    for _ in range(n):
        want_q, want_k = reference.rotate(want_q, cos, sin), reference.rotate(want_k, cos, sin)
    with tuning.override(pdl=pdl):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ropekit.apply_rope(q.clone(), k.clone(), pos, cache, inplace=True)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                ropekit.apply_rope(q, k, pos, cache, inplace=True)
        g.replay()
        torch.cuda.synchronize()
    assert rel_err(q, want_q) < 1e-5 and rel_err(k, want_k) < 1e-5


@pytest.mark.gpu
def test_gpu_forward_and_backward_in_a_graph():
    """A training step's rotation captured whole: forward and autograd backward in one CUDA graph
    (warm-up on a side stream first, as PyTorch asks), then replayed on new values copied into the
    same inputs. The outputs and gradients the replay writes (poisoned with NaN before it) match
    float64: q and k rotated, the output gradients rotated back by the inverse angle."""
    T, Hq, Hk, D = 64, 32, 8, 128
    cache = make_cache(4096, D, device="cuda")
    pos = torch.randint(0, 4096, (T,), device="cuda")
    q = torch.randn(T, Hq, D, device="cuda", requires_grad=True)
    k = torch.randn(T, Hk, D, device="cuda", requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def step():
        qo, ko = ropekit.apply_rope(q, k, pos, cache)
        return (qo, ko, *torch.autograd.grad((qo, ko), (q, k), (gq, gk)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    with torch.no_grad():
        for x in (q, k, gq, gk):
            x.copy_(torch.randn_like(x))
        for x in outs:
            x.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    cos, sin = reference.angles_from_table(cache.double(), pos, (T,))
    want = (
        reference.rotate(q.detach().double(), cos, sin),
        reference.rotate(k.detach().double(), cos, sin),
        reference.rotate(gq.double(), cos, sin, inverse=True),
        reference.rotate(gk.double(), cos, sin, inverse=True),
    )
    for name, got, ref in zip(("q_out", "k_out", "dq", "dk"), outs, want):
        assert rel_err(got, ref) < 1e-5, name
