"""Staging: decode segments against a state, or against views of the parts a rank holds, into a
:class:`~deltarl.codec.apply.StagedUpdate` (nothing is written until its commit)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarl.codec import ctxs_cells, kernels, registry
from deltarl.codec.apply import StagedUpdate, _old_range, _old_reader, _Part
from deltarl.codec.chunk import Decoded
from deltarl.codec.ctxs import ClassRecord
from deltarl.codec.grid import GRID
from deltarl.codec.kernels import worker_threads
from deltarl.codec.regions import (
    PART_CODECS,
    Placement,
    Region,
    chunk_overlaps,
    folded_cell,
    in_region_count,
    overlap,
)
from deltarl.codec.segment import FLAT, ChunkInfo, SegmentHeader, read_segment_header
from deltarl.codec.stage_columns import (
    ALL,
    EMPTY_ROWS,
    HOW,
    NONE,
    PART,
    SKIP,
    first_overlap,
    pairs,
    runs,
    sums,
)
from deltarl.codec.tensors import TensorSpec, flat_bits, is_cuda, tensor_table, uint_dtype
from deltarl.errors import BaseMismatch, FormatError, RegionError, StagingError, TensorMismatch


class Stager:
    """Incremental staging: add segments in any order as they arrive, then :meth:`finish`.

    With ``regions`` (:mod:`deltarl.codec.regions`) the state holds, for each tensor a region names,
    a view of that region only (``specs``: the global tensor table, e.g. run.json's): chunks outside
    the regions are skipped, the others decoded against the views alone, and :meth:`finish` checks
    that every element of every region is covered exactly once.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        *,
        base: str,
        torch_scatter: bool = False,
        regions: Mapping[str, Region] | None = None,
        specs: Iterable[TensorSpec] | None = None,
    ) -> None:
        """``torch_scatter=True`` puts CPU torch tensors on the device path as well (CUDA tensors
        always take it): indices and values as torch tensors, the commit an ``index_copy_``."""
        self._state = state
        self._base = base
        self._torch_scatter = torch_scatter
        self._regions = regions
        if regions is None:
            self._specs: dict[str, TensorSpec] = {s.name: s for s in tensor_table(state)}
            self._place: dict[str, Placement] = {}  # made when a tensor's first change is decoded
        else:
            if specs is None:
                raise RegionError("staging regions needs the global tensor table (specs)")
            self._specs = {s.name: s for s in specs}
            self._place = {}
            for name, region in regions.items():
                if region.kind == "none":
                    continue
                if name not in self._specs or name not in state:
                    raise TensorMismatch(f"region of {name!r}: no such tensor in the table or no view in the state")
                self._place[name] = Placement(name, self._specs[name], region, state[name])
        self._parts: dict[str, list[_Part]] = {}
        self._names = list(self._specs)
        self._tid = {name: i for i, name in enumerate(self._names)}  # a tensor's id in the covered rows
        self._covered = EMPTY_ROWS  # (tensor id, cell, start, end) of the chunks staged
        self._counted: dict[str, int] = {}
        self._cells: dict[str, set[bool]] = {}  # per tensor: whether its chunks were cells, row-major, or both
        self._host_jit: dict[str, bool] = {}  # per tensor: numba on and its span in host memory
        self._finished = False

    def add_segment(self, data: bytes, *, header: SegmentHeader | None = None) -> None:
        """Validate and decode one segment; on error nothing is kept and the stager stays usable.
        ``header``: the segment's parsed header when ``data`` holds only the chunks a region needs
        (ranged reads, each piece verified; the other bytes are never read)."""
        self.add_segments([data], headers=None if header is None else [header])

    def add_segments(self, segments: Iterable[bytes], *, headers: Iterable[SegmentHeader] | None = None) -> None:
        """Validate and decode several segments at once, their chunks spread over one pool of
        threads (no barrier per segment); on error nothing is kept and the stager stays usable."""
        if self._finished:
            raise StagingError("stager already finished")
        segs = list(segments)
        self._host_jit = {}
        heads = list(headers) if headers is not None else [read_segment_header(d) for d in segs]
        jobs: list[_Job] = []
        cells: list[_Cells] = []
        taken: list[np.ndarray] = []  # per segment: (tensor, cell, start, end) rows of the chunks staged
        counted: dict[str, int] = {}
        kinds: set[tuple[str, bool]] = set()
        for data, header in zip(segs, heads, strict=True):
            self._check_header(header)
            mv = memoryview(data).cast("B")
            raw = np.frombuffer(mv, dtype=np.uint8)
            t, names = header.table, [s.name for s in header.tensors]
            how = self._overlaps(header)  # the chunks are taken as columns: a Python step only for the few that need one
            take = np.flatnonzero(how != SKIP)
            ids = np.array([self._tid[n] for n in names], dtype=np.int64)[t.tensor[take]] if take.size else take
            taken.append(np.stack((ids, t.cell[take], t.start[take], t.start[take] + t.count[take]), axis=1))
            n = np.where(how[take] == ALL, t.count[take], 0)
            for k in np.flatnonzero(how[take] == PART).tolist():
                c = header.chunk(int(take[k]))
                place = self._place[c.tensor]
                n[k] = in_region_count(place.grid, c, place.bounds)
            for ti, got in zip(*sums(t.tensor[take], n), strict=True):
                counted[names[ti]] = counted.get(names[ti], 0) + got
            kinds.update((names[ti], bool(cell)) for ti, cell in pairs(t.tensor[take], t.cell[take] != FLAT))
            todo = take[(t.changed[take] > 0) & (how[take] != NONE)]
            batch = todo[(t.codec[todo] == _CTXS) & (t.cell[todo] != FLAT) & (t.count[todo] <= _CELL_BATCH_MAX)]
            batch = batch[self._on_host_jit(names, t.tensor[batch])]
            for i in np.setdiff1d(todo, batch, assume_unique=True).tolist():
                c = header.chunk(i)
                off = int(t.offset[i])
                jobs.append((c, mv[off : off + c.nbytes], header.classes.get(c.tensor)))
            order = batch[np.argsort(t.tensor[batch], kind="stable")]  # a tensor's cells in table order
            for ti, rows in zip(*runs(t.tensor[order], order), strict=True):
                name = names[ti]
                table = np.stack([getattr(t, f)[rows] for f in ("offset", "nbytes", "changed", "start", "count", "cell")], 1)
                cells.append(_Cells(name, header.classes.get(name), mv, raw, table, header, rows))
        rows = self._check_taken(taken)
        self._decode_all(jobs, [piece for b in cells for piece in b.split(_CELLS_PER_TASK)])
        self._covered = np.concatenate((self._covered, rows))
        for name, cell in kinds:
            self._cells.setdefault(name, set()).add(cell)
        for name, got in counted.items():
            self._counted[name] = self._counted.get(name, 0) + got

    def _overlaps(self, header: SegmentHeader) -> np.ndarray:
        """Per chunk of ``header``: how it meets this stager's regions (``ALL``, ``PART``, ``NONE``,
        or ``SKIP``: a tensor the stager holds no region of), array operations but for the few
        chunks :func:`chunk_overlaps` leaves to :meth:`_overlap`."""
        t = header.table
        if self._regions is None:
            return np.full(len(t), ALL, dtype=np.int64)
        how = chunk_overlaps(header, self._place)
        out = np.where(how == 1, ALL, np.where(how == -1, NONE, SKIP))
        for i in np.flatnonzero(how == 0).tolist():
            out[i] = HOW[self._overlap(header.chunk(i))]
        return out

    def _check_taken(self, taken: list[np.ndarray]) -> np.ndarray:
        """The rows ``(tensor id, cell, start, end)`` of the chunks of these segments; FormatError if
        one overlaps another of them or one staged before."""
        rows, hit = first_overlap(self._covered, taken)
        if hit is not None:
            tid, _, start, end = (int(x) for x in hit)
            raise FormatError(f"chunk [{start}, {end}) of {self._names[tid]!r} was already staged")
        return rows

    def _on_host_jit(self, names: list[str], tensors: np.ndarray) -> np.ndarray:
        """Per entry of ``tensors`` (header indices): whether its ctxs cells decode in one numba call
        (numba on and the tensor's span in host memory), asked once a tensor per add_segments."""
        uniq, inv = np.unique(tensors, return_inverse=True)
        flags = np.zeros(uniq.size, dtype=bool)
        for k, ti in enumerate(uniq.tolist()):
            on = self._host_jit.get(names[ti])
            if on is None:
                on = self._host_jit[names[ti]] = kernels.ctx_jit() is not None and not is_cuda(
                    self._placement(names[ti]).span)
            flags[k] = on
        return flags[inv]

    def _check_header(self, header: SegmentHeader) -> None:
        if header.base != self._base:
            raise BaseMismatch(f"segment applies to base {header.base!r}, state holds {self._base!r}")
        for spec in header.tensors:
            have = self._specs.get(spec.name)
            if have is None:
                raise TensorMismatch(f"segment names tensor {spec.name!r}, which the state does not have")
            if have != spec:
                raise TensorMismatch(
                    f"tensor {spec.name!r}: segment has {spec.dtype}{list(spec.shape)}, "
                    f"state has {have.dtype}{list(have.shape)}"
                )

    def _overlap(self, c: ChunkInfo) -> str | None:
        """How a chunk meets its tensor's region: "all", "part", "none", or None (no region)."""
        if self._regions is None:
            return "all"
        place = self._place.get(c.tensor)
        if place is None:
            return None
        if place.whole:
            return "all"
        folded_cell(place.region, c)
        how = overlap(place.grid, c, place.bounds)
        if how == "part" and c.changed and c.codec not in PART_CODECS:
            raise RegionError(
                f"chunk [{c.start}, {c.start + c.count}) of {c.tensor!r} (cell {c.cell}, codec {c.codec}) needs "
                f"base elements outside the region {place.region}"
            )
        return how

    def _placement(self, name: str) -> Placement:
        """Where ``name`` is staged into (made on first use when whole tensors are staged)."""
        place = self._place.get(name)
        if place is None:
            place = self._place[name] = Placement(name, self._specs[name], _WHOLE, self._state[name])
        return place

    def _decode_all(self, jobs: list[_Job], cells: list[_Cells]) -> None:
        threads = worker_threads()
        tasks: list[tuple[int, ...] | _Cells] = [*self._tasks(jobs, threads), *cells]
        tasks.sort(key=lambda t: t.work if isinstance(t, _Cells) else sum(_work(jobs[i][0]) for i in t), reverse=True)
        threads = min(threads, len(tasks))
        if sum(_work(job[0]) for job in jobs) + sum(b.work for b in cells) < _POOL_MIN_WORK:
            threads = 1  # a few sparse chunks: a pool costs more than it spreads
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="deltarl-decode") as pool:
                done = list(pool.map(lambda task: self._run(task, jobs), tasks))
        else:
            done = [self._run(task, jobs) for task in tasks]
        for parts in done:
            for name, part in parts:
                self._parts.setdefault(name, []).append(part)

    def _tasks(self, jobs: list[_Job], threads: int) -> list[tuple[int, ...]]:
        """Group job indices into tasks, largest first: 16-bit chunks of a codec with a pair decoder
        go two by two (similar sizes together) when there are enough of them to keep every thread busy.
        """
        single: list[tuple[int, ...]] = []
        pairable: list[int] = []
        for i, (c, _, _) in enumerate(jobs):
            if registry.BY_NAME[c.codec].decode_pair is not None and uint_dtype(self._specs[c.tensor].dtype).itemsize == 2:
                pairable.append(i)
            else:
                single.append((i,))
        if len(pairable) < 4 * threads:
            single += [(i,) for i in pairable]
            pairable = []
        pairable.sort(key=lambda i: jobs[i][0].count, reverse=True)
        tasks = single + [tuple(pairable[k : k + 2]) for k in range(0, len(pairable), 2)]
        return sorted(tasks, key=lambda t: sum(_work(jobs[i][0]) for i in t), reverse=True)

    def _run(self, task: tuple[int, ...] | _Cells, jobs: list[_Job]) -> list[tuple[str, _Part]]:
        if isinstance(task, _Cells):
            return [self._decode_cells(task)]
        if len(task) == 1:
            return [self._decode(*jobs[task[0]])]
        (ca, pa, ra), (cb, pb, rb) = jobs[task[0]], jobs[task[1]]
        if ca.codec != cb.codec:
            return [self._decode(ca, pa, ra), self._decode(cb, pb, rb)]
        olds = [self._old(c) for c in (ca, cb)]
        codec = registry.BY_NAME[ca.codec]
        assert codec.decode_pair is not None  # _tasks pairs only chunks of a codec with a pair decoder
        more_a, more_b = ((ra,), (rb,)) if codec.shared else ((), ())
        da, db = codec.decode_pair((olds[0], pa, ca.changed, *more_a), (olds[1], pb, cb.changed, *more_b))
        return [self._checked(ca, olds[0], da), self._checked(cb, olds[1], db)]

    def _old(self, c: ChunkInfo) -> np.ndarray:
        """Contiguous old bits of a chunk that lies wholly in its region."""
        place = self._placement(c.tensor)
        if place.whole and c.cell == FLAT:
            return _old_range(c.tensor, place.span, c.start, c.start + c.count)
        return place.old_bits(c)

    def _decode(self, c: ChunkInfo, payload: memoryview, record: ClassRecord | None = None) -> tuple[str, _Part]:
        place = self._placement(c.tensor)
        codec = registry.BY_NAME[c.codec]
        gather = codec.decode_gather
        if gather is not None:  # the base is read at the changed positions only
            udt = np.dtype(uint_dtype(self._specs[c.tensor].dtype))
            if place.whole and c.cell == FLAT:
                read = _old_reader(c.tensor, place.span, c.start, c.start + c.count)
            else:
                read = self._region_reader(place, c)
            return self._checked(c, None, gather(read, c.count, payload, c.changed, udt))
        if place.whole or overlap(place.grid, c, place.bounds) == "all":
            old = self._old(c)
        else:  # a part of a chunk whose codec finds its changes alone: zeros stand for other ranks' base
            old = np.zeros(c.count, dtype=uint_dtype(self._specs[c.tensor].dtype))
            mask, offs = place.offsets(c, np.arange(c.count, dtype=np.int64))
            old[mask if mask is not None else slice(None)] = _old_reader(c.tensor, place.span, 0, None)(offs)
        more = (record,) if codec.shared else ()
        return self._checked(c, old, codec.decode(old, payload, c.changed, *more))

    def _decode_cells(self, b: _Cells) -> tuple[str, _Part]:
        """One numba call for a tensor's ctxs cell chunks of one segment (:func:`ctxs_cells.decode_cells`):
        one part, positions as offsets in the tensor's span."""
        place = self._placement(b.tensor)
        g = place.grid
        ra, _, ca, _ = place.bounds
        span = flat_bits(b.tensor, place.span)
        if b.record is None:
            raise FormatError(f"ctxs chunks of {b.tensor!r} without the tensor's class record")
        cols = b.table
        i, j = np.divmod(cols[:, 5], GRID)
        r0, c0 = i * g.row_cell, j * g.col_cell
        c1 = np.minimum(g.cols, c0 + g.col_cell)
        table = np.column_stack((cols[:, :5], (r0 - ra) * place.s0 + c0 * g.inner - ca, (c1 - c0) * g.inner))
        dec, bad = ctxs_cells.decode_cells(span, place.s0, b.record, b.raw, table)
        if dec is None:  # the chunk decoded alone says why
            k = max(bad, 0)
            c, off = b.header.chunk(int(b.rows[k])), int(cols[k, 0])
            where = f"ctxs chunk [{c.start}, {c.start + c.count}) of {c.tensor!r} (cell {c.cell})"
            try:
                self._decode(c, b.mv[off : off + c.nbytes], b.record)
            except FormatError as e:
                raise FormatError(f"{where}: {e}") from e
            raise FormatError(f"{where} does not decode")
        assert dec.old_values is not None  # the kernel reads them with the base
        pos = dec.positions.astype(np.uint32) if span.size <= 1 << 32 else dec.positions
        return b.tensor, _Part(0, int(span.size), pos, dec.old_values, dec.values)

    def _region_reader(self, place: Placement, c: ChunkInfo) -> Callable[[np.ndarray], np.ndarray]:
        span_read = _old_reader(c.tensor, place.span, 0, None)
        udt = uint_dtype(self._specs[c.tensor].dtype)

        def read(pos: np.ndarray) -> np.ndarray:
            mask, offs = place.offsets(c, pos)
            if mask is None:
                return span_read(offs)
            out = np.zeros(pos.size, dtype=udt)
            out[mask] = span_read(offs)
            return out

        return read

    def _checked(
        self, c: ChunkInfo, old: np.ndarray | None, dec: Decoded
    ) -> tuple[str, _Part]:
        if dec.positions.size != c.changed or dec.values.dtype != uint_dtype(self._specs[c.tensor].dtype):
            raise FormatError(
                f"chunk of {c.tensor!r} decoded to {dec.positions.size} of {c.changed} elements"
            )
        if dec.old_values is not None:
            old_v = dec.old_values
        else:
            assert old is not None  # a decoder handed the chunk's base range
            old_v = kernels.gather(old, dec.positions)
        place = self._placement(c.tensor)
        if place.whole and c.cell == FLAT:
            # relative to the chunk: 4 bytes a position (a chunk of 2**32 elements or more keeps int64)
            pos = dec.positions.astype(np.uint32) if c.count <= 1 << 32 else dec.positions
            return c.tensor, _Part(c.start, c.count, pos, old_v, dec.values)
        mask, offs = place.offsets(c, dec.positions)
        new_v = dec.values
        if mask is not None:
            old_v, new_v = old_v[mask], new_v[mask]
        if offs.size == 0:
            return c.tensor, _Part(0, 0, offs.astype(np.uint32), old_v, new_v)
        start, count = int(offs[0]), int(offs[-1]) - int(offs[0]) + 1
        rel = offs - start
        return c.tensor, _Part(start, count, rel.astype(np.uint32) if count <= 1 << 32 else rel, old_v, new_v)

    def finish(self) -> StagedUpdate:
        """Check that the delta covers every element of every tensor (region) exactly once; return the update."""
        if self._finished:
            raise StagingError("stager already finished")
        for name in self._specs if self._regions is None else self._place:
            place = self._place.get(name)
            want = self._specs[name].numel if place is None else place.region.numel(place.spec.shape)
            covered = self._counted.get(name, 0)
            if covered != want or len(self._cells.get(name, ())) > 1:
                raise StagingError(
                    f"delta incomplete: tensor {name!r} has {covered} of {want} elements covered "
                    "(a segment is missing)"
                )
        self._finished = True
        rank = {name: i for i, name in enumerate(self._specs)}  # the table's order, not the decode's
        parts = {name: sorted((p for p in ps if p.pos.size), key=lambda p: p.start)
                 for name, ps in sorted(self._parts.items(), key=lambda kv: rank[kv[0]])}  # fmt: skip
        self._parts = {}
        parts = {name: ps for name, ps in parts.items() if ps}
        if self._regions is None:
            return StagedUpdate(self._state, self._base, parts, self._specs, torch_scatter=self._torch_scatter)
        spans = {name: self._place[name].span for name in parts}
        specs = {name: self._place[name].span_spec for name in parts}
        return StagedUpdate(spans, self._base, parts, specs, torch_scatter=self._torch_scatter)


_WHOLE = Region.whole()
# A chunk to decode: its entry, its payload and (a ctxs chunk) its tensor's class record.
_Job = tuple[ChunkInfo, memoryview, "ClassRecord | None"]
# Cells of at most this many elements decode in one call per tensor: a larger cell's scan outweighs
# its ~100 us of Python, and the pair decoder's interleaved scan is faster (1.7B's MLP and embedding
# cells: 921 ms batched against 633 ms paired at TP 1).
_CELL_BATCH_MAX = 1 << 17
# ctxs cell chunks of one tensor decoded in one task (a tensor's 64 cells spread over the threads).
_CELLS_PER_TASK = 16


@dataclass
class _Cells:
    """A tensor's ctxs cell chunks of one segment, decoded in one call: its class record, the
    segment's bytes (as a memoryview and as uint8), one row a chunk of (payload offset, nbytes,
    changed, start, count, cell), and where the chunks are in the segment's header."""

    tensor: str
    record: ClassRecord | None
    mv: memoryview
    raw: np.ndarray
    table: np.ndarray
    header: SegmentHeader
    rows: np.ndarray  # the chunks' indices in the header's table

    @property
    def work(self) -> int:
        return int(self.table[:, 4].sum())

    def split(self, most: int) -> list[_Cells]:
        """Pieces of at most ``most`` chunks."""
        return [_Cells(self.tensor, self.record, self.mv, self.raw, self.table[k : k + most], self.header,
                       self.rows[k : k + most]) for k in range(0, len(self.rows), most)]  # fmt: skip


_CTXS = registry.BY_NAME["ctxs"].id


# Decode work (in elements scanned) below which staging runs on the calling thread.
_POOL_MIN_WORK = 1 << 22


def _work(c: ChunkInfo) -> int:
    """A chunk's decode cost in elements scanned: its elements, or for a gather codec its changes
    (one change costs about as much as scanning 64 elements)."""
    return 64 * c.changed if registry.BY_NAME[c.codec].reads_changes_only else c.count


def stage_delta(
    state: Mapping[str, Any],
    segments: Iterable[bytes],
    *,
    base: str,
    torch_scatter: bool = False,
    regions: Mapping[str, Region] | None = None,
    specs: Iterable[TensorSpec] | None = None,
    headers: Iterable[SegmentHeader] | None = None,
) -> StagedUpdate:
    """Decode every segment against ``state`` (nothing is written) and return the staged update.
    ``regions``/``specs``: stage into views of parts of tensors (:class:`Stager`); ``headers``: the
    segments' parsed headers, when the segments hold only the verified pieces a region needs."""
    stager = Stager(state, base=base, torch_scatter=torch_scatter, regions=regions, specs=specs)
    stager.add_segments(segments, headers=headers)
    return stager.finish()


def apply_delta(state: Mapping[str, Any], segments: Iterable[bytes], *, base: str) -> None:
    """Apply a delta to ``state`` in place, transactionally: either all of it is written or none.

    Every segment is decoded and checked first (:func:`stage_delta`); only then are the changed
    values written.

    Args:
        state: the base state, written in place (torch tensors on any device, or numpy arrays).
        segments: the delta's segments, as :func:`encode_delta` made them.
        base: the identifier the segments were encoded against.

    Raises:
        FormatError: a malformed or truncated segment, or one made against another ``base`` or
            for other tensors; ``state`` is then unchanged.

    Example:
        >>> apply_delta(state, encode_delta(state, new, base="v1"), base="v1")  # doctest: +SKIP
    """
    stage_delta(state, segments, base=base).commit()
