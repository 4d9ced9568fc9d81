"""The suite against the transport named on the command line:
``pytest --pyargs wsync_conformance --wsync-transport NAME [--wsync-device cuda] [--wsync-option K=V]``."""

from __future__ import annotations

import pytest

from wsync_core.transport import parse_options

from wsync_conformance.suite import TransportSuite
from wsync_conformance.target import Target


class TestConformance(TransportSuite):
    @pytest.fixture
    def wsync_target(self, request: pytest.FixtureRequest) -> Target:
        config = request.config
        return Target(config.getoption("wsync_transport"), parse_options(config.getoption("wsync_option")))
