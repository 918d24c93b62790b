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
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarl.codec import kernels
from deltarl.codec.device_apply import DeviceBatch, DevicePlan, device_flat
from deltarl.codec.device_apply import first_stale as device_first_stale
from deltarl.codec.device_apply import write as device_write
from deltarl.codec.kernels import worker_threads
from deltarl.codec.tensors import UINT_BY_SIZE, TensorSpec, flat_bits, is_cuda, spec_of
from deltarl.errors import DeltaRLError, StagingError, TensorMismatch

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


def _unchanged(value: Any, seen: tuple[Any, int, Any], shape: tuple[int, ...]) -> bool:
    """Whether ``value``, the tensor object checked before (``seen``), still has that memory, dtype
    and ``shape`` and is writable: its spec and target need no new look."""
    if _data_ptr(value) != seen[1] or getattr(value, "dtype", None) != seen[2] or value.shape != shape:
        return False
    return not isinstance(value, np.ndarray) or bool(value.flags.writeable)


class _Part:
    """One chunk's changes: positions relative to ``start`` (uint32 when they fit), old and new bits."""

    __slots__ = ("count", "new", "old", "pos", "start")

    def __init__(self, start: int, count: int, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        self.start, self.count, self.pos, self.old, self.new = start, count, pos, old, new


# One tensor's staged changes: absolute positions (uint32 when the tensor has at most 2**32
# elements, else int64), the old bits there and the new bits.
_Changes = tuple[np.ndarray, np.ndarray, np.ndarray]


def _joined(parts: list[_Part]) -> _Changes:
    """One tensor's parts as one ``_Changes`` (positions made absolute); ``parts`` is emptied as it
    is copied, so staging holds each change once more only for the tensor being joined."""
    if len(parts) == 1 and parts[0].start == 0:
        p = parts.pop()
        return p.pos, p.old, p.new
    total = sum(int(p.pos.size) for p in parts)
    wide = max(p.start + p.count for p in parts) > 1 << 32
    pos = np.empty(total, dtype=np.int64 if wide else np.uint32)
    old, new = np.empty(total, dtype=parts[0].old.dtype), np.empty(total, dtype=parts[0].new.dtype)
    a = total
    while parts:  # from the last part: each is released once copied
        p = parts.pop()
        b, a = a, a - int(p.pos.size)
        np.add(p.pos, p.start, out=pos[a:b], dtype=pos.dtype)
        old[a:b], new[a:b] = p.old, p.new
    return pos, old, new


# A prepared target: the tensor object staged against, its data pointer, and either its writable
# flat bit view (CPU) or its DevicePlan (torch scatter path).
_Prepared = tuple[Any, "int | None", "np.ndarray | DevicePlan"]


class StagedUpdate:
    """A fully decoded delta, ready to be committed in place (and rolled back).

    ``changed_elements`` counts the elements the update writes, ``tensors`` names the tensors
    with at least one of them (sorted), ``base`` is the version id the update applies to.

    Everything that can be prepared is prepared here, at staging: each tensor's changes are joined
    into one array of absolute positions (4 bytes each where they fit) next to the new and old bits
    (the old ones are what a rollback, or the undo of a refused commit, writes back), and each
    target's writable bit view is resolved once; tensors on the torch scatter path (CUDA) get their
    indices and values moved to the device. The commit then checks and writes in place, one kernel
    call per tensor, nothing else. ``host_bytes`` is what the staged changes hold in host memory.
    ``parts`` (the stager's, per tensor) is consumed.
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
        self._order: list[str] = list(parts)  # tensor order: the first refusal in it is the one raised
        self._changes: dict[str, _Changes] = {}
        self._prepared: dict[str, _Prepared] = {}
        # per tensor checked against its spec at staging or by a commit: (the object, its data pointer, its dtype)
        self._seen: dict[str, tuple[Any, int, Any]] = {}
        self.tensors: tuple[str, ...] = tuple(sorted(parts))
        device_items = []
        for name in self._order:
            self._changes[name] = _joined(parts.pop(name))
            value = state[name]
            if is_cuda(value) or (torch_scatter and _data_ptr(value) is not None and hasattr(value, "device")):
                device_items.append((name, value, *self._host(name)))
                continue
            with contextlib.suppress(TensorMismatch):  # read-only or odd: the commit raises it
                self._prepared[name] = (value, _data_ptr(value), flat_bits(name, value, writable=True))
                self._see(name, value)
        self.changed_elements: int = sum(int(c[0].size) for c in self._changes.values())
        for name, plan in DeviceBatch.build(device_items).items():
            del self._changes[name]  # the device holds them now
            self._prepared[name] = (plan.source, _data_ptr(plan.source), plan)
            self._see(name, plan.source)

    def _host(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        changes = self._changes.get(name)
        if changes is None:
            plan = self._prepared[name][2]
            assert isinstance(plan, DevicePlan)
            return plan.host()
        pos, old, new = changes[0].astype(np.int64), changes[1].copy(), changes[2].copy()
        if pos.size > 1 and bool((pos[1:] < pos[:-1]).any()):  # cell parts interleave row by row
            order = np.argsort(pos, kind="stable")
            return pos[order], old[order], new[order]
        return pos, old, new

    def changes(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per tensor: absolute int64 positions (sorted), old bits, new bits (fresh host arrays)."""
        return {name: self._host(name) for name in self._order}

    @property
    def host_bytes(self) -> int:
        """Host memory held by the staged changes (positions, old and new bits)."""
        return sum(p.nbytes + o.nbytes + n.nbytes for p, o, n in self._changes.values())

    def _resolve(self, name: str, value: Any) -> np.ndarray | DevicePlan:
        """The prepared target of ``name``, re-resolved if the tensor object or its memory changed."""
        prep = self._prepared.get(name)
        ptr = _data_ptr(value)
        writable = not isinstance(value, np.ndarray) or value.flags.writeable
        if prep is not None and prep[0] is value and ptr is not None and prep[1] == ptr and writable:
            return prep[2]
        if prep is not None and isinstance(prep[2], DevicePlan):
            target: np.ndarray | DevicePlan = prep[2].rebind(name, value)
        else:
            target = flat_bits(name, value, writable=True)
        self._prepared[name] = (value, ptr, target)
        return target

    def _targets(self, direction: str) -> tuple[list[_Job], DeltaRLError | None]:
        """The tensors to write, in order, up to the first one that was replaced or is read-only."""
        jobs: list[_Job] = []
        for name in self._order:
            value = self._state.get(name)
            seen = self._seen.get(name)
            if seen is not None and seen[0] is value and _unchanged(value, seen, self._specs[name].shape):
                jobs.append((name, self._prepared[name][2]))  # checked before: the pause looks no further
                continue
            if value is None or spec_of(name, value) != self._specs[name]:
                return jobs, TensorMismatch(
                    f"cannot {direction}: tensor {name!r} was replaced or reshaped since staging"
                )
            try:  # writable: a read-only tensor is refused here, before anything is written
                jobs.append((name, self._resolve(name, value)))
            except TensorMismatch as err:
                return jobs, err
            self._see(name, value)
        return jobs, None

    def _see(self, name: str, value: Any) -> None:
        """Record ``value`` as checked against its spec, so the commit looks at it again only if it changed."""
        ptr = _data_ptr(value)
        if ptr is not None and spec_of(name, value) == self._specs[name]:
            self._seen[name] = (value, ptr, getattr(value, "dtype", None))

    def _stale(self, direction: str, name: str) -> StagingError:
        return StagingError(
            f"cannot {direction}: tensor {name!r} changed since the update was staged (base {self.base})"
        )

    def _cpu_tasks(self, jobs: list[_Job], to_new: bool | None) -> list[tuple[Any, ...]]:
        """(job index, flat bit view, positions, *bits) per CPU job; bits ordered (other, to write)
        for a write, (old, new) for a check (``to_new`` None)."""
        out = []
        for i, (name, target) in enumerate(jobs):
            if isinstance(target, DevicePlan):
                continue
            pos, old, new = self._changes[name]
            out.append((i, target, pos, *((new, old) if to_new is False else (old, new))))
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

        On CPU the common case is one pass: each position must hold the bits being replaced, and is
        read, checked and written once (:func:`kernels.write_strict`); nothing is saved during the
        pause, since every position it wrote held the staged old (or new) bits, which undo it. If
        any position holds something else, every write is undone that way and the general path
        runs: every position is checked (old or new bits: a commit over a state already partly
        new is allowed, a moved-on state refused with nothing written), then written. Tensors on
        the torch scatter path are checked first (one sync per device), then written with
        index_copy_.
        """
        jobs, refused = self._targets(direction)
        plans = [t for _, t in jobs if isinstance(t, DevicePlan)]
        tasks = self._cpu_tasks(jobs, to_new)
        if refused is None and not plans:
            done = _run_sliced(tasks, kernels.write_strict)  # (flat, pos, other, to write)
            if all(at < 0 for _, _, at in done):
                return
            for _, (flat, pos, other, _vals), at in done:
                if at < 0:  # written whole: undone exactly (a refused slice undid itself)
                    kernels.scatter(flat, pos, other)
        self._check(direction, jobs, refused)
        for _, flat, pos, _other, vals in tasks:
            kernels.scatter(flat, pos, vals)
        device_write(plans, to_new)

    def commit(self) -> None:
        """Write the new values in place. Idempotent; refuses a state that moved on since staging."""
        self._swap("commit", to_new=True)

    def rollback(self) -> None:
        """Restore the old values at the changed positions (undo :meth:`commit`)."""
        self._swap("roll back", to_new=False)


# A tensor to write: its name and its prepared target (flat bit view, or a DevicePlan).
_Job = tuple[str, "np.ndarray | DevicePlan"]
_SLICE = 1 << 17  # changed elements per commit task on several threads: amortises a task, balances


def _run_sliced(
    jobs: list[tuple[Any, ...]], fn: Callable[..., Any]
) -> list[tuple[Any, tuple[Any, ...], Any]]:
    """Run ``fn(target, pos, *values)`` for each job ``(key, target, pos, *values)``: on one thread,
    one call per job; on several (the kernels release the GIL), cut into slices of positions when
    there is enough work.

    Returns ``(key, (target, pos slice, *value slices), result)`` per slice, in job and slice order.
    """
    threads = worker_threads()
    if threads > 1 and sum(int(j[2].size) for j in jobs) >= 2 * _SLICE:
        tasks = []
        for key, target, pos, *vals in jobs:
            for a in range(0, max(1, pos.size), _SLICE):
                tasks.append((key, (target, pos[a : a + _SLICE], *(v[a : a + _SLICE] for v in vals))))
        with ThreadPoolExecutor(min(threads, len(tasks)), thread_name_prefix="deltarl-commit") as pool:
            results = list(pool.map(lambda t: fn(*t[1]), tasks))
        return [(key, args, r) for (key, args), r in zip(tasks, results, strict=True)]
    return [(key, tuple(args), fn(*args)) for key, *args in jobs]


def _by_key(done: list[tuple[Any, tuple[Any, ...], Any]]) -> dict[Any, list[Any]]:
    out: dict[Any, list[Any]] = {}
    for key, _, result in done:
        out.setdefault(key, []).append(result)
    return out


# Staging (Stager, stage_delta, apply_delta) lives in deltarl.codec.stager: it builds the StagedUpdate above.
