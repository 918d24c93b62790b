"""``python -m benchmarks.sharded_read --quick`` runs end to end: every TP 2 rank stages its part
bit-exact inside the run, and the printed figures carry the issue-32 targets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)


def test_sharded_read_quick(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    run = subprocess.run([sys.executable, "-m", "benchmarks.sharded_read", "--quick", "--out", str(tmp_path / "o.json")],
                         cwd=root, check=True, capture_output=True, text=True, timeout=170)  # fmt: skip
    out = run.stdout
    for line in ("x format 1", "TP 2 rank 1: fetched", "TP 2 stage / TP 1"):
        assert line in out
    assert "235B-A22B-shaped plan" in out
    assert not (tmp_path / "o.json").exists()  # --quick writes no result


def test_sharded_read_quick_moe_layer(tmp_path: Path) -> None:
    """``--moe-experts``: Qwen3-30B-A3B's layer 0 (real expert shapes, 2 experts) through the same run."""
    root = Path(__file__).resolve().parents[3]
    run = subprocess.run([sys.executable, "-m", "benchmarks.sharded_read", "--quick", "--moe-experts", "2", "--out",
                          str(tmp_path / "o.json")], cwd=root, check=True, capture_output=True, text=True, timeout=170)  # fmt: skip
    assert "Qwen3-30B-A3B layer 0 with 2 experts" in run.stdout
    assert "TP 2 stage / TP 1" in run.stdout
