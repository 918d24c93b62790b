"""Transactional apply: decode segments into absolute new values (stage), then commit or roll back.

Staging reads the old values before anything is written; the commit writes absolute new values
only, so running it twice is harmless, and the old values kept at the changed positions let the
same update be rolled back. Before writing, commit and rollback check that every changed position
still holds either the old or the new bits, so an update staged against a state that has since
moved on is refused instead of half-applied.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarl.codec import kernels, registry
from deltarl.codec.chunk import Decoded
from deltarl.codec.device_apply import DeviceBatch, DevicePlan, device_flat
from deltarl.codec.device_apply import first_stale as device_first_stale
from deltarl.codec.device_apply import write as device_write
from deltarl.codec.kernels import worker_threads
from deltarl.codec.regions import PART_CODECS, Placement, Region, in_region_count, overlap
from deltarl.codec.segment import FLAT, ChunkInfo, SegmentHeader, read_segment_header
from deltarl.codec.tensors import TensorSpec, flat_bits, is_cuda, spec_of, tensor_table, uint_dtype, UINT_BY_SIZE
from deltarl.errors import BaseMismatch, DeltaRLError, FormatError, RegionError, StagingError, TensorMismatch

log = logging.getLogger(__name__)


def _old_range(name: str, value: Any, start: int, stop: int) -> np.ndarray:
    """Old bits of elements [start, stop) as a numpy array (a view for CPU tensors)."""
    if is_cuda(value):
        host = device_flat(name, value)[start:stop].cpu().numpy()
        return host.view(UINT_BY_SIZE[value.element_size()])
    return flat_bits(name, value)[start:stop]


def _old_reader(name: str, value: Any, start: int, stop: int | None) -> Callable[[np.ndarray], np.ndarray]:
    """``read(positions)``: the old bits at chunk-relative positions of elements [start, stop),
    gathered where the tensor lives (a CUDA tensor is gathered on its device: only the changed
    elements cross to the host)."""
    if is_cuda(value):
        torch = sys.modules["torch"]
        flat = device_flat(name, value)[start:stop]
        udt = UINT_BY_SIZE[value.element_size()]

        def read_device(pos: np.ndarray) -> np.ndarray:
            idx = torch.from_numpy(pos).to(flat.device, non_blocking=True)
            return flat.index_select(0, idx).cpu().numpy().view(udt)

        return read_device
    view = flat_bits(name, value)[start:stop]
    return lambda pos: kernels.gather(view, pos)


def _data_ptr(value: Any) -> int | None:
    """Where a torch tensor's or numpy array's data lives (None for other bit containers)."""
    ptr = getattr(value, "data_ptr", None)
    if callable(ptr):
        return int(ptr())
    if isinstance(value, np.ndarray):
        return int(value.ctypes.data)
    return None


class _Part:
    """One chunk's changes: positions relative to ``start`` (uint32 when they fit), old and new bits."""

    __slots__ = ("count", "new", "old", "pos", "start")

    def __init__(self, start: int, count: int, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        self.start, self.count, self.pos, self.old, self.new = start, count, pos, old, new


# A prepared target: the tensor object staged against, its data pointer, and either one writable
# bit view per part (CPU) or the tensor's DevicePlan (torch scatter path).
_Prepared = tuple[Any, "int | None", "list[np.ndarray] | DevicePlan"]


class StagedUpdate:
    """A fully decoded delta, ready to be committed in place (and rolled back).

    ``changed_elements`` counts the elements the update writes, ``tensors`` names the tensors
    with at least one of them (sorted), ``base`` is the version id the update applies to.

    Everything that can be prepared is prepared here, at staging: positions are kept per chunk
    relative to the chunk start (4 bytes each), next to the new and old bits (the old ones are
    what rollback needs), and each target's writable bit views are resolved once; tensors on the
    torch scatter path (CUDA) get their indices and values moved to the device. The commit then
    checks and writes in place, nothing else. ``host_bytes`` is what the staged changes hold in
    host memory.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        base: str,
        parts: dict[str, list[_Part]],
        specs: dict[str, TensorSpec],
        *,
        torch_scatter: bool = False,
    ) -> None:
        self._state = state
        self._specs = specs
        self.base = base
        self._parts = parts
        self._prepared: dict[str, _Prepared] = {}
        self.tensors: tuple[str, ...] = tuple(sorted(parts))
        self.changed_elements: int = sum(int(p.pos.size) for ps in parts.values() for p in ps)
        device_items = []
        for name in list(parts):
            value = state[name]
            if is_cuda(value) or (torch_scatter and _data_ptr(value) is not None and hasattr(value, "device")):
                device_items.append((name, value, *self._host(name)))
                continue
            with contextlib.suppress(TensorMismatch):  # read-only or odd: the commit raises it
                self._prepared[name] = (value, _data_ptr(value), self._views(name, value))
        for name, plan in DeviceBatch.build(device_items).items():
            self._parts[name] = []  # the device holds them now
            self._prepared[name] = (plan.source, _data_ptr(plan.source), plan)

    def _host(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts = self._parts[name]
        if not parts:
            plan = self._prepared[name][2]
            assert isinstance(plan, DevicePlan)
            return plan.host()
        pos = np.concatenate([p.pos.astype(np.int64) + p.start for p in parts])
        old, new = np.concatenate([p.old for p in parts]), np.concatenate([p.new for p in parts])
        if pos.size > 1 and bool((pos[1:] < pos[:-1]).any()):  # cell parts interleave row by row
            order = np.argsort(pos, kind="stable")
            return pos[order], old[order], new[order]
        return pos, old, new

    def changes(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per tensor: absolute int64 positions (sorted), old bits, new bits (fresh host arrays)."""
        return {name: self._host(name) for name in self._parts}

    @property
    def host_bytes(self) -> int:
        """Host memory held by the staged changes (positions, old and new bits)."""
        return sum(p.pos.nbytes + p.old.nbytes + p.new.nbytes for ps in self._parts.values() for p in ps)

    def _views(self, name: str, value: Any) -> list[np.ndarray]:
        flat = flat_bits(name, value, writable=True)
        return [flat[p.start : p.start + p.count] for p in self._parts[name]]

    def _resolve(self, name: str, value: Any) -> list[np.ndarray] | DevicePlan:
        """The prepared target of ``name``, re-resolved if the tensor object or its memory changed."""
        prep = self._prepared.get(name)
        ptr = _data_ptr(value)
        writable = not isinstance(value, np.ndarray) or value.flags.writeable
        if prep is not None and prep[0] is value and ptr is not None and prep[1] == ptr and writable:
            return prep[2]
        if prep is not None and isinstance(prep[2], DevicePlan):
            target: list[np.ndarray] | DevicePlan = prep[2].rebind(name, value)
        else:
            target = self._views(name, value)
        self._prepared[name] = (value, ptr, target)
        return target

    def _targets(self, direction: str) -> tuple[list[_Job], DeltaRLError | None]:
        """The tensors to write, in order, up to the first one that was replaced or is read-only."""
        jobs: list[_Job] = []
        for name in self._parts:
            value = self._state.get(name)
            if value is None or spec_of(name, value) != self._specs[name]:
                return jobs, TensorMismatch(
                    f"cannot {direction}: tensor {name!r} was replaced or reshaped since staging"
                )
            try:  # writable: a read-only tensor is refused here, before anything is written
                jobs.append((name, self._resolve(name, value)))
            except TensorMismatch as err:
                return jobs, err
        return jobs, None

    def _stale(self, direction: str, name: str) -> StagingError:
        return StagingError(
            f"cannot {direction}: tensor {name!r} changed since the update was staged (base {self.base})"
        )

    def _cpu_tasks(self, jobs: list[_Job], to_new: bool | None) -> list[tuple[Any, ...]]:
        """(job index, part view, positions, *bits) per part of the CPU jobs; bits ordered
        (other, to write) for a write, (old, new) for a check (``to_new`` None)."""
        out = []
        for i, (name, target) in enumerate(jobs):
            if isinstance(target, DevicePlan):
                continue
            for view, p in zip(target, self._parts[name], strict=True):
                vals = (p.new, p.old) if to_new is False else (p.old, p.new)
                out.append((i, view, p.pos, *vals))
        return out

    def _check(self, direction: str, jobs: list[_Job], refused: DeltaRLError | None) -> None:
        """Raise unless every changed position holds its old or new bits (tensor order decides which error)."""
        fresh = {key: all(r) for key, r in _by_key(_run_sliced(self._cpu_tasks(jobs, None), kernels.all_old_or_new)).items()}
        plans = [(i, t) for i, (_, t) in enumerate(jobs) if isinstance(t, DevicePlan)]
        bad = device_first_stale([t for _, t in plans])
        for k, (i, _) in enumerate(plans):
            fresh[i] = bad < 0 or k < bad
        for i, (name, _) in enumerate(jobs):
            if not fresh.get(i, True):
                raise self._stale(direction, name)
        if refused is not None:
            raise refused

    def _swap(self, direction: str, to_new: bool) -> None:
        """Write the new (or old) bits after checking that every position holds the old or new bits.

        On CPU the check and the write are one pass (each position is read, checked and written
        once); if any position turns out stale, every write is undone before raising, so a refused
        commit leaves the state exactly as it was, as the separate check would. Tensors on the
        torch scatter path are checked first (one sync per device), then written with index_copy_.
        """
        jobs, refused = self._targets(direction)
        plans = [t for _, t in jobs if isinstance(t, DevicePlan)]
        if refused is not None or plans:
            self._check(direction, jobs, refused)
            for _, view, pos, *vals in self._cpu_tasks(jobs, to_new):
                kernels.scatter(view, pos, vals[1])
            device_write(plans, to_new)
            return
        done = _run_sliced(self._cpu_tasks(jobs, to_new), kernels.write_checked)  # (flat, pos, other, to write)
        stale = [key for key, _, prev in done if prev is None]
        if stale:
            for _, (flat, pos, *_vals), prev in done:
                if prev is not None:
                    kernels.scatter(flat, pos, prev)
            raise self._stale(direction, jobs[min(stale)][0])

    def commit(self) -> None:
        """Write the new values in place. Idempotent; refuses a state that moved on since staging."""
        self._swap("commit", to_new=True)

    def rollback(self) -> None:
        """Restore the old values at the changed positions (undo :meth:`commit`)."""
        self._swap("roll back", to_new=False)


# A tensor to write: its name and its prepared target (bit views per part, or a DevicePlan).
_Job = tuple[str, "list[np.ndarray] | DevicePlan"]
_SLICE = 1 << 17  # changed elements per commit task: enough to amortise a task, small enough to balance


def _run_sliced(
    jobs: list[tuple[Any, ...]], fn: Callable[..., Any]
) -> list[tuple[Any, tuple[Any, ...], Any]]:
    """Run ``fn(target, pos, *values)`` for each job ``(key, target, pos, *values)``, cut into slices of
    positions, on worker threads when there is enough work (the kernels release the GIL).

    Returns ``(key, (target, pos slice, *value slices), result)`` per slice, in job and slice order.
    """
    tasks = []
    for key, target, pos, *vals in jobs:
        if pos.size <= _SLICE:
            tasks.append((key, (target, pos, *vals)))
            continue
        for a in range(0, pos.size, _SLICE):
            tasks.append((key, (target, pos[a : a + _SLICE], *(v[a : a + _SLICE] for v in vals))))
    threads = min(worker_threads(), len(tasks))
    if threads > 1 and sum(int(t[1][1].size) for t in tasks) >= 2 * _SLICE:
        with ThreadPoolExecutor(threads, thread_name_prefix="deltarl-commit") as pool:
            results = list(pool.map(lambda t: fn(*t[1]), tasks))
    else:
        results = [fn(*t[1]) for t in tasks]
    return [(key, args, r) for (key, args), r in zip(tasks, results, strict=True)]


def _by_key(done: list[tuple[Any, tuple[Any, ...], Any]]) -> dict[Any, list[Any]]:
    out: dict[Any, list[Any]] = {}
    for key, _, result in done:
        out.setdefault(key, []).append(result)
    return out


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
        self._covered: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._counted: dict[str, int] = {}
        self._cells: dict[str, set[bool]] = {}  # per tensor: whether its chunks were cells, row-major, or both
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
        jobs: list[tuple[ChunkInfo, memoryview]] = []
        staged: dict[tuple[str, int], list[tuple[int, int]]] = {}
        counted: dict[str, int] = {}
        segs = list(segments)
        heads = list(headers) if headers is not None else [read_segment_header(d) for d in segs]
        for data, header in zip(segs, heads, strict=True):
            self._check_header(header)
            mv = memoryview(data).cast("B")
            off = header.payload_offset
            for c in header.chunks:
                key = (c.tensor, c.cell)
                taken = [*self._covered.get(key, []), *staged.get(key, [])]
                if any(s < c.start + c.count and c.start < e for s, e in taken):
                    raise FormatError(f"chunk [{c.start}, {c.start + c.count}) of {c.tensor!r} was already staged")
                how = self._overlap(c)
                if how is not None:
                    staged.setdefault(key, []).append((c.start, c.start + c.count))
                    if how == "all":
                        n = c.count
                    else:
                        place = self._place[c.tensor]
                        n = in_region_count(place.grid, c, place.bounds)
                    counted[c.tensor] = counted.get(c.tensor, 0) + n
                    if c.changed and how != "none":
                        jobs.append((c, mv[off : off + c.nbytes]))
                off += c.nbytes
        self._decode_all(jobs)
        for key, ranges in staged.items():
            self._covered.setdefault(key, []).extend(ranges)
            self._cells.setdefault(key[0], set()).add(key[1] != FLAT)
        for name, n in counted.items():
            self._counted[name] = self._counted.get(name, 0) + n

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

    def _decode_all(self, jobs: list[tuple[ChunkInfo, memoryview]]) -> None:
        threads = worker_threads()
        tasks = self._tasks(jobs, threads)
        threads = min(threads, len(tasks))
        if sum(_work(c) for c, _ in jobs) < _POOL_MIN_WORK:
            threads = 1  # a few sparse chunks: a pool costs more than it spreads
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="deltarl-decode") as pool:
                done = list(pool.map(lambda task: self._run(task, jobs), tasks))
        else:
            done = [self._run(task, jobs) for task in tasks]
        for parts in done:
            for name, part in parts:
                self._parts.setdefault(name, []).append(part)

    def _tasks(self, jobs: list[tuple[ChunkInfo, memoryview]], threads: int) -> list[tuple[int, ...]]:
        """Group job indices into tasks, largest first: 16-bit chunks of a codec with a pair decoder
        go two by two (similar sizes together) when there are enough of them to keep every thread busy.
        """
        single: list[tuple[int, ...]] = []
        pairable: list[int] = []
        for i, (c, _) in enumerate(jobs):
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

    def _run(
        self, task: tuple[int, ...], jobs: list[tuple[ChunkInfo, memoryview]]
    ) -> list[tuple[str, _Part]]:
        if len(task) == 1:
            return [self._decode(*jobs[task[0]])]
        (ca, pa), (cb, pb) = jobs[task[0]], jobs[task[1]]
        if ca.codec != cb.codec:
            return [self._decode(ca, pa), self._decode(cb, pb)]
        olds = [self._old(c) for c in (ca, cb)]
        decode_pair = registry.BY_NAME[ca.codec].decode_pair
        assert decode_pair is not None  # _tasks pairs only chunks of a codec with a pair decoder
        da, db = decode_pair((olds[0], pa, ca.changed), (olds[1], pb, cb.changed))
        return [self._checked(ca, olds[0], da), self._checked(cb, olds[1], db)]

    def _old(self, c: ChunkInfo) -> np.ndarray:
        """Contiguous old bits of a chunk that lies wholly in its region."""
        place = self._placement(c.tensor)
        if place.whole and c.cell == FLAT:
            return _old_range(c.tensor, place.span, c.start, c.start + c.count)
        return place.old_bits(c)

    def _decode(self, c: ChunkInfo, payload: memoryview) -> tuple[str, _Part]:
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
        return self._checked(c, old, codec.decode(old, payload, c.changed))

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
        parts = {name: sorted((p for p in ps if p.pos.size), key=lambda p: p.start) for name, ps in self._parts.items()}
        self._parts = {}
        parts = {name: ps for name, ps in parts.items() if ps}
        if self._regions is None:
            return StagedUpdate(self._state, self._base, parts, self._specs, torch_scatter=self._torch_scatter)
        spans = {name: self._place[name].span for name in parts}
        specs = {name: self._place[name].span_spec for name in parts}
        return StagedUpdate(spans, self._base, parts, specs, torch_scatter=self._torch_scatter)


_WHOLE = Region.whole()
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
