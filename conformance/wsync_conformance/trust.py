"""A transport built on a runtime that carries its own objects (Ray) may declare that it trusts
it: ``trusted_runtime = (module, reason)`` on its Transport class. In receivers, that runtime may
then unpickle its own classes (those of ``module`` and its submodules), its own code may unpickle
(the runtime loading what it ships between its processes: Ray loads an actor's class definition
from its control store), and its processes may listen beyond loopback; any other unpickling (the
transport's code, wsync's, anyone's outside the runtime) still fails the suite, and the table
names the runtime and the reason, so a user sees what the transport asks them to trust.

An audit event is ``[module, name]`` (the class ``pickle.find_class`` looked up), or
``["(no class)", loader]`` (a call of one of pickle's loaders, e.g. ``pickle.loads``), and,
where the harness could tell, the unpickling code as ``"module:function"``."""

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
    """The unpickling audit events (``[module, name, unpickler]``) neither of the trusted
    runtime's classes nor unpickled by the runtime's own code."""
    if runtime is None:
        return list(events)
    module = runtime[0]

    def within(name: Any) -> bool:
        return isinstance(name, str) and (name == module or name.startswith(module + "."))

    return [e for e in events if not (e and (within(e[0]) or len(e) > 2 and within(str(e[2]).split(":")[0])))]
