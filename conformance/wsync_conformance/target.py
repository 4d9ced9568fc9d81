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
from wsync_core.transport import check_options

__all__ = ["seconds", "Target"]


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
    """A transport under test: a registered name, a Transport class or factory (with ``options``), or
    a Transport object. ``make()`` builds a fresh Transport object for each scheme, unless an object was given."""

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
        """The Transport class under test."""
        return type(self.make()) if not isinstance(self._source, type) else self._source

    @property
    def capabilities(self) -> Capabilities:
        """What the transport under test declares it can do."""
        return self.cls.capabilities

    @property
    def name(self) -> str:
        """The transport's registered name (its class name where it has none)."""
        if isinstance(self.transport, str):
            return self.transport
        return getattr(self.cls, "name", self.cls.__name__)
