"""gc refuses what it cannot judge safely: a missing run, a HEAD past the last manifest, and (also
in a dry run) the objects of a live writer's publish in flight."""

from __future__ import annotations

import dataclasses

import pytest

from deltarl.errors import RunError
from deltarl.pipeline import RunLayout
from deltarl.pipeline.gc import gc
from deltarl.pipeline.manifest import HeadRecord
from deltarl.pipeline.publisher import Publisher
from tests.fixtures.runs import TinyTrainer

pytestmark = pytest.mark.torch
LAY = RunLayout("r")


def test_gc_of_a_missing_run_is_an_error(memory_store):
    with pytest.raises(RunError, match="no run 'nosuch'"):
        gc(memory_store, "nosuch")


def test_dry_run_never_lists_a_live_writers_in_flight_objects(memory_store):
    trainer = TinyTrainer(0)
    with Publisher(memory_store, "r", writer_id="w") as pub:
        pub.publish(trainer.export(), step=0)
        memory_store.put(LAY.segment(1, 0, epoch=1), b"in flight")
        dry = gc(memory_store, "r", dry_run=True)
        assert dry.orphans == []
        assert dry.in_flight == [LAY.segment(1, 0, epoch=1)]
        assert gc(memory_store, "r", dry_run=True, force=True).orphans == [LAY.segment(1, 0, epoch=1)]


def test_gc_refuses_a_head_naming_a_missing_manifest(memory_store):
    trainer = TinyTrainer(0)
    with Publisher(memory_store, "r", writer_id="w") as pub:
        for step in range(2):
            trainer.step()
            pub.publish(trainer.export(), step=step)
        memory_store.put(LAY.segment(2, 0, epoch=1), b"in flight")  # the live writer's next publish
        head = HeadRecord.from_bytes(memory_store.get(LAY.head))
        memory_store.put(LAY.head, dataclasses.replace(head, version=7).to_bytes())  # damaged
        for dry in (True, False):
            with pytest.raises(RunError, match=r"manifest .* is missing"):
                gc(memory_store, "r", dry_run=dry)
    assert memory_store.exists(LAY.segment(2, 0, epoch=1))
