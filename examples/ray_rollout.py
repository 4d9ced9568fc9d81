"""wsync on Ray: a trainer actor keeps 4 rollout actors' policies in sync through Ray's object store.

The trainer actor updates its policy and calls ``scheme.send()`` after every step; each rollout
actor acts with its own copy and picks up new weights between steps with ``scheme.receive()``.
At the end every rollout actor's weights are checked bit for bit against the trainer's.

    python examples/ray_rollout.py [--address ADDR] [--workers 4] [--steps 20]

Without ``--address`` a throwaway Ray node is started on this machine for the run (2 CPUs,
512 MiB of object store) and stopped after it; with one, the example joins that cluster.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import statistics
import time

import torch
from torch import nn

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # for the throwaway node; a real cluster sets its own

import ray  # noqa: E402
from wsync_core import WeightSyncScheme  # noqa: E402


def make_policy(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(128, 1024), nn.LayerNorm(1024), nn.Tanh(),
                         nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))


def fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@ray.remote(num_cpus=0)
class Rollout:
    """A rollout worker: acts with its local policy, picking up new weights between steps."""

    def __init__(self, scheme: WeightSyncScheme, idx: int) -> None:
        torch.set_num_threads(1)
        self.policy = make_policy(seed=1000 + idx)  # deliberately different until connect()
        self.scheme = scheme
        scheme.init_on_receiver(model=self.policy, worker_idx=idx)

    def run(self, until_version: int) -> dict:
        """Connect, then act until the policy reaches ``until_version``; what it ended with."""
        self.scheme.connect()
        obs = torch.randn(32, 128)
        steps = 0
        while self.scheme.version < until_version:
            self.scheme.receive(timeout=0.01)  # a safe point: between rollout steps
            with torch.no_grad():
                self.policy(obs)
            steps += 1
        out = {"version": self.scheme.version, "fingerprint": fingerprint(self.policy), "steps": steps}
        self.scheme.shutdown()
        return out


@ray.remote(num_cpus=0)
class Trainer:
    """The trainer: one optimizer step, then one sync, ``steps`` times."""

    def __init__(self, scheme: WeightSyncScheme, workers: int) -> None:
        torch.set_num_threads(1)
        self.policy = make_policy(seed=0)
        self.opt = torch.optim.SGD(self.policy.parameters(), lr=1e-3)
        self.scheme = scheme
        scheme.init_on_sender(model=self.policy, num_workers=workers)

    def train(self, steps: int) -> dict:
        self.scheme.connect()  # every worker holds version 0 after this
        latencies = []
        for _ in range(steps):
            loss = self.policy(torch.randn(64, 128)).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            t0 = time.perf_counter()
            self.scheme.send()  # returns once every rollout actor applied the new version
            latencies.append(time.perf_counter() - t0)
        out = {"version": self.scheme.version, "fingerprint": fingerprint(self.policy), "latencies": latencies,
               "mib": sum(t.numel() * t.element_size() for t in self.policy.state_dict().values()) / 2**20}
        self.scheme.shutdown()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=None, help="a Ray cluster to join (default: start one here)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    node = None
    if args.address is None:
        from wsync_ray.cluster import RayNode

        node = RayNode(num_cpus=2, object_store_mib=512)
    try:
        ray.init(address=args.address or node.address, log_to_driver=False, logging_level=logging.WARNING)
        scheme = WeightSyncScheme("ray", timeout=120.0)  # plain configuration: pickled into each actor
        trainer = Trainer.remote(scheme, args.workers)
        rollouts = [Rollout.remote(scheme, i) for i in range(args.workers)]
        runs = [r.run.remote(args.steps) for r in rollouts]
        trained = ray.get(trainer.train.remote(args.steps))
        results = ray.get(runs)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if node is not None:
            node.stop()

    lat = sorted(trained["latencies"])
    print(f"{args.steps} versions of a {trained['mib']:.1f} MiB policy to {args.workers} rollout actors over Ray: "
          f"p50 {statistics.median(lat) * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms per send (snapshot, delivery, "
          f"every actor's ack)")
    ok = True
    for i, r in enumerate(results):
        same = r["version"] == trained["version"] and r["fingerprint"] == trained["fingerprint"]
        ok &= same
        print(f"  rollout {i}: version {r['version']}, {r['steps']} rollout steps, weights "
              f"{'identical to the trainer' if same else 'DIFFERENT: ' + r['fingerprint']}")
    if not ok:
        raise SystemExit("a rollout actor's weights differ from the trainer's")
    print("every rollout actor holds the trainer's final weights, bit for bit")


if __name__ == "__main__":
    main()
