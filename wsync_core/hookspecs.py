"""The hooks a wsync plugin implements (pluggy project name ``"wsync"``).

A plugin is a module listed under the ``wsync`` entry-point group::

    [project.entry-points.wsync]
    mytransport = "my_package.plugin"

whose hook implementations are marked with ``wsync_core.hookimpl``.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

__all__ = ["hookspec", "hookimpl", "wsync_register_transports", "wsync_register_commands"]

hookspec = pluggy.HookspecMarker("wsync")
hookimpl = pluggy.HookimplMarker("wsync")


@hookspec
def wsync_register_transports(register: Callable[[type], None]) -> None:
    """Register transports: call ``register(TransportClass)`` once for each.

    The class subclasses ``wsync_core.Transport`` and sets ``name`` and ``capabilities``.
    """


@hookspec
def wsync_register_commands(register: Callable[..., None]) -> None:
    """Register subcommands of the ``wsync`` command: call ``register(name, help, configure, run)``
    once for each, where ``configure(parser)`` adds the command's arguments to an
    ``argparse.ArgumentParser`` and ``run(args)`` does the work and returns the exit status.
    """
