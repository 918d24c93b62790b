"""Transactional apply: decode segments into absolute new values (stage), then commit or roll back.

Staging reads the old values before anything is written; the commit writes absolute new values
only, so running it twice is harmless, and the old values kept at the changed positions let the
same update be rolled back. Before writing, commit and rollback check that every changed position
still holds either the old or the new bits, so an update staged against a state that has since
moved on is refused instead of half-applied.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarl.errors import BaseMismatch, DeltaRLError, FormatError, StagingError, TensorMismatch
from deltarl.pipeline import kernels, registry
from deltarl.pipeline.codecs import Decoded
from deltarl.pipeline.kernels import worker_threads
from deltarl.pipeline.segment import ChunkInfo, read_segment_header
from deltarl.pipeline.tensors import TensorSpec, flat_bits, is_cuda, spec_of, tensor_table, uint_dtype

log = logging.getLogger(__name__)


def _device_flat(name: str, value: Any) -> Any:
    torch = sys.modules["torch"]
    if not value.is_contiguous():
        raise TensorMismatch(f"tensor {name!r} is not contiguous")
    return value.detach().view(-1).view(torch.int16 if value.element_size() == 2 else torch.int32)


def _old_range(name: str, value: Any, start: int, stop: int) -> np.ndarray:
    """Old bits of elements [start, stop) as a numpy array (a view for CPU tensors)."""
    if is_cuda(value):
        host = _device_flat(name, value)[start:stop].cpu().numpy()
        return host.view(np.uint16 if value.element_size() == 2 else np.uint32)
    return flat_bits(name, value)[start:stop]


class StagedUpdate:
    """A fully decoded delta, ready to be committed in place (and rolled back).

    ``changed_elements`` counts the elements the update writes, ``tensors`` names the tensors
    with at least one of them (sorted), ``base`` is the version id the update applies to.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        base: str,
        staged: dict[str, tuple[np.ndarray, ...]],
        specs: dict[str, TensorSpec],
    ) -> None:
        self._state = state
        self._specs = specs
        self.base = base
        self._staged = staged  # name -> (positions int64, old bits, new bits)
        self.tensors: tuple[str, ...] = tuple(sorted(staged))
        self.changed_elements: int = sum(int(p.size) for p, _, _ in staged.values())

    def _targets(self, direction: str) -> tuple[list[_Job], DeltaRLError | None]:
        """The tensors to write, in order, up to the first one that was replaced or is read-only."""
        jobs: list[_Job] = []
        for name, (pos, old, new) in self._staged.items():
            if pos.size == 0:
                continue
            value = self._state.get(name)
            if value is None or spec_of(name, value) != self._specs[name]:
                return jobs, TensorMismatch(
                    f"cannot {direction}: tensor {name!r} was replaced or reshaped since staging"
                )
            if is_cuda(value):
                jobs.append((name, value, pos, old, new))
                continue
            try:  # writable=True: a read-only tensor is refused here, before anything is written
                jobs.append((name, flat_bits(name, value, writable=True), pos, old, new))
            except TensorMismatch as err:
                return jobs, err
        return jobs, None

    def _stale(self, direction: str, name: str) -> StagingError:
        return StagingError(
            f"cannot {direction}: tensor {name!r} changed since the update was staged (base {self.base})"
        )

    def _check(self, direction: str, jobs: list[_Job], refused: DeltaRLError | None) -> None:
        """Raise unless every changed position holds its old or new bits (tensor order decides which error)."""
        fresh = {
            key: all(results)
            for key, results in _by_key(
                _run_sliced(
                    [(i, j[1], j[2], j[3], j[4]) for i, j in enumerate(jobs) if not is_cuda(j[1])],
                    kernels.all_old_or_new,
                )
            ).items()
        }
        for i, (name, value, pos, old, new) in enumerate(jobs):
            if is_cuda(value):
                cur = _gather_device(name, value, pos)
                fresh[i] = bool(((cur == old) | (cur == new)).all())
            if not fresh[i]:
                raise self._stale(direction, name)
        if refused is not None:
            raise refused

    def _swap(self, direction: str, to_new: bool) -> None:
        """Write the new (or old) bits after checking that every position holds the old or new bits.

        On CPU the check and the write are one pass (each position is read, checked and written
        once); if any position turns out stale, every write is undone before raising, so a refused
        commit leaves the state exactly as it was, as the separate check would.
        """
        jobs, refused = self._targets(direction)
        if refused is not None or any(is_cuda(j[1]) for j in jobs):
            self._check(direction, jobs, refused)
            for name, target, pos, old, new in jobs:
                if is_cuda(target):
                    _scatter_device(name, target, pos, new if to_new else old)
                else:
                    kernels.scatter(target, pos, new if to_new else old)
            return
        done = _run_sliced(
            [
                (i, flat, pos, *((old, new) if to_new else (new, old)))
                for i, (_, flat, pos, old, new) in enumerate(jobs)
            ],
            kernels.write_checked,  # (flat, pos, other bits, bits to write)
        )
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


# A tensor to write: name, flat bits (or the device tensor), positions, old bits, new bits.
_Job = tuple[str, Any, np.ndarray, np.ndarray, np.ndarray]
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


def _gather_device(name: str, value: Any, pos: np.ndarray) -> np.ndarray:
    torch = sys.modules["torch"]
    got = _device_flat(name, value)[torch.from_numpy(pos).to(value.device)].cpu().numpy()
    return got.view(np.uint16 if value.element_size() == 2 else np.uint32)


def _scatter_device(name: str, value: Any, pos: np.ndarray, vals: np.ndarray) -> None:
    torch = sys.modules["torch"]
    signed = np.int16 if vals.dtype.itemsize == 2 else np.int32
    flat = _device_flat(name, value)
    idx = torch.from_numpy(pos).to(value.device, non_blocking=True)
    src = torch.from_numpy(vals.view(signed)).to(value.device, non_blocking=True)
    flat.index_copy_(0, idx, src)


class Stager:
    """Incremental staging: add segments in any order as they arrive, then :meth:`finish`."""

    def __init__(self, state: Mapping[str, Any], *, base: str) -> None:
        self._state = state
        self._base = base
        self._specs: dict[str, TensorSpec] = {s.name: s for s in tensor_table(state)}
        self._parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._covered: dict[str, list[tuple[int, int]]] = {}
        self._finished = False

    def add_segment(self, data: bytes) -> None:
        """Validate and decode one segment; on error nothing is kept and the stager stays usable."""
        if self._finished:
            raise StagingError("stager already finished")
        header = read_segment_header(data)
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
        mv = memoryview(data).cast("B")
        off = header.payload_offset
        jobs = []
        for c in header.chunks:
            if any(s < c.start + c.count and c.start < e for s, e in self._covered.get(c.tensor, [])):
                raise FormatError(
                    f"chunk [{c.start}, {c.start + c.count}) of {c.tensor!r} was already staged"
                )
            if c.changed:
                jobs.append((c, mv[off : off + c.nbytes]))
            off += c.nbytes
        threads = worker_threads()
        tasks = self._tasks(jobs, threads)
        threads = min(threads, len(tasks))
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="deltarl-decode") as pool:
                done = list(pool.map(lambda task: self._run(task, jobs), tasks))
        else:
            done = [self._run(task, jobs) for task in tasks]
        new_parts: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = [None] * len(jobs)  # type: ignore[list-item]
        for task, parts in zip(tasks, done, strict=True):
            for i, part in zip(task, parts, strict=True):
                new_parts[i] = part
        for name, pos, old_v, new_v in new_parts:  # chunk-table order
            self._parts.setdefault(name, []).append((pos, old_v, new_v))
        for c in header.chunks:
            self._covered.setdefault(c.tensor, []).append((c.start, c.start + c.count))

    def _tasks(self, jobs: list[tuple[ChunkInfo, memoryview]], threads: int) -> list[tuple[int, ...]]:
        """Group job indices into tasks, largest first: 16-bit chunks of a codec with a pair decoder
        go two by two (similar sizes together) when there are enough of them to keep every thread busy.
        """
        single: list[tuple[int, ...]] = []
        pairable: list[int] = []
        for i, (c, _) in enumerate(jobs):
            if c.codec in registry.PAIR_DECODERS and uint_dtype(self._specs[c.tensor].dtype).itemsize == 2:
                pairable.append(i)
            else:
                single.append((i,))
        if len(pairable) < 4 * threads:
            single += [(i,) for i in pairable]
            pairable = []
        pairable.sort(key=lambda i: jobs[i][0].count, reverse=True)
        tasks = single + [tuple(pairable[k : k + 2]) for k in range(0, len(pairable), 2)]
        return sorted(tasks, key=lambda t: sum(jobs[i][0].count for i in t), reverse=True)

    def _run(
        self, task: tuple[int, ...], jobs: list[tuple[ChunkInfo, memoryview]]
    ) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
        if len(task) == 1:
            return [self._decode(*jobs[task[0]])]
        (ca, pa), (cb, pb) = jobs[task[0]], jobs[task[1]]
        if ca.codec != cb.codec:
            return [self._decode(ca, pa), self._decode(cb, pb)]
        olds = [_old_range(c.tensor, self._state[c.tensor], c.start, c.start + c.count) for c in (ca, cb)]
        da, db = registry.PAIR_DECODERS[ca.codec]((olds[0], pa, ca.changed), (olds[1], pb, cb.changed))
        return [self._checked(ca, olds[0], da), self._checked(cb, olds[1], db)]

    def _decode(self, c: ChunkInfo, payload: memoryview) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
        old = _old_range(c.tensor, self._state[c.tensor], c.start, c.start + c.count)
        return self._checked(c, old, registry.DECODERS[c.codec](old, payload, c.changed))

    def _checked(
        self, c: ChunkInfo, old: np.ndarray, dec: Decoded
    ) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
        if dec.positions.size != c.changed or dec.values.dtype != uint_dtype(self._specs[c.tensor].dtype):
            raise FormatError(
                f"chunk of {c.tensor!r} decoded to {dec.positions.size} of {c.changed} elements"
            )
        old_v = dec.old_values if dec.old_values is not None else kernels.gather(old, dec.positions)
        pos = dec.positions
        pos += c.start  # a fresh array (Decoded's contract)
        return c.tensor, pos, old_v, dec.values

    def finish(self) -> StagedUpdate:
        """Check that the delta covers every element of every tensor exactly once; return the update."""
        if self._finished:
            raise StagingError("stager already finished")
        for name, spec in self._specs.items():
            covered = sum(e - s for s, e in self._covered.get(name, []))
            if covered != spec.numel:
                raise StagingError(
                    f"delta incomplete: tensor {name!r} has {covered} of {spec.numel} elements covered "
                    "(a segment is missing)"
                )
        self._finished = True
        staged: dict[str, tuple[np.ndarray, ...]] = {}
        for name, parts in self._parts.items():
            staged[name] = (
                parts[0]
                if len(parts) == 1
                else tuple(np.concatenate([p[i] for p in parts]) for i in range(3))
            )
        self._parts = {}
        return StagedUpdate(self._state, self._base, staged, self._specs)


def stage_delta(state: Mapping[str, Any], segments: Iterable[bytes], *, base: str) -> StagedUpdate:
    """Decode every segment against ``state`` (nothing is written) and return the staged update."""
    stager = Stager(state, base=base)
    for seg in segments:
        stager.add_segment(seg)
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
