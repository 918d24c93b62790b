"""Shared command-line pieces: the ``--store`` option and its help, and the torch check."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltarl.storage.store import ObjectStore

from deltarl import defaults

DEFAULT_STORE = defaults.STORE


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def open_existing_store(url: str) -> ObjectStore:
    """Open a store for a command that only reads it: a local path that does not exist is an error
    (``StoreNotFound``, "no store at …"), never created."""
    from deltarl.storage.open import open_store

    return open_store(url, must_exist=True)


#: Every store URL ``open_store`` accepts, and where an S3 endpoint comes from (one text for every command).
STORE_SCHEMES = (
    "a path or file:///abs/path (local folder), memory://name (in-process, empty), "
    "s3://bucket/prefix (endpoint from $DELTARL_S3_ENDPOINT, $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL; "
    "credentials the usual AWS way), http(s)://host:port (a deltarl relay or a cache in front of one), "
    "or any fsspec URL (gcs://, az://, hf://, ...; readable, publishing needs conditional writes)"
)

#: The one line a command that needs torch prints when it is not installed.
TORCH_HINT = "needs torch and transformers, which this install lacks: pip install 'deltarl[torch]'"


def store_help(what: str = "store URL", default: str | None = None) -> str:
    """Help text of a ``--store`` option: ``what``, every accepted scheme, and the default if any."""
    tail = f" (default: {default})" if default else ""
    return f"{what}: {STORE_SCHEMES}{tail}"


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="run name (the prefix of the run in the store)")
    parser.add_argument("--store", default=DEFAULT_STORE, metavar="URL", help=store_help(default=DEFAULT_STORE))


def have_torch(command: str) -> bool:
    """Whether torch and transformers import; if not, say so in one line on stderr (no traceback)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print(f"deltarl {command}: {TORCH_HINT}", file=sys.stderr)
        return False
    return True


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set: a long-running command's clean stop."""
    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return stop
