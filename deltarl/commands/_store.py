"""Shared ``--store`` option of the run commands (replay, inspect, gc)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltarl.storage.store import ObjectStore

from deltarl import defaults

DEFAULT_STORE = defaults.STORE


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def open_existing_store(url: str) -> ObjectStore:
    """Open a store for a read-only command: a local path that does not exist is an error, never
    created (``ConfigError``)."""
    from deltarl.errors import ConfigError
    from deltarl.storage import open_store

    if url and ("://" not in url or url.startswith("file://")):
        path = url.removeprefix("file://") if url.startswith("file://") else url
        if not os.path.isdir(os.path.expanduser(path)):
            raise ConfigError(f"no store at {url!r} (not a directory)")
    return open_store(url)


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="run name (the prefix of the run in the store)")
    parser.add_argument(
        "--store",
        default=DEFAULT_STORE,
        metavar="URL",
        help=f"store URL: a path, file://…, memory://…, s3://bucket/prefix (default: {DEFAULT_STORE})",
    )
