"""``deltarl trainer``: GRPO against a coordinator, publishing every version to the store."""

from __future__ import annotations

import argparse
import sys

from deltarl import defaults
from deltarl.commands._store import have_torch, store_help

HELP = "train with GRPO against a coordinator and publish every policy version to the store"

TOKEN_ENVS = defaults.TRAINER_TOKEN_ENVS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="YAML/JSON TrainerConfig (or a deployment file with a 'trainer:' section)")
    parser.add_argument("--store", default=None, metavar="URL", help=store_help("store URL, overrides the config"))
    parser.add_argument("--run", default=None, metavar="RUN", help="run name (overrides the config)")
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="training steps (overrides the config)")
    parser.add_argument("--coordinator", default=None, metavar="URL", help="coordinator base URL (overrides the config)")
    parser.add_argument("--token", default=None, metavar="TOKEN",
                        help=f"trainer bearer token (else the config, ${TOKEN_ENVS[0]} or ${TOKEN_ENVS[1]})")
    add_sink_arguments(parser)


def add_sink_arguments(parser: argparse.ArgumentParser) -> None:
    """The metric outputs shared by ``deltarl trainer`` and ``deltarl demo``."""
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics of the trainer and publisher at http://HOST:PORT/metrics")
    parser.add_argument("--metrics-host", default=None, metavar="HOST", help="address of --metrics-port (default 0.0.0.0)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR", help="write TensorBoard event files into DIR")
    parser.add_argument("--wandb", default=None, metavar="PROJECT", help="log every step to this wandb project")
    parser.add_argument("--wandb-mode", default=None, choices=("online", "offline", "disabled"),
                        help="wandb mode (else $WANDB_MODE)")


def sink_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The metric fields the flags set (None: not given)."""
    given = {"metrics_port": args.metrics_port, "metrics_host": args.metrics_host, "tensorboard": args.tensorboard,
             "wandb_project": args.wandb, "wandb_mode": args.wandb_mode}
    return {k: v for k, v in given.items() if v is not None}


def run(args: argparse.Namespace) -> int:
    if not have_torch("trainer"):
        return 2
    from deltarl.errors import DeltaRLError
    from deltarl.trainer.config import TrainerConfig

    try:
        config = TrainerConfig.load(args.config, store=args.store, run=args.run, steps=args.steps)
        config = config.model_copy(update={"metrics": config.metrics.model_copy(update=sink_overrides(args))})
        endpoint = config.coordinator
        url = args.coordinator or endpoint.url
        token = args.token or endpoint.token or defaults.first_env(TOKEN_ENVS)
        if not token:
            raise ValueError(f"give the trainer's coordinator token (--token, coordinator.token or ${TOKEN_ENVS[0]})")
    except (DeltaRLError, ValueError) as err:
        print(f"deltarl trainer: {err}", file=sys.stderr)
        return 2
    return _train(config, url, token)


def _train(config: object, url: str, token: str) -> int:
    from deltarl.errors import DeltaRLError
    from deltarl.pipeline.publisher import Publisher
    from deltarl.protocol.client import SyncCoordinatorClient
    from deltarl.storage.open import open_store
    from deltarl.trainer.config import TrainerConfig
    from deltarl.trainer.loop import ClientCoordinator, StepReport, TrainerLoop
    from deltarl.trainer.metrics import TrainerMetrics
    from deltarl.trainer.sinks import Sinks

    assert isinstance(config, TrainerConfig)
    metrics = TrainerMetrics()
    sinks: Sinks | None = None

    def show(r: StepReport) -> None:
        metrics.step(r)
        if sinks is not None:
            sinks.log_step(r)
        st = r.publish.stats
        print(
            f"step {r.step:4d}  version {r.version:4d}  reward {r.stats.reward_mean:.3f}  "
            f"changed {st.changed_fraction:6.2%}  delta {st.encoded_bytes:>10,d} B of {st.full_bytes:,d}  "
            f"wait {r.wait_s:.2f}s  publish {r.publish_s:.2f}s",
            flush=True,
        )

    server = None
    store = open_store(config.store)
    try:
        if config.metrics.metrics_port is not None:
            from deltarl.exposition import MetricsServer

            server = MetricsServer(metrics.registry, port=config.metrics.metrics_port, host=config.metrics.metrics_host)
        sinks = Sinks.open(config.metrics, run=config.run, hyperparameters=config.model_dump(mode="json",
                                                                                          exclude={"coordinator"}))
        with SyncCoordinatorClient(url, token) as client, Publisher(store, config.run, config.publish) as publisher:
            loop = TrainerLoop(config, coordinator=ClientCoordinator(client), publisher=publisher, store=store, on_step=show)
            metrics.published(loop.start())  # version 0
            loop.run()
    except DeltaRLError as err:
        print(f"deltarl trainer: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deltarl trainer: interrupted", file=sys.stderr)
        return 130
    finally:
        if sinks is not None:
            sinks.close()
        if server is not None:
            server.close()
        store.close()
    print(f"run {config.run!r}: {config.steps} steps published to {config.store}")
    return 0
