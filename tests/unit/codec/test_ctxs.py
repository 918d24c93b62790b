"""``ctxs`` (segment format 3): a tensor's cells share one class record. Golden bytes, round trips of
any record against any cell (extra classes included) on both kernel paths, every dtype, and clear
FormatErrors for corrupt or truncated records."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, encode_delta, read_segment_header, stage_delta, state_digest
from deltarl.codec import delta_layout as layout
from deltarl.codec.chunk import Changes
from deltarl.codec.classes import CELL_CLASS_FIELDS, CLASS_FIELDS, rank_classes
from deltarl.codec.ctxs import LAYOUT_COUNTS, LAYOUT_SHARES, ClassRecord, choose_record, decode, encode
from deltarl.errors import FormatError
from tests.unit.codec.test_regions import _cells_pair  # the same 16x16 pair as format 2's golden cells

torch = pytest.importorskip("torch")

# The 16 x 16 tensor of test_regions' GOLDEN_CELLS, coded ctxs with cells from 1 element: cells 0, 1,
# 8, 9 against one class record (classes of two exponents: shift 8, 7 bits), format 3.
GOLDEN_V3 = (
    "44524c53030000005f00000053affd890200763001000000000001007401021000000000000000100000000000000004"
    "00000018000000000e00400307001600400207004e0040010500560040020701000000000807043e04000000003d0500"
    "0000003f05000000003c0600000000000200b7d457020002006f8061e0000100f8200002005f8033403079b513"
)
WIDTH = {"bfloat16": 16, "float16": 16, "float32": 32, "float8_e4m3fn": 8, "float8_e5m2": 8}
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def test_golden_format3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 1)
    monkeypatch.setattr(layout, "RECORD_LAYOUT", LAYOUT_COUNTS)  # format 3's records (the encoder writes 5)
    old, new = _cells_pair()
    (seg,) = encode_delta(old, new, base="v0", codec="ctxs")
    assert seg.hex() == GOLDEN_V3
    h = read_segment_header(seg)
    assert h.format_version == 3
    assert [(c.cell, c.codec) for c in h.chunks] == [(0, "ctxs"), (1, "ctxs"), (8, "ctxs"), (9, "ctxs")]
    assert (h.classes["t"].shift, h.classes["t"].cbits) == (8, 7)
    state = {"t": BF16(old["t"].bits.copy())}
    stage_delta(state, [bytes.fromhex(GOLDEN_V3)], base="v0").commit()
    assert np.array_equal(state["t"].bits, new["t"].bits)


def draw_bits(draw: st.DrawFn, dtype: str, n: int, densities: list[float], steps: tuple[int, ...] = (),
              at_least_one: bool = True) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Old and new bits of ``n`` elements: weights of few exponents or any bits, changed with a drawn
    density by +-1, +-2, half the range, 17 (and ``steps``); one change at least if asked."""
    udt = {8: np.uint8, 16: np.uint16, 32: np.uint32}[WIDTH[dtype]]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    top = int(np.iinfo(udt).max)
    if draw(st.booleans()):  # weights: few exponents
        scale = {8: 0x30, 16: 0x3C00, 32: 0x3C000000}[WIDTH[dtype]]
        old = (scale + rng.integers(0, scale >> 3, n)).astype(udt)
    else:
        old = rng.integers(0, top, n, dtype=udt, endpoint=True)
    density = draw(st.sampled_from(densities))
    new = old.copy()
    where = np.flatnonzero(rng.random(n) < density)
    if at_least_one and not where.size:
        where = np.array([int(rng.integers(0, n))])
    step = rng.choice(np.array([1, top, 2, top - 2, top >> 1, 17, *steps], dtype=np.uint64), where.size)
    new[where] = ((old[where].astype(np.uint64) + step) & np.uint64(top)).astype(udt)
    return old, new


def draw_record(draw: st.DrawFn, old: np.ndarray, new: np.ndarray, dtype: str, part: int, hint: int) -> ClassRecord:
    """A record of either layout from a drawn part of the data (all, its first ``part`` elements or
    one: classes of a cell may be missing from it), its Rice parameters and shares sometimes drawn
    (any a writer may choose)."""
    field = draw(st.sampled_from([CLASS_FIELDS[dtype], CELL_CLASS_FIELDS[dtype]]))
    sub = draw(st.sampled_from([slice(None), slice(0, max(1, part)), slice(0, 1)]))
    kind = draw(st.sampled_from([LAYOUT_COUNTS, LAYOUT_SHARES]))
    rec = choose_record(old[sub], new[sub], dtype, hint, field, kind)
    if draw(st.booleans()):
        m = rec.classes.size
        ks = [np.array(draw(st.lists(st.integers(0, 32), min_size=m, max_size=m)), dtype=np.int64) for _ in range(5)]
        share = np.array(draw(st.lists(st.integers(0, 65535), min_size=m, max_size=m)), dtype=np.int64)
        m_pos = np.array(draw(st.lists(st.integers(1, 1 << 20), min_size=m, max_size=m)), dtype=np.int64)
        two = kind == LAYOUT_SHARES
        rec = ClassRecord(rec.shift, rec.cbits, rec.classes, *ks, share=share if two else None,
                          m_pos=m_pos if two else None, layout=kind)  # fmt: skip
    return rec


@st.composite
def cells(draw: st.DrawFn) -> tuple[str, np.ndarray, np.ndarray, ClassRecord]:
    """(dtype, old bits, new bits, a record): the record from a drawn part of the data (so classes of
    the cell may be missing from it: extra classes) with drawn Rice parameters."""
    dtype = draw(st.sampled_from(sorted(WIDTH)))
    n = draw(st.sampled_from([1, 7, 64, 300, 4099]))
    old, new = draw_bits(draw, dtype, n, [0.001, 0.01, 0.1, 0.5, 1.0])
    return dtype, old, new, draw_record(draw, old, new, dtype, n // 2, n)


@SETTINGS
@given(case=cells(), numpy_path=st.booleans())
def test_any_record_round_trips_any_cell(case: tuple, numpy_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    dtype, old, new, rec = case
    code = rank_classes(old, new, dtype, field=(rec.shift, rec.cbits))
    payload = encode(old, new, dtype, Changes(code.pos, code), rec)
    monkeypatch.setenv("DELTARL_NO_NUMBA", "1" if numpy_path else "0")
    dec = decode(old, memoryview(payload), code.pos.size, rec)
    want = np.flatnonzero(old != new)
    assert np.array_equal(np.sort(dec.positions), want)
    order = np.argsort(dec.positions)
    assert np.array_equal(dec.values[order], new[want])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(sorted(WIDTH)),
    shape=st.sampled_from([(64, 64), (72, 40), (128, 24), (40, 8, 3)]),
    density=st.sampled_from([0.003, 0.01, 0.05, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_auto_cuts_cells_into_ctxs_and_every_tp_part_stages(dtype: str, shape: tuple, density: float, seed: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``auto`` codes cells ctxs with one record per tensor; a TP part decodes with its cells alone."""
    from deltarl.codec.regions import Region
    from deltarl.codec.tensors import tensor_table

    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 64)
    monkeypatch.setattr(layout, "CELL_MIN_CHANGES", 1)
    rng = np.random.default_rng(seed)
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[dtype]  # fmt: skip
    base = torch.from_numpy((rng.standard_normal(shape) * 0.05).astype(np.float32)).to(tdt)
    udt = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[WIDTH[dtype]]
    bits = base.view(udt).clone()
    hit = torch.from_numpy(rng.random(shape) < density)
    bits[hit] += 1
    if WIDTH[dtype] == 8:  # keep FP8 codes finite: step back down where the code became a NaN
        bits[(bits & 0x7F) == 0x7F] -= 2
    old, new = {"w": base}, {"w": bits.view(tdt)}
    segs = encode_delta(old, new, base="b", segment_bytes=2048)
    heads = [read_segment_header(s) for s in segs]
    cells_ = [c for h in heads for c in h.chunks if c.cell >= 0]
    assert all(c.codec in ("ctxs", "sparse", "dense", "none") for c in cells_)
    # format 3 carries class records, 2 none; 4 (a table of 8 chunks or more, as columns) either
    assert all(h.format_version in ((5,) if any(c.codec == "ctxs" for c in h.chunks) else (2, 4)) for h in heads)
    for dim in (0, 1):
        n = shape[dim]
        tp = 2 if n % 128 == 0 else 1
        for rank in range(tp):
            state = {"w": base.clone()}
            region = Region.tp(dim, rank, tp, n)
            view = state["w"].narrow(dim, region.start, region.stop - region.start)
            stage_delta({"w": view}, segs, base="b", regions={"w": region}, specs=tensor_table(old)).commit()
            want = base.view(udt).clone()
            sl = [slice(None)] * len(shape)
            sl[dim] = slice(region.start, region.stop)
            want[tuple(sl)] = bits[tuple(sl)]
            assert torch.equal(state["w"].view(udt), want)
    whole = {"w": base.clone()}
    stage_delta(whole, segs, base="b").commit()
    assert state_digest(whole) == state_digest(new)


def _refix(seg: bytes) -> bytes:
    """The segment with both checksums recomputed (a forged, well-framed segment)."""
    b = bytearray(seg)
    hlen = struct.unpack_from("<I", b, 8)[0]
    struct.pack_into("<I", b, 12, zlib.crc32(b[16 : 16 + hlen]))
    struct.pack_into("<I", b, len(b) - 4, zlib.crc32(b[:-4]))
    return bytes(b)


def _with_body(seg: bytes, body: bytes) -> bytes:
    hlen = struct.unpack_from("<I", seg, 8)[0]
    out = bytearray(seg[:16]) + body + seg[16 + hlen :]
    struct.pack_into("<I", out, 8, len(body))
    return _refix(bytes(out))


def test_corrupt_or_truncated_records_are_format_errors() -> None:
    seg = bytes.fromhex(GOLDEN_V3)
    hlen = struct.unpack_from("<I", seg, 8)[0]
    body = seg[16 : 16 + hlen]
    rec_at = body.rindex(bytes.fromhex("0100000000"))  # u32 R = 1, tensor index 0, then the record
    record = body[rec_at + 5 :]
    shift, cbits, m = record[0], record[1], record[2]
    assert (shift, cbits, m) == (8, 7, (len(record) - 3) // 6)
    cases = {
        "truncated": body[:-1],
        "truncated before the records": body[:rec_at],
        "no records": body[:rec_at] + b"\x00\x00\x00\x00",
        "two records": body[:rec_at] + b"\x02\x00\x00\x00" + body[rec_at + 4 :],
        "another tensor": body[:rec_at + 4] + b"\x01" + record,
        "trailing": body + b"\x00",
        "field too wide": body[:rec_at + 5] + bytes([12, 7]) + record[2:],
        "no classes": body[:rec_at + 5] + bytes([8, 7, 0]),
        "too many classes": body[:rec_at + 5] + bytes([8, 7, 200]) + record[3:],
        "repeated class": body[:rec_at + 5] + record[:3] + record[3:9] + record[3:9] + record[15:],
        "k above 32": body[:rec_at + 5] + record[:4] + bytes([33]) + record[5:],
        "class out of range": body[:rec_at + 5] + record[:3] + bytes([200]) + record[4:],
    }  # fmt: skip
    for what, bad in cases.items():
        with pytest.raises(FormatError):
            read_segment_header(_with_body(seg, bad))
        assert what
    v2 = bytearray(seg)
    v2[4] = 2  # a ctxs chunk in a format 2 segment: no record to decode it with
    with pytest.raises(FormatError):
        read_segment_header(_refix(bytes(v2)))


def test_a_ctxs_payload_needs_its_record() -> None:
    old, new = _cells_pair()
    o, n = old["t"].bits.reshape(-1), new["t"].bits.reshape(-1)
    with pytest.raises(ValueError, match="class record"):
        encode(o, n, "bfloat16", Changes(np.flatnonzero(o != n)))
    with pytest.raises(FormatError, match="class record"):
        decode(o, memoryview(b"\x00"), 1)


def test_row_shards_coded_ctxs_carry_their_own_records() -> None:
    """A sharded writer's rows coded ``ctxs``: each shard's segments carry its own record of the
    tensor (records are per segment), and the shards' segments together are one delta."""
    from deltarl.codec.encode import iter_encode_rows
    from deltarl.codec.tensors import TensorSpec

    rng = np.random.default_rng(3)
    old = (0x3C00 + rng.integers(0, 0x0400, size=(64, 48))).astype(np.uint16)
    new = old.copy()
    new[rng.random(old.shape) < 0.05] += 1
    spec = TensorSpec("w", "bfloat16", (64, 48))
    segs = []
    for a, b in ((0, 24), (24, 64)):
        o, n = {"w": BF16(old[a:b].copy())}, {"w": BF16(new[a:b].copy())}
        segs += list(iter_encode_rows(o, n, {"w": (spec, a * 48)}, base="b", codec="ctxs", threads=1))
    heads = [read_segment_header(s) for s in segs]
    assert all(h.format_version == 5 and "w" in h.classes for h in heads)
    state = {"w": BF16(old.copy())}
    stage_delta(state, segs, base="b").commit()
    assert np.array_equal(state["w"].bits, new)


def _cells_delta(monkeypatch: pytest.MonkeyPatch, cols: int = 80) -> tuple[np.ndarray, list[bytes]]:
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 64)
    monkeypatch.setattr(layout, "CELL_MIN_CHANGES", 1)
    rng = np.random.default_rng(11)
    old = (0x3C00 + rng.integers(0, 0x0400, size=(96, cols))).astype(np.uint16)
    new = old.copy()
    new[rng.random(old.shape) < 0.03] += 1
    new[rng.random(old.shape) < 0.002] -= 9
    segs = encode_delta({"w": BF16(old)}, {"w": BF16(new)}, base="b", codec="ctxs", segment_bytes=1024)
    assert sum(c.codec == "ctxs" and c.cell >= 0 for s in segs for c in read_segment_header(s).chunks) > 16
    return old, segs


def test_cells_decode_in_one_call_as_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor's ctxs cells staged in one numba call give the changes of the chunk-by-chunk path."""
    from deltarl.codec import kernels
    from deltarl.codec.stager import Stager

    if kernels.ctx_jit() is None:
        pytest.skip("numba is off")
    old, segs = _cells_delta(monkeypatch)
    batched = stage_delta({"w": BF16(old.copy())}, segs, base="b").changes()["w"]
    monkeypatch.setattr(Stager, "_on_host_jit", lambda self, names, tensors: np.zeros(tensors.size, dtype=bool))
    single = stage_delta({"w": BF16(old.copy())}, segs, base="b").changes()["w"]
    order_a, order_b = np.argsort(batched[0]), np.argsort(single[0])
    for a, b in zip(batched, single, strict=True):
        assert np.array_equal(a[order_a], b[order_b])


def test_a_bad_cell_in_a_batch_names_its_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    old, segs = _cells_delta(monkeypatch)
    head = read_segment_header(segs[0])
    off = head.payload_offset
    for c in head.chunks:
        if c.codec == "ctxs" and c.changed:
            break
        off += c.nbytes
    bad = bytearray(segs[0])
    bad[off + c.nbytes - 1] ^= 0xFF  # the last sign / remainder byte: trailing bits or wrong changes
    bad[off] = 0x7F  # and 127 extra classes
    with pytest.raises(FormatError, match=rf"cell {c.cell}\)"):
        stage_delta({"w": BF16(old.copy())}, [_refix(bytes(bad)), *segs[1:]], base="b")
