"""``TransportSuite``: every guarantee of the contract (docs/guarantees.md) as tests, for any transport.

A transport's whole test file::

    from wsync_conformance import TransportSuite

    class TestMine(TransportSuite):
        transport = "mine"            # entry-point name, "module:Class", a class, object or factory
        options = {"port": 0}         # passed to the transport

Tests are marked ``wsync_guarantee(name)``; each guarantee's tests live in one module of
``wsync_conformance.checks``. Tests for capabilities the transport does not declare skip with
the reason.
"""

from __future__ import annotations

from .checks import (
    AtomicChecks,
    CapabilityChecks,
    CleanChecks,
    DeltaChecks,
    EndpointChecks,
    ExactChecks,
    FaultChecks,
    IsolatedChecks,
    LifecycleChecks,
    LiveChecks,
    OrderedChecks,
    PortableChecks,
    SafeChecks,
    SuiteBase,
    TargetedChecks,
    VersionedChecks,
)
from .holding import HoldingChecks
from .scenes import SceneChecks

__all__ = ["TransportSuite"]


class TransportSuite(
    ExactChecks,
    IsolatedChecks,
    AtomicChecks,
    VersionedChecks,
    LifecycleChecks,
    LiveChecks,
    TargetedChecks,
    OrderedChecks,
    PortableChecks,
    CleanChecks,
    SafeChecks,
    DeltaChecks,
    EndpointChecks,
    CapabilityChecks,
    FaultChecks,
    HoldingChecks,
    SceneChecks,
    SuiteBase,
):
    """Subclass and set ``transport`` (and ``options``) to run the whole suite against it."""
