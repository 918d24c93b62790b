"""``deltarl follow``: keep the newest weights of a run, through relays, and write them out."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import TYPE_CHECKING

from deltarl.commands._store import stop_on_signals

if TYPE_CHECKING:
    from deltarl.actor.subscriber import CommitInfo

HELP = ("follow a run's versions through relays (weights only, for eval servers and inference fleets) "
        "and write the last committed state as safetensors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="run name")
    parser.add_argument("--relay", action="append", default=[], metavar="URL",
                        help="relay URL (a deltarl relay or an nginx cache), nearest first; repeatable")
    parser.add_argument("--store", default=None, metavar="URL",
                        help="origin store URL, the fallback after every relay (optional)")
    parser.add_argument("--out", required=True, metavar="FILE", help="output .safetensors file")
    parser.add_argument("--until-version", type=int, default=None, metavar="N",
                        help="stop once version N is committed (default: follow until SIGINT/SIGTERM)")
    parser.add_argument("--streams", type=int, default=4, metavar="N", help="parallel fetch streams")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics (deltarl_follower_*) on this port (0: any free port)")
    parser.add_argument("--metrics-host", default="0.0.0.0", metavar="HOST", help="address of --metrics-port")
    parser.add_argument("--bootstrap-timeout", type=float, default=None, metavar="S",
                        help="give up if the run has no version after S seconds (default: wait)")


def run(args: argparse.Namespace) -> int:
    from deltarl.errors import DeltaRLError

    if not args.relay and not args.store:
        print("deltarl follow: give at least one --relay URL or a --store URL", file=sys.stderr)
        return 2
    if args.until_version is not None and args.until_version < 0:
        print("deltarl follow: --until-version must be >= 0", file=sys.stderr)
        return 2
    from deltarl.actor.follower import Follower

    stop = stop_on_signals()
    server = None
    try:
        follower = Follower(args.run, relays=args.relay, store=args.store, streams=args.streams)
        on_commit = None
        if args.metrics_port is not None:
            import dataclasses

            from deltarl.actor.metrics import WeightsMetrics
            from deltarl.exposition import MetricsServer

            metrics = WeightsMetrics("follower")
            metrics.follow_fetcher(lambda: dataclasses.asdict(follower.fetcher.stats))
            server = MetricsServer(metrics.registry, port=args.metrics_port, host=args.metrics_host)

            bootstrapped = threading.Event()

            def on_commit(info: CommitInfo) -> None:
                if not bootstrapped.is_set():  # the first call is the bootstrap's full state, not a commit
                    bootstrapped.set()
                    metrics.bootstrapped(info.version)
                    return
                metrics.record_commit(info.version, publish_to_staged_s=None, publish_to_commit_s=None,
                                      pause_s=info.pause_s)

        follower.run(args.until_version, out=args.out, stop=stop, bootstrap_timeout_s=args.bootstrap_timeout,
                     on_commit=on_commit)
    except DeltaRLError as err:
        print(f"deltarl follow: {err}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.close()
    if follower.version is None:
        print(f"deltarl follow: run {args.run!r}: stopped before any version was committed", file=sys.stderr)
        return 0 if stop.is_set() else 1
    print(f"{args.run} version {follower.version} ({(follower.version_id or '')[:16]}…) -> {args.out}")
    return 0
