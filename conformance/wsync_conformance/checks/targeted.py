"""targeted: send(worker_ids=...) changes those workers and no other."""

from __future__ import annotations


from wsync_core import WeightSyncScheme, WorkerTimeoutError

from ..context import Context
from ..guarantees import capability, guarantee, violated
from ..models import build, digests, fill_version, version_spec
from .base import contest_index

__all__ = ["TargetedChecks"]


class TargetedChecks:
    """The targeted tests (a mixin of ``TransportSuite``)."""

    @guarantee("targeted")
    @capability("subset_send")
    def test_targeted_subset_send(self, wsync: Context) -> None:
        """``send(worker_ids=[...])`` changes exactly those workers, even while all receive. The
        model (3.5 MiB) is large enough for zero-copy receivers to keep viewing the buffer of the
        version they hold while the others get newer ones: a buffer reused under them shows."""
        wsync.require("subset_send")
        s = wsync.session(version_spec(side=256), n=3)
        current = {0: 0, 1: 0, 2: 0}
        for step, targets in enumerate(([1], [0, 2], [2], [0, 1, 2])):
            fill_version(s.model, step + 1)
            s.expected[step + 1] = digests(s.model)
            error = None
            with s.following() as reports:
                try:
                    v = s.scheme.send(worker_ids=targets)
                except WorkerTimeoutError as exc:
                    error, v = exc, step + 1
            for i, r in reports.items():
                if i not in targets and r.get("applied"):
                    raise violated("targeted", f"send(worker_ids={targets}) changed worker {i} "
                                               f"(it applied {r['applied']})")
            if error is not None:
                raise violated("targeted", f"send(worker_ids={targets}) did not reach {error.workers}: {error}")
            for t in targets:
                current[t] = v
            for i in range(3):
                s.check(current[i], [i], guarantee="targeted")

    @guarantee("targeted")
    def test_targeted_worker_of_another_trainer_does_not_take_an_index(self, wsync: Context) -> None:
        """A receiver pickled from another trainer's scheme of the same model and options (another
        job given this address) claims the index of a connected worker: the holder keeps the index
        and gets every version, sends go on, and the stray is told (its connect() or receive()
        raises) and applies nothing. A transport whose hello does not carry the scheme's origin
        (``ReceiverContext.origin``), or whose sender does not refuse another (``origin_refusal``),
        lets another job's worker push this job's out."""
        s = wsync.session(version_spec(), n=1)
        other = WeightSyncScheme(s.scheme.transport, timeout=wsync.timeout)  # the same address, another trainer
        wsync.on_close(other.shutdown)
        other.init_on_sender(model=build(s.spec, wsync.sender_device, sender=True), num_workers=1)
        stray = wsync.workers(1)[0]
        stray.open(other, s.spec, wsync.device, 0)
        contest_index(wsync, s, stray, "a worker of another trainer's scheme", "targeted")
