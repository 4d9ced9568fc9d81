"""isolated: receivers never see what the trainer wrote but did not send, nor writes made after a send."""

from __future__ import annotations

import time

from ..context import Context
from ..guarantees import guarantee, violated
from ..models import build, digests, fill, many_spec, random_values, rich_spec
from .base import budget

__all__ = ["IsolatedChecks"]


class IsolatedChecks:
    """The isolated tests (a mixin of ``TransportSuite``)."""

    @guarantee("isolated")
    def test_isolated_unsent_writes_are_invisible(self, wsync: Context) -> None:
        """Trainer writes that were never sent never reach a receiver."""
        s = wsync.session(rich_spec("module", 1))
        s.fill(random_values(s.spec, 1))
        v = s.send()
        s.fill(random_values(s.spec, 2))
        with s.following() as reports:
            time.sleep(0.3)
        for i, r in reports.items():
            if r.get("applied"):
                raise violated("isolated", f"worker {i} applied versions {r['applied']} that were never sent")
        s.check(v, guarantee="isolated")

    @guarantee("isolated")
    def test_isolated_writes_after_send_returns(self, wsync: Context) -> None:
        """Changing the trainer's tensors right after send() returns changes nothing received."""
        sync = not wsync.caps.async_send
        s = wsync.session(rich_spec("module", 1), sync=sync)
        for round_ in range(3):
            s.fill(random_values(s.spec, 10 + round_))
            expected = digests(s.model)
            if sync:
                with s.following():
                    v = s.scheme.send()
            else:
                handle = s.scheme.send_async()
                v = handle.version
            s.fill(random_values(s.spec, 100 + round_))  # the trainer moves on at once
            s.expected[v] = expected
            if not sync:
                with s.following():
                    handle.wait()
            s.check(v, guarantee="isolated")

    @guarantee("isolated")
    def test_isolated_send_weights_leaves_trainer_unchanged(self, wsync: Context) -> None:
        """``send(weights=X)`` never changes the trainer's model."""
        s = wsync.session(rich_spec("state_dict", 1))
        s.fill(random_values(s.spec, 3))
        before = digests(s.model)
        other = build(s.spec.with_kind("state_dict"), wsync.sender_device, sender=True)
        fill(other, random_values(s.spec, 4))
        v = s.send(weights=other)
        if digests(s.model) != before:
            raise violated("isolated", "send(weights=X) changed the trainer's model")
        s.check(v, guarantee="isolated")

    @guarantee("isolated")
    @budget(seconds=30)
    def test_isolated_kept_references(self, wsync: Context) -> None:
        """Workers keep references to their model's tensors (>= 4 MiB, many tensors, every dtype)
        across many later versions: a reference that still backs the model holds its current
        version; one the model no longer uses keeps the values of the last version it backed
        (zero-copy receivers must not reuse a slot a kept tensor still views)."""
        s = wsync.session(many_spec("module", 4.0), n=2)
        s.hold()
        for step in range(1, 9):
            s.fill(random_values(s.spec, 1000 + step))
            targets = None if step % 3 or not wsync.caps.subset_send else [step % 2]
            s.send(worker_ids=targets)
            if step % 2:
                s.hold()
            s.check_held()
