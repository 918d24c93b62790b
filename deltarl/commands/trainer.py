"""``deltarl trainer``: GRPO against a coordinator, publishing every version to the store."""

from __future__ import annotations

import argparse
import os
import sys

from deltarl.commands._store import have_torch, store_help

HELP = "train with GRPO against a coordinator and publish every policy version to the store"

TOKEN_ENVS = ("DELTARL_TRAINER_TOKEN", "DELTARL_COORDINATOR_TOKEN")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="YAML/JSON TrainerConfig (or a deployment file with a 'trainer:' section)")
    parser.add_argument("--store", default=None, metavar="URL", help=store_help("store URL, overrides the config"))
    parser.add_argument("--run", default=None, metavar="RUN", help="run name (overrides the config)")
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="training steps (overrides the config)")
    parser.add_argument("--coordinator", default=None, metavar="URL", help="coordinator base URL (overrides the config)")
    parser.add_argument("--token", default=None, metavar="TOKEN",
                        help=f"trainer bearer token (else the config, ${TOKEN_ENVS[0]} or ${TOKEN_ENVS[1]})")


def run(args: argparse.Namespace) -> int:
    if not have_torch("trainer"):
        return 2
    from deltarl.errors import DeltaRLError
    from deltarl.trainer.config import TrainerConfig

    try:
        config = TrainerConfig.load(args.config, store=args.store, run=args.run, steps=args.steps)
        endpoint = config.coordinator
        url = args.coordinator or endpoint.url
        token = args.token or endpoint.token or next((os.environ[e] for e in TOKEN_ENVS if os.environ.get(e)), None)
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

    assert isinstance(config, TrainerConfig)

    def show(r: StepReport) -> None:
        st = r.publish.stats
        print(
            f"step {r.step:4d}  version {r.version:4d}  reward {r.stats.reward_mean:.3f}  "
            f"changed {st.changed_fraction:6.2%}  delta {st.encoded_bytes:>10,d} B of {st.full_bytes:,d}  "
            f"wait {r.wait_s:.2f}s  publish {r.publish_s:.2f}s",
            flush=True,
        )

    store = open_store(config.store)
    try:
        pub = config.publish
        with SyncCoordinatorClient(url, token) as client, Publisher(
            store,
            config.run,
            keyframe_interval=pub.keyframe_interval,
            digest_interval=pub.digest_interval,
            segment_bytes=pub.segment_bytes,
            takeover=pub.takeover,
        ) as publisher:
            loop = TrainerLoop(config, coordinator=ClientCoordinator(client), publisher=publisher, store=store, on_step=show)
            loop.run()
    except DeltaRLError as err:
        print(f"deltarl trainer: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deltarl trainer: interrupted", file=sys.stderr)
        return 130
    finally:
        store.close()
    print(f"run {config.run!r}: {config.steps} steps published to {config.store}")
    return 0
