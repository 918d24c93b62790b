"""``deltarl coordinator``: serve the rollout coordinator (leases, version-gated admission) for one run."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from deltarl import defaults
from deltarl.commands._store import store_help

HELP = "serve the rollout coordinator: EMA-proportional leases, version-gated admission, results in the store"

TOKEN_ENV = defaults.COORDINATOR_TOKEN_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None, metavar="URL",
                        help=store_help("store URL, required unless --config names one; a missing local folder is created "
                                     "(the coordinator writes results there), a missing bucket is an error"))
    parser.add_argument("--run", default=None, metavar="RUN", help="run name, its prefix in the store (required unless --config names one)")
    parser.add_argument("--listen", default=None, metavar="HOST:PORT",
                        help=f"address to bind (default from --config, else {defaults.COORDINATOR_HOST}:{defaults.COORDINATOR_PORT}; port 0 picks one)")
    parser.add_argument("--config", default=None, metavar="FILE", help="YAML/JSON CoordinatorConfig; flags override it")
    parser.add_argument("--token", action="append", default=[], metavar="TOKEN",
                        help=f"bearer token valid for actors and the trainer (repeatable; also ${TOKEN_ENV})")
    parser.add_argument("--actor-token", action="append", default=[], metavar="TOKEN", help="actor-only token")
    parser.add_argument("--trainer-token", action="append", default=[], metavar="TOKEN", help="trainer-only token")


def _parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--listen wants HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def run(args: argparse.Namespace) -> int:
    from deltarl.coordinator.config import CoordinatorConfig
    from deltarl.errors import DeltaRLError
    from deltarl.storage.open import open_store

    try:
        config = CoordinatorConfig.load(args.config) if args.config else CoordinatorConfig()
        svc = config.service
        host, port = _parse_listen(args.listen) if args.listen else (svc.host, svc.port)
        shared = list(args.token) + ([t] if (t := defaults.first_env([TOKEN_ENV])) else [])
        actor_tokens = [*svc.actor_tokens, *shared, *args.actor_token]
        trainer_tokens = [*svc.trainer_tokens, *shared, *args.trainer_token]
        if not actor_tokens or not trainer_tokens:
            raise ValueError(f"give tokens for actors and the trainer (--token, --actor-token/--trainer-token or ${TOKEN_ENV})")
        svc = svc.model_copy(update={"host": host, "port": port, "actor_tokens": actor_tokens,
                                     "trainer_tokens": trainer_tokens})
        config = config.model_copy(update={"service": svc})
        store_url, run_name = args.store or config.store, args.run or config.run
        if not store_url or not run_name:
            raise ValueError("give --store and --run (or 'store:' and 'run:' in the --config file)")
        # the coordinator writes the run's results: a missing local folder is created (it may start
        # before the trainer); a bucket never is (a missing one fails at start, naming it)
        store = open_store(store_url)
    except (DeltaRLError, ValueError) as err:
        print(f"deltarl coordinator: {err}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(store, run_name, config))
    except DeltaRLError as err:
        print(f"deltarl coordinator: {err}", file=sys.stderr)
        return 1
    finally:
        store.close()
    return 0


async def _serve(store: object, run: str, config: object) -> None:
    from aiohttp import web

    from deltarl.coordinator.config import CoordinatorConfig
    from deltarl.coordinator.server import Coordinator, create_app
    from deltarl.storage.store import ObjectStore

    assert isinstance(store, ObjectStore)
    assert isinstance(config, CoordinatorConfig)
    app = create_app(Coordinator(store, run, config))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.service.host, config.service.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # before the line a supervisor waits for: a stop
            loop.add_signal_handler(sig, stop.set)  # sent right after it is a clean exit, not a kill
        print(f"coordinator for run {run!r} listening on http://{host}:{port}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
