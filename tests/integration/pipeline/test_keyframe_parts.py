"""Keyframes end to end: parts streamed from the state, read back by ranges into fresh tensors
(or the caller's), bit-exact; a corrupted piece, a truncated part or overlapping ranges each
raise a clear error naming the object."""

from __future__ import annotations

import json

import pytest

from deltarl.errors import FormatError, IntegrityError
from deltarl.pipeline import RunLayout
from deltarl.pipeline.keyframe import empty_state
from deltarl.pipeline.manifest import canonical_json
from deltarl.pipeline.pieces import MIN_PIECE_SIZE
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay
from tests.fixtures.runs import WIDE_SHAPES, publish_run, states_equal

pytestmark = pytest.mark.torch
LAY = RunLayout("r")
# the smallest parts (64 KiB blocks) and pieces, so the test model is cut into several parts
KW = {"keyframe_interval": 3, "digest_interval": 2, "keyframe_part_bytes": 3000, "piece_size": MIN_PIECE_SIZE,
      "shapes": WIDE_SHAPES}


@pytest.fixture
def run4(local_store):
    return local_store, publish_run(local_store, "r", 4, **KW)


def test_parts_cover_the_state_and_replay_bit_exact(run4):
    store, exports = run4
    manifest, _ = RunReader(store, "r").manifest(3)
    assert manifest.keyframe is not None
    assert len(manifest.keyframe.parts) > 1
    assert all(LAY.is_keyframe_part_key(k, 3) for k in manifest.keyframe.keys)
    manifest.keyframe.check_covers(RunReader(store, "r").info().tensors, manifest.key)
    for v in range(4):
        assert states_equal(replay(store, "r", v), exports[v]), v


def test_keyframe_reads_into_the_callers_tensors(run4):
    store, exports = run4
    reader = RunReader(store, "r")
    manifest, _ = reader.manifest(0)
    into = empty_state(reader.info().tensors)
    got = reader.keyframe(manifest, into, workers=1)
    assert got is into
    assert states_equal(into, exports[0])


def _part(store, version, index):
    manifest, _ = RunReader(store, "r").manifest(version)
    return manifest, manifest.keyframe.parts[index]


def test_corrupted_piece_names_the_part(run4):
    store, _ = run4
    manifest, part = _part(store, 0, 1)
    data = bytearray(store.get(part.key))
    data[-3] ^= 0x40
    store.put(part.key, bytes(data))
    with pytest.raises(IntegrityError, match=rf"{part.key}: piece \d+ .*{manifest.key}"):
        replay(store, "r", 0)


def test_truncated_part_names_the_part(run4):
    store, _ = run4
    _, part = _part(store, 0, 0)
    store.put(part.key, store.get(part.key)[:-10])
    with pytest.raises(IntegrityError, match=rf"{part.key}: truncated"):
        replay(store, "r", 0)


def test_overlapping_ranges_name_the_manifest_and_part(run4):
    store, _ = run4
    key = LAY.manifest(0)
    obj = json.loads(store.get(key))
    parts = obj["keyframe"]["parts"]
    first = parts[0]["tensors"][0]
    other = next(p for p in parts[1:] if first[0] not in {t[0] for t in p["tensors"]})
    other["tensors"].append(list(first))  # another part also claims part 0's first range
    store.put(key, canonical_json(obj))
    with pytest.raises(FormatError, match=rf"keyframe part {other['key']} overlaps"):
        replay(store, "r", 0)


def test_a_header_that_disagrees_with_the_manifest_is_refused(local_store):
    """Another writer's part whose header does not hold the recorded ranges: FormatError naming it."""
    from deltarl.codec.tensors import TensorSpec
    from deltarl.pipeline.keyframe import part_header, read_part_into
    from deltarl.pipeline.manifest import KeyframePart, ObjectRef

    specs = {"a": TensorSpec("a", "float32", (4,)), "b": TensorSpec("b", "float32", (4,))}
    body = part_header([("b", 0, 4), ("a", 0, 4)], specs) + bytes(32)  # stored b then a
    ref = ObjectRef.of(LAY.keyframe_part(0, 0, epoch=1), body, piece_size=MIN_PIECE_SIZE)
    part = KeyframePart(ref.key, ref.root, ref.size, ref.piece_size, ref.pieces, (("a", 0, 4), ("b", 0, 4)))
    local_store.put(part.key, body)
    dest = empty_state(list(specs.values()))
    with pytest.raises(FormatError, match=part.key):
        read_part_into(local_store, part, specs, dest, named_by="m")
