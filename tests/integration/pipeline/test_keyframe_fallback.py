"""A damaged keyframe costs time, not availability: replay falls back to an older keyframe plus
the deltas after it, and the warning names the bad object."""

from __future__ import annotations

import logging

import pytest

from deltarl.errors import IntegrityError
from deltarl.pipeline import RunLayout
from deltarl.pipeline.replay import replay, squash
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch
LAY = RunLayout("r")


@pytest.fixture
def run8(memory_store):
    exports = publish_run(memory_store, "r", 8, keyframe_interval=3, digest_interval=2)  # keyframes 0, 3, 6
    return memory_store, exports


def _flip(store, key: str) -> None:
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01  # in the tensor bytes
    store.put(key, bytes(data))


@pytest.mark.parametrize("damage", ["flip", "delete", "truncate"])
def test_replay_falls_back_past_a_bad_keyframe(run8, caplog, damage: str) -> None:
    store, exports = run8
    bad = LAY.keyframe_part(3, 0, epoch=1)
    if damage == "flip":
        _flip(store, bad)
    elif damage == "delete":
        store.delete(bad)
    else:
        store.put(bad, store.get(bad)[:-50])
    with caplog.at_level(logging.WARNING, logger="deltarl.pipeline.replay"):
        assert states_equal(replay(store, "r", 5), exports[5])
    assert bad in caplog.text
    assert "falling back to keyframe 0" in caplog.text
    assert states_equal(replay(store, "r", 7), exports[7])  # keyframe 6 is fine: no fallback needed


def test_two_bad_keyframes_and_squash(run8) -> None:
    store, exports = run8
    _flip(store, LAY.keyframe_part(6, 0, epoch=1))
    _flip(store, LAY.keyframe_part(3, 0, epoch=1))
    assert states_equal(replay(store, "r", 7), exports[7])
    assert squash(store, "r", 4, 7)  # squash starts from the same fallback


def test_no_older_keyframe_still_fails_naming_it(run8) -> None:
    store, _ = run8
    _flip(store, LAY.keyframe_part(0, 0, epoch=1))
    with pytest.raises(IntegrityError, match=LAY.keyframe_part(0, 0, epoch=1)):
        replay(store, "r", 2)
