"""``python -m benchmarks.fp8 --quick`` runs end to end: every scenario checked bit-exact inside the run,
the peers run on the FP8 bytes, and the JSON carries the issue-35 figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.torch]


def test_fp8_quick(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-m", "benchmarks.fp8", "--quick", "--out", str(out)], cwd=root, check=True,
                   capture_output=True, timeout=170)  # fmt: skip
    doc = json.loads(out.read_text())
    assert set(doc["scenarios"]) == {"dense lr 1e-06", "dense lr 1e-05", "moe lr 1e-06", "moe lr 1e-05"}
    for sc in doc["scenarios"].values():
        assert 0 < sc["codes_changed_fraction"] < sc["bf16_changed_fraction"]
        assert 0 < sc["fp8_vs_bf16_delta"] < 1
        assert 0 < sc["fp8_delta_vs_full_fp8"] < 0.1
        assert set(sc["peers_bytes"]) == {"aurora", "verl/trl", "slime", "nemo-rl"}
        assert sc["fp8_by_kind"]["codes"] > 0
        assert sc["encode_GBps"] > 0
        assert sc["apply_core_s_per_GB"] > 0
