"""Hypothesis profiles: ``ci`` (derandomized, bounded time; the default) and ``thorough``."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

__all__ = ["PROFILES", "DEFAULT_PROFILE", "register", "current", "scaled"]

DEFAULT_PROFILE = "ci"
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.function_scoped_fixture]

PROFILES: dict[str, settings] = {
    # no shrinking in ci: a failing example of a slow, timing-out transport is reported as found
    "ci": settings(derandomize=True, max_examples=10, stateful_step_count=12, deadline=None, database=None,
                   suppress_health_check=_SUPPRESS, print_blob=True, report_multiple_bugs=False,
                   phases=(Phase.explicit, Phase.reuse, Phase.generate)),
    "thorough": settings(max_examples=100, stateful_step_count=50, deadline=None, database=None,
                         suppress_health_check=_SUPPRESS, print_blob=True),
}

_chosen: dict[str, str | None] = {"name": None}


def register() -> None:
    """Register the profiles with hypothesis (``--hypothesis-profile ci|thorough`` then works)."""
    for name, s in PROFILES.items():
        settings.register_profile(f"wsync-{name}", s)
        settings.register_profile(name, s)


def choose(name: str | None) -> None:
    """Use profile ``name`` for the suite (None: HYPOTHESIS_PROFILE, else ``ci``)."""
    _chosen["name"] = name


def current() -> settings:
    """The suite's settings: the chosen profile, HYPOTHESIS_PROFILE, or ``ci``."""
    name = _chosen["name"] or os.environ.get("HYPOTHESIS_PROFILE") or DEFAULT_PROFILE
    try:
        return settings.get_profile(name)
    except Exception:  # an unknown name: hypothesis raises InvalidArgument
        raise ValueError(f"unknown hypothesis profile {name!r}; wsync registers: {', '.join(PROFILES)}") from None


def scaled(fraction: float, at_least: int = 1, **overrides) -> settings:
    """The current profile with ``max_examples`` scaled by ``fraction`` (for slow examples)."""
    base = current()
    return settings(base, max_examples=max(at_least, round(base.max_examples * fraction)), **overrides)
