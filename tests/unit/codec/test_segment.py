"""The segment format: golden bytes, header validation, and a corruption fuzz test."""

from __future__ import annotations

import contextlib
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, delta_stats, encode_delta, read_segment_header, state_digest
from deltarl.codec.segment import MAX_HEADER_BYTES, ChunkInfo, pack_segment
from deltarl.codec.stager import Stager
from deltarl.codec.tensors import TensorSpec
from deltarl.errors import (
    BaseMismatch,
    FormatError,
    IntegrityError,
    TensorMismatch,
    UnsupportedFormatVersion,
)

# A tiny fixed delta: bf16 [1.0, 2.0, -0.0, inf] -> [1.0+ulp, 2.0, -0.0, NaN payload 0x41];
# fp16 [[1, 2, -0], [inf, 0.5, 3]] -> [[1, 2+ulp, -0], [inf, 0.5, -3]] (a sign flip).
GOLDEN = {
    "ctx": (
        "44524c5302000000420000007ed0213e0200763002000000000001006201010400000000000000000001006802020200"
        "0000000000000300000000000000020000000c00000000040004021e01040006021907080c010000010000010100017f"
        "0000000100ff0000060101c08080fc000a0506010000010000010200011000000f0201c04080fffc40c50fa77d"
    ),
    "aurora": (
        "44524c5302000000420000004a7a28e90200763002000000000001006201010400000000000000000001006802020200"
        "0000000000000300000000000000020000000c00000000010004020801010006020802040003813fc17f020401040140"
        "00c298508f78"
    ),
    # sparse: b changes at 0 (+1) and 3 (+65: one large value, k_big_val 6); h at 1 (+1) and 5
    # (the sign flip, |d| = 2^15: k_big_val 15, sign 1). Rice gaps 0, 2 and 1, 3 (k_pos 0).
    "sparse": (
        "44524c53020000004200000031638ed80200763002000000000001006201010400000000000000000001006802020200"
        "0000000000000300000000000000020000000c00000000050004021a01050006021b0000060100000000000000010000"
        "01000001010001904080fc0000000f010000000000000001000001000001020001444080fffc40f594f18f"
    ),
}


def _tiny() -> tuple[dict, dict]:
    old = {
        "b": BF16(np.array([0x3F80, 0x4000, 0x8000, 0x7F80], dtype=np.uint16)),
        "h": np.array([1.0, 2.0, -0.0, np.inf, 0.5, 3.0], dtype=np.float16).reshape(2, 3),
    }
    new = {
        "b": BF16(np.array([0x3F81, 0x4000, 0x8000, 0x7FC1], dtype=np.uint16)),
        "h": np.array([1.0, 2.001953125, -0.0, np.inf, 0.5, -3.0], dtype=np.float16).reshape(2, 3),
    }
    return old, new


def _copy(state: dict) -> dict:
    return {k: BF16(v.bits.copy()) if isinstance(v, BF16) else v.copy() for k, v in state.items()}


@pytest.mark.parametrize("codec", sorted(GOLDEN))
def test_golden_bytes(codec: str) -> None:
    old, new = _tiny()
    (seg,) = encode_delta(old, new, base="v0", codec=codec)
    assert seg.hex() == GOLDEN[codec]
    state = _copy(old)
    st_ = Stager(state, base="v0")
    st_.add_segment(bytes.fromhex(GOLDEN[codec]))
    st_.finish().commit()
    assert state_digest(state) == state_digest(new)


def test_golden_prefix_and_header_fields() -> None:
    seg = bytes.fromhex(GOLDEN["aurora"])
    magic, version, flags, hlen, hcrc = struct.unpack_from("<4sHHII", seg, 0)
    assert (magic, version, flags) == (b"DRLS", 2, 0)
    assert hcrc == zlib.crc32(seg[16 : 16 + hlen])
    assert struct.unpack("<I", seg[-4:])[0] == zlib.crc32(seg[:-4])
    h = read_segment_header(seg)
    assert h.format_version == 2
    assert h.base == "v0"
    assert [(t.name, t.dtype, t.shape) for t in h.tensors] == [
        ("b", "bfloat16", (4,)),
        ("h", "float16", (2, 3)),
    ]
    assert h.chunks == (
        ChunkInfo("b", 0, 4, 2, "aurora", 8),
        ChunkInfo("h", 0, 6, 2, "aurora", 8),
    )
    stats = delta_stats([seg])
    assert (stats.changed_elements, stats.total_elements, stats.encoded_bytes) == (4, 10, len(seg))


# Two tensors: "model.b.weight" shares "model." with the name before it (shared 6, suffix
# "b.weight") and is unchanged, so the segment lists no chunk for it; the parser covers it whole.
GOLDEN_SHARED_UNCHANGED = (
    "44524c5302000000480000002e72652f020076300200000000000e006d6f64656c2e612e776569676874010102000000"
    "0000000006000800622e776569676874010101000000000000000100000006000000000100020105010201813fd3faf4"
    "6d"
)


def test_golden_shared_name_prefix_and_a_tensor_without_chunks() -> None:
    old = {"model.a.weight": BF16(np.array([0x3F80, 0x3F80], np.uint16)), "model.b.weight": BF16(np.array([0x4000], np.uint16))}
    new = {"model.a.weight": BF16(np.array([0x3F80, 0x3F81], np.uint16)), "model.b.weight": BF16(np.array([0x4000], np.uint16))}
    (seg,) = encode_delta(old, new, base="v0", codec="aurora")
    assert seg.hex() == GOLDEN_SHARED_UNCHANGED
    h = read_segment_header(seg)
    assert [t.name for t in h.tensors] == ["model.a.weight", "model.b.weight"]
    assert h.chunks == (
        ChunkInfo("model.a.weight", 0, 2, 1, "aurora", 5),
        ChunkInfo("model.b.weight", 0, 1, 0, "none", 0),
    )
    state = _copy(old)
    st_ = Stager(state, base="v0")
    st_.add_segment(seg)
    st_.finish().commit()
    assert state_digest(state) == state_digest(new)


def test_a_shared_prefix_longer_than_the_previous_name_is_rejected() -> None:
    seg = bytearray(bytes.fromhex(GOLDEN_SHARED_UNCHANGED))
    at = seg.index(bytes.fromhex("06000800"))
    seg[at] = 15  # "model.a.weight" has 14 bytes
    with pytest.raises(FormatError):
        read_segment_header(_refix(bytes(seg)))


def _refix(seg: bytes) -> bytes:
    """Recompute both checksums so a mutation reaches the parser and decoders (a forged segment)."""
    b = bytearray(seg)
    if len(b) < 20:
        return bytes(b)
    (hlen,) = struct.unpack_from("<I", b, 8)
    if 16 + hlen <= len(b) - 4:
        struct.pack_into("<I", b, 12, zlib.crc32(b[16 : 16 + hlen]))
    struct.pack_into("<I", b, len(b) - 4, zlib.crc32(b[:-4]))
    return bytes(b)


def test_specific_errors() -> None:
    old, new = _tiny()
    (seg,) = encode_delta(old, new, base="v0", codec="ctx")
    with pytest.raises(FormatError, match="magic"):
        read_segment_header(b"XXXX" + seg[4:])
    for version in (b"\x01\x00", b"\x06\x00"):  # format 1 (40-byte chunk entries, no cells) and 6 are refused
        with pytest.raises(UnsupportedFormatVersion):
            read_segment_header(_refix(seg[:4] + version + seg[6:]))
    with pytest.raises(IntegrityError):
        read_segment_header(seg[:-5] + bytes([seg[-5] ^ 1]) + seg[-4:])
    with pytest.raises(FormatError, match="too short"):
        read_segment_header(seg[:10])
    huge = bytearray(seg)
    struct.pack_into("<I", huge, 8, MAX_HEADER_BYTES + 1)
    with pytest.raises(FormatError, match="out of bounds"):
        read_segment_header(bytes(huge))
    with pytest.raises(BaseMismatch):
        Stager(_copy(old), base="v1").add_segment(seg)


def test_overlapping_chunks_in_one_segment_are_rejected() -> None:
    spec = TensorSpec("w", "float32", (10,))
    seg = pack_segment(
        "b", [spec], [ChunkInfo("w", 0, 6, 0, "none", 0), ChunkInfo("w", 5, 5, 0, "none", 0)], [b"", b""]
    )
    with pytest.raises(FormatError, match="overlap"):
        read_segment_header(seg)


def test_offsets_beyond_2_pow_32_are_representable() -> None:
    spec = TensorSpec("big", "bfloat16", (1 << 34,))
    chunks = [ChunkInfo("big", (1 << 33) + 7, 1 << 22, 0, "none", 0)]
    h = read_segment_header(pack_segment("b", [spec], chunks, [b""]))
    assert h.chunks[0].start == (1 << 33) + 7
    assert h.tensors[0].numel == 1 << 34


def _fuzz_inputs() -> tuple[dict, list[bytes]]:
    rng = np.random.default_rng(7)
    old = {
        "a": BF16(rng.integers(0, 1 << 16, 3000, dtype=np.uint16)),
        "b": rng.standard_normal((40, 25)).astype(np.float32),
        "c": rng.standard_normal(700).astype(np.float16),
    }
    new = _copy(old)
    new["a"].bits[::37] += 1
    new["b"].reshape(-1)[::11] *= 1.001
    new["c"][::3] = -new["c"][::3]
    segs = []
    for codec in ("ctx", "aurora", "rice", "dense", "sparse", "ctxs"):
        segs += encode_delta(old, new, base="base-1", codec=codec, segment_bytes=1500)
    return old, segs


FUZZ_OLD, FUZZ_SEGS = _fuzz_inputs()
ALLOWED = (FormatError, BaseMismatch, TensorMismatch)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corruption_fuzz_raises_only_our_errors(data: st.DataObject) -> None:
    seg = bytearray(data.draw(st.sampled_from(FUZZ_SEGS)))
    op = data.draw(st.sampled_from(["flip", "flips", "truncate", "extend", "zero"]))
    if op == "flip":
        i = data.draw(st.integers(0, len(seg) - 1))
        seg[i] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "flips":
        for _ in range(data.draw(st.integers(2, 8))):
            seg[data.draw(st.integers(0, len(seg) - 1))] = data.draw(st.integers(0, 255))
    elif op == "truncate":
        del seg[data.draw(st.integers(0, len(seg) - 1)) :]
    elif op == "extend":
        seg += data.draw(st.binary(min_size=1, max_size=40))
    else:
        i = data.draw(st.integers(0, len(seg) - 1))
        seg[i : i + data.draw(st.integers(1, 64))] = bytes(min(64, len(seg) - i))
    forged = data.draw(st.booleans())
    blob = _refix(bytes(seg)) if forged else bytes(seg)
    state = _copy(FUZZ_OLD)
    before = state_digest(state)
    stager = Stager(state, base="base-1")
    try:
        stager.add_segment(blob)
    except ALLOWED:
        pass
    else:
        assert forged or bytes(seg) in FUZZ_SEGS, "a corrupted segment passed its checksum"
    assert state_digest(state) == before  # staging never writes
    with contextlib.suppress(FormatError):
        delta_stats([blob])
