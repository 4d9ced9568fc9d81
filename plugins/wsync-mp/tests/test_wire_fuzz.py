"""Hypothesis feeds any bytes, in any pieces, to the mp frame reader: it yields frames of the
accepted kinds within their limits or raises TransportError, never anything else."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_conformance.strategies import hostile_json
from wsync_core import TransportError
from wsync_core.framing import PREFIX
from wsync_mp.wire import FRAMING, Kind

ACCEPT = frozenset({Kind.NOTIFY, Kind.CLOSE, Kind.PROOF})
frames = st.builds(lambda kind, body, arg, value, flags: PREFIX.pack(FRAMING.magic, kind, flags, arg, len(body), value) + body,
                   st.sampled_from(list(Kind)), st.one_of(st.binary(max_size=64), hostile_json()),
                   st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 255))
pieces = st.lists(st.one_of(st.binary(max_size=64), frames), max_size=8)


@settings(max_examples=400, deadline=None)
@given(pieces)
def test_frame_reader_gives_accepted_frames_or_transport_error(chunks):
    reader = FRAMING.reader("a fuzzing peer", ACCEPT)
    try:
        for chunk in chunks:
            for f in reader.feed(chunk):
                assert f.kind in ACCEPT
    except TransportError:
        pass
