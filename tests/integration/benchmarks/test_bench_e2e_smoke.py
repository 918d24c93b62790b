"""``python -m benchmarks.e2e --quick`` runs end to end: three modes per link rate, the JSON has the
documented keys, and the deltarl and full-broadcast actors end with the trainer's exact bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(180)
def test_e2e_quick(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "e2e"
    assert doc["quick"] is True
    assert doc["scale"]["S"] > 1
    assert doc["scale"]["T"] >= 1
    assert set(doc["rates"]) == {"1gbps", "0.25gbps"}
    for rate in doc["rates"].values():
        for key in ("ideal_step_s", "full_step_s", "deltarl_step_s", "ideal_ratio", "full_ratio", "deltarl_ratio"):
            assert isinstance(rate[key], float), key
            assert rate[key] > 0, key
        assert rate["ideal_ratio"] == pytest.approx(1.0)
        assert set(rate["modes"]) == {"ideal", "full", "deltarl"}
        delta, full = rate["modes"]["deltarl"], rate["modes"]["full"]
        # exact bytes: every actor's final state digest equals the trainer's
        assert delta["exact"] is True
        assert full["exact"] is True
        assert delta["actor_digests"] == [delta["digest"]] * doc["regions"]
        # a delta moves far fewer bytes over each WAN link than the full weights
        for region, nbytes in delta["link_bytes_per_step"].items():
            assert 0 < nbytes < full["link_bytes_per_step"][region] / 5
        for mode in rate["modes"].values():
            assert 0.0 <= mode["idle_fraction"] < 1.0
            assert mode["step_s"] > 0
    assert "deltarl" in proc.stdout
    assert "x ideal" in proc.stdout


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_e2e_quick_netns(tmp_path: Path) -> None:
    """The same run with kernel (tbf) rate limits in a network namespace; needs root."""
    from benchmarks._e2e import netns

    if not netns.available():
        pytest.skip("needs root and the ip and tc commands")
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e", "--quick", "--netns", "--rates", "1", "--modes", "ideal,deltarl",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["emulation"].startswith("tbf")
    delta = doc["rates"]["1gbps"]["modes"]["deltarl"]
    assert delta["exact"] is True
    assert all(n > 0 for n in delta["link_bytes_per_step"].values())
