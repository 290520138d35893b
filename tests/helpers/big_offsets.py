"""Run apply_rope on views whose last element sits past 2^31 elements (run in a subprocess).

torch.empty does not touch its pages, so a view with a token (or head, or table-row) stride of
2^30 over a 4 GiB buffer costs only the few rows written. A kernel that computes any of those
offsets in int32 wraps at 2^31 and reads or writes the wrong address (seen: a segfault).

    python big_offsets.py rope      ropekit on token, head, column, table-row and table-head strides of 2^30: prints OK
    python big_offsets.py control   a deliberately 32-bit copy kernel on the same view: must fail
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

STRIDE = 2**30  # below 2^31, so Triton passes it as int32: the products must be widened
H, D = 2, 64


def big_rows(n_rows, row_shape, dtype=torch.bfloat16, offset=0):
    """A (n_rows, *row_shape) view with row stride 2^30 over an untouched buffer, rows filled."""
    row = 1
    for n in row_shape:
        row *= n
    buf = torch.empty((n_rows - 1) * STRIDE + row + offset, dtype=dtype)
    strides = [STRIDE]
    acc = 1
    for n in reversed(row_shape):
        strides.insert(1, acc)
        acc *= n
    view = buf.as_strided((n_rows, *row_shape), strides, storage_offset=offset)
    for i in range(n_rows):
        view[i] = torch.randn(row_shape).to(dtype)
    return view


def rope():
    import ropekit
    from ropekit.tools import reference

    def check(q, k, pos, cache, **kw):
        rq, rk = reference.apply_rope(q.double().contiguous(), k.double().contiguous(), pos, cache.double(), **kw)
        qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
        for out, ref in ((qo, rq), (ko, rk)):
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"out of place: relative error {err}"
        ropekit.apply_rope(q, k, pos, cache, inplace=True, **kw)
        for out, ref in ((q, rq), (k, rk)):
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"in place: relative error {err}"

    small_cache = torch.randn(8, D).float()
    # token stride 2^30: token 2 starts at element 2^31
    q = big_rows(3, (H, D))
    k = big_rows(3, (1, D))
    check(q, k, torch.tensor([1, 5, 7]), small_cache)
    check(q, k, torch.tensor([1, 5, 7]), small_cache, interleaved=True)
    # two token dims (B, S) = (3, 1), batch stride 2^30
    check(q.unsqueeze(1), k.unsqueeze(1), torch.tensor([[0], [3], [6]]), small_cache)
    # head stride 2^30: head 2 of the only token starts at 2^31
    qh = big_rows(3, (D,)).unsqueeze(0)  # (1, 3, D), head stride 2^30
    check(qh, torch.randn(1, 1, D).to(torch.bfloat16), torch.tensor([4]), small_cache)
    # table row stride 2^30: position 2 reads row 2 at element 2^31
    cache = big_rows(3, (D,), dtype=torch.float32)
    check(
        torch.randn(3, H, D).to(torch.bfloat16), torch.randn(3, 1, D).to(torch.bfloat16), torch.tensor([2, 0, 2]), cache
    )
    # a per-head table: row stride 2^30 (position 2's row at 2^31), then head stride 2^30 (head 2's
    # row at 2^31, read by q's and k's head 2)
    rows = big_rows(3, (1, D), dtype=torch.float32)
    check(
        torch.randn(3, H, D).to(torch.bfloat16), torch.randn(3, 1, D).to(torch.bfloat16), torch.tensor([2, 0, 2]), rows
    )
    heads = big_rows(3, (D,), dtype=torch.float32).unsqueeze(0)  # (1, 3, D)
    qk = torch.randn(2, 3, D).to(torch.bfloat16)
    check(qk, qk.clone(), torch.tensor([0, 0]), heads)
    # column (last-dim) stride 2^30: column 2 of the only head starts at element 2^31, a column index
    # times the stride past int32; full rotary (both pair layouts) and a partial one (its tail there)
    qc = big_rows(4, ()).reshape(1, 1, 4)  # (1, 1, 4), last stride 2^30
    kc = torch.randn(1, 1, 4).to(torch.bfloat16)
    check(qc, kc, torch.tensor([3]), torch.randn(8, 4).float())
    check(qc, kc, torch.tensor([3]), torch.randn(8, 4).float(), interleaved=True)
    check(qc, kc, torch.tensor([5]), torch.randn(8, 2).float(), rotary_dim=2)
    print("OK")


def control():
    """The bug this guards against: offsets in int32. Must crash or give wrong rows."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows_32bit(x_ptr, o_ptr, stride, N: tl.constexpr):
        row = tl.program_id(0)  # int32-ok: deliberately buggy control kernel, never shipped
        x = tl.load(x_ptr + row * stride + tl.arange(0, N))
        tl.store(o_ptr + row * N + tl.arange(0, N), x)

    x = big_rows(3, (D,))
    out = torch.zeros(3, D, dtype=x.dtype)
    copy_rows_32bit[(3,)](x, out, STRIDE, N=D)
    print("OK" if torch.equal(out[2], x[2]) else "WRONG")


def norm():
    """The q/k RMSNorm path on the same views: forward (out of place, in place), backward, fused store."""
    import ropekit
    from ropekit.core import plans
    from ropekit.core.variant import Variant
    from ropekit.tools import reference

    def err(out, ref):
        return ((out.double() - ref).norm() / ref.norm()).item()

    def check(q, k, pos, cache, across):
        wq = torch.rand(q.shape[-1] * (q.shape[-2] if across else 1)) + 0.5
        wk = torch.rand(k.shape[-1]) + 0.5
        kw = dict(q_norm_weight=wq, k_norm_weight=wk, norm_weight_offset=1.0)
        kw64 = dict(q_norm_weight=wq.double(), k_norm_weight=wk.double(), norm_weight_offset=1.0)
        rq, rk = reference.rms_norm_rope(q.double().contiguous(), k.double().contiguous(), pos, cache.double(), **kw64)
        qo, ko = ropekit.apply_rope(q, k, pos, cache, **kw)
        assert err(qo, rq) < 1e-2 and err(ko, rk) < 1e-2, "out of place"
        # backward: x and its gradient both read through the big strides
        variant = Variant(angles="table")
        angles = plans.angle_layout(variant, cache.shape[1], pos, cache, None)
        gx = torch.empty(q.shape, dtype=q.dtype)
        plan = plans.plan_norm_backward(q, q, gx, wq, angles, variant, 2 if across else 1)
        dw = plans.norm_partials(plan, q.device)
        plans.fire_norm_backward(plan, q, q, gx, wq, dw, pos, cache, 1e-6, 1.0)
        qd = q.double().contiguous().requires_grad_(True)
        wd = wq.double().requires_grad_(True)
        y, _ = reference.rms_norm_rope(qd, None, pos, cache.double(), q_norm_weight=wd, norm_weight_offset=1.0)
        y.backward(q.double())
        assert err(gx, qd.grad) < 2e-2, "backward"
        assert err(plans.norm_weight_grad(dw, wq), wd.grad) < 1e-4, "weight gradient"
        ropekit.apply_rope(q, k, pos, cache, inplace=True, **kw)
        assert err(q, rq) < 1e-2 and err(k, rk) < 1e-2, "in place"

    small_cache = torch.randn(8, D).float()
    q = big_rows(3, (H, D))  # token stride 2^30: token 2 starts at element 2^31
    k = big_rows(3, (1, D))
    check(q, k, torch.tensor([1, 5, 7]), small_cache, across=False)
    check(q, k, torch.tensor([1, 5, 7]), small_cache, across=True)
    qh = big_rows(3, (D,)).unsqueeze(0)  # head stride 2^30: head 2 starts at 2^31
    check(qh, torch.randn(1, 1, D).to(torch.bfloat16), torch.tensor([4]), small_cache, across=True)
    # the fused store into a flat cache whose slot stride is 2^30: slot 2 starts at 2^31
    k_cache = big_rows(3, (1, D))
    v_cache = big_rows(3, (1, D))
    q2 = torch.randn(3, H, D).to(torch.bfloat16)
    k2 = torch.randn(3, 1, D).to(torch.bfloat16)
    wk = torch.rand(D) + 0.5
    _, rk = reference.rms_norm_rope(
        q2.double(), k2.double(), torch.tensor([0, 1, 2]), small_cache.double(), k_norm_weight=wk.double()
    )
    ropekit.apply_rope_and_store(
        q2,
        k2,
        k2.clone(),
        torch.tensor([0, 1, 2]),
        small_cache,
        k_cache,
        v_cache,
        torch.tensor([2, 0, 1]),
        k_norm_weight=wk,
    )
    assert err(k_cache[2], rk[0]) < 1e-2 and err(k_cache[0], rk[1]) < 1e-2, "store"
    print("OK")


if __name__ == "__main__":
    {"rope": rope, "control": control, "norm": norm}[sys.argv[1]]()
