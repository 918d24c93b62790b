"""``python -m benchmarks.e2e --full-size`` at a tiny size: the same code path as the 1.7B run (relay
processes, tbf-shaped veths into a network namespace, one process per actor, file-backed trainer
versions), time scaled x100. The JSON has e2e.json's keys, every actor of both real modes ends
bit-identical to the trainer, and the events run: the late joiner bootstraps from the keyframe, the
killed relay's actor fails over to the origin and keeps every window on an accepted version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.netns

REPO = Path(__file__).resolve().parents[3]


def _run(tmp_path: Path, parts: str) -> dict[str, Any]:
    from benchmarks._e2e import netns

    if not netns.available():
        pytest.skip("needs root and the ip and tc commands")
    out = tmp_path / "e2e-full.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e", "--full-size", "--model", "tiny", "--time-scale", "150", "--rates", "1",
         "--parts", parts, "--steps", "1", "--full-steps", "2", "--out", str(out), "--scratch", str(tmp_path / "s")],
        cwd=REPO, capture_output=True, text=True, timeout=55,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


@pytest.mark.timeout(60)
def test_e2e_full_size_tiny(tmp_path: Path) -> None:
    doc = _run(tmp_path, "main")
    assert doc["benchmark"] == "e2e-full"
    assert doc["scale"]["S"] == 1.0
    assert doc["scale"]["T"] == 150
    assert doc["scale"]["params"] > 0
    assert doc["scale"]["command"].startswith("python -m benchmarks.e2e --full-size")
    assert doc["emulation"].startswith("tbf")
    rate = doc["rates"]["1gbps"]
    for key in ("ideal_step_s", "full_step_s", "deltarl_step_s", "full_ratio", "deltarl_ratio"):
        assert isinstance(rate[key], float), key
        assert rate[key] > 0, key
    assert set(rate["modes"]) == {"ideal", "full", "deltarl"}
    for mode in ("full", "deltarl"):
        r = rate["modes"][mode]
        assert r["exact"] is True, mode
        assert r["exact_per_actor"] == {"region-1": True, "region-2": True}, mode
        assert r["actor_digests"] == [r["digest"]] * doc["regions"], mode
        assert r["actor_versions"] == {"region-1": r["steps"], "region-2": r["steps"]}, mode
        assert {"trainer_publish", "actor:region-1", "origin_relay", "relay:region-1", "links"} <= set(r["cpu_s_per_version"])
        assert {"trainer", "actor:region-1", "relay:region-2"} <= set(r["peak_rss_copies"])
        assert all(b > 0 for b in r["link_bytes_per_step"].values())
    full, delta = rate["modes"]["full"], rate["modes"]["deltarl"]
    for region, nbytes in delta["link_bytes_per_step"].items():
        assert nbytes < full["link_bytes_per_step"][region], region
    assert doc["tokens_per_dollar"]["rates"]["1gbps"]["rdma_ideal"] > 0


@pytest.mark.timeout(60)
def test_e2e_full_size_tiny_events(tmp_path: Path) -> None:
    doc = _run(tmp_path, "events")
    ev = doc["events"]
    assert ev["run"]["exact"] is True
    joiner = ev["late_joiner"]
    assert joiner["bootstrapped_version"] >= 1
    assert joiner["keyframe_bytes"] > 0
    assert joiner["bytes_by_source"]
    lost = ev["relay_lost"]
    assert lost["failovers"] >= 1
    assert lost["windows_with_a_stale_policy"] == []
    assert lost["final_version"] == ev["run"]["steps"]
    assert ev["scheduler"]["slow"]["makespan_ratio"] < 1.1
