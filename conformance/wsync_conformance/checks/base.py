"""What every check mixin relies on: the transport under test, its timeouts, and the per-test
``wsync`` fixture (a ``Context``) under a budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from wsync_core import Transport

from ..context import Context
from ..target import Target

__all__ = ["SuiteBase", "SLACK_S", "option"]

#: slack on top of a timeout before a call counts as not honouring it (the machine may be busy)
SLACK_S = 20.0


def option(request: pytest.FixtureRequest, name: str) -> Any:
    """The value of pytest option ``name``, or None when the wsync_conformance plugin is not loaded."""
    try:
        return request.config.getoption(name)
    except ValueError:
        return None


class SuiteBase:
    """The configuration a transport's test class sets, and the fixtures every check uses."""

    #: entry-point name, ``"module:attr"``, Transport class, Transport object or factory(**options)
    transport: ClassVar[str | Transport | type[Transport] | Callable[..., Transport]] = "inproc"
    #: options for the transport
    options: ClassVar[dict[str, Any]] = {}
    #: ``cpu`` or ``cuda`` (``--wsync-device`` overrides)
    device: ClassVar[str] = "cpu"
    #: seconds a call that should succeed may take (``--wsync-timeout`` overrides)
    timeout: ClassVar[float] = 30.0
    #: seconds for calls that must time out
    short_timeout: ClassVar[float] = 1.0
    #: size of the large tensor in the rich model
    large_mib: ClassVar[int] = 4

    @pytest.fixture
    def wsync_target(self) -> Target:
        """The transport under test (``TestConformance`` takes it from the command line)."""
        return Target(type(self).transport, dict(type(self).options))

    @pytest.fixture
    def wsync(self, request: pytest.FixtureRequest, wsync_target: Target):
        """A Context for one test; frees every scheme and returns every receiver runner after it."""
        device = option(request, "wsync_device") or self.device
        timeout = option(request, "wsync_timeout") or self.timeout
        if device == "cuda":
            if not torch.cuda.is_available():
                pytest.skip("CUDA is not available on this machine")
            if not wsync_target.capabilities.cuda:
                pytest.skip(f"transport {wsync_target.name!r} does not declare the 'cuda' capability")
        ctx = Context(wsync_target, device, float(timeout), self.short_timeout)
        try:
            yield ctx
        finally:
            ctx.close()
