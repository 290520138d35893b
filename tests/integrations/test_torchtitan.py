"""ropekit.torchtitan with the real torchtitan: the override modules against torchtitan's own RoPE
modules, the overrides applied by torchtitan's mechanism to debug-size Llama 3 (ComplexRoPE) and
Qwen3 (CosSinRoPE) models built on the CPU (loss and gradients equal to the unpatched model), two
gloo processes with q / k head-sharded DTensors, as tensor parallelism hands them over, and the whole
debug models under torchtitan's own tensor parallelism (with sequence parallelism, its default) on
two gloo ranks, in each of its three SPMD backends, patched against unpatched.

Context parallelism is not tested: torchtitan 0.3.0 cannot run it on the CPU. Its SDPA path
(partial_dtensor) fails with "NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered" (the CP dispatcher knows only the GPU SDPA kernels), its full_dtensor / spmd_types
backends refuse SDPA with CP (full_dtensor.validate_config), and the attention they need for CP,
FlexAttention, raises "FlexAttention does not support backward on CPU"."""

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


def _spawn(worker, tmp_path, world, seconds):
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        worker, args=(str(tmp_path / "init"), world), nprocs=world, start_method="spawn", join=False
    )
    deadline = time.monotonic() + seconds  # bounded: a hung rank fails the test instead of the CI run
    while not ctx.join(timeout=5):  # raises with the failing rank's traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world} gloo ranks did not finish in {seconds} s")


def test_tensor_parallel_two_gloo_ranks(tmp_path):
    _spawn(_tp_worker, tmp_path, 2, 240)


TP_BACKENDS = ("spmd_types", "partial_dtensor", "full_dtensor")  # ParallelismConfig.spmd_backend's values
FAMILIES = (("llama3", "complex_rope", "RopekitComplexRoPE"), ("qwen3", "cos_sin_rope", "RopekitCosSinRoPE"))


def _model_tp_worker(rank, init_file, world):
    """One rank of the whole debug models under torchtitan's tensor parallelism, as its trainer sets
    them up: the model config's sharding (`update_from_config`, TP and sequence parallel), then the
    override, then `Model.parallelize(parallel_dims)` (what parallelize_llama / parallelize_qwen3 do
    for TP; their FSDP wrapping of size 1 is left out), inputs as the trainer hands them to each
    backend, torchtitan's vocab-parallel cross-entropy. Loss and gradients of the patched model
    against the unpatched one: DTensor gradients as full tensors, spmd_types' plain local shards
    rank by rank (each rank checks its own)."""
    import types

    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.tensor import DTensor
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.full_dtensor import parallelize_inputs, validate_config
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    def full(x):
        return x.full_tensor() if isinstance(x, DTensor) else x

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # torchtitan picks the mesh's device type at import: "cuda" on a host without an accelerator
    parallel_dims_module.device_type = "cpu"
    torch.autograd.set_multithreading_enabled(False)  # as torchtitan's init_distributed does
    try:
        for backend in TP_BACKENDS:
            dist_utils.set_spmd_backend(backend)
            dims = ParallelDims(
                dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world, spmd_backend=backend
            )
            job = types.SimpleNamespace(
                parallelism=ParallelismConfig(tensor_parallel_degree=world, spmd_backend=backend)
            )
            context = dist_utils.get_spmd_context(parallel_dims=dims)
            for family, override, rope in FAMILIES:
                where = f"{backend} {family}"
                torch.manual_seed(0)  # the same weights and tokens on every rank
                cfg = _debug(family)
                cfg.update_from_config(config=job)  # the sharding config, before the override (torchtitan's order)
                patched_cfg = copy.deepcopy(cfg)
                assert apply_overrides(OverrideConfig(imports=[f"ropekit.torchtitan.{override}"]), patched_cfg)
                model, patched = cfg.build(), patched_cfg.build()
                patched.load_state_dict(model.state_dict(), strict=True)
                ropes = [layer.attention.rope for layer in patched.layers.values()]
                assert all(type(r).__name__ == rope for r in ropes), where
                local_heads = []  # q's heads on this rank, as the patched rope module gets it
                ropes[0].register_forward_pre_hook(
                    lambda m, args: local_heads.append(
                        (args[0].to_local() if isinstance(args[0], DTensor) else args[0]).shape[2]
                    )
                )
                for m in (model, patched):
                    if backend != "partial_dtensor":
                        validate_config(dims, m)
                    m.parallelize(dims)
                tokens = torch.randint(0, cfg.vocab_size, (2, 8))
                labels = torch.randint(0, cfg.vocab_size, (2, 8))
                positions = torch.cat((torch.arange(3), torch.arange(5))).repeat(2, 1)  # two documents per row

                def loss_and_grads(m):
                    batch = tokens.clone(), labels.clone(), {"positions": positions.clone()}
                    with context():
                        if backend == "spmd_types":
                            batch = annotate_input_spmd_types(dims, *batch)
                        elif backend == "full_dtensor":
                            batch = parallelize_inputs(dims, *batch)
                        inputs, targets, kwargs = batch
                        pred = m(inputs, **kwargs)
                        loss = cross_entropy_loss(pred, targets, global_vocab_size=cfg.vocab_size) / labels.numel()
                        return loss, torch.autograd.grad(loss, [p for _, p in m.named_parameters()])

                loss_want, grads_want = loss_and_grads(model)
                loss_got, grads_got = loss_and_grads(patched)
                assert all("ropekit_table_memo" in r.__dict__ for r in ropes), where  # ropekit's forward ran
                n_heads = cfg.layers[0].attention.n_heads
                assert local_heads == [n_heads // world], (where, local_heads)  # q reached ropekit head-sharded
                loss_want, loss_got = full(loss_want).item(), full(loss_got).item()
                assert abs(loss_got - loss_want) <= FP32 * abs(loss_want), (where, loss_got, loss_want)
                for (name, _), a, b in zip(model.named_parameters(), grads_got, grads_want):
                    assert type(a) is type(b), (where, name)
                    assert rel_err(full(a), full(b)) < FP32, (where, name)
    finally:
        dist.destroy_process_group()


def test_whole_model_tensor_parallel_two_gloo_ranks(tmp_path):
    """Debug-size Llama 3 and Qwen3, patched and unpatched, under torchtitan's TP on two gloo ranks."""
    _spawn(_model_tp_worker, tmp_path, 2, 300)
