"""Run TorchRL's own collector tests with wsync swapped in for TorchRL's weight sync schemes.

TorchRL's wheels ship no tests, and this repository does not copy them: the runner fetches
``test/test_collectors.py`` and ``test/conftest.py`` of the installed TorchRL version (from
``--source``/``$WSYNC_TORCHRL_SRC``, a pytorch/rl checkout or git directory; else the sdist from
the package index; else GitHub) into a cache, then runs, with ``plugin.py`` loaded:

- by default, every test whose code names a weight sync scheme or ``update_policy_weights_``,
  minus the known exceptions (``EXCEPTIONS``, each explained in the adapter's README);
- with ``--all``, the whole file (every multi-process collector uses a scheme: TorchRL's default
  is replaced too);
- with ``--baseline``, the same tests with TorchRL's own schemes, to tell TorchRL's own failures
  (tests of a newer source than the installed wheel, timing under load) from wsync's.

    python contrib/wsync-torchrl/tests/torchrl_suite/run.py [--all] [--list] [pytest args...]

Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("test/test_collectors.py", "test/conftest.py")
#: what a test's code must name to count as exercising weight sync
MARKERS = ("WeightSyncScheme", "weight_sync_scheme", "update_policy_weights_")
#: tests that cannot pass with wsync by design: node id -> why (the README lists the same)
EXCEPTIONS: dict[str, str] = {
    "TestCollectorGeneric::test_update_weights":
        "asserts that, on CPU, a worker's policy changes when the trainer edits its weights in place "
        "without update_policy_weights_() (TorchRL's workers alias the trainer's memory); wsync "
        "workers hold private copies (isolation), so they keep the version sent",
}


def torchrl_version() -> str:
    from importlib.metadata import version

    return version("torchrl")


def fetch(dest: Path, source: str | None) -> Path:
    """Put TorchRL's test files for the installed version under ``dest``; returns it."""
    ver = torchrl_version()
    if all((dest / Path(f).name).is_file() for f in FILES):
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    errors = []
    for name, how in (("source", lambda: _from_source(dest, source)), ("sdist", lambda: _from_sdist(dest, ver)),
                      ("github", lambda: _from_github(dest, ver))):
        try:
            if how():
                return dest
        except (OSError, subprocess.CalledProcessError, tarfile.TarError) as exc:
            errors.append(f"{name}: {exc}")
    raise SystemExit(f"could not fetch TorchRL {ver}'s tests ({'; '.join(errors) or 'no source'}); "
                     f"pass --source PATH (a pytorch/rl checkout or git directory)")


def _from_source(dest: Path, source: str | None) -> bool:
    source = source or os.environ.get("WSYNC_TORCHRL_SRC")
    if not source:
        return False
    root = Path(source)
    if (root / FILES[0]).is_file():
        for f in FILES:
            shutil.copy(root / f, dest / Path(f).name)
        return True
    rev = os.environ.get("WSYNC_TORCHRL_REV", f"v{torchrl_version()}")
    for candidate in (rev, "HEAD"):
        try:
            for f in FILES:
                out = subprocess.run(["git", f"--git-dir={root}", "show", f"{candidate}:{f}"], check=True,
                                     capture_output=True).stdout
                (dest / Path(f).name).write_bytes(out)
            print(f"TorchRL tests from {root} at {candidate}", file=sys.stderr)
            return True
        except subprocess.CalledProcessError:
            continue
    return False


def _from_sdist(dest: Path, ver: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"torchrl=={ver}", "-d", tmp], check=True, capture_output=True)
        for archive in Path(tmp).glob("torchrl-*.tar.gz"):
            with tarfile.open(archive) as tar:
                members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
                if not all(f in members for f in FILES):
                    return False
                for f in FILES:
                    (dest / Path(f).name).write_bytes(tar.extractfile(members[f]).read())
                return True
    return False


def _from_github(dest: Path, ver: str) -> bool:
    for f in FILES:
        url = f"https://raw.githubusercontent.com/pytorch/rl/v{ver}/{f}"
        with urllib.request.urlopen(url, timeout=60) as r:
            (dest / Path(f).name).write_bytes(r.read())
    return True


def weight_sync_tests(path: Path) -> list[str]:
    """Node ids (``Class::test`` or ``test``) of the tests whose code names a marker."""
    tree = ast.parse(path.read_text())
    text = path.read_text().splitlines()
    out = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                visit(node.body, f"{prefix}{node.name}::")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                src = "\n".join(text[(node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1:
                                     node.end_lineno])
                if any(m in src for m in MARKERS):
                    out.append(prefix + node.name)

    visit(tree.body, "")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="run the whole of test_collectors.py")
    parser.add_argument("--list", action="store_true", help="print the selected tests and exit")
    parser.add_argument("--baseline", action="store_true",
                        help="run the same tests with TorchRL's own schemes (no swap): which failures are TorchRL's")
    parser.add_argument("--source", help="a pytorch/rl checkout or git directory to take the tests from")
    parser.add_argument("--cache", default=os.environ.get("WSYNC_TORCHRL_CACHE",
                                                          str(Path(tempfile.gettempdir()) / "wsync-torchrl-suite")))
    args, pytest_args = parser.parse_known_args(argv)
    dest = fetch(Path(args.cache) / f"torchrl-{torchrl_version()}", args.source)
    shutil.copy(HERE / "plugin.py", dest / "wsync_swap_plugin.py")
    target = dest / "test_collectors.py"
    if args.all:
        selected = [str(target)]
    else:
        selected = [f"{target}::{t}" for t in weight_sync_tests(target) if t not in EXCEPTIONS]
    deselect = [a for t in EXCEPTIONS for a in ("--deselect", f"{target}::{t}")]
    if args.list:
        print("\n".join(selected))
        return 0
    swap = [] if args.baseline else ["-p", "wsync_swap_plugin"]
    cmd = [sys.executable, "-m", "pytest", *swap, "-p", "no:cacheprovider",
           "--rootdir", str(dest), *deselect, *pytest_args, *selected]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(dest), os.environ.get("PYTHONPATH", "")]))
    return subprocess.call(cmd, cwd=dest, env=env)


if __name__ == "__main__":
    sys.exit(main())
