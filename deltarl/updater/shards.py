"""A rank that holds part of the model: deltas staged, keyframes loaded and digests hashed over only
the :class:`~deltarl.updater.probe.Region` of each checkpoint tensor it holds.

* :func:`stage_regions` decodes a delta's chunks into the rank's views through the codec's regions
  (:mod:`deltarl.codec.regions`: format 2's shard-grid cells decode against the rank's own base).
* :func:`load_keyframe` copies each keyframe part's ranges that meet the rank's regions into its views.
* :func:`owners` checks that the ranks' regions together cover every tensor exactly (replicated
  regions, such as KV heads on more ranks than heads, once) and names which rank hashes which part;
  :func:`digest_shares` hashes a rank's owned parts into shares that
  :func:`~deltarl.pipeline.shard_digest.combine_digest` joins into the whole state's digest.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarl.codec.apply import StagedUpdate
from deltarl.codec.hashing import BLOCK, leaves
from deltarl.codec.regions import Region as CodecRegion
from deltarl.codec.tensors import DTYPES, TensorSpec, flat_bits, stream_offsets
from deltarl.errors import BaseMismatch, FormatError, IntegrityError, TensorMismatch
from deltarl.pipeline.shard_digest import ShardHashes, TensorShardHashes
from deltarl.updater.probe import Placement, Region

RegionKey = tuple[str, str, int, int, tuple[int, ...] | None]  # (tensor, kind, start, stop, fold)
_HEADER_PROBE = 64 << 10  # a keyframe part's first read: its header, in one request mostly
_READ_BYTES = 64 << 20  # a keyframe read's request at most: its bytes are held twice until copied in


def _local_positions(region: Region, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mask of checkpoint flat positions ``pos`` inside the region, their local flat positions)."""
    lo, hi = region.flat_range()
    if region.kind != "cols":
        inside = (pos >= lo) & (pos < hi)
        return inside, pos - lo
    _, cols, inner = region.grid
    col = (pos // inner) % cols
    inside = (col >= region.start) & (col < region.stop)
    local = (pos // (cols * inner)) * ((region.stop - region.start) * inner) + (col - region.start) * inner + pos % inner
    return inside, local


def codec_regions(placements: Sequence[Placement], table: Sequence[TensorSpec]) -> dict[str, CodecRegion]:
    """The codec's regions (:mod:`deltarl.codec.regions`) of this rank: every tensor of ``table``,
    ``none`` where the rank holds nothing of it."""
    held = {p.name: p.region for p in placements}
    out = {}
    for spec in table:
        r = held.get(spec.name)
        out[spec.name] = CodecRegion.none() if r is None else (
            CodecRegion.whole() if r.kind == "whole" else CodecRegion(r.kind, r.start, r.stop, r.fold))  # type: ignore[arg-type]  # rows / cols
    return out


def stage_regions(views: Mapping[str, Any], placements: Sequence[Placement], table: Sequence[TensorSpec],
                  segments: Iterable[bytes], *, base: str) -> StagedUpdate:
    """Decode a delta's segments into this rank's ``views`` (nothing written): the staged update of
    the rank's part. ``table`` is the run's tensor table (the segments name whole tensors); the
    chunks of other ranks' parts are skipped, and each region decodes against the rank's own base
    (segment format 2's shard-grid cells, docs/FORMAT.md).

    Raises:
        BaseMismatch, TensorMismatch, FormatError, StagingError: as :func:`~deltarl.codec.stage_delta`.
    """
    from deltarl.codec.stager import stage_delta

    return stage_delta(views, segments, base=base, regions=codec_regions(placements, table), specs=table)


@dataclass
class RegionStage:
    """What staging a rank's part of one version took: the bytes read and where the time went."""

    fetched_bytes: int  # the rank's pieces and the segments' headers
    read_s: float  # wall: headers, the plan, the pieces read and verified
    decode_s: float  # wall: decode and stage
    #: the staging thread's CPU in decode and stage: below ``decode_s`` when it waited for a core (a decode
    #: pool's other threads, used where the rank has more than one core, are not counted)
    decode_cpu_s: float

    def as_dict(self) -> dict[str, float]:
        return {"read_s": self.read_s, "decode_s": self.decode_s, "decode_cpu_s": self.decode_cpu_s}


def stage_region_reads(get_range: Any, manifest: Any, views: Mapping[str, Any], placements: Sequence[Placement],
                       table: Sequence[TensorSpec], *, base: str) -> tuple[StagedUpdate, RegionStage]:
    """Read only the pieces of ``manifest``'s segments that hold this rank's chunks (each verified;
    :mod:`deltarl.pipeline.region_reads`) and stage them into ``views``; also what it read and took.
    ``get_range(key, start, end)`` is any ranged read (a store's, the fetcher's)."""
    from deltarl.codec.stager import stage_delta
    from deltarl.pipeline.region_reads import read_segment_parts

    t0 = time.perf_counter()
    regions = codec_regions(placements, table)
    parts = read_segment_parts(get_range, manifest, regions)
    data: list[Any] = [p.data for p in parts]  # the segments' buffers, only the verified pieces read (no copy)
    t1, c1 = time.perf_counter(), time.thread_time()
    staged = stage_delta(views, data, base=base, regions=regions, specs=table, headers=[p.header for p in parts])
    took = RegionStage(sum(p.fetched_bytes for p in parts), t1 - t0, time.perf_counter() - t1, time.thread_time() - c1)
    return staged, took


async def load_keyframe(source: Any, manifest: Any, views: Mapping[str, Any], placements: Sequence[Placement],
                        table: Sequence[TensorSpec]) -> int:
    """Copy the keyframe of ``manifest`` into the rank's ``views``, reading of each part only the
    pieces that hold its header and the ranges meeting the rank's regions (each piece checked
    against the manifest's hash before a byte of it is used). Returns the bytes read."""
    import torch

    from deltarl.pipeline.keyframe import part_views

    specs = {t.name: t for t in table}
    where = {p.name: p.region for p in placements}
    read = 0
    for part in manifest.keyframe.parts:
        data = bytearray(part.size)  # zero pages until written: only the pieces read take memory
        have: set[int] = set()
        read += await _read_pieces(source.fetcher, part, data, have, 0, min(part.size, _HEADER_PROBE), manifest.key)
        hlen = int.from_bytes(data[:8], "little")
        read += await _read_pieces(source.fetcher, part, data, have, 0, min(part.size, 8 + hlen), manifest.key)
        # the header checked against the ranges the manifest records (the views are never written: no page is touched)
        lazy = {name: torch.empty(specs[name].numel, dtype=getattr(torch, specs[name].dtype)) for name, _, _ in part.tensors}
        if part_views(part, bytes(data[: 8 + hlen]), specs, lazy, named_by=manifest.key) is None:
            raise FormatError(f"{part.key}: header of {hlen} bytes not read")
        pos, spans = 8 + hlen, []
        for name, start, count in part.tensors:
            size = DTYPES[specs[name].dtype][1] // 8
            region = where.get(name)
            if region is not None:
                lo, hi = region.flat_range()
                a, b = max(start, lo), min(start + count, hi)
                if a < b:
                    read += await _read_pieces(source.fetcher, part, data, have, pos + (a - start) * size,
                                               pos + (b - start) * size, manifest.key)
                    spans.append((name, start, count, pos))
            pos += count * size
        await asyncio.to_thread(_copy_ranges, spans, data, specs, views, where)
    return read


async def _read_pieces(fetcher: Any, ref: Any, data: bytearray, have: set[int], start: int, end: int, named_by: str) -> int:
    """Read the pieces of ``ref`` holding bytes ``[start, end)`` into ``data`` (each verified); the bytes read."""
    from deltarl.pipeline.pieces import hash_piece

    ps = ref.piece_size
    todo = [i for i in range(start // ps, -(-end // ps)) if i not in have] if end > start else []
    read = 0
    while todo:
        run = [todo.pop(0)]
        while todo and todo[0] == run[-1] + 1 and len(run) * ps < _READ_BYTES:
            run.append(todo.pop(0))
        a, b = run[0] * ps, min(ref.size, (run[-1] + 1) * ps)
        got = memoryview(await fetcher.fetch_range(ref.key, a, b))
        if len(got) != b - a:
            raise IntegrityError(f"{ref.key}: bytes {a}..{b}: got {len(got)}")
        for i in run:
            piece = got[i * ps - a : min(b, (i + 1) * ps) - a]
            if hash_piece(piece) != ref.pieces[i]:
                raise IntegrityError(f"{ref.key}: piece {i} does not match the hash {named_by} records")
        data[a:b] = got
        have.update(run)
        read += b - a
    return read


def _copy_ranges(spans: Iterable[tuple[str, int, int, int]], data: bytearray, specs: Mapping[str, TensorSpec],
                 views: Mapping[str, Any], where: Mapping[str, Region]) -> None:
    """Copy the elements of each keyframe range ``(name, start, count, part offset)`` in the rank's
    region from the part's bytes into its view, as slices: no index array of the range is built (one
    of an embedding's 155M elements took 8 bytes each, several times over)."""
    for name, start, count, pos in spans:
        region = where[name]
        size = DTYPES[specs[name].dtype][1] // 8
        src = np.frombuffer(data, dtype=np.uint16 if size == 2 else np.uint32, count=count, offset=pos)
        dst = flat_bits(name, views[name], writable=True)
        if region.kind != "cols":  # whole or a row range: one contiguous run of the checkpoint
            lo, hi = region.flat_range()
            a, b = max(start, lo), min(start + count, hi)
            if a < b:
                dst[a - lo : b - lo] = src[a - start : b - start]
            continue
        _, cols, inner = region.grid
        row, width = cols * inner, (region.stop - region.start) * inner
        first, last = -(-start // row), (start + count) // row  # the checkpoint rows the range holds whole
        if first < last:
            whole = src[first * row - start : last * row - start].reshape(last - first, row)
            dst[first * width : last * width].reshape(last - first, width)[:] = whole[:, region.start * inner :
                                                                                     region.stop * inner]
        cut = [(start, start + count)] if first > last else [(start, first * row), (last * row, start + count)]
        for a, b in cut:
            if a < b:  # a row the range cuts: at most one row's positions
                inside, local = _local_positions(region, np.arange(a, b, dtype=np.int64))
                dst[local[inside]] = src[a - start : b - start][inside]


def owners(table: Sequence[TensorSpec], regions: Sequence[Mapping[str, Region]]) -> list[set[str]]:
    """Per rank, the tensors whose part it hashes for the engine's digest (a part several ranks hold:
    the lowest). TensorMismatch unless the ranks' distinct parts tile every tensor exactly."""
    out: list[set[str]] = [set() for _ in regions]
    for spec in table:
        held: dict[RegionKey, int] = {}
        for rank, rs in enumerate(regions):
            r = rs.get(spec.name)
            if r is not None:
                held.setdefault((spec.name, r.kind, r.start, r.stop, r.fold), rank)
        kinds = {(k[1], k[4]) for k in held}  # one kind, in one fold
        spans = sorted((k[2], k[3]) for k in held)
        sample = regions[next(iter(held.values()))][spec.name] if held else None
        whole_dim = sample.grid[1] if sample is not None and sample.kind == "cols" else (spec.shape[0] if spec.shape else 1)
        tiled = bool(held) and len(kinds) == 1 and spans[0][0] == 0 and spans[-1][1] == whole_dim and all(
            a[1] == b[0] for a, b in itertools.pairwise(spans))
        if not tiled:
            raise TensorMismatch(f"{spec.name}: the engine's ranks hold {sorted(held)[:4] or 'none of it'}, "
                                 "which does not cover the tensor exactly once")
        for rank in held.values():
            out[rank].add(spec.name)
    return out


def _range_part(raw: memoryview, b0: int, total: int) -> TensorShardHashes:
    """Hashes of the stream blocks wholly inside bytes ``[b0, b0 + len(raw))`` and the cut blocks' bytes."""
    b1 = b0 + len(raw)
    part = TensorShardHashes()
    first, last = -(-b0 // BLOCK), b1 // BLOCK
    if b1 == total and last * BLOCK < total:
        last += 1
    cuts = [(b0, b1)]
    if first < last:
        part.first_block = first
        part.leaves = leaves(raw[first * BLOCK - b0 : min(last * BLOCK, total) - b0])
        cuts = [(b0, first * BLOCK), (last * BLOCK, b1)]
    for lo, hi in cuts:
        pos = lo
        while pos < hi:
            end = min(hi, (pos // BLOCK + 1) * BLOCK)
            part.fragments.append((pos // BLOCK, pos, bytes(raw[pos - b0 : end - b0])))
            pos = end
    return part


def digest_shares(table: Sequence[TensorSpec], placements: Sequence[Placement], views: Mapping[str, Any],
                  owned: set[str]) -> list[ShardHashes]:
    """This rank's shares of the state digest: the parts of the ``owned`` tensors it holds."""
    ordered = sorted(table, key=lambda s: s.name)
    offsets = stream_offsets(ordered)
    total = sum(s.numel * DTYPES[s.dtype][1] // 8 for s in ordered)
    out: list[ShardHashes] = []
    for pl in placements:
        if pl.name not in owned:
            continue
        size = views[pl.name].element_size()
        raw = memoryview(flat_bits(pl.name, views[pl.name])).cast("B")  # type: ignore[arg-type]  # numpy: a buffer
        r = pl.region
        lo, _ = r.flat_range()
        if r.kind != "cols":
            out.append({pl.name: _range_part(raw, offsets[pl.name] + lo * size, total)})
            continue
        rows, cols, inner = r.grid
        w = (r.stop - r.start) * inner  # elements of one row of the part
        for i in range(rows):
            start = offsets[pl.name] + (i * cols + r.start) * inner * size
            out.append({pl.name: _range_part(raw[i * w * size : (i + 1) * w * size], start, total)})
    return out


async def catch_up_regions(source: Any, version: int, views: Mapping[str, Any], placements: Sequence[Placement],
                           table: Sequence[TensorSpec], *, verify: bool = True) -> tuple[Any, str, Any]:
    """Load ``version`` into the rank's ``views``: the newest keyframe at or before it, then each
    delta after it (staged over the rank's regions, then committed). Returns the manifest, its id,
    and the newest manifest of the chain that records a state digest (None: none), which the caller
    checks with every rank (:func:`digest_shares`): no rank can hash the whole state alone.
    """
    from deltarl.pipeline.catch_up import check_up_to_head, walk_down

    chain = await walk_down(source, version)
    if verify:
        await check_up_to_head(source, version, chain[-1][1])
    await load_keyframe(source, chain[0][0], views, placements, table)
    for (manifest, _), (_, parent) in zip(chain[1:], chain[:-1], strict=True):
        if manifest.parent != parent:
            raise BaseMismatch(f"{manifest.key}: parent is not the id of version {manifest.version - 1}")
        segments = await source.segments(manifest)
        staged = await asyncio.to_thread(stage_regions, views, placements, table, segments, base=parent)
        staged.commit()
    digest_at = next((m for m, _ in reversed(chain[1:]) if m.state_digest is not None), None)
    return chain[-1][0], chain[-1][1], digest_at
