"""``deltarl demo --backend vllm`` with no --model: it writes a tiny servable checkpoint itself and runs the
whole loop on vLLM actors (vLLM's CPU build), every actor ending on the trainer's bits."""

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
