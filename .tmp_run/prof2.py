import torch, time, numpy as np
torch.set_num_threads(2)
n = 1 << 24
a = torch.randn(n).to(torch.bfloat16); m = a.clone()
idx = torch.randint(0, n, (n // 100,)); a[idx] += 0.5
for rep in range(2):
    sw, mw = a.view(torch.int64), m.view(torch.int64)
    t=time.perf_counter(); ne = sw != mw; w = ne.nonzero().view(-1); print("i64 ne+nonzero", time.perf_counter()-t, w.numel())
    t=time.perf_counter(); ne = torch.ne(sw, mw); print("i64 ne only", time.perf_counter()-t)
    an, mn = sw.numpy(), mw.numpy()
    t=time.perf_counter(); w2 = np.flatnonzero(an != mn); print("np i64", time.perf_counter()-t, len(w2))
    t=time.perf_counter(); blk = (sw.view(-1, 512) != mw.view(-1, 512)).any(1); print("blk any", time.perf_counter()-t, int(blk.sum()))
    t=time.perf_counter(); x = torch.bitwise_xor(sw, mw); print("xor", time.perf_counter()-t)
    t=time.perf_counter(); e = torch.equal(sw, mw); print("equal", time.perf_counter()-t)
    t=time.perf_counter(); m.copy_(a); print("memcpy", time.perf_counter()-t); m.copy_(m)
    m = a.clone(); a[idx] += 0.5
