"""Outcomes by guarantee: a pytest plugin object that ``wsync conformance`` registers, and the
table it prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from .guarantees import CAPABILITY_NAMES, GUARANTEES

__all__ = ["Collector", "Outcome", "ResultsWriter", "format_table", "marks", "note_hung"]

#: where the running ResultsWriter appends (for the watchdog's last word)
_results_path: list[str] = []


def note_hung(nodeid: str, message: str) -> None:
    """Record that test ``nodeid`` hung beyond interruption (the process is about to end)."""
    for path in _results_path:
        with open(path, "a") as f:
            f.write(json.dumps({"hung": nodeid, "message": message}) + "\n")


@dataclass
class Outcome:
    test: str
    status: str  # passed | failed | skipped
    reason: str = ""
    guarantees: list[str] = field(default_factory=list)
    capabilities: list[str] = field(default_factory=list)


def _reason(report: pytest.TestReport, call: pytest.CallInfo) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if call.excinfo is not None:
        text = str(call.excinfo.value).strip() or call.excinfo.typename
        first = text.splitlines()[0] if text else text
        return f"{call.excinfo.typename}: {first[:600]}"
    return ""


def marks(item: pytest.Item) -> tuple[list[str], list[str]]:
    """The guarantees and the capabilities a suite test is marked with."""
    return ([n for m in item.iter_markers("wsync_guarantee") for n in m.args],
            [n for m in item.iter_markers("wsync_capability") for n in m.args])


class Collector:
    """Records each wsync conformance test's outcome under the guarantees it is marked with."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Outcome] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        result = yield
        report = result.get_result()
        names, caps = marks(item)
        if not names:
            return
        test = item.name
        if report.when == "call" or report.failed or report.skipped:
            status = "failed" if report.failed else "skipped" if report.skipped else "passed"
            blamed, hung, dog = names, "", None
            if report.failed:
                # an error that names the guarantee it found broken counts against that one (a hung
                # call counts against "live"); any other error against the first the test is marked with
                error = call.excinfo.value if call.excinfo is not None else None
                named = getattr(error, "guarantee", None)
                blamed = [named] if named in GUARANTEES else names[:1]
            dog = getattr(item, "wsync_watchdog", None)
            if report.failed and dog is not None and dog.message:
                blamed, hung = ["live"], f"Hung: {dog.message}"
            prior = self.outcomes.get(item.nodeid)
            if prior is None or prior.status != "failed":
                reason = hung if report.failed and dog is not None and dog.message else _reason(report, call)
                self.outcomes[item.nodeid] = Outcome(test, status, reason, blamed, caps)

    def by_guarantee(self) -> dict[str, dict[str, Any]]:
        """guarantee -> {"status", "passed": [...], "failed": [(test, reason)], "skipped": [(test, reason)]}."""
        out = {}
        for g in GUARANTEES:
            mine = [o for o in self.outcomes.values() if g in o.guarantees]
            entry = {
                "passed": [o.test for o in mine if o.status == "passed"],
                "failed": [[o.test, o.reason] for o in mine if o.status == "failed"],
                "skipped": [[o.test, o.reason] for o in mine if o.status == "skipped"],
            }
            entry["status"] = ("failed" if entry["failed"] else "passed" if entry["passed"]
                               else "skipped" if entry["skipped"] else "not run")
            out[g] = entry
        return out

    def by_capability(self, declared: list[str]) -> dict[str, dict[str, Any]]:
        """declared capability -> {"status": passed|failed|skipped|untested, "tests": [(test, status, reason)]}."""
        out = {}
        for c in declared:
            mine = [o for o in self.outcomes.values() if c in o.capabilities]
            statuses = {o.status for o in mine}
            status = ("failed" if "failed" in statuses else "passed" if "passed" in statuses
                      else "skipped" if mine else "untested")
            out[c] = {"status": status, "tests": [[o.test, o.status, o.reason] for o in mine]}
        return out

    def to_json(self) -> str:
        return json.dumps(self.by_guarantee(), indent=2)


class ResultsWriter(Collector):
    """A Collector that also appends each test's start (with its marks) and outcome to a file, one
    JSON line each, so a parent process keeps them if this one is ended by the watchdog or dies."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        _results_path[:] = [path]

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        names, caps = marks(item)
        self._append({"started": item.nodeid, "test": item.name, "guarantees": names, "capabilities": caps})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        before = self.outcomes.get(item.nodeid)
        yield from super().pytest_runtest_makereport(item, call)
        after = self.outcomes.get(item.nodeid)
        if after is not None and after is not before:
            self._append({"nodeid": item.nodeid, "test": after.test, "status": after.status, "reason": after.reason,
                          "guarantees": after.guarantees, "capabilities": after.capabilities})


#: the width of the tables' first column
_NAME_WIDTH = max(len(name) for name in (*GUARANTEES, *CAPABILITY_NAMES, "capability"))


def format_table(results: dict[str, dict[str, Any]], header: str, declared: list[str],
                 capabilities: dict[str, dict[str, Any]] | None = None,
                 trusted: tuple[str, str] | None = None) -> str:
    """The table ``wsync conformance`` prints: one row per guarantee, then the capabilities and
    the runtime the transport trusts (``trusted``: module and reason), if any."""
    w = _NAME_WIDTH
    lines = [header, "", f"{'guarantee':<{w}} {'result':<8} detail", f"{'-' * w} {'-' * 8} {'-' * 50}"]
    for g, r in results.items():
        if r["status"] == "failed":
            detail = "; ".join(f"{t}: {why}" for t, why in r["failed"])
        elif r["status"] == "passed":
            detail = f"{len(r['passed'])} test{'s' if len(r['passed']) != 1 else ''}"
            if r["skipped"]:
                detail += f" ({len(r['skipped'])} skipped: " + "; ".join(sorted({why for _, why in r["skipped"]})) + ")"
        elif r["status"] == "skipped":
            detail = "; ".join(sorted({why for _, why in r["skipped"]}))
        else:
            detail = "no test selected"
        lines.append(f"{g:<{w}} {r['status']:<8} {detail}")
    if capabilities:
        lines += ["", f"{'capability':<{w}} {'result':<8} detail", f"{'-' * w} {'-' * 8} {'-' * 50}"]
        for c, r in capabilities.items():
            if r["status"] in ("failed", "skipped"):
                detail = "; ".join(f"{t}: {why}" for t, st, why in r["tests"] if st == r["status"])
            elif r["status"] == "passed":
                detail = ", ".join(t for t, st, _ in r["tests"] if st == "passed")
            else:
                detail = "declared, but no test of it ran"
            lines.append(f"{c:<{w}} {r['status']:<8} {detail}")
    lines += ["", "capabilities declared: " + (", ".join(declared) or "none"),
              "not declared (their tests skip): " + (", ".join(c for c in CAPABILITY_NAMES if c not in declared)
                                                     or "none")]
    if trusted is not None:
        lines.append(f"trusted runtime: {trusted[0]} ({trusted[1]})")
    return "\n".join(lines)
