"""``deltarl replay``: rebuild one version of a run from the store into a safetensors file."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from deltarl.commands._store import add_store_argument, have_torch, non_negative_int, open_existing_store

if TYPE_CHECKING:
    from deltarl.pipeline.reader import RunReader

HELP = "rebuild a version of a run bit for bit (keyframe + deltas, every hash checked) into a safetensors file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_argument(parser)
    parser.add_argument("--version", type=non_negative_int, default=None, metavar="N", help="version to rebuild (default: HEAD)")
    parser.add_argument("--out", required=True, metavar="FILE", help="output .safetensors file")
    parser.add_argument(
        "--verify", action="store_true", help="also check the newest state digest the chain records (every object's piece hashes and the parent chain are always checked)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if not have_torch("replay"):
        return 2
    from deltarl.errors import ConfigError, DeltaRLError
    from deltarl.pipeline.reader import RunReader
    from deltarl.pipeline.replay import replay
    from deltarl.pipeline.state_file import write_state_file

    out = os.path.abspath(os.path.expanduser(args.out))
    if os.path.isdir(out):
        raise ConfigError(f"--out {args.out!r} is a directory; give a file name")
    if not os.path.isdir(os.path.dirname(out)):
        raise ConfigError(f"--out {args.out!r}: folder {os.path.dirname(out)!r} does not exist")
    store = open_existing_store(args.store)
    try:
        reader = RunReader(store, args.run)
        version = args.version if args.version is not None else reader.head().version
        _, vid = reader.manifest(version)
        state = replay(store, args.run, version, verify=args.verify, progress=not args.no_progress and sys.stderr.isatty())
        checked = _checked_digest(reader, version) if args.verify else None
    except DeltaRLError as err:
        print(f"deltarl replay: {err}", file=sys.stderr)
        return 1
    finally:
        store.close()
    write_state_file(out, state, {"run": args.run, "version": str(version), "version_id": vid})  # as follow writes it
    print(f"{args.run} version {version} ({vid[:16]}…) -> {args.out}")
    if checked is not None:
        at, digest = checked
        whose = "its own" if at == version else f"version {at}'s (version {version} records none; every delta after is hash-checked)"
        print(f"verified: state digest {digest} ({whose})")
    return 0


def _checked_digest(reader: RunReader, version: int) -> tuple[int, str] | None:
    """The version whose recorded state digest ``replay(verify=True)`` checked, and that digest: the
    newest one from the keyframe it started at up to ``version``."""
    for manifest, _ in reversed(reader.chain(version)):
        if manifest.state_digest is not None:
            return manifest.version, f"{manifest.state_digest.algo}:{manifest.state_digest.value}"
    return None
