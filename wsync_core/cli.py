"""The ``wsync`` command: ``transports``, ``conformance`` and ``bench``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from .registry import list_transports

__all__ = ["main"]


def _transports(args: argparse.Namespace) -> int:
    infos = list_transports()
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
        return 0
    rows = [("name", "distribution", "version", "capabilities / error")]
    for i in infos:
        detail = f"FAILED TO LOAD: {i.error}" if i.error else ", ".join(i.capabilities)
        rows.append((i.name, i.distribution or "-", i.version or "-", detail))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3])
    return 0


def _delegate(module: str, dist: str):
    def run(args: argparse.Namespace) -> int:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            print(f"wsync: this command needs {dist} ({exc}); install it with: pip install {dist}", file=sys.stderr)
            return 2
        return mod.main(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsync", description="Keep model weights in sync between a trainer and workers.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("transports", help="list installed transports, their capabilities and load errors")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_transports)

    p = sub.add_parser("conformance", help="run the conformance suite against a transport")
    p.add_argument("name", help="transport name (see `wsync transports`)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="transport option (repeatable)")
    p.add_argument("--profile", default=None, help="hypothesis profile: ci (default) or thorough")
    p.add_argument("--thorough", action="store_true", help="the longer run (see docs/conformance.md)")
    p.add_argument("-k", dest="keyword", default=None, help="only run tests matching this pytest -k expression")
    p.set_defaults(func=_delegate("wsync_conformance.cli", "wsync-conformance"))

    p = sub.add_parser("bench", help="time transports side by side on this machine")
    p.add_argument("--transports", default="shm,mp")
    p.add_argument("--sizes", default="10KiB,64MiB,512MiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--compare", default="", help="comma-separated: torchrl")
    p.add_argument("--json", dest="json_file", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.set_defaults(func=_delegate("wsync_core.bench", "wsync-core[bench]"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
