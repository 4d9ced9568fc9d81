"""The ``wsync bench`` command, registered with ``wsync_register_commands``."""

from __future__ import annotations

import argparse
import sys

from wsync_core import hookimpl

from .harness import main

__all__ = ["wsync_register_commands"]


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", default="shm,mp",
                   help="comma-separated names, each with options as NAME:KEY=VALUE[:KEY=VALUE]")
    p.add_argument("--sizes", default="10KiB,64MiB,512MiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--compare", default="", help="comma-separated: torchrl")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the trainer's and the workers' models live")
    p.add_argument("--json", dest="json_file", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--delta", action="store_true",
                   help="time full, delta, always (delta=\"always\") and adapter (keys=) sends of a bfloat16 model side by side")
    p.add_argument("--changed", type=float, default=0.01, help="with --delta: share of elements changed per step")


def _main(args: argparse.Namespace) -> int:
    if getattr(args, "delta", False):
        from .delta import main as delta_main

        if args.device != "cpu":
            print("wsync bench: --delta times CPU models only", file=sys.stderr)
            return 2
        if not 0.0 <= args.changed <= 1.0:
            print(f"wsync bench: --changed is the share of elements changed per step, in [0, 1]; got {args.changed:g}",
                  file=sys.stderr)
            return 2
        return delta_main(args)
    return main(args)


@hookimpl
def wsync_register_commands(register) -> None:
    register("bench", "time transports side by side on this machine", _configure, _main)
