"""What the suite tests: a transport given by name, ``module:attr``, class, object or factory,
with options parsed from ``KEY=VALUE`` strings."""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from wsync_core import Capabilities, Transport, get_transport
from wsync_core.transport import check_options, parse_options, parse_value

__all__ = ["parse_value", "parse_options", "seconds", "Target"]


def seconds(text: str) -> float:
    """``--wsync-timeout``'s value: a finite number of seconds > 0 (argparse reports anything else)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _load(spec: str) -> Any:
    if ":" in spec:
        module, _, attr = spec.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    return get_transport(spec)


@dataclass
class Target:
    """A transport under test: ``make()`` builds a fresh Transport object for each scheme."""

    transport: str | Transport | type[Transport] | Callable[..., Transport]
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._source = _load(self.transport) if isinstance(self.transport, str) else self.transport

    def make(self) -> Transport:
        """A new Transport object (a given object is used as it is)."""
        if isinstance(self._source, Transport):
            return self._source
        if isinstance(self._source, type) and issubclass(self._source, Transport):
            check_options(self._source, self.options)
        made = self._source(**dict(self.options))
        if not isinstance(made, Transport):
            raise TypeError(f"{self.transport!r} made a {type(made).__name__}, expected a wsync_core.Transport")
        return made

    @property
    def cls(self) -> type[Transport]:
        return type(self.make()) if not isinstance(self._source, type) else self._source

    @property
    def capabilities(self) -> Capabilities:
        return self.cls.capabilities

    @property
    def name(self) -> str:
        if isinstance(self.transport, str):
            return self.transport
        return getattr(self.cls, "name", self.cls.__name__)
