"""portable: a pickled scheme holds configuration only."""

from __future__ import annotations

import pickle
from typing import Any, ClassVar

from wsync_core import WeightSyncScheme

from ..context import Context
from ..guarantees import guarantee, violated
from ..models import random_values, rich_spec
from ..portable import MAX_PICKLE_BYTES, inspect_pickle

__all__ = ["PortableChecks"]


class PortableChecks:
    """The portable tests (a mixin of ``TransportSuite``)."""

    large_mib: ClassVar[int]  # (SuiteBase's, in TransportSuite)

    @guarantee("portable")
    def test_portable_pickles(self, wsync: Context) -> None:
        """A scheme pickles before and after init_on_sender/connect (and on the receiver side),
        into a few KiB of configuration: no tensors, modules, threads, sockets or locks."""

        def check(obj: Any, when: str) -> None:
            report = inspect_pickle(obj)
            if report["pickle_error"]:
                raise violated("portable", f"pickle.dumps(scheme) {when} failed: {report['pickle_error']}")
            if report["forbidden"]:
                raise violated("portable", f"the pickled scheme {when} holds {sorted(set(report['forbidden']))}")
            if report["size"] > MAX_PICKLE_BYTES:
                raise violated("portable", f"the pickled scheme {when} is {report['size']} bytes "
                                           f"(more than {MAX_PICKLE_BYTES}: it carries more than configuration)")

        fresh = wsync.scheme()
        check(fresh, "before init")
        s = wsync.session(rich_spec("module", self.large_mib), n=1, connect=False)
        check(s.scheme, "after init_on_sender")
        s.connect()
        check(s.scheme, "after connect")
        copy = pickle.loads(pickle.dumps(s.scheme))
        if copy.state != WeightSyncScheme(wsync.target.make()).state or copy.version != -1:
            raise violated("portable", f"an unpickled copy is {copy.state!r} v{copy.version}, expected a new scheme")
        copy.shutdown()
        report = s.workers[0].request("pickle")
        if report.get("pickle_error") or report.get("forbidden"):
            raise violated("portable", f"a connected receiver's scheme pickles badly: {report}")
        s.fill(random_values(s.spec, 5))
        s.check(s.send(), guarantee="portable")
