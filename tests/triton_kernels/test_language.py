"""ropekit.language: kernels a user writes against its public names only, and its contract.

The kernels here import the module and use no underscore name of it. Each launch writes into an
output poisoned with NaN first, on fresh random inputs, and is compared with the float64 oracle
(ropekit.tools.reference). Without CUDA they run in Triton's interpreter (tests/conftest.py).
"""

import ast
import importlib.util
import inspect
import pathlib

import pytest
import torch
import triton
import triton.language as tl

import ropekit.language as rl
from ropekit.tools import reference

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "ropekit"
# compiled on a GPU; without one, interpreted on CPU tensors (tests/conftest.py sets TRITON_INTERPRET)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def rope_inplace(q_ptr, pos_ptr, tab_ptr, n_heads, s_tok, s_head, s_row, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t, _, _ = rl.program_token(1)  # one token dim: t is the int64 token index
    q_tok = q_ptr + t * s_tok
    i = tl.arange(0, HALF)  # HALF (rotary_dim // 2) a power of two here: no padded lanes
    p = tl.load(pos_ptr + t).to(tl.int64) + tl.zeros([HALF], tl.int64)
    c, sn = rl.table_angles(tab_ptr, tab_ptr + HALF, p * s_row, i, i < HALF, 0.0)
    for head0 in tl.range(0, n_heads, BLOCK_H):
        x1, x2 = rl.load_heads(q_tok, s_head, n_heads, head0, HALF, HALF, BLOCK_H, False, 0, "", HALF)
        o1, o2 = rl.rotate(x1, x2, c[None, :], sn[None, :], False)
        rl.store_heads(q_tok, s_head, n_heads, head0, o1, o2, HALF, HALF, BLOCK_H, False, 0, HALF)


@triton.jit
def user_rope(
    x_ptr,
    o_ptr,
    pos_ptr,
    tab_ptr,
    S,
    n_heads,
    tail_len,
    max_pos,
    stride_x_batch,
    stride_x_token,
    stride_x_head,
    stride_o_batch,
    stride_o_token,
    stride_o_head,
    stride_pos_batch,
    stride_pos_token,
    stride_row,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    GAP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INVERSE: tl.constexpr,
    FREQS: tl.constexpr,
):
    """x (B, S, H, D) rotated into o: the angles from a [cos | sin] table row (tab_ptr) or, FREQS,
    from the inverse frequencies at tab_ptr and float positions; the tail copied."""
    _, b, s = rl.program_token(S)
    x_base = x_ptr + rl.token_offset(b, s, stride_x_batch, stride_x_token)
    o_base = o_ptr + rl.token_offset(b, s, stride_o_batch, stride_o_token)
    pos_tok = pos_ptr + rl.token_offset(b, s, stride_pos_batch, stride_pos_token)
    i = tl.arange(0, HALF_PAD)
    if FREQS:
        p = tl.load(pos_tok).to(tl.float32) + tl.zeros([HALF_PAD], tl.float32)
        f = tl.load(tab_ptr + i, mask=i < HALF, other=0.0)
        c, sn = rl.freq_cos_sin(p, f)
    else:
        p = tl.load(pos_tok).to(tl.int64) + tl.zeros([HALF_PAD], tl.int64)
        ok = (i < HALF) & (p >= 0) & (p < max_pos)
        c, sn = rl.table_angles(tab_ptr, tab_ptr + HALF, p * stride_row, i, ok, float("nan"))
    for head0 in tl.range(0, n_heads, BLOCK_H):
        x1, x2 = rl.load_heads(x_base, stride_x_head, n_heads, head0, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, 0, "", GAP)
        o1, o2 = rl.rotate(x1, x2, c[None, :], sn[None, :], INVERSE)
        rl.store_heads(o_base, stride_o_head, n_heads, head0, o1, o2, HALF, HALF_PAD, BLOCK_H, INTERLEAVED, 0, GAP)
        if TAIL_PAD > 0:
            t = rl.load_tail(x_base, stride_x_head, n_heads, head0, tail_len, HALF, BLOCK_H, TAIL_PAD, GAP)
            rl.store_tail(o_base, stride_o_head, n_heads, head0, tail_len, t, HALF, BLOCK_H, TAIL_PAD, GAP)


@triton.jit
def user_angles(
    pos_ptr,
    tab_ptr,
    cos_ptr,
    sin_ptr,
    S,
    max_pos,
    stride_pos_row,
    stride_pos_batch,
    stride_pos_token,
    stride_row,
    SEC_T,
    SEC_H,
    SEC_W,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    MROPE: tl.constexpr,
    FREQS: tl.constexpr,
):
    """load_angles of every token (b, s) written out as (B * S, HALF) cos and sin rows."""
    t, b, s = rl.program_token(S)
    src = (
        (pos_ptr, stride_pos_row, stride_pos_batch, stride_pos_token),
        (tab_ptr, tab_ptr + HALF, max_pos),
        (0, 0, stride_row, 1),
        (SEC_T, SEC_H, SEC_W, 0, 1, 0),
    )
    c, sn = rl.load_angles(src, b, s, HALF, HALF_PAD, True, MROPE, False, 1, 1, FREQS)
    i = tl.arange(0, HALF_PAD)
    tl.store(cos_ptr + t * HALF + i, c, mask=i < HALF)
    tl.store(sin_ptr + t * HALF + i, sn, mask=i < HALF)


def _table(max_pos, rot, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.cat((f.cos(), f.sin()), -1).float().to(DEV), inv.float().to(DEV)


def _pow2(n):
    return triton.next_power_of_2(n) if n > 0 else 0


LAYOUTS = {
    # name: (interleaved, rotary_position, head size, rotary dim, inverse)
    "half_split": (False, "first", 16, 16, False),
    "interleaved": (True, "first", 16, 16, False),
    "partial_tail": (False, "first", 24, 16, False),
    "partial_tail_interleaved": (True, "first", 24, 8, False),
    "halves": (False, "halves", 16, 8, False),
    "inverse": (False, "first", 16, 16, True),
    "inverse_interleaved_partial": (True, "first", 24, 16, True),
}


@pytest.mark.parametrize("freqs", [False, True], ids=["table", "inv_freq"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_user_kernel_rotates_like_the_oracle(name, freqs):
    interleaved, position, D, rot, inverse = LAYOUTS[name]
    torch.manual_seed(hash((name, freqs)) % 2**31)
    B, S, H, max_pos = 2, 5, 3, 64
    x = torch.randn(B, S, H, D, device=DEV)
    out = torch.full_like(x, float("nan"))
    tab, inv = _table(max_pos, rot)
    if freqs:
        pos = torch.rand(B, S, device=DEV) * 1000.0  # float positions: only the inv_freq path takes them
        cos, sin = reference.angles_from_freqs(pos.double(), inv.double(), dtype=torch.float64)
        angles = inv
    else:
        pos = torch.randint(0, max_pos, (B, S), device=DEV)
        cos, sin = reference.angles_from_table(tab.double(), pos, (B, S))
        angles = tab
    half = rot // 2
    gap = D // 2 if position == "halves" else half
    tail = D - rot
    want = reference.rotate(x.double(), cos, sin, interleaved=interleaved, inverse=inverse, rotary_position=position)
    user_rope[(B * S,)](
        x, out, pos, angles, S, H, tail, max_pos,
        *x.stride()[:3], *out.stride()[:3], *pos.stride(), tab.stride(0),
        HALF=half, HALF_PAD=_pow2(half), GAP=gap, BLOCK_H=2, TAIL_PAD=_pow2(tail),
        INTERLEAVED=interleaved, INVERSE=inverse, FREQS=freqs,
    )  # fmt: skip
    if position == "halves":  # the dims no pair holds: [half, D/2) and [D/2 + half, D)
        kept = torch.cat((torch.arange(half, gap), torch.arange(gap + half, D)))
        torch.testing.assert_close(out[..., kept], x[..., kept], rtol=0, atol=0)
    assert not out.isnan().any(), "every element is written"
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_user_kernel_out_of_table_position_is_nan():
    torch.manual_seed(1)
    B, S, H, D = 1, 4, 2, 8
    x, tab = torch.randn(B, S, H, D, device=DEV), _table(8, D)[0]
    pos = torch.tensor([[0, 7, 8, -1]], device=DEV)
    out = torch.full_like(x, float("nan"))
    user_rope[(B * S,)](
        x, out, pos, tab, S, H, 0, 8, *x.stride()[:3], *out.stride()[:3], *pos.stride(), tab.stride(0),
        HALF=4, HALF_PAD=4, GAP=4, BLOCK_H=2, TAIL_PAD=0, INTERLEAVED=False, INVERSE=False, FREQS=False,
    )  # fmt: skip
    assert not out[0, :2].isnan().any() and out[0, 2:].isnan().all()


def test_the_documented_example_rotates_q_in_place():
    """docs/language.md's example kernel, as printed there."""
    torch.manual_seed(2)
    T, H, D, max_pos = 6, 5, 16, 32
    q = torch.randn(T, H, D, device=DEV)
    pos = torch.randint(0, max_pos, (T,), device=DEV)
    tab = _table(max_pos, D)[0]
    want = reference.rotate(q.double(), *reference.angles_from_table(tab.double(), pos, (T,)))
    rope_inplace[(T,)](q, pos, tab, H, q.stride(0), q.stride(1), tab.stride(0), HALF=8, BLOCK_H=4)
    torch.testing.assert_close(q.double(), want, rtol=1e-5, atol=1e-5)
    doc = (SRC.parents[1] / "docs" / "language.md").read_text()
    body = inspect.getsource(rope_inplace.fn).split("\n", 1)[1]  # the def and body, past the decorator
    assert body.strip() in doc, "docs/language.md's example is this test's kernel"


@pytest.mark.parametrize(
    "mrope, freqs", [(0, False), (1, False), (2, False), (0, True)], ids=["table", "mrope", "mrope_il", "axial"]
)
def test_load_angles_in_a_user_kernel(mrope, freqs):
    torch.manual_seed(3 + mrope + 10 * freqs)
    B, S, rot, max_pos = 2, 3, 24, 50
    half = rot // 2
    tab, inv = _table(max_pos, rot)
    sections = (4, 4, 4) if mrope else (5, 7, 0)  # axial: axis 0 drives 5 frequencies, axis 1 the other 7
    if freqs:
        pos = torch.rand(2, B, S, device=DEV) * 100.0  # two axes: 5 and 7 (the rest) frequencies
        want_c, want_s = reference.angles_from_freqs(pos.double(), inv.double(), (5, 7), dtype=torch.float64)
    elif mrope:
        pos = torch.randint(0, max_pos, (3, B, S), device=DEV)
        want_c, want_s = reference.angles_from_table(
            tab.double(), pos, (B, S), mrope_section=sections, mrope_interleaved=mrope == 2
        )
    else:
        pos = torch.randint(0, max_pos, (B, S), device=DEV)
        want_c, want_s = reference.angles_from_table(tab.double(), pos, (B, S))
    cos = torch.full((B * S, half), float("nan"), device=DEV)
    sin = torch.full_like(cos, float("nan"))
    row_stride = pos.stride(0) if pos.dim() == 3 else 0
    user_angles[(B * S,)](
        pos, inv if freqs else tab, cos, sin, S, max_pos, row_stride, *pos.stride()[-2:], tab.stride(0),
        *sections, HALF=half, HALF_PAD=_pow2(half), MROPE=mrope, FREQS=freqs,
    )  # fmt: skip
    torch.testing.assert_close(cos.double(), want_c.reshape(B * S, half), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin.double(), want_s.reshape(B * S, half), rtol=1e-5, atol=1e-5)


@triton.jit
def user_offsets(slot_ptr, out_ptr, n, block_size, stride_block, stride_slot, N: tl.constexpr):
    k = tl.arange(0, N)
    slot = tl.load(slot_ptr + k, mask=k < n, other=0).to(tl.int64)
    blk, row = rl.split_slot(slot, block_size)
    tl.store(out_ptr + 3 * k, rl.slot_offset(slot, block_size, stride_block, stride_slot), mask=k < n)
    tl.store(out_ptr + 3 * k + 1, blk, mask=k < n)
    tl.store(out_ptr + 3 * k + 2, row, mask=k < n)


def test_slot_offsets_are_int64():
    """A slot past 2^31 / stride: its offset needs 64 bits, and gets them."""
    slots = torch.tensor([0, 5, 17, 3_000_000_000], dtype=torch.int64, device=DEV)
    out = torch.full((4, 3), -1, dtype=torch.int64, device=DEV)
    user_offsets[(1,)](slots, out, 4, 16, 4096, 256, N=4)
    want = torch.stack([(slots // 16) * 4096 + (slots % 16) * 256, slots // 16, slots % 16], -1)
    assert torch.equal(out.cpu(), want.cpu())


@triton.jit
def user_sections(out_ptr, SEC_T, SEC_H, SEC_W, HALF: tl.constexpr, MROPE: tl.constexpr):
    i = tl.arange(0, HALF)
    if MROPE == 0:
        tl.store(out_ptr + i, rl.axial_axis(i, SEC_T, SEC_H, SEC_W))
    else:
        tl.store(out_ptr + i, rl.mrope_section(i, SEC_T, SEC_H, SEC_W, MROPE).to(tl.int64))


@pytest.mark.parametrize("mrope", [0, 1, 2], ids=["axial", "mrope", "mrope_interleaved"])
def test_which_position_drives_each_frequency(mrope):
    sections = (6, 5, 5)
    out = torch.full((16,), -1, dtype=torch.int64, device=DEV)
    user_sections[(1,)](out, *sections, HALF=16, MROPE=mrope)
    if mrope:
        want = reference.mrope_sections_of_frequencies(16, sections, mrope == 2)
    else:
        want = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
    assert torch.equal(out.cpu(), want.cpu())


# --- the contract ------------------------------------------------------------------------------


def _public(source: str) -> set:
    """Names a module's source binds at its top level (definitions, assignments, imports, also
    inside a top-level try), without a leading underscore, modules aside."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.col_offset == 0:
            names.add(node.name)
        elif isinstance(node, ast.Assign) and node.col_offset == 0:
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return {n for n in names if not n.startswith("_")}


def _is_jit(obj) -> bool:
    """A @triton.jit function (in the interpreter, Triton's stand-in for one)."""
    return isinstance(obj, triton.runtime.JITFunction) or type(obj).__name__ == "InterpretedFunction"


def _contract_breaches(module, source: str) -> list:
    breaches = []
    if _public(source) != set(module.__all__):
        breaches.append(f"public names {sorted(_public(source))} != __all__ {sorted(module.__all__)}")
    for name in module.__all__:
        fn = getattr(module, name, None)
        if not _is_jit(fn):
            breaches.append(f"{name} is not a @triton.jit function")
        elif not (fn.fn.__doc__ or "").strip():
            breaches.append(f"{name} has no docstring")
    if "stable" not in (module.__doc__ or "").lower():
        breaches.append("no stability promise in the module's docstring")
    return breaches


def test_every_public_name_is_a_documented_jit_function():
    assert not _contract_breaches(rl, (SRC / "language.py").read_text())


def test_the_contract_test_can_fail(tmp_path):
    """A module with a plain public function, an undocumented jit one and a name missing from __all__."""
    source = (
        "import triton\n"
        "@triton.jit\n"
        "def bare(x):\n"
        "    pass\n"
        "def plain(x):\n"
        "    'documented'\n"
        "helper = 1\n"
        "__all__ = ['bare', 'plain']\n"
    )
    (tmp_path / "fake_language.py").write_text(source)
    spec = importlib.util.spec_from_file_location("fake_language", tmp_path / "fake_language.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    breaches = _contract_breaches(fake, source)
    assert any("!= __all__" in b for b in breaches)  # helper
    assert "plain is not a @triton.jit function" in breaches
    assert "bare has no docstring" in breaches
    assert "no stability promise in the module's docstring" in breaches


def _calls(path):
    return {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
            for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}  # fmt: skip


def test_ropekit_kernels_are_built_from_the_public_names():
    """Every public function is called by ropekit's kernels or by another one of them (so ropekit's
    kernel tests exercise it), and the kernels take no private name of the module."""
    used = set().union(*(_calls(p) for p in (SRC / "kernels").glob("*.py")))
    language_calls = _calls(SRC / "language.py")
    unused = sorted(n for n in rl.__all__ if n not in used and n not in language_calls)
    assert not unused, f"public names no kernel of ropekit calls: {unused}"
    for p in (SRC / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("language"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{p.name} imports private names of ropekit.language: {private}"
