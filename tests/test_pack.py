"""The sender's snapshot copy (``Layout.pack``): plain CPU tensors go through ``memory.copy_pieces``
(memmove on threads that block when done, not torch's spinning OpenMP pool) and land byte for byte
where ``copy_`` would put them; everything else still goes through ``copy_``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_core import layout as layout_mod
from wsync_core import memory
from wsync_core.layout import Layout

_DTYPES = [torch.float32, torch.float64, torch.int8, torch.int64, torch.bfloat16, torch.bool, torch.complex64]


def _reference(lay: Layout, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """What torch's own copy writes: each tensor's bytes at its entry's offset, padding zero."""
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    for e in lay.entries:
        if e.nbytes:
            Layout.view(buf, e).copy_(tensors[e.key])
    return buf


def _forbid_torch_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("pack used torch's copy for plain CPU tensors")

    monkeypatch.setattr(layout_mod, "_copy_all", fail)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=6),
       dtypes=st.lists(st.sampled_from(_DTYPES), min_size=6, max_size=6),
       threads=st.integers(1, 4))
def test_plain_cpu_tensors_are_copied_byte_for_byte_without_torch_copy(sizes: list[int], dtypes: list[torch.dtype],
                                                                        threads: int) -> None:
    gen = torch.Generator().manual_seed(sum(sizes))
    tensors = {f"t{i}": torch.randint(0, 100, (n,), generator=gen).to(dtypes[i]) for i, n in enumerate(sizes)}
    lay = Layout.of(tensors)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    pieces = layout_mod._raw_pieces(lay._filled, [tensors[e.key] for e in lay._filled], buf)
    assert pieces is not None
    memory.copy_pieces(pieces, threads)
    assert torch.equal(buf, _reference(lay, tensors))


def test_a_large_model_is_split_over_threads_and_never_uses_torch_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {"a": torch.randn(3_000_000), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(1_000, 2_000)}
    lay = Layout.of(tensors)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    _forbid_torch_copy(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        lay.pack(tensors, buf)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(buf, _reference(lay, tensors))


@pytest.mark.parametrize("kind", ["transposed", "conj", "neg", "overlaps buffer", "subclass"])
def test_what_a_byte_copy_would_get_wrong_goes_through_copy(kind: str) -> None:
    buf = torch.zeros(4096 * 64, dtype=torch.uint8)
    if kind == "transposed":
        t = torch.randn(40, 30).t()
    elif kind == "conj":
        t = torch.randn(50, dtype=torch.complex64).conj()
    elif kind == "neg":
        t = torch.randn(50, dtype=torch.complex64).conj().imag  # a negative view
    elif kind == "overlaps buffer":
        t = buf[4096:8192].view(torch.float32)
    else:
        class Sub(torch.Tensor):
            pass
        t = torch.randn(64).as_subclass(Sub)
    tensors = {"w": t}
    lay = Layout.of({"w": t.detach().clone().as_subclass(torch.Tensor)})
    assert layout_mod._raw_pieces(lay._filled, [t], buf) is None
    expected = _reference(lay, {"w": t.clone().as_subclass(torch.Tensor)})
    lay.pack(tensors, buf)
    assert torch.equal(buf[:lay.nbytes], expected)


def test_a_small_model_keeps_torch_s_fused_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``memory.PARALLEL_MIN_BYTES`` the payload goes through one fused ``copy_`` call: checking
    and copying 200 tensors one by one in Python cost 2.7x as much (a 10 KiB model's send)."""
    tensors = {f"t{i:03d}": torch.randn(12) for i in range(200)}
    lay = Layout.of(tensors)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)

    def fail(*_: object) -> None:
        raise AssertionError("pack copied a small model tensor by tensor")

    monkeypatch.setattr(layout_mod, "copy_pieces", fail)
    lay.pack(tensors, buf)
    assert torch.equal(buf, _reference(lay, tensors))
