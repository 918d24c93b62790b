"""The weights-only follower: relays only (no origin store), bit-exact output, no busy polling behind
servers that answer 404 at once, and ``deltarl follow`` with and without ``--until-version``."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from deltarl.actor.follower import Follower
from deltarl.cli import main
from deltarl.errors import ConfigError
from deltarl.pipeline.publisher import Publisher
from deltarl.storage import MemoryStore
from tests.fixtures.relays import StartRelay
from tests.fixtures.runs import TinyTrainer, states_equal

pytestmark = pytest.mark.torch

RUN = "fol"
REPO = Path(__file__).resolve().parents[3]


class Trainer:
    def __init__(self, store: Any) -> None:
        self.tiny = TinyTrainer(1)
        self.pub = Publisher(store, RUN, segment_bytes=8 << 10, keyframe_interval=4, digest_interval=2)
        self.exports: list[dict[str, Any]] = []

    def publish(self, n: int = 1) -> None:
        for _ in range(n):
            if self.exports:
                self.tiny.step()
            export = self.tiny.export()
            self.pub.publish(export, step=len(self.exports))
            self.exports.append({k: t.clone() for k, t in export.items()})

    def close(self) -> None:
        self.pub.close()


def _load(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


async def test_follower_through_a_relay_only_writes_the_trainers_bits(start_relay: StartRelay, tmp_path: Path) -> None:
    origin = MemoryStore()
    trainer = Trainer(origin)
    relay = await start_relay(origin)
    await asyncio.to_thread(trainer.publish, 2)
    async with Follower(RUN, relays=[relay.url], poll_wait_s=2.0) as follower:
        seen: list[int] = []
        follow = asyncio.ensure_future(follower.follow(until_version=6, on_commit=lambda i: seen.append(i.version)))
        await asyncio.to_thread(trainer.publish, 5)  # versions 2..6 land while it follows
        last = await asyncio.wait_for(follow, 60)
        assert last is not None
        assert last.version == 6
        assert seen[0] == 1
        assert seen[-1] == 6
        assert seen == sorted(set(seen))
        assert states_equal(follower.state, trainer.exports[6])
        assert follower.fetcher.stats.bytes_by_source.keys() == {relay.url}  # no origin was given
        follower.save(tmp_path / "w.safetensors")
    assert states_equal(_load(tmp_path / "w.safetensors"), trainer.exports[6])
    trainer.close()


def test_follower_needs_a_source() -> None:
    with pytest.raises(ConfigError, match="relay or a store"):
        Follower(RUN)
    with pytest.raises(ConfigError, match="http"):
        Follower(RUN, relays=["relay:8470"])


async def test_idle_follower_behind_a_plain_server_does_not_spin(plain_http: Any) -> None:
    """A server that answers 404 at once and ignores ?wait= (nginx, plain S3): the follower backs
    off, so idle it asks a few times a second at most, and still picks up the next version."""
    origin = MemoryStore()
    trainer = Trainer(origin)
    server = await plain_http(origin)
    await asyncio.to_thread(trainer.publish, 2)
    async with Follower(RUN, relays=[server.url], poll_wait_s=5.0) as follower:
        assert (await follower.bootstrap()) is not None
        await asyncio.sleep(3.0)  # past the backoff's ramp (50 ms doubling to ~1 s)
        before = server.total
        window = 5.0
        await asyncio.sleep(window)  # idle: only the polls for version 2's manifest, segment 0 and HEAD
        idle = server.total - before
        assert idle <= 5 * window, f"{idle} requests in {window}s idle: {server.requests.most_common(5)}"
        assert idle >= 3  # it does keep looking
        await asyncio.to_thread(trainer.publish)
        info = await follower.step(timeout_s=30)
        assert info is not None
        assert info.version == 2
        assert states_equal(follower.state, trainer.exports[2])
    trainer.close()


def test_follow_command_until_version(background_relay: Any, tmp_path: Path) -> None:
    origin = MemoryStore()
    trainer = Trainer(origin)
    trainer.publish(4)
    relay = background_relay(origin)
    out = tmp_path / "w.safetensors"
    assert main(["follow", RUN, "--relay", relay.url, "--out", str(out), "--until-version", "3"]) == 0
    assert states_equal(_load(out), trainer.exports[3])
    assert main(["follow", RUN, "--out", str(out)]) == 2  # no source at all
    trainer.close()


def test_follow_command_until_stopped_writes_the_last_state(background_relay: Any, tmp_path: Path) -> None:
    origin = MemoryStore()
    trainer = Trainer(origin)
    trainer.publish(2)
    relay = background_relay(origin)
    out = tmp_path / "w.safetensors"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with socket.socket() as probe:  # a free port for the follower's Prometheus endpoint
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "deltarl.cli", "-v", "follow", RUN, "--relay", relay.url,
                             "--out", str(out), "--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:
            if "bootstrapped version 1" in line:
                break
            assert time.monotonic() < deadline, "follower never bootstrapped"
            assert proc.poll() is None
        trainer.publish(1)
        for line in proc.stderr:
            if "committed version 2" in line:
                break
        while True:  # the log line comes just before the commit is recorded; scrape until it is
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                scraped = resp.read().decode()
            # the version gauge is set just before the commit counter (the scrape runs in another thread)
            booked = "deltarl_follower_version 2.0" in scraped and "deltarl_follower_commits_total 1.0" in scraped
            if booked or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert "deltarl_follower_version 2.0" in scraped, scraped[:2000]
        assert "deltarl_follower_commits_total 1.0" in scraped, [ln for ln in scraped.splitlines() if "commits" in ln]
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(60) == 0, rest[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    assert states_equal(_load(out), trainer.exports[2])
    trainer.close()

