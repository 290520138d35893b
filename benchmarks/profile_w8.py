"""Where W8's time goes: torch.profiler over forward + backward of apply_rope (HF layout).

    PYTHONPATH=src python3 benchmarks/profile_w8.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

import ropekit

B, S, HQ, HK, D = 4, 4096, 32, 8, 128
bf = dict(dtype=torch.bfloat16, device="cuda")
q = torch.randn(B, HQ, S, D, **bf).transpose(1, 2).requires_grad_()
k = torch.randn(B, HK, S, D, **bf).transpose(1, 2).requires_grad_()
gq, gk = torch.randn(B, S, HQ, D, **bf), torch.randn(B, S, HK, D, **bf)
cache = ropekit.cos_sin_cache(D, S, device="cuda")


def step():
    qo, ko = ropekit.apply_rope(q, k, None, cache)
    return torch.autograd.grad((qo, ko), (q, k), (gq, gk))


for _ in range(5):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20):
    step()
end.record()
torch.cuda.synchronize()
print(f"W8 fwd+bwd: {start.elapsed_time(end) / 20 * 1e3:.1f} us per step (events, back to back)")
