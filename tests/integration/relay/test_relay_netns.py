"""The root-only recipe (infra/netns-regions.sh): a relay in the origin namespace serves a region
across a tbf-shaped veth link. Skipped without root or ``ip netns``."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltarl.storage import LocalStore

pytestmark = pytest.mark.netns

SCRIPT = Path(__file__).resolve().parents[3] / "infra" / "netns-regions.sh"


@pytest.fixture
def regions() -> Iterator[str]:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root, ip and tc")
    prefix = f"dt{os.getpid() % 100000}"
    env = {**os.environ, "PREFIX": prefix}
    up = subprocess.run([str(SCRIPT), "up", "40mbit"], env=env, capture_output=True, text=True)
    if up.returncode != 0:
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True)
        pytest.skip(f"network namespaces unavailable: {up.stderr.strip()[:200]}")
    try:
        yield prefix
    finally:
        subprocess.run([str(SCRIPT), "down"], env=env, check=True)


FETCH = """
import hashlib, sys, time
from deltarl.storage.http import HTTPStore
s = HTTPStore(sys.argv[1])
t0 = time.monotonic(); data = s.get(sys.argv[2]); dt = time.monotonic() - t0
print(hashlib.sha256(data).hexdigest(), len(data) * 8 / dt)
"""


def test_relay_across_a_shaped_region_link(regions: str, tmp_path: Path) -> None:
    data = os.urandom(4 << 20)
    key = "r/blobs/payload.bin"  # not a segment: a relay serves a segment only once a manifest names it
    LocalStore(str(tmp_path / "store")).put(key, data)
    relay = subprocess.Popen(
        ["ip", "netns", "exec", f"{regions}-origin", sys.executable, "-m", "deltarl.cli", "relay", "--upstream",
         str(tmp_path / "store"), "--listen", "10.77.1.1:0", "--cache-dir", str(tmp_path / "cache")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert relay.stdout is not None
        m = re.search(r"on (http://\S+)", relay.stdout.readline())
        assert m
        out = subprocess.run(["ip", "netns", "exec", f"{regions}-east", sys.executable, "-c", FETCH, m.group(1), key],
                             capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
        digest, rate = out.stdout.split()
        assert digest == hashlib.sha256(data).hexdigest()
        assert float(rate) < 45e6  # tbf holds the region link to 40 Mbit/s
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=20)
        if relay.stdout is not None:
            relay.stdout.close()
