"""reference.rotate_into (the fast CPU rotation) against reference.rotate in float64."""

from __future__ import annotations

import pytest
import torch

from ropekit import reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("in_il, out_il", [(False, False), (True, True), (False, True), (True, False)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("where", ["out", "inplace"])
@pytest.mark.parametrize("layout", ["bshd_view", "thd", "big"])
def test_rotate_into_matches_rotate(dtype, in_il, out_il, inverse, where, layout):
    g = torch.Generator().manual_seed(0)
    D, rot = 48, 32
    if layout == "bshd_view":  # HF's (B, S, H, D) view of (B, H, S, D) storage, partial rotary
        x = torch.randn(2, 3, 5, D, generator=g).to(dtype).transpose(1, 2)
        cos = torch.randn(2, 5, rot // 2, generator=g)
    elif layout == "thd":
        x = torch.randn(7, 3, D, generator=g).to(dtype)
        cos = torch.randn(7, rot // 2, generator=g)
    else:  # past one scratch block: the blocked path
        x = torch.randn(4, 8, 600, D, generator=g).to(dtype).transpose(1, 2)  # (4, 600, 8, D)
        cos = torch.randn(600, rot // 2, generator=g)  # broadcast over B
    sin = torch.randn(cos.shape, generator=g)
    want = reference.rotate(
        x.double(), cos.double(), sin.double(), interleaved=in_il, out_interleaved=out_il, inverse=inverse
    )
    src = x.clone()
    out = x if where == "inplace" else torch.full_like(x, float("nan"))
    got = reference.rotate_into(x, out, cos, sin, interleaved=in_il, out_interleaved=out_il, inverse=inverse)
    assert got is out
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 4)
    assert torch.equal(got[..., rot:], src[..., rot:]), "tail copied / kept"


def test_rotate_into_nan_angles_stay_in_their_token():
    x = torch.randn(3, 2, 8)
    cos, sin = torch.randn(3, 4), torch.randn(3, 4)
    cos[1] = float("nan")
    sin[1] = float("nan")
    out = reference.rotate_into(x, torch.empty_like(x), cos, sin)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()
