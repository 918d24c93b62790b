"""Segment format 4: the header after the base id as one zstd frame, the chunk table in it as
columns. Golden bytes (read, and the writer's header content and payloads), the columns' round trip,
and corrupt frames and tables refused by name."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, encode_delta, read_segment_header, stage_delta, state_digest
from deltarl.codec import delta_layout as layout
from deltarl.codec.chunk import zstd
from deltarl.codec.chunk_table import FIELDS
from deltarl.codec.ctxs import LAYOUT_COUNTS
from deltarl.codec.segment import MAX_HEADER_BYTES, column_table, table_columns
from deltarl.codec.stager import Stager
from deltarl.errors import BaseMismatch, FormatError, TensorMismatch

# A 64 x 64 bfloat16 tensor (arithmetic bits, no randomness) coded ctxs in its 64 cells of 8 x 8:
# 64 chunk entries (433 bytes of column varints) and the record in a 250-byte header body, where
# format 3's is 504.
GOLDEN_V4 = (
    "44524c5304000000fa000000af2f12db0200763028b52ffd60f400650700465032299029e973b4b4545a1aedea92ab8b"
    "9595e5e2e2c6efb57eafbd6ce8705fed7b6b1191b6a5945ba624652f0027001e006ecc78b9c94d279de422171d748b84"
    "c202e2c1a0e020f7b8e79c735ce39a631c1a080618160402ec268ce18bb0b30bf864182e9f7cba74c9238f0e7df1c493"
    "254b1c7164e8903ffedcb9e38d37670cf1c38f1d3bdc089aa9ca2ac0ffa7114fddbe8d7854563cfaa88e3fdaf6115161"
    "1edae9fbd76696b83073e24182998f08a87b8a55acd55db53453337775972abb74557777d752d4662a1a0c0029418115"
    "97a262a41c6c66e35b6add0492c80492314ef2156ec19800600100030086bfeab105262073000002001fc00640000200"
    "a3f8208600000300277fe80645487384000200c7c00550000100fe06700001003f8400000200677012600002006f80c2"
    "0000030092ffd05135873a000001003f4500000100cf35000002009fe08446000001007c4000030066ffa00760461880"
    "0002008dfdb0551c0000020087fc601540000002001ff0a45500000200a3f8725400000200bfc0455900000200c7c024"
    "90000100fc16000001003f66000002006f80a4000002006f8097000002008bf80689000002001fc00460000200c7c006"
    "800002005ff06605000002002fe016a0000200dfe0016350000002008bf8445a000002004fe018600002005f806b0000"
    "0200cfe03486000002009fc0d2700002001ff030760000030051bffa96840551900002005f803d0000020037fc369640"
    "0000020033f83436000002007f8065d000020093f836180000020037f8165a000001009f36000001003f3600000200bf"
    "807610000100fc56000001009f74000002004fe03a70000200cbfd306741c0000100bc400002001ff0826300000200c7"
    "f09445000002005f8089000002006ff0069c0000020031fe4608500000030075fd40045042cc0002008bf80853000003"
    "0019ff80504597000002008fc003600002002fe006c00002006dfa8cd1a0000200bf80a6301837e0bf"
)


def _pair() -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(64 * 64, dtype=np.int64)
    old = (0x3C00 + (i * 2654435761 % 0x0400)).astype(np.uint16)
    new = old.copy()
    new[(i * 40503) % 97 < 5] += 1
    new[(i * 7919) % 389 == 0] -= 9
    return old.reshape(64, 64), new.reshape(64, 64)


def _encode(monkeypatch: pytest.MonkeyPatch) -> bytes:
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 1)
    monkeypatch.setattr(layout, "RECORD_LAYOUT", LAYOUT_COUNTS)  # format 4's records (the encoder writes 5)
    monkeypatch.setattr(layout, "CELL_MIN_CHANGES", 1)
    old, new = _pair()
    (seg,) = encode_delta({"w": BF16(old)}, {"w": BF16(new)}, base="v0", codec="ctxs")
    return seg


def test_golden_format4_reads_and_stages() -> None:
    seg = bytes.fromhex(GOLDEN_V4)
    h = read_segment_header(seg)
    assert h.format_version == 4
    assert h.chunk_table_bytes == 433
    assert h.payload_offset == 16 + 250
    assert sorted(c.cell for c in h.chunks) == list(range(64))
    assert all(c.codec == "ctxs" and c.start == 0 and c.count == 64 for c in h.chunks)
    old, new = _pair()
    state = {"w": BF16(old.copy())}
    stage_delta(state, [seg], base="v0").commit()
    assert np.array_equal(state["w"].bits, new)


def test_writer_gives_the_golden_table_and_payloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frame's bytes are the zstd library's; what it holds, and every other byte, are ours."""
    from deltarl.codec.segment import _inflate

    seg, gold = _encode(monkeypatch), bytes.fromhex(GOLDEN_V4)
    a, b = read_segment_header(seg), read_segment_header(gold)
    assert a.format_version == 4
    for f in ("tensor", "cell", "codec", "start", "count", "changed", "nbytes", "offset"):
        assert np.array_equal(getattr(a.table, f), getattr(b.table, f)), f
    assert seg[a.payload_offset : -4] == gold[b.payload_offset : -4]
    assert a.classes == b.classes
    assert _inflate(memoryview(seg)[20 : a.payload_offset]) == _inflate(memoryview(gold)[20 : b.payload_offset])


def test_few_chunks_keep_the_row_table() -> None:
    """Below 8 chunks a zstd frame's own header outweighs what the columns save: format 2 or 3."""
    old = np.arange(256, dtype=np.uint16) + 0x3C00
    new = old.copy()
    new[::5] += 1
    (seg,) = encode_delta({"w": BF16(old)}, {"w": BF16(new)}, base="v0")
    assert read_segment_header(seg).format_version in (2, 3)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 65 * 8 - 1), st.integers(0, 2**40),
                               st.integers(1, 2**40), st.integers(0, 2**20), st.integers(0, 2**30)),
                     min_size=1, max_size=200))
def test_columns_round_trip(rows: list[tuple[int, ...]]) -> None:
    fields = np.array(rows, dtype=np.uint64)
    assert np.array_equal(table_columns(memoryview(column_table(fields)), len(rows), 41), fields)


def test_corrupt_tables_and_frames_are_refused_by_name() -> None:
    from deltarl.codec.bitio import leb128_encode
    from deltarl.codec.segment import _inflate

    good = column_table(np.array([[0, 8, 0, 4, 1, 3], [1, 8, 0, 4, 0, 0]], dtype=np.uint64))
    with pytest.raises(FormatError, match="exactly"):
        table_columns(memoryview(good), 3, 2)  # fewer varints than 6 a chunk
    with pytest.raises(FormatError, match="tensor index"):
        table_columns(memoryview(good), 2, 1)  # the second chunk's tensor is not in a table of one
    minus = leb128_encode(np.array([3, 0, 8, 8, 0, 0, 4, 4, 1, 0, 3, 0], dtype=np.uint64))  # zigzag 3 = -2
    with pytest.raises(FormatError, match="tensor index"):
        table_columns(memoryview(minus), 2, 2)
    frame = zstd(b"header")
    assert _inflate(memoryview(frame)) == b"header"
    with pytest.raises(FormatError, match="corrupt"):
        _inflate(memoryview(frame + b"\x00"))  # bytes after the frame
    with pytest.raises(FormatError, match="corrupt"):
        _inflate(memoryview(frame[:-2]))  # truncated
    with pytest.raises(FormatError, match="declares"):
        _inflate(memoryview(zstd(bytes(MAX_HEADER_BYTES + 1))))
    assert FIELDS == 6


def _refix(seg: bytes) -> bytes:
    """The segment with its header and whole-segment crc32s recomputed (a forged, well-framed one)."""
    hlen = struct.unpack_from("<I", seg, 8)[0]
    out = bytearray(seg)
    struct.pack_into("<I", out, 12, zlib.crc32(out[16 : 16 + hlen]))
    struct.pack_into("<I", out, len(out) - 4, zlib.crc32(out[:-4]))
    return bytes(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_corrupt_format4_header_raises_only_our_errors(data: st.DataObject) -> None:
    """Bytes of the header (the frame among them) changed, the crc32s forged to match: a FormatError
    (or a mismatch) names it, or it stages (a forged header can still describe a valid delta); the
    state is never written while staging."""
    gold = bytes.fromhex(GOLDEN_V4)
    hlen = struct.unpack_from("<I", gold, 8)[0]
    seg = bytearray(gold)
    for _ in range(data.draw(st.integers(1, 4))):
        seg[data.draw(st.integers(16, 16 + hlen - 1))] = data.draw(st.integers(0, 255))
    old, _ = _pair()
    state = {"w": BF16(old.copy())}
    before = state_digest(state)
    stager = Stager(state, base="v0")
    try:
        stager.add_segment(_refix(bytes(seg)))
        stager.finish()
    except (FormatError, BaseMismatch, TensorMismatch):
        pass
    assert state_digest(state) == before  # staging never writes


def test_a_table_of_other_codecs_as_columns_needs_no_records() -> None:
    """Format 4 without ctxs chunks (a row shard's unchanged rows, say): no class record asked for."""
    from deltarl.codec.segment import ChunkInfo, pack_segment
    from deltarl.codec.tensors import TensorSpec

    rows = [ChunkInfo("w", 64 * i, 64, 0, "none", 0) for i in range(63)]  # not the whole tensor: listed
    h = read_segment_header(pack_segment("b", [TensorSpec("w", "bfloat16", (64, 64))], rows, [b""] * 63))
    assert h.format_version == 4
    assert h.classes == {}
    assert [c.start for c in h.chunks] == [64 * i for i in range(63)]
