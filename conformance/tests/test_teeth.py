"""The suite has teeth: it fails each broken transport (``wsync_broken.py``: the seven bugs of
issue 14 and one per guarantee and interface rule) under the guarantee that transport breaks,
bounds a hang and names the call, kills its runners with the run, and passes the reference
transport ``inproc`` on every guarantee."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from wsync_conformance.watchdog import HUNG_EXIT_STATUS

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("wsync_broken", HERE / "wsync_broken.py")
broken = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(broken)


def _env(*paths: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), *map(str, paths),
                                                                     os.environ.get("PYTHONPATH")])))
    env.pop("HYPOTHESIS_PROFILE", None)
    env["WSYNC_CONFORMANCE_GRACE"] = "3"  # a call blocked in C: the process is ended sooner
    env["WSYNC_CONFORMANCE_WORK"] = "10"  # a hung test is found after its timeouts and 10 s, not 30
    return env


def _command(args: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "wsync_conformance", *args, "--json", str(out)]


#: broken transports each run through ``wsync conformance`` (the command's own behaviour is under
#: test: a hang past every interruption, the run going on) or that wait out long timeouts; the
#: rest run as test classes of two pytest processes beside them, as a third party's tests would
BY_COMMAND = ("HangsWhenSenderDies", "BlockedInC", "CrashesInC", "DeadlineIgnored", "BlockingPublish", "HoardingSender",
              "IgnoresRestart", "NoReconnect", "DroppedAck", "ProbesWithoutDeadline")
#: the reference transport, run through the whole suite by the command first, beside the broken ones
REFERENCE = "inproc"
#: the smallest transport of docs/writing-a-transport.md (its first runnable block), which the page
#: says passes the whole suite: run through it by the command beside the reference
DOCS = "mailbox_doc:MailboxTransport"
_RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```$", re.M | re.S)
#: command runs side by side (the broken ones mostly wait for timeouts)
PARALLEL = 4
#: every broken transport's run happens in the first test's setup: more than the project's 300 s
pytestmark = pytest.mark.timeout(1800)


class Run(NamedTuple):
    code: int
    log: str
    #: guarantee -> {"status", "passed", "failed", "skipped"}, as ``wsync conformance --json`` writes
    results: dict


def _batch_module(names: list[str]) -> str:
    """A test module with one ``TransportSuite`` class per broken transport."""
    lines = ["import wsync_broken", "from wsync_conformance import TransportSuite", ""]
    for name in names:
        lines += [f"class Test{name}Suite(TransportSuite):", f"    transport = wsync_broken.{name}",
                  "    timeout = 5.0", ""]
    return "\n".join(lines)


def _batch_command(where: Path, names: list[str], skip: list[str]) -> list[str]:
    """pytest on ``where``'s batch module: each class's selected tests, but those in ``skip``."""
    keyword = " or ".join(f"(Test{n}Suite and ({broken.SELECT[n]}))" for n in names)
    return [sys.executable, "-m", "pytest", "test_batch.py", "-q", "--tb=short", "-p", "no:cacheprovider", "-k",
            keyword, f"--wsync-results={where / 'results.jsonl'}", *(f"--deselect={n}" for n in skip)]


def _batch_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _batch_results(path: Path, names: list[str]) -> dict[str, dict]:
    """Each class's outcomes (``--wsync-results`` lines) by guarantee; a test that hung past
    every interruption (its process ended by the watchdog) failed under live."""
    from wsync_conformance.report import Collector, Outcome

    collectors = {name: Collector() for name in names}
    for rec in _batch_records(path):
        nodeid = rec.get("nodeid") or rec.get("hung")
        if nodeid is None:
            continue
        name = nodeid.split("::")[1].removeprefix("Test").removesuffix("Suite")
        if "hung" in rec:
            outcome = Outcome(nodeid.split("::")[-1], "failed", f"Hung: {rec['message']}", ["live"])
        else:
            outcome = Outcome(rec["test"], rec["status"], rec["reason"], rec["guarantees"], rec["capabilities"])
        collectors[name].outcomes.setdefault(nodeid, outcome)
    return {name: c.by_guarantee() for name, c in collectors.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """``inproc`` and the docs' smallest transport through the whole suite, and every broken transport
    through the tests that must catch it (``wsync_broken.SELECT``), by name: those two and the
    ``BY_COMMAND`` ones through the command, a few at a time, longest first, beside two pytest
    processes that hold the rest."""
    docs = tmp_path_factory.mktemp("docs")
    page = (HERE.parent.parent / "docs" / "writing-a-transport.md").read_text()
    (docs / "mailbox_doc.py").write_text(_RUNNABLE.findall(page)[0])
    pending = [REFERENCE, DOCS] + [n for n in BY_COMMAND if n in broken.BROKEN]
    rest = sorted(set(broken.BROKEN) - set(pending))
    running: dict[str, tuple[subprocess.Popen, object, Path]] = {}
    results: dict[str, Run] = {}
    batches = []  # two pytest processes (one took longer than every command run beside it)
    for batched in (rest[0::2], rest[1::2]):
        where = tmp_path_factory.mktemp("batch")
        (where / "test_batch.py").write_text(_batch_module(batched))
        batch_log = open(where / "log.txt", "w+")
        batches.append((batched, where, batch_log, subprocess.Popen(
            _batch_command(where, batched, []), env=_env(), stdout=batch_log, stderr=subprocess.STDOUT, cwd=where)))
    try:
        while pending or running:
            while pending and len(running) < PARALLEL:
                name = pending.pop(0)
                there = tmp_path_factory.mktemp(name)
                log = open(there / "log.txt", "w+")
                whole = name in (REFERENCE, DOCS)
                args = [name] if whole else [f"wsync_broken:{name}", "-k", broken.SELECT[name], "--timeout", "5"]
                cmd = _command(args, there / "results.json")
                running[name] = (subprocess.Popen(cmd, env=_env(docs), stdout=log, stderr=subprocess.STDOUT, cwd=there),
                                 log, there)
            for name, (proc, log, there) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.seek(0)
                out = there / "results.json"
                results[name] = Run(proc.returncode, log.read(), json.loads(out.read_text()) if out.exists() else {})
                log.close()
                del running[name]
            time.sleep(0.2)
        for batched, where, batch_log, batch in batches:
            code = batch.wait(timeout=900)
            while code == HUNG_EXIT_STATUS:  # a test hung past every interruption: the rest go on, as the command's
                started = [r["started"] for r in _batch_records(where / "results.jsonl") if "started" in r]
                if not started:
                    break
                batch_log.write(f"\n(a test hung past every interruption; going on without {started[-1]})\n")
                batch_log.flush()
                code = subprocess.call(_batch_command(where, batched, started), env=_env(), stdout=batch_log,
                                       stderr=subprocess.STDOUT, cwd=where, timeout=900)
            batch_log.seek(0)
            text = batch_log.read()
            for name, by_guarantee in _batch_results(where / "results.jsonl", batched).items():
                results[name] = Run(code, text, by_guarantee)
        return results
    finally:
        for proc in [*(b[3] for b in batches), *(p for p, _, _ in running.values())]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for _, log, _ in running.values():
            log.close()
        for b in batches:
            b[2].close()


@pytest.mark.parametrize("name", sorted(broken.BROKEN))
def test_broken_transport_fails_under_its_guarantee(name: str, runs) -> None:
    guarantee = broken.BROKEN[name]
    code, log, results = runs[name]
    log = log[-8000:]
    assert code == 1, log
    assert results[guarantee]["status"] == "failed", log
    if name in BY_COMMAND:  # the command's table names it too
        assert re.search(rf"^{guarantee} +failed ", log, re.MULTILINE), log


def test_a_hung_publish_fails_its_test_naming_the_call_and_the_run_goes_on(runs) -> None:
    """A publish that blocks forever: its test fails under live within its budget, the report
    names SenderEndpoint.publish(), and the next test still runs (and passes)."""
    code, log, results = runs["BlockingPublish"]
    (test, reason), = results["live"]["failed"]
    assert test == "test_versioned_counts_and_content" and "SenderEndpoint.publish()" in reason, log[-4000:]
    assert "ran past its budget" in reason, reason
    assert results["ordered"]["passed"] == ["test_ordered_sender"], log[-4000:]


def test_a_call_blocked_in_c_ends_its_process_and_the_run_goes_on(runs) -> None:
    """A publish that no signal reaches: the watchdog ends the pytest process, wsync conformance
    records the test as failed under live naming the call, and runs the rest in a new process."""
    code, log, results = runs["BlockedInC"]
    (test, reason), = results["live"]["failed"]
    assert test == "test_versioned_counts_and_content" and "SenderEndpoint.publish()" in reason, log[-4000:]
    assert "going on with the rest" in log and results["ordered"]["passed"] == ["test_ordered_sender"], log[-4000:]


def test_a_crash_in_native_code_fails_its_test_naming_the_signal_and_the_run_goes_on(runs) -> None:
    """A publish that crashes the process (SIGSEGV): wsync conformance records the test it died in
    as failed under that test's guarantee, naming the signal, and runs the rest in a new process."""
    code, log, results = runs["CrashesInC"]
    (test, reason), = results["versioned"]["failed"]
    assert test == "test_versioned_counts_and_content" and "SIGSEGV" in reason, log[-4000:]
    assert "crashed the test process (SIGSEGV); going on with the rest" in log, log[-4000:]
    assert results["ordered"]["passed"] == ["test_ordered_sender"], log[-4000:]


def test_a_receiver_ignoring_its_deadline_is_named(runs) -> None:
    code, log, results = runs["DeadlineIgnored"]
    (test, reason), = results["live"]["failed"]
    assert "recv()" in reason and "ran past its budget" in reason, log[-4000:]


def test_a_publish_ignoring_used_is_named(runs) -> None:
    """A transport that declares prefix_publish and delivers whole buffers fails under exact, in the
    endpoint check, naming the bytes it delivered against ``used``."""
    code, log, results = runs["PrefixIgnored"]
    (test, reason), = results["exact"]["failed"]
    assert test == "test_endpoint_publish_delivers_used_bytes" and "used=" in reason, log[-4000:]


def test_runners_die_with_the_run(tmp_path: Path) -> None:
    """Every kind of receiver runner the harness starts dies when its parent is SIGKILLed."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import time\n"
        "from wsync_conformance import harness\n"
        "if __name__ == '__main__':\n"
        "    ws = harness.acquire(1, True) + [harness.Worker(kind=k) for k in ('fork', 'launched')]\n"
        "    print(' '.join(str(w.pid) for w in ws), flush=True)\n"
        "    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait(30)
        parent.stdout.close()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "receiver runners outlived their killed parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_inproc_passes_every_guarantee(runs) -> None:
    code, log, results = runs[REFERENCE]
    assert code == 0, log[-9000:]
    assert set(results) == {"exact", "isolated", "atomic", "versioned", "live", "targeted", "ordered", "portable",
                            "clean", "safe"}
    assert {g: r["status"] for g, r in results.items()} == dict.fromkeys(results, "passed"), log
    assert "capabilities declared: zero_copy, async_send, subset_send, late_join" in log, log[-9000:]
    for name in ("zero_copy", "async_send", "subset_send", "late_join"):
        assert re.search(rf"^{name} +passed ", log, re.MULTILINE), log[-9000:]


def test_the_docs_smallest_transport_passes_every_guarantee(runs) -> None:
    """docs/writing-a-transport.md says its smallest transport (its first runnable block) passes the
    whole suite (it had no ``wake()`` once, and failed two live checks)."""
    code, log, results = runs[DOCS]
    assert code == 0, f"the smallest transport fails the suite:\n{log[-9000:]}"
    assert {g: r["status"] for g, r in results.items()} == dict.fromkeys(
        ("exact", "isolated", "atomic", "versioned", "live", "targeted", "ordered", "portable", "clean", "safe"),
        "passed"), log[-9000:]


def test_wsync_conformance_command_prints_the_table(tmp_path: Path) -> None:
    """``wsync conformance inproc`` (the core's CLI) runs the suite and prints each guarantee."""
    proc = subprocess.run([sys.executable, "-m", "wsync_core.cli", "conformance", "inproc", "-k", "portable or ordered"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for name, status in (("portable", "passed"), ("ordered", "passed"), ("exact", "not run")):
        assert re.search(rf"^{name} +{status} ", proc.stdout, re.MULTILINE), proc.stdout[-4000:]


def test_unknown_transport_is_reported(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "wsync_conformance", "no_such_transport"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no transport named 'no_such_transport'" in proc.stderr


def test_the_command_finds_a_transports_own_hooks(tmp_path: Path) -> None:
    """``wsync conformance unix`` (no suite class of the user's) tests ``auth`` with the hook the
    transport class supplies as a static method (the quick one of the two auth checks)."""
    proc = subprocess.run([sys.executable, "-m", "wsync_conformance", "unix", "-k",
                           "test_capability_auth_secrets_never_shown"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"^auth +passed +test_capability_auth_secrets_never_shown", proc.stdout, re.MULTILINE), \
        proc.stdout[-4000:]
