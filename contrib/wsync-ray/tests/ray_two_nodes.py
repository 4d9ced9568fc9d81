"""The trainer of the two-node test (run inside the head node's network namespace): it joins the
Ray cluster at ``sys.argv[1]``, starts two rollout actors on the other node (custom resource
``far``), sends versions of a 16 MiB model through the ``ray`` transport, kills one actor, and
prints one JSON line with what each side holds."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time

import ray
import torch
from wsync_core import WeightSyncScheme, WorkerTimeoutError

NUMEL = 4 << 20  # 16 MiB of float32


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


@ray.remote(num_cpus=0, resources={"far": 0.01})
class Far:
    def __init__(self, scheme, worker: int) -> None:
        torch.set_num_threads(1)
        self.model = {"w": torch.zeros(NUMEL)}
        self.scheme = scheme
        scheme.init_on_receiver(model=self.model, worker_idx=worker)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def connect(self) -> int:
        self.scheme.connect(timeout=120.0)
        return self.scheme.version

    def direct_ack(self) -> bool:
        """Whether this worker acks over a direct connection to the trainer (across the nodes' link)."""
        return self.scheme._role.endpoint.link is not None

    def receive_until(self, version: int, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while self.scheme.version < version and time.monotonic() < end:
            self.scheme.receive(timeout=0.5)
        return {"version": self.scheme.version, "digest": digest(self.model["w"])}


def main(address: str) -> dict:
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    here = ray.get_runtime_context().get_node_id()
    model = {"w": torch.zeros(NUMEL)}
    scheme = WeightSyncScheme("ray", timeout=120.0)
    actors = [Far.remote(scheme, i) for i in range(2)]
    scheme.init_on_sender(model=model, num_workers=2)
    out: dict = {"trainer_node": here, "worker_nodes": ray.get([a.node.remote() for a in actors])}
    connects = [a.connect.remote() for a in actors]
    scheme.connect()
    out["connected"] = ray.get(connects)
    out["direct_acks"] = ray.get([a.direct_ack.remote() for a in actors])
    out["versions"] = []
    for v in range(1, 4):
        model["w"].copy_(torch.randn(NUMEL, generator=torch.Generator().manual_seed(v)))
        handle = scheme.send_async()
        sent = handle.version
        got = ray.get([a.receive_until.remote(sent, 120.0) for a in actors])
        handle.wait()
        out["versions"].append({"v": sent, "digest": digest(model["w"]), "workers": got})
    out["links"] = len(scheme._role.endpoint.links)
    ray.kill(actors[1], no_restart=True)
    model["w"].fill_(4.0)
    t0 = time.monotonic()
    pending = actors[0].receive_until.remote(4, 120.0)
    try:
        scheme.send(timeout=300.0)
        out["dead"] = {"error": None}
    except WorkerTimeoutError as exc:
        out["dead"] = {"workers": exc.workers, "message": str(exc), "took_s": time.monotonic() - t0}
    out["after_kill"] = {"digest": digest(model["w"]), "worker0": ray.get(pending)}
    scheme.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
