"""``deltarl gc``: remove orphans of interrupted publishes and, on request, old versions."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from deltarl.commands._store import add_store_argument, open_existing_store, positive_int
from deltarl.pipeline.gc import PENDING_GRACE_S
from deltarl.pipeline.inspection import human_bytes

if TYPE_CHECKING:
    from deltarl.pipeline.gc import GcReport

HELP = ("remove orphaned objects and dead writers' unfinished writes of a run and, with --keep-last, old versions "
        "replay no longer needs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_argument(parser)
    parser.add_argument("--keep-last", type=positive_int, default=None, metavar="N", help="keep the last N versions replayable; remove older ones")
    parser.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    parser.add_argument("--force", action="store_true", help="also sweep a publish in flight even if its writer's lease is live")


def run(args: argparse.Namespace) -> int:
    from deltarl.errors import DeltaRLError
    from deltarl.pipeline.gc import gc

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
    if report.pending:
        print(f"{verb} {len(report.pending)} unfinished writes of dead writers "
              f"({human_bytes(sum(w.size for w in report.pending))}: temp files, multipart uploads)")  # fmt: skip
        for write in report.pending:
            print(f"  {write.key} ({write.handle}, {human_bytes(write.size)})")
    for line in report.damaged:
        print(f"kept an older keyframe: {line}")
    if report.removed_versions:
        print(f"{verb} versions {report.removed_versions[0]}..{report.removed_versions[-1]} ({len(report.removed_keys)} objects); "
              f"oldest replayable version is now {report.oldest_kept}")  # fmt: skip
    if report.in_flight or report.pending_left:
        print(_left_in_flight(report))
    print(f"{verb} {human_bytes(report.freed_bytes)}")
    return 0


def _left_in_flight(report: GcReport) -> str:
    """What gc left of a publish in flight, and when it may sweep it."""
    what = f"{len(report.in_flight)} objects and {len(report.pending_left)} unfinished writes " \
           f"({human_bytes(sum(w.size for w in report.pending_left))})"
    claim = report.live_writer
    if claim is None:
        return f"left {what} written to in the last {PENDING_GRACE_S:.0f} s (a write in progress); run gc again later"
    left_s = max(0.0, claim.expires_at_ms / 1000 - time.time())
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(claim.expires_at_ms / 1000))
    return (f"left {what} of a publish in flight: writer {claim.writer_id!r} (pid {claim.pid} on {claim.host}) holds "
            f"the run until its lease expires at {until} (in {_duration(left_s)}); run gc again after that, "
            "or with --force if that writer is dead")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s" if minutes else f"{secs} s"
