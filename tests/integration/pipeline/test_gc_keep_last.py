"""``gc --keep-last`` never removes what the versions it keeps need: it checks the keyframe it keeps
(by its hashes) before deleting anything older, falls back to an older keyframe past a damaged one,
and refuses a run it cannot judge (run.json missing or corrupt, HEAD naming another id)."""

from __future__ import annotations

import dataclasses

import pytest

from deltarl.errors import RunError
from deltarl.pipeline import RunLayout
from deltarl.pipeline.gc import gc
from deltarl.pipeline.manifest import HeadRecord
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.replay import replay
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch
LAY = RunLayout("r")
KW = {"keyframe_interval": 4, "digest_interval": 2, "segment_bytes": 4096}


@pytest.fixture
def run10(local_store):
    """Versions 0..9, keyframes 0, 4 and 8."""
    return local_store, publish_run(local_store, "r", 10, **KW)


def _damage(store, key: str, how: str) -> None:
    data = store.get(key)
    if how == "flip":
        store.put(key, data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1 :])
    elif how == "truncate":
        store.put(key, data[:-50])
    else:
        store.delete(key)


def _part(version: int) -> str:
    return LAY.keyframe_part(version, 0, epoch=1)


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_damaged_newest_keyframe_keeps_the_older_one(run10, how: str) -> None:
    store, exports = run10
    _damage(store, _part(8), how)
    assert states_equal(replay(store, "r"), exports[9])  # replay falls back to keyframe 4
    for dry in (True, False):
        report = gc(store, "r", keep_last=2, dry_run=dry)
        assert report.oldest_kept == 4
        assert report.removed_versions == [0, 1, 2, 3]
        assert len(report.damaged) == 1
        assert _part(8) in report.damaged[0]
    assert store.exists(LAY.manifest(4))
    assert store.exists(_part(4))
    assert not store.exists(LAY.manifest(3))
    assert states_equal(replay(store, "r"), exports[9])  # HEAD still replays
    assert states_equal(replay(store, "r", 8), exports[8])
    nxt = {n: t.clone() for n, t in exports[9].items()}
    nxt["embed.weight"][0, 0] += 1
    with Publisher(store, "r", **KW) as pub:  # and a new publisher resumes
        assert pub.publish(nxt, step=10).version == 10
    assert states_equal(replay(store, "r"), nxt)


def test_no_keyframe_that_verifies_means_nothing_is_removed(run10) -> None:
    store, _ = run10
    for v in (0, 4, 8):
        _damage(store, _part(v), "flip")
    before = set(store.list("r/"))
    with pytest.raises(RunError, match="removes nothing"):
        gc(store, "r", keep_last=2)
    assert set(store.list("r/")) == before


def test_a_damaged_delta_the_kept_versions_need_means_nothing_is_removed(run10) -> None:
    store, _ = run10
    _damage(store, _part(8), "flip")  # version 8 can only come from keyframe 4 plus deltas 5..8
    _damage(store, LAY.segment(6, 0, epoch=1), "flip")
    before = set(store.list("r/"))
    with pytest.raises(RunError, match=LAY.segment(6, 0, epoch=1)):
        gc(store, "r", keep_last=2)
    assert set(store.list("r/")) == before


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_gc_refuses_a_run_whose_run_json_is_missing_or_corrupt(run10, how: str) -> None:
    store, _ = run10
    if how == "missing":
        store.delete(LAY.run_json)
    else:
        store.put(LAY.run_json, store.get(LAY.run_json)[:-3])
    store.put(LAY.segment(9, 7, epoch=1), b"an orphan")
    before = set(store.list("r/"))
    for keep_last in (None, 2):
        with pytest.raises(RunError, match=r"run\.json.*removes nothing"):
            gc(store, "r", keep_last=keep_last)
    assert set(store.list("r/")) == before


def test_gc_refuses_a_head_naming_another_id(run10) -> None:
    store, _ = run10
    head = HeadRecord.from_bytes(store.get(LAY.head))
    other = head.version_id[:20] + ("0" if head.version_id[20] != "0" else "1") + head.version_id[21:]
    store.put(LAY.head, dataclasses.replace(head, version_id=other).to_bytes())
    before = set(store.list("r/"))
    for keep_last in (None, 2):
        with pytest.raises(RunError, match="removes nothing") as err:
            gc(store, "r", keep_last=keep_last)
        assert head.version_id[:21] in str(err.value)
        assert other[:21] in str(err.value)
    assert set(store.list("r/")) == before


def test_nothing_to_remove_reads_no_keyframe(run10) -> None:
    store, exports = run10
    _damage(store, _part(8), "flip")
    assert gc(store, "r", keep_last=6).removed_versions == [0, 1, 2, 3]  # keyframe 4 verifies: 8 not read
    report = gc(store, "r", keep_last=6)
    assert report.removed_versions == []
    assert report.damaged == []
    assert report.oldest_kept == 4
    assert states_equal(replay(store, "r"), exports[9])
    _damage(store, _part(4), "flip")  # nothing is older than keyframe 4, so gc has no reason to read it
    assert gc(store, "r", keep_last=3).removed_versions == []
