"""``deltarl serve-sync``: keep ``vllm serve`` endpoints on a run's HEAD over their HTTP routes."""

from __future__ import annotations

import argparse
import json
import sys

from deltarl.commands._store import stop_on_signals

HELP = ("keep vllm serve endpoints (started with deltarl's engine and VLLM_SERVER_DEV_MODE=1) on a run's HEAD: "
        "attach, stage each version as it is published, commit under a pause, reset the prefix cache")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="run name")
    parser.add_argument("--server", action="append", required=True, metavar="URL",
                        help="a vllm serve endpoint (http://host:8000); repeatable")
    parser.add_argument("--store", required=True, metavar="URL",
                        help="where to watch the run's HEAD (a store URL, or a relay's)")
    parser.add_argument("--engine-store", default=None, metavar="URL",
                        help="the store URL the servers' workers read (default --store)")
    parser.add_argument("--relay", action="append", default=[], metavar="URL",
                        help="relay the servers' workers try first, nearest first; repeatable")
    parser.add_argument("--pause", choices=("wait", "abort", "none"), default="wait",
                        help="around each commit: wait = requests in flight finish on the old version first "
                             "(none spans two versions); abort = they end at once (finish_reason 'abort'); "
                             "none = they go on, on the new weights (default: wait)")
    parser.add_argument("--no-digest", action="store_true",
                        help="do not hash the served weights after each commit (the report then has no digest)")
    parser.add_argument("--until-version", type=int, default=None, metavar="N",
                        help="exit once every server serves version N (default: run until SIGINT/SIGTERM)")
    parser.add_argument("--report", default=None, metavar="FILE",
                        help="write each server's final state (version, version id, digest, ...) as JSON")
    parser.add_argument("--poll", type=float, default=0.5, metavar="S", help="how often to read HEAD")
    parser.add_argument("--max-backoff", type=float, default=30.0, metavar="S",
                        help="longest wait before retrying a server that does not answer (from 1 s, doubling)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics (deltarl_serve_sync_*) on this port (0: any free port)")
    parser.add_argument("--metrics-host", default="0.0.0.0", metavar="HOST", help="address of --metrics-port")


def run(args: argparse.Namespace) -> int:
    from deltarl.errors import DeltaRLError
    from deltarl.integrations.vllm.serve_sync import ServeSync, ServeSyncMetrics

    stop = stop_on_signals()
    server = None
    metrics = None
    try:
        if args.metrics_port is not None:
            from deltarl.exposition import MetricsServer

            metrics = ServeSyncMetrics()
            server = MetricsServer(metrics.registry, port=args.metrics_port, host=args.metrics_host)
        sync = ServeSync(args.server, args.store, args.run, relays=args.relay, engine_store=args.engine_store,
                         pause=args.pause, digest=not args.no_digest, poll_s=args.poll,
                         backoff_s=(min(1.0, args.max_backoff), args.max_backoff), metrics=metrics)
        sync.run(stop, until_version=args.until_version)
    except DeltaRLError as err:
        print(f"deltarl serve-sync: {err}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.close()
    report = sync.report()
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    for s in report:
        digest = (s["digest"] or "")[:16]
        print(f"{s['url']} version {s['version']} digest {digest or '-'} attaches {s['attaches']} "
              f"updates {s['updates']} failures {s['failures']}")
    return 0
