"""The suite has teeth: it fails each broken transport under the guarantee that transport
breaks, and passes the reference transport ``inproc`` on every guarantee."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("wsync_broken", HERE / "wsync_broken.py")
broken = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(broken)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    env.pop("HYPOTHESIS_PROFILE", None)
    return env


def _command(args: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "wsync_conformance", *args, "--json", str(out)]


def _run(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "results.json"
    proc = subprocess.run(_command(args, out), env=_env(), capture_output=True, text=True, timeout=900, cwd=tmp_path)
    return proc, json.loads(out.read_text()) if out.exists() else {}


@pytest.fixture(scope="module")
def broken_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, dict]]:
    """Every broken transport through the suite (only its guarantee's tests), all at once:
    they spend most of their time waiting for timeouts."""
    running = {}
    try:
        for name, guarantee in sorted(broken.BROKEN.items()):
            where = tmp_path_factory.mktemp(name)
            log = open(where / "log.txt", "w+")
            cmd = _command([f"wsync_broken:{name}", "--guarantee", guarantee, "--timeout", "5"], where / "results.json")
            running[name] = (subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=where),
                             log, where)
        results = {}
        for name, (proc, log, where) in running.items():
            code = proc.wait(timeout=900)
            log.seek(0)
            out = where / "results.json"
            results[name] = (code, log.read(), json.loads(out.read_text()) if out.exists() else {})
        return results
    finally:
        for proc, log, _ in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


@pytest.mark.parametrize("name", sorted(broken.BROKEN))
def test_broken_transport_fails_under_its_guarantee(name: str, broken_runs) -> None:
    guarantee = broken.BROKEN[name]
    code, log, results = broken_runs[name]
    log = log[-8000:]
    assert code == 1, log
    assert results[guarantee]["status"] == "failed", log
    assert f"{guarantee:<11} failed" in log, log


def test_inproc_passes_every_guarantee(tmp_path: Path) -> None:
    proc, results = _run(["inproc"], tmp_path)
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert set(results) == {"exact", "isolated", "atomic", "versioned", "live", "targeted", "ordered", "portable",
                            "clean", "safe"}
    assert {g: r["status"] for g, r in results.items()} == dict.fromkeys(results, "passed"), log
    assert "capabilities declared: zero_copy, async_send, subset_send, late_join" in proc.stdout


def test_wsync_conformance_command_prints_the_table(tmp_path: Path) -> None:
    """``wsync conformance inproc`` (the core's CLI) runs the suite and prints each guarantee."""
    proc = subprocess.run([sys.executable, "-m", "wsync_core.cli", "conformance", "inproc", "-k", "portable or ordered"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for row in ("portable    passed", "ordered     passed", "exact       not run"):
        assert row in proc.stdout, proc.stdout[-4000:]


def test_unknown_transport_is_reported(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "wsync_conformance", "no_such_transport"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no transport named 'no_such_transport'" in proc.stderr
