"""The whole wsync conformance suite against ``files``, each test in its own temporary directory."""

import pytest
from wsync_conformance import Target, TransportSuite


class TestFilesConformance(TransportSuite):
    transport = "files"

    @pytest.fixture
    def wsync_target(self, tmp_path) -> Target:
        return Target(self.transport, {"directory": str(tmp_path)})
