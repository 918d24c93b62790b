"""A tensor's ``ctxs`` cell chunks coded or decoded in one numba call each (the stager's and the
encoder's batched paths): the same bytes and changes as :func:`deltarl.codec.ctxs.encode` and
:func:`deltarl.codec.ctxs.decode` chunk by chunk."""

from __future__ import annotations

from typing import Any

import numpy as np

from deltarl.codec import kernels
from deltarl.codec.chunk import Decoded
from deltarl.codec.ctxs import ClassRecord, _width

_U64 = np.uint64


# Columns of :func:`decode_cells`' table, one row a cell chunk.
CELL_COLUMNS = ("offset", "nbytes", "changed", "start", "count", "origin", "width")


def decode_cells(span: np.ndarray, s0: int, record: ClassRecord, raw: np.ndarray, table: np.ndarray
                 ) -> tuple[Decoded | None, int]:  # fmt: skip
    """Decode many cell chunks of one tensor in one numba call, each against its own base region of
    the host bits ``span`` (rows ``s0`` elements apart): ``table`` (int64, one row a chunk, columns
    :data:`CELL_COLUMNS`: payload offset and bytes in ``raw``, changes, first element in the cell's
    row-major order, elements, the cell's first element in ``span``, its row width in elements).
    Returns (positions as ``span`` offsets with old and new bits, -1), or (None, index of the first
    chunk that failed: :func:`decode` of it says why). None and -1 when numba is off."""
    if kernels.ctx_jit() is None:
        return None, -1
    from deltarl.codec import _numba_ctxs

    width = _width(span, record)
    at = np.cumsum(table[:, 2]) - table[:, 2]
    total = int(table[:, 2].sum()) if table.size else 0
    most = int(table[:, 4].max()) if table.size else 0
    half = (most + 3) // 4 * 4  # two chunks' bases side by side, the second 8-byte aligned too
    scratch64 = np.empty(2 * half * span.dtype.itemsize // 8 + 1, dtype=_U64)
    scratch = scratch64.view(span.dtype)[: 2 * half]
    pos, old_v, new_v = np.empty(total, np.int64), np.empty(total, span.dtype), np.empty(total, span.dtype)
    span64 = scratch64[:0]
    if span.dtype.itemsize == 2 and span.size >= 4 and span.ctypes.data % 8 == 0 and span.flags.c_contiguous:
        span64 = span[: span.size // 4 * 4].view(_U64)  # rows of cells read in place, 4 elements a load
    run: Any = _numba_ctxs.ctxs_cells
    err, bad = run(
        span, span64, s0, scratch, scratch64 if span.dtype.itemsize == 2 else scratch64[:0], raw,
        np.ascontiguousarray(np.column_stack((table, at)), dtype=np.int64), pos, old_v, new_v, record.shift,
        record.cbits, width, record.classes, record.rank_param(), record.k_big_gap, record.k_big_val, record.k_n,
        record.k_n_big, record.shares(), record.layout,
    )  # fmt: skip
    if err:
        return None, int(bad)
    return Decoded(pos, new_v, old_v), -1


# Columns of :func:`encode_cells`' table, one row a cell chunk.
ENCODE_COLUMNS = ("start", "count", "origin", "width", "band")
# What :func:`encode_cells` made of a chunk: no change, a ``ctxs`` payload, or left to the caller.
CELL_NONE, CELL_CTXS, CELL_OTHER = 0, 1, 2


def encode_cells(old: np.ndarray, new: np.ndarray, s0: int, record: ClassRecord, table: np.ndarray, *,
                 alone: tuple[float, float] = (0.0, np.inf), others: np.ndarray | None = None, weight: int = 1,
                 finite_mask: int = 0) -> tuple[np.ndarray, list[bytes]] | None:  # fmt: skip
    """Code many cell chunks of one tensor in one numba call (what :func:`encode` gives each, byte for
    byte), each cut out of ``old`` / ``new`` (the tensor's row-major bits, rows ``s0`` elements apart):
    ``table`` (int64, one row a chunk, columns :data:`ENCODE_COLUMNS`: first element in the cell's
    row-major order, elements, the cell's first element in the tensor, its row width in elements, a
    band: chunks of one band >= 0, the same whole rows of cells in one row band, are scanned side by
    side, a tensor row at a time; -1 alone).
    A chunk with changes is coded here when ``alone[0] * n <= weight * changed < alone[1] * n`` (of
    its ``n`` elements) and no range ``(low, high)`` of ``others`` holds it, and none of its new values
    has every bit of ``finite_mask`` set; else it is left to the caller. Returns (per chunk: kind
    (``CELL_NONE``, ``CELL_CTXS``, ``CELL_OTHER``), changed, NaN / Inf count; the payloads,
    empty where none), or None when numba is off."""
    if kernels.ctx_jit() is None:
        return None
    from deltarl.codec import _numba_ctxs_encode

    width = _width(old, record)
    a64, b64 = (np.zeros(0, dtype=_U64),) * 2
    n = old.size // 4 * 4
    if old.dtype.itemsize == 2 and n and old.ctypes.data % 8 == 0 and new.ctypes.data % 8 == 0:
        a64, b64 = old[:n].view(_U64), new[:n].view(_U64)  # 4 elements a load
    run: Any = _numba_ctxs_encode.ctxs_encode_cells
    out, rows = run(
        old, new, a64, b64, s0, np.ascontiguousarray(table, dtype=np.int64), record.shift, record.cbits, width,
        record.classes, record.rank_param(), record.k_big_gap, record.k_big_val, record.k_n, record.k_n_big,
        record.shares(), record.layout, float(alone[0]), float(alone[1]),
        np.zeros((0, 2)) if others is None else np.ascontiguousarray(others, dtype=np.float64), weight, finite_mask,
        np.empty(max(64, int(table[:, 1].sum()) // 32 if table.size else 64), np.uint8),
    )  # fmt: skip
    raw = out[: int(rows[:, 3].max()) if rows.size else 0].tobytes()
    payloads = [raw[a:b] for a, b in rows[:, 2:4].tolist()]
    return rows[:, [0, 1, 4]], payloads
