"""Packed sequences (THD) with context parallelism: each rank rotates its own tokens, no positions.

    python examples/packed_context_parallel.py

Three documents are packed along one token dim and described by `cu_seqlens` (Transformer
Engine's convention). Under context parallelism of size 2, every document is cut into 4 chunks
and rank r holds chunks r and 3 - r (the dual-chunk load balancing of TE and Megatron), so its
local `cu_seqlens` lists half of each document. `apply_rope(..., cu_seqlens=, cp_size=, cp_rank=)`
finds every local token's global position inside the kernel. The two ranks run here one after
the other in one process; in training each calls it on its own GPU. Both are checked against the
whole packed batch rotated at its global positions, forward and backward.
"""

import torch
from rope_math import check, rotate

import ropekit

H, D, CP = 4, 64, 2
DOC_LENGTHS = [8, 4, 12]  # each a multiple of 2 * CP


def global_positions(lengths) -> torch.Tensor:
    """Positions of the packed batch: 0, 1, ... restarting in every document."""
    return torch.cat([torch.arange(n) for n in lengths])


def rank_rows(lengths, rank: int) -> torch.Tensor:
    """Row indices (into the packed batch) of the tokens `rank` holds, in its local order."""
    rows, start = [], 0
    for n in lengths:
        h = n // (2 * CP)
        rows += [start + rank * h + i for i in range(h)]
        rows += [start + (2 * CP - 1 - rank) * h + i for i in range(h)]
        start += n
    return torch.tensor(rows)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cache = ropekit.cos_sin_cache(D, 64, device=device)  # (64, D) fp32 [cos | sin]
    total = sum(DOC_LENGTHS)
    q_all = torch.randn(total, H, D, device=device)
    k_all = torch.randn(total, H, D, device=device)
    pos_all = global_positions(DOC_LENGTHS).to(device)
    want_q, want_k = rotate(q_all, pos_all, cache), rotate(k_all, pos_all, cache)

    inverse = torch.cat([cache[:, : D // 2], -cache[:, D // 2 :]], dim=-1)  # sin negated: angle -theta
    local_lengths = torch.tensor([n // CP for n in DOC_LENGTHS])
    cu_seqlens = torch.cat([torch.zeros(1), local_lengths.cumsum(0)]).to(device=device, dtype=torch.int32)
    for rank in range(CP):
        rows = rank_rows(DOC_LENGTHS, rank).to(device)
        q = q_all[rows].clone().requires_grad_()
        k = k_all[rows].clone().requires_grad_()
        q_out, k_out = ropekit.apply_rope(q, k, None, cache, cu_seqlens=cu_seqlens, cp_size=CP, cp_rank=rank)
        check(f"rank {rank} q", q_out, want_q[rows], 1e-6)
        check(f"rank {rank} k", k_out, want_k[rows], 1e-6)
        positions = ropekit.positions_from_cu_seqlens(cu_seqlens, cp_size=CP, cp_rank=rank)
        assert torch.equal(positions.long(), pos_all[rows].long()), positions

        grad = torch.randn_like(q_out)
        q_out.backward(grad)  # the backward is the inverse rotation: grad rotated by -position
        check(f"rank {rank} dq", q.grad, rotate(grad, pos_all[rows], inverse), 1e-6)
        print(f"rank {rank}: {len(rows)} tokens, global positions {positions.tolist()}")
    print(f"{device}: {len(DOC_LENGTHS)} documents over {CP} ranks; ok")


if __name__ == "__main__":
    main()
