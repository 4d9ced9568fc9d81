"""How workers really hold their models, as checks: a state_dict or ``TensorDict.data`` handed to
``init_on_receiver``, tensors kept across receives, ``share_memory()``, ``fork``, a receive that
fails half-way, a model built on the meta device.

One rule stands behind them all: memory a worker's tensors view is never written while any tensor
that views it is alive, in the worker or in a child it forked; and the model the user handed over
is the one that holds each version. Zero-copy transports are where it breaks, so the model is
large enough (2 MiB) for them to map it rather than copy it.

The checks drive the worker through ``Worker.scene(name, **kwargs)``: the functions in ``SCENES``
run inside the receiver process, on its harness session.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from wsync_core import SchemaMismatchError, TransportError, WeightSyncScheme, WorkerTimeoutError

from .context import Context, Session
from .guarantees import guarantee, violated
from .models import ModelSpec, TensorSpec, build, digests, random_values

__all__ = ["HoldingChecks", "SCENES", "holding_spec"]

#: the buffer scene 4 replaces by an expanded tensor
_EXPANDED = "norm.running_mean"


def holding_spec() -> ModelSpec:
    """A 2 MiB module of parameters and buffers: over the size at which transports map rather than copy."""
    return ModelSpec("module", (
        TensorSpec("body.weight", (512, 1024), "float32"),
        TensorSpec("body.bias", (1024,), "float32"),
        TensorSpec("head.weight", (16, 64), "bfloat16"),
        TensorSpec(_EXPANDED, (1024,), "float32", buffer=True),
        TensorSpec("norm.steps", (), "int64", buffer=True),
    ))


# -- worker side: run inside the receiver process ---------------------------------------------------
def _tensordict_data(module: Any) -> Any:
    from tensordict import TensorDict  # only here: importing it costs each receiver runner seconds

    return TensorDict.from_module(module).data


def _scene_hold(s: Any, how: str) -> dict[str, Any]:
    """Build the policy (on the meta device for ``how="meta"``) and hand it to init_on_receiver
    as a module, its state_dict, or ``TensorDict.from_module(policy).data``."""
    s.model = build(s.spec, "meta" if how == "meta" else "cpu")
    given = {"module": lambda m: m, "meta": lambda m: m, "state_dict": lambda m: m.state_dict(),
             "tensordict_data": _tensordict_data}[how](s.model)
    s.scheme.init_on_receiver(model=given, worker_idx=s.worker_idx)
    return {"state": s.scheme.state}


def _scene_keep(s: Any) -> dict[str, Any]:
    """Keep tensors the way worker code does: a state_dict, detached aliases, a slice."""
    s.kept = {"state_dict": s.model.state_dict(),
              "detached": {k: v.detach() for k, v in s.model.named_parameters()},
              "slice": s.model.body.weight[3:7]}
    return {"kept": _kept_digests(s)}


def _kept_digests(s: Any) -> dict[str, Any]:
    return {"state_dict": digests(s.kept["state_dict"]), "detached": digests(s.kept["detached"]),
            "slice": digests({"slice": s.kept["slice"]})["slice"]}


def _scene_kept(s: Any) -> dict[str, Any]:
    return {"kept": _kept_digests(s), "model": digests(s.model)}


def _serve_child(conn: Any, model: torch.nn.Module) -> None:
    """A forked child (a DataLoader worker, an env process): answers with its model's digests."""
    while True:
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            return
        conn.send_bytes(repr(digests(model)).encode())


#: this runner's forked children, with the pipe each answers on (they outlive a session: a worker
#: that shuts down and opens again keeps them)
_CHILDREN: list[tuple[int, Any]] = []


def _scene_fork(s: Any, share: bool = False) -> dict[str, Any]:
    """Fork a child that holds the policy (after ``share_memory()`` when ``share``), as
    ``os.fork`` does for DataLoader workers and env pools."""
    if share:
        s.model.share_memory()
    parent, child = multiprocessing.Pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, then leave without running the parent's exit handlers
        code = 0
        try:
            parent.close()
            torch.set_num_threads(1)  # as DataLoader workers do: the parent's OpenMP pool did not fork
            _serve_child(child, s.model)
        except BaseException:  # a child must never return into the harness's loop
            code = 1
        finally:
            os._exit(code)
    child.close()
    _CHILDREN.append((pid, parent))
    return {"pid": pid}


def _scene_child(s: Any) -> dict[str, Any]:
    """The newest child's digests of its policy, and whether the worker's policy is still shared."""
    pid, conn = _CHILDREN[-1]
    conn.send_bytes(b"?")
    if not conn.poll(60):
        raise TimeoutError(f"forked child {pid} gave no digests within 60 s")
    return {"digests": ast.literal_eval(conn.recv_bytes().decode()),
            "shared": all(t.is_shared() for t in s.model.state_dict().values())}


def _scene_end_children(s: Any) -> dict[str, Any]:
    """Let every forked child exit, and reap it."""
    for pid, conn in _CHILDREN:
        conn.close()
        deadline = time.monotonic() + 30
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    _CHILDREN.clear()
    return {}


def _scene_expand(s: Any, fix: bool = False) -> dict[str, Any]:
    """Replace a buffer by an expanded tensor (a write into it fails half-way), or put a real one back."""
    mod = s.model.norm
    name = _EXPANDED.split(".")[-1]
    old = mod._buffers[name]
    mod._buffers[name] = old.clone() if fix else old.reshape(-1)[:1].clone().expand(old.shape)
    return {"digests": digests(s.model)}


def _scene_receive(s: Any, timeout: float) -> dict[str, Any]:
    """``receive()``, reporting the error type it raised, and the model's digests after it."""
    try:
        v = s.scheme.receive(timeout=timeout)
        error = None
    except (SchemaMismatchError, TransportError, WorkerTimeoutError) as exc:
        v, error = None, type(exc).__name__ + ": " + str(exc)
    return {"result": v, "raised": error, "version": s.scheme.version, "digests": digests(s.model)}


def _scene_write(s: Any, how: str) -> dict[str, Any]:
    """Write the policy between two receives, as worker code does: every floating parameter plus
    one, in place (``how="in_place"``) or as new memory put under the same Parameter
    (``how="data_swap"``: ``p.data = ...``, what ``vector_to_parameters`` does)."""
    with torch.no_grad():
        for p in s.model.parameters():
            if p.is_floating_point():
                if how == "in_place":
                    p.add_(1)
                else:
                    p.data = p.data + 1
    return {"digests": digests(s.model)}


#: name -> function(session, **kwargs) -> JSON-able dict, run in the receiver process
SCENES: dict[str, Callable[..., dict[str, Any]]] = {
    "hold": _scene_hold, "keep": _scene_keep, "kept": _scene_kept, "fork": _scene_fork, "child": _scene_child,
    "end_children": _scene_end_children, "expand": _scene_expand, "receive": _scene_receive,
    "write": _scene_write,
}


# -- the checks -------------------------------------------------------------------------------------
class HoldingChecks:
    """Checks of the isolation rule under the ways worker code holds models (mixed into TransportSuite)."""

    def _held_session(self, wsync: Context, n: int = 2, how: str = "module") -> Session:
        s = wsync.session(holding_spec(), n=n, connect=False, init=False)
        for w in s.workers:
            w.scene("hold", how=how)
        s.connect()
        s.check(0)
        return s

    def _send_random(self, s: Session, seed: int, **kw: Any) -> int:
        s.fill(random_values(s.spec, seed))
        return s.send(**kw)

    @guarantee("exact")
    @pytest.mark.parametrize("how", ["state_dict", "tensordict_data"])
    def test_exact_model_given_as_state_dict_or_tensordict(self, wsync: Context, how: str) -> None:
        """A worker hands ``policy.state_dict()`` or ``TensorDict.from_module(policy).data`` to
        ``init_on_receiver``: ``policy`` itself holds every version it reports applied."""
        s = self._held_session(wsync, how=how)
        for seed in range(1, 4):
            version = self._send_random(s, seed)
            try:
                s.check(version)
            except AssertionError as exc:
                raise violated("exact", f"model given as {how}: {exc}") from None

    @guarantee("isolated")
    def test_isolated_kept_tensors(self, wsync: Context) -> None:
        """A worker keeps its state_dict, detached aliases and a slice across receives, and stops
        receiving while the other worker gets many newer versions: what it kept changes only
        when it applies a version, and then to that version's values."""
        s = self._held_session(wsync)
        s.fill(random_values(s.spec, 1))
        v1 = s.send()
        kept = s.workers[0].scene("keep")["kept"]
        for seed in range(2, 7):  # worker 0 does not receive: memory it views must stay as it is
            s.fill(random_values(s.spec, seed))
            s.send(worker_ids=[1])
        now = s.workers[0].scene("kept")
        if now["kept"] != kept or now["model"] != s.expected[v1]:
            raise violated("isolated", "tensors worker 0 kept (or its model) changed while it did not receive; "
                                       "the memory they view was written by later versions")
        v = self._send_random(s, 9)
        now = s.workers[0].scene("kept")
        want = s.expected[v]
        if now["kept"]["state_dict"] != want or now["model"] != want:
            raise violated("isolated", f"after applying version {v}, worker 0's model or the state_dict it kept "
                                       f"does not hold version {v}")
        s.check(v)

    @guarantee("isolated")
    def test_isolated_forked_child_keeps_its_version(self, wsync: Context) -> None:
        """A worker forks a child (a DataLoader worker, an env pool) after a receive: the child
        keeps what it forked with while the worker applies newer versions; once the child exits,
        updates go on exactly."""
        wsync.require("processes")  # a fork copies the whole process: receivers must be processes
        s = self._held_session(wsync)
        v1 = self._send_random(s, 1)
        s.workers[0].scene("fork")
        for seed in range(2, 6):
            self._send_random(s, seed)
            child = s.workers[0].scene("child")["digests"]
            if child != s.expected[v1]:
                bad = sorted(k for k in child if child[k] != s.expected[v1][k])
                raise violated("isolated", f"a child forked at version {v1} now holds other values in {bad} "
                                           f"after its parent applied version {s.scheme.version}")
        s.workers[0].scene("end_children")
        for seed in range(6, 9):
            s.check(self._send_random(s, seed))

    @guarantee("isolated")
    def test_isolated_share_memory_after_receive(self, wsync: Context) -> None:
        """``policy.share_memory()`` after a receive, then a child holding the shared policy: the
        shared memory keeps holding each version the worker applies (no one is left frozen)."""
        wsync.require("processes")
        s = self._held_session(wsync)
        self._send_random(s, 1)
        s.workers[0].scene("fork", share=True)
        for seed in range(2, 5):
            v = self._send_random(s, seed)
            s.check(v)
            child = s.workers[0].scene("child")
            if not child["shared"]:
                raise violated("isolated", f"after applying version {v}, worker 0's policy left the shared memory "
                                           f"it was moved to with share_memory()")
            if child["digests"] != s.expected[v]:
                raise violated("isolated", f"the child holding worker 0's shared policy does not see version {v}: "
                                           f"the worker's policy no longer uses the memory it shared")
        s.workers[0].scene("end_children")

    @guarantee("atomic")
    def test_atomic_failed_receive_leaves_model_as_it_was(self, wsync: Context) -> None:
        """A worker replaced a buffer by an expanded tensor, so writing it fails half-way: the
        receive raises, the model stays exactly as it was, also while the sender reuses its
        memory for later versions; once the buffer is fixed, the next version applies."""
        s = self._held_session(wsync, n=1)
        self._send_random(s, 1)
        before = s.workers[0].scene("expand")["digests"]
        s.fill(random_values(s.spec, 2))
        s.expected[s.scheme.version + 1] = digests(s.model)
        s.scheme.send_async()
        got = s.workers[0].scene("receive", timeout=wsync.timeout)
        if got["raised"] is None:
            raise violated("atomic", f"receive() into a model with an expanded buffer returned {got['result']}")
        if got["digests"] != before:
            bad = sorted(k for k in before if got["digests"][k] != before[k])
            raise violated("atomic", f"a receive that failed ({got['error'][:120]}) changed {bad}")
        for seed in (3, 4, 5):  # the sender moves on and reuses its memory; the worker does not receive
            s.fill(random_values(s.spec, seed))
            s.expected[s.scheme.version + 1] = digests(s.model)
            s.scheme.send_async()
        # the newest of those reaches the worker (waiting for it: a slow transport may still have it
        # in flight) and fails again: the buffer is still expanded
        now = s.workers[0].scene("receive", timeout=wsync.timeout)
        if now["raised"] is None and now["result"] is None:
            raise violated("live", f"after a failed receive, none of versions 3-5 the sender sent reached worker 0 "
                                   f"within {wsync.timeout} s")
        if now["digests"] != before:
            raise violated("atomic", "the model of a worker whose receive failed changed afterwards")
        if now["raised"] is None:
            raise violated("atomic", f"receive() into a model whose buffer is still expanded returned {now['result']}")
        s.workers[0].scene("expand", fix=True)
        s.check(self._send_random(s, 6))

    @guarantee("exact", "ordered")
    def test_exact_meta_device_models(self, wsync: Context) -> None:
        """A receiver built on the meta device gets real memory from its first payload and holds
        every version exactly; a sender on the meta device is refused at ``init_on_sender`` and
        nothing half-happens."""
        s = self._held_session(wsync, how="meta")
        for seed in (1, 2):
            s.check(self._send_random(s, seed))
        sender = WeightSyncScheme(wsync.target.make(), timeout=wsync.timeout)
        try:
            sender.init_on_sender(model=build(s.spec, "meta", sender=True), num_workers=1)
        except ValueError:
            pass
        else:
            raise violated("ordered", "init_on_sender() accepted a model on the meta device (it holds no data)")
        finally:
            if sender.state != "new":
                raise violated("ordered", f"a refused init_on_sender() left the scheme {sender.state}")
            sender.shutdown()
