"""The segment container: magic, version, checksummed header (base, tensor and chunk tables), payloads.

Byte layout (little-endian; docs/FORMAT.md is the specification)::

    0   4  magic b"DRLS"
    4   2  format version (5 when a chunk is coded ``ctxs`` against a layout 2 class record; else 4
           when the header is shorter compressed, 3 with ``ctxs`` chunks, 2)
    6   2  flags (0)
    8   4  header length H (<= MAX_HEADER_BYTES)
    12  4  crc32 of the header body
    16  H  header body: base, tensor and chunk tables (format 3: then the class records)
    ..  P  chunk payloads, concatenated in chunk-table order
    end 4  crc32 of every byte before it
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import zstandard

from deltarl.codec.bitio import leb128_decode, leb128_encode
from deltarl.codec.chunk import zstd
from deltarl.codec.chunk_table import FIELDS, ChunkTable, parse_chunk_table
from deltarl.codec.ctxs import LAYOUT_COUNTS, LAYOUT_SHARES, ClassRecord, parse_record, read_varint
from deltarl.codec.registry import NONE, codec_id, codec_name
from deltarl.codec.tensors import DTYPE_BY_CODE, DTYPES, TensorSpec, uint_dtype
from deltarl.errors import FormatError, IntegrityError, UnsupportedFormatVersion

MAGIC = b"DRLS"
FORMAT_VERSION = 3  # written when a chunk is coded ctxs (its tensor's class record in the header)
FORMAT_COMPRESSED = 4  # written when the header is shorter as one zstd frame (the chunk table as columns)
FORMAT_SHARES = 5  # format 4 whose class records carry shares and whose ctxs chunks are coded against them
FORMAT_VERSIONS = (2, 3, 4, 5)  # read
_SHARED = codec_id("ctxs")
MAX_HEADER_BYTES = 16 << 20
MAX_BASE_BYTES = 1024
MAX_NAME_BYTES = 4096
MAX_NDIM = 32
_PREFIX = struct.Struct("<4sHHII")
FLAT = -1  # ChunkInfo.cell of a chunk of the tensor's row-major element order


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk: ``count`` elements of ``tensor`` from index ``start``; ``changed`` of them differ.

    ``cell`` is ``FLAT`` (-1) for a range of the tensor's row-major order, else the id of the grid
    cell (:mod:`deltarl.codec.grid`) whose row-major enumeration ``start`` and ``count`` index.
    """

    tensor: str
    start: int
    count: int
    changed: int
    codec: str
    nbytes: int
    cell: int = FLAT


@dataclass(frozen=True)
class SegmentHeader:
    """The parsed, validated header of one segment. ``table`` holds the chunks as columns (what
    planning reads); ``chunks`` the same chunks as :class:`ChunkInfo` records, made on first use."""

    format_version: int
    base: str
    tensors: tuple[TensorSpec, ...]
    table: ChunkTable
    payload_offset: int
    chunk_table_bytes: int = 0  # length of the chunk table's varints
    classes: Mapping[str, ClassRecord] = field(default_factory=dict)  # class records by tensor name (format 3)

    @cached_property
    def chunks(self) -> tuple[ChunkInfo, ...]:
        t = self.table
        names = [s.name for s in self.tensors]
        return tuple(
            ChunkInfo(names[ti], start, count, changed, codec_name(codec), nbytes, cell)
            for ti, cell, codec, start, count, changed, nbytes in zip(
                t.tensor.tolist(), t.cell.tolist(), t.codec.tolist(), t.start.tolist(), t.count.tolist(),
                t.changed.tolist(), t.nbytes.tolist(), strict=True,
            )
        )

    def chunk(self, i: int) -> ChunkInfo:
        """Chunk ``i`` of the table as a record (without making every other one)."""
        if "chunks" in self.__dict__:
            return self.chunks[i]
        t = self.table
        return ChunkInfo(self.tensors[int(t.tensor[i])].name, int(t.start[i]), int(t.count[i]), int(t.changed[i]),
                         codec_name(int(t.codec[i])), int(t.nbytes[i]), int(t.cell[i]))  # fmt: skip


@dataclass(frozen=True)
class DeltaStats:
    """Totals over the segments of one delta."""

    changed_elements: int
    total_elements: int
    encoded_bytes: int


def _unchanged_whole(tensors: list[TensorSpec], chunks: list[ChunkInfo]) -> set[str]:
    """Tensors whose chunks in this segment are all ``none`` and cover the whole tensor: the segment
    names them and lists no chunk for them (docs/FORMAT.md, "Tensors without chunks")."""
    spans: dict[str, list[tuple[int, int]]] = {}
    changed: set[str] = set()
    for c in chunks:
        spans.setdefault(c.tensor, []).append((c.start, c.count))
        if c.changed or c.codec != NONE or c.cell != FLAT:
            changed.add(c.tensor)
    out = set()
    for spec in tensors:
        got = sorted(spans.get(spec.name, []))
        if spec.name in changed or not got or spec.numel == 0:
            continue
        end = 0
        for start, count in got:
            if start != end:
                break
            end += count
        else:
            if end == spec.numel:
                out.add(spec.name)
    return out


def pack_segment(
    base: str, tensors: list[TensorSpec], chunks: list[ChunkInfo], payloads: list[bytes],
    records: Mapping[str, ClassRecord] | None = None, *, compress: bool = True,
) -> bytes:
    """Build one segment; ``chunks[i]`` describes ``payloads[i]``. A tensor that is wholly covered
    by ``none`` chunks here is written with no chunk at all (its table entry covers it). A segment
    with ``ctxs`` chunks is format 3 and carries their tensors' class ``records``; else format 2. With
    ``compress`` (the default), a segment of 8 chunks or more whose header is shorter so is format 4:
    everything after the base id in one zstd frame, the chunk table as columns. A segment whose
    records are layout 2 (:data:`deltarl.codec.ctxs.LAYOUT_SHARES`, what the encoder writes) is
    format 5: format 4's frame, with those records."""
    index = {spec.name: i for i, spec in enumerate(tensors)}
    whole = _unchanged_whole(tensors, chunks)
    raw_base = base.encode()
    head = [struct.pack("<H", len(raw_base)), raw_base]
    parts = [struct.pack("<I", len(tensors))]
    prev = b""
    for spec in tensors:
        name = spec.name.encode()
        shared = 0
        limit = min(len(prev), len(name) - 1, 0xFFFF)  # at least one byte of suffix
        while shared < limit and prev[shared] == name[shared]:
            shared += 1
        parts.append(struct.pack("<HH", shared, len(name) - shared) + name[shared:])
        parts.append(struct.pack("<BB", DTYPES[spec.dtype][0], len(spec.shape)))
        parts.append(struct.pack(f"<{len(spec.shape)}Q", *spec.shape))
        prev = name
    kept = [(c, p) for c, p in zip(chunks, payloads, strict=True) if c.tensor not in whole]
    fields = np.array(
        [(index[c.tensor], 8 * (c.cell + 1) + codec_id(c.codec), c.start, c.count, c.changed, c.nbytes) for c, _ in kept],
        dtype=np.uint64,
    )
    recorded = sorted({index[c.tensor] for c, _ in kept if c.codec == "ctxs"})
    if recorded and (records is None or any(tensors[t].name not in records for t in recorded)):
        raise ValueError("a segment with ctxs chunks needs their tensors' class records")
    have = records or {}
    layouts = {have[tensors[t].name].layout for t in recorded}
    if len(layouts) > 1:
        raise ValueError("a segment's class records must all be of one layout")
    shares = layouts == {LAYOUT_SHARES}
    recs = [struct.pack("<I", len(recorded)),
            *(leb128_encode(np.array([t], dtype=np.uint64)) + have[tensors[t].name].pack() for t in recorded)]
    rows = leb128_encode(fields.reshape(-1))
    body = b"".join([*head, *parts, struct.pack("<II", len(kept), len(rows)), rows, *(recs if recorded else [])])
    version = FORMAT_VERSION if recorded else 2
    if shares or (compress and len(kept) >= _COMPRESS_MIN_CHUNKS):  # format 4 where it is shorter; 5
        cols = column_table(fields)
        content = b"".join([*parts, struct.pack("<II", len(kept), len(cols)), cols, *recs])
        packed = b"".join([*head, zstd(content)])
        if len(content) > MAX_HEADER_BYTES:  # a reader inflates at most the cap
            if shares:
                raise FormatError(f"segment header of {len(content)} bytes exceeds the {MAX_HEADER_BYTES}-byte cap")
        elif shares or len(packed) < len(body):
            body, version = packed, FORMAT_SHARES if shares else FORMAT_COMPRESSED
    if len(body) > MAX_HEADER_BYTES:
        raise FormatError(f"segment header of {len(body)} bytes exceeds the {MAX_HEADER_BYTES}-byte cap")
    out = bytearray(_PREFIX.pack(MAGIC, version, 0, len(body), zlib.crc32(body)))
    out += body
    for _, p in kept:
        out += p
    out += struct.pack("<I", zlib.crc32(out))
    return bytes(out)


class _Reader:
    def __init__(self, body: memoryview) -> None:
        self.body, self.off = body, 0

    def take(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.off + size > len(self.body):
            raise FormatError("segment header is truncated")
        vals = struct.unpack_from(fmt, self.body, self.off)
        self.off += size
        return vals

    def text(self, n: int, what: str) -> str:
        if self.off + n > len(self.body):
            raise FormatError("segment header is truncated")
        try:
            s = bytes(self.body[self.off : self.off + n]).decode()
        except UnicodeDecodeError as err:
            raise FormatError(f"{what} is not valid utf-8") from err
        self.off += n
        return s


def read_segment_header(data: bytes | bytearray | memoryview, *, partial: bool = False) -> SegmentHeader:
    """Parse and validate a whole segment's framing, checksums and header; raises FormatError.

    ``partial``: ``data`` has the segment's length but holds only some of its bytes (ranged reads,
    each piece verified by its hash): the header is checked by its own crc32, the whole-segment
    crc32 is not checked."""
    mv = memoryview(data).cast("B")
    if len(mv) < _PREFIX.size + 4:
        raise FormatError(f"segment of {len(mv)} bytes is too short")
    magic, version, flags, hlen, hcrc = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FormatError(f"bad segment magic {bytes(magic)!r}")
    if version not in FORMAT_VERSIONS:
        raise UnsupportedFormatVersion(f"segment format version {version}; this build reads {FORMAT_VERSIONS}")
    if flags != 0:
        raise FormatError(f"unknown segment flags {flags:#x}")
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen + 4 > len(mv):
        raise FormatError(f"segment header length {hlen} is out of bounds")
    (crc,) = struct.unpack_from("<I", mv, len(mv) - 4)
    if not partial and zlib.crc32(mv[:-4]) != crc:
        raise IntegrityError("segment crc32 does not match its bytes")
    body = mv[_PREFIX.size : _PREFIX.size + hlen]
    if zlib.crc32(body) != hcrc:
        raise IntegrityError("segment header crc32 does not match")
    r = _Reader(body)
    (blen,) = r.take("<H")
    if not 0 < blen <= MAX_BASE_BYTES:
        raise FormatError(f"base id length {blen} out of bounds")
    base = r.text(blen, "base id")
    if version in (FORMAT_COMPRESSED, FORMAT_SHARES):
        body = memoryview(_inflate(body[r.off :]))
        r = _Reader(body)
    (ntensors,) = r.take("<I")
    tensors, r.off = _tensor_table(body, r.off, ntensors)
    nchunks, tlen = r.take("<II")
    if r.off + tlen > len(body) or nchunks > tlen:
        raise FormatError("segment header is truncated")
    if version == 2 and r.off + tlen != len(body):
        raise FormatError("segment header has trailing bytes")
    room = len(mv) - _PREFIX.size - hlen - 4
    raw = body[r.off : r.off + tlen]
    fields = table_columns(raw, nchunks, len(tensors)) if version in (FORMAT_COMPRESSED, FORMAT_SHARES) else None
    table = parse_chunk_table(raw, nchunks, tensors, _PREFIX.size + hlen, room, fields=fields)
    layout = LAYOUT_SHARES if version == FORMAT_SHARES else LAYOUT_COUNTS
    classes = _records(body, r.off + tlen, tensors, table, layout) if version != 2 else {}
    if not classes and bool((table.codec == _SHARED).any()):
        raise FormatError("a ctxs chunk in a format 2 segment (no class records)")
    return SegmentHeader(version, base, tuple(tensors), table, _PREFIX.size + hlen, tlen, classes)


# A segment of fewer chunks keeps format 2 / 3 (a zstd frame's own header outweighs what it saves).
_COMPRESS_MIN_CHUNKS = 8


def _inflate(frame: memoryview) -> bytes:
    """The content of format 4's header frame: one zstd frame, its content size declared and at most
    the header cap, and nothing after it; FormatError otherwise."""
    try:
        size = zstandard.frame_content_size(frame)
        if size < 0 or size > MAX_HEADER_BYTES:
            raise FormatError(f"segment header frame declares {size} bytes (at most {MAX_HEADER_BYTES})")
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as err:
        raise FormatError(f"segment header frame is corrupt: {err}") from err
    if len(out) != size:
        raise FormatError(f"segment header frame decoded to {len(out)} bytes, it declares {size}")
    return out


def column_table(fields: np.ndarray) -> bytes:
    """Format 4's chunk table: the table's six columns of varints, column after column, the tensor
    indices as zigzag differences from the previous chunk's (the first's from 0). A tensor's cells
    have one index, one tile step and one size: in the header's zstd frame the columns compress ~5x
    where the rows do ~2.6x (docs/FORMAT.md, "Header body")."""
    cols = fields.astype(np.int64).T.copy()
    d = np.diff(cols[0], prepend=0)
    cols[0] = (d << 1) ^ (d >> 63)
    return leb128_encode(cols.astype(np.uint64).reshape(-1))


def table_columns(raw: memoryview, nchunks: int, ntensors: int) -> np.ndarray:
    """The ``(nchunks, 6)`` fields of format 4's chunk table (:func:`column_table`); FormatError if it
    does not hold exactly ``6 nchunks`` varints or a tensor index leaves the table."""
    v = leb128_decode(raw, nchunks * FIELDS).reshape(FIELDS, nchunks)
    if nchunks and int(v.max()) >= 1 << 62:
        raise FormatError(f"chunk table value {int(v.max())} is out of range")
    cols = v.astype(np.int64)
    z = cols[0]
    d = (z >> 1) ^ -(z & 1)
    if nchunks and int(np.abs(d).max()) >= max(ntensors, 1):
        raise FormatError("chunk table names a tensor index outside the table")
    cols[0] = np.cumsum(d)
    if nchunks and (int(cols[0].min()) < 0 or int(cols[0].max()) >= ntensors):
        raise FormatError("chunk table names a tensor index outside the table")
    return cols.T.astype(np.uint64)


def _records(body: memoryview, off: int, tensors: list[TensorSpec], table: ChunkTable, layout: int
             ) -> dict[str, ClassRecord]:  # fmt: skip
    """The class records (after the chunk table; formats 3-5): one per tensor with a ``ctxs`` chunk
    here, by increasing tensor index; the body must end with them."""
    if off + 4 > len(body):
        raise FormatError("segment header is truncated (class records)")
    (count,) = struct.unpack_from("<I", body, off)
    off += 4
    want = np.unique(table.tensor[table.codec == _SHARED])
    if count != want.size:
        raise FormatError(f"{count} class records for {want.size} tensors with ctxs chunks")
    out: dict[str, ClassRecord] = {}
    for t in want.tolist():
        index, off = read_varint(body, off, "class record")
        if index != t:
            raise FormatError(f"class record of tensor {index}, expected {t} (tensors with ctxs chunks, in order)")
        out[tensors[t].name], off = parse_record(body, off, 8 * uint_dtype(tensors[t].dtype).itemsize, layout)
    if off != len(body):
        raise FormatError("segment header has trailing bytes")
    return out


_NAME_HEAD = struct.Struct("<HH")
_DTYPE_NDIM = struct.Struct("<BB")
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]


def _tensor_table(body: memoryview, off: int, ntensors: int) -> tuple[list[TensorSpec], int]:
    """Parse ``ntensors`` tensor table entries from ``off``; returns them and the offset after them."""
    raw = bytes(body)
    end = len(raw)
    tensors: list[TensorSpec] = []
    prev = b""
    try:
        for _ in range(ntensors):
            shared, nlen = _NAME_HEAD.unpack_from(raw, off)
            if shared > len(prev) or not 0 < shared + nlen <= MAX_NAME_BYTES or nlen == 0:
                raise FormatError(f"tensor name of {shared} shared + {nlen} bytes out of bounds")
            off += 4
            if off + nlen > end:
                raise FormatError("segment header is truncated")
            name_raw = prev[:shared] + raw[off : off + nlen]
            off += nlen
            prev = name_raw
            code, ndim = _DTYPE_NDIM.unpack_from(raw, off)
            off += 2
            name = name_raw.decode()
            if code not in DTYPE_BY_CODE:
                raise FormatError(f"tensor {name!r}: unknown dtype code {code}")
            if ndim > MAX_NDIM:
                raise FormatError(f"tensor {name!r}: {ndim} dimensions")
            shape = _SHAPES[ndim].unpack_from(raw, off)
            off += 8 * ndim
            tensors.append(TensorSpec(name, DTYPE_BY_CODE[code], shape))
    except struct.error as err:
        raise FormatError("segment header is truncated") from err
    except UnicodeDecodeError as err:
        raise FormatError("tensor name is not valid utf-8") from err
    if len({t.name for t in tensors}) != len(tensors):
        raise FormatError("duplicate tensor name in segment")
    return tensors, off


def delta_stats(segments: Iterable[bytes]) -> DeltaStats:
    """Changed and covered element counts and encoded size of a delta (validates every segment)."""
    changed = total = size = 0
    for seg in segments:
        h = read_segment_header(seg)
        changed += int(h.table.changed.sum())
        total += int(h.table.count.sum())
        size += len(seg)
    return DeltaStats(changed, total, size)
