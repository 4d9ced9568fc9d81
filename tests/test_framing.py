"""The control-channel frames of the shared-memory transports (``wsync_core.framing``): any
chunking reassembles the same frames; magic, kind and size are checked before a body is kept;
any bytes at all give bounded frames or TransportError, never anything else."""

from __future__ import annotations

import enum

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_conformance.strategies import hostile_json
from wsync_core import TransportError
from wsync_core.framing import PREFIX, Frame, Framing


class Kind(enum.IntEnum):
    SMALL = 1
    BIG = 2


LIMITS = {Kind.SMALL: 8, Kind.BIG: 300}
FRAMING = Framing(b"TEST", LIMITS)


@settings(max_examples=50, deadline=None)
@given(frames=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.binary(max_size=300)),
                       max_size=8),
       cuts=st.lists(st.integers(1, 64), min_size=1))
def test_frames_survive_any_chunking(frames: list[tuple[int, int, bytes]], cuts: list[int]) -> None:
    stream = b"".join(FRAMING.encode(Kind.BIG, body, arg=arg, value=value) for arg, value, body in frames)
    reader, got, pos, i = FRAMING.reader("peer"), [], 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        got += reader.feed(stream[pos:pos + step])
        pos, i = pos + step, i + 1
    assert got == [Frame(Kind.BIG, 0, arg, value, body) for arg, value, body in frames]


def test_a_body_over_its_kinds_limit_is_refused_before_it_is_kept() -> None:
    prefix = PREFIX.pack(b"TEST", Kind.SMALL, 0, 0, 9, 0)  # the body never comes
    with pytest.raises(TransportError, match="SMALL frame of 9 bytes, the limit is 8"):
        list(FRAMING.reader("peer").feed(prefix))
    with pytest.raises(ValueError, match="limit"):
        FRAMING.encode(Kind.SMALL, b"x" * 9)


def test_unexpected_kinds_and_foreign_magic_are_named() -> None:
    with pytest.raises(TransportError, match=r"kind 1, expected one of \['BIG'\]"):
        list(FRAMING.reader("peer", accept=[Kind.BIG]).feed(FRAMING.encode(Kind.SMALL)))
    with pytest.raises(TransportError, match="expected b'TEST'"):
        list(FRAMING.reader("peer").feed(Framing(b"ELSE", LIMITS).encode(Kind.SMALL)))
    with pytest.raises(ValueError, match="out of range"):
        FRAMING.encode(Kind.SMALL, arg=2**32)


pieces = st.lists(st.one_of(st.binary(max_size=64), hostile_json(),
                            st.builds(lambda k, b: PREFIX.pack(b"TEST", k, 0, 0, len(b), 0) + b,
                                      st.integers(0, 255), st.binary(max_size=64))), max_size=8)


@settings(max_examples=250, deadline=None)
@given(pieces)
def test_any_bytes_give_bounded_frames_or_transport_error(chunks: list[bytes]) -> None:
    reader = FRAMING.reader("peer")
    try:
        for chunk in chunks:
            for frame in reader.feed(chunk):
                assert frame.kind in LIMITS and len(frame.body) <= LIMITS[frame.kind]
    except TransportError:
        pass
