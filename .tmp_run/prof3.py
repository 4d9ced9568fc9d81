import torch, time, numpy as np
from concurrent.futures import ThreadPoolExecutor
torch.set_num_threads(2)
n = 1 << 25  # 64 MiB bf16
a = torch.randn(n).to(torch.bfloat16); m = a.clone()
idx = torch.randint(0, n, (n // 100,)); a[idx] += 0.5
an, mn = a.view(torch.int64).numpy(), m.view(torch.int64).numpy()
pool = ThreadPoolExecutor(2)
def part(lo, hi, C):
    out = []
    for s in range(lo, hi, C):
        e = min(hi, s + C)
        nz = np.flatnonzero(an[s:e] != mn[s:e])
        if nz.size: out.append(nz + s)
    return out
for C in (1 << 14, 1 << 16, 1 << 18):
    for rep in range(3):
        t = time.perf_counter(); r = part(0, len(an), C); dt1 = time.perf_counter() - t
        t = time.perf_counter(); h = len(an)//2; fs = [pool.submit(part, 0, h, C), pool.submit(part, h, len(an), C)]; r2 = [f.result() for f in fs]; dt2 = time.perf_counter() - t
        t = time.perf_counter(); m.copy_(a); dtm = time.perf_counter() - t
        t = time.perf_counter(); np.copyto(mn, an); dtn = time.perf_counter() - t
        mn[:] = a.view(torch.int64).numpy(); a[idx] += 0.5
        print(C, f"1thr {dt1*1e3:.1f} 2thr {dt2*1e3:.1f} torch memcpy {dtm*1e3:.1f} np copy {dtn*1e3:.1f}")
