"""``python -m benchmarks.codec --quick`` runs end to end: every format on every scenario, checked
bit-exact inside the run, and the JSON carries the issue-22 target figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)


def test_codec_quick(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-m", "benchmarks.codec", "--quick", "--out", str(out)], cwd=root, check=True,
                   capture_output=True, timeout=170)  # fmt: skip
    doc = json.loads(out.read_text())
    assert set(doc["scenarios"]) == {"dense 0.02%", "dense 1.00%", "moe 0.02%", "moe uniform 1.00%"}
    for sc in doc["scenarios"].values():
        assert {"deltarl auto", "deltarl sparse", "deltarl ctx", "aurora", "verl/trl", "slime", "nemo-rl"} <= set(sc["formats"])
        assert sc["formats"]["deltarl auto"]["bytes"] > 0
    assert doc["scenarios"]["dense 0.02%"]["formats"]["deltarl auto"]["codecs_used"].keys() <= {"none", "sparse"}
    assert "stage_ratio_dense_0.02_vs_1" in doc["targets"]
