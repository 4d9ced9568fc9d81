"""``WsyncScheme``: a TorchRL weight sync scheme whose every guarantee comes from wsync.

TorchRL's collectors drive it exactly like their own schemes (``init_on_sender``, pickling into
each worker, ``init_on_receiver``, ``connect``, ``send``); underneath, one
``wsync_core.WeightSyncScheme`` per side moves a snapshot of the weights with the chosen wsync
transport, so workers hold exact, private copies, versioned and applied whole.

Where a worker applies a version: a thread of the worker receives it and applies it under the
worker's safe point, a lock the policy holds while it runs (forward hooks). A version therefore
lands between two policy calls, i.e. between two rollout steps, never during one; an idle
worker applies it at once, so ``update_policy_weights_()`` returns as soon as every worker holds
it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.collectors import Collector
from torchrl.weight_update.utils import _resolve_model
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme as TorchRLScheme

from wsync_core import Transport, WeightSyncScheme, WorkerDiedError, WsyncError
from wsync_core.weights import EXTRA_STATE, flatten

from .safepoint import SafePoint

__all__ = ["WsyncScheme", "WorkerStartupError"]

#: how long the worker's receiving thread waits for a delivery before checking for a stop
_RECV_SLICE = 0.2


class WorkerStartupError(WorkerDiedError, RuntimeError):
    """A collector's worker died before it held the first version: a wsync ``WorkerDiedError``
    (``.workers``, the worker's traceback in the message) that is also the ``RuntimeError``
    TorchRL raises for a worker that fails to start."""


class WsyncScheme(TorchRLScheme):
    """A ``torchrl.weight_update.WeightSyncScheme`` moving weights with wsync.

    ``transport`` is a wsync transport name (``"shm"``, ``"mp"``, ``"zmq"``, ...) or object;
    ``options`` go to it. ``sync``: ``send()`` returns once every target applied the version
    (default) or once the snapshot is taken. ``timeout`` bounds every wait (seconds).

    Use it where TorchRL takes a scheme::

        MultiSyncCollector(..., weight_sync_schemes={"policy": WsyncScheme("shm")})
    """

    def __init__(self, transport: str | Transport = "shm", *, strategy: str = "tensordict", sync: bool = True,
                 timeout: float = 60.0, **options: Any) -> None:
        super().__init__(strategy=strategy)
        self._wsync = WeightSyncScheme(transport, strategy=strategy, sync=sync, timeout=timeout, **options)
        self.sync = sync
        self._fresh()

    def _fresh(self) -> None:
        self._safepoint = SafePoint()
        self._stop = threading.Event()
        self._receiver_thread: threading.Thread | None = None
        self._receiver_error: BaseException | None = None
        self._watch_procs: Any = None

    # -- pickling: only the configuration travels; each side starts fresh -----------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_safepoint", "_stop", "_receiver_thread", "_receiver_error", "_watch_procs", "_local",
                    "_per_worker_init", "_extra_keys", "_factories_only"):  # the sender's own: weights never ride the pickle
            state.pop(key, None)
        state["_wsync"] = _fresh_copy(self._wsync)
        state["_model_ref"] = None
        state["_context_ref"] = None
        state.pop("_weights", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._fresh()

    @property
    def core(self) -> WeightSyncScheme:
        """The wsync scheme underneath (versions, reports, wait_for_version, listeners)."""
        return self._wsync

    @property
    def version(self) -> int:
        """The version sent (sender) or applied (receiver); -1 before connect."""
        return self._wsync.version

    def create_transport(self, **kwargs: Any) -> Transport:
        """The wsync transport (TorchRL's per-worker transports are not used)."""
        return self._wsync.transport

    # -- sender ---------------------------------------------------------------------------------
    def _init_on_sender_impl(self, *, model_id: str | None = None, context: Any = None,
                             model: nn.Module | None = None, weights: Any = None,
                             num_workers: int | None = None, devices: list[Any] | None = None,
                             params_map: Mapping[int, TensorDictBase] | None = None, **kwargs: Any) -> None:
        model_id = model_id or "policy"
        self.model_id = model_id
        per_worker: dict[int, Any] = {}
        if params_map is not None:
            per_worker = dict(params_map)
            source: Any = per_worker[min(per_worker)]
            num_workers = len(per_worker)
        elif context is not None and isinstance(context, Collector) and num_workers is None:
            self.context = context
            self._init_in_process(context, model_id)
            return
        elif context is not None:
            self.context = context
            source, per_worker = _sender_model(context, model_id)
            self._factories_only = bool(per_worker)  # no policy of the trainer's: every send names its weights
            if num_workers is None:
                num_workers = _num_workers(context)
            self._watch_procs = context
        else:
            source = model if model is not None else weights
            if source is None:
                raise ValueError("init_on_sender() needs context=, model=, weights= or params_map=")
            if num_workers is None:
                num_workers = len(devices) if devices is not None else None
            if num_workers is None:
                raise ValueError("init_on_sender(model=/weights=) needs num_workers= (or devices=)")
        if isinstance(source, nn.Module):
            self.model = source
            self._extra_keys = [k for k in flatten(source, self.strategy_str) if EXTRA_STATE in k]
        self._per_worker_init = per_worker
        self._wsync.init_on_sender(model=source if isinstance(source, nn.Module) else None,
                                   weights=None if isinstance(source, nn.Module) else _as_weights(source),
                                   num_workers=num_workers, model_id=model_id)

    def _init_in_process(self, collector: Any, model_id: str) -> None:
        """A single-process ``Collector``: its worker is itself. The policy it runs receives the
        trainer's versions like a worker process would (same transport, same safe point); when
        it runs the trainer's very object (no device copy), there is nothing to move and
        ``send()`` does nothing."""
        trainer = collector._orig_policy if model_id == "policy" else None
        local = collector.get_model(model_id)
        if not isinstance(trainer, nn.Module):
            trainer = local
        if not isinstance(local, nn.Module):
            raise TypeError(f"WsyncScheme syncs an nn.Module; {model_id!r} is {type(local).__name__}")
        self.model = trainer
        self._per_worker_init = {}
        if local is trainer:
            self._local = None  # the collector runs the trainer's policy object itself
            return
        self._wsync.init_on_sender(model=trainer, num_workers=1, model_id=model_id)
        receiver = WsyncScheme.__new__(WsyncScheme)
        receiver.__setstate__(self.__getstate__())
        receiver.init_on_receiver(model_id=model_id, model=local, worker_idx=0)
        self._local = receiver

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None,
                                                      weights: Any = None) -> None:
        if hasattr(self, "_local"):
            if self._local is not None:
                joined = threading.Thread(target=self._local.connect, kwargs={"worker_idx": 0},
                                          name="wsync-torchrl-local-connect", daemon=True)
                joined.start()
                try:
                    self._wsync.connect()
                finally:
                    joined.join()
            return
        watch = _process_watch(self._watch_procs) if self._watch_procs is not None else None
        try:
            self._wsync.connect(watch=watch)
        except WorkerDiedError as exc:
            raise WorkerStartupError(str(exc), exc.workers) from None
        for w, worker_weights in sorted(self._per_worker_init.items()):  # distinct policy factories
            if w != min(self._per_worker_init):
                self._wsync.send(weights=_as_weights(worker_weights), worker_ids=[w])
        self._per_worker_init = {}

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Snapshot ``weights`` (default: the model) and send it to ``worker_ids`` (default: all).

        ``weights`` may be a module, a TensorDict, a state_dict, a model path in the context, or
        ``{worker: weights}`` for different weights per worker. With ``sync`` it returns once
        the targets applied it. Raises wsync's errors (WorkerTimeoutError names the laggards;
        without ``sync``, WorkerDiedError names the collector's workers whose process is gone, once
        the others were sent the version), ValueError for no weights where the trainer has no
        policy (workers built from distinct ``policy_factory`` entries).
        """
        if not self.initialized_on_sender:
            raise RuntimeError("Must be initialized on sender before sending weights")
        if not self.synchronized_on_sender:
            raise RuntimeError("Must be synchronized on sender before sending weights")
        if getattr(self, "_local", True) is None:  # a single-process Collector running the trainer's object
            if weights is not None:
                _copy_into(self.model, self._resolve(weights))
            return
        ids = _worker_ids(worker_ids)
        if (isinstance(weights, Mapping) and not isinstance(weights, TensorDictBase) and len(weights) > 0
                and all(isinstance(k, int) for k in weights)):
            targets = [i for i in sorted(weights) if ids is None or i in ids]
            handles = [self._wsync.send_async(_as_weights(self._resolve(weights[i])), worker_ids=[i]) for i in targets]
            if self.sync:
                for handle in handles:
                    handle.wait()
            else:
                self._raise_dead(targets)
            return
        if weights is None and getattr(self, "_factories_only", False):
            raise ValueError("the workers build their policies from distinct policy_factory entries, so the trainer "
                             "holds no policy of its own to send: pass the weights to update_policy_weights_() "
                             "(a module, TensorDict or state_dict for every worker, or {worker_idx: weights})")
        weights = self._resolve(weights)
        if self.sync:
            self._wsync.send(_as_weights(weights) if weights is not None else None, worker_ids=ids)
        else:
            self._wsync.send_async(_as_weights(weights) if weights is not None else None, worker_ids=ids)
            self._raise_dead(ids)

    def _raise_dead(self, ids: list[int] | None) -> None:
        """Without ``sync`` nothing waits for the workers: raise WorkerDiedError naming the targets
        among the collector's workers whose process is gone (the others were sent the version)."""
        procs = getattr(self._watch_procs, "procs", None) or []
        dead = {w: f"process {p.pid} exited with code {p.exitcode}" for w, p in enumerate(procs)
                if (ids is None or w in ids) and not p.is_alive()}
        if dead:
            raise WorkerDiedError(f"workers {sorted(dead)} are gone, the others were sent version {self.version}: "
                                  + "; ".join(f"worker {w}: {why}" for w, why in sorted(dead.items())), sorted(dead))

    def _resolve(self, weights: Any) -> Any:
        if isinstance(weights, str):
            if self.context is None:
                raise ValueError(f"Cannot resolve string reference {weights!r} without context")
            return _resolve_model(self.context, weights)
        extra = getattr(self, "_extra_keys", None)
        if extra and weights is not None and not isinstance(weights, nn.Module):
            # TorchRL's weights carry at most the top module's extra state: the rest is the
            # trainer model's current one, sent beside them
            flat = flatten(_as_weights(weights), self.strategy_str)
            missing = [k for k in extra if k not in flat]
            if missing:
                model = flatten(self.model, self.strategy_str)
                flat.update({k: model[k] for k in missing})
                return flat
        return weights

    # -- receiver -------------------------------------------------------------------------------
    def _init_on_receiver_impl(self, *, model_id: str, context: Any = None, model: Any = None,
                               worker_idx: int | None = None, **kwargs: Any) -> None:
        if context is not None:
            self.context = context
            if worker_idx is None:
                worker_idx = getattr(context, "worker_idx", None)
            if model is None:
                model = context.get_model(model_id) if hasattr(context, "get_model") else _resolve_model(context, model_id)
        if worker_idx is None:
            raise ValueError("worker_idx must be provided via context or kwargs")
        if not isinstance(model, nn.Module):
            raise TypeError(f"WsyncScheme receives into an nn.Module, got {type(model).__name__}")
        self.model_id = model_id
        self.worker_idx = worker_idx
        self._model_ref = None
        TorchRLScheme.model.fset(self, model)  # type: ignore[attr-defined]
        self._wsync.init_on_receiver(model=model, worker_idx=worker_idx, model_id=model_id)
        self._wsync.set_apply_guard(self._safepoint.hold)
        self._wsync.add_apply_listener(self._on_applied)
        self._safepoint.install(model)

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        self._wsync.connect()
        self._receiver_thread = threading.Thread(target=self._receive_loop, daemon=True,
                                                 name=f"wsync-torchrl-receiver-{self._worker_idx}")
        self._receiver_thread.start()

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._wsync.receive(timeout=_RECV_SLICE)
            except WsyncError as exc:  # a rejected payload (the sender was told) or the sender gone
                self._receiver_error = exc
                self._stop.wait(_RECV_SLICE)  # a lasting failure must not spin
            except RuntimeError as exc:  # the scheme was shut down under us
                if not self._stop.is_set():
                    self._receiver_error = exc
                return

    def _on_applied(self, version: int) -> None:
        """After a version is applied (still at the safe point's edge, before the ack): bump the
        worker collector's policy version, as TorchRL's own receivers do."""
        context = self.context
        if version > 0 and context is not None:
            if hasattr(context, "increment_version"):
                context.increment_version()
            elif hasattr(context, "update_policy_weights_"):  # a collector of collectors: pass it on
                context.update_policy_weights_(model_id=self.model_id, policy_or_weights=TensorDict.from_module(
                    self.model))

    @TorchRLScheme.context.setter  # type: ignore[attr-defined]
    def context(self, context: Any) -> None:
        """The collector this scheme serves. In a worker, TorchRL's collector keeps a TensorDict
        of aliases of its policy's weights (``policy_weights``, read only by its legacy weight
        updaters); the adapter empties it, as TorchRL does for policies its schemes fill, so that
        no one else holds the policy's memory and each version is mapped in, not copied."""
        TorchRLScheme.context.fset(self, context)  # type: ignore[attr-defined]
        if context is not None and self.initialized_on_receiver:
            held = getattr(context, "policy_weights", None)
            if isinstance(held, TensorDictBase) and not held.is_empty():
                context.policy_weights = TensorDict()

    @TorchRLScheme.model.setter  # type: ignore[attr-defined]
    def model(self, model: Any) -> None:
        """TorchRL re-points the receiver at the policy its worker actually runs (e.g. a copy
        on the policy's device): later versions go there, starting from the one held."""
        previous = self._model_ref() if self._model_ref is not None else None
        TorchRLScheme.model.fset(self, model)  # type: ignore[attr-defined]
        if (model is not None and previous is not None and model is not previous
                and self.initialized_on_receiver and isinstance(model, nn.Module)):
            self._wsync.rebind(model)
            self._safepoint.install(model)

    def receive(self, timeout: float | None = None) -> TensorDictBase | None:
        """Apply the newest version that arrived (waiting up to ``timeout``; None: not at all),
        at the safe point; returns the model's weights if one was applied, else None."""
        if not self.initialized_on_receiver:
            raise RuntimeError("Must be initialized on receiver before receiving weights")
        if not self.synchronized_on_receiver:
            raise RuntimeError("Must be synchronized on receiver before receiving weights")
        error, self._receiver_error = self._receiver_error, None
        if error is not None:  # what the worker's receiving thread met (the sender was told too)
            raise error
        version = self._wsync.receive(timeout=0.0 if timeout is None else timeout)
        if version is None:
            return None
        return TensorDict.from_module(self.model)

    def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Block until this worker holds ``version`` or newer (see wsync's wait_for_version)."""
        return self._wsync.wait_for_version(version, timeout)

    def add_apply_listener(self, listener: Any) -> None:
        """Call ``listener(version)`` in the worker each time a version was applied."""
        self._wsync.add_apply_listener(listener)

    # -- both -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the worker's receiving thread and free the transport; idempotent."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        thread = getattr(self, "_receiver_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._receiver_thread = None
        safepoint = getattr(self, "_safepoint", None)
        if safepoint is not None:
            safepoint.remove()
        local = getattr(self, "_local", None)
        if local is not None:
            local.shutdown()
        core = getattr(self, "_wsync", None)
        if core is not None:
            core.shutdown()
        super().shutdown()


def _copy_into(model: nn.Module, weights: Any) -> None:
    """Copy ``weights`` into ``model`` in place, bit for bit; raises SchemaMismatchError (nothing
    written) when their keys, shapes or dtypes differ."""
    from wsync_core import Layout

    dst = flatten(model, "tensordict", detach=False)
    src = flatten(_as_weights(weights) if not isinstance(weights, nn.Module) else weights)
    src = {k: v for k, v in src.items() if k in dst or EXTRA_STATE not in k}
    dst = {k: v for k, v in dst.items() if k in src or EXTRA_STATE not in k}
    Layout.of(dst).check_matches(Layout.of(src), mine="collector's policy", theirs="weights given",
                                 context="update_policy_weights_")
    with torch.no_grad():
        for key, t in dst.items():
            t.copy_(src[key])


def _fresh_copy(core: WeightSyncScheme) -> WeightSyncScheme:
    clone = WeightSyncScheme.__new__(WeightSyncScheme)
    clone.__setstate__(core.__getstate__())
    return clone


def _sender_model(context: Any, model_id: str) -> tuple[Any, dict[int, Any]]:
    """The trainer's model for ``model_id`` in a collector, and per-worker initial weights when
    the workers build their policies from distinct factories."""
    model = None
    try:
        model = context.get_model(model_id) if hasattr(context, "get_model") else _resolve_model(context, model_id)
    except (AttributeError, KeyError, ValueError):
        model = None
    if isinstance(model, nn.Module):
        return model, {}
    factories = getattr(context, "policy_factory", None) if model_id == "policy" else None
    if factories and any(factories):
        if all(f is factories[0] for f in factories):
            return factories[0](), {}
        per_worker = {i: TensorDict.from_module(f()).data.clone() for i, f in enumerate(factories)}
        return per_worker[0], per_worker
    raise TypeError(f"WsyncScheme syncs an nn.Module; model {model_id!r} of {type(context).__name__} is "
                    f"{type(model).__name__} (policies without parameters need no weight sync)")


def _num_workers(context: Any) -> int:
    n = getattr(context, "num_workers", None)
    if isinstance(n, int):
        return n
    devices = getattr(context, "policy_device", None)
    if isinstance(devices, (list, tuple)):
        return len(devices)
    raise ValueError(f"cannot tell how many workers {type(context).__name__} has; pass num_workers=")


def _worker_ids(worker_ids: Any) -> list[int] | None:
    if worker_ids is None:
        return None
    if isinstance(worker_ids, int):
        return [worker_ids]
    ids = list(worker_ids)
    if not all(isinstance(i, int) for i in ids):
        raise TypeError(f"WsyncScheme targets workers by index; got {worker_ids!r}")
    return ids


def _as_weights(weights: Any) -> Any:
    """Weights as wsync takes them; TorchRL's ``__extra_state__`` entry is the model's
    top-level ``_extra_state``."""
    if isinstance(weights, TensorDictBase) and "__extra_state__" in weights.keys():
        rest = weights.exclude("__extra_state__")
        extra = weights.get("__extra_state__")
        rest.set("_extra_state", extra)
        return rest
    return weights


def _process_watch(context: Any):
    """``connect(watch=...)`` for a TorchRL multi-process collector: a worker whose process
    exited, or whose control pipe already holds TorchRL's start-up error report, is dead; the
    report's traceback (read from TorchRL's own pipe, which TorchRL reads next anyway) says why."""

    def watch(missing: list[int]) -> dict[int, str]:
        procs = getattr(context, "procs", None) or []
        pipes = getattr(context, "pipes", None) or []
        dead: dict[int, str] = {}
        for w in missing:
            if w >= len(procs):
                continue
            proc = procs[w]
            pipe = pipes[w] if w < len(pipes) else None
            report = None
            if pipe is not None and not isinstance(pipe, _Replay) and pipe.poll(0):
                try:
                    report = pipe.recv()
                except (EOFError, OSError):
                    report = None
            if isinstance(report, dict) and report.get("error"):
                dead[w] = report.get("traceback") or f"{report.get('exception_type')}: {report.get('exception_msg')}"
            elif report is not None:  # a message of TorchRL's own ("instantiated"): TorchRL reads it next
                pipes[w] = _Replay(pipe, report)
            elif not proc.is_alive():
                dead[w] = f"process {proc.pid} exited with code {proc.exitcode}"
        return dead

    return watch


class _Replay:
    """A TorchRL control pipe whose first message the start-up watch already read: it gives that
    message back first, then is the pipe itself."""

    def __init__(self, pipe: Any, first: Any) -> None:
        self._pipe = pipe
        self._first = [first]

    def poll(self, timeout: float | None = 0.0) -> bool:
        return bool(self._first) or self._pipe.poll(timeout)

    def recv(self) -> Any:
        return self._first.pop() if self._first else self._pipe.recv()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)
