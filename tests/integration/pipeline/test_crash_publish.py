"""Kill a publishing process (SIGKILL) at several points: no half version is ever visible, a new
publisher resumes, and gc removes what the dead one left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deltarl.errors import WriterConflict
from deltarl.pipeline import RunLayout
from deltarl.pipeline.gc import gc
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay
from deltarl.storage import LocalStore
from deltarl.testing.faults import CRASH_ENV
from tests.fixtures.runs import TinyTrainer, states_equal

pytestmark = [pytest.mark.torch, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
LAY = RunLayout("r")
SHAPES = {"w": ((256, 512), "bfloat16"), "b": ((512,), "float32")}
KW = {"keyframe_interval": 3, "digest_interval": 2, "segment_bytes": 4096, "upload_workers": 2}
SCRIPT = """
import sys
from deltarl.storage import LocalStore
from deltarl.testing.faults import CRASH_ENV, CrashAt
from deltarl import Publisher
from deltarl.testing.faults import CrashAt
from tests.fixtures.runs import TinyTrainer
from tests.integration.pipeline.test_crash_publish import KW, SHAPES
trainer = TinyTrainer(0, lr=0.05, shapes=SHAPES)
with Publisher(LocalStore(sys.argv[1]), "r", writer_id="trainer-1", on_progress=CrashAt.from_env(), **KW) as pub:
    for step in range(int(sys.argv[2])):
        if step:
            trainer.step()
        pub.publish(trainer.export(), step=step)
"""


def _exports(n):
    trainer = TinyTrainer(0, lr=0.05, shapes=SHAPES)
    out = []
    for step in range(n):
        if step:
            trainer.step()
        out.append(trainer.export())
    return out


def _run_publisher(root: Path, versions: int, crash_at: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), **{CRASH_ENV: crash_at})
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), str(versions)], env=env, cwd=REPO, capture_output=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def _assert_only_complete_versions(store) -> int | None:
    """Every committed manifest names only present, intact objects; return the last committed."""
    reader = RunReader(store, "r")
    committed = [v for v in range(10) if reader.has_manifest(v)]
    assert committed == list(range(len(committed)))  # no gaps
    for v in committed:
        manifest, _ = reader.manifest(v)
        for i in range(len(manifest.segments)):
            reader.segment(manifest, i)
        if manifest.keyframe is not None:
            reader.keyframe(manifest)
    return committed[-1] if committed else None


@pytest.mark.parametrize(
    ("crash_at", "head", "committed", "orphans"),
    [
        ("2:segments:2", 1, 1, True),  # mid-delta: 2 segment uploads done, more to come
        ("3:keyframe", 2, 2, True),  # keyframe version: objects durable, no manifest
        ("2:manifest", 1, 2, False),  # manifest committed, HEAD not moved
        ("0:keyframe", None, None, True),  # the very first version
    ],
)
def test_crash_then_resume(tmp_path, crash_at, head, committed, orphans):
    root = tmp_path / "store"
    _run_publisher(root, 5, crash_at)
    store = LocalStore(root)
    exports = _exports(6)
    reader = RunReader(store, "r")
    if head is None:
        assert not store.exists(LAY.head)
    else:
        assert reader.head().version == head
        assert states_equal(replay(store, "r"), exports[head])
    assert _assert_only_complete_versions(store) == committed
    if committed is not None:
        assert states_equal(replay(store, "r", committed), exports[committed])

    live = gc(store, "r")  # the dead writer's lease is still live: its objects count as in flight
    assert live.orphans == []
    assert bool(live.in_flight) == orphans
    swept = gc(store, "r", force=True)
    assert bool(swept.orphans) == orphans
    nxt = 0 if committed is None else committed + 1
    assert list(store.list(LAY.version_prefix(nxt))) == []
    assert list(store.list(LAY.keyframe_prefix(nxt))) == []

    with Publisher(store, "r", writer_id="trainer-1", **KW) as pub:  # resumes (rolls HEAD forward)
        assert pub.next_version == nxt
        for v in range(nxt, 6):
            pub.publish(exports[v], step=v)
    for v in range(6):
        assert states_equal(replay(store, "r", v), exports[v]), v


def test_resume_without_gc_removes_orphans_itself(tmp_path):
    root = tmp_path / "store"
    _run_publisher(root, 5, "2:segments:3")
    store = LocalStore(root)
    assert list(store.list(LAY.version_prefix(2)))
    with pytest.raises(WriterConflict, match="already has a publisher"):
        Publisher(store, "r", writer_id="someone-else", **KW)
    exports = _exports(4)
    with Publisher(store, "r", writer_id="trainer-1", **KW) as pub:
        pub.publish(exports[2], step=2)
        pub.publish(exports[3], step=3)
    assert states_equal(replay(store, "r"), exports[3])
    assert gc(store, "r").orphans == []
