"""Run-namespace format 3, pinned byte by byte: manifest, WRITER, HEAD and run.json records, the
keyframe part header, the BLAKE3 block/piece/root tree, the blake3-stream64k state digest (checked
against an independent reimplementation of docs/FORMAT.md here), aligned keyframe parts whose
digest is composed from their own block hashes, and keyframe coverage (exactly once)."""

from __future__ import annotations

import json
import struct

import blake3
import numpy as np
import pytest

from deltarl.codec import BF16
from deltarl.codec.tensors import TensorSpec, state_digest
from deltarl.errors import FormatError, IntegrityError, UnsupportedFormatVersion
from deltarl.pipeline.canonical import canonical_json
from deltarl.pipeline.claim import WriterClaim
from deltarl.pipeline.keyframe import keyframe_digest, part_header, plan_parts, write_part
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import (
    DeltaStatsRecord,
    HeadRecord,
    Keyframe,
    KeyframePart,
    Manifest,
    ObjectRef,
    StateDigest,
    TensorEntry,
    version_id,
)
from deltarl.pipeline.pieces import PieceHasher
from deltarl.storage import MemoryStore

LAY = RunLayout("r")
KIB64 = 64 << 10


# --- an independent reading of docs/FORMAT.md ("Hashes", "State digest") -----------------------------


def _leaf(b: bytes) -> bytes:
    return blake3.blake3(b).digest()


def _piece(b: bytes) -> str:
    leaves = b"".join(_leaf(b[i : i + KIB64]) for i in range(0, len(b), KIB64))
    return blake3.blake3(leaves, derive_key_context="deltarl 2026 format 3 piece").hexdigest()


def _root(size: int, ps: int, pieces: list[str]) -> str:
    body = struct.pack("<QI", size, ps) + b"".join(bytes.fromhex(p) for p in pieces)
    return blake3.blake3(body, derive_key_context="deltarl 2026 format 3 object root").hexdigest()


def _digest(tensors: list[tuple[str, int, tuple[int, ...], bytes]]) -> str:
    table = struct.pack("<I", len(tensors))
    for name, code, shape, _ in tensors:
        table += struct.pack("<I", len(name)) + name.encode() + struct.pack("<BB", code, len(shape))
        table += struct.pack(f"<{len(shape)}Q", *shape)
    stream = b"".join(raw for *_, raw in tensors)
    leaves = b"".join(_leaf(stream[i : i + KIB64]) for i in range(0, len(stream), KIB64))
    return blake3.blake3(table + leaves, derive_key_context="deltarl 2026 format 3 state digest").hexdigest()


def _ref(key: str, size: int, ps: int = KIB64) -> ObjectRef:
    return ObjectRef.of(key, bytes(size), piece_size=ps)


def _part(key: str, size: int, tensors: tuple) -> KeyframePart:
    r = _ref(key, size)
    return KeyframePart(key=r.key, root=r.root, size=r.size, piece_size=r.piece_size, pieces=r.pieces, tensors=tensors)


def _manifest(version: int = 0, **kw) -> Manifest:
    fields = dict(
        run="r",
        version=version,
        step=0,
        parent=None if version == 0 else "cd" * 32,
        kind="keyframe" if version == 0 else "delta",
        base_version=None if version == 0 else version - 1,
        segments=() if version == 0 else (_ref(LAY.segment(version, 0, epoch=2), 12),),
        keyframe=Keyframe((_part(LAY.keyframe_part(0, 0, epoch=2), 100, (("a", 0, 6),)),)) if version == 0 else None,
        stats=DeltaStatsRecord(3, 10, 12, 20),
        state_digest=StateDigest("blake3-stream64k", "ab" * 32) if version == 0 else None,
        codec="auto",
        created_at="2026-12-02T13:00:00.000Z",
        writer_id="w1",
    )
    fields.update(kw)
    return Manifest(**fields)


def test_golden_manifest_bytes_and_version_id():
    m = _manifest()
    data = m.to_bytes()
    part = m.keyframe.parts[0]
    piece = _piece(bytes(100))  # _ref hashes zeros
    assert part.pieces == (piece,)
    assert part.root == _root(100, KIB64, [piece])
    assert data == (
        b'{"base_version":null,"codec":"auto","created_at":"2026-12-02T13:00:00.000Z","format_version":3,'
        b'"keyframe":{"parts":[{"blake3_pieces":["' + piece.encode() + b'"],"blake3_root":"' + part.root.encode() + b'",'
        b'"key":"r/keyframes/000000000000/e000002-part-r000-000.safetensors","piece_size":65536,"size":100,'
        b'"tensors":[["a",0,6]]}]},'
        b'"kind":"keyframe","parent":null,"run":"r","segments":[],'
        b'"state_digest":{"algo":"blake3-stream64k","value":"' + b"ab" * 32 + b'"},'
        b'"stats":{"changed_elements":3,"encoded_bytes":12,"full_bytes":20,"total_elements":10},'
        b'"step":0,"version":0,"writer_id":"w1"}'
    )
    assert version_id(data) == blake3.blake3(data).hexdigest() == m.version_id  # b3sum of the manifest file
    assert Manifest.from_bytes(data) == m
    delta = _manifest(1)
    assert b'"segments":[{"blake3_pieces":["' in delta.to_bytes()
    assert Manifest.from_bytes(delta.to_bytes()) == delta


@pytest.mark.parametrize("fv", [0, 1, 2, 4, "3", None, True])
def test_only_format_3_is_read(fv):
    obj = json.loads(_manifest().to_bytes())
    obj["format_version"] = fv
    with pytest.raises(UnsupportedFormatVersion, match=r"r/versions/000000000000/manifest\.json"):
        Manifest.from_bytes(canonical_json(obj), where="r/versions/000000000000/manifest.json")
    claim = json.loads(WriterClaim("w", 1, 2, "host", 3, epoch=7).to_bytes())
    claim["format_version"] = fv
    with pytest.raises(UnsupportedFormatVersion, match="r/WRITER"):
        WriterClaim.from_bytes(canonical_json(claim), where="r/WRITER")
    head = json.loads(HeadRecord(3, "ab" * 32, "w").to_bytes())
    head["format_version"] = fv
    with pytest.raises(UnsupportedFormatVersion, match="r/HEAD"):
        HeadRecord.from_bytes(canonical_json(head), where="r/HEAD")


def test_golden_writer_and_head_bytes():
    claim = WriterClaim("w", 1, 2, "host", 3, epoch=7)
    data = claim.to_bytes()
    assert data == b'{"acquired_at_ms":1,"epoch":7,"expires_at_ms":2,"format_version":3,"host":"host","pid":3,"writer_id":"w"}'
    assert WriterClaim.from_bytes(data) == claim
    with pytest.raises(FormatError):
        WriterClaim.from_bytes(data.replace(b'"epoch":7', b'"epoch":0'))
    with pytest.raises(FormatError):
        WriterClaim.from_bytes(data.replace(b'"epoch":7,', b""))  # an epoch is required
    head = HeadRecord(3, "ab" * 32, "w")
    assert head.to_bytes() == b'{"format_version":3,"version":3,"version_id":"' + b"ab" * 32 + b'","writer_id":"w"}'


def test_golden_keyframe_part_header():
    specs = {"a": TensorSpec("a", "bfloat16", (2, 3)), "b": TensorSpec("b", "float32", (10,))}
    header = part_header([("a", 0, 6), ("b", 4, 5)], specs)
    body = (
        b'{"__metadata__":{"deltarl.format":"keyframe-part/3","deltarl.ranges":"[[\\"a\\",0,6],[\\"b\\",4,5]]"},'
        b'"a":{"data_offsets":[0,12],"dtype":"BF16","shape":[2,3]},'
        b'"b":{"data_offsets":[12,32],"dtype":"F32","shape":[5]}}'
    )
    body += b" " * (KIB64 - 8 - len(body))  # the data starts at the next multiple of 64 KiB
    assert header == struct.pack("<Q", len(body)) + body
    assert len(header) == KIB64
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


def test_piece_tree_one_pass():
    data = bytes(range(256)) * 1000  # 256000 bytes: 3 full 64 KiB pieces and a short one
    ref = ObjectRef.of("k", data, piece_size=KIB64)
    assert ref.pieces == tuple(_piece(data[i : i + KIB64]) for i in range(0, len(data), KIB64))
    assert ref.root == _root(len(data), KIB64, list(ref.pieces))
    big = ObjectRef.of("k", data, piece_size=128 << 10)  # a piece hashes its blocks' hashes
    assert big.pieces == tuple(_piece(data[i : i + (128 << 10)]) for i in range(0, len(data), 128 << 10))
    h = PieceHasher(KIB64)
    for i in range(0, len(data), 1000):  # any buffer sizes give the same pieces
        h.update(data[i : i + 1000])
    assert h.finish() == (ref.root, ref.size, list(ref.pieces))
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
        {"pieces": ("cd" * 32, "cd" * 32)},  # count disagrees with ceil(size / piece_size)
        {"pieces": ("zz" * 32,)},
        {"root": "ab" * 32},  # not the root of its pieces
    ],
)
def test_bad_piece_refs(kw):
    good = _ref("k", 100)
    fields = {"key": "k", "root": good.root, "size": 100, "piece_size": KIB64, "pieces": good.pieces} | kw
    with pytest.raises(FormatError):
        ObjectRef(**fields)


def test_keyframe_coverage_exactly_once():
    tensors = (TensorEntry("a", "bfloat16", (2, 3)), TensorEntry("b", "float32", (10,)))

    def kf(*ranges):
        return Keyframe(tuple(_part(LAY.keyframe_part(0, i, epoch=1), 1, r) for i, r in enumerate(ranges)))

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
        _manifest(keyframe=kf((("a", 0, 6),), (("a", 3, 3),)))


def test_manifest_rejects_other_keys_and_algos():
    with pytest.raises(FormatError, match="segment key"):
        _manifest(1, segments=(_ref("r/versions/000000000001/seg-00000.bin", 12),))
    with pytest.raises(FormatError, match="part key"):
        _manifest(keyframe=Keyframe((_part("r/keyframes/000000000000.safetensors", 100, (("a", 0, 6),)),)))
    with pytest.raises(FormatError, match="unknown algo"):
        StateDigest("blocks64k-v2", "ab" * 32)
    obj = json.loads(_manifest(1).to_bytes())
    obj["segments"][0]["sha256"] = obj["segments"][0].pop("blake3_root")
    with pytest.raises(FormatError):
        Manifest.from_bytes(canonical_json(obj))


def test_state_digest_spec():
    bits = np.arange(70_000, dtype=np.uint16)  # 140000 bytes: the stream's blocks cross into 'x'
    x = np.arange(5, dtype=np.float32)
    state = {"w": BF16(bits), "e": np.zeros((0, 4), np.float32), "x": x}
    want = _digest([("e", 3, (0, 4), b""), ("w", 1, (70_000,), bits.tobytes()), ("x", 3, (5,), x.tobytes())])
    assert state_digest(state) == want == state_digest(state, "blake3-stream64k", threads=1)
    assert state_digest({"w": BF16(bits.reshape(350, 200)), "e": state["e"], "x": x}) != want  # shapes are hashed
    with pytest.raises(ValueError, match="unknown state digest"):
        state_digest(state, "blocks64k-v2")


def test_plan_parts_cut_the_stream_at_64k_blocks():
    specs = [TensorSpec("a", "bfloat16", (100_000, 2)), TensorSpec("b", "bfloat16", (3,)), TensorSpec("c", "float32", (0,))]
    assert plan_parts(specs, part_bytes=1 << 30) == [(("a", 0, 200_000), ("b", 0, 3), ("c", 0, 0))]
    parts = plan_parts(specs, part_bytes=150_000)  # 400006 bytes in parts of 131072 (2 blocks)
    assert parts == [(("a", 0, 65536),), (("a", 65536, 65536),), (("a", 131072, 65536),),
                     (("a", 196608, 3392), ("b", 0, 3), ("c", 0, 0))]  # fmt: skip
    assert canonical_json([list(r) for r in parts[0]]) == b'[["a",0,65536]]'
    mixed = [TensorSpec("h", "bfloat16", (3,)), TensorSpec("w", "float32", (70_000,))]  # 'w' starts at byte 6
    cuts = plan_parts(mixed, part_bytes=KIB64)
    assert all((6 + 4 * r[0][1]) % 2 == 0 for r in cuts[1:])  # only element boundaries, never mid-element
    assert sum(c for p in cuts for n, _, c in p if n == "w") == 70_000


def test_aligned_parts_compose_the_state_digest():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(300, 257, generator=g).bfloat16(), "b": torch.randn(33, generator=g),
             "c": torch.randn(1000, 70, generator=g).bfloat16()}  # fmt: skip
    specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in sorted(state.items())]
    store = MemoryStore()
    parts = [write_part(store, LAY.keyframe_part(0, i, epoch=1), state, ranges, {s.name: s for s in specs}, piece_size=KIB64)
             for i, ranges in enumerate(plan_parts(specs, part_bytes=100_000))]  # fmt: skip
    assert len(parts) > 2
    assert keyframe_digest(specs, parts) == state_digest(state)
    unkept = [KeyframePart(**{**p.__dict__, "block_hashes": None}) for p in parts]
    assert keyframe_digest(specs, unkept) is None  # parts read back: no block hashes to compose from
