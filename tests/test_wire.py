"""Layouts, headers and acks: what crosses between processes is checked field by field."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_core import SchemaMismatchError, TransportError, WorkerTimeoutError
from wsync_core.layout import ALIGN, Layout
from wsync_core.protocol import Ack, Header


def test_layout_is_sorted_aligned_and_order_independent():
    a = Layout.of({"b": torch.zeros(3), "a": torch.zeros(2, dtype=torch.int8)})
    b = Layout.of({"a": torch.zeros(2, dtype=torch.int8), "b": torch.zeros(3)})
    assert a == b and a.digest == b.digest
    assert [e.key for e in a.entries] == ["a", "b"]
    assert all(e.offset % ALIGN == 0 for e in a.entries) and a.nbytes % ALIGN == 0
    assert Layout.from_wire(__import__("json").loads(a.to_json())) == a


def test_layout_differences_name_keys_shapes_dtypes():
    mine = Layout.of({"w": torch.zeros(2, 3), "b": torch.zeros(3), "only_mine": torch.zeros(1)})
    theirs = Layout.of({"w": torch.zeros(3, 2), "b": torch.zeros(3, dtype=torch.float16), "only_theirs": torch.zeros(1)})
    with pytest.raises(SchemaMismatchError) as info:
        mine.check_matches(theirs)
    msg = str(info.value)
    for part in ("'only_mine'", "'only_theirs'", "'w': shape [2, 3] on the sender, [3, 2] on the receiver",
                 "'b': dtype float32 on the sender, float16 on the receiver"):
        assert part in msg


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
                    max_leaves=12))
@settings(max_examples=200, deadline=None)
def test_malformed_layouts_raise_value_error(raw):
    try:
        Layout.from_wire(raw)
    except ValueError:
        pass


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_garbage_headers_and_acks_raise_transport_error(data):
    for decode in (Header.decode, Ack.decode):
        try:
            decode(data)
        except TransportError:
            pass


@given(st.dictionaries(st.sampled_from(["wsync", "v", "m", "d", "n", "c", "l", "w", "e", "t"]),
                       st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3) | st.lists(st.integers(), max_size=2)))
@settings(max_examples=300, deadline=None)
def test_wrongly_typed_fields_raise_transport_error(obj):
    import json

    data = json.dumps(obj).encode()
    for decode in (Header.decode, Ack.decode):
        try:
            decoded = decode(data)
        except TransportError:
            continue
        if isinstance(decoded, Header):
            assert isinstance(decoded.version, int) and decoded.version >= 0 and isinstance(decoded.digest, str)


def test_oversized_ack_is_refused_before_parsing():
    with pytest.raises(TransportError, match="exceeds"):
        Ack.decode(b"{" + b" " * (1 << 20) + b"}")


def test_header_roundtrip_and_worker_timeout_pickles():
    h = Header(3, "policy", "abc", 128, [42])
    assert Header.decode(h.encode()) == h
    big = torch.randint(0, 255, (3 * (16 << 20) + 5,), dtype=torch.uint8)
    import xxhash
    from wsync_core.protocol import checksum
    sums = checksum(big)
    assert len(sums) == 4 and sums[-1] == xxhash.xxh3_64_intdigest(big[3 * (16 << 20):].numpy().tobytes())
    e = pickle.loads(pickle.dumps(WorkerTimeoutError("late", [2, 1])))
    assert e.workers == [1, 2] and str(e) == "late"


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([0, 1, 4095, 1 << 20, (1 << 24) - 1, 1 << 24, (1 << 24) + 1, (2 << 24) + 4097]),
       st.lists(st.integers(1, 6 << 20), max_size=40))
def test_chunk_hasher_fed_piece_by_piece_gives_the_checksum(nbytes, steps):
    """However a payload is fed to ChunkHasher (the sender hashes each piece right after packing
    it), its sums are exactly ``checksum``'s, which the receiver checks against."""
    from wsync_core.protocol import ChunkHasher, checksum
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    hasher = ChunkHasher(data)
    done = 0
    for step in steps:
        done = min(nbytes, done + step)
        hasher.update(done)
    if done < nbytes:
        with pytest.raises(ValueError):
            hasher.sums()
        hasher.update(nbytes)
    with pytest.raises(ValueError):
        hasher.update(nbytes + 1)
    assert hasher.sums() == checksum(data)


def test_sender_hashes_a_large_snapshot_while_packing_with_the_same_sums(monkeypatch):
    """A checksummed CPU snapshot of at least one checksum chunk is hashed piece by piece as it is
    packed (not in a pass of its own); the header carries the sums of the whole payload, and a
    worker checks and applies it."""
    import threading

    import wsync_core.sender as sender_module
    from wsync_core import WeightSyncScheme
    from wsync_core.protocol import CHECKSUM_CHUNK, ChunkHasher, checksum

    fed: list[int] = []

    class Spy(ChunkHasher):
        def update(self, n: int) -> None:
            fed.append(n)
            super().update(n)

    monkeypatch.setattr(sender_module, "ChunkHasher", Spy)
    weights = {"a": torch.rand(CHECKSUM_CHUNK // 4 + 3), "b": torch.rand(1000)}
    scheme = WeightSyncScheme("inproc", checksum=True, timeout=30.0)
    scheme.init_on_sender(weights=weights, num_workers=1)
    receiver = pickle.loads(pickle.dumps(scheme))
    local = {k: torch.zeros_like(v) for k, v in weights.items()}
    receiver.init_on_receiver(model=local, worker_idx=0)
    thread = threading.Thread(target=receiver.connect)
    thread.start()
    try:
        scheme.connect()
        thread.join(30)
        buffer, header = scheme._role._latest
        assert header.checksum == checksum(buffer.tensor) and len(header.checksum) == 2
        assert len(fed) > 4 and fed == sorted(fed) and fed[-1] == buffer.tensor.numel()  # in pieces, as packed
        assert all(torch.equal(local[k], weights[k]) for k in weights)
    finally:
        thread.join(30)
        receiver.shutdown()
        scheme.shutdown()
