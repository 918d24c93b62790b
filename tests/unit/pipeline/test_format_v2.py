"""Run-namespace format v2, pinned byte by byte: manifest, WRITER record, keyframe part header,
piece hashes, the blocks64k-v2 state digest, and keyframe coverage (exactly once)."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from deltarl.codec import BF16
from deltarl.codec.tensors import TensorSpec, state_digest
from deltarl.errors import FormatError, IntegrityError
from deltarl.pipeline.canonical import canonical_json
from deltarl.pipeline.claim import WriterClaim
from deltarl.pipeline.keyframe import part_header, plan_parts
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import (
    DeltaStatsRecord,
    Keyframe,
    KeyframePart,
    Manifest,
    ObjectRef,
    StateDigest,
    TensorEntry,
)
from deltarl.pipeline.pieces import PieceHasher

LAY = RunLayout("r")
SHA = "ab" * 32
P = "cd" * 32
KIB64 = 64 << 10


def _v2_manifest(version: int = 0, **kw) -> Manifest:
    fields = dict(
        run="r",
        version=version,
        step=0,
        parent=None if version == 0 else "cd" * 32,
        kind="keyframe" if version == 0 else "delta",
        base_version=None if version == 0 else version - 1,
        segments=() if version == 0 else (ObjectRef(LAY.segment(version, 0, epoch=2), SHA, 12, KIB64, (P,)),),
        keyframe=Keyframe((KeyframePart(LAY.keyframe_part(0, 0, epoch=2), SHA, 100, KIB64, (P,), (("a", 0, 6),)),))
        if version == 0
        else None,
        stats=DeltaStatsRecord(3, 10, 12, 20),
        state_digest=StateDigest("blocks64k-v2", SHA) if version == 0 else None,
        codec="auto",
        created_at="2026-12-02T13:00:00.000Z",
        writer_id="w1",
    )
    fields.update(kw)
    return Manifest(**fields)


def test_golden_v2_manifest_bytes():
    m = _v2_manifest()
    data = m.to_bytes()
    assert data == (
        b'{"base_version":null,"codec":"auto","created_at":"2026-12-02T13:00:00.000Z","format_version":2,'
        b'"keyframe":{"parts":[{"key":"r/keyframes/000000000000/e000002-part-r000-000.safetensors",'
        b'"piece_size":65536,"pieces":["' + P.encode() + b'"],"sha256":"' + SHA.encode() + b'","size":100,'
        b'"tensors":[["a",0,6]]}]},'
        b'"kind":"keyframe","parent":null,"run":"r","segments":[],'
        b'"state_digest":{"algo":"blocks64k-v2","value":"' + SHA.encode() + b'"},'
        b'"stats":{"changed_elements":3,"encoded_bytes":12,"full_bytes":20,"total_elements":10},'
        b'"step":0,"version":0,"writer_id":"w1"}'
    )
    assert Manifest.from_bytes(data) == m
    delta = _v2_manifest(1)
    assert b'"segments":[{"key":"r/versions/000000000001/e000002-seg-r000-00000.bin","piece_size":65536,' in delta.to_bytes()
    assert Manifest.from_bytes(delta.to_bytes()) == delta


def test_golden_v2_writer_bytes():
    claim = WriterClaim("w", 1, 2, "host", 3, epoch=7)
    data = claim.to_bytes()
    assert data == (
        b'{"acquired_at_ms":1,"epoch":7,"expires_at_ms":2,"format_version":2,"host":"host","pid":3,"writer_id":"w"}'
    )
    assert WriterClaim.from_bytes(data) == claim
    v1 = b'{"acquired_at_ms":1,"expires_at_ms":2,"format_version":1,"host":"host","pid":3,"writer_id":"w"}'
    assert WriterClaim.from_bytes(v1).epoch == 0  # read-compat: the next acquire writes epoch 1
    with pytest.raises(FormatError):
        WriterClaim.from_bytes(data.replace(b'"epoch":7', b'"epoch":0'))
    with pytest.raises(FormatError):
        WriterClaim.from_bytes(v1.replace(b'"format_version":1', b'"format_version":2'))  # v2 needs an epoch


def test_golden_keyframe_part_header():
    specs = {"a": TensorSpec("a", "bfloat16", (2, 3)), "b": TensorSpec("b", "float32", (10,))}
    header = part_header([("a", 0, 6), ("b", 4, 5)], specs)
    body = (
        b'{"__metadata__":{"deltarl.format":"keyframe-part/2","deltarl.ranges":"[[\\"a\\",0,6],[\\"b\\",4,5]]"},'
        b'"a":{"data_offsets":[0,12],"dtype":"BF16","shape":[2,3]},'
        b'"b":{"data_offsets":[12,32],"dtype":"F32","shape":[5]}}'
    )
    body += b" " * (-(8 + len(body)) % 8)
    assert header == struct.pack("<Q", len(body)) + body
    assert len(header) % 8 == 0
    json.loads(header[8:])  # standard safetensors: the JSON header parses as is


def test_keyframe_part_is_standard_safetensors():
    torch = pytest.importorskip("torch")
    from safetensors.torch import load

    from deltarl.pipeline.keyframe import iter_part

    state = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.arange(10, dtype=torch.float32)}
    specs = {n: TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in state.items()}
    data = b"".join(bytes(b) for b in iter_part(state, [("a", 0, 6), ("b", 4, 5)], specs))
    got = load(data)
    assert torch.equal(got["a"], state["a"])
    assert torch.equal(got["b"], state["b"][4:9])


def test_pieces_one_pass():
    data = bytes(range(256)) * 1000  # 256000 bytes: 3 full 64 KiB pieces and a short one
    ref = ObjectRef.of("k", data, piece_size=KIB64)
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    assert ref.pieces == tuple(hashlib.sha256(data[i : i + KIB64]).hexdigest() for i in range(0, len(data), KIB64))
    h = PieceHasher(KIB64)
    for i in range(0, len(data), 1000):  # any buffer sizes give the same pieces
        h.update(data[i : i + 1000])
    assert h.finish() == (ref.sha256, ref.size, list(ref.pieces))
    assert ObjectRef.of("e", b"", piece_size=KIB64).pieces == ()
    bad = bytearray(data)
    bad[KIB64 + 5] ^= 1
    v = ref.verifier("manifest m")
    with pytest.raises(IntegrityError, match="k: piece 1"):
        v.update(bad)
    v = ref.verifier("manifest m")
    v.update(data[:-1])
    with pytest.raises(IntegrityError, match="k: truncated"):
        v.finish()


@pytest.mark.parametrize(
    "kw",
    [
        {"piece_size": 1000},  # not a power of two
        {"piece_size": 32 << 10},  # below 64 KiB
        {"pieces": (P, P)},  # count disagrees with ceil(size / piece_size)
        {"pieces": ("zz" * 32,)},
    ],
)
def test_bad_piece_refs(kw):
    fields = {"key": "k", "sha256": SHA, "size": 100, "piece_size": KIB64, "pieces": (P,)} | kw
    with pytest.raises(FormatError):
        ObjectRef(**fields)


def test_keyframe_coverage_exactly_once():
    tensors = (TensorEntry("a", "bfloat16", (2, 3)), TensorEntry("b", "float32", (10,)))

    def kf(*ranges):
        return Keyframe(tuple(KeyframePart(LAY.keyframe_part(0, i, epoch=1), SHA, 1, KIB64, (P,), r) for i, r in enumerate(ranges)))

    kf((("a", 0, 6), ("b", 0, 4)), (("b", 4, 6),)).check_covers(tensors, "m")
    with pytest.raises(FormatError, match="overlaps"):
        kf((("a", 0, 6), ("b", 0, 5)), (("b", 4, 6),)).check_covers(tensors, "m")
    with pytest.raises(FormatError, match="uncovered"):
        kf((("a", 0, 6), ("b", 0, 3)), (("b", 4, 6),)).check_covers(tensors, "m")
    with pytest.raises(FormatError, match=r"elements 6\.\.10"):
        kf((("a", 0, 6), ("b", 0, 6)),).check_covers(tensors, "m")
    with pytest.raises(FormatError, match="does not list"):
        kf((("a", 0, 6), ("b", 0, 10), ("c", 0, 1)),).check_covers(tensors, "m")
    with pytest.raises(FormatError, match="overlaps"):  # the manifest alone already rejects overlap
        _v2_manifest(keyframe=kf((("a", 0, 6),), (("a", 3, 3),)))


def test_v2_manifest_rejects_v1_shapes():
    with pytest.raises(FormatError, match="pieces"):
        _v2_manifest(1, segments=(ObjectRef(LAY.segment(1, 0, epoch=1), SHA, 12),))
    with pytest.raises(FormatError, match="segment key"):
        _v2_manifest(1, segments=(ObjectRef(LAY.segment_v1(1, 0), SHA, 12, KIB64, (P,)),))
    with pytest.raises(FormatError, match="part key"):
        _v2_manifest(keyframe=Keyframe((KeyframePart(LAY.keyframe(0), SHA, 100, KIB64, (P,), (("a", 0, 6),)),)))
    with pytest.raises(FormatError, match="unknown algo"):
        StateDigest("md5", SHA)


def test_blocks64k_v2_digest_spec():
    bits = np.arange(70_000, dtype=np.uint16)  # 140000 bytes: blocks of 65536, 65536, 8928
    state = {"w": BF16(bits), "e": np.zeros((0, 4), np.float32)}
    raw = bits.tobytes()
    leaves = b"".join(hashlib.sha256(raw[i : i + KIB64]).digest() for i in range(0, len(raw), KIB64))
    want = hashlib.sha256()
    for name, th in (("e", hashlib.sha256(b"").digest()), ("w", hashlib.sha256(leaves).digest())):
        want.update(struct.pack("<I", len(name)) + name.encode() + th)
    assert state_digest(state) == want.hexdigest() == state_digest(state, "blocks64k-v2", threads=1)
    assert state_digest(state, "sha256-seq-v1") != want.hexdigest()


def test_plan_parts_cuts_at_tensors_and_rows():
    specs = [TensorSpec("a", "bfloat16", (10, 4)), TensorSpec("b", "bfloat16", (3,)), TensorSpec("c", "float32", (0,))]
    assert plan_parts(specs, part_bytes=1000) == [(("a", 0, 40), ("b", 0, 3), ("c", 0, 0))]
    parts = plan_parts(specs, part_bytes=32)  # 'a' is 80 bytes: split by rows of 4 elements (8 bytes)
    assert parts == [(("a", 0, 16),), (("a", 16, 16),), (("a", 32, 8), ("b", 0, 3), ("c", 0, 0))]
    assert canonical_json([list(r) for r in parts[0]]) == b'[["a",0,16]]'
