"""``deltarl demo --steps 2`` as a user runs it: every process starts, every check passes, nothing is left running."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

pytestmark = [pytest.mark.slow, pytest.mark.torch]


def test_demo_two_steps(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    sinks = ["--tensorboard", str(tmp_path / "tb")]
    if importlib.util.find_spec("wandb") is not None:
        sinks += ["--wandb", "deltarl-demo", "--wandb-mode", "offline"]
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "demo", "--steps", "2", "--actors", "2", "--prompts", "8", "--group-size", "4",
         "--run", "smoke", "--no-live", *sinks],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "step   2  version   2" in out
    assert "equals the trainer's export bit for bit: OK" in out
    assert "every actor holds the trainer's final weights: OK" in out
    assert "deltarl audit smoke" in out
    report = tmp_path / "deltarl-runs" / "_reports" / "smoke"
    assert (report / "report.png").stat().st_size > 10_000
    summary = json.loads((report / "summary.json").read_text())
    assert summary["ok"]
    assert summary["replay_ok"]
    assert summary["audit_ok"]
    assert sum(summary["prompts"].values()) == 2 * 8
    assert (tmp_path / "deltarl-runs" / "smoke" / "run.json").exists()
    # the run folder works with the printed commands
    inspect = subprocess.run([sys.executable, "-m", "deltarl.cli", "inspect", "smoke"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60, check=False)
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    # every child process is gone: each actor wrote its state file on a clean exit
    for name in ("actor-1", "actor-2"):
        assert json.loads((report / f"{name}.state.json").read_text())["version"] == 2
    # the metric sinks saw both steps
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("train/reward_mean")] == [1, 2]
        assert [e.value for e in acc.Scalars("publish/version")] == [1.0, 2.0]
    if "--wandb" in sinks:
        assert len(list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
