"""What each send leaves behind: a small report a user can read or listen to."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SendReport"]


@dataclass
class SendReport:
    """One version's journey: size, targets, how long the snapshot took, and each worker's ack.

    ``ack_latency`` maps a worker to the seconds from the start of the send to its ack; it fills
    in as acks arrive (with ``sync=False``, after ``send`` returned). ``missing`` lists the
    targets that had not acked when the send was last waited on.
    """

    version: int
    nbytes: int
    targets: list[int]
    snapshot_s: float = 0.0
    publish_s: float = 0.0
    total_s: float | None = None
    ack_latency: dict[int, float] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)

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
