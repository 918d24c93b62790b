"""``deltarl relay`` as a process: starts on port 0, serves a local store, stops on SIGTERM."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import urllib3

from deltarl.storage import LocalStore


def test_relay_command_serves_a_local_store(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path / "store"))
    store.put("r/versions/000000000001/seg-00000.bin", b"segment bytes")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltarl.cli", "relay", "--upstream", str(tmp_path / "store"), "--listen", "127.0.0.1:0",
         "--cache-dir", str(tmp_path / "cache"), "--cache-bytes", "64M"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"on (http://\S+)", line)
        assert m, line
        http = urllib3.PoolManager()
        resp = http.request("GET", f"{m.group(1)}/r/versions/000000000001/seg-00000.bin?unverified=1", headers={"Range": "bytes=0-6"})
        assert (resp.status, resp.data) == (206, b"segment")
        assert http.request("PUT", f"{m.group(1)}/r/x", body=b"x").status == 403  # no token: no pushes
        http.clear()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        if proc.stdout is not None:
            proc.stdout.close()
