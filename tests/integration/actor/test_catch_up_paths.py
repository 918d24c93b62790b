"""What the in-place update mechanism reads on its way to a version (the vLLM engine's faults of
issue 33, without vLLM): a catch-up from the held state instead of a keyframe when that fetches
less, a manifest that does not check at a relay taken from the origin, HEAD's id checked even
without ``verify``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.source import FetcherSource
from deltarl.errors import ChainBroken
from deltarl.pipeline import RunLayout
from deltarl.pipeline.catch_up import HeldState, catch_up
from deltarl.pipeline.manifest import version_id
from deltarl.pipeline.replay import replay
from deltarl.storage import MemoryStore
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch

LAY = RunLayout("r")


async def _caught_up(store: Any, target: int, held: HeldState | None, sources: list[Any] | None = None) -> Any:
    async with Fetcher(sources or [store]) as fetcher:
        return await catch_up(FetcherSource(fetcher, "r"), target, held=held)


def test_a_catch_up_starts_from_the_held_state_when_its_deltas_fetch_less() -> None:
    store = MemoryStore()
    exports = publish_run(store, "r", 7, keyframe_interval=5, digest_interval=3)  # keyframes 0 and 5
    held = replay(store, "r", 1)
    vid = version_id(store.get(LAY.manifest(1)))
    copies = []

    def copy() -> dict[str, Any]:
        copies.append(1)
        return {n: t.clone() for n, t in held.items()}

    done = asyncio.run(_caught_up(store, 6, HeldState(1, vid, copy)))
    assert (done.keyframe_version, done.deltas, copies) == (1, 5, [1])  # deltas 2..6, not keyframe 5 + delta 6
    assert states_equal(done.state, exports[6])
    assert done.digest_checked  # version 3 records a digest on the way (6 too)
    other = asyncio.run(_caught_up(store, 6, HeldState(1, "0" * 64, copy)))  # not in the history: keyframe 5
    assert (other.keyframe_version, other.deltas) == (5, 1)
    assert states_equal(other.state, exports[6])


def test_a_manifest_that_does_not_check_at_a_relay_is_taken_from_the_origin() -> None:
    origin = MemoryStore()
    publish_run(origin, "r", 2)
    relay = MemoryStore()  # stands in for a relay's cache: every object, one manifest cut short
    for key in origin.list("r/"):
        relay.put(key, origin.get(key))
    good = origin.get(LAY.manifest(1))
    relay.put(LAY.manifest(1), good[: len(good) // 2])

    async def read() -> tuple[Any, str]:
        async with Fetcher([relay, origin], cooldown_s=0.1) as fetcher:
            return await FetcherSource(fetcher, "r").manifest(1)

    manifest, vid = asyncio.run(read())
    assert (manifest.version, vid) == (1, version_id(good))


def test_a_catch_up_without_verify_still_checks_heads_id() -> None:
    """A store (or a relay's stale cache) whose manifests are not the ones HEAD names: replay
    without ``verify`` refuses instead of rebuilding the other run's state."""
    store = MemoryStore()
    publish_run(store, "r", 2)
    head = json.loads(store.get(LAY.head))
    head["version_id"] = "ab" * 32
    store.put(LAY.head, json.dumps(head, separators=(",", ":")).encode())
    with pytest.raises(ChainBroken, match="names id"):
        replay(store, "r", verify=False)
