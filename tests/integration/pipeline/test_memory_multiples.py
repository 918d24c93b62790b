"""Whole-model paths hold one copy of the model: keyframe publish, replay and bootstrap, each in a
subprocess that reads its own peak RSS (VmHWM) at a ~256 MB state, bit-exact.

Memory is not noisy the way time is: the peak counts the state once (the caller's state, or the
fresh state built), plus chunk-sized buffers. The interpreter's own RSS, measured before the state
is allocated, is subtracted. Linux only (``/proc/self/status``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")]

LIMIT = 1.3  # copies of one BF16 state

_COMMON = '''
import asyncio, json, sys
import torch
from deltarl.pipeline.tensors import state_digest

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def state(version):
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(16):  # 16 x 8M elements = 256 MB of BF16, in tensors of 16 MB
        t = torch.empty((2048, 4096), dtype=torch.bfloat16)
        t.view(torch.int16).random_(0, 1 << 14, generator=g)
        if version:
            t.view(torch.int16)[::97] += version  # ~1% of elements moved
        out[f"layer.{i:02d}.weight"] = t
    return out

COPY = 16 * 2048 * 4096 * 2
root, mode = sys.argv[1], sys.argv[2]
'''

_PHASES = {
    "publish": '''
from deltarl.pipeline.publisher import Publisher
from deltarl.storage import LocalStore
base = rss("VmRSS")
s = state(0)
want = state_digest(s)
with Publisher(LocalStore(root), "m", keyframe_interval=2, digest_interval=1, keyframe_part_bytes=64 << 20) as pub:
    pub.publish(s, step=0, owned=True)
peak = rss("VmHWM")
print(json.dumps({"copies": (peak - base) / COPY, "digest": want}))
''',
    "replay": '''
from deltarl.pipeline.replay import replay
from deltarl.storage import LocalStore
base = rss("VmRSS")
s = replay(LocalStore(root), "m", 0, verify=True)
peak = rss("VmHWM")
print(json.dumps({"copies": (peak - base) / COPY, "digest": state_digest(s)}))
''',
    "bootstrap": '''
from deltarl.actor.fetcher import Fetcher
from deltarl.actor.subscriber import Subscriber
from deltarl.storage import LocalStore
base = rss("VmRSS")
live = {}
async def boot():
    async with Fetcher([LocalStore(root)], streams=4) as f:
        sub = Subscriber(live, "m", f, speculate=False)
        await sub.bootstrap()
        await sub.close()
asyncio.run(boot())
peak = rss("VmHWM")
print(json.dumps({"copies": (peak - base) / COPY, "digest": state_digest(live)}))
''',
}


def _run(root: Path, mode: str) -> dict:
    script = textwrap.dedent(_COMMON) + textwrap.dedent(_PHASES[mode])
    proc = subprocess.run([sys.executable, "-c", script, str(root), mode], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_keyframe_publish_replay_and_bootstrap_hold_one_copy(tmp_path):
    published = _run(tmp_path, "publish")
    assert published["copies"] <= LIMIT, published
    replayed = _run(tmp_path, "replay")
    assert replayed["copies"] <= LIMIT, replayed
    assert replayed["digest"] == published["digest"]  # bit-exact
    booted = _run(tmp_path, "bootstrap")
    assert booted["copies"] <= LIMIT, booted
    assert booted["digest"] == published["digest"]
