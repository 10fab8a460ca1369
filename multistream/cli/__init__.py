"""The ``multistream`` command line: ``multistream text|image|video|speak|serve|demo|fit-preview ...``.

Each subcommand lives in its own module of this package and exposes ``add_parser(subparsers)``
(which sets ``func`` on its parser), so this file only wires them up. The subcommand modules are
imported statically (import-linter sees them); each keeps torch, transformers and diffusers out
of its module level, importing them inside the function that runs a model, so ``--help`` stays quick.

Example:
    $ multistream text "Write a haiku about rivers"
    $ multistream --help
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence

from ..errors import InvalidArgumentError
from . import demo, fit_preview, image, serve, speak, text, video
from ._checks import OneLineParser, check_arguments, check_device_argument, check_model_argument, refuse
from ._console import quiet_library_notices
from ._files import WriteError

__all__ = ["build_parser", "entry", "main"]

# Order is the order `--help` lists them in.
_SUBCOMMANDS = (text, image, video, speak, serve, demo, fit_preview)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand.

    Example:
        >>> build_parser().parse_args(["text", "hi"]).prompt
        'hi'
    """
    parser = OneLineParser(
        prog="multistream",
        description="Stream text tokens, image and video previews, and speech from generative models.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def entry() -> int:
    """The ``multistream`` command itself (the console script, ``python -m multistream``): `main`
    on the process's arguments, then `gc.freeze` before the process exits.

    Without the freeze, the interpreter's shutdown walked every object of the loaded libraries
    and model in its last collections: about 1.1 s between the summary line and the shell's
    prompt after ``multistream text`` (median of 4 runs on 2 cores: 6.5 s to exit, 5.4 s with it).
    The command's files are written and closed by then, and ``atexit`` handlers (logging's
    flush) still run. Only the process's own entry does this: `main` called from Python leaves
    the caller's collector alone.
    """
    status = main(own_process=True)
    gc.freeze()
    return status


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); returns the exit status.
    ``own_process``: the command is the whole process (`entry`), so a command's model load may
    end its collector pause with a freeze (`cli._console.model_loading`).

    Example:
        >>> main(["text", "--help"])  # doctest: +SKIP
    """
    quiet_library_notices()  # before any subcommand imports transformers
    parser = build_parser()
    args = parser.parse_args(argv)
    args.own_process = own_process
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        # Every argument and output path, before any command loads a model (seconds) or makes anything.
        check_arguments(args)
        check_model_argument(args)
        check_device_argument(args)
    except InvalidArgumentError as exc:
        return refuse(args.command, exc)
    try:
        return int(args.func(args) or 0)
    except WriteError as exc:  # an output file, mid-run (a full disk): one line, the file left as it was
        print(f"multistream {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Before a stream started (a model loading) or after it ended: nothing was being made.
        # Commands that were generating say what they kept themselves (cli._interrupt, speak).
        print(f"\nmultistream {args.command}: interrupted", file=sys.stderr)
        return 130
