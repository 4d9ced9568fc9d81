"""Extra state (``get_extra_state``, e.g. TorchRL's VecNorm statistics or a seeded actor's
counters) travels beside the weights as tensors, never pickled, and lands through
``set_extra_state``."""

from __future__ import annotations

import enum
import time
import types

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from core_helpers import connected_pair
from wsync_core import WeightSyncScheme, WsyncError
from wsync_core.weights import flatten


class Stats(nn.Module):
    """A layer with running statistics (tensors) and a counter (a number) as extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.loc = torch.zeros(3)
        self.count = 0
        self.rate = 0.5

    def get_extra_state(self):
        return {"loc": self.loc, "count": self.count, "rate": self.rate}

    def set_extra_state(self, state):
        self.loc, self.count, self.rate = state["loc"], state["count"], state["rate"]


class Opaque(nn.Module):
    def get_extra_state(self):
        return object()


def test_flatten_carries_extra_state_as_tensors():
    m = nn.Sequential(nn.Linear(2, 2), Stats())
    flat = flatten(m)
    assert {"1._extra_state.loc", "1._extra_state.count", "1._extra_state.rate"} <= flat.keys()
    assert flat["1._extra_state.count"].dtype == torch.int64
    assert flat["1._extra_state.rate"].dtype == torch.float64
    with pytest.raises(TypeError, match="never pickled"):
        flatten(nn.Sequential(Opaque()))


@pytest.mark.parametrize("strategy, transport", [("tensordict", "inproc"), ("state_dict", "inproc"),
                                                 ("tensordict", "shm")])
def test_extra_state_reaches_the_receiver_exactly(strategy, transport):
    sender, trainer, receiver, worker = connected_pair(transport, model=nn.Sequential(nn.Linear(2, 2), Stats()),
                                                       local=nn.Sequential(nn.Linear(2, 2), Stats()),
                                                       strategy=strategy)
    try:
        stats = trainer[1]
        stats.loc = torch.tensor([1.0, 2.0, 3.0])
        stats.count, stats.rate = 7, 0.25
        sender.send_async()
        assert receiver.wait_for_version(1, timeout=30) == 1
        assert torch.equal(worker[1].loc, stats.loc) and worker[1].loc is not stats.loc
        assert worker[1].count == 7 and isinstance(worker[1].count, int)
        assert worker[1].rate == 0.25 and isinstance(worker[1].rate, float)
        stats.loc.add_(1)  # isolation: the trainer's later in-place write stays there
        assert torch.equal(worker[1].loc, torch.tensor([1.0, 2.0, 3.0]))
    finally:
        receiver.shutdown()
        sender.shutdown()


class Phase(enum.IntEnum):
    WARMUP = 1
    TRAIN = 2


class Typed(nn.Module):
    """Extra state of number types users' statistics come in: numpy's scalars, an IntEnum."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.mean, self.steps, self.phase = np.float64(0.5), np.int64(3), Phase.WARMUP

    def get_extra_state(self):
        return {"mean": self.mean, "steps": self.steps, "phase": self.phase}

    def set_extra_state(self, state):
        self.mean, self.steps, self.phase = state["mean"], state["steps"], state["phase"]


def test_numbers_of_numpy_and_enum_types_travel_as_their_own_type():
    """numpy's float64 and int64, an IntEnum member: carried as float64 and int64 tensors, given
    back as the type the worker's module held (an outside audit: a bare KeyError at init)."""
    sender, trainer, receiver, worker = connected_pair(model=Typed(), local=Typed())
    try:
        trainer.mean, trainer.steps, trainer.phase = np.float64(0.125), np.int64(2**40), Phase.TRAIN
        sender.send_async()
        assert receiver.wait_for_version(1, timeout=30) == 1
        assert worker.mean == 0.125 and type(worker.mean) is np.float64
        assert worker.steps == 2**40 and type(worker.steps) is np.int64
        assert worker.phase is Phase.TRAIN
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_an_integer_beyond_64_bits_is_named():
    m = Typed()
    m.steps = 2**64
    with pytest.raises(ValueError, match=r"_extra_state\.steps.*64-bit"):
        flatten(m)


class Picky(nn.Module):
    """A module whose set_extra_state refuses some values (the user's own check)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.steps = 0

    def get_extra_state(self):
        return {"steps": self.steps}

    def set_extra_state(self, state):
        if state["steps"] > 5:
            raise ValueError("steps out of range")
        self.steps = state["steps"]


@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_an_error_of_the_models_own_code_is_told_to_the_sender_and_writes_nothing(transport):
    """A worker's set_extra_state that raises: receive() raises it, its model keeps the version it
    held, weights and extra state (set_extra_state runs before any weight is written; before, the
    weights of the new version sat beside the old extra state, numbered as the old), and the
    sender is told at once (its send raises naming the worker's error), not at its timeout."""
    sender, trainer, receiver, worker = connected_pair(transport, model=Picky(), local=Picky())
    try:
        held = worker.lin.weight.clone()
        with torch.no_grad():
            trainer.lin.weight.add_(1.0)
        trainer.steps = 10
        handle = sender.send_async()
        with pytest.raises(ValueError, match="steps out of range"):
            receiver.receive(timeout=30)
        assert torch.equal(worker.lin.weight, held) and worker.steps == 0 and receiver.version == 0
        started = time.monotonic()
        with pytest.raises(WsyncError, match="steps out of range"):
            handle.wait(30)
        assert time.monotonic() - started < 20  # (told, not timed out: 30 s)
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("model", [
    lambda: TensorDict({"w": torch.empty(3, device="meta")}, []).lock_(),
    lambda: types.MappingProxyType({"w": torch.empty(3, device="meta")}),
], ids=["locked-tensordict", "mappingproxy"])
def test_meta_tensors_in_a_container_that_takes_no_entries_are_refused_at_init(model):
    """Meta tensors get memory from the first version by replacing their entries: a locked
    TensorDict or a read-only mapping cannot take them, which init_on_receiver says (before, the
    worker's connect failed with a RuntimeError and its trainer waited out its timeout)."""
    scheme = WeightSyncScheme("inproc")
    with pytest.raises(TypeError, match="meta device"):
        scheme.init_on_receiver(model=model(), worker_idx=0)


def test_rebind_of_a_meta_model_gives_it_the_version_held_extra_state_too():
    """rebind() on a connected worker, of a model built on the meta device: it gets memory and the
    version the worker holds (it stayed on the meta device, an outside audit), extra state included."""
    sender, trainer, receiver, worker = connected_pair(model=nn.Sequential(nn.Linear(2, 2), Stats()),
                                                       local=nn.Sequential(nn.Linear(2, 2), Stats()))
    try:
        trainer[1].count, trainer[1].loc = 9, torch.tensor([4.0, 5.0, 6.0])
        sender.send_async()
        assert receiver.wait_for_version(1, timeout=30) == 1
        with torch.device("meta"):
            moved = nn.Sequential(nn.Linear(2, 2), Stats())
        moved[1].loc = torch.zeros(3)
        receiver.rebind(moved)
        assert not moved[0].weight.is_meta and torch.equal(moved[0].weight, trainer[0].weight)
        assert moved[1].count == 9 and torch.equal(moved[1].loc, trainer[1].loc)
    finally:
        receiver.shutdown()
        sender.shutdown()
