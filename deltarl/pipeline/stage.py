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
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarl.errors import BaseMismatch, FormatError, StagingError, TensorMismatch
from deltarl.pipeline import kernels, registry
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

    def _check(self, direction: str) -> None:
        for name, (pos, old, new) in self._staged.items():
            if pos.size == 0:
                continue
            value = self._state.get(name)
            if value is None or spec_of(name, value) != self._specs[name]:
                raise TensorMismatch(
                    f"cannot {direction}: tensor {name!r} was replaced or reshaped since staging"
                )
            if is_cuda(value):
                cur = _gather(name, value, pos)
                fresh = bool(((cur == old) | (cur == new)).all())
            else:  # writable=True: a read-only tensor is refused here, before anything is written
                fresh = kernels.all_old_or_new(flat_bits(name, value, writable=True), pos, old, new)
            if not fresh:
                raise StagingError(
                    f"cannot {direction}: tensor {name!r} changed since the update was staged (base {self.base})"
                )

    def _write(self, which: int) -> None:
        for name, parts in self._staged.items():
            if parts[0].size:
                _scatter(name, self._state[name], parts[0], parts[which])

    def commit(self) -> None:
        """Write the new values in place. Idempotent; refuses a state that moved on since staging."""
        self._check("commit")
        self._write(2)

    def rollback(self) -> None:
        """Restore the old values at the changed positions (undo :meth:`commit`)."""
        self._check("roll back")
        self._write(1)


def _gather(name: str, value: Any, pos: np.ndarray) -> np.ndarray:
    if is_cuda(value):
        torch = sys.modules["torch"]
        got = _device_flat(name, value)[torch.from_numpy(pos).to(value.device)].cpu().numpy()
        return got.view(np.uint16 if value.element_size() == 2 else np.uint32)
    return kernels.gather(flat_bits(name, value), pos)


def _scatter(name: str, value: Any, pos: np.ndarray, vals: np.ndarray) -> None:
    if is_cuda(value):
        torch = sys.modules["torch"]
        signed = np.int16 if vals.dtype.itemsize == 2 else np.int32
        flat = _device_flat(name, value)
        idx = torch.from_numpy(pos).to(value.device, non_blocking=True)
        src = torch.from_numpy(vals.view(signed)).to(value.device, non_blocking=True)
        flat.index_copy_(0, idx, src)
        return
    kernels.scatter(flat_bits(name, value, writable=True), pos, vals)


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
        threads = min(worker_threads(), len(jobs))
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="deltarl-decode") as pool:
                new_parts = list(pool.map(lambda job: self._decode(*job), jobs))
        else:
            new_parts = [self._decode(c, payload) for c, payload in jobs]
        for name, pos, old_v, new_v in new_parts:
            self._parts.setdefault(name, []).append((pos, old_v, new_v))
        for c in header.chunks:
            self._covered.setdefault(c.tensor, []).append((c.start, c.start + c.count))

    def _decode(self, c: ChunkInfo, payload: memoryview) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
        old = _old_range(c.tensor, self._state[c.tensor], c.start, c.start + c.count)
        dec = registry.DECODERS[c.codec](old, payload, c.changed)
        if dec.positions.size != c.changed or dec.values.dtype != uint_dtype(self._specs[c.tensor].dtype):
            raise FormatError(
                f"chunk of {c.tensor!r} decoded to {dec.positions.size} of {c.changed} elements"
            )
        return c.tensor, dec.positions + c.start, kernels.gather(old, dec.positions), dec.values

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
            staged[name] = tuple(np.concatenate([p[i] for p in parts]) for i in range(3))
        self._parts = {}
        return StagedUpdate(self._state, self._base, staged, self._specs)


def stage_delta(state: Mapping[str, Any], segments: Iterable[bytes], *, base: str) -> StagedUpdate:
    """Decode every segment against ``state`` (nothing is written) and return the staged update."""
    stager = Stager(state, base=base)
    for seg in segments:
        stager.add_segment(seg)
    return stager.finish()


def apply_delta(state: Mapping[str, Any], segments: Iterable[bytes], *, base: str) -> None:
    """Stage every segment, then commit in place: either all of the delta is applied or none."""
    stage_delta(state, segments, base=base).commit()
