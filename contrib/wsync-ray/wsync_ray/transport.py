"""``RayTransport``: the options of the ``ray`` transport, checked once, and its trust declaration.

The sender puts each version's payload into Ray's object store once (``ray.put``) and posts its
header and object reference to a mailbox actor named after ``channel``; each receiver takes its
newest delivery from the mailbox, reads the payload from its own node's object store (Ray moves
it between nodes) and acks over a TCP connection straight to the sender (through the mailbox
where it cannot open one). Ray is imported only when an endpoint opens.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from wsync_core.transport import (
    Capabilities,
    ReceiverContext,
    ReceiverEndpoint,
    SenderContext,
    SenderEndpoint,
    Transport,
)
from wsync_core.transport import flag

__all__ = ["RayTransport", "TRUSTED_RUNTIME"]

#: What a ``ray`` channel trusts beyond wsync's own bytes: Ray itself. wsync never pickles or
#: unpickles anything, but Ray pickles the object references and actor handles it carries between
#: the sender, the mailbox and the receivers, and its workers listen on the cluster's network.
TRUSTED_RUNTIME = (
    "ray",
    "Ray (de)serializes the object references and actor handles it carries between the trainer, the "
    "mailbox actor and the workers, and its processes listen on the cluster's network (so does the sender's "
    "direct-ack socket, on its node's Ray address, admitting only holders of a secret handed out through "
    "Ray): everyone who can join the Ray cluster (its token) is trusted. wsync's headers, acks and payloads "
    "stay raw bytes.",
)


def _name(value: Any, option: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 200:
        raise ValueError(f"ray option {option} must be a non-empty string (at most 200 characters), got {value!r}")
    return value


class RayTransport(Transport):
    """Weights through Ray's object store, to receivers that are Ray actors, tasks or drivers.

    Options: ``channel`` (the mailbox actor's name; default unique to this transport object, and
    carried when it is pickled), ``namespace`` (the Ray namespace of that name, default
    ``"wsync"``), ``address`` (the cluster a process not yet connected to Ray joins with
    ``ray.init(address=...)``; default ``"auto"``, the cluster started on this machine) and
    ``checksum`` (XXH3-64 checksums of every payload, and of every header and ack, checked before
    it is applied; default False, which trusts the bytes to Ray: Ray checks no object's bytes end
    to end, and between nodes they cross the network, so pass True where workers run on other
    nodes than the trainer; on one node it doubles a 64 MiB update's time, the workers reading
    every page they would otherwise map untouched), ``zero_copy`` (receivers map the payload copy-on-write and the core adopts
    it instead of copying: True, False, or None for CPU models of 1 MiB and more; it needs a
    process allowed to open ``/proc/self/map_files``, else the receiver copies) and
    ``direct_acks`` (default True: receivers ack over a TCP connection to the sender, opened with
    a secret the mailbox hands them, instead of through the mailbox actor; see ``acks``).
    """

    name = "ray"
    interface = 2
    capabilities = Capabilities(processes=True, multi_host=True, zero_copy=False, async_send=True,
                                subset_send=True, late_join=True, auth=False)
    #: the runtime this transport trusts, and why (``wsync_conformance`` reports it in its table)
    trusted_runtime: ClassVar[tuple[str, str]] = TRUSTED_RUNTIME

    def __init__(self, *, channel: str | None = None, namespace: str = "wsync", address: str | None = None,
                 checksum: bool = False, zero_copy: bool | None = None, direct_acks: bool = True) -> None:
        channel = f"wsync-{uuid.uuid4().hex}" if channel is None else _name(channel, "channel")
        if address is not None:
            address = _name(address, "address")
        super().__init__(channel=channel, namespace=_name(namespace, "namespace"), address=address,
                         checksum=flag("ray option checksum", checksum),
                         zero_copy=flag("ray option zero_copy", zero_copy, optional=True),
                         direct_acks=flag("ray option direct_acks", direct_acks))

    def sender(self, ctx: SenderContext) -> SenderEndpoint:
        from .endpoints import RaySender

        return RaySender(self.options, ctx)

    def receiver(self, ctx: ReceiverContext) -> ReceiverEndpoint:
        from .endpoints import RayReceiver

        return RayReceiver(self.options, ctx)
