"""gc: orphans of interrupted publishes, in-flight protection by the writer claim, old versions."""

from __future__ import annotations

import pytest

from deltarl.errors import ObjectNotFound, WriterConflict
from deltarl.pipeline import RunLayout, inspect_run
from deltarl.pipeline.gc import gc
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.replay import replay
from tests.fixtures.runs import TinyTrainer, publish_run, states_equal

pytestmark = pytest.mark.torch
LAY = RunLayout("r")


def _keys(store):
    return set(store.list("r/"))


def test_clean_run_has_no_orphans(memory_store):
    publish_run(memory_store, "r", 6, keyframe_interval=3)
    before = _keys(memory_store)
    report = gc(memory_store, "r")
    assert report.orphans == []
    assert report.last_committed == 5
    assert _keys(memory_store) == before


def test_orphans_removed_and_dry_run(memory_store):
    publish_run(memory_store, "r", 6, keyframe_interval=3)
    stray = {
        LAY.segment(2, 7, epoch=1),  # not named by version 2's manifest
        LAY.segment(2, 0, epoch=9),  # a fenced writer's late upload
        LAY.keyframe_part(4, 0, epoch=1),  # version 4 is not a keyframe
        LAY.version_prefix(3) + "junk.tmp",
    }
    for key in stray:
        memory_store.put(key, b"x" * 10)
    dry = gc(memory_store, "r", dry_run=True)
    assert set(dry.orphans) == stray
    assert dry.freed_bytes == 40
    assert stray <= _keys(memory_store)
    report = gc(memory_store, "r")
    assert set(report.orphans) == stray
    assert not stray & _keys(memory_store)
    assert states_equal(replay(memory_store, "r"), replay(memory_store, "r", 5))


def test_in_flight_objects_wait_for_the_writer_lease(memory_store):
    trainer = TinyTrainer(0)
    pub = Publisher(memory_store, "r", writer_id="w")
    pub.publish(trainer.export(), step=0)
    pending = {LAY.segment(1, 0, epoch=1), LAY.segment(1, 1, epoch=1)}
    for key in pending:
        memory_store.put(key, b"partial")
    report = gc(memory_store, "r")
    assert set(report.in_flight) == pending
    assert report.orphans == []
    assert pending <= _keys(memory_store)
    forced = gc(memory_store, "r", force=True)  # fences the live writer, then sweeps
    assert set(forced.orphans) == pending
    assert not pending & _keys(memory_store)
    trainer.step()
    with pytest.raises(WriterConflict, match="lost the writer claim"):
        pub.publish(trainer.export(), step=1)
    pub.close()
    with Publisher(memory_store, "r", writer_id="w") as again:  # the fence expired at once
        assert again.publish(trainer.export(), step=1).version == 1


def test_released_claim_lets_gc_sweep(memory_store):
    publish_run(memory_store, "r", 2)
    stray = {LAY.segment(2, 0, epoch=1), LAY.keyframe_part(2, 1, epoch=1), LAY.keyframe_part(2, 0, epoch=1)}
    for key in stray:
        memory_store.put(key, b"partial")
    report = gc(memory_store, "r")
    assert set(report.orphans) == stray


def test_keep_last_keeps_what_replay_needs(local_store):
    exports = publish_run(local_store, "r", 30, keyframe_interval=10, digest_interval=5)
    dry = gc(local_store, "r", keep_last=5, dry_run=True)
    assert dry.removed_versions == list(range(20))
    assert local_store.exists(LAY.manifest(0))
    report = gc(local_store, "r", keep_last=5)
    assert report.oldest_kept == 20
    assert report.removed_versions == list(range(20))
    assert report.freed_bytes > 0
    assert not any(k.startswith((LAY.version_prefix(5), LAY.keyframe_prefix(10))) for k in _keys(local_store))
    for v in range(20, 30):
        assert states_equal(replay(local_store, "r", v), exports[v])
    with pytest.raises(ObjectNotFound, match=LAY.manifest(19)):
        replay(local_store, "r", 19)
    assert [r.version for r in inspect_run(local_store, "r", last=None).rows] == list(range(20, 30))
    assert gc(local_store, "r", keep_last=5).removed_versions == []  # idempotent
    with Publisher(local_store, "r") as pub:  # publishing continues after gc
        assert pub.publish(exports[-1], step=30).version == 30


def test_keep_last_bounds(memory_store):
    publish_run(memory_store, "r", 3)
    assert gc(memory_store, "r", keep_last=10).removed_versions == []
    with pytest.raises(ValueError, match="keep_last"):
        gc(memory_store, "r", keep_last=0)
