"""Detect changed elements between two states and encode them into segments, streaming."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarl.codec import ctxs_cells, kernels, registry
from deltarl.codec.chunk import Changes
from deltarl.codec.classes import rank_classes
from deltarl.codec.ctxs import ClassRecord
from deltarl.codec.delta_layout import (
    CELL_COARSE_CHANGES,
    SAMPLE_BLOCK,
    SAMPLE_BLOCKS,
    CellChunks,
    Task,
    class_record,
    delta_tasks,
    host,
    sample,
)
from deltarl.codec.finite import exponent_mask, nonfinite_bits
from deltarl.codec.grid import Grid
from deltarl.codec.kernels import worker_threads
from deltarl.codec.segment import FLAT, ChunkInfo, pack_segment
from deltarl.codec.tensors import TensorSpec, check_compatible, flat_bits, spec_of, tensor_table
from deltarl.errors import NonFiniteChunk, NonFiniteTensor, TensorMismatch

log = logging.getLogger(__name__)

CODECS = ("auto", *(c.name for c in sorted(registry.CODECS, key=lambda c: c.id)))
MAX_CHUNK_ELEMENTS = 1 << 22
MIN_CHUNK_ELEMENTS = 1 << 12
# A segment also ends once its chunks hold this many changed elements: a 1% delta of a 1.7B model
# (~17M changes, ~14 MB encoded) is then ~17 segments of ~0.9 MB instead of one 16 MiB one, so
# uploads start while the rest is still being encoded and actors fetch and stage meanwhile.
SEGMENT_CHANGES = 1 << 20


def chunk_elements(segment_bytes: int) -> int:
    """Elements per chunk: large enough to amortise headers, small enough to fill segments evenly."""
    return int(min(MAX_CHUNK_ELEMENTS, max(MIN_CHUNK_ELEMENTS, segment_bytes // 4)))


def encode_chunk(
    old: np.ndarray, new: np.ndarray, dtype: str, codec: str, *, finite: bool = False, part_safe: bool = False,
    cell: bool = False, record: ClassRecord | None = None,
) -> tuple[str, int, bytes]:
    """Encode one chunk's changes: (codec used, changed count, payload).

    ``auto`` first finds the changes (a comparison at memory speed; a chunk without one costs
    nothing more), then encodes them with every codec of the registry whose ``auto`` range holds
    the chunk's changed fraction, keeping the smallest payload (the first listed on a tie): at RL
    densities ``sparse`` below ``SPARSE_MAX_FRACTION`` changed (its decode reads the base only at
    the changes), ``ctx`` above, and ``dense`` too from half of the chunk changed. ``finite``:
    refuse (``NonFiniteChunk``) if a changed value is NaN or Inf, before encoding it.
    ``part_safe``: ``auto`` uses no codec that ``needs_classes`` (``sparse`` in their range), so any
    part of the chunk decodes alone. ``cell``: the chunk is a grid cell's; with fewer than
    ``CELL_COARSE_CHANGES`` changes its ``ctx`` classes come from ``CELL_CLASS_FIELDS``.
    ``record``: its tensor's class record; ``auto`` then codes ``ctxs`` where it would code ``ctx``.
    """
    named = None if codec == "auto" else registry.by_name(codec)
    if named is not None and named.shared and record is None:
        raise ValueError(f"codec {codec!r} codes a chunk against its tensor's class record")
    if named is None and cell:
        ch = _cell_changes(old, new, dtype, record)
    else:
        classes = named.needs_classes if named else _looks_dense(old, new)
        ch = registry.detect(old, new, dtype, classes and not cell)
    changed = ch.count
    if changed == 0:
        return registry.NONE, 0, b""
    if finite and (bad := nonfinite_bits(new[ch.pos], dtype)):
        raise NonFiniteChunk(bad, changed)
    if named is not None:
        ch = _classes(old, new, dtype, ch, cell, record) if named.needs_classes else ch
        return named.name, changed, named.encode(old, new, dtype, ch, *((record,) if named.shared else ()))
    # 8-bit elements (FP8 codes) weigh a change double: the auto ranges are fitted to 16-bit bases,
    # and a chunk of 8-bit base is half the bytes a class-scanning decoder reads per change
    weight = 2 if old.dtype.itemsize == 1 else 1
    tried = [c for c in registry.AUTO if c.auto_tries(weight * changed, old.size) and not (part_safe and c.needs_classes)]
    if not tried:  # part_safe between sparse's and dense's ranges
        tried = [registry.by_name("sparse")]
    if record is not None:
        tried = [_CTXS if c.name == "ctx" else c for c in tried]
    if ch.classes is None and any(c.needs_classes for c in tried):
        ch = _classes(old, new, dtype, ch, cell, record)
    elif ch.classes is not None and not any(c.needs_classes for c in tried):
        ch = Changes(ch.positions())
    coded = [(c.name, c.encode(old, new, dtype, ch, *((record,) if c.shared else ()))) for c in tried]
    used, payload = min(coded, key=lambda item: len(item[1]))  # the first listed on a tie
    return used, changed, payload


_CTXS = registry.by_name("ctxs")


def _classes(old: np.ndarray, new: np.ndarray, dtype: str, ch: Changes, cell: bool,
             record: ClassRecord | None = None) -> Changes:  # fmt: skip
    """The changes with their exponent classes ranked (a cell with few changes: coarse classes;
    with a class record: its class field)."""
    if record is not None:
        if ch.classes is not None and (ch.classes.shift, ch.classes.cbits) == (record.shift, record.cbits):
            return ch
        code = rank_classes(old, new, dtype, field=(record.shift, record.cbits))
        return Changes(code.pos, code)
    if ch.classes is not None:
        return ch
    if not cell:
        return registry.detect(old, new, dtype, True)
    code = rank_classes(old, new, dtype, cell=ch.count < CELL_COARSE_CHANGES)
    return Changes(code.pos, code)


def _cell_changes(old: np.ndarray, new: np.ndarray, dtype: str, record: ClassRecord | None) -> Changes:
    """A cell chunk's changes, ranked in the detection pass when a sample says ``ctx`` will code it,
    with its tensor's record's class field, or (no record) the one its exact change count calls for
    (``CELL_COARSE_CHANGES``): the sample picks the field, and a wrong guess costs a second pass,
    never other bytes."""
    hits, n = sample(old, new)
    if not any(c.auto is not None and c.needs_classes and 2 * c.auto[0] * n <= hits < c.auto[1] * n
               for c in registry.AUTO):  # fmt: skip
        return Changes(kernels.changed_positions(old, new))
    if record is not None:
        code = rank_classes(old, new, dtype, field=(record.shift, record.cbits))
        return Changes(code.pos, code)
    coarse = hits * old.size < CELL_COARSE_CHANGES * n
    code = rank_classes(old, new, dtype, cell=coarse)
    if (code.pos.size < CELL_COARSE_CHANGES) != coarse:
        code = rank_classes(old, new, dtype, cell=not coarse)
    return Changes(code.pos, code)




def _looks_dense(old: np.ndarray, new: np.ndarray) -> bool:
    """A sample (32 evenly spaced runs of 512 elements, 0.4% of a full chunk, contiguous so it reads
    no more memory than it compares) changed at twice the low end of the ``auto`` range of a codec
    that ``needs_classes`` (``ctx``) or more: the chunk will most likely be coded with it, so
    detection ranks classes in the same pass. Only the work path depends on it; the codec is
    chosen by the exact count, so the bytes do not."""
    if old.size < 8 * SAMPLE_BLOCKS * SAMPLE_BLOCK:
        return False
    step = old.size // SAMPLE_BLOCKS
    a = old[: step * SAMPLE_BLOCKS].reshape(SAMPLE_BLOCKS, step)[:, :SAMPLE_BLOCK]
    b = new[: step * SAMPLE_BLOCKS].reshape(SAMPLE_BLOCKS, step)[:, :SAMPLE_BLOCK]
    hits = int(np.count_nonzero(a != b))
    n = SAMPLE_BLOCKS * SAMPLE_BLOCK
    return any(c.auto is not None and c.needs_classes and 2 * c.auto[0] * n <= hits < c.auto[1] * n
               for c in registry.AUTO)




def iter_encode_delta(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    base: str,
    segment_bytes: int = 16 << 20,
    codec: str = "auto",
    segment_changes: int = SEGMENT_CHANGES,
    check_finite: bool = False,
    cells: bool = True,
) -> Iterator[bytes]:
    """Yield the segments of the delta ``old -> new`` as each fills up: ~``segment_bytes`` of payload
    or ``segment_changes`` changed elements, whichever comes first (cut at chunk boundaries).

    Tensors are visited in sorted name order and cut into chunks; every element of every tensor is
    covered by exactly one chunk of exactly one segment. Segments are independent of each other.
    ``check_finite``: raise :class:`~deltarl.errors.NonFiniteTensor` if a changed value is NaN or
    Inf (with ``old`` known finite, that proves ``new`` finite at the cost of the changes only).
    ``cells=False``: no tensor is cut into grid cells and ``auto`` may code any chunk ``ctx`` (a
    few % smaller at RL densities; only a rank holding whole tensors can then stage it).
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")
    if not base or len(base.encode()) > 1024:
        raise ValueError("base must be a non-empty id of at most 1024 utf-8 bytes")
    if segment_bytes < 1 or segment_changes < 1:
        raise ValueError("segment_bytes and segment_changes must be positive")
    table = tensor_table(old)
    check_compatible(new, table)
    step = chunk_elements(segment_bytes)

    records: dict[str, ClassRecord] = {}  # filled by the task producer before a tensor's first chunk
    tasks = delta_tasks(table, old, new, step, cells, codec, records)
    yield from _segments(tasks, base, segment_bytes, segment_changes, codec, worker_threads(), empty=True,
                         finite=check_finite, part_safe=cells, records=records)




def _encode_named(spec: TensorSpec, cell: int, start: int, count: int, old: np.ndarray, new: np.ndarray,
                  codec: str, finite: bool, part_safe: bool, record: ClassRecord | None) -> tuple[str, int, bytes]:  # fmt: skip
    if cell != FLAT:  # the copy runs on the worker thread (numpy releases the GIL), not the producer
        grid = Grid(spec.shape)
        old, new = grid.tile_range(old, cell, start, start + count), grid.tile_range(new, cell, start, start + count)
    try:
        return encode_chunk(old, new, spec.dtype, codec, finite=finite, part_safe=part_safe and cell == FLAT,
                            cell=cell != FLAT, record=record)
    except NonFiniteChunk as err:
        raise NonFiniteTensor(
            f"tensor {spec.name!r} holds {err.bad} NaN/Inf values among the {err.changed} elements changed in "
            f"[{start}, {start + old.size}) of {'its elements' if cell == FLAT else f'cell {cell}'}; refusing to publish it (pass allow_nonfinite=True to publish anyway)"
        ) from None


def _encoded(
    tasks: Iterator[Task | CellChunks], codec: str, threads: int, finite: bool = False, part_safe: bool = False,
    records: Mapping[str, ClassRecord] | None = None,
) -> Iterator[Encoded]:
    """Encode chunks in order, ``threads`` tasks at a time (the kernels release the GIL). ``part_safe``:
    ``auto`` codes row-major chunks with codecs that find the changes without the base. ``records``:
    the tensors' class records (``auto`` uses one for cell chunks, ``ctxs`` for every chunk)."""
    records = {} if records is None else records

    def work(task: Task | CellChunks) -> list[Encoded]:
        if isinstance(task, CellChunks):
            return _encode_cells(task, codec, finite, records.get(task.spec.name))
        spec, cell, start, count, o, n = task
        record = records.get(spec.name) if cell != FLAT or codec == _CTXS.name else None
        return [(spec, cell, start, count, _encode_named(spec, cell, start, count, o, n, codec, finite, part_safe,
                                                         record))]  # fmt: skip

    if threads <= 1:
        for task in tasks:
            yield from work(task)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="deltarl-encode") as pool:
        window: deque[Future[list[Encoded]]] = deque()
        for task in tasks:
            window.append(pool.submit(work, task))
            if len(window) > 2 * threads:
                yield from window.popleft().result()
        while window:
            yield from window.popleft().result()


# One encoded chunk: the tensor, its cell (FLAT: row-major), first index, elements, (codec, changed, payload).
Encoded = tuple[TensorSpec, int, int, int, tuple[str, int, bytes]]


def _encode_cells(task: CellChunks, codec: str, finite: bool, record: ClassRecord | None) -> list[Encoded]:
    """A tiled tensor's cell chunks: those ``auto`` (or ``ctxs`` by name) codes ``ctxs`` in one numba
    call (:func:`deltarl.codec.ctxs_cells.encode_cells`, the bytes of :func:`encode_chunk`), the others
    (``sparse`` or ``dense`` may code them, or a NaN / Inf to report), and every chunk without numba
    or a class record, chunk by chunk."""
    spec, grid, old, new = task.spec, task.grid, task.old, task.new
    batch = None
    if record is not None and codec in ("auto", _CTXS.name):
        table = np.empty((len(task.chunks), 5), dtype=np.int64)
        bands: dict[tuple[int, ...], int] = {}  # chunks of the same whole rows of cells in a row band
        for i, (cell, start, count) in enumerate(task.chunks):
            r0, r1, c0, c1 = grid.rect(cell)
            width = (c1 - c0) * grid.inner
            if c1 - c0 == grid.cols:  # the cell's rows are whole rows: one run (a 1-D tensor's cells too)
                width *= r1 - r0
            rows = start % width == 0 and count % width == 0
            band = bands.setdefault((r0, start, count, width), len(bands)) if rows else -1
            table[i] = start, count, r0 * grid.row_elems + c0 * grid.inner, width, band
        batch = ctxs_cells.encode_cells(old, new, grid.row_elems, record, table, finite_mask=exponent_mask(spec.dtype) if finite else 0,
                                  **_cells_rule(codec, old.dtype.itemsize))  # fmt: skip
    out: list[Encoded] = []
    for i, (cell, start, count) in enumerate(task.chunks):
        if batch is None or batch[0][i, 0] == ctxs_cells.CELL_OTHER:
            res = _encode_named(spec, cell, start, count, old, new, codec, finite, False, record)
        elif batch[0][i, 0] == ctxs_cells.CELL_NONE:
            res = registry.NONE, 0, b""
        else:
            res = _CTXS.name, int(batch[0][i, 1]), batch[1][i]
        out.append((spec, cell, start, count, res))
    return out


def _cells_rule(codec: str, itemsize: int) -> dict[str, Any]:
    """When :func:`encode_chunk` codes a cell chunk ``ctxs`` (the :func:`ctxs_cells.encode_cells` arguments):
    by name always; ``auto`` when ``ctx``'s range is the only one of its codecs' that holds the chunk's
    changes (8-bit elements weighing a change double, as there)."""
    if codec == _CTXS.name:
        return {}
    ctx = registry.by_name("ctx")
    assert ctx.auto is not None
    others = [c.auto for c in registry.AUTO if c is not ctx and c.auto is not None]
    return {"alone": ctx.auto, "others": np.array(others, dtype=np.float64).reshape(-1, 2),
            "weight": 2 if itemsize == 1 else 1}  # fmt: skip


def iter_encode_rows(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    rows: Mapping[str, tuple[TensorSpec, int]],
    *,
    base: str,
    segment_bytes: int = 16 << 20,
    codec: str = "auto",
    threads: int | None = None,
    segment_changes: int = SEGMENT_CHANGES,
    check_finite: bool = False,
) -> Iterator[bytes]:
    """Yield the segments of the delta of one shard: a contiguous element range of each tensor.

    ``rows[name] = (global spec, start)``: the local tensors ``old[name]`` / ``new[name]`` hold the
    elements ``[start, start + local numel)`` of the row-major flattened global tensor (a dim-0
    shard). Chunks carry global element positions and segments the global tensor table, so the
    segments of every shard together form one delta of the whole state. Empty shards yield no
    chunks; a shard with no elements at all yields no segment. ``threads`` caps the encode threads
    (default :func:`worker_threads`); ``check_finite`` as for :func:`iter_encode_delta`.
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")
    if not base or len(base.encode()) > 1024:
        raise ValueError("base must be a non-empty id of at most 1024 utf-8 bytes")
    if segment_bytes < 1:
        raise ValueError("segment_bytes must be positive")
    if set(old) != set(rows) or set(new) != set(rows):
        raise TensorMismatch("old, new and rows must name the same tensors")
    step = chunk_elements(segment_bytes)
    names = sorted(rows)
    for name in names:
        spec, start = rows[name]
        for side in (old, new):
            have = spec_of(name, side[name])
            n = 1
            for d in have.shape:
                n *= d
            if have.dtype != spec.dtype or start < 0 or start + n > spec.numel:
                raise TensorMismatch(
                    f"tensor {name!r}: local {have.dtype}{list(have.shape)} at element {start} does not fit "
                    f"{spec.dtype}{list(spec.shape)}"
                )

    def tasks() -> Iterator[Task]:
        for name in names:
            spec, offset = rows[name]
            o = flat_bits(name, host(old[name]))
            n = flat_bits(name, host(new[name]))
            if o.size != n.size:
                raise TensorMismatch(f"tensor {name!r}: old and new shards differ in size")
            for start in range(0, o.size, step):
                stop = min(o.size, start + step)
                yield spec, FLAT, offset + start, stop - start, o[start:stop], n[start:stop]

    threads = worker_threads() if threads is None else threads
    records: dict[str, ClassRecord] = {}
    if codec == _CTXS.name:  # each shard's own record of its rows (a segment carries the records it uses)
        for name in names:
            so, sn = flat_bits(name, host(old[name])), flat_bits(name, host(new[name]))
            records[name] = class_record(rows[name][0], so, sn, step, False)
    yield from _segments(tasks(), base, segment_bytes, segment_changes, codec, threads, empty=False, finite=check_finite,
                         records=records)  # fmt: skip


def _segments(
    tasks: Iterator[Task | CellChunks],
    base: str,
    segment_bytes: int,
    segment_changes: int,
    codec: str,
    threads: int,
    *,
    empty: bool,
    finite: bool = False,
    part_safe: bool = False,
    records: Mapping[str, ClassRecord] | None = None,
) -> Iterator[bytes]:
    """Pack encoded chunks into segments of ~``segment_bytes`` or ``segment_changes`` changed
    elements, whichever fills first; ``empty``: yield one even if no chunk."""
    specs: dict[str, TensorSpec] = {}
    chunks: list[ChunkInfo] = []
    payloads: list[bytes] = []
    size = changes = 0
    emitted = False
    for spec, cell, start, count, (used, changed, payload) in _encoded(tasks, codec, threads, finite, part_safe, records):
        specs[spec.name] = spec
        chunks.append(ChunkInfo(spec.name, start, count, changed, used, len(payload), cell))
        payloads.append(payload)
        size += len(payload) + 12  # the payload and its chunk-table entry (~12 bytes of varints)
        changes += changed
        if size >= segment_bytes or changes >= segment_changes:
            yield pack_segment(base, list(specs.values()), chunks, payloads, records)
            specs, chunks, payloads, size, changes = {}, [], [], 0, 0
            emitted = True
    if chunks or (empty and not emitted):
        yield pack_segment(base, list(specs.values()), chunks, payloads, records)


def encode_delta(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    base: str,
    segment_bytes: int = 16 << 20,
    codec: str = "auto",
    segment_changes: int = SEGMENT_CHANGES,
    cells: bool = True,
) -> list[bytes]:
    """All segments of the lossless delta ``old -> new`` (see :func:`iter_encode_delta` for a stream).

    Args:
        old: the base state ``{name: tensor or array}`` (BF16, FP16 or FP32 values).
        new: the next state: the same names, shapes and dtypes.
        base: an identifier of ``old`` recorded in every segment; :func:`apply_delta` refuses a
            segment made against another base.
        segment_bytes: target encoded size of one segment.
        codec: ``"auto"`` (chosen per chunk) or one codec's name.
        segment_changes: at most this many changed elements in one segment (so a delta is cut
            into enough segments to pipeline encode, upload and fetch).
        cells: cut large ``ctx``-coded tensors into shard-grid cells (a TP rank reads its part).

    Returns:
        The segments, in order; together they change exactly the values that differ.

    Example:
        >>> segments = encode_delta(old, new, base="v41")  # doctest: +SKIP
        >>> apply_delta(old, segments, base="v41")  # old now equals new, bit for bit  # doctest: +SKIP
    """
    return list(
        iter_encode_delta(
            old, new, base=base, segment_bytes=segment_bytes, codec=codec, segment_changes=segment_changes,
            cells=cells,
        )
    )
