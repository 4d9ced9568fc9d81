"""A small pendulum (no gym needed) and a policy that stamps every step with the exact weights
it ran with, so tests read each worker's weights from inside its rollout."""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase


class Pendulum(EnvBase):
    """Pendulum-v1's dynamics (g=10, m=1, l=1, dt=0.05), observation (cos, sin, speed)."""

    def __init__(self, max_steps: int = 200, seed: int = 0) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.max_steps = max_steps
        self.observation_spec = Composite(observation=Unbounded(shape=(3,)), step=Unbounded(shape=(1,), dtype=torch.int64))
        self.action_spec = Bounded(low=-2.0, high=2.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))
        self._gen = torch.Generator().manual_seed(seed)
        self._state = torch.zeros(2)
        self._t = 0

    def _obs(self) -> torch.Tensor:
        th, thdot = self._state
        return torch.stack([torch.cos(th), torch.sin(th), thdot])

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        self._state = (torch.rand(2, generator=self._gen) * 2 - 1) * torch.tensor([math.pi, 1.0])
        self._t = 0
        return TensorDict({"observation": self._obs(), "step": torch.zeros(1, dtype=torch.int64),
                           "done": torch.zeros(1, dtype=torch.bool), "terminated": torch.zeros(1, dtype=torch.bool)})

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        u = tensordict["action"].clamp(-2.0, 2.0)[0]
        th, thdot = self._state
        cost = _angle(th) ** 2 + 0.1 * thdot ** 2 + 0.001 * u ** 2
        thdot = (thdot + (3 * 10.0 / 2 * torch.sin(th) + 3.0 * u) * 0.05).clamp(-8, 8)
        self._state = torch.stack([th + thdot * 0.05, thdot])
        self._t += 1
        done = torch.tensor([self._t >= self.max_steps])
        return TensorDict({"observation": self._obs(), "step": torch.tensor([self._t]),
                           "reward": (-cost).reshape(1), "done": done, "terminated": torch.zeros(1, dtype=torch.bool)})

    def _set_seed(self, seed: int | None) -> None:
        if seed is not None:
            self._gen.manual_seed(seed)


def _angle(th: torch.Tensor) -> torch.Tensor:
    return ((th + math.pi) % (2 * math.pi)) - math.pi


class StampedNet(nn.Module):
    """An MLP policy that also returns the bits of every weight it used for this step."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(observation), flat_bits(self).expand(*observation.shape[:-1], -1)


def flat_bits(module: nn.Module) -> torch.Tensor:
    """Every parameter of ``module``, concatenated, as int32 bits (bitwise comparable)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).view(torch.int32).clone()


def make_policy(seed: int = 0) -> TensorDictModule:
    torch.manual_seed(seed)
    return TensorDictModule(StampedNet(), in_keys=["observation"], out_keys=["action", "weights_bits"])


def make_env() -> Pendulum:
    return Pendulum()
