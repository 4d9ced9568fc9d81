"""The public harness: real receivers that obey JSON commands over a pipe, in a thread, a forked
or spawned process, or a process launched on its own (``python -m wsync_conformance.harness``,
optionally behind a command prefix such as a network namespace's ``ip netns exec NAME``).

``Worker(kind)`` starts one; ``worker.open(scheme, spec, device, idx)`` gives it a receiver
scheme over a model built from ``spec``; ``worker.call("connect", timeout=...)`` runs a scheme
method there and returns its ``Reply``; ``worker.snapshot()`` returns its version and a digest
of every tensor (computed by the suite, not by wsync); ``worker.follow()``/``stop()`` keep it
receiving in between. ``receivers(n, kind)`` is a context manager for a plugin's own tests.

Control messages are plain JSON bytes (``Connection.send_bytes``), never pickles, so a receiver
process can watch for ``pickle.find_class`` audit events and report any unpickling its transport
does. The scheme itself is pickled by the trusted parent and loaded before recording starts:
that is configuration, not wire data.

Every process the harness starts dies with its parent, also when the parent is killed: the
child asks the kernel for SIGKILL on its parent's death (``prctl(PR_SET_PDEATHSIG)``) and a
thread watches its parent's pid. Workers are pooled across tests by ``acquire``/``release``:
a spawned torch process takes seconds to start. A runner goes back to the pool only as it came,
listening on no socket; a runner that used a transport with a trusted runtime (Ray: its
processes listen for the runtime's own calls from the moment it starts, for as long as they
live) may keep listening on what it listened on at its first close, the runtime's sockets.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

__all__ = ["KINDS", "Worker", "Reply", "HarnessError", "acquire", "release", "close_pool", "receivers",
           "waiting", "hung_call", "kill_all", "serve", "die_with_parent", "start_process", "launch", "Processes",
           "process_fixture", "ScriptProcess", "script_workers"]

#: how a receiver runner is started
KINDS: tuple[str, ...] = ("thread", "fork", "spawn", "launched")
_PR_SET_PDEATHSIG = 1
_STACK_SIGNAL = signal.SIGUSR1

# -- the receiver side ----------------------------------------------------------------------------

_audit_events: list[list[str]] = []
_audit_local = threading.local()
_audit = {"process": False, "installed": False}
#: the sockets a trusted runtime listens on in this runner (its listeners at the first close
#: after a transport that declares one was opened here), or None
_runtime_listeners: set[str] | None = None
_runtime_used = False


def _auditing() -> bool:
    return _audit["process"] or getattr(_audit_local, "on", False)


def _audit_hook(event: str, args: tuple) -> None:
    if event == "pickle.find_class" and _auditing():
        _audit_events.append([*(str(a) for a in args), _unpickler()])


#: the pickle machinery, which an unpickling is attributed past (to the code that called it)
_MACHINERY = frozenset({__name__, "pickle", "copyreg", "multiprocessing.connection", "multiprocessing.reduction"})


def _unpickler() -> str:
    """The innermost Python code that is unpickling: ``module:function`` of the nearest frame
    outside this module and the pickle machinery (the C unpickler has no frame of its own)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _MACHINERY:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_name}"


def _recording(load: Any, name: str) -> Any:
    """``load`` (``pickle.loads`` and the like), recording each call made while auditing: an
    unpickling of plain data (bytes, tuples, dicts) looks up no class, so no ``find_class``
    event tells of it."""

    def recorded(*args: Any, **kwargs: Any) -> Any:
        if _auditing():
            _audit_events.append(["(no class)", name, _unpickler()])
        return load(*args, **kwargs)

    return recorded


def _install_audit_hook() -> None:
    """Audit unpickling in this runner: ``find_class`` events, and every call of pickle's loaders
    (``pickle``'s and ``_pickle``'s ``load``/``loads``/``Unpickler.load``, multiprocessing's)."""
    if _audit["installed"]:
        return
    sys.addaudithook(_audit_hook)
    import _pickle
    import multiprocessing.reduction

    for module in (pickle, _pickle):
        for name in ("load", "loads"):
            setattr(module, name, _recording(getattr(module, name), f"{module.__name__}.{name}"))
    load_method = _recording(_pickle.Unpickler.load, "Unpickler.load")
    recorded_unpickler = type("Unpickler", (_pickle.Unpickler,), {"load": load_method, "__module__": "pickle"})
    for module in (pickle, _pickle):  # (setattr: a module's class, replaced)
        setattr(module, "Unpickler", recorded_unpickler)
    forking = multiprocessing.reduction.ForkingPickler
    forking.loads = staticmethod(_recording(forking.loads, "ForkingPickler.loads"))
    _audit["installed"] = True


def die_with_parent(parent: int | None, stack_file: str | None = None) -> None:
    """In a runner process: be killed when ``parent`` dies (kernel signal, and a watch thread for
    the moment before it was set; None: whatever process is the parent now); dump every stack to
    ``stack_file`` on SIGUSR1."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is None:
        parent = os.getppid()
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="wsync-harness-parent-watch", daemon=True).start()
    if stack_file:
        faulthandler.register(_STACK_SIGNAL, file=open(stack_file, "w"), all_threads=True, chain=False)


class _Session:
    def __init__(self, msg: dict[str, Any], process: bool) -> None:
        from .models import ModelSpec, build

        self.scheme = pickle.loads(base64.b64decode(msg["scheme"]))  # trusted: from the parent, as config
        _uses_transport(self.scheme.transport)
        self.spec = ModelSpec.from_json(msg["spec"])
        self.model = build(self.spec, msg["device"])
        self.worker_idx = msg["worker_idx"]
        self.follow: dict[str, Any] | None = None
        self.process = process
        #: references the worker keeps: (version when taken, key -> tensor, key -> last version it
        #: backed the model at, keys that no longer back it)
        self.holds: list[tuple[int, dict[str, Any], dict[str, int], set[str]]] = []
        if msg.get("init", True):
            self.scheme.init_on_receiver(model=self.model, worker_idx=self.worker_idx,
                                         **({"model_id": msg["model_id"]} if msg.get("model_id") else {}))

    def tensors(self) -> dict[str, Any]:
        from wsync_core.weights import flatten

        return flatten(self.model)

    def applied(self) -> None:
        """After the model changed: for each held reference still backing it, note this version.
        A reference that stopped backing the model is retired for good: the slot it views must
        keep that version's values while it lives, even if the model later views the same memory
        again (which a transport may only do once nothing views it)."""
        if not self.holds:
            return
        now = {k: _storage(t) for k, t in self.tensors().items()}
        v = self.scheme.version
        for _, refs, last, retired in self.holds:
            for k, t in refs.items():
                if k in retired:
                    continue
                if _storage(t) == now.get(k):
                    last[k] = v
                else:
                    retired.add(k)

    def hold(self) -> dict[str, Any]:
        tensors = self.tensors()
        v = self.scheme.version
        self.holds.append((v, {k: t.detach() for k, t in tensors.items()}, dict.fromkeys(tensors, v), set()))
        return {"holding": len(self.holds), "version": v}

    def held(self) -> list[dict[str, Any]]:
        from .models import digest_of

        self.applied()
        out = []
        for taken, refs, last, retired in self.holds:
            out.append({"taken": taken, "keys": {k: [digest_of(t), k not in retired, last[k]] for k, t in refs.items()}})
        return out


def _uses_transport(transport: Any) -> None:
    """Note that ``transport`` was opened in this runner (see ``_listening_beyond_runtime``)."""
    global _runtime_used
    from .trust import trusted_runtime

    _runtime_used = _runtime_used or trusted_runtime(type(transport)) is not None


def _listening_beyond_runtime() -> list[str]:
    """The sockets this runner listens on, less a trusted runtime's (see the module's docstring)."""
    global _runtime_listeners
    from . import resources

    listening = resources.listening_sockets()
    if _runtime_used and _runtime_listeners is None:
        _runtime_listeners = set(listening)
    return [sock for sock in listening if sock not in (_runtime_listeners or ())]


def _storage(t) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """Where a tensor's bytes are: storage address, offset, shape and strides."""
    if t.numel() == 0:
        return (0, 0, tuple(t.shape), tuple(t.stride()))
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


class _Endpoint:
    """A bare receiver endpoint (no scheme), for the tests of the transport interface."""

    def __init__(self, msg: dict[str, Any]) -> None:
        import torch
        from wsync_core import Layout, ReceiverContext
        from wsync_core.weights import flatten

        from .models import ModelSpec, build

        transport = pickle.loads(base64.b64decode(msg["transport"]))  # trusted: from the parent, as config
        _uses_transport(transport)
        spec = ModelSpec.from_json(msg["spec"])
        layout = Layout.of(flatten(build(spec, msg["device"])))
        self.endpoint = transport.receiver(ReceiverContext(msg["worker_idx"], layout, msg.get("model_id") or "policy",
                                                           torch.device(msg["device"])))
        self.nbytes = layout.nbytes
        self.worker_idx = msg["worker_idx"]
        self.held: list[Any] = []

    def recv(self, timeout: float, keep: bool, ack: bool = False) -> dict[str, Any]:
        """One recv(); with ``ack``, ack what came as the core would (the version its header names)."""
        from wsync_core import Deadline, TransportError
        from wsync_core.protocol import Ack, Header

        from .models import payload_digest
        from .resources import busiest_threads, demand_by_thread, demand_s

        t0, c0, threads0 = time.monotonic(), demand_s(), demand_by_thread()
        d = self.endpoint.recv(Deadline(timeout))
        took = time.monotonic() - t0
        if d is None:
            return {"delivery": None, "took": took, "cpu": demand_s() - c0,
                    "busiest": busiest_threads(threads0, demand_by_thread())}
        out = {"delivery": {"header": base64.b64encode(bytes(d.header)).decode(), "size": int(d.payload.numel()),
                            "dtype": str(d.payload.dtype), "adoptable": bool(d.adoptable),
                            "digest": payload_digest(d.payload), "expected_size": self.nbytes}, "took": took}
        if keep:
            self.held.append(d)
        elif d.release is not None:
            d.release()
        if ack:
            try:
                version = Header.decode(bytes(d.header)).version
            except TransportError:  # not a header the suite wrote: nothing to ack
                return out
            self.endpoint.ack(Ack(self.worker_idx, version).encode())
        return out

    def shared(self, timeout: float, pointer: int, process: bool) -> dict[str, Any]:
        """Receive one delivery and keep it; say whether its payload is the sender's buffer (same
        process) or lies in memory mapped shared (``/proc/self/maps``)."""
        from wsync_core import Deadline
        from wsync_core.protocol import Header

        d = self.endpoint.recv(Deadline(timeout))
        if d is None:
            return {"version": None}
        self.held.append(d)
        version = Header.decode(bytes(d.header)).version
        p = d.payload
        if p.device.type != "cpu":
            return {"version": version, "shared": True, "where": str(p.device)}
        start = p.data_ptr()
        if not process:
            return {"version": version, "shared": start == pointer, "where": "this process"}
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= start < hi:  # shared, or mapped from a file (copy-on-write): no copy was made
                    return {"version": version, "shared": parts[1][3] == "s" or parts[4] != "0",
                            "where": line.strip()}
        return {"version": version, "shared": False, "where": "no mapping found"}

    def release(self, keep_last: int = 0) -> int:
        """Release the held deliveries but the newest ``keep_last``; returns how many it released."""
        cut = max(0, len(self.held) - keep_last)
        gone, self.held = self.held[:cut], self.held[cut:]
        for d in gone:
            if d.release is not None:
                d.release()
        return len(gone)


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc), "workers": getattr(exc, "workers", None),
            "traceback": traceback.format_exc(limit=6)}


def _state(s: _Session) -> dict[str, Any]:
    return {"version": s.scheme.version, "state": s.scheme.state}


def _opened(s: _Session | None) -> _Session:
    """The session a command works on: the one the parent opened (``open``) and has not closed."""
    if s is None:  # (the command's first use of it raised this: the reply names it)
        raise AttributeError("no receiver session is open: the parent sends 'open' first")
    return s


def _opened_endpoint(e: _Endpoint | None) -> _Endpoint:
    """The endpoint an ``ep_*`` command works on: the one ``ep_open`` made and ``ep_close`` has not closed."""
    if e is None:  # (as _opened)
        raise AttributeError("no receiver endpoint is open: the parent sends 'ep_open' first")
    return e


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
    if method in ("connect", "receive") and s.scheme.worker_idx is not None:
        s.applied()
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
                s.applied()
                result["applied"].append(v)
                if record:
                    result["records"].append([v, s.scheme.version, digests(s.model)])
    finally:
        _audit_local.on = False


def _fill(s: _Session, msg: dict[str, Any]) -> dict[str, Any]:
    """Fill the model (a sender's, in a runner) with the values of ``seed``; return its digests."""
    from .models import digests, fill, random_values

    fill(s.model, random_values(s.spec, msg["seed"]))
    return {"digests": digests(s.model)}


def _shutdown_while_waiting(s: _Session, msg: dict[str, Any]) -> dict[str, Any]:
    """``receive(timeout=wait)`` (or ``connect``, as ``call`` says) in a second thread,
    ``shutdown()`` from this one ``after`` seconds later; reports how the call ended and how long
    each took, waiting ``patience`` seconds at most for the call to end."""
    import time

    out: dict[str, Any] = {}
    call = getattr(s.scheme, msg.get("call", "receive"))

    def wait() -> None:
        try:
            out["result"] = call(timeout=msg["wait"])
        except Exception as exc:  # reported to the parent, which decides
            out.update(error=type(exc).__name__, message=str(exc))
        out["ended"] = time.monotonic()

    thread = threading.Thread(target=wait, name="wsync-conformance-blocked-call", daemon=True)
    thread.start()
    time.sleep(msg["after"])
    t0 = time.monotonic()
    closer = threading.Thread(target=s.scheme.shutdown, name="wsync-conformance-shutdown", daemon=True)
    closer.start()
    closer.join(msg.get("patience", msg["wait"] + 60))
    shutdown_s = time.monotonic() - t0 if not closer.is_alive() else None
    thread.join(msg.get("patience", msg["wait"] + 60))
    return {"result": out.get("result"), "error": None, "call_error": out.get("error"),
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
    endpoint: _Endpoint | None = None
    reply: dict[str, Any]
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
                reply = _call(_opened(session), msg)
            elif cmd == "follow":
                conn.send_bytes(json.dumps({"following": True}).encode())
                _follow(conn, _opened(session), msg)
                continue
            elif cmd == "stop":
                s = _opened(session)
                reply = {**(s.follow or {}), **_state(s)}
                s.follow = None
            elif cmd == "scene":
                from .holding import SCENES

                reply = SCENES[msg["name"]](session, **msg.get("kwargs", {}))
            elif cmd == "snapshot":
                s = _opened(session)
                reply = {**_state(s), "digests": digests(s.model)}
            elif cmd == "fill":
                reply = _fill(_opened(session), msg)
            elif cmd == "hold":
                reply = _opened(session).hold()
            elif cmd == "held":
                reply = {"held": _opened(session).held()}
            elif cmd == "ep_open":
                from wsync_core import Deadline

                if endpoint is not None:
                    endpoint.release()
                    endpoint.endpoint.close()
                endpoint = _Endpoint(msg)
                t0 = time.monotonic()
                if msg.get("open", True):
                    endpoint.endpoint.open(Deadline(msg["timeout"]))
                reply = {"opened": msg.get("open", True), "took": time.monotonic() - t0}
            elif cmd == "ep_recv":
                reply = _opened_endpoint(endpoint).recv(msg["timeout"], msg.get("keep", False), msg.get("ack", False))
            elif cmd == "ep_shared":
                reply = _opened_endpoint(endpoint).shared(msg["timeout"], msg["pointer"], process)
            elif cmd == "ep_held":
                from .models import payload_digest

                reply = {"digests": [payload_digest(d.payload) for d in _opened_endpoint(endpoint).held]}
            elif cmd == "ep_release":
                reply = {"released": _opened_endpoint(endpoint).release(msg.get("keep_last", 0))}
            elif cmd == "ep_ack":
                _opened_endpoint(endpoint).endpoint.ack(base64.b64decode(msg["data"]))
                reply = {"acked": True}
            elif cmd == "ep_close":
                closing = _opened_endpoint(endpoint)
                if not msg.get("keep", False):
                    closing.release()
                if "ack" in msg:  # acked right before closing, in one request: no round trip between
                    closing.endpoint.ack(base64.b64decode(msg["ack"]))
                t0 = time.monotonic()
                closing.endpoint.close()
                reply = {"closed": True, "took": time.monotonic() - t0}
                endpoint = None
            elif cmd == "pickle":
                from .portable import inspect_pickle

                reply = inspect_pickle(_opened(session).scheme)
            elif cmd == "shutdown_while_waiting":
                reply = _shutdown_while_waiting(_opened(session), msg)
            elif cmd == "raw_ack":  # a broken or hostile worker: any bytes, sent as its ack
                _opened(session).scheme._role.endpoint.ack(base64.b64decode(msg["data"]))
                reply = {"sent": True}
            elif cmd == "reshape":
                reply = _reshape(_opened(session), msg["key"])
            elif cmd == "audit":
                reply = {"events": list(_audit_events)}
            elif cmd == "resources":
                reply = resources.snapshot(exclude_threads=set(msg.get("exclude_threads", [])))
            elif cmd == "close":
                _audit["process"] = False
                if endpoint is not None:
                    endpoint.release()
                    endpoint.endpoint.close()
                    endpoint = None
                if session is not None:
                    session.scheme.shutdown()
                session = None
                reply = {"closed": True, "listening": _listening_beyond_runtime() if process else []}
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


def _process_main(conn, parent: int, stack_file: str) -> None:
    """A forked or spawned runner: die with the parent, then serve."""
    die_with_parent(parent, stack_file)
    serve(conn, True)


def _launched_main(argv: Sequence[str]) -> None:
    """``python -m wsync_conformance.harness SOCKET_PATH PARENT_PID STACK_FILE``: connect back and serve."""
    path, parent, stack_file = argv[0], int(argv[1]), argv[2]
    die_with_parent(parent, stack_file)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    serve(multiprocessing.connection.Connection(sock.detach()), True)


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


_live: set[Worker] = set()
_live_lock = threading.Lock()


class Worker:
    """One receiver runner and its control pipe.

    ``kind`` is ``thread``, ``fork``, ``spawn`` or ``launched`` (``python -m wsync_conformance.harness``
    started with ``subprocess``, after ``prefix``: e.g. a ``netns.Host.prefix``); ``process=True``
    is ``spawn``, ``False`` is ``thread``. Raises HarnessError if it does not answer within
    ``start_timeout`` seconds.
    """

    def __init__(self, process: bool | None = None, *, kind: str | None = None, prefix: Sequence[str] = (),
                 start_timeout: float = 180.0, wait: bool = True) -> None:
        kind = kind or ("spawn" if process or process is None else "thread")
        if kind not in KINDS:
            raise ValueError(f"harness worker kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.process = kind != "thread"
        self.broken = False
        self.pending: str | None = None  # the command sent and not yet answered
        self.pid: int | None = None
        self._dir = tempfile.mkdtemp(prefix="wsync-harness-") if self.process else None
        self.stack_file = os.path.join(self._dir, "stack.txt") if self._dir else ""
        parent = os.getpid()
        if kind == "thread":
            self.conn, child = multiprocessing.Pipe()
            self.runner: Any = threading.Thread(target=serve, args=(child, False), daemon=True,
                                                name="wsync-conformance-receiver")
            self.runner.start()
        elif kind in ("fork", "spawn"):
            ctx = multiprocessing.get_context(kind)
            self.conn, child = ctx.Pipe()
            # (typeshed types get_context(str) as a BaseContext, which has no Process: every start method's has)
            self.runner = ctx.Process(  # type: ignore[attr-defined]
                target=_process_main, args=(child, parent, self.stack_file), daemon=True,
                name="wsync-conformance-receiver")
            self.runner.start()
            child.close()
        else:
            self.conn, self.runner = self._launch(prefix, parent, start_timeout)
        with _live_lock:
            _live.add(self)
        if wait:
            self.wait_started(start_timeout)

    def _launch(self, prefix: Sequence[str], parent: int, timeout: float):
        directory = self._dir
        assert directory is not None  # (a launched runner is a process: __init__ made its directory)
        path = os.path.join(directory, "control.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(timeout)
            proc = subprocess.Popen([*prefix, sys.executable, "-m", "wsync_conformance.harness", path, str(parent),
                                     self.stack_file], stdin=subprocess.DEVNULL)
            try:
                sock, _ = listener.accept()
            except OSError as exc:
                proc.kill()
                proc.wait(30)
                raise HarnessError(f"a launched receiver runner did not connect back within {timeout:g} s ({exc})") from None
        finally:
            listener.close()
        sock.settimeout(None)
        return multiprocessing.connection.Connection(sock.detach()), proc

    def wait_started(self, timeout: float = 180.0) -> None:
        self.pid = self.request("ping", within=timeout)["pid"]

    @property
    def label(self) -> str:
        if self.kind == "thread":
            return f"thread {self.runner.ident}"
        return f"{self.kind} process {self.pid}"

    def alive(self) -> bool:
        if self.broken:
            return False
        if self.kind == "launched":
            return self.runner.poll() is None
        return self.runner.is_alive()

    def send(self, cmd: str, **kw: Any) -> None:
        self.pending = f"{cmd!r}" + (f" ({kw['method']})" if "method" in kw else "")
        try:
            self.conn.send_bytes(json.dumps({"cmd": cmd, **kw}).encode())
        except OSError as exc:
            self.broken = True
            raise HarnessError(f"receiver runner {self.pid} cannot be reached ({exc})") from None

    def recv(self, timeout: float, what: str = "reply") -> Reply:
        try:
            ready = self.conn.poll(timeout)
        except OSError as exc:
            self.broken = True
            raise HarnessError(f"receiver runner {self.pid} cannot be reached ({exc})") from None
        if not ready:
            self.broken = True  # its next answer would be out of step: never reuse it
            raise HarnessError(f"receiver runner {self.pid} gave no {what} within {timeout:g} s (hung in the transport?)")
        try:
            reply = Reply(json.loads(self.conn.recv_bytes()))
        except (EOFError, OSError) as exc:
            self.broken = True
            raise HarnessError(f"receiver runner {self.pid} died ({exc})") from None
        if not reply.get("following"):
            self.pending = None
        return reply

    def request(self, cmd: str, within: float = 60.0, **kw: Any) -> Reply:
        """Send command ``cmd`` (``kw`` as its fields) and wait up to ``within`` seconds for the answer."""
        self.send(cmd, **kw)
        return self.recv(within, f"answer to {cmd!r}")

    def open(self, scheme, spec, device: str, worker_idx: int, *, init: bool = True, model_id: str | None = None,
             timeout: float = 120.0) -> Reply:
        """Give this runner a receiver ``scheme`` (pickled here) over a model built from ``spec``."""
        blob = base64.b64encode(pickle.dumps(scheme)).decode()
        return self.request("open", timeout, scheme=blob, spec=spec.to_json(), device=device, worker_idx=worker_idx,
                            init=init, model_id=model_id).raise_for_error(f"worker {worker_idx}: opening a receiver")

    def call(self, method: str, **kwargs: Any) -> Reply:
        """Call ``scheme.<method>(**kwargs)`` in the receiver; the reply names the error it raised."""
        wait = float(kwargs.get("timeout") or 0.0) + 60.0
        return self.request("call", wait, method=method, kwargs=kwargs)

    def call_async(self, method: str, **kwargs: Any) -> None:
        self.send("call", method=method, kwargs=kwargs)

    def follow(self, record: bool = False, poll: float = 0.01) -> None:
        self.request("follow", 60.0, record=record, poll=poll)

    def stop(self, timeout: float = 60.0) -> Reply:
        return self.request("stop", timeout)

    def scene(self, name: str, **kwargs: Any) -> Reply:
        """Run ``holding.SCENES[name](session, **kwargs)`` in the receiver; raises HarnessError on error."""
        wait = float(kwargs.get("timeout") or 0.0) + 120.0
        return self.request("scene", wait, name=name, kwargs=kwargs).raise_for_error(f"scene {name!r}")

    def snapshot(self) -> Reply:
        """The runner's scheme version and the digest of each of its model's tensors."""
        return self.request("snapshot").raise_for_error("snapshot")

    def hold(self) -> Reply:
        """The runner keeps a reference to each tensor of its model as it is now."""
        return self.request("hold").raise_for_error("hold")

    def held(self) -> list[dict[str, Any]]:
        """For each hold: the version it was taken at, and per key [digest now, still backs the
        model, the last version it backed the model at]."""
        return self.request("held").raise_for_error("held")["held"]

    def close_session(self, timeout: float = 60.0) -> None:
        """The runner closes its bare endpoint and shuts its scheme down; raises HarnessError if it
        does not answer within ``timeout`` seconds."""
        self.request("close", timeout)

    def dump_stack(self) -> str:
        """Every thread's stack in the runner now (a process: dumped by faulthandler on SIGUSR1)."""
        if not self.process:
            frame = sys._current_frames().get(self.runner.ident)
            return "".join(traceback.format_stack(frame)) if frame is not None else "(thread gone)"
        if self.pid is None or not self.alive():
            return "(process gone)"
        try:
            size = os.path.getsize(self.stack_file) if os.path.exists(self.stack_file) else 0
            os.kill(self.pid, _STACK_SIGNAL)
            for _ in range(20):
                time.sleep(0.1)
                if os.path.exists(self.stack_file) and os.path.getsize(self.stack_file) > size:
                    break
            with open(self.stack_file) as f:
                f.seek(size)
                return f.read()
        except OSError as exc:
            return f"(no stack: {exc})"

    def kill(self) -> None:
        """Kill the runner with SIGKILL (a thread cannot be: it is abandoned, marked broken)."""
        alive = self.alive()  # before marking it broken: a broken runner does not count as alive
        self.broken = True
        if self.process and alive:
            self.runner.kill()
        if self.process:
            if self.kind == "launched":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.runner.wait(10)
            else:
                self.runner.join(10)
        self._forget()

    def exit(self) -> int | None:
        """End the runner (its scheme shut down first, then a normal end); the process's exit
        status (negative: the signal that ended it, -9 if it had to be killed), None for a thread."""
        try:
            self.request("exit", 30.0)
        except HarnessError:
            pass
        if self.kind == "launched":
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.runner.wait(30)
        else:
            self.runner.join(30)
        if self.process and self.alive():
            self.runner.kill()
            if self.kind != "launched":
                self.runner.join(10)
        self._forget()
        if not self.process:
            return None
        return self.runner.returncode if self.kind == "launched" else self.runner.exitcode

    def _forget(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        with _live_lock:
            _live.discard(self)


def waiting() -> list[tuple[Worker, str]]:
    """The live runners with a command sent and not answered yet (runner, the command), leaving
    out those whose answer waits in the pipe."""
    with _live_lock:
        busy = [(w, w.pending) for w in _live if w.pending and not w.broken]
    out = []
    for w, what in busy:
        try:
            answered = w.conn.poll(0)
        except OSError:
            continue
        if not answered:
            out.append((w, what))
    return out


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')


def hung_call(stack: str) -> str | None:
    """In a faulthandler dump or a formatted stack: the call below the core's (or the harness's)
    last frame in the first thread that has one, e.g. ``recv() (transport.py:120)``."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack)
    for block in blocks:
        frames = [m.groupdict() for m in _FRAME.finditer(block)]
        if "most recent call first" in block:
            frames.reverse()  # faulthandler lists the innermost first
        below = None
        for i, f in enumerate(frames):
            if "wsync_core" in f["file"] or "wsync_conformance" in f["file"]:
                below = i
        if below is not None and below + 1 < len(frames):
            f = frames[below + 1]
            return f"{f['func']}() ({os.path.basename(f['file'])}:{f['line']})"
    return None


def kill_all() -> None:
    """Kill every runner process this process started (at a hang that cannot be interrupted)."""
    with _live_lock:
        workers = list(_live)
    for w in workers:
        with contextlib.suppress(Exception):
            w.kill()


_pool: dict[str, list[Worker]] = {k: [] for k in KINDS}
_pool_lock = threading.Lock()


def acquire(n: int, process: bool | None = None, *, kind: str | None = None) -> list[Worker]:
    """``n`` idle receiver runners of ``kind`` (started as needed, in parallel; dead ones replaced)."""
    kind = kind or ("spawn" if process or process is None else "thread")
    with _pool_lock:
        pool = _pool[kind]
        pool[:] = [w for w in pool if w.alive()]
        started: list[Worker] = []
        try:
            while len(pool) + len(started) < n:
                started.append(Worker(kind=kind, wait=False))  # from this thread: see die_with_parent
            errors: list[BaseException] = []

            def ping(w: Worker) -> None:
                try:
                    w.wait_started()
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=ping, args=(w,)) for w in started]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
        except BaseException:
            for w in started:
                w.kill()
            raise
        pool.extend(started)
        taken, rest = pool[:n], pool[n:]
        pool[:] = rest
        return taken


def release(workers: list[Worker]) -> None:
    """Close each runner's session and return the clean ones to the pool; kill the others (dead,
    failing to close, or still listening on a socket), so no test inherits another's leftovers."""
    for w in workers:
        healthy = w.alive()
        if healthy:
            try:
                # a follow or a call left running by a failed test answers first
                w.send("close")
                for _ in range(3):
                    reply = w.recv(30.0, "answer to 'close'")
                    if reply.get("closed") or reply.error:
                        break
                healthy = bool(reply.get("closed")) and not reply.get("listening")
            except (HarnessError, OSError):
                healthy = False
        if healthy:
            w.pending = None
            with _pool_lock:
                _pool[w.kind].append(w)
        else:
            w.kill()


def close_pool() -> None:
    """Stop every pooled runner (at exit, or at the end of a test session)."""
    with _pool_lock:
        workers = [w for pool in _pool.values() for w in pool]
        for pool in _pool.values():
            pool.clear()
    for w in workers:
        w.exit()


@contextlib.contextmanager
def receivers(n: int, kind: str = "spawn", prefix: Sequence[str] = ()) -> Iterator[list[Worker]]:
    """``n`` fresh runners of ``kind`` (not pooled), each killed on exit whatever happens."""
    started: list[Worker] = []
    try:
        for _ in range(n):
            started.append(Worker(kind=kind, prefix=prefix, wait=False))
        for w in started:
            w.wait_started()
        yield started
    finally:
        for w in started:
            if w.alive():
                w.exit()
            else:
                w.kill()


atexit.register(close_pool)


# -- any receiver code of a plugin's own tests ------------------------------------------------------


def _run_target(parent: int | None, target, args: tuple) -> None:
    die_with_parent(parent)
    target(*args)


def start_process(target, *args: Any, kind: str = "spawn", daemon: bool = True):
    """Run ``target(*args)`` in a new ``kind`` ("spawn", "fork" or "forkserver") process that dies
    with this one; returns the started ``multiprocessing.Process``. ``target`` must be importable."""
    ctx = multiprocessing.get_context(kind)
    parent = None if kind == "forkserver" else os.getpid()  # a forkserver child's parent is the server
    # (typeshed types get_context(str) as a BaseContext, which has no Process: every start method's has)
    proc = ctx.Process(target=_run_target, args=(parent, target, args), daemon=daemon)  # type: ignore[attr-defined]
    proc.start()
    return proc


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def launch(argv: Sequence[str], prefix: Sequence[str] = (), **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen([*prefix, *argv], **popen)`` for a process launched on its own (a script,
    behind e.g. ``ip netns exec NAME``), killed by the kernel if this process dies."""
    if sys.platform.startswith("linux"):
        popen.setdefault("preexec_fn", _set_pdeathsig)
    return subprocess.Popen([*prefix, *argv], **popen)


class Processes:
    """Processes started for one test: ``start(target, *args)`` gives each a command pipe (its last
    argument) and returns (process, the parent's end); ``close()`` kills and joins them all."""

    def __init__(self, kind: str = "spawn") -> None:
        self.ctx = multiprocessing.get_context(kind)
        self.kind = kind
        self.started: list[tuple[Any, Any]] = []

    def start(self, target, *args: Any):
        parent, child = self.ctx.Pipe()
        proc = start_process(target, *args, child, kind=self.kind)
        child.close()
        self.started.append((proc, parent))
        return proc, parent

    def close(self) -> None:
        for proc, conn in self.started:
            if proc.is_alive():
                proc.kill()
            proc.join(30)
            conn.close()
        self.started.clear()


def process_fixture(name: str = "spawn", kind: str = "spawn"):
    """A pytest fixture (called ``name``) giving ``Processes(kind).start``; all killed after the test."""
    import pytest

    def fixture() -> Iterator:
        procs = Processes(kind)
        try:
            yield procs.start
        finally:
            procs.close()

    return pytest.fixture(fixture, name=name)


from .scripts import ScriptProcess, script_workers  # noqa: E402  (the "launched" kind, for scripts)

if __name__ == "__main__":
    _launched_main(sys.argv[1:])
