"""The sender's snapshot copy (``Layout.pack``): every tensor's bytes land at its entry's offset,
whatever its dtype, size or view, and the padding between entries stays as it was."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_core.layout import Layout

_DTYPES = [torch.float32, torch.float64, torch.int8, torch.int64, torch.bfloat16, torch.bool, torch.complex64]


def _reference(lay: Layout, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each tensor's bytes at its entry's offset, padding zero, written entry by entry."""
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    for e in lay.entries:
        if e.nbytes:
            Layout.view(buf, e).copy_(tensors[e.key])
    return buf


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=6),
       dtypes=st.lists(st.sampled_from(_DTYPES), min_size=6, max_size=6))
def test_tensors_land_byte_for_byte_at_their_offsets(sizes: list[int], dtypes: list[torch.dtype]) -> None:
    gen = torch.Generator().manual_seed(sum(sizes))
    tensors = {f"t{i}": torch.randint(0, 100, (n,), generator=gen).to(dtypes[i]) for i, n in enumerate(sizes)}
    lay = Layout.of(tensors)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    lay.pack(tensors, buf)
    assert torch.equal(buf, _reference(lay, tensors))


@pytest.mark.parametrize("kind", ["transposed", "conj", "neg", "subclass"])
def test_views_land_as_their_values(kind: str) -> None:
    """A transposed, conjugate or negative view, or a subclass, is packed as its values, not its raw storage."""
    if kind == "transposed":
        t = torch.randn(40, 30).t()
    elif kind == "conj":
        t = torch.randn(50, dtype=torch.complex64).conj()
    elif kind == "neg":
        t = torch.randn(50, dtype=torch.complex64).conj().imag  # a negative view
    else:
        class Sub(torch.Tensor):
            pass
        t = torch.randn(64).as_subclass(Sub)
    plain = t.detach().clone().resolve_conj().resolve_neg().as_subclass(torch.Tensor)
    lay = Layout.of({"w": plain})
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    lay.pack({"w": t}, buf)
    assert torch.equal(buf, _reference(lay, {"w": plain}))


def test_a_source_inside_the_buffer_lands_as_its_values() -> None:
    """A source that is itself a view of the buffer (outside the bytes it is packed to) is copied as its values."""
    buf = torch.zeros(4096 * 64, dtype=torch.uint8)
    buf[4096:8192] = torch.randint(0, 255, (4096,), dtype=torch.uint8)
    t = buf[4096:8192].view(torch.float32)
    plain = t.clone()
    lay = Layout.of({"w": plain})
    lay.pack({"w": t}, buf)
    assert torch.equal(buf[:lay.nbytes], _reference(lay, {"w": plain}))
