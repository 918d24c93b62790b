"""Whole-model paths hold one copy of the model (keyframe publish, replay, bootstrap) and delta
publishing two, flat over 16 versions; each runs in a subprocess that reads its own peak RSS
(VmHWM) at a ~256 MB state, bit-exact.

Memory is not noisy the way time is: the peak counts the state once (the caller's state, or the
fresh state built), plus chunk-sized buffers. The interpreter's own RSS (with the codec's compiled
code where deltas are published), measured before the state is allocated, is subtracted. Linux
only (``/proc/self/status``).
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
from deltarl.codec.tensors import state_digest

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
    "deltas": '''
from deltarl.codec.heap import trim
from deltarl.pipeline.publisher import Publisher
from deltarl.codec.jit_warmup import warm_codec
from deltarl.storage import LocalStore
warm_codec(["bfloat16"])  # the codec's compiled code (~120 MB with numba) is the process's, not data
trim()
base = rss("VmRSS")
s = state(0)
after = []
with Publisher(LocalStore(root), "d", keyframe_interval=1000, digest_interval=1000, keyframe_part_bytes=64 << 20) as pub:
    pub.publish(s, step=0, owned=True)
    for v in range(1, VERSIONS + 1):  # each version a new export, ~1% of it moved by one ulp, handed over
        s = {name: t.clone() for name, t in s.items()}
        for t in s.values():
            t.view(torch.int16)[::97] += 1 if v % 2 else -1
        info = pub.publish(s, step=v, owned=True)
        assert info.stats.changed_elements == 16 * -(-2048 // 97) * 4096, info.stats  # every 97th row
        after.append((rss("VmRSS") - base) / COPY)
peak = rss("VmHWM")
print(json.dumps({"copies": (peak - base) / COPY, "after": after, "digest": state_digest(s)}))
''',
}

DELTA_VERSIONS = 16
DELTA_LIMIT = 2.3  # the previous base plus the new export


def _run(root: Path, mode: str) -> dict:
    script = textwrap.dedent(_COMMON) + f"VERSIONS = {DELTA_VERSIONS}\n" + textwrap.dedent(_PHASES[mode])
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


@pytest.mark.slow
def test_delta_publishing_holds_two_copies_and_does_not_grow(tmp_path):
    published = _run(tmp_path, "deltas")
    assert published["copies"] <= DELTA_LIMIT, published
    after = published["after"]
    assert len(after) == DELTA_VERSIONS
    # what the process holds after each version: the adopted export (one copy) plus buffers; the
    # memory of each dropped export goes back to the OS, so the last version holds what the fifth did
    assert max(after) <= 1.3, after
    assert after[-1] - after[4] <= 0.05, after
    from deltarl.codec.tensors import state_digest
    from deltarl.pipeline.replay import replay
    from deltarl.storage import LocalStore

    assert state_digest(replay(LocalStore(tmp_path), "d", DELTA_VERSIONS)) == published["digest"]  # bit-exact
