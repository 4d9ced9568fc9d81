"""The docs are checked against the code: their runnable examples run, their links resolve, the
README's transport table matches what each transport declares, and nothing points to a file
users do not have.

A python block preceded by the line ``<!-- runnable -->`` is runnable; the runnable blocks of one
file, in order, make one script, run in a fresh interpreter (so a spawned worker can import it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from wsync_core import UnknownTransportError, get_transport, list_transports

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = ["README.md", "docs/writing-a-transport.md"]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```$", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def runnable_script(page: str) -> str:
    """The runnable python blocks of ``page``, joined into one script."""
    return "\n\n".join(_BLOCK.findall((ROOT / page).read_text()))


def _slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's rules) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.M | re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", RUNNABLE)
def test_runnable_examples_run(page: str, tmp_path: Path) -> None:
    script = runnable_script(page)
    assert script, f"{page} has no block marked <!-- runnable -->"
    path = tmp_path / f"doc_{Path(page).stem.replace('-', '_')}.py"
    path.write_text(script)
    result = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"the runnable examples of {page} failed:\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve_and_nothing_points_to_spec(page: str) -> None:
    text = (ROOT / page).read_text()
    assert "SPEC.md" not in text, f"{page} points to SPEC.md, which users do not have: link docs/ instead"
    assert "/work/" not in text, f"{page} points to a path on the developers' machine, which users do not have"
    base = (ROOT / page).parent
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # an external address
        file, _, anchor = target.partition("#")
        path = (base / file).resolve() if file else ROOT / page
        assert path.exists(), f"{page} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page} links to {target}: no heading makes #{anchor}"


def _table_rows() -> list[tuple[str, set[str]]]:
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| [^|]+ \| ([\w, ]+) \|$", (ROOT / "README.md").read_text(), re.M)
    return [(name, {c.strip() for c in caps.split(",")}) for name, caps in rows]


def test_readme_lists_every_transport_of_the_project() -> None:
    """Every installed transport whose code lives in this repository has its row."""
    names = {name for name, _ in _table_rows()}
    ours = {i.name for i in list_transports() if not i.error
            and Path(sys.modules[get_transport(i.name).__module__].__file__).resolve().is_relative_to(ROOT)}
    assert ours <= names, f"README's transport table lacks {sorted(ours - names)}"


@pytest.mark.parametrize(("name", "listed"), _table_rows(), ids=[name for name, _ in _table_rows()])
def test_readme_capabilities_are_what_the_transport_declares(name: str, listed: set[str]) -> None:
    try:
        cls = get_transport(name)
    except UnknownTransportError as exc:
        pytest.skip(f"transport {name!r} is not installed here: {exc}")
    assert listed == set(cls.capabilities.declared()), f"README's row for {name!r}"


def test_the_transport_interface_is_importable_from_wsync_core() -> None:
    import wsync_core

    names = {"Transport", "Capabilities", "SenderContext", "ReceiverContext", "SenderEndpoint", "ReceiverEndpoint",
             "Delivery", "Event", "Joined", "Acked", "Left", "Deadline", "Layout", "free_port", "zero_copy_for",
             "hookimpl", "MAX_HEADER_BYTES", "MAX_ACK_BYTES", "TransportError", "WorkerTimeoutError",
             "SenderBase", "ReceiverBase", "Buffer", "StreamSender", "StreamReceiver"}
    assert names <= set(wsync_core.__all__), sorted(names - set(wsync_core.__all__))
    assert all(hasattr(wsync_core, name) for name in wsync_core.__all__)
