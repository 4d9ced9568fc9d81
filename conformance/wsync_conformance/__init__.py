"""wsync-conformance: the suite that proves a transport keeps wsync's guarantees.

Subclass ``TransportSuite`` (set ``transport`` and ``options``), or run
``pytest --pyargs wsync_conformance --wsync-transport NAME`` or ``wsync conformance NAME``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from .guarantees import CAPABILITY_NAMES, GUARANTEES, GuaranteeViolation, guarantee

__all__ = ["__version__", "TransportSuite", "Target", "GUARANTEES", "CAPABILITY_NAMES", "GuaranteeViolation",
           "guarantee"]


def __getattr__(name: str) -> Any:
    # the suite imports torch: load it on first use, not when pytest loads the plugin
    if name == "TransportSuite":
        from .suite import TransportSuite

        return TransportSuite
    if name == "Target":
        from .target import Target

        return Target
    raise AttributeError(f"module 'wsync_conformance' has no attribute {name!r}")
