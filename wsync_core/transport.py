"""The interface a transport implements: connection set-up and the moving of bytes, nothing else.

The core owns everything else: snapshots, versions, headers, acks, timeouts, schema checks,
checksums and applying weights. A transport moves two kinds of things:

- *deliveries*, sender -> receivers: an opaque ``header`` (a few hundred bytes of JSON the
  core writes) and a flat uint8 ``payload`` of ``layout.nbytes`` bytes;
- *acks*, receiver -> sender: opaque bytes (small JSON the core writes).

The sender's core asks the transport for a ``Buffer`` (``acquire``), writes the snapshot into its
``tensor``, sets how many bytes it filled (``used``), then ``publish``-es that same ``Buffer`` to
some workers. A zero-copy transport returns a buffer that receivers
can read directly (a shared-memory slot, a CUDA IPC block); a network transport returns a
staging buffer it then sends. Either way the core copies the trainer's tensors exactly once.

Rules every transport keeps (the conformance suite checks them):

1. ``acquire`` never returns the most recently published buffer, nor one a receiver may still
   read: the core writes into it at once.
2. ``publish`` hands the buffer to exactly the listed workers and returns without waiting for
   them to apply it; it may re-publish the latest buffer to a worker that (re)joins.
3. A receiver only needs the newest delivery: a transport may drop older undelivered ones.
4. ``recv``, ``poll`` and ``acquire`` return or raise by their deadline; ``recv`` (and ``poll``)
   return at once after ``wake``, called from another thread when the scheme shuts down.
5. Nothing received from another process is unpickled; ``close`` frees every resource.

The whole interface, with what each call returns and may raise, the threading rules and the
limits: docs/writing-a-transport.md.
"""

from __future__ import annotations

import inspect
import ipaddress
import math
import numbers
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, Union, overload

import torch

from .deadline import Deadline
from .layout import Layout

__all__ = [
    "Buffer",
    "Capabilities",
    "SenderContext",
    "ReceiverContext",
    "Delivery",
    "Joined",
    "Acked",
    "Left",
    "Event",
    "SenderEndpoint",
    "ReceiverEndpoint",
    "Transport",
    "free_port",
    "is_loopback",
    "wait_listening",
    "check_options",
    "parse_options",
    "parse_value",
    "flag",
    "number",
    "index_refusal",
    "claim_refusal",
    "origin_refusal",
    "MAX_ORIGIN_BYTES",
    "zero_copy_for",
    "ZERO_COPY_MIN_BYTES",
    "INTERFACE_VERSION",
    "check_interface",
]

#: below this payload size, copying into a model costs less than mapping memory for it to adopt
ZERO_COPY_MIN_BYTES = 1 << 20
#: the version of the transport interface (this module) that this wsync-core implements. A
#: transport class says which version it was written for (``interface = 2``); any change to what
#: the core calls, or to what it expects back, raises it, and a plugin written for another
#: version is refused when it loads, with both versions named. 2: ``acquire`` returns a
#: ``Buffer`` and ``publish`` takes it back (1: a bare tensor, found again by identity)
INTERFACE_VERSION = 2


@dataclass(eq=False)
class Buffer:
    """A payload buffer a sender endpoint hands out (``acquire``) and takes back (``publish``).

    ``tensor`` is a contiguous uint8 tensor of ``layout.nbytes`` bytes; ``index`` is the
    transport's own name for it (a slot number), so ``publish`` needs no search; ``used`` is the
    number of bytes the core filled, set before each ``publish``: the delivery is ``tensor``'s
    first ``used`` bytes. The core sets ``used`` below ``layout.nbytes`` only for an endpoint
    with ``prefix_publish``; a transport makes one ``Buffer`` per buffer it owns and hands the
    same object out again (no allocation per send).
    """

    tensor: torch.Tensor
    index: int = 0
    #: the bytes of ``tensor`` the next ``publish`` delivers (its first ``used``); -1 at creation: all
    used: int = -1

    def __post_init__(self) -> None:
        if self.used < 0:
            self.used = self.tensor.numel()

    @property
    def payload(self) -> torch.Tensor:
        """What a publish of this buffer delivers: ``tensor``'s first ``used`` bytes (``tensor`` itself when whole)."""
        return self.tensor if self.used == self.tensor.numel() else self.tensor[:self.used]


@dataclass(frozen=True)
class Capabilities:
    """What a transport declares it can do; the conformance suite tests each declared one."""

    #: receivers may live in other processes (False only for thread-based transports)
    processes: bool = True
    #: receivers may live on other hosts
    multi_host: bool = False
    #: sender and receiver models may live on CUDA devices
    cuda: bool = False
    #: receivers read the sender's snapshot without another full copy in between
    zero_copy: bool = False
    #: ``send(sync=False)`` returns before receivers apply
    async_send: bool = True
    #: ``send(worker_ids=...)`` reaches only those workers
    subset_send: bool = True
    #: a receiver that connects late, or restarts, gets the latest version at connect
    late_join: bool = True
    #: peers can be required to authenticate
    auth: bool = False
    #: a sender built again from the same options (a trainer restarted: the same address), after
    #: the first one shut down, is followed by the receivers that were connected to the first: they
    #: reconnect by themselves and apply its versions, numbered from 0 again
    sender_restart: bool = False

    def declared(self) -> list[str]:
        """The names of the capabilities set to True."""
        return [f.name for f in fields(self) if getattr(self, f.name)]


@dataclass(frozen=True)
class SenderContext:
    """What a sender endpoint needs to know: how many workers, and the payload's layout.
    ``origin`` names the scheme this sender belongs to (every copy pickled from it): a hello
    that carries another is refused (``origin_refusal``); "" where unknown."""

    num_workers: int
    layout: Layout
    model_id: str
    device: torch.device
    origin: str = ""


@dataclass(frozen=True)
class ReceiverContext:
    """What a receiver endpoint needs to know: who it is, and its model's layout and device.
    ``origin``: the scheme's it was pickled from, for its hello; "" (a scheme built in the
    worker itself) takes any sender's."""

    worker_idx: int
    layout: Layout
    model_id: str
    device: torch.device
    origin: str = ""


@dataclass
class Delivery:
    """One received version: header bytes and a flat uint8 payload.

    The core calls ``release()`` once nothing views the payload; until then the transport must
    keep the payload's bytes unchanged. A transport sets ``adoptable`` when the payload's memory
    is this receiver's own to keep (writing it reaches no one else): the core may then make the
    model's tensors views of it instead of copying, and calls ``release()`` only once the last
    tensor viewing it is freed and every child forked meanwhile has exited (``wsync_core.lease``):
    possibly from another thread, and after ``close()``. ``warm``, if set, runs after the core
    acked a payload the model now views: work a transport can leave off the sender's path, such
    as faulting in a fresh mapping so that the worker's first read does not.
    """

    header: bytes
    payload: torch.Tensor
    release: Callable[[], None] | None = None
    adoptable: bool = False
    warm: Callable[[], object] | None = None


@dataclass(frozen=True)
class Joined:
    """Worker ``worker`` connected (or re-connected): it should get the latest version."""

    worker: int


@dataclass(frozen=True)
class Acked:
    """Worker ``worker`` sent ack bytes ``data``."""

    worker: int
    data: bytes


@dataclass(frozen=True)
class Left:
    """Worker ``worker`` disconnected or died; ``reason`` says how the transport knows."""

    worker: int
    reason: str


Event = Union[Joined, Acked, Left]


class SenderEndpoint(ABC):
    """The trainer's side of a transport. Used from one thread at a time."""

    #: A streaming transport sets this to a number of bytes: the core then writes each new
    #: snapshot in pieces of about this size, calling ``ready`` after each, so the transport can
    #: move the first bytes while the rest is copied. 0 (the default): no ``ready`` calls.
    stream_bytes: int = 0
    #: The endpoint's promise that ``publish`` honours ``Buffer.used``: it delivers only the first
    #: ``used`` bytes (the receiver's payload then has ``used`` bytes). The core then sends encoded
    #: payloads (deltas, a wire dtype; see ``wsync_core.delta``) as a prefix. False (the default):
    #: the core always sets ``used`` to the whole buffer, the receiver's core reads the first bytes.
    prefix_publish: bool = False

    def ready(self, buffer: Buffer, nbytes: int, workers: Sequence[int]) -> None:
        """Bytes ``[0, nbytes)`` of ``buffer`` (from the last ``acquire``) now hold the snapshot
        bound for ``workers``; calls come with rising ``nbytes`` up to ``layout.nbytes``, then
        ``publish`` gives the header. If the core fails in between, no ``publish`` follows: the
        transport must make sure no receiver applies those bytes, and gets the buffer back from
        the next ``acquire``."""

    def open(self, deadline: Deadline) -> None:
        """Bind, listen and allocate; may return before any receiver connects."""

    @abstractmethod
    def acquire(self, deadline: Deadline) -> Buffer:
        """A ``Buffer`` whose ``tensor`` (contiguous uint8, ``layout.nbytes`` bytes, at an address
        that is a multiple of 64, as torch's and mmap's are) the core may overwrite now.

        Raises WorkerTimeoutError if no buffer frees up by the deadline.
        """

    @abstractmethod
    def publish(self, buffer: Buffer, header: bytes, workers: Sequence[int]) -> None:
        """Deliver ``buffer``'s first ``buffer.used`` bytes and ``header`` to ``workers``; ``buffer`` is the one
        ``acquire`` returned last, or the latest published one again."""

    @abstractmethod
    def poll(self, deadline: Deadline) -> list[Event]:
        """Events since the last call; waits for at least one until the deadline, then returns []."""

    def wake(self) -> None:
        """Make a ``poll`` waiting in another thread, and every later one, return at once, and an
        ``acquire`` waiting for a free buffer raise: the scheme is shutting down. Called from any
        thread, before ``close``. A transport whose ``poll`` blocks must implement it (a flag and a
        notify, or an eventfd its wait also watches): ``shutdown()`` from another thread must not
        wait out a ``send()``'s timeout (``test_live_shutdown_ends_a_waiting_send``)."""

    def close(self) -> None:
        """Free everything; idempotent."""


class ReceiverEndpoint(ABC):
    """A worker's side of a transport. Used from one thread at a time."""

    def open(self, deadline: Deadline) -> None:
        """Connect to the sender and announce this worker (the sender then sees ``Joined``)."""

    @abstractmethod
    def recv(self, deadline: Deadline) -> Delivery | None:
        """The next delivery, waiting for one until the deadline; None if none came."""

    @abstractmethod
    def ack(self, data: bytes) -> None:
        """Send ``data`` to the sender (it sees ``Acked(worker_idx, data)``)."""

    def last_error(self) -> str | None:
        """Why nothing has come from the sender, if the endpoint knows (e.g. it cannot reach the
        sender, and the error that says why); None otherwise. ``connect()`` quotes it when it times out."""
        return None

    def wake(self) -> None:
        """Make a ``recv`` waiting in another thread, and every later one, return None at once:
        the scheme is shutting down. Called from any thread, before ``close``. A transport whose
        ``recv`` blocks must implement it (a flag and a notify, or an eventfd its wait also
        watches): ``shutdown()`` from another thread must not wait for the deadline."""

    def close(self) -> None:
        """Free everything; idempotent."""


def _rebuild(cls: type[Transport], options: dict[str, Any]) -> Transport:
    return cls(**options)


class Transport(ABC):
    """A way to move weights; plugins subclass it and register the class.

    A transport object holds configuration only: ``options`` must be plain, picklable values,
    and a copy built from them (in another process, or by an independent receiver given the
    same options) must reach the same channel.
    """

    #: the name users pass to ``WeightSyncScheme``
    name: ClassVar[str]
    #: the transport interface version this class implements (``wsync_core.INTERFACE_VERSION``)
    interface: ClassVar[int]
    #: what the transport can do
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: options whose values are secrets (keys, shared secrets): ``repr`` shows them as ``'***'``.
    #: A transport that declares ``auth`` names its credentials here (the suite checks it)
    secret_options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: Any) -> None:
        self.options: dict[str, Any] = options

    @property
    def checksum(self) -> bool:
        """Whether the core adds XXH3-64 checksums of every payload to its header and checks them on
        arrival (for transports whose bytes cross something that can damage them): the ``checksum``
        option, off where the transport has none."""
        return bool(self.options.get("checksum", False))

    @abstractmethod
    def sender(self, ctx: SenderContext) -> SenderEndpoint:
        """A new, unopened sender endpoint."""

    @abstractmethod
    def receiver(self, ctx: ReceiverContext) -> ReceiverEndpoint:
        """A new, unopened receiver endpoint."""

    def __reduce__(self):
        return (_rebuild, (type(self), dict(self.options)))

    def __repr__(self) -> str:
        """The class and its options, each secret one (``secret_options``) shown as ``'***'`` if set."""
        shown = {k: "***" if k in self.secret_options and v is not None else v for k, v in self.options.items()}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def check_interface(cls: type[Transport]) -> None:
    """Raise TypeError unless ``cls`` implements the transport interface of this wsync-core,
    naming both versions."""
    version = getattr(cls, "interface", None)
    if version != INTERFACE_VERSION:
        from . import __version__

        said = "does not say which transport interface it implements" if version is None else \
            f"implements transport interface {version}"
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} {said}; wsync-core {__version__} implements "
                        f"interface {INTERFACE_VERSION} (set interface = {INTERFACE_VERSION} once it does; "
                        f"docs/writing-a-transport.md lists what changed between versions)")


def parse_value(text: str) -> Any:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None, else the string;
    quoted (``'12345'`` or ``"12345"``), the string inside the quotes, whatever it reads as."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def parse_options(pairs: Iterable[str]) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}``; raises ValueError for an item without '='."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"transport options are KEY=VALUE, got {pair!r}")
        out[key.strip()] = parse_value(value)
    return out


@overload
def flag(name: str, value: Any, *, optional: Literal[False] = False) -> bool: ...
@overload
def flag(name: str, value: Any, *, optional: bool) -> bool | None: ...
def flag(name: str, value: Any, *, optional: bool = False) -> bool | None:
    """``value`` if it is True or False (or None where ``optional``); raises ValueError naming
    ``name`` for anything else (a string "no" would otherwise read as True)."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    raise ValueError(f"{name} must be True{', False or None' if optional else ' or False'}, got {value!r}")


def number(name: str, value: Any, low: float, high: float = math.inf, *, above: bool = False,
           integer: bool = False) -> Any:
    """``value`` (a float, or an int where ``integer``) if it is a number, not a bool, with
    ``low <= value <= high`` (``low < value`` where ``above``); raises ValueError naming ``name`` and
    the range for anything else, NaN and strings included. NumPy's numbers count as numbers."""
    # (the numbers ABCs declare no comparison with a float in typeshed: a checked value stays Any)
    kind: type[Any] = numbers.Integral if integer else numbers.Real
    if (isinstance(value, kind) and not isinstance(value, bool)
            and (low < value if above else low <= value) and value <= high):
        return int(value) if integer else float(value)
    what = "an int" if integer else "a number"
    span = f"{'(' if above else '['}{low:g}, {high:g}]" if high != math.inf else f"{'>' if above else '>='} {low:g}"
    raise ValueError(f"{name} must be {what} {'in ' if high != math.inf else ''}{span}, got {value!r}")


def index_refusal(worker: int, num_workers: int) -> str | None:
    """Why a sender of ``num_workers`` workers refuses worker ``worker`` (its index out of range,
    a launcher's off-by-one), to tell that worker; None if it takes it."""
    if 0 <= worker < num_workers:
        return None
    return f"worker_idx {worker} is out of range: this sender has {num_workers} workers"


#: the longest origin a hello may carry (the core's are 16 hex digits)
MAX_ORIGIN_BYTES = 64


def origin_refusal(worker: int, theirs: str, mine: str) -> str | None:
    """Why a sender of origin ``mine`` refuses a hello of origin ``theirs`` from worker ``worker``
    (a worker of another trainer's scheme: another job given this address), to tell it; None if
    it takes it (the same origin, or either unknown: ""). Checked before ``claim_refusal``: such a
    worker never takes an index, held or not."""
    if not theirs or not mine or theirs == mine:
        return None
    return (f"worker {worker} belongs to another trainer's scheme (origin {theirs[:16]}; this sender's is "
            f"{mine[:16]}): another job's worker given this address? Give each job its own address")


def claim_refusal(worker: int, theirs: str) -> str:
    """Why a sender refuses a receiver that says hello as ``worker`` while a live connection holds
    that index with a model that fits, and the newcomer's does not (``theirs`` says how): to tell
    it. Another model's worker, started with this scheme's options by mistake, would otherwise push
    out the worker that holds the index (the newest hello wins only where it fits: a restarted
    worker takes its index back)."""
    return (f"worker_idx {worker} is held by a worker whose model fits this sender's, and this one's does not "
            f"({theirs}): another model's worker, given this scheme's options? The holder keeps the index")


def check_options(cls: type[Transport], options: Mapping[str, Any]) -> None:
    """Raise ValueError naming the ``options`` that ``cls(**options)`` would not take, and the ones
    it takes (a constructor that takes ``**kwargs`` takes any)."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    known = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"transport {getattr(cls, 'name', cls.__name__)!r} has no option "
                         f"{', '.join(map(repr, unknown))}; its options are {', '.join(known) or 'none'}")


def zero_copy_for(option: bool | None, ctx: ReceiverContext) -> bool:
    """Whether a receiver should hand the core adoptable deliveries: ``option`` True or False
    decides; None (automatic) means a CPU model of at least ``ZERO_COPY_MIN_BYTES``."""
    if option is not None:
        return bool(option) and ctx.device.type == "cpu"
    return ctx.device.type == "cpu" and ctx.layout.nbytes >= ZERO_COPY_MIN_BYTES


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback, whose bytes never
    cross a wire (rpc and distributed default their ``checksum`` option to off there, on elsewhere)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def wait_listening(host: str, port: int, deadline: Deadline, woken: Callable[[], bool]) -> bool:
    """Wait until something accepts TCP connections at ``host:port``: True; False as soon as
    ``woken()`` says the scheme is shutting down. Raises TimeoutError naming the last failure at
    the deadline. Each try is a plain connect, closed at once, a few times a second: a client
    that blocks in C (torch's TCPStore) is started only once its server is there, so it never
    outlives the deadline with its own retries nor a ``shutdown()`` from another thread."""
    delay = 0.01
    while True:
        if woken():
            return False
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=max(min(deadline.remaining(), 1.0), 0.05)):
                return True
        except OSError as exc:
            if deadline.expired():
                raise TimeoutError(f"nothing accepts connections at {host}:{port} ({exc})") from None
        if woken():
            return False
        time.sleep(deadline.slice(delay))
        delay = min(2 * delay, 0.1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a transport that must fix its port when it is built
    (so pickled copies meet there). Raises ValueError if ``host`` cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as exc:
            raise ValueError(f"cannot pick a free port on host {host!r} ({exc}); pass port=") from None
        return s.getsockname()[1]
