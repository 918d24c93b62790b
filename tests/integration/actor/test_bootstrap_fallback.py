"""An actor bootstraps past a corrupt keyframe: an older keyframe plus deltas, a warning naming it."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.subscriber import Subscriber
from deltarl.pipeline import RunLayout
from deltarl.storage import MemoryStore
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch


async def test_bootstrap_falls_back_past_a_corrupt_keyframe(caplog: pytest.LogCaptureFixture) -> None:
    origin = MemoryStore()
    exports = publish_run(origin, "r", 6, keyframe_interval=3, digest_interval=2)  # keyframes 0 and 3
    bad = RunLayout("r").keyframe_part(3, 0, epoch=1)
    data = bytearray(origin.get(bad))
    data[300] ^= 0x04
    origin.put(bad, bytes(data))
    state: dict[str, Any] = {}
    with caplog.at_level(logging.WARNING, logger="deltarl.actor.subscriber"):
        async with Fetcher([origin], streams=2) as fetcher, Subscriber(state, "r", fetcher) as sub:
            info = await sub.bootstrap()
    assert info.version == 5
    assert states_equal(state, exports[5])
    assert bad in caplog.text
    assert "falling back to keyframe 0" in caplog.text
