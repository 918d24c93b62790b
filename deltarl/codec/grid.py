"""The shard grid of a tensor: the cells a tiled chunk lies in (docs/FORMAT.md, "Tiles").

A tensor of shape ``(d0, d1, *rest)`` is seen as ``rows = d0`` by ``cols = d1`` by ``inner =
prod(rest)`` (a 1-D tensor has one column, a scalar one row). Each of the two dimensions is cut
into cells of ``cell_size(n) = 8 * ceil(n / 64)`` (at most 8 cells; exactly ``n / 8`` when ``n`` is a
multiple of 64), so every tensor-parallel shard of TP 1, 2, 4 or 8 along either dimension, a
padded vocabulary's shards included (vLLM pads a vocabulary to a multiple of 64 and splits the
padded rows evenly), is a union of whole cells. Cell ``(i, j)`` has the id ``8 * i + j``; its
elements are enumerated row-major inside the cell (row, then column, then the inner dimensions).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

GRID = 8  # cells per dimension at most
CELLS = GRID * GRID


def cell_size(n: int) -> int:
    """Length of one cell along a dimension of length ``n`` (>= 1)."""
    return 8 * -(-n // 64) if n > 0 else 1


def morton(cell: int) -> int:
    """Position of cell ``8 * i + j`` in Z order (row bits above column bits): a TP 2 row half is
    one contiguous run of the order, a column half two, a TP 8 part eight."""
    i, j = divmod(cell, GRID)
    out = 0
    for b in range(3):
        out |= ((i >> b) & 1) << (2 * b + 1) | ((j >> b) & 1) << (2 * b)
    return out


MORTON_ORDER: tuple[int, ...] = tuple(sorted(range(CELLS), key=morton))


@dataclass(frozen=True)
class Grid:
    """The cells of one tensor shape."""

    shape: tuple[int, ...]

    @cached_property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @cached_property
    def cols(self) -> int:
        return self.shape[1] if len(self.shape) >= 2 else 1

    @cached_property
    def inner(self) -> int:
        n = 1
        for d in self.shape[2:]:
            n *= d
        return n

    @property
    def row_elems(self) -> int:
        """Elements of one row (columns times inner)."""
        return self.cols * self.inner

    @cached_property
    def row_cell(self) -> int:
        return cell_size(self.rows)

    @cached_property
    def col_cell(self) -> int:
        return cell_size(self.cols)

    @cached_property
    def cells(self) -> tuple[int, ...]:
        """The ids of the cells with at least one element, in Z order."""
        if self.rows * self.row_elems == 0:
            return ()
        nr, nc = -(-self.rows // self.row_cell), -(-self.cols // self.col_cell)
        return tuple(c for c in MORTON_ORDER if c // GRID < nr and c % GRID < nc)

    def has(self, cell: int) -> bool:
        return cell in self._cell_set

    @cached_property
    def _cell_set(self) -> frozenset[int]:
        return frozenset(self.cells)

    def rect(self, cell: int) -> tuple[int, int, int, int]:
        """``(r0, r1, c0, c1)``: the rows and columns of ``cell``."""
        i, j = divmod(cell, GRID)
        r0, c0 = i * self.row_cell, j * self.col_cell
        return r0, min(self.rows, r0 + self.row_cell), c0, min(self.cols, c0 + self.col_cell)

    def numel(self, cell: int) -> int:
        r0, r1, c0, c1 = self.rect(cell)
        return (r1 - r0) * (c1 - c0) * self.inner

    def tile_range(self, flat: np.ndarray, cell: int, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of ``cell``'s enumeration (copying only the rows they lie in)."""
        r0, _, c0, c1 = self.rect(cell)
        width = (c1 - c0) * self.inner
        qa, qb = start // width, -(-stop // width)
        if c1 - c0 == self.cols:  # the cell spans whole rows: a view of the flat array
            return flat[r0 * width + start : r0 * width + stop]
        block = flat.reshape(self.rows, self.row_elems)[r0 + qa : r0 + qb, c0 * self.inner : c1 * self.inner]
        return np.ascontiguousarray(block).reshape(-1)[start - qa * width : stop - qa * width]

    def to_global(self, cell: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global ``(row, column element)`` of the cell-enumeration indices ``index`` (int64)."""
        r0, _, c0, c1 = self.rect(cell)
        width = (c1 - c0) * self.inner
        return r0 + index // width, c0 * self.inner + index % width


def flat_to_global(grid: Grid, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global ``(row, column element)`` of row-major flat indices."""
    return index // grid.row_elems, index % grid.row_elems
