"""``wsync conformance NAME``: run the suite against a transport and print a table by guarantee."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from . import profiles
from .target import seconds

__all__ = ["main", "build_parser", "add_arguments", "pytest_args", "run_suite"]


def pytest_args(args: argparse.Namespace) -> list[str]:
    """The pytest command line equivalent to ``args``."""
    out = ["--pyargs", "wsync_conformance", "--wsync-transport", args.name, "-q", "--tb=short",
           "-p", "no:cacheprovider"]
    if getattr(args, "device", None):
        out += ["--wsync-device", args.device]
    for opt in getattr(args, "option", None) or []:
        out += ["--wsync-option", opt]
    if getattr(args, "timeout", None) is not None:
        out += ["--wsync-timeout", str(args.timeout)]
    for g in getattr(args, "guarantee", None) or []:
        out += ["--wsync-guarantee", g]
    if getattr(args, "profile", None):
        out += ["--hypothesis-profile", args.profile]
    if getattr(args, "thorough", False) or getattr(args, "profile", None) == "thorough":
        out += ["--thorough"]
    if getattr(args, "keyword", None):
        out += ["-k", args.keyword]
    return out


def main(args: argparse.Namespace) -> int:
    """Run the suite; print the table; return non-zero on any failure (or if nothing ran)."""
    from wsync_core.transport import parse_options

    from .report import Collector, format_table
    from .target import Target
    from .trust import trusted_runtime

    try:
        target = Target(args.name, parse_options(getattr(args, "option", None) or []))
        target.make()  # options the transport rejects are a usage error, not 28 failures
        declared = target.capabilities.declared()
        trusted = trusted_runtime(target.cls)
        label = f"transport {target.name!r} ({target.cls.__module__}.{target.cls.__qualname__})"
    except Exception as exc:  # unknown transport, bad option: say so instead of a traceback
        print(f"wsync conformance: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    collector = Collector()
    code = run_suite(pytest_args(args), collector)
    results = collector.by_guarantee()
    profile = getattr(args, "profile", None) or ("thorough" if getattr(args, "thorough", False) else "ci")
    header = f"wsync conformance: {label}, device {getattr(args, 'device', None) or 'cpu'}, profile {profile}"
    print()
    capabilities = collector.by_capability(declared)
    print(format_table(results, header, declared, capabilities, trusted))
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            f.write(collector.to_json())
    failed = [g for g, r in results.items() if r["status"] == "failed"]
    failed += [f"capability {c}" for c, r in capabilities.items() if r["status"] == "failed"]
    selected = not (getattr(args, "keyword", None) or getattr(args, "guarantee", None))
    untested = [c for c, r in capabilities.items() if r["status"] == "untested" and selected]
    if untested:
        failed.append(f"declared capabilities no test ran: {', '.join(untested)}")
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
        return 1
    if code not in (0, 5) or not collector.outcomes:
        print(f"\npytest exited with status {int(code)}")
        return int(code) or 1
    if not any(r["status"] == "passed" for r in results.values()):
        print("\nSKIPPED: no guarantee could be tested here (see the reasons above)")
        return 0
    print("\nPASSED: every guarantee that applies")
    return 0


def run_suite(argv: list[str], collector) -> int:
    """Run pytest ``argv`` in a child process, recording outcomes into ``collector``. If the
    child ends with the watchdog's status (a test hung in C, past every interruption), the hung
    test is recorded as failed under live; if it dies of a signal (a crash in native code), the
    test it died in is recorded as failed under its guarantee, naming the signal. Either way the
    run goes on without the tests already run. Returns pytest's exit status."""
    from .report import Outcome
    from .watchdog import HUNG_EXIT_STATUS

    skip: list[str] = []
    with tempfile.TemporaryDirectory(prefix="wsync-conformance-") as tmp:
        path = os.path.join(tmp, "results.jsonl")
        while True:
            open(path, "w").close()
            cmd = [sys.executable, "-m", "pytest", *argv, f"--wsync-results={path}", *(f"--deselect={n}" for n in skip)]
            code = subprocess.call(cmd)
            started: list[dict] = []
            hung: dict[str, str] = {}
            with open(path) as f:
                for line in f:
                    rec = json.loads(line)
                    if "started" in rec:
                        started.append(rec)
                    elif "hung" in rec:
                        hung[rec["hung"]] = rec["message"]
                    else:
                        collector.outcomes[rec["nodeid"]] = Outcome(rec["test"], rec["status"], rec["reason"],
                                                                    rec["guarantees"], rec["capabilities"])
            if code != HUNG_EXIT_STATUS and code >= 0 or not started:
                return code
            rec = started[-1]
            last = rec["started"]
            if code == HUNG_EXIT_STATUS:
                what = "hung past every interruption"
                outcome = Outcome(rec["test"], "failed", "Hung: " + hung.get(
                    last, "the test hung in a call that could not be interrupted; the process was ended"), ["live"])
            else:
                what = f"crashed the test process ({_signal_name(-code)})"
                outcome = Outcome(rec["test"], "failed", f"Crashed: the test process died of {_signal_name(-code)} "
                                  f"in this test (a fault in native code; its stack is printed above)",
                                  rec["guarantees"][:1], rec["capabilities"])
            if last not in collector.outcomes or collector.outcomes[last].status != "failed":
                collector.outcomes[last] = outcome
            print(f"\nwsync conformance: {last} {what}; going on with the rest\n", flush=True)
            skip = sorted(set(skip) | {r["started"] for r in started})


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def build_parser() -> argparse.ArgumentParser:
    """``python -m wsync_conformance``: the arguments of ``wsync conformance``."""
    p = argparse.ArgumentParser(prog="python -m wsync_conformance", description=__doc__)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``wsync conformance``."""
    p.add_argument("name", help="transport: entry-point name or module:Class")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--profile", default=None, choices=sorted(profiles.PROFILES),
                   help="hypothesis profile: ci (default) or thorough")
    p.add_argument("--thorough", action="store_true", help="the longer run: thorough profile, thorough-only tests")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("-g", "--guarantee", action="append", default=[], help="only these guarantees (repeatable)")
    p.add_argument("--timeout", type=seconds, default=None, help="seconds a call that should succeed may take")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results by guarantee as JSON")


def run(argv: Sequence[str] | None = None) -> int:
    return main(build_parser().parse_args(argv))
