"""``deltarl demo --backend vllm`` with no --model: it writes a tiny servable checkpoint itself and runs the
whole loop on vLLM actors (vLLM's CPU build), every actor ending on the trainer's bits. The actor is a
``deltarl actor`` process with ``backend: vllm``: its events show the bootstrap through the deltarl engine,
vLLM's admitted rollouts, a commit per version and the bytes vLLM's workers fetched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(600)]


def test_demo_on_vllm_builds_its_own_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "demo", "--backend", "vllm", "--steps", "2", "--actors", "1",
         "--prompts", "8", "--group-size", "4", "--run", "v", "--no-live"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "every actor holds the trainer's final weights: OK" in out
    assert (tmp_path / "deltarl-runs" / "_cache" / "vllm-tiny-qwen3" / "config.json").exists()
    report = tmp_path / "deltarl-runs" / "_reports" / "v"
    assert json.loads((report / "summary.json").read_text())["ok"]
    assert json.loads((report / "actor-1.state.json").read_text())["version"] == 2
    evs = [json.loads(line) for line in (report / "actor-1.events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in evs][:2] == ["bootstrap", "registered"]
    assert [e["version"] for e in evs if e["event"] == "commit"] == [1, 2]
    assert any(e["event"] == "result" and e.get("admitted") for e in evs)  # vLLM generated admitted rollouts
    assert evs[-1]["event"] == "exit"  # a clean stop
    # the weights are fetched in vLLM's workers; their bytes reach the actor's events
    checkpoint = tmp_path / "deltarl-runs" / "_cache" / "vllm-tiny-qwen3" / "model.safetensors"
    boot = next(e for e in evs if e["event"] == "bootstrap")
    assert sum(boot["fetch"]["bytes_by_source"].values()) > checkpoint.stat().st_size // 4  # a keyframe: > 1/4 of BF16
