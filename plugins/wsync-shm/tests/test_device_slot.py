"""Device slots (a GPU sender's snapshots, opened by workers through CUDA IPC) without a GPU: the
handle record's encoding and its bounds, and a worker whose torch has no CUDA. The GPU path itself
runs in ``test_cuda.py`` and in the suite with ``--wsync-device cuda``."""

from __future__ import annotations

import os
import struct
import uuid

import pytest
import torch

from wsync_core import TransportError
from wsync_shm.slot import HEAD, RECORD_BYTES, SHM_DIR, Slot, decode_handle, encode_handle

#: what ``UntypedStorage._share_cuda_()`` gives: device, handle, bytes, offset, ref counter name,
#: its offset, event handle, whether the event must be waited on
SHARED = (0, b"h" * 66, 4096, 512, b"/torch_123_456_0", 7, b"e" * 64, True)


def test_a_handle_record_round_trips() -> None:
    assert decode_handle(encode_handle(SHARED)) == SHARED
    no_event = SHARED[:6] + (b"", False)
    assert decode_handle(encode_handle(no_event)) == no_event


@pytest.mark.parametrize("damage", ["short", "truncated", "trailing", "empty", "device", "no-handle"])
def test_a_malformed_handle_record_is_refused_naming_it(damage: str) -> None:
    record = encode_handle(SHARED)
    if damage == "short":
        record = record[:10]
    elif damage == "truncated":
        record = record[:-5]
    elif damage == "trailing":
        record += b"x"
    elif damage == "empty":
        record = encode_handle((0, b"h" * 66, 0, 0, b"/r", 0, b"", False))  # a storage of no bytes
    elif damage == "device":
        record = struct.pack("<i", 5000) + record[4:]
    elif damage == "no-handle":
        record = encode_handle((0, b"", 4096, 0, b"/r", 0, None, False))
    with pytest.raises(TransportError, match="handle record"):
        decode_handle(record)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a worker without CUDA")
def test_a_worker_without_cuda_is_told_how_to_stage_in_host_memory() -> None:
    path = f"{SHM_DIR}/wsync-test-{uuid.uuid4().hex[:12]}-0"
    record = encode_handle(SHARED)
    with open(path, "wb") as f:  # what a GPU sender's slot file holds
        f.write(struct.pack("<QII", 1, 1, len(record)).ljust(HEAD, b"\0") + record.ljust(RECORD_BYTES, b"\0"))
    try:
        with pytest.raises(TransportError, match="leave the sender's cuda_ipc off"):
            Slot.open(path)
    finally:
        os.unlink(path)


def test_a_cpu_sender_keeps_host_slots(tmp_path) -> None:
    path = f"{SHM_DIR}/wsync-test-{uuid.uuid4().hex[:12]}-0"
    slot = Slot.create(path, 4096, torch.device("cpu"))
    try:
        assert not slot.on_device and slot.payload.numel() == 4096
        reader = Slot.open(path)
        assert not reader.on_device and reader.payload.numel() == 4096
        reader.close()
    finally:
        slot.unlink()
        slot.close()
