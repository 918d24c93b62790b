"""A damaged keyframe costs time, not availability: replay falls back to an older keyframe plus
the deltas after it, and the warning names the bad object."""

from __future__ import annotations

import logging

import pytest

from deltarl.errors import IntegrityError
from deltarl.pipeline import RunLayout, replay, squash
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch
LAY = RunLayout("r")


@pytest.fixture
def run8(memory_store):
    exports = publish_run(memory_store, "r", 8, keyframe_interval=3, digest_interval=2)  # keyframes 0, 3, 6
    return memory_store, exports


def _flip(store, key: str, at: int = 200) -> None:
    data = bytearray(store.get(key))
    data[at] ^= 0x01
    store.put(key, bytes(data))


@pytest.mark.parametrize("damage", ["flip", "delete", "truncate"])
def test_replay_falls_back_past_a_bad_keyframe(run8, caplog, damage: str) -> None:
    store, exports = run8
    bad = LAY.keyframe(3)
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
    _flip(store, LAY.keyframe(6))
    _flip(store, LAY.keyframe(3))
    assert states_equal(replay(store, "r", 7), exports[7])
    assert squash(store, "r", 4, 7)  # squash starts from the same fallback


def test_no_older_keyframe_still_fails_naming_it(run8) -> None:
    store, _ = run8
    _flip(store, LAY.keyframe(0))
    with pytest.raises(IntegrityError, match=LAY.keyframe(0)):
        replay(store, "r", 2)
