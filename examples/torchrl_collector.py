"""Train a small policy with a TorchRL collector whose weight sync is wsync (CPU, well under a minute).

    .venv/bin/python examples/torchrl_collector.py [--transport shm] [--iters 15]

Two worker processes roll out a pendulum (Pendulum-v1's dynamics, written here so gym is not
needed) with a Gaussian MLP policy; the trainer takes a REINFORCE step on each batch and calls
``collector.update_policy_weights_()``. The only wsync-specific line is the scheme:
``weight_sync_schemes={"policy": WsyncScheme("shm")}`` instead of TorchRL's own. Every step
records the weight version its worker ran with, so the log shows each batch was collected
with exactly the version sent after the previous step.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiSyncCollector
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase

from wsync_torchrl import WsyncScheme


class Pendulum(EnvBase):
    """Swing a pendulum up: observation (cos, sin, angular speed), torque in [-2, 2]."""

    def __init__(self, max_steps: int = 100) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.max_steps = max_steps
        self.observation_spec = Composite(observation=Unbounded(shape=(3,)))
        self.action_spec = Bounded(low=-2.0, high=2.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))
        self.state = torch.zeros(2)
        self.t = 0

    def _observe(self) -> torch.Tensor:
        return torch.stack([self.state[0].cos(), self.state[0].sin(), self.state[1]])

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        self.state = (torch.rand(2) * 2 - 1) * torch.tensor([math.pi, 1.0])
        self.t = 0
        return TensorDict({"observation": self._observe(), "done": torch.tensor([False]),
                           "terminated": torch.tensor([False])})

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        torque = tensordict["action"].clamp(-2.0, 2.0)[0]
        angle, speed = self.state
        upright = ((angle + math.pi) % (2 * math.pi)) - math.pi
        reward = -(upright ** 2 + 0.1 * speed ** 2 + 0.001 * torque ** 2)
        speed = (speed + (15.0 * angle.sin() + 3.0 * torque) * 0.05).clamp(-8.0, 8.0)
        self.state = torch.stack([angle + speed * 0.05, speed])
        self.t += 1
        return TensorDict({"observation": self._observe(), "reward": reward.reshape(1),
                           "done": torch.tensor([self.t >= self.max_steps]), "terminated": torch.tensor([False])})

    def _set_seed(self, seed: int | None) -> None:
        if seed is not None:
            torch.manual_seed(seed)


class GaussianPolicy(nn.Module):
    """Samples a torque around an MLP's mean; also reports the weights' version it ran with."""

    std = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1))
        self.register_buffer("version", torch.zeros(1, dtype=torch.int64))

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.mean(observation)
        action = mean + self.std * torch.randn_like(mean)
        return action, self.version.expand(*observation.shape[:-1], 1).clone()

    def log_prob(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Normal(self.mean(observation), self.std).log_prob(action).sum(-1)


def returns(reward: torch.Tensor, done: torch.Tensor, gamma: float = 0.95) -> torch.Tensor:
    """Discounted reward-to-go along the last (time) dimension, restarting after each done."""
    out = torch.zeros_like(reward)
    running = torch.zeros_like(reward[..., -1])
    for t in reversed(range(reward.shape[-1])):
        running = reward[..., t] + gamma * running * (~done[..., t]).float()
        out[..., t] = running
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", default="shm", help="any wsync transport: shm, mp, zmq, ...")
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    net = GaussianPolicy()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action", "policy_version"])
    optim = torch.optim.Adam(net.mean.parameters(), lr=3e-3)
    scheme = WsyncScheme(args.transport)
    collector = MultiSyncCollector([Pendulum] * 2, policy, frames_per_batch=400, total_frames=400 * args.iters,
                                   weight_sync_schemes={"policy": scheme})
    t0 = time.monotonic()
    try:
        for i, batch in enumerate(collector):
            versions = batch["policy_version"].unique().tolist()
            assert versions == [i], f"batch {i} was collected with versions {versions}"
            reward = batch["next", "reward"].squeeze(-1)
            ret = returns(reward, batch["next", "done"].squeeze(-1))
            advantage = (ret - ret.mean()) / (ret.std() + 1e-6)
            loss = -(net.log_prob(batch["observation"], batch["action"]) * advantage).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            net.version += 1
            collector.update_policy_weights_()  # every worker holds this version when it returns
            print(f"iter {i:2d}  mean reward {reward.mean():7.3f}  loss {loss.item():7.3f}  "
                  f"collected with version {versions[0]}, sent version {net.version.item()}")
    finally:
        collector.shutdown()
        scheme.shutdown()  # TorchRL's shutdown() leaves schemes open
    print(f"done in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
