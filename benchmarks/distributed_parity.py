"""Training parity of a ropekit-patched tiny Llama: one device vs context parallel vs tensor parallel.

Run (two GPUs, NCCL; NVLink multicast stays off, the script sets NCCL_NVLS_ENABLE=0 itself):

    torchrun --standalone --nproc-per-node 2 benchmarks/distributed_parity.py
    torchrun --standalone --nproc-per-node 2 benchmarks/distributed_parity.py --device cpu --backend gloo --modes tp

For every seed (and repeat) it trains the same randomly initialized Hugging Face Llama (built from
LlamaConfig, no download; SDPA attention, ropekit.hf.patch) for a few SGD steps three ways:

  single  every rank trains the whole model on the whole batch (the reference);
  cp      context parallelism: torch.distributed.tensor.experimental.context_parallel shards
          input ids, labels and positions along the sequence with its head-tail load balancer
          (rank r holds chunks r and 2W-1-r, the mapping of ropekit.positions_from_cu_seqlens);
          SDPA is replaced by ring attention; parameter gradients are summed over ranks;
  tp      tensor parallelism: parallelize_module with ColwiseParallel q/k/v/gate/up and
          RowwiseParallel o/down projections (DTensor parameters, heads split over ranks);
          --tp-dtensor-activations keeps q/k/v DTensors (use_local_output=False), so ropekit's
          rotation receives DTensors (needs ropekit's DTensor routing).

and compares every step's loss and every parameter's gradient of cp and tp with single. Prints a
table on rank 0 and writes DIR/distributed_parity.json with --out DIR. Exit status 1 if a
comparison is over its tolerance.

Positions under CP: HF builds a block-diagonal mask when position_ids jump (packed-sequence
detection), which the ring attention cannot take, so the model is called without position_ids
and a forward pre-hook on its rotary embedding substitutes the sharded global positions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off (before torch loads NCCL)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=None, help="folder for distributed_parity.json (rank 0)")
    p.add_argument("--backend", default=None, help="nccl (cuda) or gloo (cpu) by default")
    p.add_argument("--modes", default="cp,tp", help="comma list of cp, tp")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--repeats", type=int, default=2, help="runs per seed (checks run-to-run determinism too)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512, help="global sequence length (multiple of 2 * world size)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--loss-tol", type=float, default=1e-4, help="max relative loss difference")
    p.add_argument("--grad-tol", type=float, default=2e-3, help="max ||g - g_ref|| / ||g_ref|| per parameter")
    p.add_argument("--tp-dtensor-activations", action="store_true")
    p.add_argument("--no-ropekit", action="store_true", help="HF's own rotary code (a control run)")
    return p.parse_args()


def build_model(args, seed, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4 * args.seq,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.float32)
    return model


def batch_for(args, seed, step, device):
    g = torch.Generator().manual_seed(10_000 * seed + step)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=g)
    labels = torch.cat((ids[:, 1:], torch.full((args.batch, 1), -100)), dim=1)  # next token, last ignored
    positions = torch.arange(args.seq).expand(args.batch, -1).contiguous()
    return ids.to(device), labels.to(device), positions.to(device)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grads_of(model):
    return {n: _full(p.grad).detach().double().cpu().clone() for n, p in model.named_parameters()}


def _sdpa_backend(device):
    """On CUDA, one SDPA kernel for the reference and the ring attention: memory-efficient attention
    (float32 capable; context_parallel handles it). The CPU has no CP-capable SDPA kernel."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])


def token_loss(model, ids, labels):
    """Summed cross entropy over the tokens given, and their count (ignore_index -100)."""
    with _sdpa_backend(ids.device):
        logits = model(input_ids=ids, use_cache=False).logits
    logits = _full(logits)
    total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()


def run_single(args, seed, device):
    model = build_model(args, seed, device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, foreach=False)  # TP mixes DTensor and plain params
    losses, grads = [], []
    for step in range(args.steps):
        ids, labels, _ = batch_for(args, seed, step, device)
        total, count = token_loss(model, ids, labels)
        loss = total / count
        opt.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        grads.append(grads_of(model))
        opt.step()
    return losses, grads


class _GlobalPositions:
    """Forward pre-hook on the rotary embedding: replace position_ids by the CP shard's positions."""

    def __init__(self):
        self.positions = None

    def __call__(self, module, args, kwargs):
        if self.positions is None:
            return None
        if "position_ids" in kwargs:
            kwargs = dict(kwargs, position_ids=self.positions)
            return args, kwargs
        return (args[0], self.positions) + tuple(args[2:]), kwargs


def run_cp(args, seed, device, mesh):
    from torch.distributed.tensor.experimental import context_parallel

    import ropekit

    model = build_model(args, seed, device)
    hook = _GlobalPositions()
    model.model.rotary_emb.register_forward_pre_hook(hook, with_kwargs=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, foreach=False)  # TP mixes DTensor and plain params
    losses, grads = [], []
    for step in range(args.steps):
        ids, labels, positions = batch_for(args, seed, step, device)
        opt.zero_grad(set_to_none=True)
        # sharded in place on entry (load-balanced along dim 1), not restored: rebuilt every step
        with context_parallel(
            mesh,
            buffers=[ids, labels, positions],
            buffer_seq_dims=[1, 1, 1],
            no_restore_buffers={ids, labels, positions},
        ):
            # torch's load balancer and ropekit's THD/CP mapping must agree (ropekit's cu_seqlens path)
            local = args.seq // mesh.size()
            expect = ropekit.positions_from_cu_seqlens(
                torch.tensor([0, local]), cp_size=mesh.size(), cp_rank=mesh.get_local_rank()
            ).to(device)
            if not torch.equal(positions[0], expect):
                raise AssertionError(f"CP positions {positions[0].tolist()} != ropekit's {expect.tolist()}")
            hook.positions = positions
            total, count = token_loss(model, ids, labels)
            hook.positions = None
            count = count.clone()
            dist.all_reduce(count, group=mesh.get_group())
            (total / count).backward()
        total = total.detach().clone()
        dist.all_reduce(total, group=mesh.get_group())
        for p in model.parameters():  # every rank saw a part of the tokens: sum the parts
            dist.all_reduce(p.grad, group=mesh.get_group())
        losses.append((total / count).item())
        grads.append(grads_of(model))
        opt.step()
    return losses, grads


def run_tp(args, seed, device, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build_model(args, seed, device)
    local = not args.tp_dtensor_activations
    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "self_attn.q_proj": ColwiseParallel(use_local_output=local),
                "self_attn.k_proj": ColwiseParallel(use_local_output=local),
                "self_attn.v_proj": ColwiseParallel(use_local_output=local),
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
        )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, foreach=False)  # TP mixes DTensor and plain params
    losses, grads = [], []
    for step in range(args.steps):
        ids, labels, _ = batch_for(args, seed, step, device)
        total, count = token_loss(model, ids, labels)
        loss = total / count
        opt.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        grads.append(grads_of(model))
        opt.step()
    return losses, grads


def compare(ref, got):
    """(max relative loss difference, max over steps and parameters of the relative grad error,
    the parameter where that max is)."""
    ref_losses, ref_grads = ref
    losses, grads = got
    loss_err = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref_losses, losses))
    worst, where = 0.0, ""
    for step, (gr, gg) in enumerate(zip(ref_grads, grads)):
        for name, r in gr.items():
            err = ((gg[name] - r).norm() / r.norm().clamp_min(1e-30)).item()
            if err > worst:
                worst, where = err, f"step {step} {name}"
    return loss_err, worst, where


def main():
    args = parse()
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(args.device, (world,))
    if args.seq % (2 * world):
        raise SystemExit(f"--seq {args.seq} must be a multiple of 2 * world size ({2 * world})")

    import ropekit
    import ropekit.hf

    if not args.no_ropekit:
        ropekit.hf.patch(families=["llama"])

    modes = [m for m in args.modes.split(",") if m]
    rows, ok = [], True
    for seed in (int(s) for s in args.seeds.split(",")):
        for repeat in range(args.repeats):
            t0 = time.perf_counter()
            ref = run_single(args, seed, device)
            for mode in modes:
                try:
                    got = run_cp(args, seed, device, mesh) if mode == "cp" else run_tp(args, seed, device, mesh)
                    loss_err, grad_err, where = compare(ref, got)
                    passed = loss_err <= args.loss_tol and grad_err <= args.grad_tol
                    row = dict(
                        seed=seed,
                        repeat=repeat,
                        mode=mode,
                        steps=args.steps,
                        loss_ref=ref[0],
                        loss=got[0],
                        loss_rel_err=loss_err,
                        grad_rel_err=grad_err,
                        worst=where,
                        passed=passed,
                    )
                except Exception as e:  # a mode that cannot run here is reported, not hidden
                    row = dict(
                        seed=seed, repeat=repeat, mode=mode, error=f"{type(e).__name__}: {e}"[:500], passed=False
                    )
                ok = ok and row["passed"]
                rows.append(row)
            if rank == 0:
                print(f"seed {seed} repeat {repeat}: {time.perf_counter() - t0:.1f} s", flush=True)

    if rank == 0:
        print(
            f"\nropekit distributed parity: world {world}, {args.device}/{backend}, torch {torch.__version__}, "
            f"ropekit {'patched' if not args.no_ropekit else 'NOT patched (control)'}, B={args.batch} "
            f"S={args.seq} hidden={args.hidden} layers={args.layers} heads={args.heads}/{args.kv_heads} "
            f"steps={args.steps}"
        )
        print(
            f"{'seed':>4} {'rep':>3} {'mode':>4} {'loss[0] ref':>12} {'loss[0]':>12} {'loss rel':>9} "
            f"{'grad rel':>9}  result"
        )
        for r in rows:
            if "error" in r:
                print(f"{r['seed']:>4} {r['repeat']:>3} {r['mode']:>4}  ERROR {r['error']}")
                continue
            print(
                f"{r['seed']:>4} {r['repeat']:>3} {r['mode']:>4} {r['loss_ref'][0]:>12.6f} {r['loss'][0]:>12.6f} "
                f"{r['loss_rel_err']:>9.2e} {r['grad_rel_err']:>9.2e}  {'PASS' if r['passed'] else 'FAIL'}"
                f"  (worst: {r['worst']})"
            )
        print("ALL PASS" if ok else "SOME FAILED")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "distributed_parity.json"), "w") as f:
                json.dump(
                    dict(
                        world=world,
                        device=args.device,
                        backend=backend,
                        torch=torch.__version__,
                        args=vars(args),
                        rows=rows,
                        all_passed=ok,
                    ),
                    f,
                    indent=1,
                )
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
