import sys, torch, threading
sys.path.insert(0, "conformance/tests")
import wsync_broken
from wsync_core import WeightSyncScheme
src = {"a": torch.randn(1000)}
s = WeightSyncScheme(wsync_broken.CorruptDelta(), delta=True)
r = WeightSyncScheme.__new__(WeightSyncScheme); r.__setstate__(s.__getstate__())
r.init_on_receiver(model={"a": torch.zeros(1000)}, worker_idx=0)
s.init_on_sender(weights=src, num_workers=1)
t = threading.Thread(target=r.connect); t.start(); s.connect(); t.join()
src["a"][5] = 3.0
h = s.send_async()
print(r.receive(5.0), s.last_report.delta_workers, torch.equal(r._role.source["a"], src["a"]))
