import torch, time
from wsync_core.delta import _update, _bits
torch.set_num_threads(2)
n = 1 << 24  # 32 MiB bf16
a = torch.randn(n).to(torch.bfloat16); m = a.clone()
idx = torch.randint(0, n, (n // 100,)); a[idx] += 0.5
t=time.perf_counter(); r = _update(m, a); print("update", time.perf_counter()-t, r.numel())
a[idx] += 0.5
sb, mb = _bits(a), _bits(m)
t=time.perf_counter(); ne = sb != mb; print("ne", time.perf_counter()-t)
t=time.perf_counter(); nz = ne.nonzero(); print("nonzero", time.perf_counter()-t)
t=time.perf_counter(); nz2 = torch.nonzero(ne.view(torch.uint8)); print("nonzero u8", time.perf_counter()-t)
t=time.perf_counter(); c = ne.sum(); print("sum", time.perf_counter()-t)
i = nz.view(-1)
t=time.perf_counter(); mb.index_copy_(0, i, sb.index_select(0, i)); print("index_copy", time.perf_counter()-t)
t=time.perf_counter(); mb[i] = sb[i]; print("index_put", time.perf_counter()-t)
t=time.perf_counter(); m.copy_(a); print("memcpy", time.perf_counter()-t)
t=time.perf_counter(); torch.equal(sb, mb); print("equal", time.perf_counter()-t)
