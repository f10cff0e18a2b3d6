"""`enginewright bench offline|served`: the benchmark harness of `serving.bench` on the CLI."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    from serving.bench.__main__ import run

    return run(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand."""
    from serving.bench.__main__ import add_arguments

    p = subparsers.add_parser("bench", help="offline / served benchmarks of the torch engine (GPU)")
    add_arguments(p)
    p.set_defaults(func=_run)
