"""The ``wsync`` command: ``transports``, and the commands installed plugins register
(``wsync_register_commands``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .registry import failed_plugins, install_hint, list_commands, list_transports

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


def build_parser() -> argparse.ArgumentParser:
    """``wsync transports`` and every command an installed plugin registered."""
    parser = argparse.ArgumentParser(prog="wsync", description="Keep model weights in sync between a trainer and workers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("transports", help="list installed transports, their capabilities and load errors")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_transports)
    for name, command in sorted(list_commands().items()):
        p = sub.add_parser(name, help=command.help)
        command.configure(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``wsync ARGV``; an unknown command says which ones are installed and how to add more."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    known = {"transports", *list_commands()}
    if argv and not argv[0].startswith("-") and argv[0] not in known:
        failed = "".join(f"\n  {name!r}: {error}" for name, error in sorted(failed_plugins().items()))
        print(f"wsync: no command {argv[0]!r}; installed: {', '.join(sorted(known))}. Plugins add commands: "
              f"{install_hint(argv[0], 'command')}."
              + (f"\nInstalled plugins that failed to load (one may be what provides it):{failed}" if failed else ""),
              file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
