"""``deltarl checkpoint``: write a small local checkpoint that vLLM (and the hf backend) serves."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deltarl.commands._store import have_torch, positive_int

HELP = ("write a tiny Qwen3 checkpoint (BF16 safetensors, config, an offline Hugging Face byte tokenizer) that "
        "vllm serve, vLLM actors and --model take; nothing is downloaded")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, metavar="DIR", help="the checkpoint directory to write (must not exist)")
    parser.add_argument("--hidden-size", type=positive_int, default=256, metavar="N",
                        help="hidden width (default 256; hidden / heads must be >= 32 for vLLM's CPU attention)")
    parser.add_argument("--layers", type=positive_int, default=2, metavar="N", help="decoder layers (default 2)")
    parser.add_argument("--heads", type=positive_int, default=4, metavar="N", help="attention heads (default 4)")
    parser.add_argument("--kv-heads", type=positive_int, default=2, metavar="N", help="key/value heads (default 2)")
    parser.add_argument("--seed", type=int, default=3, metavar="N", help="seed of the initialisation (default 3)")


def run(args: argparse.Namespace) -> int:
    if not have_torch("checkpoint"):
        return 2
    from pydantic import ValidationError

    from deltarl.model.checkpoint import SERVABLE_TINY, write_checkpoint

    if args.out.exists():
        print(f"deltarl checkpoint: {args.out} exists; give a new directory", file=sys.stderr)
        return 2
    try:
        spec = SERVABLE_TINY.model_copy(update={"hidden_size": args.hidden_size, "num_layers": args.layers,
                                                "num_heads": args.heads, "num_kv_heads": args.kv_heads,
                                                "seed": args.seed})
        spec = type(spec).model_validate(spec.model_dump())
    except ValidationError as err:
        print(f"deltarl checkpoint: {err}", file=sys.stderr)
        return 2
    if spec.hidden_size // spec.num_heads < 32:
        print(f"deltarl checkpoint: note: head_dim {spec.hidden_size // spec.num_heads} < 32 is not served by "
              "vLLM's CPU build", file=sys.stderr)
    state = write_checkpoint(args.out, spec)
    params = sum(t.numel() for t in state.values())
    print(f"{args.out}: tiny Qwen3, {params:,} parameters, head_dim {spec.hidden_size // spec.num_heads}, "
          "hf byte tokenizer")
    return 0
