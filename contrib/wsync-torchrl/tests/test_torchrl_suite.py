"""TorchRL's own collector tests with wsync swapped in (opt-in: they take minutes and fetch
TorchRL's test files). ``WSYNC_TORCHRL_SUITE=1``: the weight-sync tests; ``=all``: the whole
file. ``WSYNC_TORCHRL_SRC`` may name a pytorch/rl checkout to take them from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parent / "torchrl_suite" / "run.py"
MODE = os.environ.get("WSYNC_TORCHRL_SUITE", "")


@pytest.mark.skipif(not MODE, reason="opt-in: WSYNC_TORCHRL_SUITE=1 (weight-sync tests) or =all")
@pytest.mark.timeout(3600)
def test_torchrl_collector_tests_pass_with_wsync():
    args = ["--all"] if MODE == "all" else []
    out = subprocess.run([sys.executable, str(RUN), *args, "-p", "no:warnings", "-q", "--timeout", "300"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]
