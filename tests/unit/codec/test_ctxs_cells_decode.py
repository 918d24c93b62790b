"""A tensor's ``ctxs`` cells decoded in one numba call, 16-bit ones two at a time (``ctx_scan2``): the
same changes as chunk by chunk for any number of chunks a call (odd ones included), and a bad chunk,
first or second of a pair, bad payload or a base its ranks do not fit, named as the first that failed.
Cells 16 wide in rows 80 apart are read in place; rows 74 apart are not 8-byte aligned: copied."""

from __future__ import annotations

import numpy as np
import pytest

from deltarl.codec import BF16, kernels, read_segment_header, stage_delta
from deltarl.codec import stager as stager_mod
from deltarl.codec.grid import Grid
from deltarl.codec.segment import ChunkInfo
from deltarl.errors import FormatError
from tests.unit.codec.test_ctxs import _cells_delta, _refix

pytestmark = pytest.mark.skipif(kernels.ctx_jit() is None, reason="numba is off")


def _changes(old: np.ndarray, segs: list[bytes]) -> tuple[np.ndarray, ...]:
    got = stage_delta({"w": BF16(old.copy())}, segs, base="b").changes()["w"]
    order = np.argsort(got[0])
    return tuple(a[order] for a in got)


@pytest.mark.parametrize("cols", [80, 74])
@pytest.mark.parametrize("per_task", [1, 2, 3, 5, 16])
def test_any_number_of_cells_a_call_decodes_as_chunk_by_chunk(per_task: int, cols: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    old, segs = _cells_delta(monkeypatch, cols)
    monkeypatch.setattr(stager_mod.Stager, "_on_host_jit", lambda self, names, tensors: np.zeros(tensors.size, dtype=bool))
    single = _changes(old, segs)
    monkeypatch.undo()
    old, segs = _cells_delta(monkeypatch, cols)
    monkeypatch.setattr(stager_mod, "_CELLS_PER_TASK", per_task)
    for a, b in zip(_changes(old, segs), single, strict=True):
        assert np.array_equal(a, b)


def _cells_of(seg: bytes) -> list[tuple[ChunkInfo, int]]:
    """The ctxs cell chunks with changes of a segment, with their payload offsets, in segment order."""
    head = read_segment_header(seg)
    off, out = head.payload_offset, []
    for c in head.chunks:
        if c.codec == "ctxs" and c.changed and c.cell >= 0:
            out.append((c, off))
        off += c.nbytes
    return out


def _zero_cell(old: np.ndarray, cell: int) -> np.ndarray:
    """The base with a cell's elements zero: a class no change of the cell has, so its ranks do not fit."""
    r0, r1, c0, c1 = Grid(old.shape).rect(cell)
    out = old.copy()
    out[r0:r1, c0:c1] = 0
    return out


@pytest.mark.parametrize("cols", [80, 74])
@pytest.mark.parametrize(("zeroed", "broken", "named"), [
    ([1], [], 1), ([0], [], 0), ([2, 3], [], 2), ([-1], [], -1), ([], [1], 1), ([0], [1], 0), ([], [0, 1], 0),
    ([3], [2], 2), ([], [-1], -1),
])  # fmt: skip
def test_the_first_bad_chunk_of_a_pair_is_named(zeroed: list[int], broken: list[int], named: int, cols: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Chunks whose base was zeroed fail in the scan, chunks whose unary stream (at the payload's end,
    segment format 5) starts with 48 zero bits, longer than any code (or is all zeros), in the parse; either way the
    stager names the first in segment order, a pair's first or second."""
    old, segs = _cells_delta(monkeypatch, cols)
    cells = _cells_of(segs[0])
    assert len(cells) >= 5
    assert len({c.cell for c, _ in cells}) == len(cells)
    for k in zeroed:
        old = _zero_cell(old, cells[k][0].cell)
    bad = bytearray(segs[0])
    for k in broken:
        end = cells[k][1] + cells[k][0].nbytes
        start = max(cells[k][1], end - 6)  # a payload of fewer bytes: all of it, no code ends
        bad[start:end] = bytes(end - start)
    with pytest.raises(FormatError, match=rf"cell {cells[named][0].cell}\)"):
        stage_delta({"w": BF16(old)}, [_refix(bytes(bad)), *segs[1:]], base="b")
