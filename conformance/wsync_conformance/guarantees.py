"""The ten guarantees (docs/guarantees.md), by name, and how a test says which one it proves."""

from __future__ import annotations

from dataclasses import fields

import pytest
from wsync_core import Capabilities

__all__ = ["GUARANTEES", "CAPABILITY_NAMES", "guarantee", "capability", "GuaranteeViolation", "violated"]

#: name -> one line from docs/guarantees.md
GUARANTEES: dict[str, str] = {
    "exact": "the receiver's model equals the sender's snapshot bit for bit",
    "isolated": "receivers never see what the trainer wrote but did not send",
    "atomic": "a model never holds a mix of versions; bad payloads leave it untouched",
    "versioned": "versions rise by one per send; acks name their version",
    "live": "every blocking call honours a timeout; the scheme stays usable",
    "targeted": "send(worker_ids=...) changes those workers and no other",
    "ordered": "a call out of order raises StateError and never half-happens",
    "portable": "a pickled scheme holds configuration only",
    "clean": "shutdown and exit free every resource",
    "safe": "nothing received is unpickled; damaged bytes never damage a model",
}

#: every field of wsync_core.Capabilities
CAPABILITY_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Capabilities))


def guarantee(*names: str) -> pytest.MarkDecorator:
    """Mark a test as proving ``names`` (a failure counts against them)."""
    for name in names:
        if name not in GUARANTEES:
            raise ValueError(f"unknown guarantee {name!r}; known: {', '.join(GUARANTEES)}")
    return pytest.mark.wsync_guarantee(*names)


class GuaranteeViolation(AssertionError):
    """An assertion that names the guarantee it found broken (used by tests marked with several)."""

    def __init__(self, guarantee: str, message: str) -> None:
        super().__init__(f"[{guarantee}] {message}")
        self.guarantee = guarantee


def violated(name: str, message: str) -> GuaranteeViolation:
    """The error to raise when guarantee ``name`` is broken."""
    return GuaranteeViolation(name, message)


def capability(name: str) -> pytest.MarkDecorator:
    """Mark a test as proving the declared capability ``name``."""
    if name not in CAPABILITY_NAMES:
        raise ValueError(f"unknown capability {name!r}; known: {', '.join(CAPABILITY_NAMES)}")
    return pytest.mark.wsync_capability(name)
