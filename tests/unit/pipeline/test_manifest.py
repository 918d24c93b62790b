"""Manifest, run.json and HEAD records: canonical bytes, version ids, strict parsing (the golden
bytes of format 3 are pinned in test_format_v3.py)."""

from __future__ import annotations

import json

import blake3
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


def _ref(key: str, size: int) -> ObjectRef:
    return ObjectRef.of(key, bytes(size), piece_size=64 << 10)


def _part(key: str, size: int, tensors: tuple) -> KeyframePart:
    r = _ref(key, size)
    return KeyframePart(key=r.key, root=r.root, size=r.size, piece_size=r.piece_size, pieces=r.pieces, tensors=tensors)


def _manifest(version: int = 1, **kw) -> Manifest:
    fields = dict(
        run="r",
        version=version,
        step=version * 10,
        parent=None if version == 0 else "cd" * 32,
        kind="keyframe" if version == 0 else "delta",
        base_version=None if version == 0 else version - 1,
        segments=() if version == 0 else (_ref(LAY.segment(version, 0, epoch=1), 12),),
        keyframe=Keyframe((_part(LAY.keyframe_part(0, 0, epoch=1), 100, (("a", 0, 50),)),)) if version == 0 else None,
        stats=DeltaStatsRecord(3, 10, 12, 20),
        state_digest=StateDigest("blake3-stream64k", SHA) if version == 0 else None,
        codec="auto",
        created_at="2026-12-02T13:00:00.000Z",
        writer_id="w1",
    )
    fields.update(kw)
    return Manifest(**fields)


def test_canonical_bytes_and_version_id():
    m = _manifest()
    data = m.to_bytes()
    assert b" " not in data
    assert data == canonical_json(json.loads(data))
    assert list(json.loads(data)) == sorted(json.loads(data))
    assert version_id(data) == blake3.blake3(data).hexdigest() == m.version_id
    assert Manifest.from_bytes(data) == m


def test_id_changes_with_any_field():
    a = _manifest()
    assert a.version_id != _manifest(step=11).version_id
    assert a.version_id != _manifest(parent="ef" * 32).version_id


def test_non_canonical_bytes_rejected():
    data = _manifest().to_bytes()
    pretty = json.dumps(json.loads(data), indent=1).encode()
    with pytest.raises(FormatError, match="canonical"):
        Manifest.from_bytes(pretty)


@pytest.mark.parametrize("fv", [0, 1, 2, 4, "3", None, True])
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
        lambda o: o["segments"][0].update(key="r/versions/000000000002/e000001-seg-r000-00000.bin"),
        lambda o: o["segments"][0].update(key="r/versions/000000000001/seg-00000.bin"),
        lambda o: o["segments"][0].update(key="elsewhere/seg-00000.bin"),
        lambda o: o["segments"][0].update(blake3_root="AB" * 32),
        lambda o: o["segments"][0].update(blake3_root=SHA),
        lambda o: o["segments"][0]["blake3_pieces"].append(SHA),
        lambda o: o["segments"][0].update(size=-1),
        lambda o: o["segments"][0].update(size=13),
        lambda o: o["segments"].append(dict(o["segments"][0])),
        lambda o: o["stats"].update(changed_elements=11),
        lambda o: o.update(keyframe={"parts": []}),
        lambda o: o.update(state_digest="ab" * 32),
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
        HeadRecord.from_bytes(b'{"format_version":3,"version":3}')
    with pytest.raises(FormatError):
        HeadRecord(3, "nope")
