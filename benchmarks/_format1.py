"""The bytes segment format 1 took for the chunks of a format-2 delta without cells (40-byte chunk
entries, u32 stream lengths): what ``benchmarks.codec`` and ``benchmarks.sharded_read`` compare
format 2 against. Chunk payloads are otherwise byte-identical between the two formats."""

from __future__ import annotations

import struct

from deltarl.codec import read_segment_header
from deltarl.codec.chunk import unpack_streams
from deltarl.codec.segment import pack_segment

_LAYOUT = {
    "ctx": ("<BB", 11),
    "sparse": ("<BBBQ", 10),
    "dense": ("", 1),
    "rice": ("<B", 5),
    "aurora": ("", 2),
}


def _uncompressed(seg: bytes) -> bytes:
    """The segment with its header as format 2 / 3 write it (format 4 compresses the header)."""
    h = read_segment_header(seg)
    if h.format_version != 4:
        return seg
    payloads = [bytes(seg[o : o + c.nbytes]) for c, o in zip(h.chunks, h.table.offset.tolist(), strict=True)]
    return pack_segment(h.base, list(h.tensors), list(h.chunks), payloads, h.classes, compress=False)


def format1_bytes(segments: list[bytes]) -> int:
    """The bytes format 1 takes for the same chunks: 40-byte chunk entries, u32 stream lengths."""
    total = 0
    for stored in segments:
        seg = _uncompressed(stored)
        h = read_segment_header(seg)
        listed = [c for c in h.chunks if c.changed or c.codec == "none"]
        total += len(seg) - 4 - h.chunk_table_bytes + 40 * len(listed)
        off = h.payload_offset
        for c in h.chunks:
            if c.changed:
                fmt, n = _LAYOUT[c.codec]
                _, streams = unpack_streams(memoryview(seg)[off : off + c.nbytes], fmt, n)
                total += struct.calcsize(fmt) + 4 * n + sum(len(s) for s in streams) - c.nbytes
            off += c.nbytes
    return total
