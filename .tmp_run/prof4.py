import torch, time
from wsync_core.delta import _update, _changed, _words
n = 1 << 27  # 256 MiB bf16
a = torch.randn(n).to(torch.bfloat16); m = a.clone(); dst = torch.empty_like(a)
idx = torch.randint(0, n, (n // 100,))
def T(f, *x):
    t = time.perf_counter(); r = f(*x); return (time.perf_counter() - t) * 1e3, r
for rep in range(3):
    a[idx] += 0.5
    print("memcpy %.1f" % T(dst.copy_, a)[0])
    sw, mw = _words(a), _words(m)
    dt, ne = T(torch.ne, sw, mw); print("ne %.1f" % dt)
    dt, nz = T(torch.nonzero, ne); print("nonzero %.1f" % dt, nz.numel())
    dt, cnt = T(torch.count_nonzero, ne); print("count %.1f" % dt)
    dt, _ = T(_update, m, a); print("update total %.1f" % dt)
