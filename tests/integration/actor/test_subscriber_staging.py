"""Speculative staging: segments decoded before the manifest are trusted only if the manifest agrees."""

from __future__ import annotations

import asyncio
import types

import pytest

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.prefetch import VersionStaging
from deltarl.codec import encode_delta
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import ObjectRef
from deltarl.storage import MemoryStore
from tests.fixtures.runs import TinyTrainer, states_equal

pytestmark = pytest.mark.torch

BASE = "a" * 64


async def test_a_speculative_segment_that_disagrees_with_the_manifest_is_restaged() -> None:
    tiny = TinyTrainer(1)
    old = tiny.export()
    tiny.step()
    new = tiny.export()
    tiny.step()
    other = tiny.export()  # a delta on the same base that is NOT the committed version
    good = encode_delta(old, new, base=BASE, segment_bytes=1 << 10)
    bad = encode_delta(old, other, base=BASE, segment_bytes=1 << 10)
    layout = RunLayout("spec")
    store = MemoryStore()
    store.put(layout.segment(1, 0, epoch=1), bad[0])  # what a speculative reader sees first
    state = {k: t.clone() for k, t in old.items()}
    staging = VersionStaging(state, BASE)
    async with Fetcher([store]) as fetcher:
        task = asyncio.ensure_future(staging.speculate(fetcher, lambda i: layout.segment(1, i, epoch=1), window=2, wait_s=0.2))
        for _ in range(200):
            if staging._pending:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        refs = []
        for i, seg in enumerate(good):
            store.put(layout.segment(1, i, epoch=1), seg)
            refs.append(ObjectRef.of(layout.segment(1, i, epoch=1), seg))
        manifest = types.SimpleNamespace(key=layout.manifest(1), segments=tuple(refs))
        update = await staging.complete(fetcher, manifest)  # type: ignore[arg-type]
    staging.close()
    assert staging.speculative == {}  # the disagreeing speculation was thrown away
    assert states_equal(state, old)  # staging never writes the live state
    update.commit()
    assert states_equal(state, new)
