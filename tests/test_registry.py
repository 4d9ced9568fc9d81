"""Plugin discovery with real installed distributions (pip-installed into a temporary target)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wsync_core import UnknownTransportError, WeightSyncScheme, list_transports
from wsync_core.registry import install_hint

GOOD = '''
from wsync_core import Capabilities, hookimpl
from wsync_core.inproc import InprocTransport


class EchoTransport(InprocTransport):
    """inproc under another name: a third-party transport in a few lines."""

    name = "echo"
    capabilities = Capabilities(processes=False, zero_copy=True, auth=True)


@hookimpl
def wsync_register_transports(register):
    register(EchoTransport)
'''
OLD_INTERFACE = '''
from wsync_core import hookimpl
from wsync_core.inproc import InprocTransport


class OldTransport(InprocTransport):
    name = "old"
    interface = 1  # written before acquire() returned a Buffer


@hookimpl
def wsync_register_transports(register):
    register(OldTransport)


@hookimpl
def wsync_register_commands(register):
    def configure(parser):
        parser.add_argument("--who", default="world")

    register("hello", "say hello", configure, lambda args: print(f"hello {args.who}") or 3)
'''
BROKEN_IMPORT = "import no_such_module_anywhere\n"
BROKEN_COMMANDS = '''
from wsync_core import hookimpl


@hookimpl
def wsync_register_commands(register):
    raise RuntimeError("the greet command needs a config file")
'''
BROKEN_HOOK = '''
from wsync_core import hookimpl


@hookimpl
def wsync_register_transports(register):
    register(object)
'''


def _dist(root: Path, name: str, module: str, source: str) -> Path:
    pkg = root / name
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text(source)
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f'''
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "1.2.3"
        [project.entry-points.wsync]
        {module.removeprefix("wsync_")} = "{module}"
        [tool.setuptools]
        packages = ["{module}"]
    '''))
    return pkg


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory holding five real, pip-installed plugin distributions."""
    root = tmp_path_factory.mktemp("plugins")
    target = root / "site"
    dists = [_dist(root, "wsync-echo", "wsync_echo", GOOD),
             _dist(root, "wsync-brokenimport", "wsync_brokenimport", BROKEN_IMPORT),
             _dist(root, "wsync-brokenhook", "wsync_brokenhook", BROKEN_HOOK),
             _dist(root, "wsync-old", "wsync_old", OLD_INTERFACE),
             _dist(root, "wsync-greet", "wsync_greet", BROKEN_COMMANDS)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), *map(str, dists)], check=True, timeout=300)
    return target


def wsync(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(site), **env}
    cli = [sys.executable, "-c", "import sys; from wsync_core.cli import main; sys.exit(main())"]
    return subprocess.run([*cli, *args], capture_output=True, text=True, env=environ, timeout=120)


def test_installed_plugin_is_found_and_broken_ones_are_listed(site):
    out = wsync(site, "transports", "--json")
    assert out.returncode == 0, out.stderr
    infos = {i["name"]: i for i in json.loads(out.stdout)}
    assert infos["echo"]["distribution"] == "wsync-echo" and infos["echo"]["version"] == "1.2.3"
    assert "auth" in infos["echo"]["capabilities"] and infos["echo"]["error"] is None
    assert "No module named 'no_such_module_anywhere'" in infos["brokenimport"]["error"]
    assert infos["brokenimport"]["distribution"] == "wsync-brokenimport"
    assert "Transport subclass" in infos["brokenhook"]["error"]
    assert infos["inproc"]["distribution"] == "wsync-core"
    table = wsync(site, "transports")
    assert "FAILED TO LOAD" in table.stdout and "echo" in table.stdout


def test_plugin_for_another_interface_version_is_refused_naming_both(site):
    out = wsync(site, "transports", "--json")
    infos = {i["name"]: i for i in json.loads(out.stdout)}
    assert "old" not in [i["name"] for i in infos.values() if not i["error"]]
    error = infos["old"]["error"]
    assert "implements transport interface 1" in error and "implements interface 2" in error, error


def test_plugins_add_commands_and_unknown_ones_say_how_to_get_them(site):
    out = wsync(site, "hello", "--who", "wsync")
    assert out.returncode == 3 and out.stdout.strip() == "hello wsync", out.stderr
    out = wsync(site, "nosuchcommand")
    assert out.returncode == 2 and "hello" in out.stderr, out.stderr
    assert "no plugin of wsync's repository provides a command 'nosuchcommand'" in out.stderr
    assert "pip install" not in out.stderr  # (no name on a package index that nobody owns)
    # a plugin that failed is named with its error: it may be the one that provides the command
    out = wsync(site, "greet")
    assert out.returncode == 2 and "Installed plugins that failed to load" in out.stderr, out.stderr
    assert "'greet': RuntimeError: the greet command needs a config file" in out.stderr
    assert "'brokenimport': ModuleNotFoundError: No module named 'no_such_module_anywhere'" in out.stderr
    assert install_hint("bench", "command").endswith("pip install -e benchmarks (from a clone of it)")


def test_installed_plugin_works_end_to_end(site):
    code = textwrap.dedent('''
        import threading, pickle, torch
        from wsync_core import WeightSyncScheme
        s = WeightSyncScheme("echo", timeout=20)
        w = {"x": torch.arange(10.0)}
        s.init_on_sender(weights=w, num_workers=1)
        r = pickle.loads(pickle.dumps(s)); m = {"x": torch.zeros(10)}
        r.init_on_receiver(model=m, worker_idx=0)
        t = threading.Thread(target=r.connect); t.start(); s.connect(); t.join()
        assert torch.equal(m["x"], w["x"]); print("ok")
        r.shutdown(); s.shutdown()
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert out.stdout.strip() == "ok", out.stderr


def test_disable_plugins(site):
    out = wsync(site, "transports", "--json", WSYNC_DISABLE_PLUGINS="echo,brokenimport")
    names = {i["name"] for i in json.loads(out.stdout)}
    assert "echo" not in names and "brokenimport" not in names and "inproc" in names


def test_unknown_transport_lists_installed_and_how_to_install():
    with pytest.raises(UnknownTransportError) as info:
        WeightSyncScheme("nosuch")
    msg = str(info.value)
    assert "'nosuch'" in msg and "inproc" in msg and "entry point group" in msg and "pip install" not in msg
    for name, folder in (("shm", "plugins/wsync-shm"), ("tcp", "contrib/wsync-tcp")):  # where ours lie
        assert f"pip install -e {folder} (from a clone of it)" in install_hint(name, "transport")
    assert isinstance(info.value, LookupError)
    names = {i.name for i in list_transports()}
    assert "inproc" in names


def test_transport_object_and_options():
    from wsync_core.inproc import InprocTransport

    t = InprocTransport(channel="x")
    assert WeightSyncScheme(t).transport is t
    with pytest.raises(TypeError, match="options"):
        WeightSyncScheme(t, channel="y")
    with pytest.raises(ValueError, match=r"^transport 'inproc' has no option 'no_such_option'; its options are "
                                         r"channel, checksum$"):
        WeightSyncScheme("inproc", no_such_option=1)
