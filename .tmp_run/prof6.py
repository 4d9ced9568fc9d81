import torch, time
import wsync_core.delta as D
n = 1 << 24
t = torch.randn(n).to(torch.bfloat16); m = t.clone()
g = torch.Generator().manual_seed(0)
def step():
    i = torch.randint(0, n, (n // 100,), generator=g); t[i] += 0.5
for _ in range(3):
    step(); t0 = time.perf_counter(); D._update(m, t); print("update %.1f" % ((time.perf_counter() - t0) * 1e3))
step()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    D._update(m, t)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
