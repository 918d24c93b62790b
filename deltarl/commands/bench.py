"""``deltarl bench``: run one of the reproducible benchmarks under ``benchmarks/`` of a checkout."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HELP = "run a benchmark from the checkout's benchmarks/ folder (codec, publish, transfer, scheduler, e2e, pause, gpu)"

BENCHMARKS = ("codec", "publish", "transfer", "scheduler", "e2e", "pause", "gpu")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    parser.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        help="arguments passed to the benchmark script (e.g. --quick)",
    )


def benchmarks_dir() -> Path | None:
    """The ``benchmarks/`` folder next to the package (present in a checkout or editable install)."""
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    return here if here.is_dir() else None


def run(args: argparse.Namespace) -> int:
    folder = benchmarks_dir()
    if folder is None:
        print(
            "deltarl bench: no benchmarks/ folder next to this installation; "
            "run it from a source checkout (pip install -e .)",
            file=sys.stderr,
        )
        return 2
    script = folder / f"{args.name}.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder.parent), env.get("PYTHONPATH", "")) if p)
    return subprocess.call([sys.executable, str(script), *args.bench_args], cwd=folder.parent, env=env)
