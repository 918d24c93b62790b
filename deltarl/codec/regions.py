"""Parts of tensors: what a tensor- or expert-parallel rank holds, and which chunks of a delta it needs.

A rank of a sharded inference engine holds, of each checkpoint tensor, a :class:`Region`: the whole
tensor, nothing (an expert on another rank), a row range ``[start, stop)`` along dim 0
(column-parallel layers, vocabulary shards, replicated KV heads) or a column block along dim 1
(row-parallel layers: ``o_proj``, ``down_proj``, MoE ``w2``). Deltas cut every large tensor that
``ctx`` codes into the cells of its shard grid (:mod:`deltarl.codec.grid`), so a region that is a
union of cells (any TP 1, 2, 4, 8 part along either dimension) needs only those cells' chunks and
decodes them against only its own base; the other chunks need no base to find their changes, so
any region decodes them alone (docs/FORMAT.md, "Tiles").

How a rank uses it::

    regions = {q: Region.rows(a, b), o: Region.cols(a, b), expert_elsewhere: Region.none(), norm: Region.whole()}
    views = {q: q_param, o: o_param, norm: norm_param}   # the rank's memory: shape = region.shape(global)
    # a version: every segment's header pieces, then only the pieces of the chunks the regions need
    parts = deltarl.pipeline.read_segment_parts(store.get_range, manifest, regions)
    staged = stage_delta(views, [p.data for p in parts], base=parent_id, regions=regions,
                         specs=run_info.tensors, headers=[p.header for p in parts])
    staged.commit()                                      # or rollback(); the transaction is the usual one
    # a keyframe (late start): deltarl.pipeline.region_reads.read_part_regions per part, into the views

A view is the rank's parameter memory for the region, indexed from the region's first row and
column: a contiguous row range, or a strided column block (``param.narrow(1, a, b - a)``; each row
contiguous). Staging reads the base only from the views and the commit writes only into them.
:func:`plan_chunks` is the per-segment plan (chunks and payload byte ranges) for callers that fetch
themselves. A region must be a union of grid cells for ``ctx`` chunks (every TP 1/2/4/8 part of a
dimension that is a multiple of 64, and padded vocabularies); otherwise RegionError.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from deltarl.codec.grid import GRID, Grid, flat_to_global
from deltarl.codec.registry import codec_id
from deltarl.codec.segment import FLAT, ChunkInfo, SegmentHeader
from deltarl.codec.tensors import BF16, TensorSpec, dtype_of, flat_bits, is_cuda
from deltarl.errors import RegionError

Kind = Literal["whole", "none", "rows", "cols"]
# Codecs that find a chunk's changes from the payload alone: a region decodes any part of their chunks.
PART_CODECS = frozenset({"none", "sparse", "dense"})
_PART_IDS = np.array([0, *(codec_id(n) for n in sorted(PART_CODECS) if n != "none")], dtype=np.int64)


@dataclass(frozen=True)
class Region:
    """The part of one checkpoint tensor a rank holds (``start``/``stop`` index dim 0 or dim 1).
    ``fold``: the shape (same elements, same row-major order) a column range is taken in, for a part
    no range of the tensor's own shape expresses (a tensor-parallel rank's part of fused experts:
    ``[E, 2I, H]`` as ``(2E, I, H)``); such a part reads row-major chunks only (RegionError for a
    cell chunk: the grid cuts the tensor's own dimensions)."""

    kind: Kind = "whole"
    start: int = 0
    stop: int = 0
    fold: tuple[int, ...] | None = None

    @classmethod
    def whole(cls) -> Region:
        return cls("whole")

    @classmethod
    def none(cls) -> Region:
        return cls("none")

    @classmethod
    def rows(cls, start: int, stop: int) -> Region:
        return cls("rows", start, stop)

    @classmethod
    def cols(cls, start: int, stop: int) -> Region:
        return cls("cols", start, stop)

    @classmethod
    def tp(cls, dim: int, rank: int, size: int, n: int) -> Region:
        """Rank ``rank`` of ``size`` equal parts of a dimension of length ``n`` (dim 0 rows, 1 columns).
        A padded vocabulary's shard is ``Region.rows(r * per, min((r + 1) * per, vocab))`` instead,
        with the view holding only the real rows (``per`` = padded rows / size)."""
        if n % size:
            raise RegionError(f"a dimension of {n} does not split into {size} equal parts")
        part = n // size
        return cls("rows" if dim == 0 else "cols", rank * part, (rank + 1) * part)

    def __post_init__(self) -> None:
        if self.kind not in ("whole", "none", "rows", "cols"):
            raise RegionError(f"unknown region kind {self.kind!r}")
        if self.kind in ("rows", "cols") and not 0 <= self.start < self.stop:
            raise RegionError(f"region {self.kind} [{self.start}, {self.stop}) is empty or negative")

    def bounds(self, grid: Grid) -> tuple[int, int, int, int]:
        """``(first row, end row, first column element, end column element)`` in the tensor."""
        if self.kind == "rows":
            if self.stop > grid.rows:
                raise RegionError(f"rows [{self.start}, {self.stop}) outside {grid.rows} rows")
            return self.start, self.stop, 0, grid.row_elems
        if self.kind == "cols":
            if len(grid.shape) < 2 or self.stop > grid.cols:
                raise RegionError(f"columns [{self.start}, {self.stop}) outside shape {list(grid.shape)}")
            return 0, grid.rows, self.start * grid.inner, self.stop * grid.inner
        return 0, grid.rows, 0, grid.row_elems

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this region of a tensor of ``shape`` (the rank's view has it)."""
        shape = self.fold or shape
        if self.kind == "rows":
            return (self.stop - self.start, *shape[1:])
        if self.kind == "cols":
            return (shape[0], self.stop - self.start, *shape[2:])
        return tuple(shape)

    def numel(self, shape: tuple[int, ...]) -> int:
        n = 1
        for d in self.shape(shape):
            n *= d
        return 0 if self.kind == "none" else n


Overlap = Literal["all", "part", "none"]


def chunk_rows_cols(grid: Grid, c: ChunkInfo) -> tuple[int, int, int, int]:
    """The rows ``[a, b)`` and column elements ``[x, y)`` a chunk's elements lie in (a bounding box)."""
    if c.cell == FLAT:
        r0, c0, width = 0, 0, grid.row_elems
    else:
        r0, _, cc0, cc1 = grid.rect(c.cell)
        c0, width = cc0 * grid.inner, (cc1 - cc0) * grid.inner
    qa, qb = c.start // width, (c.start + c.count - 1) // width
    if qa == qb:
        return r0 + qa, r0 + qa + 1, c0 + c.start % width, c0 + (c.start + c.count - 1) % width + 1
    return r0 + qa, r0 + qb + 1, c0, c0 + width


def overlap(grid: Grid, c: ChunkInfo, bounds: tuple[int, int, int, int]) -> Overlap:
    """Whether a chunk's elements lie all, partly or not at all in a region's ``bounds``."""
    ra, rb, ca, cb = bounds
    a, b, x, y = chunk_rows_cols(grid, c)
    if b <= ra or a >= rb or y <= ca or x >= cb:
        return "none"
    if ra <= a and b <= rb and ca <= x and y <= cb:
        return "all"
    return "part"


def global_index(grid: Grid, c: ChunkInfo, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global ``(row, column element)`` of chunk-relative positions."""
    index = pos.astype(np.int64) + c.start
    return flat_to_global(grid, index) if c.cell == FLAT else grid.to_global(c.cell, index)


def in_region_count(grid: Grid, c: ChunkInfo, bounds: tuple[int, int, int, int]) -> int:
    """How many of a chunk's elements lie in ``bounds`` (row by row; no element is enumerated)."""
    ra, rb, ca, cb = bounds
    if c.cell == FLAT:
        r0, c0, width = 0, 0, grid.row_elems
    else:
        r0, _, cc0, cc1 = grid.rect(c.cell)
        c0, width = cc0 * grid.inner, (cc1 - cc0) * grid.inner
    q = np.arange(c.start // width, (c.start + c.count - 1) // width + 1, dtype=np.int64)
    lo = np.maximum(c.start, q * width) - q * width + c0
    hi = np.minimum(c.start + c.count, (q + 1) * width) - q * width + c0
    rows = r0 + q
    keep = (rows >= ra) & (rows < rb)
    return int(np.maximum(0, np.minimum(hi, cb) - np.maximum(lo, ca))[keep].sum())


@dataclass(frozen=True)
class ChunkRef:
    """A chunk a region needs: its index in the segment's chunk table and its payload's byte range."""

    index: int
    chunk: ChunkInfo
    offset: int  # payload's first byte in the segment
    overlap: Overlap


def plan_chunks(
    header: SegmentHeader, regions: dict[str, Region], *, grids: dict[str, Grid] | None = None
) -> list[ChunkRef]:
    """The chunks of one segment that the ``regions`` need (with a change and touching a region).

    Cost: array operations over the chunk table and one step per tensor with a change. Raises
    RegionError for a chunk coded with a codec that needs its whole base (``ctx``, ``ctxs``) that lies partly
    in a region: that region is not a union of the tensor's grid cells (or the delta came from a
    sharded writer's row-major chunks).
    """
    grids = {} if grids is None else grids
    t = header.table
    live = np.flatnonzero(t.changed > 0)
    tensors = np.unique(t.tensor[live])
    # per tensor with a change: rows, row elements, inner, row cell, column cell, cols, region bounds
    # (ra, rb, ca, cb), and whether the region is whole (1), absent (0) or a part (2)
    dims = np.zeros((len(header.tensors), 10), dtype=np.int64)
    how = np.zeros(len(header.tensors), dtype=np.int64)
    folded = np.zeros(len(header.tensors), dtype=bool)
    for ti in tensors.tolist():
        spec = header.tensors[ti]
        region = regions.get(spec.name)
        if region is None or region.kind == "none":
            continue
        grid = grids.get(spec.name) or grids.setdefault(spec.name, Grid(region.fold or spec.shape))
        how[ti] = 1 if region.kind == "whole" else 2
        folded[ti] = region.fold is not None
        bounds = region.bounds(grid) if how[ti] == 2 else (0, 0, 0, 0)
        dims[ti] = (grid.rows, grid.row_elems, grid.inner, grid.row_cell, grid.col_cell, grid.cols, *bounds)
    cells = live[folded[t.tensor[live]] & (t.cell[live] != FLAT)]
    if cells.size:  # a folded part's cell chunk (one pass over the table, not one per folded tensor)
        c = header.chunk(int(cells[0]))
        folded_cell(regions[c.tensor], c)
    live = live[how[t.tensor[live]] > 0]
    part = live[how[t.tensor[live]] == 2]
    a, b, x, y = _boxes(dims[t.tensor[part]], t.cell[part], t.start[part], t.count[part])
    ra, rb, ca, cb = (dims[t.tensor[part], k] for k in range(6, 10))
    meets = (b > ra) & (a < rb) & (y > ca) & (x < cb)
    inside = (ra <= a) & (b <= rb) & (ca <= x) & (y <= cb)
    state = np.full(len(t), -1, dtype=np.int64)  # -1 not needed, 0 part, 1 all
    state[live] = 1
    state[part] = np.where(meets, np.where(inside, 1, 0), -1)
    bad = np.flatnonzero((state == 0) & ~np.isin(t.codec, _PART_IDS))
    if bad.size:
        c = header.chunk(int(bad[0]))
        raise RegionError(
            f"chunk [{c.start}, {c.start + c.count}) of {c.tensor!r} (cell {c.cell}, codec {c.codec}) needs base "
            f"elements outside the region {regions[c.tensor]}: not a union of the tensor's grid cells"
        )
    return [ChunkRef(i, header.chunk(i), int(t.offset[i]), "all" if state[i] else "part")
            for i in np.flatnonzero(state >= 0).tolist()]  # fmt: skip


def _boxes(dims: np.ndarray, cell: np.ndarray, start: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, ...]:
    """Vector form of :func:`chunk_rows_cols`: each chunk's rows ``[a, b)`` and column elements
    ``[x, y)`` (``dims`` per chunk: rows, row elements, inner, row cell, column cell, cols)."""
    _, row_elems, inner, rc, cc, cols = (dims[:, k] for k in range(6))
    flat = cell < 0
    i, j = np.maximum(cell, 0) // GRID, np.maximum(cell, 0) % GRID
    cc0 = j * cc
    r0 = np.where(flat, 0, i * rc)
    c0 = np.where(flat, 0, cc0 * inner)
    width = np.where(flat, row_elems, (np.minimum(cols, cc0 + cc) - cc0) * inner)
    width = np.maximum(width, 1)
    last = start + count - 1
    qa, qb = start // width, last // width
    one = qa == qb
    a, b = r0 + qa, r0 + qb + 1
    x = np.where(one, c0 + start % width, c0)
    y = np.where(one, c0 + last % width + 1, c0 + width)
    return a, b, x, y


def chunk_overlaps(header: SegmentHeader, places: dict[str, Placement]) -> np.ndarray:
    """Per chunk of ``header``'s table, as array operations: 1 when it lies wholly in its tensor's
    placed region (or the region is whole), -1 when wholly outside, 0 when the caller must ask
    :func:`overlap` chunk by chunk (a part, a tensor without a placement, a folded region's cell)."""
    t = header.table
    dims = np.zeros((len(header.tensors), 10), dtype=np.int64)
    how = np.zeros(len(header.tensors), dtype=np.int64)  # 1 whole, 2 a part, 3 folded part, 0 none placed
    for ti, spec in enumerate(header.tensors):
        place = places.get(spec.name)
        if place is None:
            continue
        g = place.grid
        how[ti] = 1 if place.whole else 3 if place.region.fold is not None else 2
        dims[ti] = (g.rows, g.row_elems, g.inner, g.row_cell, g.col_cell, g.cols, *place.bounds)
    per = dims[t.tensor]
    a, b, x, y = _boxes(per, t.cell, t.start, t.count)
    ra, rb, ca, cb = (per[:, k] for k in range(6, 10))
    meets = (b > ra) & (a < rb) & (y > ca) & (x < cb)
    inside = (ra <= a) & (b <= rb) & (ca <= x) & (y <= cb)
    kind = how[t.tensor]
    vec = (kind == 2) | ((kind == 3) & (t.cell == FLAT))
    out = np.where(vec, np.where(meets, np.where(inside, 1, 0), -1), 0)
    return np.where(kind == 1, 1, out)


def folded_cell(region: Region, c: ChunkInfo) -> None:
    """RegionError for a grid cell's chunk of a tensor whose region is taken in a fold."""
    if region.fold is not None and c.cell != FLAT:
        raise RegionError(f"cell {c.cell} of {c.tensor!r}: a part taken in the fold {list(region.fold)} reads "
                          "row-major chunks only (the grid cuts the tensor's own dimensions)")


def byte_ranges(refs: list[ChunkRef]) -> list[tuple[int, int]]:
    """The payload byte ranges ``[start, end)`` of ``refs``, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for r in sorted(refs, key=lambda r: r.offset):
        a, b = r.offset, r.offset + r.chunk.nbytes
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _contiguous_rows(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether every dimension but the first is laid out contiguously (strides in elements)."""
    want = 1
    for d, s in zip(reversed(shape[1:]), reversed(strides[1:]), strict=True):
        if d > 1 and s != want:
            return False
        want *= d
    return True


def span_of(name: str, value: Any, shape: tuple[int, ...]) -> tuple[Any, int]:
    """``(span, row stride)``: a 1-D view over the memory of a region view, from its first element to
    its last (rows of a column block are ``row stride`` elements apart), the same kind of object as
    ``value`` (torch tensor, numpy array or BF16)."""
    if tuple(int(d) for d in value.shape) != tuple(shape):
        raise RegionError(
            f"tensor {name!r}: view of shape {list(value.shape)}, region has shape {list(shape)}"
        )
    dtype_of(name, value)
    rows = shape[0] if shape else 1
    row_elems = 1
    for d in shape[1:]:
        row_elems *= d
    if rows * row_elems == 0:
        raise RegionError(f"tensor {name!r}: an empty region has no view")
    if isinstance(value, BF16 | np.ndarray):
        arr = value.bits if isinstance(value, BF16) else value
        isz = arr.dtype.itemsize
        strides = tuple(s // isz for s in arr.strides) if arr.ndim else ()
        if not _contiguous_rows(shape, strides) or (arr.ndim and strides[0] < row_elems and rows > 1):
            raise RegionError(f"tensor {name!r}: the rows of a region view must be contiguous")
        s0 = strides[0] if arr.ndim and rows > 1 else row_elems
        span = np.lib.stride_tricks.as_strided(arr, shape=((rows - 1) * s0 + row_elems,), strides=(isz,))
        return (BF16(span) if isinstance(value, BF16) else span), s0
    torch = sys.modules["torch"]
    strides = tuple(value.stride())
    if not _contiguous_rows(shape, strides) or (value.dim() and strides[0] < row_elems and rows > 1):
        raise RegionError(f"tensor {name!r}: the rows of a region view must be contiguous")
    s0 = strides[0] if value.dim() and rows > 1 else row_elems
    length = (rows - 1) * s0 + row_elems
    return torch.as_strided(value.detach(), (length,), (1,), value.storage_offset()), s0


def block_of(span: Any, s0: int, rows: int, width: int, r: tuple[int, int], x: tuple[int, int]) -> np.ndarray:
    """Contiguous copy of rows ``r`` and column elements ``x`` of a region (``span``'s 2-D layout is
    ``rows`` rows ``s0`` apart, ``width`` elements each): the old bits a cell chunk decodes against."""
    if is_cuda(span):
        from deltarl.codec.tensors import UINT_BY_SIZE, signed_torch_dtype

        flat = span.view(signed_torch_dtype(span.element_size()))
        block = flat.as_strided((rows, width), (s0, 1))[r[0] : r[1], x[0] : x[1]].contiguous().cpu().numpy()
        return block.reshape(-1).view(UINT_BY_SIZE[block.itemsize])
    return np.ascontiguousarray(block_view(span, s0, rows, width)[r[0] : r[1], x[0] : x[1]]).reshape(-1)


def block_view(span: Any, s0: int, rows: int, width: int) -> np.ndarray:
    """A host span's bits as the region's 2-D array (``rows`` rows ``s0`` apart, ``width`` each)."""
    arr = flat_bits("span", span)
    return np.lib.stride_tricks.as_strided(arr, shape=(rows, width), strides=(s0 * arr.itemsize, arr.itemsize))


def region_spec(name: str, spec: TensorSpec, length: int) -> TensorSpec:
    """The spec of a region's 1-D span (what the staged update writes into)."""
    return TensorSpec(name, spec.dtype, (length,))


class Placement:
    """Where the stager finds one tensor's region: grid, bounds, the span (the memory staged into and
    committed to) and its row stride. With ``whole`` the span is the tensor itself (flat offsets)."""

    def __init__(self, name: str, spec: TensorSpec, region: Region, value: Any) -> None:
        self.name, self.spec, self.region = name, spec, region
        self.grid = Grid(region.fold or spec.shape)
        self.bounds = region.bounds(self.grid)
        self.whole = region.kind == "whole"
        self._view2d: np.ndarray | None = None
        if self.whole:
            self.span, self.s0 = value, self.grid.row_elems
        else:
            self.span, self.s0 = span_of(name, value, region.shape(spec.shape))

    @property
    def span_spec(self) -> TensorSpec:
        ra, rb, ca, cb = self.bounds
        if self.whole:
            return self.spec
        return region_spec(self.name, self.spec, (rb - ra - 1) * self.s0 + cb - ca)

    def old_bits(self, c: ChunkInfo) -> np.ndarray:
        """Contiguous old bits of a chunk that lies wholly in the region."""
        ra, rb, ca, cb = self.bounds
        g = self.grid
        if c.cell == FLAT:
            r0, x0, width = 0, 0, g.row_elems
        else:
            r0, _, cc0, cc1 = g.rect(c.cell)
            x0, width = cc0 * g.inner, (cc1 - cc0) * g.inner
        qa, qb = c.start // width, (c.start + c.count - 1) // width
        rows, cols = (r0 + qa - ra, r0 + qb + 1 - ra), (x0 - ca, x0 + width - ca)
        if is_cuda(self.span):
            block = block_of(self.span, self.s0, rb - ra, cb - ca, rows, cols)
        else:  # the region's 2-D bit view, made once
            if self._view2d is None:
                self._view2d = block_view(self.span, self.s0, rb - ra, cb - ca)
            block = np.ascontiguousarray(self._view2d[rows[0] : rows[1], cols[0] : cols[1]]).reshape(-1)
        first = c.start - qa * width
        return block[first : first + c.count]

    def offsets(self, c: ChunkInfo, pos: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """``(mask, offsets)``: which chunk-relative positions lie in the region (None: all) and their
        element offsets in the span."""
        ra, rb, ca, cb = self.bounds
        if self.whole and c.cell != FLAT:  # offsets straight from the cell's origin and width
            r0, _, cc0, cc1 = self.grid.rect(c.cell)
            width, rw = (cc1 - cc0) * self.grid.inner, self.grid.row_elems
            index = pos.astype(np.int64) + c.start
            q = index // width
            return None, q * rw + (index - q * width) + (r0 * rw + cc0 * self.grid.inner)
        row, col = global_index(self.grid, c, pos)
        mask = None
        if not self.whole:
            inside = (row >= ra) & (row < rb) & (col >= ca) & (col < cb)
            if not bool(inside.all()):
                mask, row, col = inside, row[inside], col[inside]
        return mask, (row - ra) * self.s0 + (col - ca)
