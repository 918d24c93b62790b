"""``deltarl inspect``: a table of a run's versions (changed fraction, bytes, ratio, keyframes, digests)."""

from __future__ import annotations

import argparse
import json
import sys

from deltarl.commands._store import add_store_argument, non_negative_int, open_existing_store, positive_int
from deltarl.pipeline.inspection import human_bytes, spans

HELP = "show a run's versions: changed fraction, delta bytes, ratio vs full weights, keyframes, digests"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_argument(parser)
    parser.add_argument("--version", type=non_negative_int, default=None, metavar="N", help="show only version N")
    parser.add_argument("--last", type=positive_int, default=50, metavar="N", help="show the last N versions (default 50)")
    parser.add_argument("--all", action="store_true", help="show every version still stored")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from deltarl.errors import DeltaRLError
    from deltarl.pipeline.inspection import inspect_run

    store = open_existing_store(args.store)
    try:
        summary = inspect_run(store, args.run, version=args.version, last=None if args.all else args.last)
    except DeltaRLError as err:
        print(f"deltarl inspect: {err}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if summary.missing:
        many = len(summary.missing) > 1
        print(f"deltarl inspect: version{'s' if many else ''} {spans(summary.missing)} {'are' if many else 'is'} missing "
              "(no manifest): the stored chain is broken there, and no version after the gap replays from a "
              "keyframe before it", file=sys.stderr)  # fmt: skip
    if args.json:
        versions = [r.to_obj() for r in summary.rows]
        print(json.dumps({"run": args.run, "head": None if summary.head is None else summary.head.version,
                          "versions": versions, "missing": list(summary.missing)}, indent=1))
        return 0
    info, head = summary.info, summary.head
    full = sum(t.numel for t in info.tensors)
    title = (f"run {info.run}: {len(info.tensors)} tensors, {full:,} elements, codec {info.codec}, keyframe every "
             f"{info.keyframe_interval}, digest every {info.digest_interval}; HEAD "
             f"{'none' if head is None else f'{head.version} ({head.version_id[:12]})'}")  # fmt: skip
    columns = ("version", "step", "kind", "segs", "changed", "delta", "ratio vs full", "keyframe", "digest", "id")
    rows: list[tuple[str, ...]] = [
        (
            str(r.version),
            str(r.step),
            r.kind,
            str(r.segments),
            f"{100 * r.stats.changed_fraction:.3f}%",
            human_bytes(r.stats.encoded_bytes),
            f"{100 * r.stats.ratio:.3f}%",
            "" if r.keyframe_bytes is None else human_bytes(r.keyframe_bytes),
            "" if r.state_digest is None else r.state_digest[:12],
            r.version_id[:12],
        )
        for r in summary.rows
    ]
    shown = {r.version for r in summary.rows}
    if shown:  # a gap inside the versions shown is a row of its own
        gaps = [v for v in summary.missing if min(shown) < v < max(shown)]
        rows.extend((str(v), "", "missing", *("",) * (len(columns) - 3)) for v in gaps)
        rows.sort(key=lambda row: int(row[0]))
    if not sys.stdout.isatty():  # piped: whole values, tab-separated, one version a line (cut/awk/sort work)
        print(f"# {title}")
        print("\t".join(c.replace(" ", "_") for c in columns))
        for row in rows:
            print("\t".join(cell or "-" for cell in row))
        return 0
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="right" if col not in ("kind", "digest", "id") else "left", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return 0
