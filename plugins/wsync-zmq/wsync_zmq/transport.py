"""``ZmqTransport``: the options of the ``zmq`` transport, checked once, and its two endpoints.

The sender binds one ROUTER socket; each receiver connects a DEALER to ``address``. Receivers
on other hosts build their own scheme with the same options. Without ``address`` a free port on
127.0.0.1 is chosen when the transport is built, and the pickled scheme carries it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.utils.z85
from wsync_core.transport import (
    Capabilities,
    ReceiverContext,
    ReceiverEndpoint,
    SenderContext,
    SenderEndpoint,
    Transport,
    free_port,
)
from wsync_core.transport import flag, number

__all__ = ["ZmqTransport"]

_TCP = re.compile(r"^tcp://(?P<host>\[[0-9a-fA-F:.]+\]|[^:/\s\[\]]+):(?P<port>\d{1,5})$")
_WILDCARDS = {"*", "0.0.0.0", "[::]", "[*]"}
#: the options that hold secret keys: never shown (``repr``, errors)
_SECRETS = ("curve_server_secret", "curve_client_secret")


def _check_endpoint(value: Any, option: str, wildcard: bool) -> str:
    if not isinstance(value, str):
        raise TypeError(f"zmq option {option} must be a string like 'tcp://127.0.0.1:5555', got {value!r}")
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    m = _TCP.match(value)
    if m is None:
        raise ValueError(f"zmq option {option} must be 'tcp://HOST:PORT' with an explicit port (or 'ipc://PATH'), "
                         f"got {value!r}")
    if not 0 < int(m["port"]) < 65536:
        raise ValueError(f"zmq option {option}={value!r}: the port must be 1 to 65535")
    if m["host"] in _WILDCARDS and not wildcard:
        raise ValueError(f"zmq option {option}={value!r} names every interface, which receivers cannot connect "
                         f"to; give the sender's address here and bind wider with bind='{value}'")
    return value


def _check_key(value: Any, option: str) -> str:
    """``value`` as a Z85 CURVE key; ValueError naming ``option`` otherwise. A secret key's value is
    never quoted (a wrong one is most often the right key with a stray character)."""
    shown = "its value not shown: a secret" if option in _SECRETS else f"{value!r:.50}"
    try:
        key = value.decode("ascii") if isinstance(value, bytes) else value
    except UnicodeDecodeError:
        key = None
    if not isinstance(key, str) or len(key) != 40:
        what = ("bytes that are not ASCII" if isinstance(value, bytes) and key is None
                else f"{len(value)} characters" if isinstance(value, (str, bytes))
                else f"a value of type {type(value).__name__}")
        raise ValueError(f"zmq option {option} must be a 40-character Z85 CURVE key (from zmq.curve_keypair()), "
                         f"got {what} ({shown})")
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"zmq option {option} is not a valid Z85 key"
                         f"{'' if option in _SECRETS else f': {exc}'}") from None
    return key


@functools.cache
def _suite_keys() -> tuple[tuple[str, str], ...]:
    """Three CURVE key pairs (server, client, stranger) for the conformance suite's auth hook."""
    return tuple((public.decode(), secret.decode()) for public, secret in (zmq.curve_keypair() for _ in range(3)))


class ZmqTransport(Transport):
    """Weights over ZeroMQ: one sender ROUTER, one DEALER per receiver, zero-copy payload frames.

    Options: ``address`` (where receivers connect, default ``tcp://127.0.0.1:<free port>``),
    ``bind`` (what the sender binds, default ``address``; e.g. ``tcp://0.0.0.0:5555``),
    ``checksum`` (XXH3-64 checksums of every payload, default True), ``heartbeat`` (seconds a link
    may stay silent before its peer counts as gone, default 10; a payload may take longer to
    cross), and CURVE: ``curve_server_key`` (the sender's public key; setting it requires CURVE
    on both sides), ``curve_server_secret`` (sender only),
    ``curve_client_key``/``curve_client_secret`` (a receiver's pair; default a fresh one) and
    ``curve_allowed_clients`` (public keys the sender accepts; default any holder of the server key).
    """

    name = "zmq"
    interface = 2
    capabilities = Capabilities(processes=True, multi_host=True, zero_copy=False, async_send=True,
                                subset_send=True, late_join=True, auth=True, sender_restart=True)
    secret_options = _SECRETS

    @staticmethod
    def auth_options(good: bool) -> dict[str, Any]:
        """The conformance suite's hook (``wsync conformance zmq`` runs it): with ``good``, CURVE
        keys the sender and its workers share, only the client key allowed; else a stranger that
        knows the server's public key but holds a key the sender does not allow."""
        server, client, stranger = _suite_keys()
        if good:
            return {"curve_server_key": server[0], "curve_server_secret": server[1], "curve_client_key": client[0],
                    "curve_client_secret": client[1], "curve_allowed_clients": [client[0]]}
        return {"curve_server_secret": None, "curve_client_key": stranger[0], "curve_client_secret": stranger[1]}

    @staticmethod
    def multi_host_options(host_address: str) -> dict[str, Any]:
        """The conformance suite's hook: options for a sender that listens on ``host_address`` (its
        address on a bridge to another network namespace)."""
        return {"address": f"tcp://{host_address}:{free_port(host_address)}"}

    def __init__(
        self,
        *,
        address: str | None = None,
        bind: str | None = None,
        checksum: bool = True,
        heartbeat: float = 10.0,
        curve_server_key: str | None = None,
        curve_server_secret: str | None = None,
        curve_client_key: str | None = None,
        curve_client_secret: str | None = None,
        curve_allowed_clients: Sequence[str] | None = None,
    ) -> None:
        address = f"tcp://127.0.0.1:{free_port()}" if address is None else _check_endpoint(address, "address", False)
        if bind is not None:
            bind = _check_endpoint(bind, "bind", True)
        heartbeat = number("zmq option heartbeat (seconds)", heartbeat, 0.1, 3600)
        keys = {"curve_server_secret": curve_server_secret, "curve_client_key": curve_client_key,
                "curve_client_secret": curve_client_secret}
        if curve_server_key is None and (any(v is not None for v in keys.values()) or curve_allowed_clients):
            raise ValueError("zmq CURVE options need curve_server_key (the sender's public key) on both sides")
        if curve_server_key is not None:
            curve_server_key = _check_key(curve_server_key, "curve_server_key")
            keys = {k: None if v is None else _check_key(v, k) for k, v in keys.items()}
            curve_server_secret, curve_client_key, curve_client_secret = keys.values()
            if curve_server_secret is not None and \
                    zmq.curve_public(curve_server_secret.encode()).decode() != curve_server_key:
                raise ValueError("zmq option curve_server_secret does not match curve_server_key")
            if (curve_client_key is None) != (curve_client_secret is None):
                raise ValueError("zmq options curve_client_key and curve_client_secret go together")
            if curve_client_secret is not None and \
                    zmq.curve_public(curve_client_secret.encode()).decode() != curve_client_key:
                raise ValueError("zmq option curve_client_secret does not match curve_client_key")
            if curve_allowed_clients is not None:
                if isinstance(curve_allowed_clients, (str, bytes)):
                    raise TypeError("zmq option curve_allowed_clients must be a list of public keys, not one key")
                curve_allowed_clients = [_check_key(k, "curve_allowed_clients") for k in curve_allowed_clients]
        super().__init__(address=address, bind=bind, checksum=flag("zmq option checksum", checksum),
                         heartbeat=heartbeat,
                         curve_server_key=curve_server_key, curve_server_secret=curve_server_secret,
                         curve_client_key=curve_client_key, curve_client_secret=curve_client_secret,
                         curve_allowed_clients=curve_allowed_clients)

    def sender(self, ctx: SenderContext) -> SenderEndpoint:
        if self.options["curve_server_key"] and not self.options["curve_server_secret"]:
            raise ValueError("the zmq sender needs curve_server_secret when curve_server_key is set")
        from .sender import ZmqSender

        return ZmqSender(self.options, ctx)

    def receiver(self, ctx: ReceiverContext) -> ReceiverEndpoint:
        from .receiver import ZmqReceiver

        return ZmqReceiver(self.options, ctx)

