"""Hypothesis feeds any bytes, in any pieces, to the shm control channel's frame reader: it
returns frames within the limit or raises TransportError, never anything else."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_conformance.strategies import hostile_json
from wsync_core import TransportError
from wsync_shm.wire import FrameReader, frame

LIMIT = 4096
pieces = st.lists(st.one_of(st.binary(max_size=64), hostile_json(),
                            st.builds(frame, st.sampled_from(b"HAWDRX\x00"), st.binary(max_size=64))), max_size=8)


@settings(max_examples=400, deadline=None)
@given(pieces)
def test_frame_reader_gives_bounded_frames_or_transport_error(chunks):
    reader = FrameReader(LIMIT)
    try:
        for chunk in chunks:
            for kind, body in reader.feed(chunk):
                assert 0 <= kind < 256 and len(body) <= LIMIT
    except TransportError:
        pass
