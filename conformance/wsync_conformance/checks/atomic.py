"""atomic: a model never holds a mix of versions; bad payloads leave it untouched."""

from __future__ import annotations

import json
import time

from wsync_core import SchemaMismatchError

from ..context import Context, Session, classify, raw_receiver
from ..guarantees import capability, guarantee, violated
from ..models import ModelSpec, TensorSpec, build, digests, fill_version, many_spec, random_values, version_spec
from .base import budget, thorough

__all__ = ["AtomicChecks"]


class AtomicChecks:
    """The atomic tests (a mixin of ``TransportSuite``)."""

    @guarantee("atomic")
    def test_atomic_no_mix_of_versions(self, wsync: Context) -> None:
        """Receivers applying versions in a loop while the trainer sends never hold a mix of two."""
        async_ = wsync.caps.async_send
        s = wsync.session(version_spec(), sync=not async_)
        with s.following(record=True) as reports:
            handles = []
            for v in range(1, 25):
                fill_version(s.model, v)
                s.expected[v] = digests(s.model)
                if async_:
                    handles.append(s.scheme.send_async())
                else:
                    s.scheme.send()
            for h in handles:
                h.wait()
        for i, r in reports.items():
            for applied, _, got in r["records"]:
                kind, detail = classify(got, s.expected)
                if kind == "mixed":
                    raise violated("atomic", f"worker {i} applied version {applied} and held a mix of versions: "
                                             f"{detail}")
            if r.get("errors"):
                raise AssertionError(f"worker {i} raised while receiving: {r['errors'][0]}")
        s.check(24, guarantee="atomic")

    @guarantee("atomic")
    def test_atomic_schema_mismatch_at_connect(self, wsync: Context) -> None:
        """A receiver whose model differs (shape, dtype, keys) gets SchemaMismatchError; its model is untouched."""
        base = version_spec()
        variants = {
            "shape": ModelSpec(base.kind, (TensorSpec("block0.weight", (64, 63), "float32"),) + base.tensors[1:]),
            "dtype": ModelSpec(base.kind, (TensorSpec("block0.weight", (64, 64), "float64"),) + base.tensors[1:]),
            "keys": ModelSpec(base.kind, base.tensors[:-1]),
        }
        for what, spec in variants.items():
            (w,) = wsync.workers(1)
            s = Session(wsync, base, [w])
            wsync.on_close(s.close)
            fill_version(s.model, 5)
            w.open(s.scheme, spec, wsync.device, 0)  # replaces the session's receiver with a mismatching one
            before = w.snapshot()["digests"]
            w.call_async("connect", timeout=wsync.timeout)
            try:
                s.scheme.connect()
            except SchemaMismatchError:
                pass
            else:
                raise violated("atomic", f"sender connect() succeeded with a receiver whose {what} differ")
            finally:
                reply = w.recv(wsync.timeout + 60)
            if reply.error != "SchemaMismatchError":
                raise violated("atomic", f"receiver with differing {what}: connect() gave {reply.error or 'no error'}, "
                                         f"expected SchemaMismatchError ({reply.get('message')})")
            if w.snapshot()["digests"] != before:
                raise violated("atomic", f"a payload with differing {what} changed the receiver's model")
            s.close()

    @guarantee("atomic")
    def test_atomic_send_weights_mismatch(self, wsync: Context) -> None:
        """``send(weights=...)`` that does not match raises SchemaMismatchError before anything is sent."""
        s = wsync.session(version_spec("state_dict"))
        wrong = build(ModelSpec("state_dict", version_spec().tensors[:-1]), wsync.sender_device)
        with s.following() as reports:
            try:
                s.scheme.send(weights=wrong)
            except SchemaMismatchError:
                pass
            else:
                raise violated("atomic", "send(weights=<missing a key>) did not raise SchemaMismatchError")
            time.sleep(0.2)
        if s.scheme.version != 0 or any(r.get("applied") for r in reports.values()):
            raise violated("atomic", "a rejected send(weights=...) changed a version")
        s.check(0, guarantee="atomic")
        fill_version(s.model, 1)
        s.check(s.send())

    @guarantee("atomic")
    def test_atomic_damaged_payload(self, wsync: Context) -> None:
        """A payload under a wrong layout or a failing checksum raises and leaves the model untouched."""
        raw, w, before = raw_receiver(wsync)
        other = version_spec().tensors[:-1]
        from wsync_core import Layout

        other_layout = Layout.of(build(ModelSpec("state_dict", other)))
        cases = {
            "a different layout": (raw.header(1, digest=other_layout.digest,
                                              layout=json.loads(other_layout.to_json())), "SchemaMismatchError"),
            "a wrong checksum": (raw.header(2, checksum=[12345]), "TransportError"),
            "a wrong size": (raw.header(3, nbytes=raw.layout.nbytes + 64), "TransportError"),
            "another model's id": (raw.header(4, model_id="critic"), "SchemaMismatchError"),
        }
        fill_version(raw.model, 9)
        for what, (header, error) in cases.items():
            raw.publish(header, [0])
            reply = raw.call(w, "receive", timeout=wsync.timeout)
            if reply.error != error:
                raise violated("atomic", f"a payload with {what}: receive() gave {reply.error or reply.get('result')}, "
                                         f"expected {error}")
            if w.snapshot()["digests"] != before:
                raise violated("atomic", f"a payload with {what} changed the receiver's model")

    @guarantee("atomic")
    @budget(seconds=30)
    @capability("async_send")
    def test_atomic_overlapping_large_async_sends(self, wsync: Context) -> None:
        """Eight asynchronous sends of a >= 1 MiB model, issued without waiting (they overlap in
        the transport), while receivers apply in a loop: every version a receiver applies is whole,
        and each ends on the newest."""
        wsync.require("async_send")
        s = wsync.session(many_spec("module", 1.5, count=12), n=2, sync=False)
        with s.following(record=True) as reports:
            handles = []
            for v in range(1, 9):
                s.fill(random_values(s.spec, 3000 + v))
                s.expected[v] = digests(s.model)
                handles.append(s.scheme.send_async())
                s.fill(random_values(s.spec, 3500 + v))  # the trainer moves on at once
            for h in handles:
                h.wait()
        for i, r in reports.items():
            if r.get("errors"):
                raise AssertionError(f"worker {i} raised while receiving: {r['errors'][0]}")
            previous = 0
            for applied, _, got in r["records"]:
                if applied <= previous:
                    raise violated("versioned", f"worker {i} applied version {applied} after {previous}")
                previous = applied
                kind, detail = classify(got, s.expected)
                if kind != "match" or detail != applied:
                    raise violated("atomic", f"worker {i} applied version {applied} and held {kind} {detail}")
        s.check(8, guarantee="atomic")

    @guarantee("atomic")
    @thorough()
    def test_atomic_soak(self, wsync: Context) -> None:
        """(--thorough) 150 sends of a 4 MiB model (asynchronous where the transport can) while
        receivers apply in a loop and keep references: never a mix, never a changed reference."""
        async_ = wsync.caps.async_send
        s = wsync.session(many_spec("tensordict", 4.0), n=3, sync=not async_)
        with s.following(record=True) as reports:
            for v in range(1, 151):
                s.fill(random_values(s.spec, 5000 + v))
                s.expected[v] = digests(s.model)
                handle = s.scheme.send_async() if async_ else None
                if handle is None:
                    s.scheme.send()
                elif v % 10 == 0:
                    handle.wait()
        for i, r in reports.items():
            for applied, _, got in r["records"]:
                kind, detail = classify(got, s.expected)
                if kind != "match" or detail != applied:
                    raise violated("atomic", f"worker {i} applied version {applied} and held {kind} {detail}")
        s.check(150, guarantee="atomic")
