"""64-bit addressing, provable on CPU: views whose elements sit past 2^31 (see helpers/big_offsets.py).

Each case runs in a subprocess: a 32-bit kernel may segfault the interpreter. The control case
runs a deliberately 32-bit kernel on the same view and must fail, which shows the setup bites.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "big_offsets.py"


def run(mode):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, str(SCRIPT), mode], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.skipif(sys.platform != "linux", reason="relies on untouched pages of torch.empty (Linux overcommit)")
def test_offsets_past_2_31_are_right():
    r = run("rope")
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="relies on untouched pages of torch.empty (Linux overcommit)")
def test_control_32bit_kernel_fails_on_the_same_view():
    r = run("control")
    assert r.returncode != 0 or "WRONG" in r.stdout, "the 64-bit test setup would not catch a 32-bit kernel"


@pytest.mark.gpu
@pytest.mark.bigmem
def test_bigmem_cuda_q_past_2_31_elements():
    """A real q above 2^31 elements on the GPU (T=262,145, H=64, D=128, bf16: 4.3 GB)."""
    import ropekit
    from ropekit.tools import reference

    T, H, D = 262_145, 64, 128
    assert T * H * D > 2**31
    q = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(T, 8, D, dtype=torch.bfloat16, device="cuda")
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.arange(T, dtype=torch.float64)[:, None] * inv
    cache = torch.cat((f.cos(), f.sin()), -1).float().cuda()
    pos = torch.arange(T, device="cuda")
    tail = slice(T - 3, T)
    rq, rk = reference.apply_rope(q[tail].double().cpu(), k[tail].double().cpu(), pos[tail].cpu(), cache.double().cpu())
    qo, ko = ropekit.apply_rope(q, k, pos, cache)
    torch.cuda.synchronize()
    for out, ref in ((qo[tail], rq), (ko[tail], rk)):
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-2
    ropekit.apply_rope(q, k, pos, cache, inplace=True)
    err = ((q[tail].double().cpu() - rq).norm() / rq.norm()).item()
    assert err < 1e-2


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("interleaved_sections", [False, True], ids=["chunked", "interleaved"])
def test_bigmem_cuda_mrope_past_2_31_elements(interleaved_sections):
    """M-RoPE on a q above 2^31 elements (T=262,145, H=64, D=128, bf16), (3, T) positions."""
    import ropekit
    from ropekit.tools import reference

    T, H, D = 262_145, 64, 128
    section = [16, 24, 24] if not interleaved_sections else [24, 20, 20]
    q = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    cache = ropekit.cos_sin_cache(D, 65536, device="cuda")
    pos = torch.randint(0, 65536, (3, T), device="cuda")
    tail = slice(T - 3, T)
    rq, _ = reference.apply_rope(
        q[tail].double().cpu(),
        None,
        pos[:, tail].cpu(),
        cache.double().cpu(),
        mrope_section=section,
        mrope_interleaved=interleaved_sections,
    )
    qo, _ = ropekit.apply_rope(q, None, pos, cache, mrope_section=section, mrope_interleaved=interleaved_sections)
    torch.cuda.synchronize()
    err = ((qo[tail].double().cpu() - rq).norm() / rq.norm()).item()
    assert err < 1e-2


@pytest.mark.gpu
@pytest.mark.bigmem
def test_bigmem_cuda_axial_freqs_past_2_31_elements():
    """Angles computed in the kernel (Wan's 3 axes) on a q above 2^31 elements (T=262,145, H=64,
    D=128, bf16: 4.3 GB): the last tokens against float64, out of place and in place."""
    import ropekit
    from ropekit.tools import reference

    T, H, D = 262_145, 64, 128
    axes = (22, 21, 21)
    f = ropekit.axial_inv_freq((44, 42, 42), device="cuda")
    q = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(-1000, 100_000, (3, T), device="cuda")
    tail = slice(T - 3, T)
    c, s = reference.angles_from_freqs(pos[:, tail].cpu(), f.cpu(), axes, torch.float64)
    rq = reference.rotate(q[tail].double().cpu(), c, s, interleaved=True)
    qo, _ = ropekit.apply_rope(q, None, pos, None, inv_freq=f, axes=axes, interleaved=True)
    torch.cuda.synchronize()
    assert ((qo[tail].double().cpu() - rq).norm() / rq.norm()).item() < 1e-2
    del qo
    ropekit.apply_rope(q, None, pos, None, inv_freq=f, axes=axes, interleaved=True, inplace=True)
    assert ((q[tail].double().cpu() - rq).norm() / rq.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.bigmem
def test_bigmem_cuda_head_table_past_2_31_elements():
    """A per-head table above 2^31 elements (2^21 + 1 positions x 8 heads x 128, bf16: 4.3 GB): rows
    of its last positions, read through int64 row and head offsets."""
    import ropekit
    from ropekit.tools import reference

    P, Ht, D = 2**21 + 1, 8, 128
    assert P * Ht * D > 2**31
    table = torch.empty(P, Ht, D, dtype=torch.bfloat16, device="cuda")
    last = torch.randn(4, Ht, D, dtype=torch.float64)
    table[-4:] = last.to(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(3, 32, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(3, Ht, D, dtype=torch.bfloat16, device="cuda")
    pos = torch.tensor([P - 1, P - 4, P - 2], device="cuda")
    small = table[-4:].double().cpu()  # the same rows, positions shifted into a 4-row table
    rq, rk = reference.apply_rope(q.double().cpu(), k.double().cpu(), pos.cpu() - (P - 4), small)
    qo, ko = ropekit.apply_rope(q, k, pos, table)
    torch.cuda.synchronize()
    for out, ref in ((qo, rq), (ko, rk)):
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-2
