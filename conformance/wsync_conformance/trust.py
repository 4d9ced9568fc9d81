"""A transport built on a runtime that carries its own objects (Ray) may declare that it trusts
it: ``trusted_runtime = (module, reason)`` on its Transport class. In receivers, that runtime may
then unpickle its own classes (those of ``module`` and its submodules), and its processes may
listen beyond loopback; any other unpickling still fails the suite, and the table names the
runtime and the reason, so a user sees what the transport asks them to trust."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["trusted_runtime", "untrusted_unpickling"]


def trusted_runtime(cls: type) -> tuple[str, str] | None:
    """``(module, reason)`` that transport class ``cls`` declares, or None; raises TypeError for a
    malformed declaration."""
    value = getattr(cls, "trusted_runtime", None)
    if value is None:
        return None
    if not (isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) and v for v in value)):
        raise TypeError(f"{cls.__qualname__}.trusted_runtime must be (module, reason), two non-empty strings; "
                        f"got {value!r}")
    return value


def untrusted_unpickling(events: Iterable[Any], runtime: tuple[str, str] | None) -> list[Any]:
    """The ``find_class`` audit events (``[module, name]``) not of the trusted runtime's modules."""
    if runtime is None:
        return list(events)
    module = runtime[0]
    return [e for e in events if not (e and isinstance(e[0], str) and (e[0] == module or e[0].startswith(module + ".")))]
