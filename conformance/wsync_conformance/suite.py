"""``TransportSuite``: every guarantee of SPEC.md as tests, for any transport.

A transport's whole test file::

    from wsync_conformance import TransportSuite

    class TestMine(TransportSuite):
        transport = "mine"            # entry-point name, "module:Class", a class, object or factory
        options = {"port": 0}         # passed to the transport

Tests are marked ``wsync_guarantee(name)``; tests for capabilities the transport does not
declare skip with the reason.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from wsync_core import (
    SchemaMismatchError,
    StateError,
    Transport,
    TransportError,
    WeightSyncScheme,
    WorkerTimeoutError,
)
from wsync_core.protocol import MAX_HEADER_BYTES

from . import harness, profiles, resources
from .context import Context, RawSender, Session, classify, send_expect_timeout
from .guarantees import guarantee, violated
from .holding import HoldingChecks
from .models import KINDS, ModelSpec, TensorSpec, build, digests, fill, fill_version, random_values, rich_spec, version_spec
from .portable import MAX_PICKLE_BYTES, inspect_pickle
from .scenes import SceneChecks
from .stateful import run_lifecycle_machine
from .strategies import model_specs, seeds, value_styles
from .target import Target
from .trust import trusted_runtime, untrusted_unpickling

__all__ = ["TransportSuite"]

#: slack on top of a timeout before a call counts as not honouring it (the machine may be busy)
SLACK_S = 20.0


def _option(request: pytest.FixtureRequest, name: str) -> Any:
    try:
        return request.config.getoption(name)
    except ValueError:  # the wsync_conformance plugin is not loaded
        return None


class TransportSuite(HoldingChecks, SceneChecks):
    """Subclass and set ``transport`` (and ``options``) to run the whole suite against it."""

    #: entry-point name, ``"module:attr"``, Transport class, Transport object or factory(**options)
    transport: ClassVar[str | Transport | type[Transport] | Callable[..., Transport]] = "inproc"
    #: options for the transport
    options: ClassVar[dict[str, Any]] = {}
    #: ``cpu`` or ``cuda`` (``--wsync-device`` overrides)
    device: ClassVar[str] = "cpu"
    #: seconds a call that should succeed may take (``--wsync-timeout`` overrides)
    timeout: ClassVar[float] = 30.0
    #: seconds for calls that must time out
    short_timeout: ClassVar[float] = 1.0
    #: size of the large tensor in the rich model
    large_mib: ClassVar[int] = 4

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def wsync_target(self) -> Target:
        """The transport under test (``TestConformance`` takes it from the command line)."""
        return Target(type(self).transport, dict(type(self).options))

    @pytest.fixture
    def wsync(self, request: pytest.FixtureRequest, wsync_target: Target):
        """A Context for one test; frees every scheme and returns every receiver runner after it."""
        device = _option(request, "wsync_device") or self.device
        timeout = _option(request, "wsync_timeout") or self.timeout
        if device == "cuda":
            if not torch.cuda.is_available():
                pytest.skip("CUDA is not available on this machine")
            if not wsync_target.capabilities.cuda:
                pytest.skip(f"transport {wsync_target.name!r} does not declare the 'cuda' capability")
        ctx = Context(wsync_target, device, float(timeout), self.short_timeout)
        try:
            yield ctx
        finally:
            ctx.close()

    # == exact ======================================================================================
    @guarantee("exact")
    @pytest.mark.parametrize("kind", KINDS)
    def test_exact_every_dtype_and_shape(self, wsync: Context, kind: str) -> None:
        """Random bits, extremes, 0-d, empty, large, transposed/strided/shared/tied sources,
        parameters and buffers, as a module, TensorDict and state_dict: equal bit for bit."""
        s = wsync.session(rich_spec(kind, self.large_mib))
        s.check(0)

        @profiles.scaled(0.6)
        @given(seed=seeds(), styles=value_styles(s.spec))
        def run(seed: int, styles: dict[str, str]) -> None:
            s.fill(random_values(s.spec, seed, styles))
            s.check(s.send())

        run()

    @guarantee("exact")
    def test_exact_drawn_structures(self, wsync: Context) -> None:
        """Hypothesis-drawn nested structures (kinds, dtypes, shapes, sources, ties)."""
        workers = wsync.workers(2)

        @profiles.scaled(0.5 if wsync.process else 1.5, at_least=2)
        @given(spec=model_specs(large=True), seed=seeds(), styles=st.data())
        def run(spec: ModelSpec, seed: int, styles) -> None:
            s = wsync.session(spec, workers=workers, connect=False)
            try:
                s.fill(random_values(spec, seed ^ 1))
                s.connect()
                s.check(0)
                s.fill(random_values(spec, seed, styles.draw(value_styles(spec))))
                s.check(s.send())
            finally:
                s.close()

        run()

    @guarantee("exact")
    def test_exact_send_weights_views(self, wsync: Context) -> None:
        """``send(weights=...)`` of transposed views and slices of one storage arrives exactly."""
        spec = ModelSpec("state_dict", (TensorSpec("a", (6, 4), "float32"), TensorSpec("b", (4, 6), "bfloat16"),
                                        TensorSpec("c", (5,), "int64"), TensorSpec("d", (5,), "int64")))
        s = wsync.session(spec)
        storage = torch.arange(100, dtype=torch.int64)
        weights = {"a": torch.randn(4, 6).t(), "b": torch.randn(6, 4).to(torch.bfloat16).t(),
                   "c": storage[10:15], "d": storage[::20]}
        assert not weights["a"].is_contiguous() and not weights["d"].is_contiguous()
        s.check(s.send(weights=weights))

    @guarantee("exact")
    def test_exact_cpu_sender_cuda_receivers(self, wsync: Context) -> None:
        """A CPU trainer syncing CUDA receivers (only with --wsync-device cuda)."""
        if wsync.device != "cuda":
            pytest.skip("only with --wsync-device cuda (CPU sender, CUDA receivers)")
        wsync.sender_device = "cpu"
        s = wsync.session(rich_spec("module", 1), receiver_device="cuda")
        s.fill(random_values(s.spec, 7))
        s.check(s.send())

    # == isolated ===================================================================================
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

    # == atomic =====================================================================================
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
            wsync._closers.append(s.close)
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
        raw, w, before = _raw_receiver(wsync)
        other = version_spec().tensors[:-1]
        from wsync_core import Layout

        other_layout = Layout.of(build(ModelSpec("state_dict", other)))
        cases = {
            "a different layout": (raw.header(1, digest=other_layout.digest,
                                              layout=json.loads(other_layout.to_json())), "SchemaMismatchError"),
            "a wrong checksum": (raw.header(2, crc=12345), "TransportError"),
            "a wrong size": (raw.header(3, nbytes=raw.layout.nbytes + 64), "TransportError"),
            "another model's id": (raw.header(4, model_id="critic"), "SchemaMismatchError"),
        }
        fill_version(raw.model, 9)
        for what, (header, error) in cases.items():
            raw.publish(header, [0])
            reply = w.call("receive", timeout=wsync.timeout)
            if reply.error != error:
                raise violated("atomic", f"a payload with {what}: receive() gave {reply.error or reply.get('result')}, "
                                         f"expected {error}")
            if w.snapshot()["digests"] != before:
                raise violated("atomic", f"a payload with {what} changed the receiver's model")

    # == versioned ==================================================================================
    @guarantee("versioned")
    def test_versioned_counts_and_content(self, wsync: Context) -> None:
        """0 after connect, +1 per send; receivers report what they applied, holding exactly that."""
        s = wsync.session(version_spec(), n=2)
        if s.scheme.version != 0:
            raise violated("versioned", f"sender version after connect is {s.scheme.version}, expected 0")
        s.check(0, guarantee="versioned")
        for expected_v in range(1, 6):
            fill_version(s.model, expected_v)
            try:
                v = s.send()
            except WorkerTimeoutError as exc:
                applied = {i: s.workers[i].snapshot()["version"] for i in exc.workers}
                if any(a >= expected_v for a in applied.values()):
                    raise violated("versioned", f"workers {applied} applied version {expected_v} but their acks "
                                                f"never completed the send: {exc}") from exc
                raise
            if v != expected_v or s.scheme.version != v:
                raise violated("versioned", f"send() #{expected_v} returned {v} (scheme.version {s.scheme.version})")
            for i, w in enumerate(s.workers):
                snap = w.snapshot()
                kind, detail = classify(snap["digests"], s.expected)
                if snap["version"] != v:
                    raise violated("versioned", f"worker {i} reports version {snap['version']} after send {v} returned")
                if kind == "match" and detail != v:
                    raise violated("versioned", f"worker {i} reports version {v} but holds the content of version {detail}")
        reply = s.workers[0].call("receive", timeout=0.2)
        if reply.get("result") is not None or reply.get("version") != 5:
            raise violated("versioned", f"receive() with nothing new returned {reply.get('result')} "
                                        f"(version {reply.get('version')}), expected None (version 5)")

    @guarantee("versioned")
    def test_versioned_old_ack_never_completes_newer_send(self, wsync: Context) -> None:
        """A worker that acked v does not complete the send of v+1 until it applies v+1."""
        s = wsync.session(version_spec(), n=2, sync=not wsync.caps.async_send)
        fill_version(s.model, 1)
        s.check(s.send())
        fill_version(s.model, 2)
        s.expected[2] = digests(s.model)
        if wsync.caps.async_send:
            handle = s.scheme.send_async()
            time.sleep(0.2)
            if handle.done():
                raise violated("versioned", "send_async(v2).done() is True before any worker received v2")
            try:
                handle.wait(timeout=wsync.short_timeout)
            except WorkerTimeoutError as exc:
                if exc.workers != [0, 1]:
                    raise violated("versioned", f"WorkerTimeoutError names {exc.workers}, expected [0, 1]") from exc
            else:
                raise violated("versioned", "an old ack completed a newer send")
            with s.following():
                handle.wait()
        else:
            with s.following([1]):
                exc, _ = send_expect_timeout(s, [0], timeout=wsync.short_timeout)
            if exc.workers != [0]:
                raise violated("versioned", f"WorkerTimeoutError names {exc.workers}, expected [0]")
            with s.following():
                s.send()
        s.check(s.scheme.version)

    @guarantee("versioned")
    def test_versioned_async_send(self, wsync: Context) -> None:
        """With sync=False, send() returns at the snapshot; send_async().wait() returns the version."""
        wsync.require("async_send")
        s = wsync.session(version_spec(), n=2, sync=False)
        fill_version(s.model, 1)
        s.expected[1] = digests(s.model)
        v = s.scheme.send()  # nobody receives yet: must still return
        if v != 1:
            raise violated("versioned", f"send() returned {v}, expected 1")
        fill_version(s.model, 2)
        s.expected[2] = digests(s.model)
        handle = s.scheme.send_async()
        with s.following():
            if handle.wait() != 2:
                raise violated("versioned", "send_async().wait() did not return version 2")
        s.check(2)

    @guarantee("versioned", "atomic", "exact", "isolated", "targeted", "live", "portable", "clean", "safe")
    def test_lifecycle_state_machine(self, wsync: Context) -> None:
        """Random sequences of sends, subset and async sends, receives, silent workers, unsent
        writes, pickling and shutdown; every invariant checked after every step."""
        run_lifecycle_machine(wsync)

    # == live =======================================================================================
    @guarantee("live")
    def test_live_silent_worker(self, wsync: Context) -> None:
        """A silent worker: send() raises WorkerTimeoutError naming exactly it, in time; the
        others are updated and the scheme keeps working for them."""
        s = wsync.session(version_spec(), n=3)
        fill_version(s.model, 1)
        s.expected[1] = digests(s.model)
        with s.following([0, 2]):
            exc, took = send_expect_timeout(s, [1], timeout=wsync.short_timeout)
        if exc.workers != [1]:
            raise violated("live", f"WorkerTimeoutError names workers {exc.workers}, expected [1]")
        if took > wsync.short_timeout + SLACK_S:
            raise violated("live", f"send(timeout={wsync.short_timeout}) took {took:.1f} s")
        s.check(1, [0, 2], guarantee="live")
        if wsync.caps.subset_send:
            fill_version(s.model, 2)
            s.check(s.send(worker_ids=[0, 2]), [0, 2], guarantee="live")
        fill_version(s.model, 3)
        v = s.send()
        s.check(v, guarantee="live")

    @guarantee("live")
    def test_live_receive_and_connect_honour_timeouts(self, wsync: Context) -> None:
        """receive(timeout) returns None in time when nothing comes; connect() on either side
        raises by its timeout when the peer never comes."""
        short = wsync.short_timeout
        # a sender whose worker 1 never connects
        s = wsync.session(version_spec(), n=2, connect=False)
        t0 = time.monotonic()
        # A transport with a static membership (no late_join: e.g. torch RPC's fixed world) cannot
        # update anyone until everyone is there; it must still time out, naming the absent worker.
        partial = wsync.caps.late_join
        try:
            s.connect(workers=[0], timeout=short)
        except WorkerTimeoutError as exc:
            if exc.workers != [1] and (partial or 1 not in exc.workers):
                raise violated("live", f"connect() WorkerTimeoutError names {exc.workers}, expected [1]") from exc
        else:
            raise violated("live", "sender connect() returned although worker 1 never connected")
        if time.monotonic() - t0 > short + SLACK_S:
            raise violated("live", f"connect(timeout={short}) took {time.monotonic() - t0:.1f} s")
        if partial:
            s.check(0, [0], guarantee="live")
            t0 = time.monotonic()
            reply = s.workers[0].call("receive", timeout=0.5)
            took = time.monotonic() - t0
            if reply.error or reply.get("result") is not None:
                raise violated("live", f"receive(timeout=0.5) with nothing sent gave {reply.error or reply.get('result')}")
            if took > 0.5 + SLACK_S:
                raise violated("live", f"receive(timeout=0.5) took {took:.1f} s")
            if wsync.caps.subset_send:
                fill_version(s.model, 1)
                s.check(s.send(worker_ids=[0]), [0], guarantee="live")
        s.close()
        # a receiver whose sender never comes
        (w,) = wsync.workers(1)
        lonely = wsync.scheme()
        w.open(lonely, version_spec(), wsync.device, 0)
        t0 = time.monotonic()
        reply = w.call("connect", timeout=short)
        took = time.monotonic() - t0
        if reply.error not in ("WorkerTimeoutError", "TransportError"):
            raise violated("live", f"receiver connect(timeout={short}) without a sender gave "
                                   f"{reply.error or 'success'}, expected WorkerTimeoutError")
        if took > short + SLACK_S:
            raise violated("live", f"receiver connect(timeout={short}) took {took:.1f} s")

    @guarantee("live")
    def test_live_restarted_worker_gets_latest(self, wsync: Context) -> None:
        """A worker that shuts down and comes back gets the latest version at connect (late_join)."""
        wsync.require("late_join")
        s = wsync.session(version_spec(), n=2)
        fill_version(s.model, 1)
        s.check(s.send())
        s.workers[1].call("shutdown").raise_for_error("receiver shutdown()")
        fill_version(s.model, 2)
        s.expected[2] = digests(s.model)
        with s.following([0]):
            exc, _ = send_expect_timeout(s, [1], timeout=wsync.short_timeout)
        if exc.workers != [1]:
            raise violated("live", f"WorkerTimeoutError names {exc.workers}, expected [1]")
        s.workers[1].open(s.scheme, s.spec, wsync.device, 1)
        reply = s.workers[1].call("connect", timeout=wsync.timeout)
        reply.raise_for_error("restarted receiver connect()")
        s.check(2, [1], guarantee="live")
        fill_version(s.model, 3)
        s.check(s.send())

    # == targeted ===================================================================================
    @guarantee("targeted")
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

    # == ordered ====================================================================================
    @guarantee("ordered")
    def test_ordered_sender(self, wsync: Context) -> None:
        """Every out-of-order sender call raises StateError and changes nothing."""
        spec = version_spec()
        workers = wsync.workers(1)
        scheme = wsync.scheme()
        model = build(spec, wsync.sender_device)

        def expect(call: str, fn: Callable[[], Any]) -> None:
            state, version = scheme.state, scheme.version
            try:
                fn()
            except StateError as exc:
                if not str(exc):
                    raise violated("ordered", f"{call}: StateError without a message") from exc
            else:
                raise violated("ordered", f"{call} in state {state!r} did not raise StateError")
            if (scheme.state, scheme.version) != (state, version):
                raise violated("ordered", f"{call} raised but moved the scheme from {state!r} v{version} to "
                                          f"{scheme.state!r} v{scheme.version}")

        expect("send() before init", lambda: scheme.send())
        expect("send_async() before init", lambda: scheme.send_async())
        expect("connect() before init", lambda: scheme.connect(timeout=wsync.short_timeout))
        expect("receive() before init", lambda: scheme.receive())
        scheme.init_on_sender(model=model, num_workers=1)
        expect("send() before connect", lambda: scheme.send())
        expect("receive() on a sender", lambda: scheme.receive())
        expect("init_on_sender() twice", lambda: scheme.init_on_sender(model=model, num_workers=1))
        expect("init_on_receiver() on a sender", lambda: scheme.init_on_receiver(model=model, worker_idx=0))
        s = Session(wsync, spec, workers, scheme=scheme, model=model)
        wsync._closers.append(s.close)
        s.connect()
        expect("connect() twice", lambda: scheme.connect(timeout=wsync.short_timeout))
        expect("init_on_sender() after connect", lambda: scheme.init_on_sender(model=model, num_workers=1))
        expect("receive() on a connected sender", lambda: scheme.receive())
        fill_version(model, 1)
        s.check(s.send(), guarantee="ordered")
        scheme.shutdown()
        scheme.shutdown()  # idempotent
        expect("send() after shutdown", lambda: scheme.send())
        expect("connect() after shutdown", lambda: scheme.connect(timeout=wsync.short_timeout))
        expect("init_on_sender() after shutdown", lambda: scheme.init_on_sender(model=model, num_workers=1))

    @guarantee("ordered")
    def test_ordered_receiver(self, wsync: Context) -> None:
        """Every out-of-order receiver call raises StateError and changes nothing."""
        s = wsync.session(version_spec(), n=1, connect=False)
        w = s.workers[0]
        w.open(s.scheme, s.spec, wsync.device, 0, init=False)

        def expect(call: str, method: str, **kw: Any) -> None:
            reply = w.call(method, **kw)
            if reply.error != "StateError":
                raise violated("ordered", f"receiver {call} gave {reply.error or 'no error'}, expected StateError")

        expect("receive() before init", "receive", timeout=0)
        expect("connect() before init", "connect", timeout=wsync.short_timeout)
        w.call("init_on_receiver").raise_for_error("init_on_receiver()")
        expect("receive() before connect", "receive", timeout=0)
        expect("init_on_receiver() twice", "init_on_receiver")
        expect("init_on_sender() on a receiver", "init_on_sender")
        s.connect()
        expect("connect() twice", "connect", timeout=wsync.short_timeout)
        expect("send() on a receiver", "send")
        expect("init_on_receiver() after connect", "init_on_receiver")
        fill_version(s.model, 1)
        s.check(s.send(), guarantee="ordered")  # still works after every refused call
        w.call("shutdown").raise_for_error("receiver shutdown()")
        expect("receive() after shutdown", "receive", timeout=0)

    # == portable ===================================================================================
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

    # == clean ======================================================================================
    def _lifecycle(self, wsync: Context, workers: list, mid: dict[str, Any] | None = None) -> None:
        s = wsync.session(rich_spec("module", 1), workers=workers)
        s.fill(random_values(s.spec, 1))
        s.check(s.send())
        if mid is not None:
            mid["parent"] = resources.snapshot()
            mid["workers"] = [w.request("resources") for w in s.workers] if wsync.process else []
        for w in s.workers:
            w.call("shutdown").raise_for_error("receiver shutdown()")
        s.scheme.shutdown()
        s.close()

    @guarantee("clean")
    def test_clean_after_shutdown(self, wsync: Context) -> None:
        """After shutdown() on both sides: no thread, file descriptor, child process, shared
        memory segment, listening socket or inproc channel is left behind."""
        workers = wsync.workers(2)
        self._lifecycle(wsync, workers)  # warm-up: lazy initialisation is not a leak
        shm_before = resources.shm_entries()
        before = resources.snapshot()
        worker_before = [w.request("resources") for w in workers] if wsync.process else []
        mid: dict[str, Any] = {}
        self._lifecycle(wsync, workers, mid)
        pool = {w.pid for w in workers}
        found = resources.wait_for_no_leaks(before, resources.snapshot, ignore_children=pool)
        found = [f"sender process: {f}" for f in found]
        for i, (w, b) in enumerate(zip(workers, worker_before)):
            found += [f"receiver process {i}: {f}" for f in resources.wait_for_no_leaks(
                b, lambda w=w: w.request("resources"))]
        used = set(mid["parent"]["shm_mapped"]).union(*(m["shm_mapped"] for m in mid["workers"]))
        found += [f"shared memory segment {p} left in /dev/shm" for p in sorted(resources.shm_entries() - shm_before)
                  if p in used]
        if found:
            raise violated("clean", "after shutdown():\n  " + "\n  ".join(found))

    @guarantee("clean")
    def test_clean_after_receiver_exit(self, wsync: Context) -> None:
        """A receiver process that exits without shutdown(): the sender names it, and after the
        sender's shutdown nothing of either is left behind."""
        wsync.require("processes")
        workers = wsync.workers(2)
        self._lifecycle(wsync, workers)
        shm_before = resources.shm_entries()
        before = resources.snapshot()
        s = wsync.session(version_spec(), workers=workers)
        fill_version(s.model, 1)
        s.check(s.send())
        used = set(resources.snapshot()["shm_mapped"]).union(*(w.request("resources")["shm_mapped"] for w in workers))
        workers[1].send("exit", abrupt=True)
        workers[1].runner.join(30)
        fill_version(s.model, 2)
        s.expected[2] = digests(s.model)
        with s.following([0]):
            exc, _ = send_expect_timeout(s, [1], timeout=wsync.short_timeout)
        if exc.workers != [1]:
            raise violated("live", f"WorkerTimeoutError names {exc.workers}, expected the dead worker [1]")
        s.check(2, [0])
        s.close()
        found = resources.wait_for_no_leaks(before, resources.snapshot, ignore_children={w.pid for w in workers})
        found += [f"shared memory segment {p} left in /dev/shm" for p in sorted(resources.shm_entries() - shm_before)
                  if p in used]
        if found:
            raise violated("clean", "after a receiver died and the sender shut down:\n  " + "\n  ".join(found))

    # == safe =======================================================================================
    @guarantee("safe")
    def test_safe_nothing_unpickled(self, wsync: Context) -> None:
        """No ``pickle.find_class`` happens in a receiver while it connects and receives."""
        s = wsync.session(rich_spec("module", 1), n=2)
        for seed in range(3):
            s.fill(random_values(s.spec, seed))
            s.check(s.send())
        runtime = trusted_runtime(wsync.target.cls)
        for i, w in enumerate(s.workers):
            events = untrusted_unpickling(w.request("audit")["events"], runtime)
            if events:
                raise violated("safe", f"receiver {i} unpickled while receiving: find_class{tuple(events[0])} "
                                       f"and {len(events) - 1} more")

    @guarantee("safe")
    def test_safe_hostile_headers(self, wsync: Context) -> None:
        """Garbage, truncated, pickled, oversized and malformed headers raise TransportError;
        the model is untouched and the receiver keeps working."""
        raw, w, before = _raw_receiver(wsync)
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
            reply = w.call("receive", timeout=min(wsync.timeout, 5.0))
            if reply.error not in ("TransportError",) and not (reply.error is None and reply.get("result") is None):
                raise violated("safe", f"a header of {what}: receive() gave {reply.error or reply.get('result')}, "
                                       f"expected TransportError (or nothing)")
            if w.snapshot()["digests"] != before:
                raise violated("safe", f"a header of {what} changed the receiver's model")
        events = untrusted_unpickling(w.request("audit")["events"], trusted_runtime(wsync.target.cls))
        if events:
            raise violated("safe", f"the receiver unpickled hostile bytes: find_class{tuple(events[0])}")
        fill_version(raw.model, 4)
        raw.publish(raw.header(5), [0])
        for _ in range(3):  # a hostile header still in flight may surface first, as TransportError
            reply = w.call("receive", timeout=wsync.timeout)
            if reply.error != "TransportError":
                break
        if reply.get("result") != 5:
            raise violated("safe", f"after hostile headers a good delivery gave {reply.error or reply.get('result')}: "
                                   f"{reply.get('message', '')}")
        # last: an oversized header (a transport may refuse to carry it, or drop the peer that sent it)
        before = w.snapshot()["digests"]
        fill_version(raw.model, 11)
        try:
            raw.publish(b'{"wsync":1,"pad":"' + b"x" * (MAX_HEADER_BYTES + 16) + b'"}', [0])
        except (TransportError, ValueError):
            return
        reply = w.call("receive", timeout=min(wsync.timeout, 5.0))
        if reply.error not in (None, "TransportError") or reply.get("result") is not None:
            raise violated("safe", f"an oversized header: receive() gave {reply.error or reply.get('result')}, "
                                   f"expected TransportError (or nothing)")
        if w.snapshot()["digests"] != before:
            raise violated("safe", "an oversized header changed the receiver's model")

    @guarantee("safe")
    def test_safe_binds_loopback(self, wsync: Context) -> None:
        """Unless told otherwise, every socket the transport listens on is bound to loopback."""
        s = wsync.session(version_spec(), n=2)
        found = resources.listening_sockets()
        if wsync.process:
            for w in s.workers:
                found += w.request("resources")["listening"]
        public = [a for a in found if not resources.is_loopback(a)]
        runtime = trusted_runtime(wsync.target.cls)
        if public and runtime is not None:
            pytest.skip(f"the sockets listening beyond loopback are the trusted runtime's ({runtime[0]}): "
                        f"{len(public)} found")
        if public:
            raise violated("safe", f"listening on non-loopback addresses by default: {public}")

    # == declared capabilities without a transport-independent test ===============================
    @guarantee("safe")
    def test_auth_declared(self, wsync: Context) -> None:
        """``auth`` can only be checked by the transport's own tests (how a peer authenticates is its own)."""
        wsync.require("auth")
        pytest.skip("auth is declared; how a peer authenticates is transport-specific: the transport's own tests "
                    "must prove it")

    @guarantee("exact")
    def test_multi_host_declared(self, wsync: Context) -> None:
        """``multi_host`` needs a second host; the suite runs on one."""
        wsync.require("multi_host")
        pytest.skip("multi_host is declared; this suite runs on one host (receivers on loopback)")


def _raw_receiver(wsync: Context) -> tuple[RawSender, harness.Worker, dict]:
    """One receiver connected to a raw sender (which can publish anything) and holding its version
    0; returns the sender, the receiver and the receiver's digests."""
    spec = version_spec()
    raw = RawSender(wsync, spec, 1)
    (w,) = wsync.workers(1)
    w.open(WeightSyncScheme(raw.transport, timeout=wsync.timeout), spec, wsync.device, 0)
    w.call_async("connect", timeout=wsync.timeout)
    raw.wait_joined([0])
    fill_version(raw.model, 3)
    raw.publish(raw.header(0), [0])
    w.recv(wsync.timeout + 60).raise_for_error("receiver connect() to a raw sender")
    return raw, w, w.snapshot()["digests"]
