"""The run namespace's key builders and parsers."""

from __future__ import annotations

import pytest

from deltarl.errors import InvalidKey
from deltarl.pipeline.layout import RunLayout, is_immutable, validate_run_name


def test_keys_match_design():
    lay = RunLayout("run-1")
    assert lay.run_json == "run-1/run.json"
    assert lay.head == "run-1/HEAD"
    assert lay.writer == "run-1/WRITER"
    assert lay.version_prefix(42) == "run-1/versions/000000000042/"
    assert lay.manifest(42) == "run-1/versions/000000000042/manifest.json"
    assert lay.segment(42, 0) == "run-1/versions/000000000042/seg-00000.bin"
    assert lay.keyframe(40) == "run-1/keyframes/000000000040.safetensors"
    assert lay.rollouts_prefix(42) == "run-1/rollouts/step-000000000042/"
    assert lay.coordinator_prefix == "run-1/coordinator/"


def test_keys_sort_numerically():
    lay = RunLayout("r")
    keys = [lay.manifest(v) for v in (10, 2, 100, 9)]
    assert sorted(keys) == [lay.manifest(v) for v in (2, 9, 10, 100)]


def test_parse_roundtrip():
    lay = RunLayout("r")
    assert lay.parse_version_key(lay.segment(7, 3)) == (7, "seg-00003.bin")
    assert lay.parse_version_key(lay.manifest(7)) == (7, "manifest.json")
    assert lay.parse_version_key("r/versions/7/x") is None
    assert lay.parse_version_key("other/versions/000000000007/x") is None
    assert lay.parse_keyframe_key(lay.keyframe(50)) == 50
    assert lay.parse_keyframe_key("r/keyframes/abc.safetensors") is None
    assert lay.is_segment_key(lay.segment(7, 3), 7)
    assert not lay.is_segment_key(lay.segment(7, 3), 8)
    assert not lay.is_segment_key(lay.manifest(7), 7)


def test_immutability():
    lay = RunLayout("r")
    assert not is_immutable(lay.head)
    assert not is_immutable(lay.writer)
    for key in (lay.run_json, lay.manifest(1), lay.segment(1, 0), lay.keyframe(0)):
        assert is_immutable(key)


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "-x", "x" * 129, "sp ace", "ü"])
def test_bad_run_names(bad):
    with pytest.raises(InvalidKey):
        validate_run_name(bad)


@pytest.mark.parametrize("bad", [-1, 10**12, True, 1.0])
def test_bad_versions(bad):
    with pytest.raises(InvalidKey):
        RunLayout("r").manifest(bad)
