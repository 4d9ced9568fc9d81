import sys; sys.path.insert(0, "tests")
import torch
from test_delta import model_of, scramble
from core_helpers import same
from wsync_core.delta import Mirror, decode_table, check_indices, apply_ops
from wsync_core.layout import Layout
w = model_of(1); layout = Layout.of(w)
m = Mirror(layout, None, 2, torch.device("cpu")); m.reset(w, 0)
held = {k: v.clone() for k, v in w.items()}
scramble(w, 0, 0.01); m.update(w, 1, None)
buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
enc = m.encode(m.since(0), buf)
ops = decode_table(enc.table, layout, m.wire, enc.nbytes, "t")
apply_ops(ops, check_indices(ops, buf[:enc.nbytes], "t"), buf[:enc.nbytes], held)
for k in w:
    if not same({k: w[k]}, {k: held[k]}): print("differs", k, w[k].dtype)
mw = {e.key: Layout.view(m.buffer, e) for e in m.wire.entries}
for k in w:
    if not same({k: w[k]}, {k: mw[k]}): print("mirror differs", k)
for op in ops:
    if op.entry.key == "t6": print(op)
print(m.changes[1].get([e.key for e in layout.entries].index("t6")))
d = (w["t6"] != held["t6"]).nonzero().view(-1); print(d, w["t6"][d], held["t6"][d])
