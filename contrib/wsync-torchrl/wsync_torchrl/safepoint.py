"""The worker's safe point: a lock held while the policy runs, so a new version lands between
two policy calls (two rollout steps), never during one."""

from __future__ import annotations

import threading
from typing import Any

from torch import nn

__all__ = ["SafePoint"]


class SafePoint:
    """A re-entrant lock that a module's forward holds (through hooks) while it runs.

    ``install(module)`` hooks it on; ``remove()`` takes the hooks off; ``hold()`` is the
    context manager a receiver enters to change the module's tensors.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = threading.local()
        self._handles: list[Any] = []
        self.module: nn.Module | None = None

    def install(self, module: nn.Module) -> None:
        """Hold the lock during every ``module(...)`` call (moving the hooks off a previous module)."""
        if module is self.module:
            return
        self.remove()
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]
        self.module = module

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.module = None

    def hold(self) -> threading.RLock:
        """The lock, for ``with``: the module is not running while it is held."""
        return self._lock

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._lock.acquire()
        self._depth.n = getattr(self._depth, "n", 0) + 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if getattr(self._depth, "n", 0) > 0:  # a pre-hook before ours may have raised
            self._depth.n -= 1
            self._lock.release()
