"""One rank of tests/integrations/test_distributed.py: DTensor calls of ropekit's custom ops over gloo (CPU).

Usage: python dtensor_worker.py RANK WORLD PORT OUT. Every rank builds the same global inputs (fixed
seed), runs each case on DTensors and checks placements; rank 0 saves the gathered results (and
the error messages of the refused layouts) to OUT for the parent to compare with float64.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # the Triton kernels, interpreted on CPU tensors

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor  # noqa: E402

import ropekit  # noqa: E402  (its first DTensor call registers the sharding rules)
from ropekit.core.variant import Variant  # noqa: E402
from ropekit.distributed import replicate  # noqa: E402


def inputs(shape_q, shape_k, max_pos=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g)
    k = torch.randn(*shape_k, generator=g)
    pos = torch.randint(0, max_pos, shape_q[:-2], generator=g)
    cache = torch.randn(max_pos, shape_q[-1], generator=g)
    return q, k, pos, cache


def main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", list(range(world)))
    results, errors = {}, {}
    R = Replicate()
    # (name, q shape, k shape, q/k placement, positions placement)
    cases = [
        ("thd_tokens", (8, 4, 32), (8, 2, 32), Shard(0), Shard(0)),
        ("bshd_tokens", (2, 6, 4, 32), (2, 6, 2, 32), Shard(1), Shard(1)),
        ("bshd_batch", (2, 6, 4, 32), (2, 6, 2, 32), Shard(0), Shard(0)),
        ("thd_heads", (8, 4, 32), (8, 2, 32), Shard(1), R),
        ("replicate", (8, 4, 32), (8, 2, 32), R, R),
        ("positions_replicated_sliced", (8, 4, 32), (8, 2, 32), Shard(0), R),
    ]
    for name, sq, sk, pl, pp in cases:
        q, k, pos, cache = inputs(sq, sk, seed=len(name))
        dq, dk = distribute_tensor(q, mesh, [pl]), distribute_tensor(k, mesh, [pl])
        dp = distribute_tensor(pos, mesh, [pp])
        qo, ko = ropekit.apply_rope(dq, dk, dp, cache)  # the public op, a plain table
        assert tuple(qo.placements) == (pl,) and tuple(ko.placements) == (pl,), (name, qo.placements)
        assert qo.to_local().shape == dq.to_local().shape
        # backward: one weighted loss (sharded gradients) and one plain sum (replicated gradients)
        wq = torch.randn(sq, generator=torch.Generator().manual_seed(5))
        wk = torch.randn(sk, generator=torch.Generator().manual_seed(6))
        gq = dq.detach().requires_grad_()
        gk = dk.detach().requires_grad_()
        a, b = ropekit.apply_rope(gq, gk, dp, replicate(cache, mesh))
        loss = (
            (a * distribute_tensor(wq, mesh, [pl])).sum()
            + (b * distribute_tensor(wk, mesh, [pl])).sum()
            + a.sum()
            + b.sum()
        )
        loss.backward()
        results[name] = dict(
            q=q,
            k=k,
            pos=pos,
            cache=cache,
            wq=wq,
            wk=wk,
            qo=qo.full_tensor(),
            ko=ko.full_tensor(),
            gq=gq.grad.full_tensor(),
            gk=gk.grad.full_tensor(),
            loss=loss.full_tensor(),
        )
    # M-RoPE, token-sharded: positions (3, T) sharded on their dim 1
    q, k, _, cache = inputs((8, 4, 32), (8, 2, 32), seed=42)
    pos3 = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(43))
    qo, ko = torch.ops.ropekit.rotate(
        distribute_tensor(q, mesh, [Shard(0)]),
        distribute_tensor(k, mesh, [Shard(0)]),
        distribute_tensor(pos3, mesh, [Shard(1)]),
        replicate(cache, mesh),
        None,
        None,
        None,
        None,
        Variant(mrope=1, sections=(4, 6, 6)).encode(),
        32,
        [1, 0],
        [0.0, 0.0],
        None,
    )
    results["mrope_tokens"] = dict(q=q, k=k, pos=pos3, cache=cache, qo=qo.full_tensor(), ko=ko.full_tensor())
    # per-token angles (the Hugging Face form), token-sharded, plain cos / sin
    q, k, pos, cache = inputs((8, 4, 32), (8, 2, 32), seed=77)
    qo, ko = ropekit.rotate_with_angles(
        distribute_tensor(q, mesh, [Shard(0)]), distribute_tensor(k, mesh, [Shard(0)]), cache[pos, :16], cache[pos, 16:]
    )
    assert tuple(qo.placements) == (Shard(0),)
    results["angles_tokens"] = dict(q=q, k=k, pos=pos, cache=cache, qo=qo.full_tensor(), ko=ko.full_tensor())
    # in place, head-sharded
    q, k, pos, cache = inputs((8, 4, 32), (8, 2, 32), seed=99)
    dq, dk = distribute_tensor(q, mesh, [Shard(1)]), distribute_tensor(k, mesh, [Shard(1)])
    ropekit.apply_rope(dq, dk, distribute_tensor(pos, mesh, [R]), cache, inplace=True)
    results["inplace_heads"] = dict(q=q, k=k, pos=pos, cache=cache, qo=dq.full_tensor(), ko=dk.full_tensor())
    # a per-head table (2 KV heads; q's 4 heads in groups of 2), head-sharded (the table sliced on its
    # heads: each rank's table head is its k head's) and token-sharded (the table replicated), with
    # backward
    for name, pl, pp in (("head_table_heads", Shard(1), R), ("head_table_tokens", Shard(0), Shard(0))):
        q, k, pos, _ = inputs((8, 4, 32), (8, 2, 32), seed=len(name))
        table = torch.randn(64, 2, 32, generator=torch.Generator().manual_seed(11))
        dq = distribute_tensor(q, mesh, [pl]).requires_grad_()
        dk = distribute_tensor(k, mesh, [pl]).requires_grad_()
        qo, ko = ropekit.apply_rope(dq, dk, distribute_tensor(pos, mesh, [pp]), replicate(table, mesh))
        assert tuple(qo.placements) == (pl,), (name, qo.placements)
        (qo.sum() + (ko * ko.detach()).sum()).backward()
        results[name] = dict(
            q=q,
            k=k,
            pos=pos,
            cache=table,
            qo=qo.full_tensor(),
            ko=ko.full_tensor(),
            gq=dq.grad.full_tensor(),
            gk=dk.grad.full_tensor(),
        )
    # fused store, head-sharded: q, k, v on heads, paged caches on their head dim, the rest replicated
    v = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(7))
    k_cache = torch.randn(3, 4, 2, 32, generator=torch.Generator().manual_seed(8))
    v_cache = torch.randn(3, 4, 2, 32, generator=torch.Generator().manual_seed(9))
    slots = torch.randperm(12, generator=torch.Generator().manual_seed(10))[:8]
    H = Shard(1)
    dq, dk, dv = (distribute_tensor(x, mesh, [H]) for x in (q, k, v))
    dkc, dvc = distribute_tensor(k_cache, mesh, [Shard(2)]), distribute_tensor(v_cache, mesh, [Shard(2)])
    ropekit.apply_rope_and_store(
        dq, dk, dv, distribute_tensor(pos, mesh, [R]), cache, dkc, dvc, distribute_tensor(slots, mesh, [R])
    )
    results["store_heads"] = dict(
        q=q,
        k=k,
        v=v,
        pos=pos,
        cache=cache,
        k_cache=k_cache,
        v_cache=v_cache,
        slots=slots,
        qo=dq.full_tensor(),
        k_cache_out=dkc.full_tensor(),
        v_cache_out=dvc.full_tensor(),
    )
    try:
        dq, dk, dv = (distribute_tensor(x, mesh, [Shard(0)]) for x in (q, k, v))
        torch.ops.ropekit.rope_and_store(
            dq,
            dk,
            dv,
            distribute_tensor(pos, mesh, [Shard(0)]),
            replicate(cache, mesh),
            distribute_tensor(k_cache, mesh, [R]),
            distribute_tensor(v_cache, mesh, [R]),
            distribute_tensor(slots, mesh, [Shard(0)]),
            Variant().encode(),
            cache.shape[1],
            None,
            None,
            None,
            None,
            [1e-6, 0.0],
            [1, 0],
        )
        errors["store_token_sharded"] = None
    except RuntimeError as e:
        errors["store_token_sharded"] = str(e)
    # the store with the norm (per-head weights, replicated) and packed angles, head-sharded
    g = torch.Generator().manual_seed(11)
    wq, wk = torch.rand(32, generator=g) + 0.5, torch.rand(32, generator=g) + 0.5
    cu = torch.tensor([0, 3, 8])
    kc2, vc2 = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    dq, dk, dv = (distribute_tensor(x, mesh, [H]) for x in (q, k, v))
    dkc, dvc = distribute_tensor(kc2, mesh, [Shard(2)]), distribute_tensor(vc2, mesh, [Shard(2)])
    ropekit.apply_rope_and_store(
        dq, dk, dv, None, cache, dkc, dvc, distribute_tensor(slots, mesh, [R]), cu_seqlens=cu,
        q_norm_weight=wq, k_norm_weight=wk, norm_weight_offset=1.0,
    )  # fmt: skip
    results["store_norm_packed_heads"] = dict(
        q=q,
        k=k,
        v=v,
        cu=cu,
        cache=cache,
        wq=wq,
        wk=wk,
        slots=slots,
        qo=dq.full_tensor(),
        k_cache_out=dkc.full_tensor(),
        v_cache_out=dvc.full_tensor(),
    )
    # a norm across heads needs every head of a token: refused under head sharding, nothing written
    try:
        dq, dk, dv = (distribute_tensor(x, mesh, [H]) for x in (q, k, v))
        dkc = distribute_tensor(torch.zeros_like(k_cache), mesh, [Shard(2)])
        dvc = distribute_tensor(torch.zeros_like(v_cache), mesh, [Shard(2)])
        ropekit.apply_rope_and_store(
            dq, dk, dv, distribute_tensor(pos, mesh, [R]), cache, dkc, dvc, distribute_tensor(slots, mesh, [R]),
            k_norm_weight=torch.ones(2 * 32),
        )  # fmt: skip
        errors["store_norm_across_heads_sharded"] = None
    except RuntimeError as e:
        assert torch.equal(dq.full_tensor(), q) and not dkc.full_tensor().any(), "written before the refusal"
        errors["store_norm_across_heads_sharded"] = str(e)
    # packed sequences (cu_seqlens), head-sharded, forward and backward; token sharding refused
    q, k, _, cache = inputs((8, 4, 32), (8, 2, 32), seed=123)
    cu = torch.tensor([0, 3, 8])
    gq = distribute_tensor(q, mesh, [Shard(1)]).requires_grad_()
    gk = distribute_tensor(k, mesh, [Shard(1)]).requires_grad_()
    qo, ko = ropekit.apply_rope(gq, gk, None, cache, cu_seqlens=cu)
    assert tuple(qo.placements) == (Shard(1),), qo.placements
    (qo.sum() + 2 * ko.sum()).backward()
    results["packed_heads"] = dict(
        q=q,
        k=k,
        cu=cu,
        cache=cache,
        qo=qo.full_tensor(),
        ko=ko.full_tensor(),
        gq=gq.grad.full_tensor(),
        gk=gk.grad.full_tensor(),
    )
    try:
        dq, dk = distribute_tensor(q, mesh, [Shard(0)]), distribute_tensor(k, mesh, [Shard(0)])
        ropekit.apply_rope(dq, dk, None, cache, cu_seqlens=cu)
        errors["packed_token_sharded"] = None
    except RuntimeError as e:
        errors["packed_token_sharded"] = str(e)
    # the QK-norm on DTensors, with gradients: per head under head sharding, across heads under
    # token sharding (plain weights become replicated DTensors); angles from inv_freq token-sharded
    q, k, pos, cache = inputs((8, 4, 32), (8, 2, 32), seed=91)
    g = torch.Generator().manual_seed(92)
    w_head, w_all = torch.rand(32, generator=g) + 0.5, torch.rand(2 * 32, generator=g) + 0.5
    for name, pl, wk in (("norm_heads", Shard(1), w_head), ("norm_tokens_across", Shard(0), w_all)):
        gq = distribute_tensor(q, mesh, [pl]).requires_grad_()
        gk = distribute_tensor(k, mesh, [pl]).requires_grad_()
        dp = distribute_tensor(pos, mesh, [pl if pl == Shard(0) else R])
        wq_leaf = distribute_tensor(w_head, mesh, [R]).requires_grad_()
        qo, ko = ropekit.apply_rope(gq, gk, dp, cache, q_norm_weight=wq_leaf, k_norm_weight=wk)
        assert tuple(qo.placements) == (pl,), (name, qo.placements)
        (qo.sum() + 2 * ko.sum()).backward()
        results[name] = dict(
            q=q,
            k=k,
            pos=pos,
            cache=cache,
            wq=w_head,
            wk=wk,
            qo=qo.full_tensor(),
            ko=ko.full_tensor(),
            gq=gq.grad.full_tensor(),
            gk=gk.grad.full_tensor(),
            gwq=wq_leaf.grad.full_tensor(),
        )
    try:
        ropekit.apply_rope(
            distribute_tensor(q, mesh, [Shard(1)]),
            None,
            distribute_tensor(pos, mesh, [R]),
            cache,
            q_norm_weight=torch.ones(128),
        )
        errors["norm_across_heads_sharded"] = None
    except RuntimeError as e:
        errors["norm_across_heads_sharded"] = str(e)
    f = ropekit.axial_inv_freq((8, 8, 16))
    pos3 = torch.randn(3, 8, generator=g) * 5
    qo, ko = ropekit.apply_rope(
        distribute_tensor(q, mesh, [Shard(0)]),
        distribute_tensor(k, mesh, [Shard(0)]),
        distribute_tensor(pos3, mesh, [Shard(1)]),
        None,
        inv_freq=f,
        axes=(4, 4, 8),
        interleaved=True,
    )
    assert tuple(qo.placements) == (Shard(0),), qo.placements
    results["freqs_tokens"] = dict(q=q, k=k, pos=pos3, inv_freq=f, qo=qo.full_tensor(), ko=ko.full_tensor())
    # refused layouts: each must raise, naming the argument
    refused = {
        "positions_sharded_under_head_sharding": (Shard(1), Shard(1), Shard(0)),
        "k_on_other_dim": (Shard(0), Shard(1), Shard(0)),
        "shard_of_head_size": (Shard(2), Shard(2), R),
    }
    for name, (plq, plk, pp) in refused.items():
        dq, dk = distribute_tensor(q, mesh, [plq]), distribute_tensor(k, mesh, [plk])
        try:
            ropekit.apply_rope(dq, dk, distribute_tensor(pos, mesh, [pp]), cache)
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    if rank == 0:
        torch.save(dict(results=results, errors=errors), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
