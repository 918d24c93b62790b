"""Closing a subscriber while its codec warm-up is compiling: the close tells the warm-up to stop at its
next step and waits for that, not for every signature (a minute on two cores with a cold cache)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from deltarl.actor import subscriber as subscriber_module
from deltarl.actor.fetcher import Fetcher
from deltarl.actor.subscriber import Subscriber
from deltarl.pipeline.publisher import Publisher
from deltarl.storage import MemoryStore
from tests.fixtures.runs import TinyTrainer

pytestmark = pytest.mark.torch

RUN = "close"


class BlockingWarmUp:
    """Stands in for the numba compile only: blocks until its ``stop`` is set (at most 60 s)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.saw_stop: bool | None = None

    def __call__(self, dtypes: Any, *, stop: threading.Event | None = None) -> None:
        assert stop is not None
        self.entered.set()
        self.saw_stop = stop.wait(60)


async def test_close_stops_a_warm_up_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    warm = BlockingWarmUp()
    monkeypatch.setattr(subscriber_module, "warm_codec_quietly", warm)
    origin = MemoryStore()
    tiny = TinyTrainer(0)
    with Publisher(origin, RUN, segment_bytes=8 << 10) as pub:
        pub.publish(tiny.export(), step=0)
    state: dict[str, Any] = {}
    async with Fetcher([origin]) as fetcher:
        sub = Subscriber(state, RUN, fetcher, poll_wait_s=0.5)
        await sub.bootstrap()
        sub.start()  # background staging starts the warm-up first
        assert await asyncio.to_thread(warm.entered.wait, 30)
        t0 = time.monotonic()
        await asyncio.wait_for(sub.close(), 30)
        assert warm.saw_stop is True
        assert time.monotonic() - t0 < 10
        assert not sub.running
