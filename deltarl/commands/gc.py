"""``deltarl gc``: remove orphans of interrupted publishes and, on request, old versions."""

from __future__ import annotations

import argparse
import sys

from deltarl.commands._store import add_store_argument, open_existing_store, positive_int
from deltarl.pipeline.inspection import human_bytes

HELP = "remove orphaned objects of a run and, with --keep-last, old versions replay no longer needs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_argument(parser)
    parser.add_argument("--keep-last", type=positive_int, default=None, metavar="N", help="keep the last N versions replayable; remove older ones")
    parser.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    parser.add_argument("--force", action="store_true", help="also sweep a publish in flight even if its writer's lease is live")


def run(args: argparse.Namespace) -> int:
    from deltarl.errors import DeltaRLError
    from deltarl.pipeline import gc

    store = open_existing_store(args.store)
    try:
        report = gc(store, args.run, keep_last=args.keep_last, dry_run=args.dry_run, force=args.force)
    except (DeltaRLError, ValueError) as err:
        print(f"deltarl gc: {err}", file=sys.stderr)
        return 1
    finally:
        store.close()
    verb = "would remove" if args.dry_run else "removed"
    print(f"run {args.run}: last committed version {report.last_committed}")
    print(f"{verb} {len(report.orphans)} orphans")
    for key in report.orphans:
        print(f"  {key}")
    if report.removed_versions:
        print(f"{verb} versions {report.removed_versions[0]}..{report.removed_versions[-1]} ({len(report.removed_keys)} objects); "
              f"oldest replayable version is now {report.oldest_kept}")  # fmt: skip
    if report.in_flight:
        print(f"left {len(report.in_flight)} objects of a publish in flight (a live writer holds the run; --force sweeps them)")
    print(f"{verb} {human_bytes(report.freed_bytes)}")
    return 0
