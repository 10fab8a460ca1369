"""The ``multistream`` command line: ``multistream text|image|speak|serve|demo|fit-preview ...``.

Each subcommand lives in its own module under ``multistream/_cli/`` and exposes
``add_parser(subparsers)`` (which sets ``func`` on its parser) so this file only wires them up.

Example:
    $ multistream text "Write a haiku about rivers"
    $ multistream --help
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._cli._console import quiet_library_notices

__all__ = ["main"]

# Order is the order `--help` lists them in.
_SUBCOMMAND_MODULES = ("text", "image", "speak", "serve", "demo", "fit_preview")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multistream",
        description="Stream text tokens and image previews from generative models.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(f"multistream._cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"multistream._cli.{name}":
                raise
            continue  # that subcommand is not part of this install
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    quiet_library_notices()  # before any subcommand imports transformers
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
