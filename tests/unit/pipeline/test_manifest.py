"""Manifest, run.json and HEAD records: canonical bytes, version ids, strict parsing.

The manifests here are format_version 1 (read-compat: readers still read v1 runs); the v2 records
are pinned in test_format_v2.py."""

from __future__ import annotations

import hashlib
import json

import pytest

from deltarl.errors import FormatError, UnsupportedFormatVersion
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import (
    DeltaStatsRecord,
    HeadRecord,
    Keyframe,
    KeyframePart,
    Manifest,
    ObjectRef,
    RunInfo,
    StateDigest,
    TensorEntry,
    canonical_json,
    version_id,
)

LAY = RunLayout("r")
SHA = "ab" * 32


def _manifest(version: int = 1, **kw) -> Manifest:
    fields = dict(
        run="r",
        version=version,
        step=version * 10,
        parent=None if version == 0 else "cd" * 32,
        kind="keyframe" if version == 0 else "delta",
        base_version=None if version == 0 else version - 1,
        segments=() if version == 0 else (ObjectRef(LAY.segment_v1(version, 0), SHA, 12),),
        keyframe=Keyframe((KeyframePart(LAY.keyframe(0), SHA, 100),)) if version == 0 else None,
        stats=DeltaStatsRecord(3, 10, 12, 20),
        state_digest=StateDigest("sha256-seq-v1", SHA) if version == 0 else None,
        codec="auto",
        created_at="2026-12-02T13:00:00.000Z",
        writer_id="w1",
        format_version=1,
    )
    fields.update(kw)
    return Manifest(**fields)


def test_canonical_bytes_and_version_id():
    m = _manifest()
    data = m.to_bytes()
    assert b" " not in data
    assert data == canonical_json(json.loads(data))
    assert list(json.loads(data)) == sorted(json.loads(data))
    assert version_id(data) == hashlib.sha256(data).hexdigest() == m.version_id
    assert Manifest.from_bytes(data) == m


def test_golden_manifest_bytes():
    data = _manifest(0).to_bytes()
    assert data == (
        b'{"base_version":null,"codec":"auto","created_at":"2026-12-02T13:00:00.000Z","format_version":1,'
        b'"keyframe":{"key":"r/keyframes/000000000000.safetensors","sha256":"' + SHA.encode() + b'","size":100},'
        b'"kind":"keyframe","parent":null,"run":"r","segments":[],"state_digest":"' + SHA.encode() + b'",'
        b'"stats":{"changed_elements":3,"encoded_bytes":12,"full_bytes":20,"total_elements":10},'
        b'"step":0,"version":0,"writer_id":"w1"}'
    )


def test_id_changes_with_any_field():
    a = _manifest()
    assert a.version_id != _manifest(step=11).version_id
    assert a.version_id != _manifest(parent="ef" * 32).version_id


def test_non_canonical_bytes_rejected():
    data = _manifest().to_bytes()
    pretty = json.dumps(json.loads(data), indent=1).encode()
    with pytest.raises(FormatError, match="canonical"):
        Manifest.from_bytes(pretty)


@pytest.mark.parametrize("fv", [0, 3, "1", None, True])
def test_unknown_format_version_rejected(fv):
    obj = json.loads(_manifest().to_bytes())
    obj["format_version"] = fv
    with pytest.raises(UnsupportedFormatVersion):
        Manifest.from_bytes(canonical_json(obj))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(extra=1),
        lambda o: o.pop("step"),
        lambda o: o.update(step=-1),
        lambda o: o.update(step=True),
        lambda o: o.update(version="1"),
        lambda o: o.update(parent="xyz"),
        lambda o: o.update(parent=None),
        lambda o: o.update(base_version=5),
        lambda o: o.update(kind="weird"),
        lambda o: o.update(run="a/b"),
        lambda o: o["segments"][0].update(key="r/versions/000000000002/seg-00000.bin"),
        lambda o: o["segments"][0].update(key="elsewhere/seg-00000.bin"),
        lambda o: o["segments"][0].update(sha256="AB" * 32),
        lambda o: o["segments"][0].update(size=-1),
        lambda o: o["segments"].append(dict(o["segments"][0])),
        lambda o: o["stats"].update(changed_elements=11),
        lambda o: o.update(keyframe={"key": LAY.keyframe(0), "sha256": SHA, "size": 1}),
    ],
)
def test_strict_validation(mutate):
    obj = json.loads(_manifest().to_bytes())
    mutate(obj)
    with pytest.raises(FormatError):
        Manifest.from_bytes(canonical_json(obj))


@pytest.mark.parametrize("data", [b"", b"\xff", b"[]", b"{", b"null", b"1" * 100])
def test_garbage_raises_format_error(data):
    with pytest.raises(FormatError):
        Manifest.from_bytes(data)


def test_size_cap():
    with pytest.raises(FormatError, match="cap"):
        Manifest.from_bytes(b" " * (9 << 20))


def test_version_zero_rules():
    _manifest(0)
    with pytest.raises(FormatError):
        _manifest(0, kind="delta", keyframe=None)
    with pytest.raises(FormatError):
        _manifest(0, parent="cd" * 32)
    with pytest.raises(FormatError, match="digest"):
        _manifest(0, state_digest=None)


def test_run_info_roundtrip():
    info = RunInfo(
        run="r",
        tensors=(TensorEntry("a", "bfloat16", (2, 3)), TensorEntry("b", "float32", ())),
        codec="auto",
        keyframe_interval=50,
        digest_interval=10,
        segment_bytes=1 << 20,
        created_at="t",
    )
    assert RunInfo.from_bytes(info.to_bytes()) == info
    assert info.total_elements == 7
    with pytest.raises(FormatError):
        RunInfo(**{**info.__dict__, "tensors": (TensorEntry("b", "float32", ()), TensorEntry("a", "float32", ()))})
    with pytest.raises(FormatError):
        RunInfo(**{**info.__dict__, "tensors": (TensorEntry("a", "int8", ()),)})
    obj = json.loads(info.to_bytes())
    obj["format_version"] = 9
    with pytest.raises(UnsupportedFormatVersion):
        RunInfo.from_bytes(canonical_json(obj))


def test_head_roundtrip():
    head = HeadRecord(3, SHA, "w")
    assert HeadRecord.from_bytes(head.to_bytes()) == head
    with pytest.raises(FormatError):
        HeadRecord.from_bytes(b'{"format_version":1,"version":3}')
    with pytest.raises(FormatError):
        HeadRecord(3, "nope")
