"""Replay and squash: bit-exact against the trainer's exports; bad input fails naming the object."""

from __future__ import annotations

import json

import pytest
import torch

from deltarl.codec import apply_delta, read_segment_header
from deltarl.errors import FormatError, IntegrityError, ObjectNotFound, RunError
from deltarl.pipeline import RunLayout
from deltarl.pipeline.manifest import Manifest, canonical_json
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay, squash
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch
LAY = RunLayout("r")
KW = {"keyframe_interval": 20, "digest_interval": 7, "segment_bytes": 4096}


def test_replay_50_versions_local_bit_exact(local_store):
    exports = publish_run(local_store, "r", 50, **KW)
    for v in range(50):
        assert states_equal(replay(local_store, "r", v, verify=v % 10 == 0), exports[v]), v


@pytest.mark.s3
def test_replay_50_versions_s3_bit_exact(moto_store):
    exports = publish_run(moto_store, "r", 50, **KW)
    for v in range(50):
        assert states_equal(replay(moto_store, "r", v, verify=v % 10 == 0), exports[v]), v


def test_replay_progress_bar(memory_store, capsys):
    exports = publish_run(memory_store, "r", 5, **KW)
    assert states_equal(replay(memory_store, "r", progress=True), exports[-1])
    assert "replay r" in capsys.readouterr().err


@pytest.fixture
def run5(memory_store):
    exports = publish_run(memory_store, "r", 5, **KW)
    return memory_store, exports


def test_missing_segment(run5):
    store, _ = run5
    store.delete(LAY.segment(3, 0, epoch=1))
    with pytest.raises(ObjectNotFound, match=LAY.segment(3, 0, epoch=1)):
        replay(store, "r", 4)


def test_flipped_byte_in_segment(run5):
    store, _ = run5
    key = LAY.segment(2, 0, epoch=1)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01
    store.put(key, bytes(data))
    with pytest.raises(IntegrityError, match=key):
        replay(store, "r", 4)
    assert states_equal(replay(store, "r", 1), run5[1][1])  # versions before it still replay


def _rewrite_manifest(store, version, **changes):
    m = Manifest.from_bytes(store.get(LAY.manifest(version)))
    obj = json.loads(m.to_bytes())
    obj.update(changes)
    store.put(LAY.manifest(version), canonical_json(obj))


def test_manifest_parent_breaks_chain(run5):
    store, _ = run5
    _rewrite_manifest(store, 3, parent="ab" * 32)
    with pytest.raises(RunError, match=rf"{LAY.manifest(3)}.*broken parent chain"):
        replay(store, "r", 3)


def test_manifest_rewritten_breaks_child_link(run5):
    store, _ = run5
    _rewrite_manifest(store, 2, step=999)  # its id changes, so version 3's parent link breaks
    with pytest.raises(RunError, match=LAY.manifest(3)):
        replay(store, "r", 4)


def test_head_names_other_id(run5):
    store, _ = run5
    head = json.loads(store.get(LAY.head))
    head["version_id"] = "cd" * 32
    store.put(LAY.head, canonical_json(head))
    with pytest.raises(RunError, match=LAY.head):
        replay(store, "r")


def test_truncated_keyframe(run5):
    store, _ = run5
    key = LAY.keyframe_part(0, 0, epoch=1)
    store.put(key, store.get(key)[:-100])
    with pytest.raises(IntegrityError, match=rf"{key}: truncated"):
        replay(store, "r", 2)


def test_wrong_run_json(run5):
    store, _ = run5
    info = json.loads(store.get(LAY.run_json))
    info["run"] = "other"
    store.put(LAY.run_json, canonical_json(info))
    with pytest.raises(RunError, match="names run 'other'"):
        replay(store, "r", 1)
    info["run"] = "r"
    info["tensors"][0]["shape"] = [1, 2]
    store.put(LAY.run_json, canonical_json(info))
    with pytest.raises(FormatError, match=r"keyframe parts .* elements of"):  # the parts no longer cover run.json
        replay(store, "r", 1)
    store.put(LAY.run_json, b"{not json")
    with pytest.raises(FormatError, match=LAY.run_json):
        replay(store, "r", 1)


def test_verify_checks_the_newest_recorded_digest_once(memory_store, monkeypatch):
    """digest_interval=7: versions 7 and 14 record digests; replaying 16 hashes the state once (at
    14), and a digest forged into the newest version is caught, naming its manifest."""
    import deltarl.codec.tensors as tensors

    exports = publish_run(memory_store, "r", 17, **KW)
    passes: list[int] = []
    real = tensors.state_digest
    monkeypatch.setattr(tensors, "state_digest", lambda state, *a, **k: passes.append(1) or real(state, *a, **k))
    assert states_equal(replay(memory_store, "r", 16), exports[16])
    assert len(passes) == 1
    assert states_equal(replay(memory_store, "r", 6), exports[6])  # no digest between keyframe 0 and 6
    assert len(passes) == 1
    # the newest version's digest, forged (and HEAD moved to its new id): caught, named
    assert Manifest.from_bytes(memory_store.get(LAY.manifest(16))).state_digest is None
    _rewrite_manifest(memory_store, 16, state_digest={"algo": "blake3-stream64k", "value": "ab" * 32})
    head = json.loads(memory_store.get(LAY.head))
    head["version_id"] = Manifest.from_bytes(memory_store.get(LAY.manifest(16))).version_id
    memory_store.put(LAY.head, canonical_json(head))
    with pytest.raises(IntegrityError, match=rf"{LAY.manifest(16)}: rebuilt state digest"):
        replay(memory_store, "r", 16)
    assert states_equal(replay(memory_store, "r", 16, verify=False), exports[16])


def test_manifest_for_other_version(run5):
    store, _ = run5
    store.put(LAY.manifest(4), store.get(LAY.manifest(3)))
    with pytest.raises(RunError, match=LAY.manifest(4)):
        replay(store, "r", 4)


def test_squash_catches_up_a_laggard(memory_store):
    exports = publish_run(memory_store, "r", 30, **KW)
    segments = squash(memory_store, "r", 5, 27, segment_bytes=4096)
    _, id5 = RunReader(memory_store, "r").manifest(5)
    assert all(read_segment_header(s).base == id5 for s in segments)
    state = {n: t.clone() for n, t in exports[5].items()}
    apply_delta(state, segments, base=id5)
    assert states_equal(state, exports[27])
    one_by_one = sum(RunReader(memory_store, "r").manifest(v)[0].stats.encoded_bytes for v in range(6, 28))
    assert sum(len(s) for s in segments) < one_by_one
    with pytest.raises(ValueError, match="from_version < to_version"):
        squash(memory_store, "r", 5, 5)


def test_replay_does_not_alias_trainer_tensors(memory_store):
    exports = publish_run(memory_store, "r", 3, **KW)
    a = replay(memory_store, "r", 2)
    a["embed.weight"].add_(torch.ones_like(a["embed.weight"]))
    assert states_equal(replay(memory_store, "r", 2), exports[2])


def test_small_run_fixture(small_run):
    store, exports = small_run
    assert RunReader(store, "r").head().version == 9
    assert states_equal(replay(store, "r", 6), exports[6])
