"""The segment container: magic, version, checksummed header (base, tensor and chunk tables), payloads.

Byte layout (little-endian; docs/FORMAT.md is the specification)::

    0   4  magic b"DRLS"
    4   2  format version (2)
    6   2  flags (0)
    8   4  header length H (<= MAX_HEADER_BYTES)
    12  4  crc32 of the header body
    16  H  header body: base, tensor table, chunk table
    ..  P  chunk payloads, concatenated in chunk-table order
    end 4  crc32 of every byte before it
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from deltarl.codec.bitio import leb128_decode, leb128_encode
from deltarl.codec.grid import CELLS, Grid
from deltarl.codec.registry import NONE, codec_id, codec_name
from deltarl.codec.tensors import DTYPE_BY_CODE, DTYPES, TensorSpec
from deltarl.errors import FormatError, IntegrityError, UnsupportedFormatVersion

MAGIC = b"DRLS"
FORMAT_VERSION = 2
MAX_HEADER_BYTES = 16 << 20
MAX_BASE_BYTES = 1024
MAX_NAME_BYTES = 4096
MAX_NDIM = 32
_PREFIX = struct.Struct("<4sHHII")
_CHUNK_FIELDS = 6  # varints per chunk: tensor index, 8 * tile + codec, start, count, changed, nbytes
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
    """The parsed, validated header of one segment."""

    format_version: int
    base: str
    tensors: tuple[TensorSpec, ...]
    chunks: tuple[ChunkInfo, ...]
    payload_offset: int
    chunk_table_bytes: int = 0  # length of the chunk table's varints


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
    base: str, tensors: list[TensorSpec], chunks: list[ChunkInfo], payloads: list[bytes]
) -> bytes:
    """Build one segment; ``chunks[i]`` describes ``payloads[i]``. A tensor that is wholly covered
    by ``none`` chunks here is written with no chunk at all (its table entry covers it)."""
    index = {spec.name: i for i, spec in enumerate(tensors)}
    whole = _unchanged_whole(tensors, chunks)
    raw_base = base.encode()
    parts = [struct.pack("<H", len(raw_base)), raw_base, struct.pack("<I", len(tensors))]
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
    table = leb128_encode(fields.reshape(-1))
    parts.append(struct.pack("<II", len(kept), len(table)))
    parts.append(table)
    body = b"".join(parts)
    if len(body) > MAX_HEADER_BYTES:
        raise FormatError(f"segment header of {len(body)} bytes exceeds the {MAX_HEADER_BYTES}-byte cap")
    out = bytearray(_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body), zlib.crc32(body)))
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
    if version != FORMAT_VERSION:
        raise UnsupportedFormatVersion(f"segment format version {version}; this build reads {FORMAT_VERSION}")
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
    (ntensors,) = r.take("<I")
    tensors: list[TensorSpec] = []
    prev = b""
    for _ in range(ntensors):
        shared, nlen = r.take("<HH")
        if shared > len(prev) or not 0 < shared + nlen <= MAX_NAME_BYTES or nlen == 0:
            raise FormatError(f"tensor name of {shared} shared + {nlen} bytes out of bounds")
        if r.off + nlen > len(body):
            raise FormatError("segment header is truncated")
        raw = prev[:shared] + bytes(body[r.off : r.off + nlen])
        r.off += nlen
        try:
            name = raw.decode()
        except UnicodeDecodeError as err:
            raise FormatError("tensor name is not valid utf-8") from err
        prev = raw
        code, ndim = r.take("<BB")
        if code not in DTYPE_BY_CODE:
            raise FormatError(f"tensor {name!r}: unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise FormatError(f"tensor {name!r}: {ndim} dimensions")
        shape = r.take(f"<{ndim}Q")
        tensors.append(TensorSpec(name, DTYPE_BY_CODE[code], tuple(shape)))
    if len({t.name for t in tensors}) != len(tensors):
        raise FormatError("duplicate tensor name in segment")
    nchunks, tlen = r.take("<II")
    if r.off + tlen > len(body) or nchunks > tlen:
        raise FormatError("segment header is truncated")
    chunks = _chunk_table(body[r.off : r.off + tlen], nchunks, tensors)
    r.off += tlen
    total = sum(c.nbytes for c in chunks)
    listed = {c.tensor for c in chunks}
    for spec in tensors:  # a tensor without a chunk is covered whole, unchanged, by this segment
        if spec.name not in listed and spec.numel:
            chunks.append(ChunkInfo(spec.name, 0, spec.numel, 0, NONE, 0))
    if r.off != len(body):
        raise FormatError("segment header has trailing bytes")
    if _PREFIX.size + hlen + total + 4 != len(mv):
        raise FormatError("chunk payload lengths do not add up to the segment length")
    spans = sorted((c.tensor, c.cell, c.start, c.start + c.count) for c in chunks)
    for (t0, g0, _, e0), (t1, g1, s1, _) in itertools.pairwise(spans):
        if t0 == t1 and g0 == g1 and s1 < e0:
            raise FormatError(f"chunks of {t0!r} overlap at element {s1}")
        if t0 == t1 and g0 == FLAT and g1 != FLAT:
            raise FormatError(f"tensor {t0!r} has both row-major and cell chunks")
    return SegmentHeader(version, base, tuple(tensors), tuple(chunks), _PREFIX.size + hlen, tlen)


def _chunk_table(raw: memoryview, nchunks: int, tensors: list[TensorSpec]) -> list[ChunkInfo]:
    """Parse and check the chunk table's varints (6 per chunk)."""
    v = leb128_decode(raw, nchunks * _CHUNK_FIELDS).reshape(nchunks, _CHUNK_FIELDS)
    if nchunks and int(v[:, 0].max()) >= len(tensors):
        raise FormatError(f"chunk names tensor index {int(v[:, 0].max())} of {len(tensors)}")
    grids: dict[int, Grid] = {}
    chunks: list[ChunkInfo] = []
    for ti, kind, start, count, changed, nbytes in v.tolist():
        tile, codec = divmod(kind, 8)
        name = codec_name(codec)
        if tile > CELLS:
            raise FormatError(f"unknown chunk tile {tile}")
        spec = tensors[ti]
        if tile:
            grid = grids.get(ti) or grids.setdefault(ti, Grid(spec.shape))
            limit = grid.numel(tile - 1) if grid.has(tile - 1) else 0
        else:
            limit = spec.numel
        if count == 0 or start + count > limit:
            raise FormatError(f"chunk [{start}, {start + count}) outside tensor {spec.name!r} (tile {tile}) of {limit}")
        if changed > count or (codec == 0) != (changed == 0) or (codec == 0 and nbytes):
            raise FormatError(f"chunk of {spec.name!r}: inconsistent changed={changed} codec={codec}")
        chunks.append(ChunkInfo(spec.name, start, count, changed, name, nbytes, tile - 1))
    return chunks


def delta_stats(segments: Iterable[bytes]) -> DeltaStats:
    """Changed and covered element counts and encoded size of a delta (validates every segment)."""
    changed = total = size = 0
    for seg in segments:
        h = read_segment_header(seg)
        changed += sum(c.changed for c in h.chunks)
        total += sum(c.count for c in h.chunks)
        size += len(seg)
    return DeltaStats(changed, total, size)
