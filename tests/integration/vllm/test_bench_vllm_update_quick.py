"""benchmarks/vllm_update.py cannot rot: its --quick mode (tiny shape, one version) runs against vLLM's
real engine and prints its table (the measured runs are benchmarks/results/vllm_update*.json)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch]
ROOT = Path(__file__).resolve().parents[3]


def test_the_quick_run_updates_a_tiny_engine_and_prints_its_table() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "benchmarks.vllm_update", "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "deltarl pause (commit)" in out.stdout
    assert "bytes a rank fetched" in out.stdout
