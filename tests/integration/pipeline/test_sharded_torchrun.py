"""Sharded publishing launched the way users launch it: torchrun, 3 FSDP2 ranks on gloo, each
version published in the background while the next step trains; every version replays bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
STEPS = 4


def test_torchrun_three_ranks_publish_in_the_background_and_replay_bit_exact(tmp_path: Path) -> None:
    from deltarl.pipeline.reader import RunReader
    from deltarl.pipeline.replay import replay
    from deltarl.storage import LocalStore

    script = Path(__file__).with_name("torchrun_publish.py")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                           str(script), str(tmp_path), str(STEPS)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    for err in sorted(tmp_path.glob("error-*.txt")):
        pytest.fail(err.read_text())
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = LocalStore(tmp_path / "store")
    reader = RunReader(store, "r")
    assert reader.head().version == STEPS - 1
    for version in range(STEPS):
        manifest, _ = reader.manifest(version)
        if manifest.keyframe is not None:
            assert len(manifest.keyframe.parts) == 3  # one part per rank
        else:
            assert {ref.key.split("-r")[1][:3] for ref in manifest.segments} == {"000", "001", "002"}
        want = torch.load(tmp_path / f"full-{version}.pt")
        got = replay(store, "r", version, verify=True)
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), (version, name)
