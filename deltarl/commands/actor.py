"""``deltarl actor``: generate rollouts for a run, following its versions through relays or the store."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType
from typing import Any

from deltarl.actor.backends.table import BACKENDS
from deltarl.commands._store import have_torch, store_help

HELP = "run a rollout actor: lease prompts, generate on the current version, commit new versions between batches"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML/JSON ActorConfig (or a deployment file with an 'actor:' section); flags override it")
    parser.add_argument("--coordinator", default=None, metavar="URL", help="coordinator base URL")
    parser.add_argument("--token", default=None, metavar="TOKEN",
                        help="actor bearer token (else the config, $DELTARL_ACTOR_TOKEN or $DELTARL_COORDINATOR_TOKEN)")
    parser.add_argument("--store", default=None, metavar="URL", help=store_help(
        "origin store URL, the last source after the relays (optional with --relay: a relay-only actor "
        "reads model.json, HEAD, manifests and segments through relays)"))
    parser.add_argument("--run", default=None, metavar="RUN", help="run name")
    parser.add_argument("--region", default=None, help="region label (selects the region's relays in the config)")
    parser.add_argument("--relay", action="append", default=None, metavar="URL",
                        help="relay URL, in order of preference (repeatable; replaces the config's relays)")
    parser.add_argument("--streams", type=int, default=None, metavar="N", help="parallel fetch streams")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default=None,
                        help="generation backend: " + "; ".join(f"{e.name}: {e.summary}" for e in BACKENDS.values()))
    parser.add_argument("--engine-option", action="append", default=None, metavar="KEY=VALUE",
                        help="a keyword option of the backend's engine (vllm: a vllm.LLM argument; VALUE read as "
                             "JSON, else a string; repeatable), e.g. max_model_len=512")
    parser.add_argument("--device", default=None, help="torch device of the hf backend (cpu, cuda, cuda:1)")
    parser.add_argument("--throttle", type=float, default=None, metavar="X",
                        help="emulate hardware X times slower (>= 1; fleets of unequal actors on one machine)")
    parser.add_argument("--max-prompts", type=int, default=None, metavar="N", help="cap on prompts per lease")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--name", default=None, help="name in logs and events (default: the region)")
    parser.add_argument("--events", default=None, metavar="FILE", help="append one JSON line per event to FILE")
    parser.add_argument("--state-out", default=None, metavar="FILE",
                        help="on exit (and on SIGUSR1), write the live weights' version and state digest to FILE")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (versions, publish->staged, "
                             "commit pause, bytes by source, results)")
    parser.add_argument("--metrics-host", default=None, metavar="HOST", help="address of --metrics-port (default 0.0.0.0)")


def engine_options(items: list[str] | None) -> dict[str, Any] | None:
    """``KEY=VALUE`` flags as a dict (VALUE as JSON where it parses); None without any."""
    import json

    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"deltarl actor: --engine-option wants KEY=VALUE, not {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    if not have_torch("actor"):
        return 2
    from deltarl.actor.config import ActorConfig
    from deltarl.errors import DeltaRLError

    try:
        config = ActorConfig.load(
            args.config, coordinator=args.coordinator, token=args.token, store=args.store, run=args.run,
            region=args.region, relays=args.relay, streams=args.streams, backend=args.backend, device=args.device,
            throttle=args.throttle, max_prompts=args.max_prompts, seed=args.seed, events=args.events,
            state_out=args.state_out, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
            engine_options=engine_options(args.engine_option),
        )
        config.resolved_token()
        config.check_sources()
    except DeltaRLError as err:
        print(f"deltarl actor: {err}", file=sys.stderr)
        return 2
    from deltarl.actor.loop import ActorLoop

    loop = ActorLoop(config, name=args.name)

    def _stop(signum: int, frame: FrameType | None) -> None:
        loop.stop()

    def _state(signum: int, frame: FrameType | None) -> None:
        loop.request_state()

    signal.signal(signal.SIGUSR1, _state)  # write --state-out now (at the next safe point) and carry on
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        loop.run()
    except DeltaRLError as err:
        print(f"deltarl actor: {err}", file=sys.stderr)
        return 1
    return 0
