"""How a delta is laid out before it is coded: which tensors are cut into shard-grid cells or row
bands (from a sample of their changes), each tiled tensor's class record, and the order of the
chunks the encoder codes (deltarl.codec.encode codes them; docs/FORMAT.md, "What the encoder
writes")."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarl.codec import registry
from deltarl.codec.classes import CELL_CLASS_FIELDS, CLASS_FIELDS
from deltarl.codec.ctxs import LAYOUT_SHARES, ClassRecord, choose_record
from deltarl.codec.grid import CELLS, GRID, MORTON_ORDER, Grid
from deltarl.codec.segment import FLAT
from deltarl.codec.tensors import TensorSpec, flat_bits, is_cuda
from deltarl.errors import TensorMismatch

_CTXS = registry.by_name("ctxs")
# The class records the encoder writes: layout 2 (segment format 5, counts against each class's
# share). Layout 1 (formats 3 and 4) is still read; the golden tests of those formats write it.
RECORD_LAYOUT = LAYOUT_SHARES
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
# Qwen3-30B-A3B-shaped layer at 1% (experts: ~245 changes a cell) is 1.11x format 1 where its
# row-banded experts were 1.39x, and a TP 2 rank reads 0.62-0.65x of it where 0.68-0.72x
# (benchmarks/sharded_read.py --moe-experts 32). The writer codes a tensor's cells in one numba call
# a quarter (encode.py, ctxs_cells.encode_cells): that layer encodes in 0.28 s at 64 where 0.52 s with the
# experts in row bands (288) and 0.11 s with no cells at all; one cell at a time it took 2.5-3.0 s.
CELL_MIN_CHANGES = 64
# A row-major tensor is cut at its grid's row bands only when a band will hold this many changes.
BAND_MIN_CHANGES = 256


def sample(old: np.ndarray, new: np.ndarray, blocks: int = 32) -> tuple[int, int]:
    """Changed elements in ``blocks`` evenly spaced runs of up to 512 elements, and the elements compared."""
    step = old.size // blocks
    if step == 0:
        return int(np.count_nonzero(old != new)), int(old.size)
    run = min(SAMPLE_BLOCK, step)
    a = old[: step * blocks].reshape(blocks, step)[:, :run]
    b = new[: step * blocks].reshape(blocks, step)[:, :run]
    return int(np.count_nonzero(a != b)), blocks * run


SAMPLE_BLOCKS, SAMPLE_BLOCK = 32, 512
# The cut-into-cells decision (and a tiled tensor's class record) samples 4x more (65,536 elements):
# at 1% changed a Qwen3-30B-A3B expert (1.57M elements, 245 changes a cell) lies ~19 standard
# deviations of this sample above CELL_MIN_CHANGES (171 sampled changes).
TILE_SAMPLE_BLOCKS = 128


def _tiles(numel: int, old: np.ndarray, new: np.ndarray, codec: str) -> bool:
    """Whether a tensor is cut into grid cells: a codec that needs the base's classes will code it,
    and (for ``auto``, from a sample of 128 evenly spaced runs of 512) its cells will hold at least
    ``CELL_MIN_CHANGES`` changes each on average; below that a cell's own chunk entry, stream lengths
    and class table outweigh what ``ctx`` saves over ``sparse``, which decodes any part alone."""
    if numel < TILE_MIN_ELEMENTS:
        return False
    if codec != "auto":
        return registry.by_name(codec).needs_classes
    hits, n = sample(old, new, TILE_SAMPLE_BLOCKS)
    return hits >= registry.SPARSE_MAX_FRACTION * n and hits * numel >= CELL_MIN_CHANGES * CELLS * n


def kind_of(name: str) -> str:
    """A tensor's name without its numbers (``model.layers.mlp.experts.down_proj.weight``): tensors
    of one kind are split alike by every engine, so the encoder writes them next to each other."""
    return ".".join(p for p in name.split(".") if not p.isdigit())


def host(value: Any) -> Any:
    """A CUDA tensor's host copy (the encoder reads bits on the host); anything else as it is."""
    return value.cpu() if is_cuda(value) else value


def delta_tasks(table: list[TensorSpec], old: Mapping[str, Any], new: Mapping[str, Any], step: int, cells: bool,
                 codec: str, records: dict[str, ClassRecord]) -> Iterator[Task | CellChunks]:  # fmt: skip
    """The chunks of a delta in the order segments hold them: row-major tensors first (small ones,
    every rank reads them whole), then by Z-order quarter the cells of the tiled tensors (in each
    quarter the tensors of a kind together, each tensor's cells in Z order, one :class:`CellChunks`
    a tensor and quarter), with the top row bands
    of the banded tensors (:func:`_bands`) after quarter 0 and the bottom ones after quarter 2: a
    TP 2 rank's part is then one run (rows: quarters 0, 1 or 2, 3 with their bands) or two. Fills
    ``records`` with the class record of each tiled tensor (``auto``) or of every tensor (``ctxs``)."""
    tiled: list[tuple[TensorSpec, Grid, np.ndarray, np.ndarray]] = []
    banded: list[tuple[TensorSpec, Grid, np.ndarray, np.ndarray]] = []
    for spec in table:
        o = flat_bits(spec.name, host(old[spec.name]))
        n = flat_bits(spec.name, host(new[spec.name]))
        if o.size != spec.numel or n.size != spec.numel:
            raise TensorMismatch(f"tensor {spec.name!r}: element count differs from its shape")
        tiles = cells and _tiles(spec.numel, o, n, codec)
        if (tiles and codec == "auto") or codec == _CTXS.name:
            records[spec.name] = class_record(spec, o, n, step, tiles)
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
            chunks = [(cell, start, min(grid.numel(cell), start + step) - start)
                      for cell in MORTON_ORDER[16 * quarter : 16 * quarter + 16] if grid.has(cell)
                      for start in range(0, grid.numel(cell), step)]  # fmt: skip
            if chunks:  # the worker copies the cells' rows
                yield CellChunks(spec, grid, chunks, o, n)
        if quarter in (0, 2):
            for spec, grid, o, n in banded:
                yield from _bands(spec, grid, o, n, step, quarter // 2)


def class_record(spec: TensorSpec, old: np.ndarray, new: np.ndarray, step: int, tiles: bool) -> ClassRecord:
    """A tensor's class record, from the cells' sample (128 evenly spaced runs of 512): the class
    field of a cell chunk with few changes (``CELL_CLASS_FIELDS``) when a chunk will hold fewer
    than ``CELL_COARSE_CHANGES`` on average, and ``k_n`` fitted to the tensor's mean chunk."""
    if tiles:
        grid = Grid(spec.shape)
        chunks = sum(-(-grid.numel(c) // step) for c in range(CELLS) if grid.has(c))
    else:
        chunks = -(-spec.numel // step)
    mean = -(-spec.numel // max(chunks, 1))
    so, sn = sample_arrays(old, new, TILE_SAMPLE_BLOCKS)
    hits = int(np.count_nonzero(so != sn))
    coarse = hits * mean < CELL_COARSE_CHANGES * max(so.size, 1)
    field = (CELL_CLASS_FIELDS if coarse else CLASS_FIELDS)[spec.dtype]
    return choose_record(so, sn, spec.dtype, mean, field, RECORD_LAYOUT)


def sample_arrays(old: np.ndarray, new: np.ndarray, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The elements :func:`sample` compares, as two arrays."""
    step = old.size // blocks
    if step == 0:
        return old, new
    run = min(SAMPLE_BLOCK, step)
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
    hits, n = sample(old, new, TILE_SAMPLE_BLOCKS)
    return hits * spec.numel >= BAND_MIN_CHANGES * GRID * n


def _bands(spec: TensorSpec, grid: Grid, o: np.ndarray, n: np.ndarray, step: int, half: int) -> Iterator[Task]:
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
Task = tuple[TensorSpec, int, int, int, np.ndarray, np.ndarray]


@dataclass(frozen=True, eq=False)
class CellChunks:
    """Cell chunks of one tiled tensor to encode together (one Z-order quarter of its cells):
    ``chunks`` are ``(cell, first index in the cell's enumeration, elements)`` in segment order;
    ``old`` / ``new`` the whole tensor's row-major bits (the worker cuts the cells out)."""

    spec: TensorSpec
    grid: Grid
    chunks: list[tuple[int, int, int]]
    old: np.ndarray
    new: np.ndarray
