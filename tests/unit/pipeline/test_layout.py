"""The run namespace's key builders and parsers."""

from __future__ import annotations

import pytest

from deltarl.errors import InvalidKey
from deltarl.pipeline.layout import RunLayout, is_immutable, key_epoch, manifest_key_for, validate_run_name


def test_keys_match_design():
    lay = RunLayout("run-1")
    assert lay.run_json == "run-1/run.json"
    assert lay.head == "run-1/HEAD"
    assert lay.writer == "run-1/WRITER"
    assert lay.version_prefix(42) == "run-1/versions/000000000042/"
    assert lay.manifest(42) == "run-1/versions/000000000042/manifest.json"
    assert lay.segment(42, 0, epoch=3) == "run-1/versions/000000000042/e000003-seg-r000-00000.bin"
    assert lay.segment(42, 7, epoch=12, rank=5) == "run-1/versions/000000000042/e000012-seg-r005-00007.bin"
    assert lay.keyframe_part(40, 2, epoch=3, rank=1) == "run-1/keyframes/000000000040/e000003-part-r001-002.safetensors"
    assert lay.rollouts_prefix(42) == "run-1/rollouts/step-000000000042/"
    assert lay.coordinator_prefix == "run-1/coordinator/"


def test_keys_sort_numerically():
    lay = RunLayout("r")
    keys = [lay.manifest(v) for v in (10, 2, 100, 9)]
    assert sorted(keys) == [lay.manifest(v) for v in (2, 9, 10, 100)]


def test_parse_roundtrip():
    lay = RunLayout("r")
    assert lay.parse_version_key(lay.segment(7, 3, epoch=2)) == (7, "e000002-seg-r000-00003.bin")
    assert lay.parse_keyframe_key(lay.keyframe_part(50, 1, epoch=2)) == 50
    assert lay.parse_keyframe_key("r/keyframes/000000000050/junk.safetensors") is None
    assert lay.is_keyframe_part_key(lay.keyframe_part(50, 1, epoch=2), 50)
    assert not lay.is_keyframe_part_key(lay.keyframe_part(50, 1, epoch=2), 51)
    assert key_epoch(lay.segment(7, 3, epoch=42)) == 42
    assert key_epoch("r/versions/000000000007/seg-00003.bin") is None
    assert not lay.is_segment_key("r/versions/000000000007/seg-00003.bin", 7)  # no key without an epoch
    assert lay.parse_version_key(lay.manifest(7)) == (7, "manifest.json")
    assert lay.parse_version_key("r/versions/7/x") is None
    assert lay.parse_version_key("other/versions/000000000007/x") is None
    assert lay.parse_keyframe_key("r/keyframes/000000000050.safetensors") is None
    assert lay.parse_keyframe_key("r/keyframes/abc.safetensors") is None
    assert lay.is_segment_key(lay.segment(7, 3, epoch=1), 7)
    assert not lay.is_segment_key(lay.segment(7, 3, epoch=1), 8)
    assert not lay.is_segment_key(lay.manifest(7), 7)


def test_immutability():
    lay = RunLayout("r")
    assert not is_immutable(lay.head)
    assert not is_immutable(lay.writer)
    for key in (lay.run_json, lay.manifest(1), lay.segment(1, 0, epoch=1), lay.keyframe_part(0, 0, epoch=1)):
        assert is_immutable(key)


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "-x", "x" * 129, "sp ace", "ü"])
def test_bad_run_names(bad):
    with pytest.raises(InvalidKey):
        validate_run_name(bad)


@pytest.mark.parametrize("bad", [-1, 10**12, True, 1.0])
def test_bad_versions(bad):
    with pytest.raises(InvalidKey):
        RunLayout("r").manifest(bad)


@pytest.mark.parametrize("kw", [{"epoch": 0}, {"epoch": 10**6}, {"epoch": 1, "rank": 1000}, {"epoch": 1, "rank": -1}])
def test_bad_epochs_and_ranks(kw):
    with pytest.raises(InvalidKey):
        RunLayout("r").segment(1, 0, **kw)


def test_manifest_key_for_objects():
    lay = RunLayout("r")
    assert manifest_key_for(lay.segment(42, 3, epoch=2, rank=1)) == lay.manifest(42)
    assert manifest_key_for(lay.keyframe_part(40, 0, epoch=2)) == lay.manifest(40)
    for key in (lay.manifest(42), lay.head, lay.run_json, "r/versions/000000000042/seg-00003.bin",
                "r/keyframes/000000000040.safetensors", "r/versions/000000000042/e000002-part-r000-000.safetensors",
                "r/keyframes/000000000040/e000002-seg-r000-00000.bin", "-r/versions/000000000042/e000002-seg-r000-00000.bin"):
        assert manifest_key_for(key) is None, key
