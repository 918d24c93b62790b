"""A store on a read-only mount can be read: opening it writes nothing, every read works, and the
read-only commands (inspect, replay, audit, a relay in front of it) serve it. Writes fail as one
``StoreError`` naming the store.

The mount is a real read-only bind mount (``mount --bind`` then ``remount,bind,ro``); the test is
skipped where mounting is not permitted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from deltarl.cli import main
from deltarl.errors import StoreError
from deltarl.pipeline import RunLayout
from deltarl.pipeline.replay import replay
from deltarl.storage import LocalStore
from deltarl.storage.local import TMP_DIR
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch
LAY = RunLayout("r")


@pytest.fixture
def ro_store(tmp_path: Path) -> Iterator[tuple[Path, list[dict]]]:
    """A published run (3 versions) behind a read-only bind mount, with a crashed writer's old temp file."""
    src, mnt = tmp_path / "src", tmp_path / "ro"
    exports = publish_run(LocalStore(src), "r", 3)
    stale = src / TMP_DIR / "r~0123.tmp"
    stale.write_bytes(b"left by a crashed writer")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))  # old enough for the open-time sweep
    mnt.mkdir()
    try:
        subprocess.run(["mount", "--bind", str(src), str(mnt)], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"cannot bind-mount here: {err}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], check=True, capture_output=True, timeout=10)
        with pytest.raises(OSError, match="Read-only file system"):
            (mnt / "probe").write_bytes(b"")
        yield mnt, exports
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=10)
    assert stale.exists()  # nothing was swept through the read-only mount


def test_a_read_only_store_opens_and_reads(ro_store) -> None:
    root, exports = ro_store
    store = LocalStore(root)
    assert store.get(LAY.head)
    assert store.head(LAY.run_json).size > 0
    assert LAY.manifest(2) in list(store.list("r/"))
    assert states_equal(replay(store, "r"), exports[2])
    for write in (lambda: store.put("r/x", b"x"), lambda: store.put_if_absent("r/x", b"x"),
                  lambda: store.delete(LAY.head), lambda: store.cas(LAY.head, b"x", None)):
        with pytest.raises(StoreError, match="Read-only file system"):
            write()


def test_read_only_commands_work_on_a_read_only_store(ro_store, tmp_path: Path, capsys) -> None:
    root, _ = ro_store
    assert main(["inspect", "r", "--store", str(root)]) == 0
    assert main(["replay", "r", "--store", str(root), "--out", str(tmp_path / "w.safetensors"), "--no-progress"]) == 0
    assert main(["audit", "r", "--store", str(root)]) == 0  # no rollouts: nothing failed
    assert main(["gc", "r", "--store", str(root), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "cannot create" not in err
    assert "Read-only" not in err


def test_a_relay_serves_a_read_only_store(ro_store, tmp_path: Path) -> None:
    root, _ = ro_store
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltarl.cli", "relay", "--upstream", str(root), "--listen", "127.0.0.1:0",
         "--cache-dir", str(tmp_path / "cache")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"on (http://\S+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        http = urllib3.PoolManager()
        resp = http.request("GET", f"{m.group(1)}/{LAY.run_json}")
        assert resp.status == 200
        assert resp.data == (root / LAY.run_json).read_bytes()
        http.clear()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
