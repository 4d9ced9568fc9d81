"""The small-update hot path (issue 20): fast header and ack codecs, ``Layout.ready``, and that a
worker's change to its model between two receives is always seen (nothing about the model is
remembered across versions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from core_helpers import bump, connected_pair, make_policy, same
from wsync_core import SchemaMismatchError, TransportError
from wsync_core.layout import Layout
from wsync_core.protocol import CHECKSUM_CHUNK, PROTOCOL, Ack, Header

_INT63 = st.integers(0, (1 << 63) - 1)


def _reference(h: Header, sealed: bool = False) -> bytes:
    """What ``json.dumps`` writes for ``h`` (the encoding before the fast path), ``sealed`` with
    the XXH3-64 of those bytes as a last field ``"h"``."""
    obj = {"wsync": PROTOCOL, "v": h.version, "m": h.model_id, "d": h.digest, "n": h.nbytes, "c": h.checksum}
    if h.session is not None:
        obj["s"] = h.session
    body = json.dumps(obj, separators=(",", ":")).encode()
    if not sealed:
        return body
    return json.dumps({**obj, "h": xxhash.xxh3_64_intdigest(body[:-1])}, separators=(",", ":")).encode()


@st.composite
def _headers(draw: st.DrawFn) -> Header:
    nbytes = draw(st.one_of(st.integers(0, 1 << 40), _INT63))
    sums = None
    if nbytes < 1 << 34 and draw(st.booleans()):
        chunks = max(1, -(-nbytes // CHECKSUM_CHUNK))
        sums = draw(st.lists(st.integers(0, (1 << 64) - 1), min_size=chunks, max_size=chunks))
    session = draw(st.one_of(st.none(), st.text("0123456789abcdef", min_size=1, max_size=32)))
    return Header(draw(_INT63), draw(st.text(max_size=20)), draw(st.text(max_size=40)), nbytes, sums,
                  session=session)


def _same_outcome(data: bytes, decode, checked) -> None:
    """``decode`` and the checked parser agree: the same value, or both raise TransportError."""
    try:
        expected = checked(data)
    except TransportError:
        with pytest.raises(TransportError):
            decode(data)
        return
    assert decode(data) == expected


@given(_headers())
@settings(max_examples=300, deadline=None)
def test_header_fast_encoding_is_the_json_one_and_decodes_to_itself(h: Header) -> None:
    for sealed in (False, True):
        data = h.encode(sealed)
        assert data == _reference(h, sealed)
        if sealed and h.checksum is None:  # a side that checks payloads refuses a header without their sums
            for decode in (Header.decode, Header.decode_checked):
                with pytest.raises(TransportError, match="no checksums of its payload"):
                    decode(data, sealed)
            continue
        assert Header.decode(data, sealed) == Header.decode_checked(data, sealed) == h


@given(_headers(), st.integers(0, 400), st.integers(0, 4), st.binary(max_size=6))
@settings(max_examples=500, deadline=None)
def test_a_damaged_header_decodes_as_the_checked_parser_says(h: Header, at: int, cut: int, put: bytes) -> None:
    data = h.encode()
    at = min(at, len(data))
    _same_outcome(data[:at] + put + data[at + cut:], Header.decode, Header.decode_checked)


@given(st.integers(0, (1 << 70)), st.integers(-(1 << 70), 1 << 70), st.integers(0, 40), st.integers(0, 4),
       st.binary(max_size=4))
@settings(max_examples=500, deadline=None)
def test_acks_encode_as_json_and_damaged_ones_decode_as_the_checked_parser_says(
        worker: int, version: int, at: int, cut: int, put: bytes) -> None:
    data = Ack(worker, version).encode()
    assert data == json.dumps({"wsync": PROTOCOL, "w": worker, "v": version}, separators=(",", ":")).encode()
    _same_outcome(data, Ack.decode, Ack.decode_checked)
    at = min(at, len(data))
    _same_outcome(data[:at] + put + data[at + cut:], Ack.decode, Ack.decode_checked)


@given(st.integers(0, 1 << 20), st.integers(0, 1 << 30), st.text("0123456789abcdef", min_size=1, max_size=32),
       st.data())
@settings(max_examples=300, deadline=None)
def test_a_sealed_header_or_ack_with_any_byte_changed_is_refused_as_damaged(
        version: int, nbytes: int, session: str, data: st.DataObject) -> None:
    """With checksums on, a header and an ack carry their own XXH3-64: any byte changed (a digit of
    the version, a size, a base, a checksum: what still parses, and TCP's own checksum can miss)
    is refused, by the fast path and the checked parser alike. Without it, a digit changed in
    transit named another version, and was believed."""
    chunks = max(1, -(-nbytes // CHECKSUM_CHUNK))
    for good, decode, checked in (
            (Header(version, "policy", "ab" * 16, nbytes, [7] * chunks, session=session).encode(True),
             Header.decode, Header.decode_checked),
            (Header(version + 1, "policy", "ab" * 16, 64, [7], wire="bfloat16", table=[[0, 4, 0]], base=version,
                    session=session).encode(True), Header.decode, Header.decode_checked),
            (Ack(3, version).encode(sealed=True), Ack.decode, Ack.decode_checked),
            (Ack(3, version, "bad", "TransportError").encode(sealed=True), Ack.decode, Ack.decode_checked)):
        assert decode(good, True) == checked(good, True) == decode(good) == checked(good)
        at = data.draw(st.integers(0, len(good) - 1))
        new = data.draw(st.integers(0, 255).filter(lambda b: b != good[at]))
        damaged = good[:at] + bytes([new]) + good[at + 1:]
        with pytest.raises(TransportError):
            decode(damaged, True)
        with pytest.raises(TransportError):
            checked(damaged, True)


def test_a_side_that_checksums_refuses_an_unsealed_header_or_ack_by_name() -> None:
    """Where this side checks checksums, a header or ack without its own (a peer given another
    ``checksum`` option, or a seal's key damaged) is refused, saying so."""
    for data, decode in ((Header(1, "policy", "ab", 10).encode(), Header.decode),
                         (Header(1, "policy", "ab", 10, [7]).encode(), Header.decode),
                         (Header(1, "policy", "ab", 10, wire="bfloat16").encode(), Header.decode),
                         (Ack(0, 1).encode(), Ack.decode), (Ack(0, 1, "bad", "TransportError").encode(), Ack.decode)):
        decode(data)
        with pytest.raises(TransportError, match="no checksum of its own"):
            decode(data, True)


def test_fast_header_refuses_what_the_checked_parser_refuses() -> None:
    good = Header(1, "policy", "ab", 10).encode()
    for bad in (good.replace(b'"v":1', b'"v":01'), good.replace(b'"n":10', b'"n":9223372036854775808'),
                good.replace(b'"c":null', b'"c":[1,2]'), good.replace(b'"c":null', b'"c":[18446744073709551616]'),
                good.replace(b'"wsync":1', b'"wsync":2'), good.replace(b'"c":null', b'"c":null,"s":"ABC"'),
                good.replace(b'"c":null', b'"c":null,"s":""'), good.replace(b'"c":null', b'"c":null,"s":7')):
        with pytest.raises(TransportError):
            Header.decode(bad)


_BAD_TARGETS = {
    "expanded": lambda t: t.reshape(-1)[:1].expand(t.shape) if t.dim() else t,
    "transposed": lambda t: t.t() if t.dim() == 2 else t,
    "inference": lambda t: _inference(t),
    "meta": lambda t: t.to("meta"),
    "dtype": lambda t: t.double(),
    "shape": lambda t: t.reshape(-1)[:-1] if t.numel() > 1 else torch.zeros(2),
}


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


@given(st.sampled_from(sorted(_BAD_TARGETS)), st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_ready_is_true_only_where_every_check_passes(change: str, which: int) -> None:
    tensors = {k: v.detach().clone() for k, v in make_policy(0).state_dict().items()}
    layout = Layout.of(tensors)
    assert layout.ready(tensors)
    key = sorted(tensors)[which % len(tensors)]
    tensors[key] = _BAD_TARGETS[change](tensors[key])
    if layout.ready(tensors):  # then no named check may fail
        layout.check_fits(tensors, mine="a", theirs="b", context="c")
        layout.check_writable(tensors, context="c")
    else:
        assert change == "transposed" or not layout.fits(tensors) or _raises(layout, tensors)


def _raises(layout: Layout, tensors: dict[str, torch.Tensor]) -> bool:
    try:
        layout.check_writable(tensors, context="c")
    except SchemaMismatchError:
        return True
    return False




def _first_weight(m: nn.Module) -> tuple[nn.Module, str]:
    for mod in m.modules():
        if isinstance(getattr(mod, "weight", None), nn.Parameter) and mod.weight.dim() == 2:
            return mod, "weight"
    raise AssertionError("no 2-d weight")


def test_every_change_a_worker_makes_between_receives_is_seen() -> None:
    sender, model, receiver, local = connected_pair(sync=False)
    try:
        mod, name = _first_weight(local)
        steps = [
            lambda: setattr(mod, name, nn.Parameter(getattr(mod, name).detach().clone())),  # replaced
            lambda: local.share_memory(),
            lambda: local.load_state_dict(make_policy(7).state_dict()),
            lambda: setattr(getattr(mod, name), "data", getattr(mod, name).detach().t().clone().t()),  # strided
        ]
        for step in steps:
            step()
            bump(model)
            version = sender.send()
            assert receiver.receive(timeout=30) == version
            assert same(local, model)
        # a weight whose elements share memory cannot take a version in place: refused, nothing written
        before = {k: v.clone() for k, v in local.state_dict().items()}
        with torch.no_grad():
            setattr(mod, name, nn.Parameter(getattr(mod, name).reshape(-1)[:1].expand(getattr(mod, name).shape)))
        bump(model)
        sender.send()
        with pytest.raises(SchemaMismatchError, match="share memory"):
            receiver.receive(timeout=30)
        expanded = next(k for k, v in local.named_parameters() if v is getattr(mod, name))
        for k, v in local.state_dict().items():
            if k != expanded:
                assert torch.equal(v, before[k]), k
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_worker_that_never_uses_tensordict_never_imports_it() -> None:
    """Importing tensordict costs a process about as much as torch (it imports torch._dynamo):
    a worker that syncs a module pays for it only if it made a TensorDict itself, and a TensorDict
    model still works once it did."""
    code = (
        "import sys\n"
        "import torch\n"
        "from wsync_core import WeightSyncScheme\n"
        "from wsync_core.weights import flatten\n"
        "policy = torch.nn.Linear(3, 2)\n"
        "sender = WeightSyncScheme('inproc')\n"
        "sender.init_on_sender(model=policy, num_workers=1)\n"
        "assert sorted(flatten(policy)) == ['bias', 'weight']\n"
        "assert 'tensordict' not in sys.modules, 'imported tensordict'\n"
        "from tensordict import TensorDict\n"
        "td = TensorDict.from_module(policy)\n"
        "assert sorted(flatten(td)) == ['bias', 'weight'] and flatten(td)['weight'].data_ptr() == policy.weight.data_ptr()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
