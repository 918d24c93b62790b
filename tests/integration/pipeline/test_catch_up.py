"""The one catch-up path (deltarl.pipeline.catch_up) as replay, the subscriber and the follower use it:
a corrupt keyframe behind a relay, a forged manifest below HEAD, a run re-created under the same name."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from deltarl.actor.follower import Follower
from deltarl.errors import ChainBroken, RunReplaced
from deltarl.pipeline import RunLayout
from deltarl.pipeline.canonical import canonical_json
from deltarl.pipeline.manifest import Manifest
from deltarl.pipeline.replay import replay
from deltarl.storage import LocalStore, MemoryStore
from deltarl.storage.open import open_store
from tests.fixtures.runs import TinyTrainer, publish_run, states_equal

pytestmark = pytest.mark.torch

LAY = RunLayout("r")


def _flip(store: Any, key: str, at: int = 300) -> None:
    data = bytearray(store.get(key))
    data[at] ^= 0x04
    store.put(key, bytes(data))


def test_replay_through_a_relay_falls_back_past_a_corrupt_keyframe(tmp_path, background_relay, caplog) -> None:
    """The relay refuses to serve the bad part (it checks every piece against the manifest); replay
    through it takes keyframe 4 plus deltas, as replay from the store does, naming the bad keyframe."""
    origin = LocalStore(str(tmp_path / "store"))
    exports = publish_run(origin, "r", 10, keyframe_interval=4, digest_interval=3)  # keyframes 0, 4, 8
    bad = LAY.keyframe_part(8, 0, epoch=1)
    _flip(origin, bad)
    relay = background_relay(origin)
    store = open_store(relay.url)
    with caplog.at_level(logging.WARNING):
        state = replay(store, "r", 9)
    assert states_equal(state, exports[9])
    assert "keyframe of version 8" in caplog.text
    assert "falling back to keyframe 4" in caplog.text


def test_replay_with_verify_catches_a_forged_manifest_below_head(memory_store: MemoryStore) -> None:
    """A manifest below HEAD rewritten into another valid one (its step edited): its id is no longer
    the parent its child names, so replay of it with verify fails, naming both."""
    exports = publish_run(memory_store, "r", 6, keyframe_interval=10)
    key = LAY.manifest(3)
    obj = json.loads(memory_store.get(key))
    obj["step"] = 99
    memory_store.put(key, canonical_json(obj))
    forged = Manifest.from_bytes(memory_store.get(key))
    assert forged.step == 99  # a valid manifest, committing to the same segments
    with pytest.raises(ChainBroken, match=r"versions/000000000004/manifest.json: names parent .*version 3 has id"):
        replay(memory_store, "r", 3)
    assert states_equal(replay(memory_store, "r", 3, verify=False), exports[3])  # the bytes are still version 3's


def _recreate(store: Any, versions: int, seed: int, **kw: Any) -> list[dict[str, Any]]:
    for key in store.list("r/"):
        store.delete(key)
    return publish_run(store, "r", versions, seed=seed, **kw)


async def _follow_until(follower: Follower, version: int, timeout_s: float = 30) -> None:
    await asyncio.wait_for(follower.follow(until_version=version), timeout_s)


async def test_a_follower_catches_up_with_a_run_recreated_with_the_same_tensors(tmp_path) -> None:
    """A run deleted and published again under the same name: the held version's id is not the new
    chain's parent, so the follower bootstraps again from the newest keyframe and follows on."""
    origin = LocalStore(str(tmp_path / "store"))
    publish_run(origin, "r", 3, keyframe_interval=2)
    async with Follower("r", store=origin, poll_wait_s=0.2) as follower:
        await _follow_until(follower, 2)
        exports = _recreate(origin, 6, seed=7, keyframe_interval=2)
        await _follow_until(follower, 5)
        assert follower.version == 5
        assert states_equal(follower.state, exports[5])


async def test_a_follower_stops_on_a_run_recreated_with_other_tensors(tmp_path) -> None:
    origin = LocalStore(str(tmp_path / "store"))
    publish_run(origin, "r", 2)
    async with Follower("r", store=origin, poll_wait_s=0.2) as follower:
        await _follow_until(follower, 1)
        for key in origin.list("r/"):
            origin.delete(key)
        trainer = TinyTrainer(3, shapes={"only": ((8, 8), "bfloat16")})
        from deltarl.pipeline.publisher import Publisher

        with Publisher(origin, "r") as pub:
            for step in range(3):
                trainer.step()
                pub.publish(trainer.export(), step)
        with pytest.raises(RunReplaced, match="re-created with another tensor table"):
            await _follow_until(follower, 2)
        assert follower.version == 1  # what it held stays as it was
