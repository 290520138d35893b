"""A serving loop over a paged KV cache: prefill, then decode, with RoPE fused into the cache store.

    python examples/serving_paged_cache.py

Two requests share a pool of cache blocks. Each step calls `ropekit.apply_rope_and_store` once for
all tokens of the step: q is rotated in place, and the rotated k and the v of every token land in
the cache rows its `slot_mapping` names (block * block_size + offset, as in vLLM). Attention then
reads each request's rows through its block table. The random q / k / v stand in for a model's
projections; every decode output is checked against attention over keys rotated from scratch.
"""

import torch
from rope_math import attend, check, rotate

import ropekit

HQ, HK, D = 8, 2, 64  # query heads, kv heads, head size
BLOCK_SIZE, NUM_BLOCKS, MAX_POSITION = 4, 32, 256


class Request:
    """A request's block table and, for the check, the unrotated keys and values it stored."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.length = 0  # tokens stored so far: the next token's position
        self.blocks = []
        self.raw_k, self.raw_v = [], []

    def slot(self, position: int, free_blocks: list) -> int:
        if position // BLOCK_SIZE == len(self.blocks):
            self.blocks.append(free_blocks.pop())
        return self.blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def slots(self) -> torch.Tensor:
        pos = torch.arange(self.length)
        return torch.tensor(self.blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def step(requests, counts, cache, k_cache, v_cache, free_blocks, device):
    """Store `counts[i]` new tokens of request i (one launch); return each request's rotated q of
    its last new token and the positions used."""
    positions, slots, owners = [], [], []
    for i, (req, n) in enumerate(zip(requests, counts)):
        for p in range(req.length, req.length + n):
            positions.append(p)
            slots.append(req.slot(p, free_blocks))
            owners.append(i)
    t = len(positions)
    q = torch.randn(t, HQ, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(t, HK, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(t, HK, D, device=device, dtype=torch.bfloat16)
    pos = torch.tensor(positions, device=device)
    raw_q = q.clone()
    ropekit.apply_rope_and_store(q, k, v, pos, cache, k_cache, v_cache, torch.tensor(slots, device=device))
    last = {}
    for row, i in enumerate(owners):
        requests[i].raw_k.append(k[row])
        requests[i].raw_v.append(v[row])
        last[i] = row
    for req, n in zip(requests, counts):
        req.length += n
    return [(q[last[i]], raw_q[last[i]], pos[last[i]]) for i in range(len(requests))]


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cache = ropekit.cos_sin_cache(D, MAX_POSITION, base=500000.0, device=device)  # (MAX_POSITION, D) fp32
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HK, D, device=device, dtype=torch.bfloat16)  # NHD paged
    v_cache = torch.zeros_like(k_cache)
    free_blocks = list(range(NUM_BLOCKS))
    requests = [Request(prompt_len=11), Request(prompt_len=6)]

    counts = [r.prompt_len for r in requests]  # prefill, then one token per request per step
    for it in range(8):
        outs = step(requests, counts, cache, k_cache, v_cache, free_blocks, device)
        for req, (q_rot, q_raw, p) in zip(requests, outs):
            slots = req.slots().to(device)
            got = attend(q_rot, k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots])
            want_k = rotate(torch.stack(req.raw_k), torch.arange(req.length, device=device), cache)
            want = attend(rotate(q_raw[None], p[None], cache)[0], want_k, torch.stack(req.raw_v))
            check("decode attention", got, want, 2e-2)  # bf16 cache: one rounding of k
        counts = [1] * len(requests)
    lengths = [r.length for r in requests]
    print(f"{device}: prefill + 7 decode steps, lengths {lengths}, {NUM_BLOCKS - len(free_blocks)} blocks used; ok")


if __name__ == "__main__":
    main()
