"""A smoke run of ``wsync bench``: tiny sizes, two repeats; figures are checked for shape, never for speed."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_bench import harness as bench
from wsync_bench.harness import split_system
from wsync_core import list_transports
from wsync_core.cli import main as cli_main


def _installed(name: str) -> bool:
    return any(i.name == name and not i.error for i in list_transports())


@pytest.fixture
def leaves_no_process():
    """Fails the test if a process it started outlives it (processes that were running before it,
    such as the conformance suite's pooled receivers from another file in this pytest process, are
    not its own)."""
    before = set(multiprocessing.active_children())
    yield
    left = [p for p in multiprocessing.active_children() if p not in before]
    assert not left, f"left running: {left}"


@pytest.mark.parametrize("text, nbytes", [("10KiB", 10240), ("64MiB", 64 << 20), ("1.5GiB", 3 << 29),
                                          ("1MB", 10**6), ("4096", 4096), (" 2 kib ", 2048)])
def test_parse_size(text: str, nbytes: int) -> None:
    assert bench.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "MiB", "ten", "12XB", "2"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bad size"):
        bench.parse_size(text)


def test_format_size() -> None:
    assert [bench.format_size(n) for n in (10240, 512 << 20, 3 << 29, 100)] == ["10KiB", "512MiB", "1.5GiB", "100B"]


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=4, max_value=4 << 20))
def test_model_holds_exactly_the_bytes_asked(nbytes: int) -> None:
    model = bench.build_model(nbytes)
    tensors = list(model.parameters()) + list(model.buffers())
    assert sum(t.numel() * t.element_size() for t in tensors) == nbytes // 4 * 4
    assert all(t.numel() > 0 for t in tensors)


def test_cli_smoke(tmp_path, capsys, leaves_no_process) -> None:
    """Threads (inproc) and processes (mp, when installed), end to end (an unknown transport is
    refused before anything runs: ``test_bad_arguments_exit_2``)."""
    systems = ["inproc"] + [t for t in ("mp",) if _installed(t)]
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    rc = cli_main(["bench", "--transports", ",".join(systems), "--sizes", "8KiB",
                   "--workers", "2", "--repeat", "2", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    table = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["machine"]["cores"] >= 1 and data["machine"]["torch"] and "inproc" in data["machine"]["transports"]
    rows = {(r["system"], r["size"]): r for r in data["rows"]}
    for size in ("8KiB",):
        assert len(rows["memcpy", size]["latencies_s"]) >= 5
        assert len(rows["raw unix", size]["latencies_s"]) >= 5 and rows["raw unix", size]["workers"] == 2
        for system in systems:
            row = rows[system, size]
            assert row["error"] is None, row["error"]
            assert len(row["latencies_s"]) == 2 and row["workers"] == 2
            assert row["p10_s"] <= row["median_s"] <= row["p90_s"] and row["x_memcpy"] > 0
            assert f"| {system}" in table
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overrunning_job_is_ended_and_reported(leaves_no_process) -> None:
    report = bench.run(bench.BenchConfig(["inproc"], [4096], repeat=1, job_timeout=0.5), progress=False)
    (row,) = [r for r in report.rows if r.system == "inproc"]
    assert row.error is not None and "timed out after 0.5 s" in row.error


def test_bad_arguments_exit_2(capsys) -> None:
    assert cli_main(["bench", "--sizes", "lots"]) == 2
    assert cli_main(["bench", "--compare", "ray"]) == 2
    assert "bad size" in capsys.readouterr().err
    assert cli_main(["bench", "--transports", "shm,nosuch"]) == 2  # before anything is timed
    assert "no transport named 'nosuch'" in capsys.readouterr().err
    assert cli_main(["bench", "--transports", "inproc:bogus=1"]) == 2  # options travel as NAME:KEY=VALUE
    assert "transport 'inproc' has no option 'bogus'" in capsys.readouterr().err
    assert cli_main(["bench", "--device", "cuda", "--transports", "inproc"]) == 2
    err = capsys.readouterr().err
    assert ("CUDA is not available" in err) if not torch.cuda.is_available() else ("'cuda' capability" in err)
    assert cli_main(["bench", "--delta", "--device", "cuda"]) == 2
    assert split_system("shm:cuda_ipc=true:max_slots=3") == ("shm", {"cuda_ipc": True, "max_slots": 3})


def test_delta_cli_smoke(tmp_path, capsys, leaves_no_process) -> None:
    """``wsync bench --delta``: full, delta, always and adapter rows, bytes and latencies, one worker process."""
    if not _installed("shm"):
        pytest.skip("the shm transport is not installed")
    out_json = tmp_path / "d.json"
    rc = cli_main(["bench", "--delta", "--transports", "shm", "--sizes", "4MiB", "--workers", "1",
                   "--repeat", "2", "--json", str(out_json)])
    assert rc == 0, capsys.readouterr().out
    rows = {r["case"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"full", "delta", "always", "adapter"}
    assert all(r["error"] is None and len(r["latencies_s"]) == 2 for r in rows.values())
    assert rows["delta"]["bytes_median"] < rows["full"]["bytes_median"]
    assert rows["always"]["bytes_median"] < rows["full"]["bytes_median"]
    assert rows["adapter"]["bytes_median"] < rows["full"]["bytes_median"]
    assert "adapter" in capsys.readouterr().out


@pytest.mark.skipif(not _installed("shm"), reason="the shm plugin is not installed")
def test_same_loop_times_every_send_it_was_asked_for(tmp_path) -> None:
    """``benchmarks/same_loop.py`` (the program that compares commits) runs on the public API."""
    script = Path(__file__).parents[1] / "same_loop.py"
    out = subprocess.run([sys.executable, str(script), "shm", "--workers", "1", "--updates", "5", "--warmup", "1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("shm 1 workers, 5 sends: p50 "), out.stdout


def test_workers_ratio_alternates_the_worker_counts(tmp_path) -> None:
    """``benchmarks/workers_ratio.py`` times both worker counts in each round and prints the ratios."""
    script = Path(__file__).parents[1] / "workers_ratio.py"
    out = subprocess.run([sys.executable, str(script), "inproc", "--size", "64KiB", "--few", "1", "--many", "2",
                          "--rounds", "1", "--repeat", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    first, summary = out.stdout.strip().splitlines()
    assert re.match(r"round 1: 1 workers p50 [0-9.]+ ms p99 [0-9.]+ ms; 2 workers p50 .* ratio [0-9.]+$", first), first
    assert re.match(r"inproc 64KiB: 2 workers over 1, median of 1 rounds [0-9.]+x", summary), summary


@pytest.mark.skipif(not _installed("mp"), reason="the mp plugin is not installed")
def test_waiting_receive_times_the_receives_that_took_a_version(tmp_path) -> None:
    """``benchmarks/waiting_receive.py`` runs on the public API and prints its percentiles."""
    script = Path(__file__).parents[1] / "waiting_receive.py"
    out = subprocess.run([sys.executable, str(script), "mp", "--seconds", "1", "--step-ms", "2", "--rollout-ms", "3"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.match(r"mp [1-9][0-9]* receives: p50 [0-9.]+ ms, p90 [0-9.]+ ms, p99 [0-9.]+ ms", out.stdout), out.stdout


def test_polling_receive_times_the_polls_that_found_nothing_and_those_that_applied(tmp_path) -> None:
    """``benchmarks/polling_receive.py`` runs on the public API and prints its three lines of percentiles."""
    script = Path(__file__).parents[1] / "polling_receive.py"
    out = subprocess.run([sys.executable, str(script), "unix", "--mib", "1", "--seconds", "3", "--pause-ms", "20"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for what in ("finding nothing new", "applying a version"):
        assert re.search(rf"receive\(timeout=0\) {what} \([1-9][0-9]* calls\): p50 [0-9.]+  p99 [0-9.]+  "
                         rf"p99\.9 [0-9.]+  max [0-9.]+ ms", out.stdout), out.stdout
    assert re.search(r"the trainer's send\(\) with sync=False \([1-9][0-9]* calls\): p50 [0-9.]+  p99 [0-9.]+  "
                     r"p99\.9 [0-9.]+  max [0-9.]+ ms", out.stdout), out.stdout


def test_python_floor_times_every_update_and_leaves_nothing_behind(tmp_path) -> None:
    """``benchmarks/python_floor.py`` (the floor of a small update in Python) runs and cleans up."""
    script = Path(__file__).parents[1] / "python_floor.py"
    before = {e for e in os.listdir("/dev/shm") if e.startswith("wsync-floor-")}
    out = subprocess.run([sys.executable, str(script), "--workers", "2", "--updates", "5", "--warmup", "1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("python floor, 2 workers, 5 updates: p50 "), out.stdout
    assert {e for e in os.listdir("/dev/shm") if e.startswith("wsync-floor-")} == before


@pytest.mark.skipif(not _installed("shm"), reason="the shm plugin is not installed")
def test_python_floor_checked_runs_beside_wsync_and_says_each_process_cpu(tmp_path) -> None:
    """``python_floor.py --checked --against shm``: the checked floor, then wsync's loop, each with
    its latency and the CPU per update of the trainer and of each worker."""
    script = Path(__file__).parents[1] / "python_floor.py"
    out = subprocess.run([sys.executable, str(script), "--workers", "2", "--updates", "5", "--warmup", "2",
                          "--checked", "--against", "shm"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    cpu = r"p50 [0-9.]+ ms, p99 [0-9.]+ ms; CPU per update: trainer [0-9]+ us, each worker [0-9]+ us"
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and re.fullmatch(r"python floor, checked, 2 workers, 5 updates: " + cpu, lines[0]) \
        and re.fullmatch(r"wsync shm, 2 workers, 5 updates: " + cpu, lines[1]), out.stdout


@pytest.mark.skipif(not _installed("shm"), reason="the shm plugin is not installed")
def test_send_phases_splits_every_send_it_was_asked_for(tmp_path) -> None:
    """``benchmarks/send_phases.py`` times the whole send, its snapshot and the rest, beside a memcpy."""
    script = Path(__file__).parents[1] / "send_phases.py"
    out = subprocess.run([sys.executable, str(script), "shm", "--workers", "1", "--mib", "2", "--repeat", "3",
                          "--warmup", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("shm, 1 workers, 2 MiB, 3 sends, p50 / p99 ms: send "), out.stdout
    assert "snapshot" in out.stdout and "publish to last ack" in out.stdout and "send x memcpy" in out.stdout


def test_delta_pairs_runs_the_cases_in_the_order_asked(tmp_path) -> None:
    """``benchmarks/delta_pairs.py`` times the cases it is given, in that order, and refuses unknown ones."""
    script = Path(__file__).parents[1] / "delta_pairs.py"
    out = subprocess.run([sys.executable, str(script), "--transport", "shm", "--cases", "delta,full,delta",
                          "--size", "1MiB", "--repeat", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [w for w in out.stdout.split() if not w[0].isdigit()] == ["delta", "full", "delta"], out.stdout
    bad = subprocess.run([sys.executable, str(script), "--cases", "full,nope"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert bad.returncode == 2 and "unknown cases ['nope']" in bad.stderr


def test_workers_check_the_weights_they_hold() -> None:
    """A bench worker checks the last version it applied against the trainer's steps (a wrong
    value turns the row into an error instead of timing a broken update)."""
    model = bench.build_model(4096)
    bench._check_exact(model, 0)
    bench._bump(model)
    bench._bump(model)
    bench._check_exact(model, 2)
    with pytest.raises(RuntimeError, match="version 1: tensor 0 holds"):
        bench._check_exact(model, 1)
