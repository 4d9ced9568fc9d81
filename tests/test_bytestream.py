"""The byte-stream base's framing: what is written reads back; anything else is a Violation,
checked before a byte of it is allocated (wsync-tcp and wsync-unix test the rest with real sockets)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES
from wsync_core.stream import Kind, Violation, _Reader, frame

ALL = frozenset(range(1, 9))


def reader_over(data: bytes, payload_max: int, sizes: list[int]):
    """A reader of ``data`` (in chunks of at most 7 bytes) whose sink records what it is asked for."""
    pos = 0

    def read_into(view: memoryview) -> int:
        nonlocal pos
        n = min(len(view), 7, len(data) - pos)
        if n == 0:
            raise EOFError  # end of the test's bytes
        view[:n] = data[pos:pos + n]
        pos += n
        return n

    def sink(size: int) -> torch.Tensor:
        sizes.append(size)
        return torch.empty(size, dtype=torch.uint8)

    reader = _Reader(payload_max, sink)
    reader.accept = ALL
    return reader, read_into


def read_all(data: bytes, payload_max: int, sizes: list[int]) -> list:
    reader, read_into = reader_over(data, payload_max, sizes)
    frames = []
    while True:
        try:
            _, got = reader.read(read_into)
        except EOFError:
            return frames
        if got is not None:
            frames.append(got)


@given(header=st.binary(max_size=300), payload=st.binary(max_size=300), ack=st.binary(max_size=300),
       worker=st.integers(0, 0xFFFF))
def test_frames_read_back(header: bytes, payload: bytes, ack: bytes, worker: int) -> None:
    data = (frame(Kind.HELLO, a=worker, b=len(payload)) + frame(Kind.DELIVER, header, len(header), len(payload))
            + payload + frame(Kind.ACK, ack) + frame(Kind.PING) + frame(Kind.BYE, b"reason"))
    frames = read_all(data, len(payload), [])
    assert [f.kind for f in frames] == [Kind.HELLO, Kind.DELIVER, Kind.ACK, Kind.PING, Kind.BYE]
    assert (frames[0].a, frames[0].b) == (worker, len(payload))
    assert frames[1].body == header
    assert (bytes(frames[1].payload.numpy()) if payload else frames[1].payload) == (payload or None)
    assert frames[2].body == ack and frames[4].body == b"reason"


@settings(max_examples=300)
@given(data=st.binary(min_size=16, max_size=200), payload_max=st.integers(0, 64))
def test_garbage_is_a_violation_and_never_allocates_past_the_limits(data: bytes, payload_max: int) -> None:
    sizes: list[int] = []
    try:
        read_all(data, payload_max, sizes)
    except Violation:
        pass
    assert all(s <= payload_max for s in sizes)


def test_sizes_over_the_limits_are_refused_from_the_prefix_alone() -> None:
    for data in (frame(Kind.DELIVER, a=MAX_HEADER_BYTES + 1, b=0), frame(Kind.DELIVER, a=0, b=11),
                 frame(Kind.ACK, a=MAX_ACK_BYTES + 1), frame(Kind.CHALLENGE, a=31), frame(99),
                 b"XX" + frame(Kind.PING)[2:]):
        try:
            read_all(data, 10, [])
        except Violation:
            continue
        raise AssertionError(f"{data[:16]!r} was accepted")
    reader, read_into = reader_over(frame(Kind.ACK, b"x"), 0, [])
    reader.accept = frozenset({Kind.HELLO})  # out of turn
    try:
        reader.read(read_into)
        reader.read(read_into)
        reader.read(read_into)
    except Violation:
        return
    raise AssertionError("an ack out of turn was accepted")
