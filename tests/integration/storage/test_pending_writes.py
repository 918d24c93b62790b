"""What a writer killed mid-write leaves in a store (a local temp file, an S3 multipart upload with
its parts) is listed by ``pending_writes`` with its bytes, and ``abort_pending`` removes it. The
writer is a real process streaming an object into a real store (a local folder, SeaweedFS), killed
with SIGKILL while its write is open."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deltarl.storage import LocalStore
from deltarl.storage.local import TMP_DIR

REPO = Path(__file__).resolve().parents[3]
MIB = 1 << 20
#: A writer that streams ``<MiB>`` MiB of a key, says "ready" once the store holds them, then hangs.
WRITER = """
import sys, time
from deltarl import open_store
url, key, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
opts = {"part_size": 5 << 20, "multipart_threshold": 5 << 20} if url.startswith("s3://") else {}
store = open_store(url, **opts)

def chunks():
    yield b"x" * (mib << 20)
    yield b"y"  # the store takes the first chunk in (a part upload starts on S3) before asking for this one
    while url.startswith("s3://") and sum(w.size for w in store.pending_writes("r/")) < (mib << 20) // (5 << 20) * (5 << 20):
        time.sleep(0.05)  # until every full part has landed (a local temp file holds the bytes already)
    print("ready", flush=True)
    time.sleep(3600)
    yield b""

store.put_stream_if_absent(key, chunks())
"""


def kill_mid_write(url: str, key: str, mib: int, env: dict[str, str] | None = None) -> None:
    """Run a writer of ``key`` in a child process and SIGKILL it while its write is open."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url, key, str(mib)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**(env or os.environ), "PYTHONPATH": str(REPO)}, cwd=REPO)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == b"ready", (line, proc.stderr.read() if proc.stderr else b"")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_a_killed_local_writer_leaves_a_temp_file_that_pending_writes_finds(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.put("other/x", b"a live run's object")
    kill_mid_write(str(tmp_path / "s"), "r/keyframes/000000000002/e000001-part-r000-000.safetensors", 3)
    pending = list(store.pending_writes("r/"))
    assert [(w.key, w.size) for w in pending] == [("r/…", 3 * MIB + 1)]
    assert list(store.pending_writes("other/")) == []
    assert list(store.pending_writes("r/keyframes/")) == pending  # the local store knows the run only
    assert list(store.pending_writes("")) == pending
    store.abort_pending(pending[0])
    store.abort_pending(pending[0])  # already gone: no error
    assert list(store.pending_writes("r/")) == []
    assert os.listdir(tmp_path / "s" / TMP_DIR) == ["locks"]
    assert list(store.list()) == ["other/x"]


@pytest.mark.s3
def test_a_killed_s3_writer_leaves_an_upload_that_pending_writes_finds(seaweed_s3) -> None:
    store = seaweed_s3.open()
    key = "r/keyframes/000000000002/e000001-part-r000-000.safetensors"
    kill_mid_write(seaweed_s3.url, key, 11, env=seaweed_s3.env)  # two 5 MiB parts landed, a third being filled
    pending = list(store.pending_writes("r/"))
    assert [(w.key, w.size) for w in pending] == [(key, 10 * MIB)]
    assert list(store.pending_writes("other/")) == []
    assert list(store.list("r/")) == []  # never visible as an object
    store.abort_pending(pending[0])
    store.abort_pending(pending[0])  # already gone: no error
    assert list(store.pending_writes("r/")) == []
    store.close()
