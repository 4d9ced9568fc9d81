import torch, time
import wsync_core.delta as D
n = 1 << 24  # one 32 MiB bf16 tensor, x8 = the bench model
ts = [torch.randn(n).to(torch.bfloat16) for _ in range(8)]
ms = [t.clone() for t in ts]
g = torch.Generator().manual_seed(0)
def step():
    for t in ts:
        i = torch.randint(0, n, (n // 100,), generator=g); t[i] += 0.5
def run(chunk):
    D._CHUNK = chunk
    t0 = time.perf_counter()
    for t, m in zip(ts, ms):
        D._update(m, t)
    return (time.perf_counter() - t0) * 1e3
for chunk in (1 << 20, 1 << 22, 1 << 24):
    r = []
    for _ in range(4):
        step(); r.append(run(chunk))
    print(chunk, ["%.1f" % x for x in r])
# components on one tensor
step()
t, m = ts[0], ms[0]
sw, mw = t.view(torch.int64), m.view(torch.int64)
for name, f in [("ne", lambda: torch.ne(sw, mw)), ("memcpy", lambda: m.copy_(t))]:
    t0 = time.perf_counter(); r = f(); print(name, "%.1f" % ((time.perf_counter() - t0) * 1e3))
ne = torch.ne(sw, mw)
for name, f in [("nonzero", lambda: ne.nonzero()), ("argwhere", lambda: torch.argwhere(ne)), ("nz u8", lambda: ne.view(torch.uint8).nonzero()),
                ("masked_select", lambda: torch.masked_select(torch.arange(ne.numel()), ne))]:
    t0 = time.perf_counter(); r = f(); print(name, "%.1f" % ((time.perf_counter() - t0) * 1e3))
w = ne.nonzero().view(-1)
for name, f in [("isel", lambda: mw.index_select(0, w)), ("icopy", lambda: mw.index_copy_(0, w, sw.index_select(0, w))), ("iput", lambda: mw.__setitem__(w, sw[w]))]:
    t0 = time.perf_counter(); r = f(); print(name, "%.1f" % ((time.perf_counter() - t0) * 1e3))
