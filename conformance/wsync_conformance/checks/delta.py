"""Sending less (``delta=True``, ``send(keys=...)``, ``wire_dtype=``) keeps every guarantee: each
receiver ends bit for bit at the version sent, whatever version it held; a damaged or
mismatched delta leaves its model untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, strategies as st
from wsync_core import SendReport, WeightSyncScheme
from wsync_core.deadline import Deadline
from wsync_core.delta import Mirror
from wsync_core.protocol import Header, checksum
from wsync_core.weights import flatten

from .. import profiles
from ..context import Context, Session, raw_receiver
from ..guarantees import guarantee, violated
from ..models import ModelSpec, build, digests, random_values, rich_spec, version_spec
from ..strategies import seeds
from .base import thorough

__all__ = ["DeltaChecks"]


def delta_session(wsync: Context, spec: ModelSpec, n: int = 2, *, sync: bool = True, **options: Any) -> Session:
    """A connected session whose sender scheme has ``options`` (delta=, delta_bases=, wire_dtype=)."""
    model = build(spec, wsync.sender_device, sender=True)
    scheme = WeightSyncScheme(wsync.target.make(), sync=sync, timeout=wsync.timeout, **options)
    wsync.on_close(scheme.shutdown)
    scheme.init_on_sender(model=model, num_workers=n)
    s = Session(wsync, spec, wsync.workers(n), scheme=scheme, model=model)
    wsync.on_close(s.close)
    s.connect()
    return s


def last_report(s: Session) -> SendReport:
    """The report of the send just made (a sender's scheme has one after each send)."""
    report = s.scheme.last_report
    assert report is not None
    return report


def touch(s: Session, seed: int, share: float) -> None:
    """Give about ``share`` of the elements of every untied tensor new random bits (NaN payloads,
    -0.0 and subnormals among them)."""
    g = torch.Generator().manual_seed(seed)
    fresh = random_values(s.spec, seed)
    current = flatten(s.model)
    values = {}
    for key, new in fresh.items():
        old = current[key].detach().cpu().clone()
        if not old.numel():
            continue
        mask = torch.rand(old.shape, generator=g) < share
        values[key] = torch.where(mask, new, old)
    s.fill(values)


def reach(wsync: Context, s: Session, worker: int, version: int) -> None:
    """Make ``worker`` call receive() until it holds ``version``; raise its error if it raises one."""
    deadline = Deadline(wsync.timeout)
    while s.workers[worker].snapshot()["version"] < version:
        if deadline.expired():
            raise violated("live", f"worker {worker} did not reach version {version} within {wsync.timeout} s")
        s.workers[worker].call("receive", timeout=0.5).raise_for_error(f"worker {worker}: receive()")


class DeltaChecks:
    """The delta tests (a mixin of ``TransportSuite``)."""

    @guarantee("exact")
    def test_delta_exact_sparse_changes(self, wsync: Context) -> None:
        """delta=True: versions changing none, 1%, 30% or all of the elements (random bits) arrive
        bit for bit; a 1% change travels as a delta smaller than a full payload."""
        s = delta_session(wsync, rich_spec("module", 1), delta=True)

        def step(seed: int, share: float) -> None:
            touch(s, seed, share)
            v = s.send()
            report = last_report(s)
            partial = s.scheme._sender()._moves_prefix()  # else the transport moves whole buffers, deltas or not
            if share <= 0.01 and (sorted(report.delta_workers) != [0, 1]
                                  or partial and report.nbytes >= report.full_nbytes):
                raise violated("exact", f"version {v} changed {'?' if report.changed is None else format(report.changed, '.3%')} of the elements but went as "
                                        f"{report.worker_nbytes} bytes (full: {report.full_nbytes}), deltas to "
                                        f"{report.delta_workers}")

        for seed, share in ((1, 0.01), (2, 0.0), (3, 0.3), (4, 1.0), (5, 0.01)):
            step(seed, share)

        @profiles.scaled(0.2, at_least=2)
        @given(seed=seeds(), share=st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]))
        def run(seed: int, share: float) -> None:
            step(seed, share)

        run()

    @guarantee("exact", "versioned")
    def test_delta_workers_at_different_versions(self, wsync: Context) -> None:
        """sync=False, worker 1 silent while three versions go out as deltas (its mailbox keeps
        the newest): each worker ends exactly at the version it applied, from whatever it held."""
        s = delta_session(wsync, version_spec(side=32), sync=False, delta=True, delta_bases=4)
        handles = []
        for v in (1, 2, 3):
            touch(s, 100 + v, 0.02)
            handles.append(s.scheme.send_async())
            s.expected[v] = digests(s.model)
            if v < 3:  # worker 0 applies each version; worker 1 receives nothing yet
                reach(wsync, s, 0, v)
                s.check(v, [0])
        for i in (0, 1):
            reach(wsync, s, i, 3)
        handles[-1].wait()
        s.check(3)
        touch(s, 200, 0.02)
        s.send()  # both at version 3 now: one shared delta
        report = last_report(s)
        if sorted(report.delta_workers) != [0, 1]:
            raise violated("exact", f"workers at the same version got {report.worker_nbytes} bytes, "
                                    f"deltas to {report.delta_workers}")

    @guarantee("exact")
    @pytest.mark.parametrize("how", ["in_place", "data_swap"])
    def test_delta_after_the_worker_wrote_its_model(self, wsync: Context, how: str) -> None:
        """A worker writes its policy between two versions (in place, or ``p.data = ...``): the next
        version, sent as a delta, must not leave what it wrote where the trainer changed nothing:
        the worker ends exactly at that version (it asks for it in full)."""
        s = delta_session(wsync, version_spec(side=32), delta=True)
        touch(s, 31, 0.02)
        s.send()
        for seed in (32, 33):
            written = s.workers[0].scene("write", how=how)["digests"]
            if written == s.expected[s.scheme.version]:
                raise AssertionError(f"the write ({how}) changed nothing on worker 0")
            touch(s, seed, 0.02)
            s.send()  # checks each worker holds exactly the version sent

    @guarantee("exact")
    @thorough()
    def test_delta_worker_beyond_kept_bases_gets_full(self, wsync: Context) -> None:
        """(--thorough) A worker further behind than delta_bases versions gets a full payload, the others deltas."""
        s = delta_session(wsync, version_spec(side=32), n=3, delta=True, delta_bases=2)
        for i in range(3):
            touch(s, 300 + i, 0.02)
            s.send(worker_ids=[0, 1] if i < 2 else [0])
        touch(s, 400, 0.02)
        s.send()
        report = last_report(s)
        if 2 in report.delta_workers or 0 not in report.delta_workers:
            raise violated("exact", f"deltas went to {report.delta_workers}: worker 2 (at version 0) needs a full one")

    @guarantee("atomic", "safe")
    def test_delta_damaged_leaves_model_untouched(self, wsync: Context) -> None:
        """Deltas with indices out of range or out of order, a table past the payload's end or
        naming no tensor raise TransportError and change nothing; a delta for a base the worker
        does not hold is refused (nothing applied, a BaseMismatch ack); a good one then applies."""
        raw, w, before = raw_receiver(wsync)
        mirror = Mirror(raw.layout, None, 4, torch.device("cpu"))
        mirror.reset(flatten(raw.model), 0)
        with torch.no_grad():
            for t in flatten(raw.model).values():
                t.view(-1)[3:9] += 1
        mirror.update(flatten(raw.model), 1, None)
        changes = mirror.since(0)
        assert changes is not None  # (the mirror is at version 1 and remembers version 0: reset above)

        def publish(version: int, damage=None, **fields: Any) -> None:
            lease = raw.endpoint.acquire(Deadline(wsync.timeout))
            buffer = lease.tensor
            encoded = mirror.encode(changes, buffer)
            table = [list(t) for t in encoded.table]
            header: dict[str, Any] = dict(version=version, model_id="policy", digest=raw.layout.digest,
                                          nbytes=encoded.nbytes, table=table, base=0)
            if damage is not None:
                damage(buffer, table, header)
            header.update(fields)
            if raw.transport.checksum:  # as the core's (damaged before it is summed: the checks of the delta must refuse it)
                header["checksum"] = checksum(buffer[:min(header["nbytes"], buffer.numel())])
            prefix = getattr(raw.endpoint, "prefix_publish", False)  # as the core: a prefix, never empty
            lease.used = min(max(header["nbytes"], 1), buffer.numel()) if prefix else buffer.numel()
            raw.endpoint.publish(lease, Header(**header).encode(raw.transport.checksum), [0])

        first = changes[min(changes)]
        at = mirror.encode(changes, torch.empty(raw.layout.nbytes, dtype=torch.uint8)).table[0][2]

        def index(value: int):
            def damage(buffer, table, header):
                buffer[at:at + 4].view(torch.int32)[0] = value
            return damage

        def swap(buffer, table, header):
            idx = buffer[at:at + 8].view(torch.int32)
            idx[0], idx[1] = int(idx[1]), int(idx[0])

        cases = {
            "an index past the tensor's end": index(1 << 30),
            "a negative index": index(-1),
            "indices out of order": swap,
            "a table past the payload's end": lambda b, t, h: h.update(nbytes=t[-1][2]),
            "a table naming no tensor": lambda b, t, h: t.append([999, -1, t[-1][2] + 64]),
            "a count over the tensor's size": lambda b, t, h: t[0].__setitem__(1, 1 << 40),
        }
        assert first is not None and first.numel() >= 2
        for what, damage in cases.items():
            publish(1, damage)
            reply = raw.call(w, "receive", timeout=min(wsync.timeout, 5.0))
            if reply.error != "TransportError":
                raise violated("atomic", f"a delta with {what}: receive() gave {reply.error or reply.get('result')}, "
                                         f"expected TransportError")
            if w.snapshot()["digests"] != before:
                raise violated("atomic", f"a delta with {what} changed the receiver's model")
        publish(2, base=1)  # the worker holds version 0
        reply = raw.call(w, "receive", timeout=min(wsync.timeout, 5.0))
        if reply.error is not None or reply.get("result") is not None or w.snapshot()["digests"] != before:
            raise violated("atomic", f"a delta for base 1 to a worker at version 0: receive() gave "
                                     f"{reply.error or reply.get('result')} and the model "
                                     f"{'changed' if w.snapshot()['digests'] != before else 'kept'}")
        deadline = Deadline(wsync.timeout)
        while not any(a.error_type == "BaseMismatch" for a in raw.acks) and not deadline.expired():
            raw._pump(deadline)
        if not any(a.error_type == "BaseMismatch" for a in raw.acks):
            raise violated("atomic", f"the worker refused a delta for a base it does not hold without telling the "
                                     f"sender (acks: {raw.acks})")
        publish(3)
        reply = raw.call(w, "receive", timeout=wsync.timeout)
        if reply.error is not None or reply.get("result") != 3:
            raise violated("atomic", f"a good delta after damaged ones: receive() gave {reply.error or reply.get('result')}")
        if w.snapshot()["digests"] != digests(raw.model):
            raise violated("exact", "a good delta after damaged ones did not make the model equal the sender's")

    @guarantee("atomic", "exact")
    @pytest.mark.parametrize("delta", [False, True])
    def test_keys_subset_is_one_version(self, wsync: Context, delta: bool) -> None:
        """send(keys=[...]): the new version is the previous one with those tensors replaced (the
        trainer's other changes stay unsent), applied whole."""
        s = delta_session(wsync, rich_spec("module", 0), delta=delta)
        keys = ["encoder.norm.weight", "stats.small"]
        for seed in (11, 12):
            prev = s.expected[max(s.expected)]
            touch(s, seed, 1.0)
            now = digests(s.model)
            with s.following():
                v = s.scheme.send(keys=keys)
            s.expected[v] = {k: now[k] if k in keys else d for k, d in prev.items()}
            s.check(v, guarantee="atomic")
        s.expected[s.send()] = digests(s.model)

    @guarantee("exact")
    @pytest.mark.parametrize("wire,delta", [("bfloat16", True), ("float16", False)])
    def test_wire_dtype_casts_exactly(self, wsync: Context, wire: str, delta: bool) -> None:
        """wire_dtype=: floating tensors arrive as x.to(wire).to(model dtype), bit for bit
        (random bits: NaN, infinities, subnormals), as deltas too."""
        dtype = getattr(torch, wire)
        s = delta_session(wsync, rich_spec("module", 0), wire_dtype=dtype, delta=delta)
        for seed, share in ((21, 1.0), (22, 0.05)):
            touch(s, seed, share)
            cast = {k: t.detach().to(dtype).to(t.dtype) if t.is_floating_point() else t.detach()
                    for k, t in flatten(s.model).items()}
            s.send(weights=cast)
