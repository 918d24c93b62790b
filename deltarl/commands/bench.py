"""``deltarl bench``: run one of the reproducible benchmarks of a source checkout (``python -m benchmarks.NAME``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

#: Every module of ``benchmarks/`` that runs as ``python -m benchmarks.NAME`` (a test keeps this in step).
BENCHMARKS = ("codec", "publish", "transfer", "scheduler", "e2e", "scale", "sharded", "pause", "gpu", "idle_polling",
              "trl_callback", "vllm_update", "sharded_read", "fp8")

HELP = f"run a benchmark of a source checkout: python -m benchmarks.NAME ({', '.join(BENCHMARKS)})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    parser.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        help="arguments passed to the benchmark (e.g. --quick)",
    )


def checkout_root() -> Path | None:
    """The source checkout this package runs from (it has ``benchmarks/__init__.py``), else None."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "benchmarks" / "__init__.py").is_file() else None


def run(args: argparse.Namespace) -> int:
    root = checkout_root()
    if root is None:
        print("deltarl bench: the benchmarks ship with the source, not the installed package; "
              "clone the repository, pip install -e . and run it there", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return subprocess.call([sys.executable, "-m", f"benchmarks.{args.name}", *args.bench_args], cwd=root, env=env)
