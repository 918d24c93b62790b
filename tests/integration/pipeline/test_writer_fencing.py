"""A restarted trainer (same writer id) or a takeover while the old process still runs: the taker
goes on, the old writer is fenced (its late uploads land under its own epoch's keys, it cannot
commit), the chain stays intact, and gc never sweeps what the live claim may own."""

from __future__ import annotations

import pytest

from deltarl.errors import WriterConflict
from deltarl.pipeline import RunLayout
from deltarl.pipeline.gc import gc
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay
from tests.fixtures.runs import TinyTrainer, states_equal

pytestmark = pytest.mark.torch
LAY = RunLayout("r")


@pytest.mark.parametrize(("new_id", "takeover"), [("w", False), ("taker", True)])
def test_taker_continues_and_the_old_writer_is_fenced(memory_store, new_id: str, takeover: bool) -> None:
    trainer = TinyTrainer(0)
    old = Publisher(memory_store, "r", writer_id="w", segment_bytes=4096)
    old.publish(trainer.export(), step=0)
    new = Publisher(memory_store, "r", writer_id=new_id, takeover=takeover, segment_bytes=4096)  # cleans up v1
    trainer.step()
    stale = trainer.export()
    # The old process is still running: its publish of version 1 uploads after the new one's cleanup.
    with pytest.raises(WriterConflict, match="lost the writer claim"):
        old.publish(stale, step=1)
    late = set(memory_store.list(LAY.version_prefix(1)))
    assert late  # its segments landed, under its own (old) epoch
    assert not memory_store.exists(LAY.manifest(1))  # but it committed nothing
    # While the taker's claim is live, gc leaves every object of the version in flight alone.
    report = gc(memory_store, "r")
    assert set(report.in_flight) == late
    assert late <= set(memory_store.list(LAY.version_prefix(1)))
    trainer.step()
    good = trainer.export()
    assert new.publish(good, step=1).version == 1  # no "already exists with other bytes"
    trainer.step()
    newest = trainer.export()
    new.publish(newest, step=2)
    new.close()
    old.close()
    assert states_equal(replay(memory_store, "r", 1), good)
    assert states_equal(replay(memory_store, "r", 2), newest)
    assert [m.version for m, _ in RunReader(memory_store, "r").kept_chain()] == [0, 1, 2]
    # Once committed past it, the fenced writer's late uploads are orphans gc removes.
    swept = gc(memory_store, "r")
    assert late <= set(swept.orphans)
    assert states_equal(replay(memory_store, "r", 2), newest)
