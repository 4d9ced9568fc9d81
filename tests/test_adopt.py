"""Layout.adopt: a receiver's tensors become views of a delivery instead of copies, where they can."""

from __future__ import annotations

import torch
from torch import nn

from wsync_core.layout import Layout
from wsync_core.weights import flatten


def test_parameters_and_buffers_are_adopted_views_are_copied() -> None:
    sender, receiver = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    base = torch.zeros(6)
    receiver.register_buffer("part", base[:3])  # a view of another tensor: swapping it would cut the tie
    sender.register_buffer("part", torch.zeros(3))
    with torch.no_grad():
        for i, t in enumerate(flatten(sender).values()):
            t.fill_(i + 1)
    layout = Layout.of(flatten(sender))
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(flatten(sender), buffer)
    weight = receiver.weight
    adopted = layout.adopt(buffer, flatten(receiver, detach=False))
    assert receiver.weight is weight and weight.requires_grad  # the same Parameter, now a view
    assert weight.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert receiver.part._base is base and torch.equal(base[:3], sender.part)  # copied, tie kept
    assert all(t is not receiver.part for t in adopted)
    for key, t in flatten(sender).items():
        assert torch.equal(flatten(receiver)[key], t), key


def test_nothing_on_another_device_or_of_a_subclass_is_adopted() -> None:
    class Marked(torch.Tensor):
        pass

    src = {"a": torch.ones(4), "b": torch.full((2,), 2.0)}
    layout = Layout.of(src)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(src, buffer)
    dst = {"a": torch.zeros(4).as_subclass(Marked), "b": torch.zeros(2)}
    adopted = layout.adopt(buffer, dst)
    assert len(adopted) == 1 and adopted[0] is dst["b"]
    assert torch.equal(dst["a"].as_subclass(torch.Tensor), src["a"]) and torch.equal(dst["b"], src["b"])


def test_memory_shared_on_purpose_is_copied_into_not_replaced() -> None:
    src = {"shared": torch.ones(4), "plain": torch.full((2,), 2.0)}
    layout = Layout.of(src)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(src, buffer)
    dst = {"shared": torch.zeros(4).share_memory_(), "plain": torch.zeros(2)}
    before = dst["shared"].data_ptr()
    adopted = layout.adopt(buffer, dst)
    assert len(adopted) == 1 and adopted[0] is dst["plain"]
    assert dst["shared"].data_ptr() == before and dst["shared"].is_shared()  # other processes still see it
    assert torch.equal(dst["shared"], src["shared"])


def test_module_walk_lists_what_named_parameters_and_buffers_list() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.BatchNorm1d(3), nn.Sequential(shared, nn.Linear(3, 2, bias=False)))
    model[1].register_buffer("scratch", torch.zeros(1), persistent=False)
    model.register_parameter("nothing", None)
    tied = nn.Module()
    tied.a, tied.b = nn.Linear(2, 2), nn.Linear(2, 2)
    tied.b.weight = tied.a.weight
    for m in (model, tied, nn.Linear(1, 1)):
        expected = dict(m.named_parameters(remove_duplicate=False))
        expected.update(m.named_buffers(remove_duplicate=False))
        got = flatten(m, detach=False)
        assert list(got) == list(expected)
        assert all(got[k] is v for k, v in expected.items())
