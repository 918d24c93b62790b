"""The ``deltarl`` command: argument parsing and wiring only.

Each subcommand lives in ``deltarl.commands.<name>`` and exposes ``HELP: str``,
``add_arguments(parser)`` and ``run(args) -> int``. Those modules import nothing heavy at module
level (no torch, no transformers), so ``deltarl --help`` answers instantly.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from deltarl import __version__
from deltarl.commands._store import TORCH_HINT

#: A command that fails importing one of these says how to install it instead of a traceback.
TORCH_MODULES = frozenset({"torch", "transformers"})

COMMANDS: tuple[str, ...] = (
    "demo",
    "trainer",
    "coordinator",
    "relay",
    "actor",
    "follow",
    "serve-sync",
    "checkpoint",
    "replay",
    "audit",
    "inspect",
    "gc",
    "bench",
    "nginx-config",
)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line refusals (``deltarl inspect: error: …``), no usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every available subcommand."""
    parser = _Parser(prog="deltarl", description="deltarl: lossless sparse weight deltas for RL post-training across regions.")
    parser.add_argument("--version", action="version", version=f"deltarl {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"deltarl.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as err:
            if err.name == f"deltarl.commands.{name.replace('-', '_')}":
                continue  # command not built in this checkout
            raise
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        # -v after the subcommand too; its own dest, since a subparser's values replace the parent's
        p.add_argument("-v", "--verbose", dest="sub_verbose", action="count", default=0,
                       help="more logging (-vv for debug)")
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``deltarl`` console script.

    A reader of stdout that goes away (``deltarl inspect RUN | head``) ends the command quietly
    with 141, the status of a process killed by SIGPIPE, for every command.
    """
    try:
        try:
            code = _run(argv)
        except SystemExit:  # argparse: --help, --version, a refusal
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # here, not at interpreter exit, so a closed pipe is caught below
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        _detach_stdout()
        return 128 + signal.SIGPIPE


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose + args.sub_verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from deltarl.errors import DeltaRLError

    try:
        return int(args._module.run(args) or 0)
    except ModuleNotFoundError as err:
        if err.name not in TORCH_MODULES:
            raise
        print(f"deltarl {args.command}: {TORCH_HINT}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except (DeltaRLError, OSError) as err:  # bad input or a failing store: one line, no traceback
        if args.verbose:
            raise
        print(f"deltarl {args.command}: {err} (-v for details)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (so EPIPE came from it)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced (a test's capture) or closed
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _detach_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what is left has somewhere to go."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
