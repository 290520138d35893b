"""Tests for ropekit.audit, the static int32-index-overflow checker for Triton kernels.

Every test writes a small kernel source to tmp_path; nothing is compiled or imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SRC = Path(__file__).resolve().parents[2] / "src"
try:
    from ropekit import audit
except ImportError:  # not installed: use the checkout
    sys.path.insert(0, str(_SRC))
    from ropekit import audit

HEADER = "import triton\nimport triton.language as tl\n\n"


def _write(tmp_path: Path, body: str, name: str = "kern.py") -> tuple[Path, str]:
    src = HEADER + textwrap.dedent(body)
    path = tmp_path / name
    path.write_text(src)
    return path, src


def run_audit(tmp_path: Path, body: str):
    """Returns [(line, function, expression)] and the source."""
    path, src = _write(tmp_path, body)
    found, _warnings = audit.audit_file(str(path))
    return [(f.line, f.function, f.expression) for f in found], src


def line_of(src: str, needle: str, nth: int = 0) -> int:
    hits = [i for i, line in enumerate(src.splitlines(), 1) if needle in line]
    return hits[nth]


# ---------------------------------------------------------------------------------------
# the core rule


def test_classic_pid_times_stride_is_flagged(tmp_path):
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def copy_rows(x_ptr, y_ptr, row_stride, n_cols, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            row = tl.load(x_ptr + pid * row_stride + cols, mask=cols < n_cols)
            tl.store(y_ptr + cols, row, mask=cols < n_cols)
    """,
    )
    assert found == [(line_of(src, "tl.load"), "copy_rows", "pid * row_stride")]


def test_widened_before_multiply_is_clean(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def copy_rows(x_ptr, y_ptr, row_stride, n_cols, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            row = tl.load(x_ptr + pid.to(tl.int64) * row_stride + cols, mask=cols < n_cols)
            tl.store(y_ptr + row_stride * tl.program_id(0).to(tl.int64) + cols, row)
            r64 = tl.cast(pid, tl.int64)
            tl.store(y_ptr + r64 * row_stride + cols, row)
            w = tl.program_id(1).to(tl.int64, bitcast=False)
            tl.store(y_ptr + w * row_stride + cols, row)
    """,
    )
    assert found == []


def test_widened_stride_makes_product_wide(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, row_stride, stride64: tl.int64, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            tl.load(x_ptr + pid * row_stride.to(tl.int64) + tl.arange(0, BLOCK))
            tl.load(x_ptr + pid * stride64 + tl.arange(0, BLOCK))
    """,
    )
    assert found == []


def test_late_widening_is_flagged(tmp_path):
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def late(x_ptr, row_stride, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            off = (pid * row_stride).to(tl.int64)
            tl.load(x_ptr + off + tl.arange(0, BLOCK))
    """,
    )
    assert found == [(line_of(src, "off = "), "late", "pid * row_stride")]


def test_wide_sum_does_not_excuse_an_earlier_narrow_product(tmp_path):
    # the int64 term is added after pid_h * stride_h was computed in int32
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride_t, stride_h, BLOCK: tl.constexpr):
            pid_t = tl.program_id(0)
            pid_h = tl.program_id(1)
            off = pid_t.to(tl.int64) * stride_t + pid_h * stride_h
            tl.load(x_ptr + off + tl.arange(0, BLOCK))
    """,
    )
    assert found == [(line_of(src, "off = "), "k", "pid_h * stride_h")]


def test_narrowing_cast_is_not_a_widening(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride, BLOCK: tl.constexpr):
            pid = tl.program_id(0).to(tl.int64).to(tl.int32)
            tl.load(x_ptr + pid * stride)
    """,
    )
    assert [f[2] for f in found] == ["pid * stride"]


def test_loop_index_is_flagged_and_widened_form_is_clean(tmp_path):
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def rows(p, n, stride, BLOCK: tl.constexpr):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(n):
                acc += tl.load(p + i * stride + tl.arange(0, BLOCK))
            tl.store(p + tl.arange(0, BLOCK), acc)

        @triton.jit
        def rows_fixed(p, n, stride, BLOCK: tl.constexpr):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in tl.range(n):
                acc += tl.load(p + i.to(tl.int64) * stride + tl.arange(0, BLOCK))
            for j in range(n.to(tl.int64)):  # int64 bounds give an int64 loop variable
                acc += tl.load(p + j * stride + tl.arange(0, BLOCK))
            tl.store(p + tl.arange(0, BLOCK), acc)
    """,
    )
    assert found == [(line_of(src, "i * stride"), "rows", "i * stride")]


def test_static_range_variable_times_stride_is_flagged(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride, BLOCK: tl.constexpr, N: tl.constexpr):
            for i in tl.static_range(N):
                tl.load(x_ptr + i * 4 + tl.arange(0, BLOCK))   # bounded * small constant: fine
                tl.load(x_ptr + i * stride + tl.arange(0, BLOCK))
    """,
    )
    assert [f[2] for f in found] == ["i * stride"]


def test_loop_carried_value_found_by_fixed_point(tmp_path):
    # `off` only becomes a narrow product in the first iteration and is used in the next
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, n, stride, BLOCK: tl.constexpr):
            off = 0
            for i in range(n):
                tl.load(x_ptr + off + tl.arange(0, BLOCK))
                off = i * stride
    """,
    )
    assert found == [(line_of(src, "off = i"), "k", "i * stride")]


def test_branch_widening_only_one_side_is_flagged(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride, FLAG: tl.constexpr):
            pid = tl.program_id(0)
            if FLAG:
                row = pid.to(tl.int64)
            else:
                row = pid
            tl.load(x_ptr + row * stride)
    """,
    )
    assert [f[2] for f in found] == ["row * stride"]


def test_arange_block_offsets_are_clean(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, out_ptr, n, BLOCK: tl.constexpr, HALF: tl.constexpr):
            cols = tl.arange(0, BLOCK)
            x = tl.load(x_ptr + cols, mask=cols < n)
            pairs = tl.arange(0, HALF) * 2            # interleaved pairs, constant scale
            y = tl.load(x_ptr + pairs + 1)
            tile = tl.arange(0, HALF)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
            tl.store(out_ptr + tile, x[None, :] + y[:, None])
            tl.store(out_ptr + tl.program_id(0), 0.0)     # an unscaled program id is < 2**31
    """,
    )
    assert found == []


def test_arange_times_runtime_stride_is_flagged(tmp_path):
    # BLOCK_H * stride_h can pass 2**31 when the head stride is large (head-major layout)
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(q_ptr, stride_t, stride_h, BLOCK_H: tl.constexpr, D: tl.constexpr):
            t = tl.program_id(0).to(tl.int64)
            offs_h = tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, D)
            base = q_ptr + t * stride_t
            x = tl.load(base + offs_h[:, None] * stride_h + offs_d[None, :])
            x = tl.load(base + offs_h[:, None].to(tl.int64) * stride_h + offs_d[None, :])
    """,
    )
    assert [f[2] for f in found] == ["offs_h[:, None] * stride_h"]


def test_flat_program_id_times_block_is_flagged(tmp_path):
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n)
            tl.store(y_ptr + offs, x, mask=offs < n)

        @triton.jit
        def add_fixed(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n)
            tl.store(y_ptr + offs, x, mask=offs < n)

        @triton.jit
        def add_late(x_ptr, n, BLOCK: tl.constexpr):
            offs = (tl.program_id(0) * BLOCK).to(tl.int64) + tl.arange(0, BLOCK)
            tl.load(x_ptr + offs, mask=offs < n)
    """,
    )
    assert found == [
        (line_of(src, "offs = tl.program_id(0) * BLOCK"), "add", "tl.program_id(0) * BLOCK"),
        (line_of(src, "offs = (tl.program_id(0) * BLOCK)"), "add_late", "tl.program_id(0) * BLOCK"),
    ]


def test_tiled_token_block_widened_before_stride_is_clean(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(q_ptr, T, stride_t, BLOCK_T: tl.constexpr, D: tl.constexpr):
            offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
            offs_d = tl.arange(0, D)
            ptrs = q_ptr + offs_t.to(tl.int64)[:, None] * stride_t + offs_d[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=offs_t[:, None] < T) * 2, mask=offs_t[:, None] < T)
    """,
    )
    assert found == []


def test_tiled_token_block_not_widened_is_flagged_once(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(q_ptr, stride_t, BLOCK_T: tl.constexpr, D: tl.constexpr):
            offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
            ptrs = q_ptr + offs_t[:, None] * stride_t + tl.arange(0, D)[None, :]
            tl.store(ptrs, tl.load(ptrs))
    """,
    )
    assert [f[2] for f in found] == ["offs_t[:, None] * stride_t"]


def test_chained_product_reported_once(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, H, D):
            pid = tl.program_id(0)
            tl.load(x_ptr + pid * H * D)
    """,
    )
    assert [f[2] for f in found] == ["pid * H"]


def test_multiline_expression_is_reported_on_one_line(tmp_path):
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride):
            pid = tl.program_id(0)
            off = (pid *
                   stride)
            tl.load(x_ptr + off)
    """,
    )
    assert found == [(line_of(src, "off = (pid"), "k", "pid * stride")]


def test_loaded_index_is_narrow(tmp_path):
    # slot_mapping / positions may be int32 tensors
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def store(cache_ptr, slot_ptr, stride_slot, D: tl.constexpr):
            t = tl.program_id(0)
            slot = tl.load(slot_ptr + t)
            tl.store(cache_ptr + slot * stride_slot + tl.arange(0, D), 1.0)
            slot64 = tl.load(slot_ptr + t).to(tl.int64)
            tl.store(cache_ptr + slot64 * stride_slot + tl.arange(0, D), 1.0)
    """,
    )
    assert found == [(line_of(src, "slot * stride_slot"), "store", "slot * stride_slot")]


def test_pointer_by_annotation_and_augassign(tmp_path):
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(X: "*fp32", Y, stride):
            pid = tl.program_id(0)
            row = X + pid * stride
            Y += pid * stride
            tl.store(Y, 0.0)
    """,
    )
    assert found == [
        (line_of(src, "row = X"), "k", "pid * stride"),
        (line_of(src, "Y += "), "k", "pid * stride"),
    ]


def test_mask_and_stored_values_are_not_offsets(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, idx_ptr, n, stride, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            m = pid * stride + cols < n
            tl.store(idx_ptr + cols, pid * stride + cols, mask=m)
    """,
    )
    assert found == []


def test_block_ptr_offsets(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, M, N, stride_m, stride_n, BM: tl.constexpr, BN: tl.constexpr):
            pid = tl.program_id(0)
            bp = tl.make_block_ptr(x_ptr, (M, N), (stride_m, stride_n), (pid * BM, 0), (BM, BN), (1, 0))
            tl.load(bp)
            bp2 = tl.make_block_ptr(base=x_ptr, shape=(M, N), strides=(stride_m, stride_n),
                                    offsets=(pid * M, 0), block_shape=(BM, BN), order=(1, 0))
            tl.load(tl.advance(bp2, (0, BN)))
    """,
    )
    assert [f[2] for f in found] == ["pid * M"]


# ---------------------------------------------------------------------------------------
# suppression


def test_suppression_with_reason(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            x = tl.load(x_ptr + pid * stride + tl.arange(0, BLOCK))  # int32-ok: grid <= 64 rows by contract
    """,
    )
    assert found == []


def test_suppression_at_the_pointer_use(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride, BLOCK: tl.constexpr):
            off = tl.program_id(0) * stride
            a = tl.load(x_ptr + off)  # int32-ok: launcher asserts numel < 2**31 for this path
            b = tl.load(x_ptr + off + 1)
    """,
    )
    assert [f[2] for f in found] == ["tl.program_id(0) * stride"]  # the second use still counts


def test_suppression_needs_a_reason(tmp_path):
    path, src = _write(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride):
            pid = tl.program_id(0)
            a = tl.load(x_ptr + pid * stride)  # int32-ok
            b = tl.load(x_ptr + pid * stride)  # int32-ok:
    """,
    )
    found, warnings = audit.audit_file(str(path))
    assert len(found) == 2
    assert sorted(w.line for w in warnings) == [line_of(src, "a = "), line_of(src, "b = ")]


def test_suppression_on_multiline_statement(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride, n):
            pid = tl.program_id(0)
            a = tl.load(
                x_ptr + pid * stride,
                mask=pid < n,
            )  # int32-ok: rows are < 2**31 / stride by construction
    """,
    )
    assert found == []


def test_suppressed_assignment_declares_a_small_index(tmp_path):
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride, BLOCK: tl.constexpr):
            blk = tl.program_id(1)  # int32-ok: fewer than 65536 head blocks
            tl.load(x_ptr + blk * BLOCK + tl.arange(0, BLOCK))   # constant scaling: fine now
            tl.load(x_ptr + blk * stride)                        # still a narrow product
    """,
    )
    assert found == [(line_of(src, "blk * stride"), "k", "blk * stride")]


# ---------------------------------------------------------------------------------------
# jit detection and calls between kernels


def test_only_jit_functions_are_checked_and_decorator_forms(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        from triton import jit

        def host_side(x_ptr, stride):
            pid = tl.program_id(0)
            return tl.load(x_ptr + pid * stride)

        @jit
        def a(x_ptr, stride):
            tl.load(x_ptr + tl.program_id(0) * stride)

        @triton.jit(do_not_specialize=["stride"])
        def b(x_ptr, stride):
            tl.load(x_ptr + tl.program_id(0) * stride)

        @triton.autotune(configs=[triton.Config({"BLOCK": 128})], key=["n"])
        @triton.heuristics({"EVEN": lambda args: args["n"] % 128 == 0})
        @triton.jit
        def c(x_ptr, stride, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
            tl.load(x_ptr + tl.program_id(0) * stride)
    """,
    )
    assert [f[1] for f in found] == ["a", "b", "c"]


def test_helper_receives_narrow_arguments(tmp_path):
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def _load_row(x_ptr, row, stride, BLOCK: tl.constexpr):
            return tl.load(x_ptr + row * stride + tl.arange(0, BLOCK))

        @triton.jit
        def kernel(x_ptr, stride, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            return _load_row(x_ptr, pid, stride, BLOCK)
    """,
    )
    assert found == [(line_of(src, "row * stride"), "_load_row", "row * stride")]


def test_helper_with_widened_arguments_is_clean(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def _load_row(x_ptr, row, stride, BLOCK: tl.constexpr):
            return tl.load(x_ptr + row * stride + tl.arange(0, BLOCK))

        @triton.jit
        def kernel(x_ptr, stride, BLOCK: tl.constexpr):
            return _load_row(x_ptr, row=tl.program_id(0).to(tl.int64), stride=stride, BLOCK=BLOCK)

        @triton.jit
        def unused_helper(x_ptr, row, stride):
            return tl.load(x_ptr + row * stride)  # params of a launched kernel: not narrow
    """,
    )
    assert found == []


def test_helper_multiplies_its_param_with_a_pid(tmp_path):
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def _row_ptr(x_ptr, stride):
            return x_ptr + tl.program_id(0) * stride

        @triton.jit
        def kernel(x_ptr, stride):
            tl.store(_row_ptr(x_ptr, stride), 1.0)
    """,
    )
    assert [(f[1], f[2]) for f in found] == [("_row_ptr", "tl.program_id(0) * stride")]


def test_helper_return_value_flows_back(tmp_path):
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def _row_offset(stride):
            return tl.program_id(0) * stride

        @triton.jit
        def kernel(x_ptr, stride, BLOCK: tl.constexpr):
            off = _row_offset(stride)
            tl.load(x_ptr + off + tl.arange(0, BLOCK))
    """,
    )
    assert found == [(line_of(src, "return tl.program_id"), "_row_offset", "tl.program_id(0) * stride")]


def test_tuple_concatenation_keeps_each_element(tmp_path):
    # a group grown with += hands each element on as it was: the float value's product next to a
    # pointer does not make the pointer's offset narrow, and the narrow offset is still found
    found, src = run_audit(
        tmp_path,
        """
        @triton.jit
        def _use(group, BLOCK: tl.constexpr):
            base, eps, off = group[0], group[1], group[2]
            v = tl.load(base + tl.arange(0, BLOCK))
            tl.store(base + off + tl.arange(0, BLOCK), v + eps)

        @triton.jit
        def kernel(x_ptr, stride, eps_val, BLOCK: tl.constexpr):
            v = tl.load(x_ptr + tl.arange(0, BLOCK))
            group = (x_ptr,)
            group += (v * v * eps_val, tl.program_id(0) * stride)
            _use(group, BLOCK)
    """,
    )
    assert found == [(line_of(src, "group += ("), "kernel", "tl.program_id(0) * stride")]


def test_helper_constexpr_like_argument_is_constant(tmp_path):
    # a helper parameter that every caller fills with a constexpr acts as a constant
    found, _ = run_audit(
        tmp_path,
        """
        @triton.jit
        def _tile(x_ptr, start, BLOCK):
            return tl.load(x_ptr + start + tl.arange(0, BLOCK) * 2)

        @triton.jit
        def kernel(x_ptr, BLOCK: tl.constexpr):
            _tile(x_ptr, tl.program_id(0), BLOCK)
    """,
    )
    assert found == []


def test_helper_imported_from_another_file(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _, helpers_src = _write(
        pkg,
        """
        @triton.jit
        def _load_row(x_ptr, row, stride, BLOCK: tl.constexpr):
            return tl.load(x_ptr + row * stride + tl.arange(0, BLOCK))
    """,
        "helpers.py",
    )
    _write(
        pkg,
        """
        from .helpers import _load_row
        from pkg import helpers

        @triton.jit
        def kernel(x_ptr, stride, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            _load_row(x_ptr, pid, stride, BLOCK)
            helpers._load_row(x_ptr, pid.to(tl.int64), stride, BLOCK)
    """,
        "kern.py",
    )
    want = [(str(pkg / "helpers.py"), line_of(helpers_src, "row * stride"), "row * stride")]
    for paths in ([str(pkg)], [str(pkg / "kern.py")]):  # the imported file is read either way
        found, _, errors, _ = audit.audit_paths(paths)
        assert not errors
        assert [(os.path.abspath(f.path), f.line, f.expression) for f in found] == want
    # the helper alone: its parameters are runtime values, not narrow
    found, _, _, _ = audit.audit_paths([str(pkg / "helpers.py")])
    assert found == []


# ---------------------------------------------------------------------------------------
# API, CLI and exit codes


def test_finding_format(tmp_path):
    path, src = _write(
        tmp_path,
        """
        @triton.jit
        def k(x_ptr, stride):
            tl.load(x_ptr + tl.program_id(0) * stride)
    """,
    )
    (f,), _ = audit.audit_file(str(path))
    assert f.format() == (
        f"{path}:{line_of(src, 'tl.load')}: k: narrow (int32) index reaches a pointer offset: tl.program_id(0) * stride"
    )


BUGGY = """
    @triton.jit
    def bad(x_ptr, stride, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        tl.load(x_ptr + pid * stride + tl.arange(0, BLOCK))
"""
CLEAN = """
    @triton.jit
    def good(x_ptr, stride, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        tl.load(x_ptr + pid * stride + tl.arange(0, BLOCK))
"""


def test_main_in_process(tmp_path, capsys):
    bad, src = _write(tmp_path, BUGGY, "bad.py")
    good, _ = _write(tmp_path, CLEAN, "good.py")
    assert audit.main([str(good)]) == 0
    assert audit.main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}:{line_of(src, 'tl.load')}: bad: narrow (int32) index reaches a pointer offset: pid * stride" in out
    assert audit.main([str(tmp_path / "missing.py")]) == 2
    assert audit.main([]) == 2
    (tmp_path / "broken.py").write_text("def f(:\n")
    assert audit.main([str(tmp_path / "broken.py")]) == 2


def _cli(*args, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_SRC)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run(
        [sys.executable, "-m", "ropekit.audit", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_cli_exit_codes(tmp_path):
    clean_dir = tmp_path / "clean"
    bad_dir = tmp_path / "bad" / "nested"
    clean_dir.mkdir()
    bad_dir.mkdir(parents=True)
    _write(clean_dir, CLEAN, "good.py")
    _, bad_src = _write(bad_dir, BUGGY, "bad.py")
    (bad_dir / "notes.txt").write_text("tl.load(x_ptr + pid * stride)")  # not a .py file

    r = _cli(clean_dir / "good.py", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no findings" in r.stdout

    r = _cli(tmp_path / "bad", clean_dir, cwd=tmp_path)  # directories are searched recursively
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == (
        f"{bad_dir / 'bad.py'}:{line_of(bad_src, 'tl.load')}: bad: narrow (int32) index reaches a pointer "
        "offset: pid * stride"
    )
    assert "1 finding(s) in 2 file(s)" in lines[-1]

    (tmp_path / "broken.py").write_text("@triton.jit\ndef f(:\n")
    r = _cli(tmp_path / "broken.py", cwd=tmp_path)
    assert r.returncode == 2
    assert "broken.py:2" in r.stderr
    r = _cli(tmp_path / "broken.py", tmp_path / "nope.py", cwd=tmp_path)  # a wrong path: only that
    assert r.returncode == 2
    assert "nope.py" in r.stderr and "broken.py" not in r.stderr and r.stdout == ""


def test_ropekit_kernels_are_clean():
    """What CI enforces: ropekit's own kernels have no unexplained int32 index."""
    kernels = _SRC / "ropekit" / "kernels"
    assert {p.name for p in kernels.glob("*.py")} >= {"rope.py", "store.py", "rerotate.py"}
    found, warnings, errors, _ = audit.audit_paths([str(kernels)])
    assert not errors
    assert not warnings, [w.format() for w in warnings]
    assert not found, "\n".join(f.format() for f in found)


def test_missing_path_prints_only_the_error_and_fails(tmp_path, capsys):
    missing = tmp_path / "no_such_dir"
    good, _ = _write(tmp_path, "x = 1\n")
    assert audit.main([str(missing), str(good)]) == 2
    out, err = capsys.readouterr()
    assert out == "", f"nothing on stdout beside the error, got {out!r}"
    assert err.strip() == f"{missing}: error: no such file or directory"
    # through the module entry point, as a user runs it
    proc = subprocess.run(
        [sys.executable, "-m", "ropekit.audit", str(missing)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(_SRC)},
    )
    assert proc.returncode == 2 and proc.stdout == "" and "no findings" not in proc.stderr
