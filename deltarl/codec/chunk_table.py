"""A segment's chunk table as columns (one numpy array per field), parsed and checked without a
Python step per chunk: a 235B-A22B-shaped version has ~140k chunks over ~37k tensors, and a rank
parses every segment's table before it knows which pieces to read (docs/FORMAT.md, "Reading a part").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltarl.codec.bitio import leb128_decode
from deltarl.codec.grid import CELLS, GRID, cell_size
from deltarl.codec.registry import BY_ID
from deltarl.codec.tensors import TensorSpec
from deltarl.errors import FormatError

FIELDS = 6  # varints per chunk: tensor index, 8 * tile + codec, start, count, changed, nbytes
_MAX_FIELD = 1 << 62  # larger varints cannot describe a real chunk (and would overflow int64 sums)
_KNOWN = np.zeros(8, dtype=bool)
_KNOWN[[0, *BY_ID]] = True


@dataclass(frozen=True)
class ChunkTable:
    """The chunks of one segment, field by field (int64 arrays of one length): ``tensor`` (index into
    the header's tensor table), ``cell`` (-1: row-major, else the grid cell), ``codec`` (id), ``start``,
    ``count``, ``changed``, ``nbytes`` and ``offset`` (the payload's first byte in the segment)."""

    tensor: np.ndarray
    cell: np.ndarray
    codec: np.ndarray
    start: np.ndarray
    count: np.ndarray
    changed: np.ndarray
    nbytes: np.ndarray
    offset: np.ndarray

    def __len__(self) -> int:
        return int(self.tensor.size)


def _tensor_dims(tensors: list[TensorSpec], used: np.ndarray) -> np.ndarray:
    """Per tensor of the table (rows of ``used`` only; others zero): numel, rows, cols, inner, row
    cell and column cell, capped at 2^62 so that checks on int64 never overflow."""
    dims = np.zeros((len(tensors), 6), dtype=np.int64)
    for t in used.tolist():
        shape = tensors[t].shape
        rows = shape[0] if shape else 1
        cols = shape[1] if len(shape) >= 2 else 1
        inner = 1
        for d in shape[2:]:
            inner *= d
        rows, cols, inner = (min(x, _MAX_FIELD) for x in (rows, cols, inner))
        dims[t] = [min(rows * cols * inner, _MAX_FIELD), rows, cols, inner, cell_size(rows), cell_size(cols)]
    return dims


def _limits(dims: np.ndarray, ti: np.ndarray, tile: np.ndarray) -> np.ndarray:
    """Elements of each chunk's tile (0 where the tile is not a cell of the tensor's grid)."""
    numel, rows, cols, inner, rc, cc = (dims[ti, k] for k in range(6))
    cell = np.maximum(tile - 1, 0)
    r0, c0 = (cell // GRID) * rc, (cell % GRID) * cc
    exists = (r0 < rows) & (c0 < cols) & (numel > 0)
    with np.errstate(over="ignore"):
        cells = (np.minimum(rows, r0 + rc) - r0) * (np.minimum(cols, c0 + cc) - c0) * inner
    return np.where(tile == 0, numel, np.where(exists, cells, 0))


def parse_chunk_table(raw: memoryview, nchunks: int, tensors: list[TensorSpec], payload_offset: int,
                      payload_room: int, *, fields: np.ndarray | None = None) -> ChunkTable:  # fmt: skip
    """Parse and check a chunk table's varints (or its ``fields``, one row a chunk, where the
    segment stored them another way: format 4's columns), then add one ``none`` chunk ``[0, numel)``
    for every tensor of the table (with elements) that no chunk names. ``payload_room``: bytes the
    segment has for payloads (the total must equal it). Raises FormatError on any inconsistency."""
    v = leb128_decode(raw, nchunks * FIELDS).reshape(nchunks, FIELDS) if fields is None else fields
    if nchunks and int(v.max()) >= _MAX_FIELD:
        raise FormatError(f"chunk table value {int(v.max())} is out of range")
    v = v.astype(np.int64)
    ti, kind, start, count, changed, nbytes = (v[:, k] for k in range(FIELDS))
    if nchunks and int(ti.max()) >= len(tensors):
        raise FormatError(f"chunk names tensor index {int(ti.max())} of {len(tensors)}")
    tile, codec = kind >> 3, kind & 7
    if nchunks and int(tile.max()) > CELLS:
        raise FormatError(f"unknown chunk tile {int(tile.max())}")
    if not bool(_KNOWN[codec].all()):
        raise FormatError(f"unknown chunk codec {int(codec[~_KNOWN[codec]][0])}")
    listed = np.zeros(len(tensors), dtype=bool)
    listed[ti] = True
    dims = _tensor_dims(tensors, np.flatnonzero(listed))
    limit = _limits(dims, ti, tile)
    bad = np.flatnonzero((count == 0) | (start > limit - count))
    if bad.size:
        i = int(bad[0])
        raise FormatError(f"chunk [{int(start[i])}, {int(start[i] + count[i])}) outside tensor "
                          f"{tensors[int(ti[i])].name!r} (tile {int(tile[i])}) of {int(limit[i])}")  # fmt: skip
    bad = np.flatnonzero((changed > count) | ((codec == 0) != (changed == 0)) | ((codec == 0) & (nbytes != 0)))
    if bad.size:
        i = int(bad[0])
        raise FormatError(f"chunk of {tensors[int(ti[i])].name!r}: inconsistent changed={int(changed[i])} "
                          f"codec={int(codec[i])}")  # fmt: skip
    if nchunks and (int(nbytes.max()) > payload_room or int(nbytes.sum()) != payload_room):
        raise FormatError("chunk payload lengths do not add up to the segment length")
    if not nchunks and payload_room:
        raise FormatError("chunk payload lengths do not add up to the segment length")
    _check_disjoint(tensors, ti, tile - 1, start, count)
    rest = np.flatnonzero(~listed)
    if rest.size:  # tensors without chunks: covered whole, unchanged, by this segment
        numel = np.array([min(tensors[t].numel, _MAX_FIELD) for t in rest.tolist()], dtype=np.int64)
        rest, numel = rest[numel > 0], numel[numel > 0]
        zeros = np.zeros(rest.size, dtype=np.int64)
        ti, tile = np.concatenate((ti, rest)), np.concatenate((tile, zeros))
        codec, start = np.concatenate((codec, zeros)), np.concatenate((start, zeros))
        count, changed = np.concatenate((count, numel)), np.concatenate((changed, zeros))
        nbytes = np.concatenate((nbytes, zeros))
    offset = payload_offset + np.cumsum(nbytes) - nbytes
    return ChunkTable(ti, tile - 1, codec, start, count, changed, nbytes, offset)


def _check_disjoint(tensors: list[TensorSpec], ti: np.ndarray, cell: np.ndarray, start: np.ndarray,
                    count: np.ndarray) -> None:  # fmt: skip
    """Chunks of one tensor and tile must not overlap; a tensor's chunks are all row-major or all cells."""
    if ti.size < 2:
        return
    order = np.lexsort((start, cell, ti))
    t, g, s = ti[order], cell[order], start[order]
    e = s + count[order]
    same = t[1:] == t[:-1]
    hit = np.flatnonzero(same & (g[1:] == g[:-1]) & (s[1:] < e[:-1]))
    if hit.size:
        i = int(hit[0])
        raise FormatError(f"chunks of {tensors[int(t[i])].name!r} overlap at element {int(s[i + 1])}")
    hit = np.flatnonzero(same & (g[:-1] == -1) & (g[1:] != -1))
    if hit.size:
        raise FormatError(f"tensor {tensors[int(t[int(hit[0])])].name!r} has both row-major and cell chunks")
