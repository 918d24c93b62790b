"""Every benchmark's ``--quick`` mode runs end to end and writes its JSON where asked, so none can
rot unnoticed (``tests/unit/benchmarks/test_every_benchmark_has_a_quick_test.py`` keeps the list
complete; codec, e2e and vllm_update have their own quick tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[3]


def _run(argv: list[str], tmp_path: Path, timeout: float = 280) -> tuple[str, dict[str, Any] | None]:
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
           "DELTARL_SCRATCH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", *argv, "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text()) if out.exists() else None


def _scheduler(doc: dict[str, Any]) -> None:
    assert doc["makespan"][0]["ratio_mean"] >= 1.0
    assert doc["throughput"]["admitted_per_s"] > 0


def _publish(doc: dict[str, Any]) -> None:
    assert [r["target"] for r in doc["runs"][0]["results"]] == ["local", "link"]
    assert doc["runs"][0]["size"] == "small"


def _transfer(doc: dict[str, Any]) -> None:
    assert doc["streams"]["rows"]
    assert all(r["all_exact"] for r in doc["faults"])


def _pause(doc: dict[str, Any]) -> None:
    assert doc["commit"]
    assert doc["publish"]


def _idle_polling(doc: dict[str, Any]) -> None:
    assert {r["server"] for r in doc["rows"]} >= {"relay", "plain"}
    assert all(len(r["pickups_s"]) == 2 for r in doc["rows"])


def _scale(doc: dict[str, Any]) -> None:
    assert doc["model"] == "tiny"
    assert doc["phases"]
    assert not {name: res["error"] for name, res in doc["phases"].items() if "error" in res}


def _sharded(doc: dict[str, Any]) -> None:
    assert doc["model"] == "tiny"
    assert set(doc["results"]) == {"1", "2"}
    assert all(r["bytes_per_version"] > 0 for r in doc["results"].values())  # the targets are for full sizes


def _sharded_fp8(doc: dict[str, Any]) -> None:
    _sharded(doc)
    assert doc["serve_as"] == "fp8-block128"
    assert doc["collective_bytes_per_version"]["2"] > 4 * 2 * 4  # the header and a block per quantized weight at least


def _trl_callback(doc: dict[str, Any]) -> None:
    assert doc["callback"]["publish_s"] > 0
    assert doc["in_step"]["publish_s"] > 0


QUICK: dict[str, tuple[list[str], Callable[[dict[str, Any]], None]]] = {
    "scheduler": (["benchmarks.scheduler", "--quick"], _scheduler),
    "publish": (["benchmarks.publish", "--quick", "--targets", "local,link"], _publish),
    "transfer": (["benchmarks.transfer", "--quick"], _transfer),
    "pause": (["benchmarks.pause", "--quick"], _pause),
    "idle_polling": (["benchmarks.idle_polling", "--quick"], _idle_polling),
    "scale": (["benchmarks.scale", "--quick"], _scale),
    "sharded": (["benchmarks.sharded", "--quick"], _sharded),
    "sharded_fp8": (["benchmarks.sharded", "--quick", "--serve-as", "fp8-block128"], _sharded_fp8),
    "trl_callback": (["benchmarks.trl_callback", "--quick"], _trl_callback),
}


@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick(name: str, tmp_path: Path) -> None:
    argv, check = QUICK[name]
    _, doc = _run(argv, tmp_path)
    assert doc is not None
    assert doc["quick"] is True
    check(doc)


def test_gpu_quick_skips_cleanly_without_cuda_and_runs_its_torch_path_on_cpu(tmp_path: Path) -> None:
    import torch

    stdout, doc = _run(["benchmarks.gpu", "--quick"], tmp_path)
    if not torch.cuda.is_available():
        assert doc is None
        assert stdout.startswith("skipped: no CUDA"), stdout
    stdout, doc = _run(["benchmarks.gpu", "--quick", "--allow-cpu"], tmp_path)
    assert doc is not None
    assert doc["quick"] is True
    assert doc["hf"]["bit_exact"] is True
    assert [r["case"] for r in doc["states"]] == ["dense", "moe", "dense-fp8"]  # staging and commit: both shapes, and FP8
    assert stdout.count("bit-exact") >= 2
