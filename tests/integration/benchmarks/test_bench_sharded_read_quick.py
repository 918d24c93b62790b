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
