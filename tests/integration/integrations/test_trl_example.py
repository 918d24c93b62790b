"""``examples/trl_grpo.py``, the TRL integration as docs/integrations.md shows it, runs as written:
a tiny Qwen3 from a config and an offline tokenizer (nothing downloaded), every optimizer step a
version that replays bit for bit."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("torch")

from deltarl.model.record import read_model_json
from deltarl.model.tokenizer import TokenizerSpec
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay
from deltarl.storage import LocalStore

pytestmark = [pytest.mark.slow, pytest.mark.torch]
REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "trl_grpo.py"


def test_the_trl_example_runs_and_every_step_replays(tmp_path: Path) -> None:
    store_dir = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--store", str(store_dir), "--run", "ex", "--steps", "2",
                           "--metrics-port", "0"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ex version")]
    assert [line.split()[2] for line in lines] == ["0", "1", "2"]
    store = LocalStore(store_dir)
    reader = RunReader(store, "ex")
    assert reader.head().version == 2
    states = [replay(store, "ex", version, verify=True) for version in range(3)]
    import torch

    for old, new in itertools.pairwise(states):  # the sparse regime: a small share of elements changes per version
        changed = sum(int((old[k].view(-1).view(torch.int16) != t.view(-1).view(torch.int16)).sum()) for k, t in new.items())
        assert 0 < changed < 0.2 * sum(t.numel() for t in new.values())
    assert read_model_json(store, "ex").tokenizer == TokenizerSpec(kind="byte")


def test_the_docs_point_at_the_example() -> None:
    text = (REPO / "docs" / "integrations.md").read_text()
    assert "examples/trl_grpo.py" in text
