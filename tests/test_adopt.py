"""Layout.adopt: a receiver's tensors become views of a delivery instead of copies, where they can."""

from __future__ import annotations

import pytest
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


def _packed(src: dict[str, torch.Tensor]) -> tuple[Layout, torch.Tensor]:
    layout = Layout.of(src)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(src, buffer)
    return layout, buffer


def test_tensors_of_the_model_that_share_bytes_go_on_sharing_them() -> None:
    """``weight`` and a buffer ``weight.detach()`` are two tensors of one model over the same bytes:
    re-pointing each at its own part of the payload would cut them apart (a write to one no longer
    seen through the other), so both are copied into."""
    receiver = nn.Linear(3, 3)
    receiver.register_buffer("alias", receiver.weight.detach())
    sender = nn.Linear(3, 3)
    sender.register_buffer("alias", sender.weight.detach())
    layout, buffer = _packed(flatten(sender))
    adopted = layout.adopt(buffer, flatten(receiver, detach=False))
    assert [t.shape for t in adopted] == [receiver.bias.shape]  # the bias alone is re-pointed
    assert receiver.alias.data_ptr() == receiver.weight.data_ptr()
    assert torch.equal(receiver.weight, sender.weight) and torch.equal(receiver.alias, sender.weight)
    with torch.no_grad():
        receiver.weight.fill_(7.0)
    assert torch.all(receiver.alias == 7.0)


def test_a_tied_parameter_with_a_reference_kept_elsewhere_is_copied_into() -> None:
    """A parameter tied under two names counts once: a reference the worker kept besides it still
    holds the storage, so the parameter is copied into and the reference sees the version."""
    tied = nn.Parameter(torch.zeros(4))
    kept = tied.detach()
    src = {"a": torch.arange(4.0), "b": torch.arange(4.0)}
    layout, buffer = _packed(src)
    assert layout.adopt(buffer, {"a": tied, "b": tied}) == []
    assert torch.equal(kept, src["a"]) and kept.data_ptr() == tied.data_ptr()


def test_parameters_packed_in_one_storage_without_overlap_are_adopted() -> None:
    """Parameters made from disjoint parts of one flat tensor that nothing else holds share no byte:
    each is re-pointed (zero-copy kept)."""
    flat = torch.zeros(8)
    params = {"a": nn.Parameter(flat[:4]), "b": nn.Parameter(flat[4:])}
    del flat
    src = {"a": torch.ones(4), "b": torch.full((4,), 2.0)}
    layout, buffer = _packed(src)
    assert len(layout.adopt(buffer, params)) == 2
    assert all(p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for p in params.values())
    assert torch.equal(params["a"], src["a"]) and torch.equal(params["b"], src["b"])


def test_an_adopted_tensor_counts_the_write_so_a_graph_that_saved_it_raises() -> None:
    """Re-pointing ``.data`` does not move a tensor's version counter by itself: a backward pass
    through a graph that saved the old weight (an elementwise product, a conv) would use the new
    values without a word, where a copy into it raises."""
    weight = nn.Parameter(torch.ones(16))
    x = torch.full((16,), 2.0, requires_grad=True)
    loss = (x * weight).sum()  # saves weight itself (nn.Linear saves a view, which is never adopted)
    before = weight._version
    layout, buffer = _packed({"w": torch.full((16,), 3.0)})
    assert layout.adopt(buffer, {"w": weight}) == [weight]
    assert weight._version > before and torch.equal(weight, torch.full((16,), 3.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_target_whose_strides_differ_from_the_payload_keeps_them() -> None:
    """A channels_last conv weight or a transposed parameter is copied into, not re-pointed at the
    payload's row-major bytes: the worker's memory format and strides stay as it built them."""
    conv = nn.Parameter(torch.zeros(4, 3, 2, 2).to(memory_format=torch.channels_last))
    proj = nn.Parameter(torch.zeros(6, 5).t())
    plain = nn.Parameter(torch.zeros(3))
    src = {"conv": torch.randn(4, 3, 2, 2), "proj": torch.randn(5, 6), "plain": torch.randn(3)}
    strides = {"conv": conv.stride(), "proj": proj.stride()}
    layout, buffer = _packed(src)
    assert layout.adopt(buffer, {"conv": conv, "proj": proj, "plain": plain}) == [plain]
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert {"conv": conv.stride(), "proj": proj.stride()} == strides
    for key, t in {"conv": conv, "proj": proj, "plain": plain}.items():
        assert torch.equal(t, src[key]), key


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


@pytest.mark.parametrize("transport", ["shm", "mp"])
def test_a_worker_graph_that_saved_a_weight_raises_after_an_adopted_receive(transport: str) -> None:
    """End to end on transports that adopt (a model of 1.2 MiB): a conv that saved its weight
    before a receive, then backward, raises as docs/api.md promises; a channels_last weight stays so."""
    from core_helpers import bump, connected_pair

    def conv() -> nn.Module:
        return nn.Conv2d(96, 96, 6, bias=False).to(memory_format=torch.channels_last)

    def plain() -> nn.Module:
        return nn.Sequential(nn.Conv2d(64, 64, 9))

    sender, model, receiver, local = connected_pair(transport, plain(), plain(), sync=False)
    try:
        x = torch.randn(1, 64, 9, 9, requires_grad=True)
        loss = local(x).sum()
        bump(model)
        handle = sender.send_async()
        assert receiver.receive(timeout=30) == 1 and handle.wait(30) == 1
        assert torch.equal(local[0].weight, model[0].weight)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    finally:
        receiver.shutdown()
        sender.shutdown()
    sender, model, receiver, local = connected_pair(transport, conv(), conv(), sync=False)
    try:
        bump(model)
        handle = sender.send_async()
        assert receiver.receive(timeout=30) == 1 and handle.wait(30) == 1
        assert torch.equal(local.weight, model.weight)
        assert local.weight.is_contiguous(memory_format=torch.channels_last)
    finally:
        receiver.shutdown()
        sender.shutdown()
