"""The subscriber end to end: a real publisher, a relay, the fetcher, staging and in-place commits."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.subscriber import Subscriber
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.reader import RunReader
from deltarl.storage import MemoryStore
from deltarl.testing.wan import EmulatedLink
from tests.fixtures.relays import StartRelay
from tests.fixtures.runs import TinyTrainer, states_equal

pytestmark = pytest.mark.torch

RUN = "sub"


class Trainer:
    """A TinyTrainer publishing through a Publisher (publish runs in a thread)."""

    def __init__(self, store: MemoryStore, **kw: Any) -> None:
        self.tiny = TinyTrainer(0)
        self.pub = Publisher(store, RUN, segment_bytes=8 << 10, **kw)
        self.exports: list[dict[str, Any]] = []

    async def publish(self, n: int = 1) -> None:
        def run() -> None:
            for _ in range(n):
                if self.exports:
                    self.tiny.step()
                export = self.tiny.export()
                self.pub.publish(export, step=len(self.exports))
                self.exports.append({k: t.clone() for k, t in export.items()})

        await asyncio.to_thread(run)

    def close(self) -> None:
        self.pub.close()


async def _until_ready(sub: Subscriber, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not sub.ready():
        assert time.monotonic() < deadline, f"nothing staged (error: {sub.error})"
        await asyncio.sleep(0.02)


async def test_bootstrap_follow_and_catch_up(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    trainer = Trainer(origin, keyframe_interval=5, digest_interval=2)
    relay = await start_relay(origin)
    state: dict[str, Any] = {}
    try:
        await trainer.publish(3)
        async with Fetcher([relay.url, origin], streams=3) as fetcher, Subscriber(
            state, RUN, fetcher, poll_wait_s=2.0, catch_up_after=3
        ) as sub:
            info = await sub.bootstrap()
            assert (info.version, info.full) == (2, True)
            assert states_equal(state, trainer.exports[2])
            live = dict(state)  # the tensors the actor's model holds: commits must write into them
            sub.start()
            await asyncio.sleep(0.1)
            assert not sub.ready()
            await trainer.publish()
            await _until_ready(sub)
            assert sub.staged_version == 3
            assert states_equal(state, trainer.exports[2])  # staging wrote nothing
            info = sub.commit()
            assert (info.version, info.full) == (3, False)
            assert info.changed_elements > 0
            assert info.version_id == trainer.pub.head_version_id
            assert states_equal(state, trainer.exports[3])
            # Far behind: v4 gets staged, then 7 more versions land before the next safe point (staged
            # first, so a slow subscriber cannot see them all in HEAD and jump before it stages v4).
            await trainer.publish()
            await _until_ready(sub)
            assert sub.staged_version == 4
            await trainer.publish(7)
            assert sub.commit().version == 4
            infos = []
            while sub.version != 11:  # HEAD is a cached hint: a step or two may come before the jump
                await _until_ready(sub)
                infos.append(sub.commit())
            assert len(infos) <= 6
            assert infos[-1].full
            assert infos[-1].state_digest_ok in (True, None)
            assert states_equal(state, trainer.exports[11])
            assert all(state[k] is live[k] for k in live)  # in place
    finally:
        trainer.close()
    assert fetcher.stats.bytes_by_source.get(origin.url, 0) == 0  # everything came through the relay


async def test_stages_exact_bytes_when_the_relay_dies(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    trainer = Trainer(origin)
    relay = await start_relay(origin)
    state: dict[str, Any] = {}
    try:
        await trainer.publish(2)
        async with EmulatedLink("127.0.0.1", relay.port) as link, Fetcher(
            [link.url, origin], streams=2, read_timeout_s=2
        ) as fetcher, Subscriber(state, RUN, fetcher, poll_wait_s=1.0) as sub:
            await sub.bootstrap()
            sub.start()
            link.kill()  # the relay's region goes dark
            await trainer.publish()
            await _until_ready(sub)
            assert sub.commit().version == 2
            assert states_equal(state, trainer.exports[2])
    finally:
        trainer.close()
    assert fetcher.stats.failovers >= 1
    assert fetcher.stats.bytes_by_source[origin.url] > 0


class SlowManifests(MemoryStore):
    """An origin where each manifest lands ``delay`` seconds after the segments (a slow commit)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def put_if_absent(self, key: str, data: bytes) -> str:
        if key.endswith("/manifest.json"):
            time.sleep(self.delay)
        return super().put_if_absent(key, data)


async def test_segments_are_staged_before_the_manifest_lands(start_relay: StartRelay) -> None:
    origin = SlowManifests(delay=0.0)
    trainer = Trainer(origin)
    relay = await start_relay(origin)
    state: dict[str, Any] = {}
    try:
        await trainer.publish(2)
        origin.delay = 1.0
        async with Fetcher([relay.url, origin], streams=3) as fetcher, Subscriber(state, RUN, fetcher, poll_wait_s=5.0) as sub:
            await sub.bootstrap()
            sub.start()
            await trainer.publish()
            await _until_ready(sub)
            info = sub.commit()
    finally:
        trainer.close()
    assert info.version == 2
    assert states_equal(state, trainer.exports[2])
    assert sub.speculated_segments >= 1  # fetched and decoded during the second before the commit
    assert info.stage_s < origin.delay  # staged without waiting out the slow origin once the manifest landed


async def test_speculation_follows_a_restarted_writers_epoch(start_relay: StartRelay) -> None:
    """A restarted trainer holds a new claim epoch, and its segments carry it: the subscriber reads
    the claim, so its speculative fetches name the new writer's keys and land before the manifest."""
    origin = SlowManifests(delay=0.0)
    trainer = Trainer(origin)
    relay = await start_relay(origin)
    state: dict[str, Any] = {}
    try:
        await trainer.publish(2)
        trainer.pub.close()
        trainer.pub = Publisher(origin, RUN, segment_bytes=8 << 10)  # a restart: epoch 2
        origin.delay = 1.0
        async with Fetcher([relay.url, origin], streams=3) as fetcher, Subscriber(state, RUN, fetcher, poll_wait_s=5.0) as sub:
            await sub.bootstrap()
            sub.start()
            await trainer.publish()
            await _until_ready(sub)
            info = sub.commit()
    finally:
        trainer.close()
    assert info.version == 2
    manifest, _ = RunReader(origin, RUN).manifest(2)
    assert all("/e000002-seg-" in ref.key for ref in manifest.segments)
    assert sub.speculated_segments >= 1
    assert states_equal(state, trainer.exports[2])


def _unchanged_element(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, int]:
    """A (tensor, flat index) whose bits are the same in ``a`` and ``b``."""
    import torch

    for name in sorted(a):
        bits = torch.int16 if a[name].element_size() == 2 else torch.int32
        same = (a[name].reshape(-1).view(bits) == b[name].reshape(-1).view(bits)).nonzero()
        if len(same):
            return name, int(same[0])
    raise AssertionError("every element changed")


def _flip(state: dict[str, Any], name: str, index: int) -> None:
    import torch

    flat = state[name].view(-1).view(torch.int16 if state[name].element_size() == 2 else torch.int32)
    flat[index] ^= 1


async def test_digest_is_checked_after_the_commit_and_a_mismatch_rolls_back() -> None:
    from deltarl.errors import IntegrityError

    origin = MemoryStore()
    trainer = Trainer(origin, digest_interval=1)
    state: dict[str, Any] = {}
    try:
        await trainer.publish()
        async with Fetcher([origin], streams=2) as fetcher, Subscriber(state, RUN, fetcher, poll_wait_s=1.0) as sub:
            await sub.bootstrap()
            sub.start()
            # a good version: the commit returns before the digest check, confirm() finishes it
            await trainer.publish()
            await _until_ready(sub)
            staged_at = sub.staged_at
            assert staged_at is not None
            assert staged_at <= time.time()
            info = sub.commit()
            assert (info.version, info.digest_pending, info.state_digest_ok, info.staged_at) == (1, True, None, staged_at)
            confirmed = await sub.confirm()
            assert confirmed is not None
            assert (confirmed.version, confirmed.digest_pending, confirmed.state_digest_ok) == (1, False, True)
            assert confirmed.digest_s is not None
            assert sub.commits[-1] == confirmed
            assert await sub.confirm() is None  # nothing pending any more

            # a state that differs from the trainer's outside the delta: commit, then confirm() rolls back
            await trainer.publish()
            await _until_ready(sub)
            name, index = _unchanged_element(trainer.exports[1], trainer.exports[2])
            _flip(state, name, index)
            assert sub.commit().digest_pending
            with pytest.raises(IntegrityError, match="rolled back to version 1"):
                await sub.confirm()
            assert (sub.version, sub.version_id) == (1, confirmed.version_id)
            assert sub.commits[-1].state_digest_ok is False
            _flip(state, name, index)
            assert states_equal(state, trainer.exports[1])  # every value the commit wrote is restored

            # the next commit settles a pending check first: the version staged on the bad one is dropped
            await _until_ready(sub)  # version 2 again
            _flip(state, name, index)
            sub.commit()
            await trainer.publish()
            await _until_ready(sub)
            assert sub.staged_version == 3
            with pytest.raises(IntegrityError):
                sub.commit()
            assert sub.version == 1
            assert sub.staged_version in (None, 2)
            _flip(state, name, index)
            while sub.version != 3:  # healthy again: versions 2 and 3 commit and check out
                await _until_ready(sub)
                sub.commit()
                assert (await sub.confirm()).state_digest_ok  # type: ignore[union-attr]
            assert states_equal(state, trainer.exports[3])
    finally:
        trainer.close()
