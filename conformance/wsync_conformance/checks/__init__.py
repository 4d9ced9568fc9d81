"""The suite's tests, one mixin class per guarantee (and one for the transport interface and one
for declared capabilities); ``TransportSuite`` is composed from them."""

from __future__ import annotations

from .atomic import AtomicChecks
from .capabilities import CapabilityChecks
from .base import SuiteBase
from .clean import CleanChecks
from .delta import DeltaChecks
from .endpoint import EndpointChecks
from .exact import ExactChecks
from .faults import FaultChecks
from .isolated import IsolatedChecks
from .lifecycle import LifecycleChecks
from .live import LiveChecks
from .ordered import OrderedChecks
from .portable import PortableChecks
from .safe import SafeChecks
from .targeted import TargetedChecks
from .versioned import VersionedChecks

__all__ = ["SuiteBase", "ExactChecks", "IsolatedChecks", "AtomicChecks", "VersionedChecks", "LifecycleChecks",
           "LiveChecks", "TargetedChecks", "OrderedChecks", "PortableChecks", "CleanChecks", "SafeChecks", "EndpointChecks", "CapabilityChecks",
           "DeltaChecks", "FaultChecks"]
