"""mp's zero-copy worker: one private mapping per slot, kept across deliveries."""

from __future__ import annotations

import pickle
import threading

import torch
from wsync_core import WeightSyncScheme


def test_a_zero_copy_worker_that_writes_its_model_gets_each_reused_slot_exactly() -> None:
    """The pages a worker wrote into its model (all of a tensor, a few scattered ones) are dropped
    before their slot goes back to the sender, so a later version in the same slot is exact."""
    model = {"w": torch.zeros(64 * 1024), "b": torch.zeros(10)}
    sender = WeightSyncScheme("mp", timeout=30.0, sync=False, zero_copy=True)
    sender.init_on_sender(model=model, num_workers=1)
    receiver: WeightSyncScheme = pickle.loads(pickle.dumps(sender))
    mine = {"w": torch.zeros(64 * 1024), "b": torch.zeros(10)}
    own = mine["w"].data_ptr()
    receiver.init_on_receiver(model=mine, worker_idx=0)
    t = threading.Thread(target=receiver.connect)
    t.start()
    sender.connect()
    t.join(60)
    try:
        for v in range(1, 13):  # a few slots, each reused several times
            model["w"].fill_(v + 0.5)
            model["b"].fill_(-v)
            sender.send_async()
            assert receiver.receive(timeout=30.0) == v
            assert torch.equal(mine["w"], model["w"]) and torch.equal(mine["b"], model["b"]), v
            if v % 3 == 0:
                mine["w"].fill_(-1.0)  # every page of the tensor
            else:
                mine["w"][v::4099].fill_(-2.0)  # a few scattered pages
        assert mine["w"].data_ptr() != own  # the model views the slots (zero-copy)
    finally:
        receiver.shutdown()
        sender.shutdown()
