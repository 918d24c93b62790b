"""``deltarl demo``: the whole RL loop on one machine, nothing to set up."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from deltarl import defaults
from deltarl.actor.backends.table import BACKENDS
from deltarl.commands._store import have_torch, store_help
from deltarl.commands.trainer import add_sink_arguments, sink_overrides

HELP = ("run the whole loop on this machine: coordinator, relay, trainer and unequal actors on a warm-started tiny model "
        "(or --model PATH) in the sparse regime (a few minutes)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=25, metavar="N", help="training steps (default 25)")
    parser.add_argument("--actors", type=int, default=3, metavar="N", help="actor processes of unequal speed (default 3)")
    parser.add_argument("--store", default=None, metavar="URL",
                        help=store_help("store URL (default: the --out folder; s3:// also takes --endpoint-url)"))
    parser.add_argument("--endpoint-url", default=None, metavar="URL",
                        help="S3 endpoint for an s3:// store (MinIO, SeaweedFS); also $DELTARL_S3_ENDPOINT")
    parser.add_argument("--out", type=Path, default=Path(defaults.STORE), metavar="DIR",
                        help=f"folder of the local store and of the demo's logs and report (default {defaults.STORE})")
    parser.add_argument("--run", default=None, metavar="RUN", help="run name (default demo-<UTC time>)")
    parser.add_argument("--prompts", type=int, default=32, metavar="N", help="prompts per step (default 32)")
    parser.add_argument("--group-size", type=int, default=8, metavar="G", help="completions per prompt (default 8)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a local Hugging Face checkpoint directory (any causal LM, with its tokenizer) instead of "
                             "the tiny model; nothing is downloaded")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="hf",
                        help="the actors' generation backend (" + "; ".join(
                            f"{e.name}: {e.summary}" for e in BACKENDS.values())
                        + "); a backend that serves a checkpoint directory gets a tiny one written under --out "
                          "when --model is not given")
    parser.add_argument("--lr", type=float, default=None, metavar="LR",
                        help="GRPO learning rate (default 1.5e-5 for the tiny model, 1e-6 for --model)")
    parser.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                        help="supervised warm-up steps before GRPO, cached under --out (default 4; 0 for --model)")
    parser.add_argument("--no-live", action="store_true", help="print one line per step instead of the live table")
    add_sink_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if not have_torch("demo"):
        return 2
    from deltarl.demo.runner import DemoOptions, run_demo
    from deltarl.trainer.sinks import SinkConfig

    if args.steps < 1 or not 1 <= args.actors <= 8 or args.prompts < 1 or args.group_size < 2:
        print("deltarl demo: need --steps >= 1, 1 <= --actors <= 8, --prompts >= 1, --group-size >= 2")
        return 2
    if args.lr is not None and not 0 < args.lr <= 1:
        print("deltarl demo: need 0 < --lr <= 1")
        return 2
    if args.warmup_steps is not None and args.warmup_steps < 0:
        print("deltarl demo: need --warmup-steps >= 0")
        return 2
    if BACKENDS[args.backend].needs_checkpoint and args.model is None:  # it serves a directory: write a tiny one
        args.model, args.lr, args.warmup_steps = _servable_tiny(args)
    if args.model is not None:
        from deltarl.demo.preset import check_checkpoint
        from deltarl.errors import ConfigError

        try:
            check_checkpoint(args.model)
        except ConfigError as err:
            print(f"deltarl demo: {err}")
            return 2
    if args.endpoint_url:
        os.environ[defaults.S3_ENDPOINT_ENV] = args.endpoint_url  # inherited by every child process
    options = DemoOptions(steps=args.steps, actors=args.actors, store=args.store, out=args.out, run=args.run,
                          prompts_per_step=args.prompts, group_size=args.group_size,
                          live=False if args.no_live else None, metrics=SinkConfig.model_validate(sink_overrides(args)),
                          model=args.model, lr=args.lr, warmup_steps=args.warmup_steps, backend=args.backend)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops every child like Ctrl-C does
    return run_demo(options)


def _servable_tiny(args: argparse.Namespace) -> tuple[str, float, int]:
    """``deltarl demo --backend vllm`` without ``--model``: a tiny Qwen3 checkpoint vLLM's CPU build
    serves (head_dim 64), written once under ``--out``, trained at the tiny preset's lr and warm-up."""
    from deltarl.model.checkpoint import SERVABLE_TINY, write_checkpoint
    from deltarl.trainer.config import SPARSE_GRPO, SPARSE_WARMUP

    path = Path(args.out) / "_cache" / "vllm-tiny-qwen3"
    if not (path / "config.json").exists():
        write_checkpoint(path, SERVABLE_TINY)
    lr = SPARSE_GRPO.lr if args.lr is None else args.lr
    return str(path), lr, SPARSE_WARMUP.steps if args.warmup_steps is None else args.warmup_steps
