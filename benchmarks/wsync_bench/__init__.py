"""wsync-bench: ``wsync bench``, transports side by side on this machine against its own floors.

Installing this distribution adds the ``bench`` command to ``wsync`` (through the
``wsync_register_commands`` hook); ``harness`` holds the measurement itself.
"""

from __future__ import annotations

from .harness import (
    BenchConfig,
    Report,
    Row,
    build_model,
    cuda_floor,
    format_size,
    format_table,
    machine_info,
    memcpy_floor,
    parse_size,
    plot,
    run,
    split_system,
    tcp_floor,
    write_json,
)

__all__ = [
    "BenchConfig",
    "Report",
    "Row",
    "build_model",
    "cuda_floor",
    "format_size",
    "format_table",
    "machine_info",
    "memcpy_floor",
    "parse_size",
    "plot",
    "run",
    "split_system",
    "tcp_floor",
    "write_json",
]
