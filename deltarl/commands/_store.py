"""Shared ``--store`` option of the run commands (replay, inspect, gc)."""

from __future__ import annotations

import argparse

from deltarl import defaults

DEFAULT_STORE = defaults.STORE


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="run name (the prefix of the run in the store)")
    parser.add_argument(
        "--store",
        default=DEFAULT_STORE,
        metavar="URL",
        help=f"store URL: a path, file://…, memory://…, s3://bucket/prefix (default: {DEFAULT_STORE})",
    )
