"""The coordinator writes a run's results, and may start before the trainer creates the run: a
missing local store folder is created (a writer's local store), a missing bucket never is."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.fixtures.servers import S3Server

ARGS = ["--run", "r", "--token", "t", "--listen", "127.0.0.1:0"]


def _start(store: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child holds its own descriptor
        return subprocess.Popen([sys.executable, "-m", "deltarl.cli", "coordinator", "--store", store, *ARGS],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_listening(proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
        if m:
            return m.group(1)
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    raise AssertionError(f"coordinator did not start: {log.read_text()}")


def test_a_missing_local_store_folder_is_created(tmp_path: Path) -> None:
    store = tmp_path / "new" / "store"
    log = tmp_path / "coordinator.log"
    proc = _start(str(store), log)
    try:
        _wait_listening(proc, log)
        assert store.is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()


def test_a_missing_bucket_is_an_error_and_is_not_created(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = "never-made-by-the-coordinator"
    log = tmp_path / "coordinator.log"
    proc = _start(f"s3://{bucket}/runs", log, env={**os.environ, "DELTARL_S3_ENDPOINT": moto_server.endpoint_url})
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert code != 0
    assert "Traceback" not in out
    assert len(out.strip().splitlines()) == 1, out
    assert f"bucket {bucket!r} does not exist" in out
    buckets = moto_server.session.client("s3", endpoint_url=moto_server.endpoint_url).list_buckets()["Buckets"]
    assert bucket not in {b["Name"] for b in buckets}
