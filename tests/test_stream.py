"""Layout.pack_stream: the snapshot written in pieces, each announced once final."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_core.layout import Layout

_DTYPES = [torch.float32, torch.float64, torch.int8, torch.bool, torch.bfloat16]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6), step=st.integers(1, 5000),
       dtypes=st.lists(st.sampled_from(_DTYPES), min_size=6, max_size=6), transpose=st.booleans())
def test_pieces_add_up_to_pack_and_each_prefix_is_final(sizes, step, dtypes, transpose) -> None:
    g = torch.Generator().manual_seed(len(sizes) * 7919 + step)
    tensors = {}
    for i, (n, dtype) in enumerate(zip(sizes, dtypes)):
        t = torch.randint(0, 100, (n,), generator=g).to(dtype)
        tensors[f"t{i}"] = t
    if transpose:  # a non-contiguous source is copied whole
        tensors["m"] = torch.randn(17, 9, generator=g).t()
    layout = Layout.of(tensors)
    expected = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(tensors, expected)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    seen: list[int] = []

    def ready(n: int) -> None:
        assert torch.equal(buffer[:n], expected[:n])
        seen.append(n)

    layout.pack_stream(tensors, buffer, step, ready)
    assert seen and seen[-1] == layout.nbytes and seen == sorted(set(seen))
    assert torch.equal(buffer, expected)
