"""CUDA models on either side: the payload stages through the shared-memory slot (host memory), or
with ``cuda_ipc=True`` a GPU sender's slot stays in its GPU memory, opened by the receiver."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from shm_procs import fill, make_model

from wsync_core import WeightSyncScheme

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")


def on(model: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: t.to(device) for k, t in model.items()}


@pytest.mark.parametrize("cuda_ipc", [False, True])
@pytest.mark.parametrize("sender_device,receiver_device", [("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "cuda")])
def test_cuda_models_receive_exact_weights_on_their_device(sender_device: str, receiver_device: str,
                                                          cuda_ipc: bool) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    src = make_model()
    fill(src, 0)
    model = on(src, sender_device)
    sender = WeightSyncScheme("shm", sync=False, timeout=30.0, name=name, cuda_ipc=cuda_ipc)
    sender.init_on_sender(model=model, num_workers=1)
    target = on(make_model(), receiver_device)
    receiver = WeightSyncScheme("shm", timeout=30.0, name=name)
    receiver.init_on_receiver(model=target, worker_idx=0)
    try:
        t = threading.Thread(target=sender.connect)
        t.start()
        receiver.connect()
        t.join(60)
        for v in (1, 2):
            fill(src, v)
            for k in model:
                model[k].copy_(src[k])
            handle = sender.send_async()
            assert receiver.receive(timeout=30.0) == v
            handle.wait()
            assert all(target[k].device.type == receiver_device for k in target)
            assert all(torch.equal(target[k].cpu(), src[k]) for k in src)
    finally:
        receiver.shutdown()
        sender.shutdown()
