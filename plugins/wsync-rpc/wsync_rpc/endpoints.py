"""The sender and receiver endpoints, and the process-wide RPC agent they share.

Every message is a TorchScript function whose body is a ``wsync_rpc::`` operator implemented
here in Python: RPC carries its arguments (ints and tensors) with TorchScript's own tensor
serializer, so wsync's traffic never goes through Python's pickle.

Deliveries are numbered when published (``seq``, one number per publish), and the sender writes
each worker's newest number to its TCP store at publish (``_newest_key``; one ``multi_set``, no
reply awaited). A receiver whose ``receive()`` finds a delivery waiting reads that key (the
store's C++ server answers even while the trainer's Python is busy) and waits for that delivery
(``ReceiverBase``'s probe): a worker that was away never applies a version that a newer one
published before its ``receive()`` replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import socket
import struct
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.rpc import api as rpc_api
from wsync_core import (
    AckPusher,
    Acked,
    Buffer,
    Deadline,
    Delivery,
    Joined,
    Left,
    ReceiverBase,
    ReceiverContext,
    SenderBase,
    SenderContext,
    TransportError,
    WorkerTimeoutError,
)
from wsync_core import forked
from wsync_core.forked import close_inherited
from wsync_core.protocol import MAX_ACK_BYTES, MAX_HEADER_BYTES
from wsync_core.transport import wait_listening

__all__ = ["RpcSender", "RpcReceiver", "SENDER", "worker_name"]

log = logging.getLogger("wsync.rpc")

SENDER = "wsync-sender"


def worker_name(worker: int) -> str:
    """The RPC name of worker ``worker`` (rank ``worker + 1``)."""
    return f"wsync-worker-{worker}"


# -- what arrives, per process (one RPC agent per process) ------------------------------------
_cond = threading.Lock()
_owner: list[object] = []  # the endpoint that holds this process's RPC agent


def _owned(kind: type) -> Any:
    """This process's endpoint if it is a ``kind``, else None."""
    with _cond:
        owner = _owner[0] if _owner else None
    return owner if isinstance(owner, kind) else None


def _deliver_impl(seq: int, header: torch.Tensor, payload: torch.Tensor) -> int:
    receiver = _owned(RpcReceiver)
    if receiver is None or header.numel() > MAX_HEADER_BYTES:
        return 0
    receiver.arrived(seq, header.numpy().tobytes(), payload)
    return 1


def _event_impl(kind: int, worker: int, data: torch.Tensor) -> int:
    sender = _owned(RpcSender)
    if sender is None or not 0 <= worker < sender.ctx.num_workers:
        return 0
    if kind == _JOIN:
        sender.emit(Joined(worker))
    elif kind == _ACK and data.numel() <= MAX_ACK_BYTES:
        sender.emit(Acked(worker, data.numpy().tobytes()))
    elif kind == _LEAVE:
        sender.emit(Left(worker, "receiver shut down"))
    return 1


_lib = torch.library.Library("wsync_rpc", "DEF")
_lib.define("deliver(int seq, Tensor header, Tensor payload) -> int")
_lib.define("event(int kind, int worker, Tensor data) -> int")
_lib.impl("deliver", _deliver_impl, "CompositeExplicitAutograd")
_lib.impl("event", _event_impl, "CompositeExplicitAutograd")


@torch.jit.script
def _deliver(seq: int, header: torch.Tensor, payload: torch.Tensor) -> int:
    return torch.ops.wsync_rpc.deliver(seq, header, payload)


@torch.jit.script
def _event(kind: int, worker: int, data: torch.Tensor) -> int:
    return torch.ops.wsync_rpc.event(kind, worker, data)


_JOIN, _ACK, _LEAVE = 0, 1, 2


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8) if len(data) < 64 else \
        torch.frombuffer(bytearray(data), dtype=torch.uint8)


# -- the agent ----------------------------------------------------------------------------------
def _ifname_of(address: str) -> str | None:
    """The name of this host's interface holding IPv4 ``address`` (Linux), or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


#: [interface, address] that TensorPipe listens on in this process once wsync started an agent:
#: torch reads ``TP_SOCKET_IFNAME`` at the first RPC agent of a process and keeps that address
_listening: list[str] = []
#: wsync marks the ``TP_SOCKET_IFNAME`` it sets with this variable, so that a child process (which
#: inherits both) knows the value is not the user's choice
_MARK = "WSYNC_RPC_TP_SOCKET_IFNAME"


def _interface_for(host: str, port: int) -> tuple[str, str] | None:
    """The interface (name, address) TensorPipe must listen on to be reached from ``host``'s network (loopback for
    loopback), or None where the user chose one with ``TP_SOCKET_IFNAME``. Raises TransportError if
    no interface holds the address routing to ``host``, or if this process already listens on another."""
    chosen = os.environ.get("TP_SOCKET_IFNAME", "")
    if not _listening and chosen and chosen != os.environ.get(_MARK):
        return None
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)  # UDP: nothing is sent, a route is chosen
            local = s.getsockname()[0]
    except OSError as exc:
        raise TransportError(f"rpc: no route from this host to {host}: {exc}") from exc
    name = _ifname_of(local)
    if name is None:
        raise TransportError(f"rpc: no IPv4 network interface holds {local}, the address that routes to {host}; "
                             f"set TP_SOCKET_IFNAME")
    if _listening and _listening[0] != name:
        raise TransportError(f"rpc: this process's RPC agents listen on {_listening[1]} ({_listening[0]}), fixed by "
                             f"its first agent (torch.distributed.rpc picks that address once per process), but "
                             f"{host} is reached through {local} ({name}); host this endpoint in a new process")
    return name, local


def _init_dist_autograd(rank: int) -> None:
    """RPC needs distributed autograd's container; wsync never uses it. A process keeps the id of
    its first agent (a reused process may later be another rank: that is harmless here)."""
    try:
        dist_autograd._init(rank)
    except RuntimeError as exc:
        if "already initialized" not in str(exc):
            raise


def _store_wait(seconds: float) -> timedelta:
    """``seconds`` as a store's wait: at least 50 ms, at most a day (``math.inf``, the documented
    "forever", is more than a timedelta can hold: OverflowError)."""
    return timedelta(seconds=max(0.05, min(seconds, 86400.0)))


def _start_agent(store: dist.Store, name: str, rank: int, world: int, opts: rpc.TensorPipeRpcBackendOptions) -> None:
    """``rpc.init_rpc`` for a static CPU group, without its warm-up round: that round is a Python
    UDF every peer unpickles, and wsync's own first message (a worker's join) warms the channels.
    Names and addresses are exchanged through ``store``, bounded by its timeout."""
    agent = rpc.TensorPipeAgent(store, name, rank, world, opts, {}, [])
    rpc_api._init_rpc_states(agent)


def _agent_store(host: str, port: int, wait: timedelta) -> dist.TCPStore:
    """A client of the store at ``host:port``, for the sender's RPC agent. torch keeps a process's
    first RPC agent alive after ``rpc.shutdown()`` (its process-wide RRef context holds it), and
    with it the store the agent was given: were that the store that listens, its port would stay
    taken for the life of the process (no Python reference left) and a new sender with the same
    options could not bind it. Raises RuntimeError if it cannot connect within ``wait``."""
    return dist.TCPStore(host, port, None, False, wait)


_WORLD_KEY = "wsync-rpc/world"


def _newest_key(worker: int) -> str:
    """The sender's store key holding the number (decimal) of the newest delivery published to ``worker``."""
    return f"wsync-rpc/newest/{worker}"


def _joined_key(worker: int) -> str:
    return f"wsync-rpc/joined/{worker}"


class _Agent:
    """This process's RPC agent for one endpoint: a TCP store (the sender hosts it) and an RPC
    agent started on it once every rank is there."""

    def __init__(self, owner: object, options: dict[str, Any], name: str, rank: int, deadline: Deadline) -> None:
        with _cond:
            if _owner or rpc_api._is_current_rpc_agent_set():
                raise TransportError("rpc: this process already runs an RPC agent (one per process: a process "
                                     "cannot be two wsync rpc endpoints, nor join another RPC group)")
            _owner.append(owner)
        self.name, self.rank = name, rank
        self.host, self.port, self.world = options["host"], options["port"], options["world_size"]
        self.timeout = options["rpc_timeout"]
        self.started = False
        try:
            self.interface = _interface_for(self.host, self.port)
        except TransportError:
            self.close()
            raise
        wait = _store_wait(deadline.remaining())
        master = rank == 0
        if master:
            forked.watch(self)  # a forked child lets go of its copies of the store's sockets
        listen: dict[str, int] = {}
        try:
            if master:  # the store listens on ``host`` only (TCPStore alone binds every interface); it owns the fd
                with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((self.host, self.port))
                    s.listen(1024)
                    listen["master_listen_fd"] = s.detach()
            self.store: dist.TCPStore | None = dist.TCPStore(self.host, self.port, None, master, wait,
                                                             wait_for_workers=False,
                                                             master_listen_fd=listen.get("master_listen_fd"))
        except (RuntimeError, OSError) as exc:
            if "master_listen_fd" in listen:
                with contextlib.suppress(OSError):
                    os.close(listen["master_listen_fd"])
            self.close()
            what = "host the rendezvous store at" if master else "reach the sender's store at"
            raise TransportError(f"rpc: {name} cannot {what} {self.host}:{self.port} within "
                                 f"{wait.total_seconds():g} s: {_brief(exc)}") from exc
        if master:
            self.store.set(_WORLD_KEY, str(self.world))
        elif self.world is None:  # an independently built receiver learns the world size from the sender
            try:
                raw = self.store.get(_WORLD_KEY)
            except RuntimeError as exc:
                self.close()
                raise TransportError(f"rpc: {name} got no world size from the sender's store at "
                                     f"{self.host}:{self.port} within {wait.total_seconds():g} s: {_brief(exc)}") from exc
            if not (0 < len(raw) <= 8 and raw.isdigit()) or not rank < int(raw) <= 1 << 20:
                self.close()
                raise TransportError(f"rpc: the sender's store gives world size {raw[:20]!r}, which cannot hold rank {rank}")
            self.world = int(raw)

    def live_store(self) -> dist.TCPStore:
        """The store, from construction until ``close``: its callers run before."""
        store = self.store
        assert store is not None
        return store

    def joined(self) -> list[int]:
        """Workers that reached the store (they then start their agents)."""
        store = self.live_store()
        return [w for w in range(self.world - 1) if store.check([_joined_key(w)])]

    def start(self, wait_s: float) -> None:
        """Start this process's RPC agent; every rank must start within ``wait_s`` seconds."""
        own = self.live_store()
        if self.rank:
            own.set(_joined_key(self.rank - 1), b"1")  # type: ignore[arg-type]  # (torch's stubs: str only)
        if self.interface is not None:
            os.environ["TP_SOCKET_IFNAME"] = os.environ[_MARK] = self.interface[0]
        # TCP only: TensorPipe's shm transport polls without sleeping (most of a core per idle process)
        opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=self.timeout, init_method=f"tcp://{self.host}:{self.port}",
                                               _transports=["uv"])
        wait = _store_wait(wait_s)
        own.set_timeout(wait)
        _init_dist_autograd(self.rank)
        try:
            store = self.live_store()
            if self.rank == 0:  # the agent gets a client of its own, never the store that listens (see _agent_store)
                store = _agent_store(self.host, self.port, wait)
            _start_agent(dist.PrefixStore("wsync-rpc/agent", store), self.name, self.rank, self.world, opts)
        except (RuntimeError, OSError) as exc:
            raise TransportError(f"rpc: {self.name} could not start its RPC agent with world_size={self.world} at "
                                 f"{self.host}:{self.port} within {wait_s:g} s (RPC needs every rank at start): "
                                 f"{_brief(exc)}") from exc
        finally:
            self.started = rpc_api._is_current_rpc_agent_set()
            if self.started and self.interface is not None and not _listening:
                _listening[:] = self.interface
        self.live_store().set_timeout(timedelta(seconds=self.timeout))

    def forget_in_child(self) -> None:
        """A forked child lets go of its copies of the sender's store sockets, so the parent's port
        is free once it closes (the child never uses them)."""
        close_inherited(ports=[self.port])

    def close(self) -> None:
        if self.started or rpc_api._is_current_rpc_agent_set():
            self.started = False
            try:
                rpc.shutdown(graceful=False)
            except RuntimeError as exc:
                log.warning("rpc: shutting down the RPC agent: %s", _brief(exc))
        self.store = None
        forked.unwatch(self)
        with _cond:
            _owner.clear()


def _brief(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# -- endpoints ---------------------------------------------------------------------------------
class RpcSender(SenderBase):
    """Hosts the store at once; a short-lived thread starts the RPC agent when every worker has
    reached the store. One delivery is in flight per worker at a time; the newest published
    meanwhile waits (an older one waiting is dropped), so a slow or silent worker holds at most
    two buffers and never delays the others."""

    prefix_publish = True  # a delivery sends ``buffer.payload``, the first ``used`` bytes

    def __init__(self, options: dict[str, Any], ctx: SenderContext) -> None:
        super().__init__("rpc sender", ctx)
        self.options = options
        self.timeout = options["rpc_timeout"]
        self.agent: _Agent | None = None
        self.running = False  # the RPC agent runs (not ``ready``: that is SenderEndpoint's streaming call)
        self.pending: dict[int, tuple[int, torch.Tensor, Buffer]] = {}  # worker -> the newest (seq, header, buffer) to send
        self.inflight: set[int] = set()  # workers whose last delivery RPC is still sending
        #: numbers publishes: a receiver keeps the newest whatever order RPC runs them in, and waits for
        #: the number the store names (``_newest_key``) when it asks
        self.seq = itertools.count(1)
        self.marks: dist.Store | None = None  # the core's thread's store client: the published numbers
        self.stopping = threading.Event()
        self.starter: threading.Thread | None = None

    def start(self, deadline: Deadline) -> None:
        self.stopping.clear()
        self.agent = _Agent(self, self.options, SENDER, 0, deadline)
        try:
            # (torch's stubs lack Store.clone)
            self.marks = self.agent.live_store().clone()  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise TransportError(f"rpc: no second client of the sender's own store: {_brief(exc)}") from exc
        self.starter = threading.Thread(target=self._start_agent, name="wsync-rpc-start", daemon=True)
        self.starter.start()

    def _start_agent(self) -> None:
        agent = self.agent
        assert agent is not None  # (start made it before this thread; stop drops it after joining it)
        while len(agent.joined()) < self.ctx.num_workers:
            if self.stopping.wait(0.05):
                return
        try:
            agent.start(self.timeout)
        except TransportError as exc:
            log.warning("%s", exc)
            for w in range(self.ctx.num_workers):
                self.emit(Left(w, str(exc)))
            return
        with self.cond:
            self.running = True
            for w in list(self.pending):
                self._pump(w)

    def deliver(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        head = _as_tensor(header)
        seq = next(self.seq)
        if workers:
            marks = self.marks
            assert marks is not None  # (start made it; the core publishes only while the endpoint is open)
            try:  # before it is sent: a receiver that asks is told this one or a newer
                keys = [_newest_key(w) for w in workers]
                marks.multi_set(keys, [str(seq)] * len(workers))  # type: ignore[attr-defined]  # (torch's stubs lack it)
            except RuntimeError as exc:
                raise TransportError(f"rpc: cannot write the published version's number to the sender's own "
                                     f"store: {_brief(exc)}") from exc
        for w in workers:
            self.hold(buffer, w)  # until RPC has sent it, or a newer one replaced it
            older = self.pending.get(w)
            self.pending[w] = (seq, head, buffer)
            if older is not None:
                self.let_go(older[2], w)
            self._pump(w)

    def _pump(self, worker: int) -> None:
        """Send ``worker`` its pending delivery unless one is in flight (with ``self.cond`` held)."""
        if not self.running or worker in self.inflight or worker not in self.pending:
            return
        seq, head, buffer = self.pending.pop(worker)
        self.inflight.add(worker)
        try:
            payload = buffer.payload  # a prefix for the core's deltas: copied, RPC would send its whole storage
            if payload.numel() < buffer.tensor.numel():
                payload = payload.clone()
            fut = rpc.rpc_async(worker_name(worker), _deliver, args=(seq, head, payload),
                                timeout=self.timeout)
        except RuntimeError as exc:
            self.inflight.discard(worker)
            self.let_go(buffer, worker)
            self.emit(Left(worker, f"cannot send to {worker_name(worker)}: {_brief(exc)}"))
            return
        fut.add_done_callback(lambda f: self._sent(worker, buffer, f))

    def _sent(self, worker: int, buffer: Buffer, fut: torch.futures.Future) -> None:
        try:
            fut.wait()
            failure = None
        except RuntimeError as exc:
            failure = f"delivery to {worker_name(worker)} failed: {_brief(exc)}"
        with self.cond:
            self.inflight.discard(worker)
            self.let_go(buffer, worker)
            if failure is not None:
                self.emit(Left(worker, failure))
            elif self.is_open:
                self._pump(worker)

    def stop(self) -> None:
        self.stopping.set()
        if self.starter is not None:
            self.starter.join(self.timeout + 10)
            if self.starter.is_alive():
                log.warning("rpc: the agent start thread did not stop")
            self.starter = None
        agent, self.agent = self.agent, None
        self.marks = None
        with self.cond:
            self.pending.clear()
            self.inflight.clear()
            self.running = False
        if agent is not None:
            agent.close()


class RpcReceiver(ReceiverBase):
    """Joins the sender's RPC group; deliveries arrive on RPC's threads and wait in the mailbox. A
    ``receive()`` that finds one waiting first reads the newest number from the sender's store
    (``_newest_key``) and waits for that delivery (at most ``probe_patience``: two RPC timeouts,
    the one in flight and the newest)."""

    def __init__(self, options: dict[str, Any], ctx: ReceiverContext) -> None:
        super().__init__(f"rpc {worker_name(ctx.worker_idx)}", ctx)
        self.options = options
        self.worker = ctx.worker_idx
        self.timeout = options["rpc_timeout"]
        self.probe_patience = 2 * self.timeout
        self.agent: _Agent | None = None
        self.asker: dist.Store | None = None  # the probe thread's store client (``newest_published``)
        self.acks = AckPusher(self._push_ack, self.what)

    def start(self, deadline: Deadline) -> None:
        host, port = self.options["host"], self.options["port"]
        try:
            if not wait_listening(host, port, deadline, lambda: self._woken):
                return  # shutting down: recv returns None, the core's connect() raises StateError
        except TimeoutError as exc:
            raise WorkerTimeoutError(f"rpc: {worker_name(self.worker)} found no sender at {host}:{port} within "
                                     f"{deadline.timeout:g} s (is the sender connecting with the same host and "
                                     f"port?): {exc}", []) from None
        self.agent = _Agent(self, self.options, worker_name(self.worker), self.worker + 1, deadline)
        self.agent.start(deadline.remaining())
        try:
            # (torch's stubs lack Store.clone)
            self.asker = self.agent.live_store().clone()  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise TransportError(f"rpc: {worker_name(self.worker)} cannot open a second client of the sender's "
                                 f"store: {_brief(exc)}") from exc
        self._tell(_JOIN, b"", wait=True)

    def arrived(self, seq: int, header: bytes, payload: torch.Tensor) -> None:
        """A delivery from RPC's thread: into the mailbox unless a newer one came first (RPC runs
        calls on a thread pool, so an older delivery can arrive after a newer one: ``put`` drops it)."""
        with self.cond:
            if self.is_open:
                self.put(Delivery(header, payload), seq)

    def newest_published(self, deadline: Deadline) -> int | None:
        """The sender's number for the newest delivery published to this worker, read from its store
        (one round trip, bounded by the deadline and ``rpc_timeout``); None if there is no time left
        or the store does not answer in time (``recv`` then returns what arrived)."""
        asker = self.asker
        wait = min(deadline.remaining(), self.timeout)
        if asker is None or wait <= 0:
            return None
        try:
            asker.set_timeout(timedelta(seconds=wait))
            return asker.add(_newest_key(self.worker), 0)  # 0 if nothing was published to it yet
        except RuntimeError as exc:
            log.debug("rpc: %s could not read the newest published version: %s", worker_name(self.worker),
                      _brief(exc))
            return None

    def _tell(self, kind: int, data: bytes, wait: bool = False) -> torch.futures.Future:
        try:
            fut = rpc.rpc_async(SENDER, _event, args=(kind, self.worker, _as_tensor(data)), timeout=self.timeout)
            if wait:
                fut.wait()
        except RuntimeError as exc:
            raise TransportError(f"rpc: {worker_name(self.worker)} cannot reach {SENDER}: {_brief(exc)}") from exc
        return fut

    def ack(self, data: bytes) -> None:
        """Hand the ack to the ack thread (``AckPusher``), which sends each once the one before it
        landed: RPC runs handlers on a thread pool, so two calls in flight at once could run in
        either order; and an ack waiting for its reply (a cut link, a sender whose RPC threads are
        busy) must not hold the ``receive()`` that applied the version."""
        self.check_open()
        self.acks.put(data)

    def _push_ack(self, data: bytes) -> None:
        """Send one ack and wait for it to land (``rpc_timeout`` at most); TransportError if it did not."""
        self._tell(_ACK, data, wait=True)

    def stop(self) -> None:
        agent, self.agent = self.agent, None
        self.asker = None
        if agent is None:
            return
        self.acks.close(self.timeout + 5, deliver=agent.started)  # the acks land before the goodbye
        if agent.started:
            try:
                self._tell(_LEAVE, b"", wait=True)
            except TransportError as exc:
                log.debug("rpc: goodbye not delivered: %s", exc)
        agent.close()
