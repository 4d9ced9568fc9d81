"""``wsync_core.memory``: a private mapping kept across deliveries, cleaned of the pages this process wrote."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from wsync_core.memory import Slot, discard_written, map_private

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and pagemap are Linux's")

PAGES = 64


def _file(value: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("wsync-test-memory")
    os.ftruncate(fd, PAGES * mmap.PAGESIZE)
    shared = mmap.mmap(fd, PAGES * mmap.PAGESIZE)
    shared[:] = bytes([value]) * len(shared)
    return fd, shared


def test_written_pages_read_the_file_again_and_the_others_follow_it() -> None:
    fd, shared = _file(1)
    try:
        private = map_private(fd, 0, PAGES * mmap.PAGESIZE)
        assert torch.all(private == 1)  # every page mapped, none written
        assert discard_written(private) == 0
        written = [0, 1, 2, 17, 40, 63]
        for page in written:
            private[page * mmap.PAGESIZE + 5] = 9  # copy on write: this process's own page now
        shared[:] = bytes([2]) * len(shared)  # the writer's next version
        pages = private.view(PAGES, mmap.PAGESIZE)
        assert [p for p in range(PAGES) if pages[p, 0].item() != 2] == written  # stale: this process's copies
        assert discard_written(private) == len(written)
        assert torch.all(private == 2)
        assert discard_written(private) == 0
    finally:
        shared.close()
        os.close(fd)


def test_without_pagemap_every_page_is_dropped_and_reads_the_file(monkeypatch) -> None:
    """Where /proc/self/pagemap cannot be read, the written pages still go: all of them do."""
    import builtins

    real_open = builtins.open

    def no_pagemap(path, *args, **kwargs):
        if str(path) == "/proc/self/pagemap":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    fd, shared = _file(1)
    try:
        private = map_private(fd, 0, PAGES * mmap.PAGESIZE)
        private[3 * mmap.PAGESIZE] = 9
        shared[:] = bytes([2]) * len(shared)
        monkeypatch.setattr(builtins, "open", no_pagemap)
        assert discard_written(private) == PAGES
        assert torch.all(private == 2)
    finally:
        shared.close()
        os.close(fd)


def _interrupted(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


def test_a_slot_file_cut_short_by_ctrl_c_leaves_no_file_and_no_descriptor(tmp_path, monkeypatch) -> None:
    """A KeyboardInterrupt while a large slot file is allocated (the trainer's Ctrl-C in send(),
    shm) closes and removes the file: the same path can be created again. It left both behind, and
    every later slot of that index failed with 'File exists'."""
    path = str(tmp_path / "slot")
    fds = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "posix_fallocate", _interrupted)
    with pytest.raises(KeyboardInterrupt):
        Slot.file(path, 1 << 20)
    monkeypatch.undo()
    assert not os.path.exists(path) and len(os.listdir("/proc/self/fd")) == fds
    slot = Slot.file(path, 1 << 20)
    assert slot.tensor.numel() == 1 << 20
    slot.close()


def test_a_memfd_slot_cut_short_by_ctrl_c_leaves_no_descriptor(monkeypatch) -> None:
    """A KeyboardInterrupt while a large memfd slot is mapped and filled in (mp) closes its
    descriptor: it kept the memory until the process exited (200 MiB per interrupted send)."""
    fds = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(mmap, "mmap", _interrupted)
    with pytest.raises(KeyboardInterrupt):
        Slot.memfd("wsync-test", 1 << 20)
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == fds
