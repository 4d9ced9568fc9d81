"""The ``mp`` transport class and its pluggy registration."""

from __future__ import annotations

import secrets
import sys
from typing import Any

from wsync_core import hookimpl
from wsync_core.transport import Capabilities, ReceiverContext, ReceiverEndpoint, SenderContext, SenderEndpoint, \
    Transport, flag, zero_copy_for

from .receiver import MpReceiver
from .sender import MpSender

__all__ = ["MpTransport", "wsync_register_transports"]


class MpTransport(Transport):
    """Worker processes on this host, started any way (spawn, forkserver, fork, or on their own).

    Options (plain values; a copy given the same options reaches the same sender):

    - ``address``: ``"@name"`` (Linux abstract socket) or a filesystem path for a Unix socket;
      default: a new unique abstract name, with a new random ``authkey``.
    - ``authkey``: a shared secret (str); both sides prove they hold it (HMAC-SHA256) before
      anything else is exchanged. Default with an explicit ``address``: none (empty key).
    - ``max_slots``: payload buffers the sender may create (default ``2 * num_workers + 2``;
      two are used unless workers stall).
    - ``checksum``: have the core add and check XXH3-64 checksums of every payload (default False).
    - ``zero_copy``: a worker's tensors become private copy-on-write maps of the slot instead of
      copies; the slot stays the worker's until it moves on. False copies into the tensors the
      model already has; None (default) maps models of 1 MiB and more and copies smaller ones.
    """

    name = "mp"
    interface = 2
    capabilities = Capabilities(processes=True, multi_host=False, cuda=False, zero_copy=True, async_send=True,
                                subset_send=True, late_join=True, auth=True, sender_restart=True)
    secret_options = ("authkey",)

    @staticmethod
    def auth_options(good: bool) -> dict[str, Any]:
        """The conformance suite's hook (``wsync conformance mp`` runs it): with ``good``, the
        authkey the sender and its workers share; else one a stranger guessed."""
        return {"authkey": "the-shared-secret-of-the-suite" if good else "a-guess-at-the-secret"}

    def __init__(self, *, address: str | None = None, authkey: str | None = None, max_slots: int | None = None,
                 checksum: bool = False, zero_copy: bool | None = None) -> None:
        if not sys.platform.startswith("linux"):
            raise RuntimeError(f"the mp transport needs Linux (memfd and SCM_RIGHTS); this is {sys.platform}")
        if address is None:
            address = f"@wsync-mp-{secrets.token_hex(8)}"
            authkey = secrets.token_hex(16) if authkey is None else authkey
        if not isinstance(address, str) or address in ("", "@"):
            raise ValueError(f"address must be '@name' or a socket path, got {address!r}")
        if authkey is not None and not isinstance(authkey, str):
            raise TypeError(f"authkey must be a str, got {type(authkey).__name__}")
        if authkey == "":  # (what os.environ.get("KEY", "") gives when KEY is unset): no secret at all
            raise ValueError("mp option authkey must be a non-empty string (or None)")
        if max_slots is not None and (isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 2):
            raise ValueError(f"max_slots must be an int >= 2, got {max_slots!r}")
        super().__init__(address=address, authkey=authkey, max_slots=max_slots,
                         checksum=flag("mp option checksum", checksum),
                         zero_copy=flag("mp option zero_copy", zero_copy, optional=True))

    @property
    def _key(self) -> bytes:
        return (self.options["authkey"] or "").encode()

    def sender(self, ctx: SenderContext) -> SenderEndpoint:
        max_slots = self.options["max_slots"] or 2 * ctx.num_workers + 2
        return MpSender(self.options["address"], self._key, ctx, max_slots)

    def receiver(self, ctx: ReceiverContext) -> ReceiverEndpoint:
        return MpReceiver(self.options["address"], self._key, ctx, zero_copy_for(self.options["zero_copy"], ctx))


@hookimpl
def wsync_register_transports(register) -> None:
    register(MpTransport)
