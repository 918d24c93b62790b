"""Detect changed elements between two states and encode them into segments, streaming."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarl.codec import kernels, registry
from deltarl.codec.chunk import Changes
from deltarl.codec.classes import CELL_CLASS_FIELDS, CLASS_FIELDS, rank_classes
from deltarl.codec.ctxs import ClassRecord, choose_record
from deltarl.codec.finite import nonfinite_bits
from deltarl.codec.grid import CELLS, GRID, MORTON_ORDER, Grid
from deltarl.codec.kernels import worker_threads
from deltarl.codec.segment import FLAT, ChunkInfo, pack_segment
from deltarl.codec.tensors import TensorSpec, check_compatible, flat_bits, is_cuda, spec_of, tensor_table
from deltarl.errors import NonFiniteChunk, NonFiniteTensor, TensorMismatch

log = logging.getLogger(__name__)

CODECS = ("auto", *(c.name for c in sorted(registry.CODECS, key=lambda c: c.id)))
MAX_CHUNK_ELEMENTS = 1 << 22
MIN_CHUNK_ELEMENTS = 1 << 12
# A segment also ends once its chunks hold this many changed elements: a 1% delta of a 1.7B model
# (~17M changes, ~14 MB encoded) is then ~17 segments of ~0.9 MB instead of one 16 MiB one, so
# uploads start while the rest is still being encoded and actors fetch and stage meanwhile.
SEGMENT_CHANGES = 1 << 20
# A tensor of at least this many elements whose changes ``ctx`` will code is cut into the cells of
# its shard grid (deltarl.codec.grid): a rank holding a TP part along either dimension then reads
# and decodes only its cells, against only its own base. Smaller tensors, and tensors ``sparse``
# codes, stay in row-major chunks whose codecs find the changes without the base, so any part of
# them decodes from the chunk alone.
TILE_MIN_ELEMENTS = 1 << 16
# A cell chunk with fewer changes codes ctx classes of two exponents (CELL_CLASS_FIELDS): its class
# table is then half as long, which outweighs the coarser context below this many changes.
CELL_COARSE_CHANGES = 4096
# ``auto`` cuts a tensor into cells only when a cell will hold this many changes on average. A cell
# chunk coded ``ctxs`` costs ~20 bytes of its own (its classes' parameters are its tensor's class
# record), so from ~64 changes a cell its bytes beat the tensor's sparse row-major chunks: a
# Qwen3-30B-A3B-shaped layer at 1% (experts: ~245 changes a cell) is then 1.11x format 1 where 1.35x,
# and a TP 2 rank reads 0.62-0.65x of it where 0.69x. The bound stays at 288 for what cells cost the
# writer and the TP 1 reader (benchmarks/sharded_read.py --moe-experts 32): encode 3.02 s where
# 0.106 s (each cell's coding is ~0.5 ms of Python that holds the GIL, so more threads do not help:
# a whole 30B-A3B would take minutes a version) and TP 1 staging 345 ms where 113 ms. Dense
# projections at RL densities hold thousands of changes a cell and are cut either way.
CELL_MIN_CHANGES = 288
# A row-major tensor is cut at its grid's row bands only when a band will hold this many changes.
BAND_MIN_CHANGES = 256


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
    hits, n = _sample(old, new)
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


def _sample(old: np.ndarray, new: np.ndarray, blocks: int = 32) -> tuple[int, int]:
    """Changed elements in ``blocks`` evenly spaced runs of up to 512 elements, and the elements compared."""
    step = old.size // blocks
    if step == 0:
        return int(np.count_nonzero(old != new)), int(old.size)
    run = min(_SAMPLE_BLOCK, step)
    a = old[: step * blocks].reshape(blocks, step)[:, :run]
    b = new[: step * blocks].reshape(blocks, step)[:, :run]
    return int(np.count_nonzero(a != b)), blocks * run


_SAMPLE_BLOCKS, _SAMPLE_BLOCK = 32, 512
# The cut-into-cells decision (and a tiled tensor's class record) samples 4x more (65,536 elements):
# at 1% changed a Qwen3-30B-A3B expert (1.57M elements, 245 changes a cell) lies ~19 standard
# deviations of this sample above CELL_MIN_CHANGES (171 sampled changes).
_TILE_SAMPLE_BLOCKS = 128


def _looks_dense(old: np.ndarray, new: np.ndarray) -> bool:
    """A sample (32 evenly spaced runs of 512 elements, 0.4% of a full chunk, contiguous so it reads
    no more memory than it compares) changed at twice the low end of the ``auto`` range of a codec
    that ``needs_classes`` (``ctx``) or more: the chunk will most likely be coded with it, so
    detection ranks classes in the same pass. Only the work path depends on it; the codec is
    chosen by the exact count, so the bytes do not."""
    if old.size < 8 * _SAMPLE_BLOCKS * _SAMPLE_BLOCK:
        return False
    step = old.size // _SAMPLE_BLOCKS
    a = old[: step * _SAMPLE_BLOCKS].reshape(_SAMPLE_BLOCKS, step)[:, :_SAMPLE_BLOCK]
    b = new[: step * _SAMPLE_BLOCKS].reshape(_SAMPLE_BLOCKS, step)[:, :_SAMPLE_BLOCK]
    hits = int(np.count_nonzero(a != b))
    n = _SAMPLE_BLOCKS * _SAMPLE_BLOCK
    return any(c.auto is not None and c.needs_classes and 2 * c.auto[0] * n <= hits < c.auto[1] * n
               for c in registry.AUTO)


def _tiles(numel: int, old: np.ndarray, new: np.ndarray, codec: str) -> bool:
    """Whether a tensor is cut into grid cells: a codec that needs the base's classes will code it,
    and (for ``auto``, from a sample of 128 evenly spaced runs of 512) its cells will hold at least
    ``CELL_MIN_CHANGES`` changes each on average; below that a cell's own chunk entry, stream lengths
    and class table outweigh what ``ctx`` saves over ``sparse``, which decodes any part alone."""
    if numel < TILE_MIN_ELEMENTS:
        return False
    if codec != "auto":
        return registry.by_name(codec).needs_classes
    hits, n = _sample(old, new, _TILE_SAMPLE_BLOCKS)
    return hits >= registry.SPARSE_MAX_FRACTION * n and hits * numel >= CELL_MIN_CHANGES * CELLS * n


def kind_of(name: str) -> str:
    """A tensor's name without its numbers (``model.layers.mlp.experts.down_proj.weight``): tensors
    of one kind are split alike by every engine, so the encoder writes them next to each other."""
    return ".".join(p for p in name.split(".") if not p.isdigit())


def _cpu(value: Any) -> Any:
    return value.cpu() if is_cuda(value) else value


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
    tasks = _delta_tasks(table, old, new, step, cells, codec, records)
    yield from _segments(tasks, base, segment_bytes, segment_changes, codec, worker_threads(), empty=True,
                         finite=check_finite, part_safe=cells, records=records)


def _delta_tasks(table: list[TensorSpec], old: Mapping[str, Any], new: Mapping[str, Any], step: int, cells: bool,
                 codec: str, records: dict[str, ClassRecord]) -> Iterator[_Task]:  # fmt: skip
    """The chunks of a delta in the order segments hold them: row-major tensors first (small ones,
    every rank reads them whole), then by Z-order quarter the cells of the tiled tensors (in each
    quarter the tensors of a kind together, each tensor's cells in Z order), with the top row bands
    of the banded tensors (:func:`_bands`) after quarter 0 and the bottom ones after quarter 2: a
    TP 2 rank's part is then one run (rows: quarters 0, 1 or 2, 3 with their bands) or two. Fills
    ``records`` with the class record of each tiled tensor (``auto``) or of every tensor (``ctxs``)."""
    tiled: list[tuple[TensorSpec, Grid, np.ndarray, np.ndarray]] = []
    banded: list[tuple[TensorSpec, Grid, np.ndarray, np.ndarray]] = []
    for spec in table:
        o = flat_bits(spec.name, _cpu(old[spec.name]))
        n = flat_bits(spec.name, _cpu(new[spec.name]))
        if o.size != spec.numel or n.size != spec.numel:
            raise TensorMismatch(f"tensor {spec.name!r}: element count differs from its shape")
        tiles = cells and _tiles(spec.numel, o, n, codec)
        if (tiles and codec == "auto") or codec == _CTXS.name:
            records[spec.name] = _record(spec, o, n, step, tiles)
        if tiles:
            tiled.append((spec, Grid(spec.shape), o, n))
        elif cells and _banded(spec, o, n):
            banded.append((spec, Grid(spec.shape), o, n))
        else:
            for start in range(0, spec.numel, step):
                stop = min(spec.numel, start + step)
                yield spec, FLAT, start, stop - start, o[start:stop], n[start:stop]
    tiled.sort(key=lambda item: (kind_of(item[0].name), item[0].name))
    banded.sort(key=lambda item: (kind_of(item[0].name), item[0].name))
    for quarter in range(4):
        for spec, grid, o, n in tiled:
            for cell in MORTON_ORDER[16 * quarter : 16 * quarter + 16]:
                if grid.has(cell):
                    size = grid.numel(cell)
                    for start in range(0, size, step):  # the worker copies the cell's rows
                        yield spec, cell, start, min(size, start + step) - start, o, n
        if quarter in (0, 2):
            for spec, grid, o, n in banded:
                yield from _bands(spec, grid, o, n, step, quarter // 2)


def _record(spec: TensorSpec, old: np.ndarray, new: np.ndarray, step: int, tiles: bool) -> ClassRecord:
    """A tensor's class record, from the cells' sample (128 evenly spaced runs of 512): the class
    field of a cell chunk with few changes (``CELL_CLASS_FIELDS``) when a chunk will hold fewer
    than ``CELL_COARSE_CHANGES`` on average, and ``k_n`` fitted to the tensor's mean chunk."""
    if tiles:
        grid = Grid(spec.shape)
        chunks = sum(-(-grid.numel(c) // step) for c in range(CELLS) if grid.has(c))
    else:
        chunks = -(-spec.numel // step)
    mean = -(-spec.numel // max(chunks, 1))
    so, sn = _sample_arrays(old, new, _TILE_SAMPLE_BLOCKS)
    hits = int(np.count_nonzero(so != sn))
    coarse = hits * mean < CELL_COARSE_CHANGES * max(so.size, 1)
    return choose_record(so, sn, spec.dtype, mean, (CELL_CLASS_FIELDS if coarse else CLASS_FIELDS)[spec.dtype])


def _sample_arrays(old: np.ndarray, new: np.ndarray, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The elements :func:`_sample` compares, as two arrays."""
    step = old.size // blocks
    if step == 0:
        return old, new
    run = min(_SAMPLE_BLOCK, step)
    a = old[: step * blocks].reshape(blocks, step)[:, :run]
    b = new[: step * blocks].reshape(blocks, step)[:, :run]
    return a.reshape(-1), b.reshape(-1)


def _banded(spec: TensorSpec, old: np.ndarray, new: np.ndarray) -> bool:
    """Whether a row-major tensor is cut at its row bands: 2-D or more, ``TILE_MIN_ELEMENTS`` or
    more, and (from the cells' sample) ``BAND_MIN_CHANGES`` changes a band: a band's own chunk
    entry, codec parameters and stream lengths (~30 bytes) then stay a few % of its payload, and an
    untouched tensor keeps costing only its table entry."""
    if spec.numel < TILE_MIN_ELEMENTS or len(spec.shape) < 2:
        return False
    hits, n = _sample(old, new, _TILE_SAMPLE_BLOCKS)
    return hits * spec.numel >= BAND_MIN_CHANGES * GRID * n


def _bands(spec: TensorSpec, grid: Grid, o: np.ndarray, n: np.ndarray, step: int, half: int) -> Iterator[_Task]:
    """Row-major chunks of a tensor kept out of cells (its cells would hold too few changes to pay
    for their own headers), cut at its grid's row bands ``4 half .. 4 half + 3``: a rank holding a
    row range (k/v projections are split by rows) reads only its bands; any region decodes them."""
    band = grid.row_cell * grid.row_elems
    for a in range(4 * half * band, min(spec.numel, 4 * (half + 1) * band), band):
        end = min(spec.numel, a + band)
        for start in range(a, end, step):
            stop = min(end, start + step)
            yield spec, FLAT, start, stop - start, o[start:stop], n[start:stop]


# One chunk to encode: the tensor, its cell (FLAT: row-major), the first index, the element count,
# old and new bits (of the chunk; of the whole tensor for a cell's chunk, cut out by the worker).
_Task = tuple[TensorSpec, int, int, int, np.ndarray, np.ndarray]


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
    tasks: Iterator[_Task], codec: str, threads: int, finite: bool = False, part_safe: bool = False,
    records: Mapping[str, ClassRecord] | None = None,
) -> Iterator[tuple[TensorSpec, int, int, int, tuple[str, int, bytes]]]:
    """Encode chunks in order, ``threads`` at a time (the kernels release the GIL). ``part_safe``:
    ``auto`` codes row-major chunks with codecs that find the changes without the base. ``records``:
    the tensors' class records (``auto`` uses one for cell chunks, ``ctxs`` for every chunk)."""
    records = {} if records is None else records

    def record(spec: TensorSpec, cell: int) -> ClassRecord | None:
        return records.get(spec.name) if cell != FLAT or codec == _CTXS.name else None

    if threads <= 1:
        for spec, cell, start, count, o, n in tasks:
            yield spec, cell, start, count, _encode_named(spec, cell, start, count, o, n, codec, finite, part_safe,
                                                          record(spec, cell))  # fmt: skip
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="deltarl-encode") as pool:
        window: deque[tuple[TensorSpec, int, int, int, Future[tuple[str, int, bytes]]]] = deque()
        for spec, cell, start, count, o, n in tasks:
            fut = pool.submit(_encode_named, spec, cell, start, count, o, n, codec, finite, part_safe, record(spec, cell))
            window.append((spec, cell, start, count, fut))
            if len(window) > 2 * threads:
                s, g, st, c, f = window.popleft()
                yield s, g, st, c, f.result()
        while window:
            s, g, st, c, f = window.popleft()
            yield s, g, st, c, f.result()


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

    def tasks() -> Iterator[_Task]:
        for name in names:
            spec, offset = rows[name]
            o = flat_bits(name, _cpu(old[name]))
            n = flat_bits(name, _cpu(new[name]))
            if o.size != n.size:
                raise TensorMismatch(f"tensor {name!r}: old and new shards differ in size")
            for start in range(0, o.size, step):
                stop = min(o.size, start + step)
                yield spec, FLAT, offset + start, stop - start, o[start:stop], n[start:stop]

    threads = worker_threads() if threads is None else threads
    records: dict[str, ClassRecord] = {}
    if codec == _CTXS.name:  # each shard's own record of its rows (a segment carries the records it uses)
        for name in names:
            so, sn = flat_bits(name, _cpu(old[name])), flat_bits(name, _cpu(new[name]))
            records[name] = _record(rows[name][0], so, sn, step, False)
    yield from _segments(tasks(), base, segment_bytes, segment_changes, codec, threads, empty=False, finite=check_finite,
                         records=records)  # fmt: skip


def _segments(
    tasks: Iterator[_Task],
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
