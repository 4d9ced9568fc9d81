"""Real receivers for the suite: each runs in its own spawned process (or a thread, for a
transport without the ``processes`` capability) and obeys JSON commands over a pipe.

Control messages are plain JSON bytes (``Connection.send_bytes``), never pickles, so a
receiver process can watch for ``pickle.find_class`` audit events and report any unpickling
its transport does. The scheme itself is pickled by the trusted parent and loaded before
recording starts: that is configuration, not wire data.

Workers are pooled and reused across tests: a spawned torch process takes seconds to start.
"""

from __future__ import annotations

import atexit
import base64
import json
import multiprocessing
import os
import pickle
import sys
import threading
import traceback
from typing import Any

__all__ = ["Worker", "Reply", "HarnessError", "acquire", "release", "close_pool"]

# -- the receiver side ----------------------------------------------------------------------------

_audit_events: list[list[str]] = []
_audit_local = threading.local()
_audit = {"process": False, "installed": False}


def _audit_hook(event: str, args: tuple) -> None:
    if event == "pickle.find_class" and (_audit["process"] or getattr(_audit_local, "on", False)):
        _audit_events.append([str(a) for a in args])


def _install_audit_hook() -> None:
    if not _audit["installed"]:
        sys.addaudithook(_audit_hook)
        _audit["installed"] = True


class _Session:
    def __init__(self, msg: dict[str, Any], process: bool) -> None:
        from .models import ModelSpec, build

        self.scheme = pickle.loads(base64.b64decode(msg["scheme"]))  # trusted: from the parent, as config
        self.spec = ModelSpec.from_json(msg["spec"])
        self.model = build(self.spec, msg["device"])
        self.worker_idx = msg["worker_idx"]
        self.follow: dict[str, Any] | None = None
        self.process = process
        if msg.get("init", True):
            self.scheme.init_on_receiver(model=self.model, worker_idx=self.worker_idx,
                                         **({"model_id": msg["model_id"]} if msg.get("model_id") else {}))


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc), "workers": getattr(exc, "workers", None),
            "traceback": traceback.format_exc(limit=6)}


def _state(s: _Session) -> dict[str, Any]:
    return {"version": s.scheme.version, "state": s.scheme.state}


def _call(s: _Session, msg: dict[str, Any]) -> dict[str, Any]:
    method, kwargs = msg["method"], dict(msg.get("kwargs", {}))
    if method in ("init_on_receiver", "init_on_sender"):
        kwargs["model"] = s.model
        if method == "init_on_receiver":
            kwargs.setdefault("worker_idx", s.worker_idx)
        else:
            kwargs.setdefault("num_workers", 1)
    if method not in ("connect", "receive", "shutdown", "init_on_receiver", "init_on_sender", "send", "send_async"):
        raise ValueError(f"harness cannot call {method!r}")
    _audit_local.on = True
    try:
        result = getattr(s.scheme, method)(**kwargs)
    finally:
        _audit_local.on = False
    return {"result": result if isinstance(result, (int, type(None))) else repr(result), **_state(s)}


def _follow(conn, s: _Session, msg: dict[str, Any]) -> None:
    """Receive in a loop until the next command arrives; record versions (and digests)."""
    from .models import digests

    record, poll = msg.get("record", False), msg.get("poll", 0.01)
    result: dict[str, Any] = {"applied": [], "records": []}
    s.follow = result
    _audit_local.on = True
    try:
        while not conn.poll(0):
            try:
                v = s.scheme.receive(timeout=poll)
            except Exception as exc:  # reported to the parent with the next reply
                result.setdefault("errors", []).append(_error(exc))
                if len(result["errors"]) > 20:
                    break
                continue
            if v is not None:
                result["applied"].append(v)
                if record:
                    result["records"].append([v, s.scheme.version, digests(s.model)])
    finally:
        _audit_local.on = False


def _shutdown_while_receiving(s: _Session, msg: dict[str, Any]) -> dict[str, Any]:
    """``receive(timeout=wait)`` in a second thread, ``shutdown()`` from this one ``after`` seconds
    later; reports how the receive ended and how long each took."""
    import time

    out: dict[str, Any] = {}

    def wait() -> None:
        try:
            out["result"] = s.scheme.receive(timeout=msg["wait"])
        except Exception as exc:  # reported to the parent, which decides
            out.update(error=type(exc).__name__, message=str(exc))
        out["ended"] = time.monotonic()

    thread = threading.Thread(target=wait, name="wsync-conformance-blocked-receive", daemon=True)
    thread.start()
    time.sleep(msg["after"])
    t0 = time.monotonic()
    s.scheme.shutdown()
    shutdown_s = time.monotonic() - t0
    thread.join(msg["wait"] + 60)
    return {"result": out.get("result"), "error": None, "receive_error": out.get("error"),
            "message": out.get("message"), "shutdown_s": shutdown_s,
            "ended_after_s": out["ended"] - t0 if "ended" in out else None}


def _reshape(s: _Session, key: str) -> dict[str, Any]:
    """Replace tensor ``key`` of a state_dict receiver model by one element longer, so its next
    receive rejects the version (SchemaMismatchError) and leaves the model as it is."""
    import torch

    t = s.model[key]
    s.model[key] = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    return {"reshaped": key}


def serve(conn, process: bool) -> None:
    """Answer the parent's commands until ``exit``; one receiver session at a time."""
    from . import resources
    from .models import digests

    _install_audit_hook()
    session: _Session | None = None
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            break
        msg = json.loads(raw)
        cmd = msg["cmd"]
        try:
            if cmd == "ping":
                reply = {"pid": os.getpid()}
            elif cmd == "open":
                if session is not None:
                    session.scheme.shutdown()
                session = None
                _audit_events.clear()
                session = _Session(msg, process)
                _audit["process"] = process
                reply = _state(session)
            elif cmd == "call":
                reply = _call(session, msg)
            elif cmd == "follow":
                conn.send_bytes(json.dumps({"following": True}).encode())
                _follow(conn, session, msg)
                continue
            elif cmd == "stop":
                reply = {**(session.follow or {}), **_state(session)}
                session.follow = None
            elif cmd == "scene":
                from .holding import SCENES

                reply = SCENES[msg["name"]](session, **msg.get("kwargs", {}))
            elif cmd == "snapshot":
                reply = {**_state(session), "digests": digests(session.model)}
            elif cmd == "pickle":
                from .portable import inspect_pickle

                reply = inspect_pickle(session.scheme)
            elif cmd == "shutdown_while_receiving":
                reply = _shutdown_while_receiving(session, msg)
            elif cmd == "raw_ack":  # a broken or hostile worker: any bytes, sent as its ack
                session.scheme._role.endpoint.ack(base64.b64decode(msg["data"]))
                reply = {"sent": True}
            elif cmd == "reshape":
                reply = _reshape(session, msg["key"])
            elif cmd == "audit":
                reply = {"events": list(_audit_events)}
            elif cmd == "resources":
                reply = resources.snapshot(exclude_threads=set(msg.get("exclude_threads", [])))
            elif cmd == "close":
                _audit["process"] = False
                if session is not None:
                    session.scheme.shutdown()
                session = None
                reply = {"closed": True}
            elif cmd == "exit":
                _audit["process"] = False
                if msg.get("abrupt"):
                    conn.send_bytes(b'{"exiting": true}')
                    os._exit(0)
                if session is not None:
                    session.scheme.shutdown()
                conn.send_bytes(b'{"exiting": true}')
                break
            else:
                raise ValueError(f"unknown harness command {cmd!r}")
        except Exception as exc:  # every failure goes back to the parent, which decides
            reply = _error(exc)
        try:
            conn.send_bytes(json.dumps(reply).encode())
        except (OSError, BrokenPipeError):
            break
    conn.close()


# -- the parent side --------------------------------------------------------------------------


class HarnessError(AssertionError):
    """A receiver did not answer its command in time, or died."""


class Reply(dict):
    """A worker's answer; ``error`` is the exception type name when the call raised."""

    @property
    def error(self) -> str | None:
        return self.get("error")

    def raise_for_error(self, what: str) -> Reply:
        if self.error:
            raise HarnessError(f"{what} raised {self.error}: {self.get('message')}\n{self.get('traceback', '')}")
        return self


class Worker:
    """One receiver runner (a spawned process or a thread) and its control pipe."""

    def __init__(self, process: bool) -> None:
        self.process = process
        if process:
            ctx = multiprocessing.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.runner = ctx.Process(target=serve, args=(child, True), daemon=True, name="wsync-conformance-receiver")
        else:
            self.conn, child = multiprocessing.Pipe()
            self.runner = threading.Thread(target=serve, args=(child, False), daemon=True,
                                           name="wsync-conformance-receiver")
        self.broken = False
        self.runner.start()
        if process:
            child.close()
        self.pid = self.request("ping", timeout=180.0)["pid"]

    def alive(self) -> bool:
        return self.runner.is_alive() and not self.broken

    def send(self, cmd: str, **kw: Any) -> None:
        self.conn.send_bytes(json.dumps({"cmd": cmd, **kw}).encode())

    def recv(self, timeout: float, what: str = "reply") -> Reply:
        if not self.conn.poll(timeout):
            self.broken = True  # its next answer would be out of step: never reuse it
            raise HarnessError(f"receiver runner {self.pid} gave no {what} within {timeout:g} s (hung in the transport?)")
        try:
            return Reply(json.loads(self.conn.recv_bytes()))
        except (EOFError, OSError) as exc:
            raise HarnessError(f"receiver runner {self.pid} died ({exc})") from None

    def request(self, cmd: str, timeout: float = 120.0, **kw: Any) -> Reply:
        self.send(cmd, **kw)
        return self.recv(timeout, f"answer to {cmd!r}")

    def open(self, scheme, spec, device: str, worker_idx: int, *, init: bool = True, model_id: str | None = None,
             timeout: float = 120.0) -> Reply:
        blob = base64.b64encode(pickle.dumps(scheme)).decode()
        return self.request("open", timeout, scheme=blob, spec=spec.to_json(), device=device, worker_idx=worker_idx,
                            init=init, model_id=model_id).raise_for_error(f"worker {worker_idx}: opening a receiver")

    def call(self, method: str, **kwargs: Any) -> Reply:
        """Call ``scheme.<method>(**kwargs)`` in the receiver; the reply names the error it raised."""
        wait = float(kwargs.get("timeout") or 0.0) + 120.0
        return self.request("call", wait, method=method, kwargs=kwargs)

    def call_async(self, method: str, **kwargs: Any) -> None:
        self.send("call", method=method, kwargs=kwargs)

    def follow(self, record: bool = False, poll: float = 0.01) -> None:
        self.request("follow", 60.0, record=record, poll=poll)

    def stop(self, timeout: float = 120.0) -> Reply:
        return self.request("stop", timeout)

    def scene(self, name: str, **kwargs: Any) -> Reply:
        """Run ``holding.SCENES[name](session, **kwargs)`` in the receiver; raises HarnessError on error."""
        wait = float(kwargs.get("timeout") or 0.0) + 120.0
        return self.request("scene", wait, name=name, kwargs=kwargs).raise_for_error(f"scene {name!r}")

    def snapshot(self) -> Reply:
        return self.request("snapshot").raise_for_error("snapshot")

    def close_session(self) -> None:
        self.request("close", 60.0)

    def kill(self) -> None:
        if self.process and self.runner.is_alive():
            self.runner.kill()
            self.runner.join(10)
        self.conn.close()

    def exit(self) -> None:
        try:
            self.request("exit", 30.0)
        except HarnessError:
            pass
        self.runner.join(30)
        if self.process and self.runner.is_alive():
            self.runner.kill()
            self.runner.join(10)
        self.conn.close()


_pool: dict[bool, list[Worker]] = {True: [], False: []}
_pool_lock = threading.Lock()


def acquire(n: int, process: bool) -> list[Worker]:
    """``n`` idle receiver runners (spawned as needed; dead ones replaced)."""
    with _pool_lock:
        pool = _pool[process]
        pool[:] = [w for w in pool if w.alive()]
        while len(pool) < n:
            pool.append(None)  # type: ignore[arg-type]  # placeholder, filled below in parallel
        missing = [i for i, w in enumerate(pool) if w is None]
        if missing:
            made: dict[int, Worker] = {}
            errors: list[BaseException] = []

            def start(i: int) -> None:
                try:
                    made[i] = Worker(process)
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=start, args=(i,)) for i in missing]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i in missing:
                pool[i] = made.get(i)  # type: ignore[assignment]
            pool[:] = [w for w in pool if w is not None]
            if errors:
                raise errors[0]
        taken, rest = pool[:n], pool[n:]
        pool[:] = rest
        return taken


def release(workers: list[Worker]) -> None:
    """Close each runner's session and return the healthy ones to the pool."""
    for w in workers:
        healthy = w.alive()
        if healthy:
            try:
                # a follow or a call left running by a failed test answers first
                w.send("close")
                for _ in range(3):
                    reply = w.recv(60.0, "answer to 'close'")
                    if reply.get("closed") or reply.error:
                        break
            except HarnessError:
                healthy = False
        if healthy:
            with _pool_lock:
                _pool[w.process].append(w)
        else:
            w.kill()


def close_pool() -> None:
    """Stop every pooled runner (at exit, or at the end of a test session)."""
    with _pool_lock:
        workers = _pool[True] + _pool[False]
        _pool[True], _pool[False] = [], []
    for w in workers:
        w.exit()


atexit.register(close_pool)
