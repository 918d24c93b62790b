"""``python -m benchmarks.vllm_update --quick`` runs end to end against vLLM's real engine: every
version committed, every path timed, the JSON written where asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[3]


def test_vllm_update_quick(tmp_path: Path) -> None:
    out = tmp_path / "vllm_update.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm_update", "--quick", "--out", str(out),
                           "--workdir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["benchmark"], doc["quick"], doc["shape"], doc["final_version"]) == ("vllm_update", True, "tiny", 2)
    assert len(doc["versions"]) == 2
    for key in ("fetch_s", "decode_s", "pause_s", "scatter_s", "vllm_sparse_s", "dense_reload_s"):
        assert doc["median"][key] > 0, key
