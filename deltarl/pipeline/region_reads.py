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

from deltarl.codec import ChunkRef, Grid, Region, SegmentHeader, byte_ranges, plan_chunks, read_segment_header
from deltarl.errors import FormatError, IntegrityError, short_pair
from deltarl.pipeline.manifest import Manifest, ObjectRef
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


__all__ = ["GetRange", "SegmentPart", "plan_segment", "read_header", "read_segment_parts"]
