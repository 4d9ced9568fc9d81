"""The core type-checks clean under the mypy settings in pyproject.toml, and ships its types
(``wsync_core/py.typed``) so that users' mypy checks their calls against wsync's signatures."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_core_type_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = pytest.importorskip("mypy.api")  # (in requirements-dev.txt)
    monkeypatch.chdir(ROOT)
    stdout, stderr, status = api.run(["wsync_core", "--config-file", str(ROOT / "pyproject.toml"),
                                      "--cache-dir", str(tmp_path / "mypy-cache")])
    assert status == 0, f"mypy wsync_core exited with {status}:\n{stdout}{stderr}"


def test_core_ships_its_types() -> None:
    import tomllib

    assert (ROOT / "wsync_core" / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["wsync_core"]
