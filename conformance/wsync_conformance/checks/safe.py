"""safe: nothing received is unpickled; damaged or hostile bytes never damage a model."""

from __future__ import annotations

import pickle

import pytest

from wsync_core import TransportError
from wsync_core.protocol import MAX_HEADER_BYTES

from .. import resources
from ..context import Context, expect_serving_after_hostile, raw_receiver
from ..guarantees import guarantee, violated
from ..models import fill_version, random_values, rich_spec, version_spec
from ..trust import trusted_runtime, untrusted_unpickling

__all__ = ["SafeChecks"]


class SafeChecks:
    """The safe tests (a mixin of ``TransportSuite``)."""

    @guarantee("safe")
    def test_safe_nothing_unpickled(self, wsync: Context) -> None:
        """Nothing is unpickled in a receiver while it connects and receives: no ``pickle.find_class``
        and no call of pickle's loaders (an unpickling of plain bytes or tuples looks up no class)."""
        s = wsync.session(rich_spec("module", 1), n=2)
        for seed in range(3):
            s.fill(random_values(s.spec, seed))
            s.check(s.send())
        for i, w in enumerate(s.workers):
            events = untrusted_unpickling(w.request("audit")["events"], trusted_runtime(wsync.target.cls))
            if events:
                raise violated("safe", f"receiver {i} unpickled while receiving: {_described(events[0])} "
                                       f"and {len(events) - 1} more")

    @guarantee("safe")
    def test_safe_hostile_headers(self, wsync: Context) -> None:
        """Garbage, truncated, pickled, oversized and malformed headers raise TransportError;
        the model is untouched and the receiver keeps working."""
        raw, w, before = raw_receiver(wsync)
        good = raw.header(1)
        cases = {
            "empty bytes": b"",
            "random bytes": bytes(range(256)) * 4,
            "a pickle": pickle.dumps(print) + pickle.dumps(("unpickled!",)),
            "truncated JSON": good[: len(good) // 2],
            "another protocol": b'{"wsync": 99, "v": 1}',
            "a string version": good.replace(b'"v":1', b'"v":"1"'),
            "a negative size": good.replace(f'"n":{raw.layout.nbytes}'.encode(), b'"n":-5'),
        }
        fill_version(raw.model, 9)
        for what, header in cases.items():
            try:
                raw.publish(header, [0])
            except (TransportError, ValueError) as exc:
                raise violated("safe", f"publishing {what} failed on the sender side: {exc}") from exc
            reply = raw.call(w, "receive", timeout=min(wsync.timeout, 5.0))
            if reply.error not in ("TransportError",) and not (reply.error is None and reply.get("result") is None):
                raise violated("safe", f"a header of {what}: receive() gave {reply.error or reply.get('result')}, "
                                       f"expected TransportError (or nothing)")
            if w.snapshot()["digests"] != before:
                raise violated("safe", f"a header of {what} changed the receiver's model")
        events = untrusted_unpickling(w.request("audit")["events"], trusted_runtime(wsync.target.cls))
        if events:
            raise violated("safe", f"the receiver unpickled hostile bytes: {_described(events[0])}")
        expect_serving_after_hostile(raw, w, wsync)
        # last: an oversized header (a transport may refuse to carry it, or drop the peer that sent it)
        before = w.snapshot()["digests"]
        fill_version(raw.model, 11)
        try:
            raw.publish(b'{"wsync":1,"pad":"' + b"x" * (MAX_HEADER_BYTES + 16) + b'"}', [0])
        except (TransportError, ValueError):
            return
        reply = raw.call(w, "receive", timeout=min(wsync.timeout, 5.0))
        if reply.error not in (None, "TransportError") or reply.get("result") is not None:
            raise violated("safe", f"an oversized header: receive() gave {reply.error or reply.get('result')}, "
                                   f"expected TransportError (or nothing)")
        if w.snapshot()["digests"] != before:
            raise violated("safe", "an oversized header changed the receiver's model")

    @guarantee("safe")
    def test_safe_binds_loopback(self, wsync: Context) -> None:
        """Unless told otherwise, every socket the transport listens on is bound to loopback (in
        this process, the sockets its session opened; in a receiver's runner, every one)."""
        before = set(resources.listening_sockets())  # an earlier test's are not this session's
        s = wsync.session(version_spec(), n=2)
        found = {a: "the sender's process" for a in resources.listening_sockets() if a not in before}
        if wsync.process:
            for i, w in enumerate(s.workers):
                found.update((a, f"receiver {i}'s process") for a in w.request("resources")["listening"])
        public = {a: holder for a, holder in found.items() if not resources.is_loopback(a)}
        runtime = trusted_runtime(wsync.target.cls)
        if public and runtime is not None:
            pytest.skip(f"the sockets listening beyond loopback are the trusted runtime's ({runtime[0]}): "
                        f"{len(public)} found")
        if public:
            where = ", ".join(f"{a} ({holder})" for a, holder in sorted(public.items()))
            raise violated("safe", f"listening on non-loopback addresses by default: {where}")


def _described(event: list[str]) -> str:
    """An audit event in words: ``find_class(module, name) in module:function`` for a class looked
    up, ``pickle.loads in module:function`` for a loader called on plain data."""
    where = f" in {event[2]}" if len(event) > 2 else ""
    if event and event[0] == "(no class)":
        return f"{event[1]}(){where}"
    return f"find_class{tuple(event[:2])}{where}"
