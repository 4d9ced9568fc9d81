"""Sending less in the core: delta=True, send(keys=...), wire_dtype=, the SendReport figures and
versions_behind (inproc receivers as threads; every transport runs wsync_conformance's DeltaChecks)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from core_helpers import same
from wsync_core import TransportError, WeightSyncScheme
from wsync_core.delta import Mirror, apply_ops, check_indices, decode_table, wire_layout
from wsync_core.layout import Layout
from wsync_core.weights import flatten

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool,
          torch.complex64, torch.complex128, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2]


def model_of(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dtype in enumerate(DTYPES):
        n = 50 + 37 * i
        raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
        out[f"t{i}"] = (raw % 2).bool() if dtype is torch.bool else raw.view(dtype)
    out["empty"] = torch.empty(0)
    out["scalar"] = torch.tensor(1.5)
    out["matrix"] = torch.randn(7, 9, generator=g)
    out["big"] = torch.randn(100, 300, generator=g)
    return out


def scramble(weights: dict[str, torch.Tensor], seed: int, share: float) -> None:
    """New random bits (NaN payloads, -0.0 among them) in about ``share`` of the elements."""
    g = torch.Generator().manual_seed(seed)
    for t in weights.values():
        if not t.numel():
            continue
        flat = t.view(-1) if t.dtype in (torch.bool, torch.int8, torch.uint8) or t.element_size() > 1 else \
            t.view(torch.uint8).view(-1)  # (float8: torch cannot index-assign it)
        mask = torch.rand(flat.shape, generator=g) < share
        size = flat.numel() * flat.element_size()
        fresh = torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8).view(flat.dtype)
        if t.dtype is torch.bool:
            fresh = fresh.view(torch.uint8).bool()
        flat[mask] = fresh[mask]


def cast(weights: dict[str, torch.Tensor], wire: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``weights`` as a worker gets them with ``wire_dtype=wire``: floating tensors wider than it
    through it, the others as they are."""
    if wire is None:
        return weights
    return {k: t.to(wire).to(t.dtype) if t.is_floating_point() and t.element_size() > wire.itemsize else t
            for k, t in weights.items()}


@settings(max_examples=15, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**31), min_size=1, max_size=4),
       shares=st.lists(st.sampled_from([0.0, 0.001, 0.05, 0.6, 1.0]), min_size=4, max_size=4),
       wire=st.sampled_from([None, torch.bfloat16, torch.float16]), base_back=st.integers(1, 3))
@example(seeds=[44557], shares=[0.05, 0.05, 0.05, 0.001], wire=torch.float16, base_back=2)  # a NaN widened two ways
def test_mirror_round_trip_is_bit_exact(seeds, shares, wire, base_back) -> None:
    """A receiver at any kept base applies the mirror's delta and equals the newest version
    (cast through the wire dtype) bit for bit: every dtype, NaN payloads, -0.0 (after a cast, NaN
    as NaN: torch widens a NaN's payload differently in its vectorized and scalar loops)."""
    weights = model_of(seeds[0])
    layout = Layout.of(weights)
    mirror = Mirror(layout, None if wire is None else {torch.bfloat16: "bfloat16", torch.float16: "float16"}[wire],
                    3, torch.device("cpu"))
    mirror.reset(weights, 0)
    held = {0: {k: v.clone() for k, v in cast(weights, wire).items()}}
    for v, (seed, share) in enumerate(zip(seeds * 4, shares), start=1):
        scramble(weights, seed + v, share)
        mirror.update(weights, v, None)
        held[v] = {k: x.clone() for k, x in cast(weights, wire).items()}
    newest = mirror.version
    base = max(0, newest - base_back)
    changes = mirror.since(base)
    if newest - base > 3:
        assert changes is None
        return
    buffer = torch.zeros(layout.nbytes + 64, dtype=torch.uint8)
    encoded = mirror.encode(changes, buffer)
    assert encoded.nbytes == mirror.delta_nbytes(changes)
    payload = buffer[:encoded.nbytes]
    target = {k: x.clone() for k, x in held[base].items()}
    ops = decode_table(encoded.table, layout, mirror.wire, encoded.nbytes, "test")
    apply_ops(ops, check_indices(ops, payload, "test"), payload, target)
    if wire is None:
        assert same(target, held[newest])
    else:  # a NaN's payload after a widening cast depends on torch's path (vectorized or not): NaN stays NaN
        assert same(nan_canonical(target), nan_canonical(held[newest]))


def nan_canonical(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with every floating NaN replaced by the one canonical NaN."""
    return {k: torch.where(t.isnan(), torch.full_like(t, float("nan")), t) if t.is_floating_point() else t
            for k, t in weights.items()}


def test_delta_sends_only_changes_and_stays_exact(cluster) -> None:
    weights = model_of(1)
    c = cluster(n=2, model=weights, make=lambda i: {k: torch.zeros_like(v) for k, v in weights.items()}, delta=True)
    for step in range(4):
        scramble(weights, step, 0.01)
        v = c.sender.send()
        report = c.sender.last_report
        assert sorted(report.delta_workers) == [0, 1]
        assert report.nbytes == report.worker_nbytes[0] < report.full_nbytes / 5
        assert 0 < report.changed < 0.05 and report.diff_s > 0 and report.acks_s is not None
        for r in c.receivers:
            assert r.scheme.version == v and same(r.model, weights)
            assert r.scheme.versions_behind == 0


def test_dense_change_goes_full(cluster) -> None:
    weights = model_of(2)
    c = cluster(n=1, model=weights, make=lambda i: {k: torch.zeros_like(v) for k, v in weights.items()}, delta=True)
    scramble(weights, 5, 1.0)
    c.sender.send()
    report = c.sender.last_report
    assert report.delta_workers == [] and report.nbytes == report.full_nbytes
    assert same(c.receivers[0].model, weights)


def test_worker_beyond_kept_bases_gets_full(cluster) -> None:
    weights = model_of(3)
    c = cluster(n=2, model=weights, make=lambda i: {k: torch.zeros_like(v) for k, v in weights.items()},
                delta=True, delta_bases=2)
    for step in range(3):
        scramble(weights, 10 + step, 0.01)
        c.sender.send(worker_ids=[0])
    scramble(weights, 20, 0.01)
    c.sender.send()
    report = c.sender.last_report
    assert report.delta_workers == [0] and report.worker_nbytes[1] == report.full_nbytes
    assert all(same(r.model, weights) for r in c.receivers)


def test_keys_send_is_previous_version_plus_those_keys(cluster) -> None:
    for delta in (False, True):
        weights = model_of(4)
        c = cluster(n=1, model=weights, make=lambda i: {k: torch.zeros_like(v) for k, v in weights.items()},
                    delta=delta)
        before = {k: v.clone() for k, v in weights.items()}
        scramble(weights, 30, 1.0)
        c.sender.send(keys=["matrix", "t0"])
        expected = {k: (weights[k] if k in ("matrix", "t0") else before[k]) for k in weights}
        assert same(c.receivers[0].model, expected)
        with pytest.raises(ValueError, match="unknown: 'nope'"):
            c.sender.send(keys=["nope"])
        with pytest.raises(ValueError, match="names no key"):
            c.sender.send(keys=[])
        c.stop()


class _Tied(torch.nn.Module):
    """An embedding tied to the output layer, and a buffer that is a slice of a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.out = torch.nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight
        self.big = torch.nn.Parameter(torch.zeros(16))
        self.register_buffer("part", self.big.data[4:10])


@pytest.mark.parametrize("key", ["emb.weight", "out.weight", "part", "big"])
@pytest.mark.parametrize("delta", [False, True])
def test_keys_send_of_one_key_of_memory_shared_sends_every_key_sharing_it(cluster, key: str, delta: bool) -> None:
    """send(keys=[k]) where k shares memory with other keys (a tie, a view): the worker holds the
    trainer's new values under every key, whichever is named (an entry left out wrote its old bytes
    over the new ones: the worker acked the version holding the old tied weights)."""
    torch.manual_seed(0)
    trainer = _Tied()
    c = cluster(n=1, model=trainer, make=lambda i: _Tied(), delta=delta)
    worker = c.receivers[0].model
    for step in (1.0, 2.0):
        with torch.no_grad():
            trainer.emb.weight.fill_(step)
            trainer.big.fill_(10 + step)
        c.sender.send(keys=[key])
        changed = {"emb.weight": "emb", "out.weight": "emb", "part": "big", "big": "big"}[key]
        want = {"emb": trainer.emb.weight, "big": trainer.big}[changed]
        got = {"emb": worker.emb.weight, "big": worker.big}[changed]
        assert torch.equal(got, want), (key, step)
        assert worker.out.weight is worker.emb.weight
        assert torch.equal(worker.part, worker.big.detach()[4:10])


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16, torch.float32])
def test_wire_dtype_is_cast_then_back(cluster, wire) -> None:
    """Floating tensors wider than the wire dtype go through it; the others (float16 under a
    bfloat16 wire, bfloat16 and float8 under a float32 one) travel as they are. A float32 wire
    with a bfloat16 tensor made the sender's connect() fail on a raw RuntimeError, the wire
    layout larger than its buffers."""
    weights = model_of(5)
    c = cluster(n=1, model=weights, make=lambda i: {k: torch.zeros_like(v) for k, v in weights.items()},
                wire_dtype=wire)
    scramble(weights, 40, 1.0)
    c.sender.send()
    assert same(c.receivers[0].model, cast(weights, wire))
    assert c.sender.last_report.nbytes == wire_layout(Layout.of(weights), str(wire).split(".")[1]).nbytes


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="wire_dtype"):
        WeightSyncScheme("inproc", wire_dtype=torch.int8)
    with pytest.raises(ValueError, match="delta_bases"):
        WeightSyncScheme("inproc", delta=True, delta_bases=0)
    with pytest.raises(ValueError, match="delta_dense"):
        WeightSyncScheme("inproc", delta=True, delta_dense=2.0)
    for flag in (1, 0, 1.0, "yes"):  # (1 == True: a number was taken as a flag, where sync=1 is refused)
        with pytest.raises(ValueError, match="delta must be"):
            WeightSyncScheme("inproc", delta=flag)
    with pytest.raises(ValueError, match="delta_dense"):
        WeightSyncScheme("inproc", delta=True, delta_dense=True)


def _two_element_delta():
    """A delta of two elements of ``matrix`` between versions 0 and 1 of ``model_of(6)``:
    (version 1's weights, their layout, the mirror, the payload buffer, the encoding)."""
    weights = model_of(6)
    layout = Layout.of(weights)
    mirror = Mirror(layout, None, 2, torch.device("cpu"))
    mirror.reset(weights, 0)
    weights["matrix"].view(-1)[[1, 5]] += 1
    mirror.update(weights, 1, None)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    enc = mirror.encode(mirror.since(0), buffer)
    return weights, layout, mirror, buffer, enc


def test_damaged_tables_are_refused_before_any_write() -> None:
    _, layout, mirror, buffer, enc = _two_element_delta()
    (i, count, offset), = enc.table
    for table in ([[i, count, offset + 1]], [[i, 0, offset]], [[i, count, enc.nbytes]], [[len(layout), -1, 0]],
                  [[i, count, offset], [i, count, offset]], "x"):
        with pytest.raises(TransportError):
            decode_table(table, layout, mirror.wire, enc.nbytes, "test")
    ops = decode_table(enc.table, layout, mirror.wire, enc.nbytes, "test")
    buffer[offset:offset + 4].view(torch.int32)[0] = 10**6
    with pytest.raises(TransportError, match="out of range"):
        check_indices(ops, buffer, "test")
    buffer[offset:offset + 8].view(torch.int32)[:] = torch.tensor([5, 1], dtype=torch.int32)
    with pytest.raises(TransportError, match="ascending"):
        check_indices(ops, buffer, "test")


def test_indices_checked_are_the_indices_applied() -> None:
    """check_indices hands back copies: a payload written after the check (a faulty transport
    reusing its buffer) cannot move an index out of range before apply_ops uses it (the native
    scatter, which trusts checked indices, wrote out of bounds)."""
    weights, layout, mirror, buffer, enc = _two_element_delta()
    (_, _, offset), = enc.table
    ops = decode_table(enc.table, layout, mirror.wire, enc.nbytes, "test")
    indices = check_indices(ops, buffer, "test")
    buffer[offset:offset + 8].view(torch.int32)[:] = 10**9  # written after the check
    target = {k: v.clone() for k, v in weights.items()}
    target["matrix"].view(-1)[[1, 5]] -= 1
    apply_ops(ops, indices, buffer[:enc.nbytes], target)
    assert same(target, weights)


def test_receiver_missing_the_base_asks_for_full(cluster) -> None:
    """A delta for a base the worker does not hold is not applied; the sender answers the
    BaseMismatch ack with the newest version in full."""
    weights = model_of(7)
    c = cluster(n=1, model=weights, make=lambda i: {k: torch.zeros_like(v) for k, v in weights.items()}, delta=True)
    sender = c.sender._role
    sender._holds[0] = 0
    scramble(weights, 50, 0.01)
    c.sender.send()
    r = c.receivers[0]
    r.scheme._role.version = -5  # pretend: a restarted worker the sender has not heard from yet
    with c.sender._lock:
        sender._holds[0] = 1
    scramble(weights, 51, 0.01)
    c.sender.send()
    assert same(r.model, weights) and r.scheme.version == 2
    assert not r.errors


def test_a_worker_that_wrote_its_model_gets_the_newest_version_in_full(cluster) -> None:
    """A delta would keep what a worker wrote into its model (a BatchNorm in train mode, a local
    step) wherever the trainer changed nothing: such a worker applies none, and the sender answers
    its BaseMismatch ack with the newest version in full. Workers that did not write take deltas."""
    weights = model_of(8)
    c = cluster(n=2, model=weights, make=lambda i: {k: torch.zeros_like(v) for k, v in weights.items()}, delta=True)
    scramble(weights, 60, 0.01)
    c.sender.send()
    writer = c.receivers[0]
    swap = lambda m: setattr(m["big"], "data", m["big"].detach() + 1.0)  # noqa: E731 (what vector_to_parameters does)
    for step, write in enumerate([lambda m: m["big"].add_(1.0), lambda m: m["matrix"][3].zero_(), swap]):
        writer.pause()
        write(writer.model)  # in place, between two receives
        writer.resume()
        scramble(weights, 61 + step, 0.01)
        v = c.sender.send()  # a delta to both; the writer refuses it and gets version v in full
        assert all(r.scheme.version == v and same(r.model, weights) for r in c.receivers)
        assert not writer.errors
        report = c.sender.last_report  # what each worker got on the wire
        assert report.delta_workers == [1] and report.worker_nbytes[0] == report.full_nbytes == report.nbytes
        assert report.worker_nbytes[1] < report.full_nbytes
    scramble(weights, 70, 0.01)
    c.sender.send()  # nothing written since: a delta again
    assert c.sender.last_report.delta_workers == [0, 1]
    assert all(same(r.model, weights) for r in c.receivers)


def test_flatten_of_sender_is_untouched() -> None:
    """The mirror never aliases the trainer's tensors."""
    weights = model_of(8)
    mirror = Mirror(Layout.of(weights), None, 2, torch.device("cpu"))
    mirror.reset(weights, 0)
    before = {k: v.clone() for k, v in weights.items()}
    mirror.buffer.fill_(7)
    assert same(flatten(weights), before)


def test_costs_probe_then_choose() -> None:
    """A slow-enough delta, then a probe, then full once 1.2x a probe beats every delta; a losing
    probe is repeated, up to three."""
    from wsync_core.delta import Costs

    assert Costs(1 << 20).next_send() == "delta"
    small = Costs(1 << 20)
    small.record("delta", 0.080, 0.060)
    assert small.next_send() == "delta"  # a small model is never switched
    fast = Costs(1 << 30)
    fast.record("delta", 0.010, 0.001)
    assert fast.next_send() == "delta"  # a comparison under 5 ms is never replaced
    for probe_s, expected in ((0.010, "full"), (0.070, "probe")):
        c = Costs(1 << 30)
        assert c.next_send() == "delta"
        c.record("delta", 0.080, 0.060)
        assert c.next_send() == "probe"
        assert c.next_send() == "delta"  # the probe's ack is not in yet
        c.record("probe", probe_s, 0.0)
        assert c.next_send() == expected  # a losing probe is tried again
    slow_once = Costs(1 << 30)  # one probe slowed by a busy moment does not decide
    slow_once.record("delta", 0.080, 0.060)
    for probe_s in (0.070, 0.010):
        assert slow_once.next_send() == "probe"
        slow_once.record("probe", probe_s, 0.0)
    assert slow_once.next_send() == "full"
    losing = Costs(1 << 30)  # deltas go on for good after three losing probes
    losing.record("delta", 0.080, 0.060)
    for _ in range(3):
        assert losing.next_send() == "probe"
        losing.record("probe", 0.070, 0.0)
    assert [losing.next_send() for _ in range(3)] == ["delta"] * 3


@pytest.mark.parametrize("margin,full_after", [(0.0, True), (1e9, False)])
def test_full_when_cheaper_stays_exact(cluster, monkeypatch, margin, full_after) -> None:
    """delta=True: after a delta a probe goes full; then full sends (the copy freed) or deltas,
    as the times say; every version arrives exact, send(keys=...) too."""
    from wsync_core import delta as delta_module

    monkeypatch.setattr(delta_module, "_PROBE_DIFF_S", 0.0)
    monkeypatch.setattr(delta_module, "_PROBE_MIN_BYTES", 0)
    monkeypatch.setattr(delta_module, "_MARGIN", margin)
    weights = model_of(6)
    c = cluster(n=2, model=weights, make=lambda i: {k: torch.zeros_like(v) for k, v in weights.items()}, delta=True)
    kinds = []
    for step in range(5):
        scramble(weights, 40 + step, 0.01)
        c.sender.send()
        report = c.sender.last_report
        kinds.append("delta" if report.delta_workers else "full")
        assert all(same(r.model, weights) for r in c.receivers)
    # the probe (full) wins at once, or loses three times (three full sends) before deltas go on
    assert kinds == ["delta", "full"] + (["full"] * 3 if full_after else ["full", "full", "delta"])
    assert (c.sender._role.mirror is None) == full_after
    scramble(weights, 50, 1.0)
    c.sender.send(keys=["matrix"])
    assert all(torch.equal(r.model["matrix"], weights["matrix"]) for r in c.receivers)


def test_delta_always_never_probes(cluster, monkeypatch) -> None:
    from wsync_core import delta as delta_module

    monkeypatch.setattr(delta_module, "_PROBE_DIFF_S", 0.0)
    monkeypatch.setattr(delta_module, "_PROBE_MIN_BYTES", 0)
    weights = model_of(7)
    c = cluster(n=1, model=weights, make=lambda i: {k: torch.zeros_like(v) for k, v in weights.items()},
                delta="always")
    for step in range(4):
        scramble(weights, 60 + step, 0.01)
        c.sender.send()
        assert c.sender.last_report.delta_workers == [0]
        assert same(c.receivers[0].model, weights)
