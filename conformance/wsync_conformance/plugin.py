"""pytest plugin (entry point ``pytest11``): the ``--wsync-*`` options, the ``wsync_guarantee``
marker and the hypothesis profiles. It changes nothing else in a pytest run."""

from __future__ import annotations

import contextlib

import pytest

from . import profiles
from .guarantees import GUARANTEES
from .target import seconds

profiles.register()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("wsync", "wsync conformance suite")
    group.addoption("--wsync-transport", default="inproc", metavar="NAME",
                    help="transport to test: entry-point name or module:Class (default: inproc)")
    group.addoption("--wsync-device", default=None, choices=["cpu", "cuda"],
                    help="device of the models (default: cpu)")
    group.addoption("--wsync-option", action="append", default=[], metavar="KEY=VALUE",
                    help="transport option, repeatable; values parse as int, float, bool, None or string")
    group.addoption("--wsync-timeout", type=seconds, default=None, metavar="SECONDS",
                    help="seconds a call that should succeed may take (default: 30)")
    group.addoption("--thorough", action="store_true", dest="wsync_thorough", default=False,
                    help="the longer profile: the thorough hypothesis profile, the tests marked thorough, "
                         "ten times the budget per test")
    group.addoption("--wsync-results", default=None, metavar="FILE",
                    help="append each test's start and outcome to FILE as JSON lines (used by wsync conformance)")
    group.addoption("--wsync-guarantee", action="append", default=[], metavar="NAME",
                    help=f"only run the tests of these guarantees ({', '.join(GUARANTEES)})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "wsync_guarantee(*names): the wsync guarantees a conformance test proves")
    config.addinivalue_line("markers", "wsync_budget(seconds, timeouts, short_timeouts): waits a conformance "
                                       "test declares beyond its budget")
    config.addinivalue_line("markers", "wsync_thorough: a conformance test that runs only with --thorough")
    config.addinivalue_line("markers", "wsync_capability(name): the declared capability a conformance test proves")
    try:
        chosen = config.getoption("hypothesis_profile")
    except ValueError:  # hypothesis's pytest plugin is not loaded
        chosen = None
    if chosen is None and config.getoption("wsync_thorough"):
        chosen = "thorough"
    if config.getoption("wsync_results"):
        from .report import ResultsWriter

        config.pluginmanager.register(ResultsWriter(config.getoption("wsync_results")), "wsync-results")
    profiles.choose(chosen)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("wsync_guarantee") or [])
    if not wanted:
        return
    unknown = wanted - set(GUARANTEES)
    if unknown:
        raise pytest.UsageError(f"--wsync-guarantee: unknown {sorted(unknown)}; known: {', '.join(GUARANTEES)}")
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        marks = [m for m in item.iter_markers("wsync_guarantee")]
        names = {n for m in marks for n in m.args}
        (keep if not marks or names & wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """The test's watchdog stops when its teardown ends, however it ends: a ``Hung`` raised in one
    fixture's teardown (a BaseException) makes pytest skip the finalizers after it, the watchdog's
    own among them, and a watchdog left running would end the process during a later test."""
    try:
        return (yield)
    finally:
        dog = getattr(item, "wsync_watchdog", None)
        if dog is not None:
            dog.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test whose watchdog fired fails under "live" with the watchdog's finding first, whatever
    error the interrupted test raised next. The watchdog neither counts nor interrupts the
    making of the report (``Watchdog.reporting``)."""
    dog = getattr(item, "wsync_watchdog", None)
    with dog.reporting() if dog is not None else contextlib.nullcontext():
        outcome = yield
    report = outcome.get_result()
    message = dog.message if dog is not None else None
    if message and report.failed and not getattr(item, "wsync_hung_reported", False):
        setattr(item, "wsync_hung_reported", True)  # (an attribute of wsync's own on pytest's item)
        report.sections.insert(0, ("wsync watchdog", message))
        report.longrepr = f"[live] {message}\n\n{report.longrepr}"
