"""The core, every transport (``plugins/``, ``contrib/``) and the conformance suite type-check clean
under the mypy settings in pyproject.toml, and each ships its types (a ``py.typed`` in its
package, PEP 561) so that users' mypy checks their calls, and a transport built on them, against
wsync's signatures."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: each distribution's folder, relative to the root, and its package
PACKAGES = {
    ".": "wsync_core",
    **{p.parent.relative_to(ROOT).as_posix(): p.parent.name.replace("-", "_")
       for p in sorted(ROOT.glob("*/wsync-*/pyproject.toml"))},  # plugins/ and contrib/
    "conformance": "wsync_conformance",
}


def _checked(folder: str) -> str:
    """How ``[tool.mypy] files`` names the package of ``folder``."""
    return PACKAGES[folder] if folder == "." else f"{folder}/{PACKAGES[folder]}"


def test_everything_type_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``mypy`` run, on what ``[tool.mypy] files`` lists: the core, every plugin and contrib
    package, and the conformance suite."""
    api = pytest.importorskip("mypy.api")  # (in requirements-dev.txt)
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert sorted(listed) == sorted(_checked(f) for f in PACKAGES), "[tool.mypy] files lists other packages"
    monkeypatch.chdir(ROOT)
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                      "--cache-dir", str(tmp_path / "mypy-cache")])
    assert status == 0, f"mypy exited with {status}:\n{stdout}{stderr}"


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_each_package_ships_its_types(folder: str) -> None:
    import tomllib

    package = PACKAGES[folder]
    assert (ROOT / folder / package / "py.typed").is_file()
    config = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"][package]
