"""The adapter's tests import their helpers (a pendulum, a policy stamping its weights) by name,
here and in the collectors' worker processes."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

collect_ignore = ["torchrl_suite"]
