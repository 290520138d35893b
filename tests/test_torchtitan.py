"""ropekit.torchtitan with the real torchtitan: the override modules against torchtitan's own RoPE
modules, the overrides applied by torchtitan's mechanism to debug-size Llama 3 (ComplexRoPE) and
Qwen3 (CosSinRoPE) models built on the CPU (loss and gradients equal to the unpatched model), and
two gloo processes with q / k head-sharded DTensors, as tensor parallelism hands them over."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="torchtitan is not installed (CI installs it in its own venv)")
from torchtitan.config import OverrideConfig, apply_overrides, derive  # noqa: E402
from torchtitan.config.override import parse_cli_imports  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE  # noqa: E402

from ropekit import torchtitan as rt  # noqa: E402

from conftest import TOL, rel_err  # noqa: E402

FP32 = TOL[torch.float32]


def _pairs():
    pairs = [
        (CosSinRoPE.Config(dim=32, max_seq_len=64, theta=1e6), rt.RopekitCosSinRoPE),
        (
            ComplexRoPE.Config(dim=32, max_seq_len=64, theta=5e5, scaling="llama", original_max_position_embeddings=32),
            rt.RopekitComplexRoPE,
        ),
        (
            CosSinRoPE.Config(dim=32, max_seq_len=64, scaling="yarn", rope_factor=4.0, original_seq_len=16),
            rt.RopekitCosSinRoPE,
        ),
    ]
    if rt.MRoPE is not None:
        pairs.append((rt.MRoPE.Config(dim=32, max_seq_len=64, mrope_section=[6, 5, 5]), rt.RopekitMRoPE))
    return pairs


@pytest.mark.parametrize("cfg, cls", _pairs(), ids=lambda v: type(v).__qualname__ if not isinstance(v, type) else "")
@pytest.mark.parametrize("kind", ["none", "batch", "shared", "mrope"])
def test_override_module_is_torchtitans(cfg, cls, kind):
    if kind == "mrope" and not (rt.MRoPE is not None and isinstance(cfg, rt.MRoPE.Config)):
        pytest.skip("(B, S, 3) positions are MRoPE's")
    torch.manual_seed(0)
    theirs, ours = cfg.build(), derive(cfg, cls.Config).build()
    assert type(ours) is cls and isinstance(ours, type(theirs))
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()] == ["cache"]
    assert torch.equal(ours.cache, theirs.cache)
    q = torch.randn(2, 6, 4, 32, requires_grad=True)
    k = torch.randn(2, 6, 2, 32, requires_grad=True)
    pos = {
        "none": None,
        "batch": torch.randint(0, 64, (2, 6)),
        "shared": torch.randint(0, 64, (1, 6)),
        "mrope": torch.randint(0, 64, (2, 6, 3)),
    }[kind]
    want, got = theirs(q, k, pos), ours(q, k, pos)
    g = [torch.randn_like(x) for x in want]
    grads_want = torch.autograd.grad(sum((x * gx).sum() for x, gx in zip(want, g)), (q, k))
    grads_got = torch.autograd.grad(sum((x * gx).sum() for x, gx in zip(got, g)), (q, k))
    for a, b in zip(got + grads_got, want + grads_want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_err(a, b) < FP32


def test_overrides_resolve_by_their_public_names():
    """torchtitan resolves `--override.imports module.function` by the factory's registered name."""
    imports = parse_cli_imports(["ropekit.torchtitan.cos_sin_rope,ropekit.torchtitan.complex_rope"])
    cfg = _debug("qwen3")
    lines = apply_overrides(OverrideConfig(imports=imports), cfg)
    assert lines and all("RopekitCosSinRoPE" in line for line in lines), lines
    assert all(type(layer.attention.rope) is rt.RopekitCosSinRoPE.Config for layer in cfg.layers)


def _debug(family):
    """torchtitan's debug model of the family, 2 layers, with its causal SDPA (FlexAttention has no CPU backward)."""
    if family == "llama3":
        from torchtitan.models.llama3 import model_registry
    else:
        from torchtitan.models.qwen3 import model_registry
    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


@pytest.mark.parametrize(
    "family, override, rope",
    [("llama3", "complex_rope", "RopekitComplexRoPE"), ("qwen3", "cos_sin_rope", "RopekitCosSinRoPE")],
)
def test_patched_model_trains_as_torchtitans(family, override, rope):
    torch.manual_seed(0)
    cfg = _debug(family)
    patched_cfg = copy.deepcopy(cfg)
    assert apply_overrides(OverrideConfig(imports=[f"ropekit.torchtitan.{override}"]), patched_cfg)
    model, patched = cfg.build(), patched_cfg.build()
    assert type(patched.layers["0"].attention.rope).__name__ == rope
    assert patched.state_dict().keys() == model.state_dict().keys()
    patched.load_state_dict(model.state_dict(), strict=True)
    tokens = torch.randint(0, 2048, (2, 12))
    labels = torch.randint(0, 2048, (2, 12))
    positions = torch.cat((torch.arange(5), torch.arange(7))).repeat(2, 1)  # two documents per row

    def loss_and_grads(m):
        logits = m(tokens, positions)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return loss, torch.autograd.grad(loss, [p for _, p in m.named_parameters()])

    loss_want, grads_want = loss_and_grads(model)
    loss_got, grads_got = loss_and_grads(patched)
    assert abs(loss_got.item() - loss_want.item()) <= FP32 * abs(loss_want.item())
    for (name, _), a, b in zip(model.named_parameters(), grads_got, grads_want):
        assert rel_err(a, b) < FP32, name


def _tp_worker(rank, init_file, world):
    """One rank: q / k head-sharded DTensors (ColwiseParallel's output), the cache a replicated DTensor
    (torchtitan's sharding config for it), plain positions; the patched module's full result and
    gradients against torchtitan's module on the unsharded tensors."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for cfg, cls in _pairs()[:2]:
            torch.manual_seed(0)  # the same full tensors on every rank
            theirs, ours = cfg.build(), derive(cfg, cls.Config).build()
            ours.cache = distribute_tensor(ours.cache, mesh, [Replicate()])
            q = torch.randn(2, 6, 4, 32, requires_grad=True)
            k = torch.randn(2, 6, 2, 32, requires_grad=True)
            pos = torch.randint(0, 64, (2, 6))
            gq, gk = torch.randn(2, 6, 4, 32), torch.randn(2, 6, 2, 32)
            want = theirs(q, k, pos)
            grads_want = torch.autograd.grad((want[0] * gq).sum() + (want[1] * gk).sum(), (q, k))
            qd = distribute_tensor(q.detach(), mesh, [Shard(2)]).requires_grad_()
            kd = distribute_tensor(k.detach(), mesh, [Shard(2)]).requires_grad_()
            got = ours(qd, kd, pos)
            assert all(x.placements == (Shard(2),) for x in got), [x.placements for x in got]
            gqd, gkd = (distribute_tensor(g, mesh, [Shard(2)]) for g in (gq, gk))
            grads_got = torch.autograd.grad((got[0] * gqd).sum() + (got[1] * gkd).sum(), (qd, kd))
            for a, b in zip(got + grads_got, want + grads_want):
                assert rel_err(a.full_tensor(), b) < FP32, cls.__name__
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_two_gloo_ranks(tmp_path):
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(_tp_worker, args=(str(tmp_path / "init"), 2), nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + 240  # bounded: a hung rank fails the test instead of the CI run
    while not ctx.join(timeout=5):  # raises with the failing rank's traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two gloo ranks did not finish in 240 s")
