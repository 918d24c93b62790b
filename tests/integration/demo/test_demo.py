"""``deltarl demo`` as a user runs it (small configurations): every process starts, every check passes, nothing is
left running; ``--model`` trains a local checkpoint, and a missing one is a one-line error."""

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
    assert "warm-up took" in out
    assert "aurora (LEB128) would ship" in out
    assert "estimate for an 8B model over a 1 Gbit/s link" in out
    report = tmp_path / "deltarl-runs" / "_reports" / "smoke"
    assert (report / "report.png").stat().st_size > 10_000
    summary = json.loads((report / "summary.json").read_text())
    assert summary["ok"]
    assert summary["replay_ok"]
    assert summary["audit_ok"]
    assert sum(summary["prompts"].values()) == 2 * 8
    assert len(summary["aurora_bytes"]) == 2
    assert all(a > d for a, d in zip(summary["aurora_bytes"], summary["delta_bytes"], strict=True))
    assert summary["warmup_steps"] > 0
    assert summary["estimate_8b"]["full_s"] == 128
    assert list((tmp_path / "deltarl-runs" / "_cache").glob("warmup-*.pt"))
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


def _demo(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "deltarl.cli", "demo", "--no-live", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240, check=False)


def test_demo_missing_checkpoint_is_one_line(tmp_path: Path) -> None:
    proc = _demo(tmp_path, "--model", str(tmp_path / "nowhere"))
    assert proc.returncode == 2
    assert proc.stdout.strip().count("\n") == 0, proc.stdout + proc.stderr
    assert "no checkpoint directory at" in proc.stdout
    assert not (tmp_path / "deltarl-runs").exists()


def test_demo_on_a_local_checkpoint(tmp_path: Path, hf_checkpoint: Path) -> None:
    proc = _demo(tmp_path, "--model", str(hf_checkpoint), "--steps", "1", "--actors", "1", "--prompts", "4",
                 "--group-size", "2", "--lr", "1e-4", "--warmup-steps", "1", "--run", "ckpt")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "ckpt on addition, GRPO lr 0.0001" in out
    summary = json.loads((tmp_path / "deltarl-runs" / "_reports" / "ckpt" / "summary.json").read_text())
    assert summary["ok"]
    assert summary["replay_ok"]
    assert summary["audit_ok"]
    assert all(summary["actors_ok"].values())
    assert summary["model"] == str(hf_checkpoint.resolve())
    assert summary["grpo_lr"] == 1e-4
    assert summary["warmup_steps"] == 1
