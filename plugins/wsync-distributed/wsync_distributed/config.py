"""``Config``: a channel's options once resolved, shared by the transport, its endpoints and the wire."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """Resolved options, as every endpoint of one channel sees them."""

    backend: str
    host: str
    port: int
    world_size: int | None
    rank: int | None
    bucket_bytes: int
    timeout: float
    heartbeat_timeout: float
    bind: str
    prefix: str
    devices: int
    stream: bool = True
