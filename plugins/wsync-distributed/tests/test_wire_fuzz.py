"""Hypothesis feeds hostile JSON and any bytes to the distributed transport's control and event
decoders: each returns a checked value or raises TransportError, never anything else."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_conformance.strategies import HOSTILE_TOKENS, hostile_json
from wsync_core import TransportError
from wsync_distributed.wire import KINDS, Control, decode_control, decode_event, encode_control

bodies = st.one_of(hostile_json(), st.builds(
    lambda token, key: encode_control(Control(kind="data"))[4:].replace(f'"{key}":'.encode(), f'"{key}":'.encode() + token + b",\"_\":", 1),
    st.sampled_from(HOSTILE_TOKENS), st.sampled_from(list("kgnbsf"))))


@settings(max_examples=400, deadline=None)
@given(bodies, st.binary(max_size=32), st.integers(-8, 8))
def test_control_decoder_gives_a_checked_control_or_transport_error(body, header, skew):
    raw = struct.pack(">I", max(0, len(body) + skew)) + body + header
    try:
        ctl, rest = decode_control(raw)
    except TransportError:
        return
    assert ctl.kind in KINDS and ctl.nbytes >= 0 and ctl.bucket > 0 and ctl.seq >= 0


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_event_decoder_gives_an_event_or_transport_error(raw):
    try:
        kind, worker, data = decode_event(raw)
    except TransportError:
        return
    assert worker >= 0 and len(raw) == 5 + len(data)
