"""benchmarks/gpu.py cannot rot: without CUDA it skips cleanly, and its --allow-cpu --quick mode runs
deltarl's own torch scatter path at dense and MoE shapes (bit-exact, checked inside)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)
    return out.stdout


def test_without_cuda_it_skips_cleanly() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the benchmark runs for real")
    assert _run("--quick").startswith("skipped: no CUDA")


def test_the_quick_cpu_run_stages_and_commits_dense_and_moe_bit_exact() -> None:
    out = _run("--quick", "--allow-cpu")
    assert "dense" in out
    assert "moe" in out
    assert out.count("bit-exact") >= 2
