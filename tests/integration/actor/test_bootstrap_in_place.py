"""A first bootstrap loads straight into the actor's model tensors when they fit run.json, so it
holds one copy of the model, not two; otherwise it builds a fresh state and swaps it in."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.subscriber import Subscriber
from deltarl.errors import StagingError
from deltarl.storage import MemoryStore
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch


async def test_bootstrap_writes_into_the_models_own_tensors() -> None:
    origin = MemoryStore()
    exports = publish_run(origin, "r", 4, keyframe_interval=2)  # keyframe 2, then delta 3
    model = {name: torch.zeros_like(t) for name, t in exports[-1].items()}  # built before joining
    storage = {name: t.data_ptr() for name, t in model.items()}
    async with Fetcher([origin], streams=2) as fetcher, Subscriber(model, "r", fetcher) as sub:
        info = await sub.bootstrap()
    assert info.version == 3
    assert states_equal(model, exports[3])
    assert {name: t.data_ptr() for name, t in model.items()} == storage  # the same memory, written in place


async def test_a_model_that_does_not_fit_run_json_is_not_written_in_place() -> None:
    origin = MemoryStore()
    exports = publish_run(origin, "r", 2)
    name = sorted(exports[-1])[0]
    model: dict[str, Any] = {n: torch.zeros_like(t) for n, t in exports[-1].items()}
    model[name] = torch.zeros(exports[-1][name].shape, dtype=torch.float64)  # another dtype than run.json's
    before = {n: t.clone() for n, t in model.items()}
    async with Fetcher([origin], streams=2) as fetcher, Subscriber(model, "r", fetcher) as sub:
        with pytest.raises(StagingError, match=name):
            await sub.bootstrap()
    assert states_equal(model, before)  # nothing was written: the catch-up state was built aside

