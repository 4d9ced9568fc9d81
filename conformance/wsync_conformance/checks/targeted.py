"""targeted: send(worker_ids=...) changes those workers and no other."""

from __future__ import annotations


from wsync_core import WorkerTimeoutError

from ..context import Context
from ..guarantees import capability, guarantee, violated
from ..models import digests, fill_version, version_spec

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
