"""gc finds what publishers killed mid-write left in the store (local temp files, S3 multipart
uploads and their parts), says when a live-looking writer's lease expires, and once it has expired
sweeps them and reports the bytes. Each writer is a real publisher process on a real store (a local
folder, SeaweedFS), SIGKILLed while a keyframe part it streams is open."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltarl.cli import main
from deltarl.pipeline import RunLayout
from deltarl.pipeline.gc import gc
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.replay import replay
from deltarl.storage import LocalStore
from deltarl.storage.local import TMP_DIR
from tests.fixtures.runs import states_equal

pytestmark = [pytest.mark.torch, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
LAY = RunLayout("r")
MIB = 1 << 20
#: A publisher ("trainer-1") that commits the next version, then dies while streaming a keyframe
#: part of the one after it: it says "ready" once the store holds <MiB> MiB of it, and hangs.
PUBLISHER = """
import sys, time
from deltarl import Publisher, open_store
from deltarl.pipeline import RunLayout
from tests.fixtures.runs import TinyTrainer
url, lease_s, mib = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
store = open_store(url, **({"part_size": 5 << 20, "multipart_threshold": 5 << 20} if url.startswith("s3://") else {}))
pub = Publisher(store, "r", writer_id="trainer-1", lease_s=lease_s, keyframe_interval=2)
trainer = TinyTrainer(0)
for _ in range(pub.next_version):
    trainer.step()
pub.publish(trainer.export(), step=pub.next_version)
full = (mib << 20) // (5 << 20) * (5 << 20)  # the bytes of the full S3 parts

def part():
    yield b"x" * (mib << 20)
    yield b"y"
    while url.startswith("s3://") and sum(w.size for w in store.pending_writes("r/")) < full * (1 + int(sys.argv[4])):
        time.sleep(0.05)  # until every full part has landed (a local temp file holds the bytes already)
    print("ready", flush=True)
    time.sleep(3600)
    yield b""

store.put_stream_if_absent(RunLayout("r").keyframe_part(pub.next_version + 1, 0, epoch=1), part())
"""


def _kill_publisher_mid_write(url: str, lease_s: float, mib: int, earlier: int, env: dict[str, str] | None = None) -> None:
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, url, str(lease_s), str(mib), str(earlier)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**(env or os.environ), "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == b"ready", (line, proc.stderr.read()[-3000:] if proc.stderr else b"")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _temp_files(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root / TMP_DIR) if n.endswith(".tmp"))


def _resumes(store) -> None:
    with Publisher(store, "r", writer_id="trainer-2", keyframe_interval=2) as pub:
        state = {n: t.clone() for n, t in replay(store, "r").items()}
        state["embed.weight"][0, 0] += 1
        assert pub.publish(state, step=99).version == pub.next_version - 1
    assert states_equal(replay(store, "r"), state)


def test_gc_leaves_a_live_writers_unfinished_write_and_says_when_its_lease_expires(tmp_path: Path, capsys) -> None:
    root = tmp_path / "s"
    _kill_publisher_mid_write(str(root), 300, 3, 0)
    store = LocalStore(root)
    report = gc(store, "r")
    assert [(w.key, w.size) for w in report.pending_left] == [("r/…", 3 * MIB + 1)]
    assert report.pending == []
    assert report.live_writer is not None
    assert report.live_writer.writer_id == "trainer-1"
    assert main(["gc", "r", "--store", str(root)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"holds the run until its lease expires at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(in [45] min \d+ s\)", out), out
    assert "3.0 MiB" in out
    assert len(_temp_files(root)) == 1


def test_gc_sweeps_what_killed_local_publishers_left_and_reports_the_bytes(tmp_path: Path, capsys) -> None:
    root = tmp_path / "s"
    for earlier in range(3):
        _kill_publisher_mid_write(str(root), 1, 2, earlier)
    assert len(_temp_files(root)) == 3
    time.sleep(1.2)  # the last lease has expired
    for name in _temp_files(root):  # killed more than PENDING_GRACE_S ago
        os.utime(root / TMP_DIR / name, (time.time() - 120, time.time() - 120))
    assert main(["gc", "r", "--store", str(root), "--dry-run"]) == 0
    assert "would remove 3 unfinished writes of dead writers (6.0 MiB" in capsys.readouterr().out
    assert len(_temp_files(root)) == 3
    assert main(["gc", "r", "--store", str(root)]) == 0
    out = capsys.readouterr().out
    assert "removed 3 unfinished writes of dead writers (6.0 MiB" in out
    assert re.search(r"^removed 6\.0 MiB$", out, re.M), out
    assert _temp_files(root) == []
    _resumes(LocalStore(root))


@pytest.mark.s3
def test_gc_aborts_the_uploads_killed_publishers_left_on_s3(seaweed_s3) -> None:
    for earlier in range(2):
        _kill_publisher_mid_write(seaweed_s3.url, 1, 11, earlier, env=seaweed_s3.env)
    store = seaweed_s3.open()
    assert sum(w.size for w in store.pending_writes("r/")) == 20 * MIB
    time.sleep(1.2)
    dry = gc(store, "r", dry_run=True, pending_grace_s=0)
    assert sum(w.size for w in dry.pending) == 20 * MIB
    assert len(list(store.pending_writes("r/"))) == 2
    report = gc(store, "r", pending_grace_s=0)
    assert [w.size for w in report.pending] == [10 * MIB, 10 * MIB]
    assert report.freed_bytes >= 20 * MIB
    assert list(store.pending_writes("r/")) == []
    _resumes(store)
    store.close()
