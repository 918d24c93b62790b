"""Ranged, verified reads of the parts of a version that a tensor- or expert-parallel rank holds.

A rank reads the header pieces of each segment (the chunk table), picks the chunks its regions
need (:func:`deltarl.codec.regions.plan_chunks`), and reads only the pieces that hold them; every
piece is checked against the manifest's BLAKE3 piece hash before any of its bytes is used, so a
region read trusts nothing a whole read would not. Verification is per piece: a rank reads whole
pieces, i.e. up to one piece more at each end of every run of chunks it needs, plus the pieces of
each segment's header (docs/FORMAT.md, "Reading a part").

Example (``get_range(key, start, end) -> bytes`` is any ranged GET: a store, a relay)::

    parts = read_segment_parts(store.get_range, manifest, regions)
    staged = stage_delta(views, [p.data for p in parts], base=parent_id, regions=regions,
                         specs=info.tensors, headers=[p.header for p in parts])
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltarl.codec.grid import Grid
from deltarl.codec.regions import ChunkRef, Region, byte_ranges, plan_chunks, span_of
from deltarl.codec.segment import SegmentHeader, read_segment_header
from deltarl.codec.tensors import TensorSpec, flat_bits, uint_dtype
from deltarl.errors import FormatError, IntegrityError, short_pair
from deltarl.pipeline.manifest import KeyframePart, Manifest, ObjectRef
from deltarl.pipeline.pieces import hash_piece

#: ``get_range(key, start, end)``: bytes ``[start, end)`` of an immutable object.
GetRange = Callable[[str, int, int], bytes]
_PREFIX = struct.Struct("<4sHHII")


@dataclass
class SegmentPart:
    """One segment as a rank holds it: a buffer of the segment's size holding the verified pieces
    it read (zeros elsewhere), the parsed header, the chunks its regions need, and what it read."""

    ref: ObjectRef
    data: bytearray
    header: SegmentHeader
    chunks: list[ChunkRef] = field(default_factory=list)
    pieces: set[int] = field(default_factory=set)

    @property
    def fetched_bytes(self) -> int:
        ps, size = self.ref.piece_size, self.ref.size
        return sum(min(ps, size - i * ps) for i in self.pieces)


def _read_pieces(get_range: GetRange, part: SegmentPart, wanted: Sequence[int], named_by: str) -> None:
    """Read and verify pieces ``wanted`` (runs of consecutive pieces in one request each)."""
    ref, ps = part.ref, part.ref.piece_size
    todo = sorted(set(wanted) - part.pieces)
    runs: list[list[int]] = []
    for i in todo:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    for run in runs:
        start, end = run[0] * ps, min(ref.size, (run[-1] + 1) * ps)
        data = get_range(ref.key, start, end)
        if len(data) != end - start:
            raise IntegrityError(f"{ref.key}: bytes {start}..{end}: got {len(data)}")
        mv = memoryview(data)
        for i in run:
            got = hash_piece(mv[i * ps - start : min(end, (i + 1) * ps) - start])
            if got != ref.pieces[i]:
                shown = short_pair(got, ref.pieces[i])
                raise IntegrityError(
                    f"{ref.key}: piece {i} has hash {shown[0]}, {named_by} records {shown[1]}"
                )
        part.data[start:end] = data
        part.pieces.update(run)


def read_header(get_range: GetRange, ref: ObjectRef, named_by: str) -> SegmentPart:
    """Read a segment's header pieces (verified) and parse its header."""
    part = SegmentPart(ref, bytearray(ref.size), None)  # type: ignore[arg-type]  # set below
    ps = ref.piece_size
    _read_pieces(get_range, part, [0], named_by)
    if ref.size < _PREFIX.size + 4:
        raise FormatError(f"{ref.key}: a segment of {ref.size} bytes is too short")
    (hlen,) = struct.unpack_from("<I", part.data, 8)
    end = min(ref.size, _PREFIX.size + hlen)
    _read_pieces(get_range, part, range(0, -(-end // ps)), named_by)
    part.header = read_segment_header(part.data, partial=True)
    return part


def plan_segment(
    part: SegmentPart, regions: Mapping[str, Region], grids: dict[str, Grid] | None = None
) -> list[int]:
    """Pick the chunks of one segment the regions need; return the pieces that hold them."""
    part.chunks = plan_chunks(part.header, dict(regions), grids=grids)
    ps = part.ref.piece_size
    wanted: set[int] = set()
    for a, b in byte_ranges(part.chunks):
        wanted.update(range(a // ps, (b - 1) // ps + 1))
    return sorted(wanted)


def read_segment_parts(
    get_range: GetRange,
    manifest: Manifest | Sequence[ObjectRef],
    regions: Mapping[str, Region],
    *,
    named_by: str | None = None,
) -> list[SegmentPart]:
    """Every segment of ``manifest`` (or of a list of segment refs) as the ``regions`` need it:
    headers, then the needed pieces, every piece verified.

    Segments whose chunks the regions do not need are returned too (their header only): staging
    checks from them that the regions are covered exactly once.
    """
    refs = manifest.segments if isinstance(manifest, Manifest) else tuple(manifest)
    where = named_by or (manifest.key if isinstance(manifest, Manifest) else "the manifest")
    grids: dict[str, Grid] = {}
    parts = [read_header(get_range, ref, where) for ref in refs]
    for part in parts:
        _read_pieces(get_range, part, plan_segment(part, regions, grids), where)
    return parts


def _needed_bytes(spec: TensorSpec, region: Region, start: int, count: int, isz: int) -> tuple[int, int] | None:
    """Bytes ``[a, b)`` of a keyframe range (elements ``start..start+count`` of ``spec``) that hold a
    region's elements: a row range's are contiguous; a column block's span its first to last row."""
    grid = Grid(region.fold or spec.shape)
    ra, rb, ca, cb = region.bounds(grid)
    rw = grid.row_elems
    lo = max(start, ra * rw + ca)
    hi = min(start + count, (rb - 1) * rw + cb)
    if lo >= hi:
        return None
    return (lo - start) * isz, (hi - start) * isz


def _copy_rows(src: np.ndarray, start: int, spec: TensorSpec, region: Region, dst: np.ndarray, s0: int) -> None:
    """Copy the region's elements of ``src`` (elements ``start..`` of the tensor) into the region's
    span ``dst`` (rows ``s0`` apart): whole rows as one 2-D copy, a cut row at either end alone."""
    grid = Grid(region.fold or spec.shape)
    ra, rb, ca, cb = region.bounds(grid)
    rw, end = grid.row_elems, start + src.size
    view = np.lib.stride_tricks.as_strided(dst, shape=(rb - ra, cb - ca), strides=(s0 * dst.itemsize, dst.itemsize))
    first, last = max(-(-start // rw), ra), min(end // rw, rb)
    if first < last:
        view[first - ra : last - ra] = src[first * rw - start : last * rw - start].reshape(-1, rw)[:, ca:cb]
    for row in {start // rw, (end - 1) // rw} - set(range(first, last)):
        if ra <= row < rb:
            a, b = max(start, row * rw + ca), min(end, row * rw + cb)
            if a < b:
                view[row - ra, a - row * rw - ca : b - row * rw - ca] = src[a - start : b - start]


def read_part_regions(
    get_range: GetRange, part: KeyframePart, specs: Mapping[str, TensorSpec], regions: Mapping[str, Region],
    views: Mapping[str, Any], *, named_by: str,
) -> int:
    """Read the elements of a keyframe part that ``regions`` hold into ``views`` (each region's
    view, as for staging); every piece read is verified. Returns the bytes read.

    A row range is one contiguous byte range of the part; a column block spans its first to last
    row, so a TP-t rank holding column blocks reads about t times their bytes (every row's pieces)."""
    ps = part.piece_size
    holder = SegmentPart(part, bytearray(part.size), None)  # type: ignore[arg-type]  # pieces only
    _read_pieces(get_range, holder, [0], named_by)
    (hlen,) = struct.unpack_from("<Q", holder.data, 0)
    if 8 + hlen > part.size:
        raise FormatError(f"{part.key}: header length {hlen} is beyond the part ({part.size} bytes)")
    pos = 8 + hlen
    wanted: set[int] = set()
    jobs: list[tuple[str, int, int, int, int]] = []
    for name, start, count in part.tensors:
        spec = specs[name]
        isz = uint_dtype(spec.dtype).itemsize
        region = regions.get(name)
        span = None if region is None or region.kind == "none" else _needed_bytes(spec, region, start, count, isz)
        if span is not None:
            wanted.update(range((pos + span[0]) // ps, (pos + span[1] - 1) // ps + 1))
            jobs.append((name, start, count, pos, isz))
        pos += count * isz
    if pos != part.size:
        raise FormatError(f"{part.key}: its ranges end at byte {pos}, {named_by} records {part.size} bytes")
    _read_pieces(get_range, holder, sorted(wanted), named_by)
    for name, start, count, at, isz in jobs:
        spec, region = specs[name], regions[name]
        a, b = _needed_bytes(spec, region, start, count, isz) or (0, 0)
        src = np.frombuffer(holder.data, dtype=uint_dtype(spec.dtype), count=(b - a) // isz, offset=at + a)
        span, s0 = span_of(name, views[name], region.shape(spec.shape))
        _copy_rows(src, start + a // isz, spec, region, flat_bits(name, span, writable=True), s0)
    return holder.fetched_bytes


__all__ = ["GetRange", "SegmentPart", "plan_segment", "read_header", "read_part_regions", "read_segment_parts"]
