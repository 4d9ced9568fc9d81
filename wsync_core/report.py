"""What each send leaves behind: a small report a user can read or listen to."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SendReport"]


@dataclass
class SendReport:
    """One version's journey: size, targets, the time of each phase, and each worker's ack.

    ``nbytes``: the payload bytes sent to a worker (the largest, when workers got different
    payloads); ``worker_nbytes`` maps each worker the version was published to, to its payload's
    bytes on the wire; ``full_nbytes``: what a full payload takes. ``changed``: the share of the
    model's elements this version changed (``delta=True`` only, else None); ``delta_workers``: the
    workers that got a delta. Phases, in seconds: ``diff_s`` (comparing with the last version,
    ``delta=True``), ``snapshot_s`` (writing the payloads), ``publish_s`` (handing them to the
    transport), ``acks_s`` (from then to the last ack). ``ack_latency`` maps a worker to the
    seconds from the start of the send to its ack; it fills in as acks arrive (with
    ``sync=False``, after ``send`` returned). ``missing`` lists the targets that had not acked
    when the send was last waited on.
    """

    version: int
    nbytes: int
    targets: list[int]
    snapshot_s: float = 0.0
    publish_s: float = 0.0
    total_s: float | None = None
    ack_latency: dict[int, float] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    worker_nbytes: dict[int, int] = field(default_factory=dict)
    full_nbytes: int = 0
    changed: float | None = None
    delta_workers: list[int] = field(default_factory=list)
    diff_s: float = 0.0

    @property
    def acks_s(self) -> float | None:
        """Seconds from the end of publishing to the last ack, once complete."""
        if self.total_s is None:
            return None
        return max(0.0, self.total_s - self.diff_s - self.snapshot_s - self.publish_s)

    @property
    def complete(self) -> bool:
        """True once every target has acked this version (or a newer one)."""
        return len(self.ack_latency) == len(self.targets)

    @property
    def throughput(self) -> float | None:
        """Bytes per second over the whole send (snapshot to last ack), once complete."""
        if self.total_s is None or self.total_s <= 0:
            return None
        return self.nbytes / self.total_s
