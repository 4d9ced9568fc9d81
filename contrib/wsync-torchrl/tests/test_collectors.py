"""WsyncScheme in TorchRL's real collectors, 2 worker processes each: weights reach every worker
bit for bit (read from inside its rollout), later in-place writes by the trainer never do, a
version lands between two policy calls, a worker dying at start-up fails the collector fast."""

from __future__ import annotations

import functools
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

from torchrl_helpers import flat_bits, make_env, make_policy
from wsync_core import WorkerDiedError
from wsync_torchrl import WsyncScheme

HERE = Path(__file__).resolve().parent


def bump(policy: nn.Module) -> None:
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))


@pytest.mark.parametrize("transport", ["shm", "mp"])
def test_multisync_exact_and_isolated_over_many_updates(transport):
    policy = make_policy()
    scheme = WsyncScheme(transport, timeout=60)
    collector = MultiSyncCollector([make_env] * 2, policy, frames_per_batch=8, total_frames=-1,
                                   weight_sync_schemes={"policy": scheme})
    try:
        it = iter(collector)
        expected = flat_bits(policy.module)
        for i in range(40):
            data = next(it)
            bits = data["weights_bits"]
            assert bits.shape[:2] == (2, 4)
            assert (bits == expected).all(), f"round {i}: a worker ran with other weights"
            if i % 4 == 3:  # isolation: the trainer writes in place and does not send
                bump(policy)
                continue
            bump(policy)
            collector.update_policy_weights_()
            expected = flat_bits(policy.module)
        assert scheme.version == 30
    finally:
        collector.shutdown()


def test_multiasync_every_step_runs_a_version_that_was_sent():
    policy = make_policy()
    collector = MultiAsyncCollector([make_env] * 2, policy, frames_per_batch=8, total_frames=-1,
                                    weight_sync_schemes={"policy": WsyncScheme("shm", timeout=60)})
    try:
        sent = {tuple(flat_bits(policy.module).tolist())}
        newest_seen = 0
        for i, data in enumerate(collector):
            for step in data["weights_bits"].reshape(-1, data["weights_bits"].shape[-1]):
                assert tuple(step.tolist()) in sent, f"batch {i}: weights that were never sent"
            if (data["weights_bits"] == flat_bits(policy.module)).all(-1).any():  # a step ran the newest
                newest_seen += 1
            if i == 60:
                break
            bump(policy)
            collector.update_policy_weights_()
            sent.add(tuple(flat_bits(policy.module).tolist()))
        assert newest_seen > 0
    finally:
        collector.shutdown()


class TornCheck(nn.Module):
    """Reads its weights before and after a pause inside forward: both reads must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(256))

    def forward(self, observation: torch.Tensor):
        first = self.w.detach().clone()
        time.sleep(0.002)
        torn = not torch.equal(first, self.w.detach())
        return first[:1].expand(*observation.shape[:-1], 1) * 0, torch.tensor([torn]), first[:1].clone()


def test_a_version_lands_between_two_policy_calls_never_during_one():
    policy = TensorDictModule(TornCheck(), in_keys=["observation"], out_keys=["action", "torn", "w0"])
    collector = MultiAsyncCollector([make_env] * 2, policy, frames_per_batch=16, total_frames=-1,
                                    weight_sync_schemes={"policy": WsyncScheme("shm", timeout=60, sync=False)})
    try:
        values = set()
        for i, data in enumerate(collector):
            assert not data["torn"].any(), f"batch {i}: a step saw two versions"
            values.update(data["w0"].reshape(-1).tolist())
            if i == 40:
                break
            with torch.no_grad():
                policy.module.w.fill_(float(i + 1))
            collector.update_policy_weights_()
        assert len(values) > 5  # versions kept landing while the workers were rolling out
    finally:
        collector.shutdown()


def _broken_env():
    raise RuntimeError("no such environment: Pendulum-v99")


def test_a_worker_dying_at_startup_fails_the_collector_fast_with_its_error():
    policy = make_policy()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        MultiSyncCollector([make_env, _broken_env], policy, frames_per_batch=8, total_frames=-1,
                           weight_sync_schemes={"policy": WsyncScheme("shm", timeout=120)})
    assert time.monotonic() - t0 < 60  # far less than the scheme's 120 s timeout
    assert info.value.workers == [1]
    assert "worker 1" in str(info.value) and "Pendulum-v99" in str(info.value)
    assert isinstance(info.value, RuntimeError)  # what TorchRL raises for a worker failing to start


def test_policies_from_distinct_factories_are_never_sent_weights_nobody_named():
    """Workers built from distinct ``policy_factory`` entries: there is no trainer policy, so an
    update without weights raises ValueError and every worker keeps what it runs (it sent every
    worker a copy of factory 0's policy made when the collector was built); weights given per
    worker reach each its own."""
    factories = [functools.partial(make_policy, 10), functools.partial(make_policy, 11)]
    scheme = WsyncScheme("shm", timeout=60)
    collector = MultiSyncCollector([make_env] * 2, policy_factory=factories, frames_per_batch=8, total_frames=-1,
                                   weight_sync_schemes={"policy": scheme})
    try:
        it = iter(collector)
        data = next(it)
        started = [flat_bits(f().module) for f in factories]
        assert all((data["weights_bits"][w] == started[w]).all() for w in (0, 1))
        mine = [make_policy(20), make_policy(21)]
        collector.update_policy_weights_({w: TensorDict.from_module(mine[w]) for w in (0, 1)})
        data = next(it)
        assert all((data["weights_bits"][w] == flat_bits(mine[w].module)).all() for w in (0, 1))
        with pytest.raises(ValueError, match="distinct policy_factory entries"):
            collector.update_policy_weights_()
        data = next(it)
        assert all((data["weights_bits"][w] == flat_bits(mine[w].module)).all() for w in (0, 1))
    finally:
        collector.shutdown()
        scheme.shutdown()


def test_without_sync_an_update_names_a_worker_whose_process_is_gone():
    """``sync=False``: nothing waits for the acks, so a killed worker was never reported (every
    update returned at once); the update after it raises WorkerDiedError naming it, once the
    others were sent the version."""
    policy = make_policy()
    scheme = WsyncScheme("shm", timeout=60, sync=False)
    collector = MultiSyncCollector([make_env] * 2, policy, frames_per_batch=8, total_frames=-1,
                                   weight_sync_schemes={"policy": scheme})
    try:
        next(iter(collector))
        os.kill(collector.procs[1].pid, signal.SIGKILL)
        collector.procs[1].join(30)
        bump(policy)
        with pytest.raises(WorkerDiedError) as info:
            collector.update_policy_weights_()
        assert info.value.workers == [1] and "worker 1: process" in str(info.value)
        assert scheme.version == 1  # the version went out
    finally:
        collector.shutdown()
        scheme.shutdown()


def test_collector_receives_through_weight_recv_schemes_inproc():
    """A single-process Collector as the receiver (inproc: the trainer is a thread away)."""
    trainer = make_policy()
    sender = WsyncScheme("inproc", timeout=30)
    sender.init_on_sender(model=trainer, num_workers=1)
    receiver = pickle.loads(pickle.dumps(sender))
    connected = threading.Thread(target=sender.connect)
    connected.start()
    local = make_policy(seed=5)
    collector = Collector(make_env(), local, frames_per_batch=4, total_frames=-1, worker_idx=0,
                          weight_recv_schemes={"policy": receiver})
    connected.join()
    try:
        for i, data in enumerate(collector):
            assert (data["weights_bits"] == flat_bits(trainer.module)).all()
            if i == 10:
                break
            bump(trainer)
            sender.send()
            receiver.wait_for_version(sender.version, timeout=30)
    finally:
        collector.shutdown()
        receiver.shutdown()
        sender.shutdown()


def test_no_noise_at_exit_when_the_scheme_is_never_shut_down(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        from torchrl.collectors import MultiSyncCollector
        from torchrl_helpers import make_env, make_policy
        from wsync_torchrl import WsyncScheme

        if __name__ == "__main__":
            policy = make_policy()
            c = MultiSyncCollector([make_env] * 2, policy, frames_per_batch=8, total_frames=32,
                                   weight_sync_schemes={{"policy": WsyncScheme("shm")}})
            for data in c:
                c.update_policy_weights_()
            c.shutdown()  # TorchRL's own shutdown; nobody calls the scheme's
    """))
    others = {ep.name for ep in entry_points(group="wsync")} - {"shm"}  # a broken neighbour plugin would say so
    out = subprocess.run([sys.executable, "-W", "ignore::UserWarning", str(script)], capture_output=True,
                         text=True, timeout=240, env=dict(os.environ, WSYNC_DISABLE_PLUGINS=",".join(sorted(others))))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""


def test_the_example_trains_with_every_batch_on_the_version_sent():
    example = HERE.parents[2] / "examples" / "torchrl_collector.py"
    out = subprocess.run([sys.executable, "-W", "ignore", str(example), "--iters", "3"], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "collected with version 2, sent version 3" in out.stdout


@pytest.mark.parametrize("transport", ["shm", "inproc"])
def test_collector_takes_the_scheme_as_weight_sync_schemes(transport):
    """A single-process Collector given the scheme directly: on one device it runs the trainer's
    own policy object, so there is nothing to move, but weights given are copied in exactly."""
    policy = make_policy()
    scheme = WsyncScheme(transport, timeout=30)
    collector = Collector(make_env(), policy, frames_per_batch=4, total_frames=-1,
                          weight_sync_schemes={"policy": scheme})
    try:
        for i, data in enumerate(collector):
            assert (data["weights_bits"] == flat_bits(policy.module)).all()
            if i == 5:
                break
            if i % 2:
                bump(policy)
                collector.update_policy_weights_()
            else:
                other = make_policy(seed=100 + i)
                collector.update_policy_weights_(TensorDict.from_module(other))
                assert (flat_bits(policy.module) == flat_bits(other.module)).all()
    finally:
        collector.shutdown()
        scheme.shutdown()


class WithStats(nn.Module):
    """A policy with extra state (a running mean and a step counter, as normalizers keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.mean = torch.zeros(3)
        self.count = 0

    def get_extra_state(self):
        return {"mean": self.mean, "count": self.count}

    def set_extra_state(self, state):
        self.mean, self.count = state["mean"], state["count"]

    def forward(self, observation: torch.Tensor):
        n = observation.shape[:-1]
        return self.lin(observation - self.mean), self.mean.expand(*n, 3).clone(), torch.full((*n, 1), self.count)


@pytest.mark.parametrize("extracted", [False, True])
def test_extra_state_reaches_the_workers_beside_the_weights(extracted):
    from torchrl.weight_update.weight_sync_schemes import WeightStrategy

    policy = TensorDictModule(WithStats(), in_keys=["observation"], out_keys=["action", "mean", "count"])
    collector = MultiSyncCollector([make_env] * 2, policy, frames_per_batch=8, total_frames=-1,
                                   weight_sync_schemes={"policy": WsyncScheme("shm", timeout=60)})
    try:
        it = iter(collector)
        next(it)
        stats = policy.module
        for i in range(1, 4):
            stats.mean = torch.full((3,), float(i))
            stats.count = 10 * i
            if extracted:  # the weights as TorchRL's strategy extracts them ("__extra_state__")
                collector.update_policy_weights_(WeightStrategy("tensordict").extract_weights(policy))
            else:
                collector.update_policy_weights_()
            data = next(it)
            assert (data["mean"] == float(i)).all() and (data["count"] == 10 * i).all()
    finally:
        collector.shutdown()
