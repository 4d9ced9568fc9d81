"""Plugin discovery: transports registered through the ``wsync`` entry-point group with pluggy.

Plugins load once, on first use. A plugin that fails to import or to register is listed with
its error and breaks nothing else. ``WSYNC_DISABLE_PLUGINS=name,...`` (entry-point or
transport names) turns plugins off.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import UnknownTransportError
from .transport import Transport, check_interface, check_options

__all__ = ["TransportInfo", "Command", "list_transports", "get_transport", "resolve_transport", "list_commands",
           "failed_plugins", "install_hint", "ENTRY_POINT_GROUP"]

log = logging.getLogger("wsync")

ENTRY_POINT_GROUP = "wsync"
#: built-in plugin modules, registered without an entry point
_BUILTIN = ("wsync_core.inproc",)
#: where the plugins of this project's repository lie (they are not published on a package index):
#: what an unknown name's error tells the user to install
_IN_REPOSITORY = {
    **{name: f"plugins/wsync-{name}" for name in ("shm", "mp", "distributed", "rpc", "zmq")},
    **{name: f"contrib/wsync-{name}" for name in ("tcp", "unix", "files", "ray")},
    "conformance": "conformance", "bench": "benchmarks",
}


@dataclass(frozen=True)
class TransportInfo:
    """One installed transport (or a plugin that failed to load, with ``error`` set)."""

    name: str
    distribution: str | None
    version: str | None
    capabilities: list[str] = field(default_factory=list)
    error: str | None = None
    plugin: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Its fields as a dict of plain values (``wsync transports --json``)."""
        return asdict(self)


@dataclass(frozen=True)
class Command:
    """A ``wsync`` subcommand a plugin registered: ``configure(parser)`` adds its arguments,
    ``run(args)`` returns the exit status."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    distribution: str | None = None


@dataclass
class _Loaded:
    key: str
    classes: dict[str, type[Transport]]
    infos: dict[str, TransportInfo]
    commands: dict[str, Command] = field(default_factory=dict)
    #: plugin name -> the error it failed to load or register with
    failed: dict[str, str] = field(default_factory=dict)


_cache: _Loaded | None = None


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get("WSYNC_DISABLE_PLUGINS", "").split(",") if n.strip()}


def _load() -> _Loaded:
    global _cache
    key = os.environ.get("WSYNC_DISABLE_PLUGINS", "")
    if _cache is not None and _cache.key == key:
        return _cache
    disabled = _disabled()
    pm = pluggy.PluginManager("wsync")
    pm.add_hookspecs(hookspecs)
    classes: dict[str, type[Transport]] = {}
    infos: dict[str, TransportInfo] = {}
    origin: dict[str, tuple[str | None, str | None]] = {}  # plugin name -> (distribution, version)
    failed: dict[str, str] = {}

    from . import __version__

    for modname in _BUILTIN:
        module = importlib.import_module(modname)
        pm.register(module, name=modname)
        origin[modname] = ("wsync-core", __version__)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in disabled or ep.name in pm.list_name_plugin():
            continue
        dist = ep.dist.name if ep.dist else None
        dver = ep.dist.version if ep.dist else None
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
        except Exception as exc:  # a broken plugin must not break the others
            log.warning("wsync plugin %r (%s) failed to load: %s", ep.name, dist, exc)
            failed[ep.name] = f"{type(exc).__name__}: {exc}"
            infos[ep.name] = TransportInfo(ep.name, dist, dver, error=failed[ep.name], plugin=ep.name)
            continue
        origin[ep.name] = (dist, dver)

    for impl in pm.hook.wsync_register_transports.get_hookimpls():
        plugin = impl.plugin_name
        dist, dver = origin.get(plugin, (None, None))

        def register(cls: type, _plugin: str = plugin, _dist: str | None = dist, _ver: str | None = dver) -> None:
            if not (isinstance(cls, type) and issubclass(cls, Transport)):
                raise TypeError(f"register() takes a Transport subclass, got {cls!r}")
            name = getattr(cls, "name", None)
            if not isinstance(name, str) or not name.isidentifier():
                raise TypeError(f"{cls.__qualname__}.name must be an identifier string, got {name!r}")
            check_interface(cls)
            if name in disabled:
                return
            if name in classes:
                raise ValueError(f"transport {name!r} is already registered by {infos[name].plugin}")
            classes[name] = cls
            infos[name] = TransportInfo(name, _dist, _ver, cls.capabilities.declared(), plugin=_plugin)

        try:
            impl.function(**{arg: register for arg in impl.argnames})
        except Exception as exc:  # a broken plugin must not break the others
            log.warning("wsync plugin %r failed to register its transports: %s", plugin, exc)
            failed[plugin] = f"{type(exc).__name__}: {exc}"
            infos.setdefault(plugin, TransportInfo(plugin, dist, dver, error=failed[plugin], plugin=plugin))
    commands: dict[str, Command] = {}
    for impl in pm.hook.wsync_register_commands.get_hookimpls():
        plugin = impl.plugin_name

        def add(name: str, help: str, configure: Callable, run: Callable, _dist: str | None = origin.get(
                plugin, (None, None))[0]) -> None:
            if not (isinstance(name, str) and name.isidentifier() and callable(configure) and callable(run)):
                raise TypeError(f"register(name, help, configure, run) got {name!r}, {configure!r}, {run!r}")
            if name in commands or name == "transports":
                raise ValueError(f"command {name!r} is already registered")
            commands[name] = Command(name, str(help), configure, run, _dist)

        try:
            impl.function(**{arg: add for arg in impl.argnames})
        except Exception as exc:  # a broken plugin must not break the others
            log.warning("wsync plugin %r failed to register its commands: %s", plugin, exc)
            failed[plugin] = f"{type(exc).__name__}: {exc}"
    _cache = _Loaded(key, classes, infos, commands, failed)
    return _cache


def list_transports() -> list[TransportInfo]:
    """Every installed transport, sorted by name, with plugins that failed to load (``error`` set)."""
    return sorted(_load().infos.values(), key=lambda i: i.name)


def get_transport(name: str) -> type[Transport]:
    """The transport class registered as ``name``; raises UnknownTransportError if there is none."""
    loaded = _load()
    cls = loaded.classes.get(name)
    if cls is not None:
        return cls
    installed = ", ".join(sorted(loaded.classes)) or "none"
    info = loaded.infos.get(name)
    if info is not None and info.error:
        raise UnknownTransportError(f"transport {name!r} is installed ({info.distribution}) but failed to load: "
                                    f"{info.error}. Installed transports: {installed}")
    hint = install_hint(name, "transport")
    if name in _disabled():
        hint = f"it is disabled by WSYNC_DISABLE_PLUGINS={os.environ['WSYNC_DISABLE_PLUGINS']}"
    raise UnknownTransportError(f"no transport named {name!r}; installed: {installed}. To get it: {hint}")


def install_hint(name: str, kind: str) -> str:
    """How to get the ``kind`` ("transport" or "command") called ``name``: the folder of this project's
    repository it ships in, or how a third party's plugin makes itself known."""
    folder = _IN_REPOSITORY.get(name)
    if folder is not None:
        return f"it ships with wsync's repository: pip install -e {folder} (from a clone of it)"
    return (f"no plugin of wsync's repository provides a {kind} {name!r}; one from elsewhere registers it "
            f"under the 'wsync' entry point group once its distribution is installed")


def list_commands() -> dict[str, Command]:
    """The ``wsync`` subcommands installed plugins registered, by name."""
    return dict(_load().commands)


def failed_plugins() -> dict[str, str]:
    """Installed plugins that failed to load or to register what they provide: name -> the error."""
    return dict(_load().failed)


def resolve_transport(transport: str | Transport, options: dict[str, Any]) -> Transport:
    """A Transport object from a name and options, or the object itself (then ``options`` must be empty)."""
    if isinstance(transport, Transport):
        check_interface(type(transport))
        if options:
            raise TypeError(f"options {sorted(options)} are for a transport given by name; "
                            f"pass them to {type(transport).__name__}(...) instead")
        return transport
    if not isinstance(transport, str):
        raise TypeError(f"transport must be a name or a Transport object, got {type(transport).__name__}")
    cls = get_transport(transport)
    check_options(cls, options)
    return cls(**options)
