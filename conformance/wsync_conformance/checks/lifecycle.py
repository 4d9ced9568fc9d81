"""The lifecycle state machine: every guarantee it checks, after every step."""

from __future__ import annotations



from ..context import Context
from ..guarantees import guarantee
from ..stateful import run_lifecycle_machine

__all__ = ["LifecycleChecks"]


class LifecycleChecks:
    """The lifecycle tests (a mixin of ``TransportSuite``)."""

    @guarantee("versioned", "atomic", "exact", "isolated", "targeted", "live", "portable", "clean", "safe")
    def test_lifecycle_state_machine(self, wsync: Context) -> None:
        """Random sequences of sends, subset and async sends, receives, silent workers, unsent
        writes, pickling and shutdown; every invariant checked after every step."""
        run_lifecycle_machine(wsync)
