"""wsync-core installs into a TorchRL 0.14 environment without changing its pins."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from packaging.version import Version


def test_test_environment_is_a_torchrl_environment():
    assert Version(importlib.metadata.version("torchrl")) >= Version("0.14")
    assert Version(importlib.metadata.version("tensordict")) < Version("0.15")
    assert importlib.metadata.version("wsync-core")


def test_no_broken_requirements():
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_core_does_not_pin_torch_or_tensordict_above_torchrl():
    reqs = importlib.metadata.requires("wsync-core") or []
    torch_req = next(r for r in reqs if r.startswith("torch"))
    td_req = next(r for r in reqs if r.startswith("tensordict"))
    assert "==" not in torch_req and "<" not in td_req and ">=0.14" in td_req


def test_every_package_is_in_its_distribution():
    """Each project's ``[tool.setuptools] packages`` names every package under it: an editable
    install finds a subpackage left out, a wheel (what users install) does not ship it."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    projects = [root, *(p.parent for p in root.glob("*/pyproject.toml")), *(p.parent for p in root.glob("*/*/pyproject.toml"))]
    checked = 0
    for project in projects:
        listed = tomllib.loads((project / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {}).get("packages")
        if not listed:
            continue
        for top in {name.split(".")[0] for name in listed}:
            found = {".".join(d.relative_to(project).parts) for d in (project / top).rglob("__init__.py")
                     for d in [d.parent]}
            assert found <= set(listed), f"{project.name}: packages {sorted(found - set(listed))} are not listed"
            checked += 1
    assert checked >= 10
