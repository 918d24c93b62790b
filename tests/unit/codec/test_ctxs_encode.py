"""The batched ``ctxs`` cell writer (``ctxs_cells.encode_cells``, one numba call for a tensor's cells) gives
the bytes of the chunk-by-chunk path: any class record, any cells and chunk sizes, every dtype, both
``auto`` and ``ctxs`` by name, NaN / Inf refusals included; and whole deltas are the same bytes with
the batch, chunk by chunk and on the numpy path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, ctxs_cells, encode_delta, kernels
from deltarl.codec import delta_layout as layout
from deltarl.codec.ctxs import ClassRecord, choose_record
from deltarl.codec.delta_layout import CellChunks
from deltarl.codec.encode import _encode_cells, _encode_named
from deltarl.codec.grid import Grid
from deltarl.codec.tensors import TensorSpec
from deltarl.errors import NonFiniteTensor
from tests.unit.codec.test_ctxs import WIDTH, draw_bits, draw_record

NAN = {"bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000, "float8_e4m3fn": 0x7F, "float8_e5m2": 0x7E}
SHAPES = [(64, 64), (72, 40), (130, 24), (40, 8, 3), (1000,), (9, 700), (256, 9), (16, 72)]  # (16, 72): cells 16 and 8 wide
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip


@st.composite
def tensors(draw: st.DrawFn) -> tuple[TensorSpec, np.ndarray, np.ndarray, ClassRecord, list[tuple[int, int, int]]]:
    """(spec, old bits, new bits, a record, cell chunks): the record from a drawn part of the tensor
    (classes of a cell may be missing from it), its Rice parameters sometimes drawn; cells cut into
    chunks of a drawn size; densities from a few changes to every element changed."""
    dtype = draw(st.sampled_from(sorted(WIDTH)))
    shape = draw(st.sampled_from(SHAPES))
    n = int(np.prod(shape))
    steps = (1 << (WIDTH[dtype] - 3),)
    old, new = draw_bits(draw, dtype, n, [0.0, 0.001, 0.003, 0.01, 0.1, 0.6, 1.0], steps, at_least_one=False)
    rec = draw_record(draw, old, new, dtype, n // 3, n // 64 + 1)
    grid = Grid(shape)
    most = draw(st.sampled_from([5, 64, 333, 1 << 22]))
    chunks = [(cell, a, min(grid.numel(cell), a + most) - a) for cell in grid.cells
              for a in range(0, grid.numel(cell), most)]  # fmt: skip
    return TensorSpec("t", dtype, shape), old, new, rec, chunks


def _one_by_one(task: CellChunks, codec: str, finite: bool, record: ClassRecord) -> list[tuple[str, int, bytes]]:
    return [_encode_named(task.spec, cell, start, count, task.old, task.new, codec, finite, False, record)
            for cell, start, count in task.chunks]  # fmt: skip


@SETTINGS
@given(case=tensors(), codec=st.sampled_from(["auto", "ctxs"]), nan=st.booleans())
def test_batched_cells_are_the_bytes_of_chunk_by_chunk(case: tuple, codec: str, nan: bool) -> None:
    if kernels.ctx_jit() is None:
        pytest.skip("numba is off")
    from deltarl.codec import _numba_ctxs_encode

    assert (_numba_ctxs_encode.CELL_CTXS, _numba_ctxs_encode.CELL_OTHER) == (ctxs_cells.CELL_CTXS, ctxs_cells.CELL_OTHER)
    spec, old, new, rec, chunks = case
    if nan:  # a NaN among one cell's new values: both refuse it, naming the same chunk
        new = new.copy()
        new[new.size // 2] = NAN[spec.dtype]
    task = CellChunks(spec, Grid(spec.shape), chunks, old, new)
    want: list | Exception
    try:
        want = _one_by_one(task, codec, nan, rec)
    except NonFiniteTensor as err:
        want = err
    if isinstance(want, Exception):
        with pytest.raises(NonFiniteTensor) as got:
            _encode_cells(task, codec, nan, rec)
        assert str(got.value) == str(want)
        return
    got = [res for *_, res in _encode_cells(task, codec, nan, rec)]
    assert got == want
    assert [(c, s, n) for _, c, s, n, _ in _encode_cells(task, codec, nan, rec)] == chunks


def test_cells_of_two_widths_in_one_band() -> None:
    """Chunks of a row band's cells scanned side by side span the same rows only when their cells are
    as wide: (16, 72)'s last column of cells is 8 wide where the others are 16, and chunks of 64
    elements are 4 rows of one and 8 of the other."""
    rng = np.random.default_rng(0)
    old = (0x3C00 + rng.integers(0, 0x400, 16 * 72)).astype(np.uint16)
    new = old.copy()
    new[rng.random(old.size) < 0.3] += 1
    grid = Grid((16, 72))
    chunks = [(c, a, min(grid.numel(c), a + 64) - a) for c in grid.cells for a in range(0, grid.numel(c), 64)]
    rec = choose_record(old, new, "bfloat16", 64, (8, 7))
    task = CellChunks(TensorSpec("t", "bfloat16", (16, 72)), grid, chunks, old, new)
    assert [res for *_, res in _encode_cells(task, "ctxs", False, rec)] == _one_by_one(task, "ctxs", False, rec)


def _state(seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for i, (shape, p) in enumerate([((256, 192), 0.01), ((96, 80), 0.004), ((128, 64), 0.3), ((300,), 0.01),
                                    ((64, 48), 0.002), ((80, 80), 0.7)]):  # fmt: skip
        o = (0x3C00 + rng.integers(0, 0x0400, size=shape)).astype(np.uint16)
        n = o.copy()
        n[rng.random(shape) < p] += 1
        n[rng.random(shape) < p / 10] -= 9
        old[f"m.{i}.w"], new[f"m.{i}.w"] = BF16(o), BF16(n)
    return old, new


@pytest.mark.parametrize("codec", ["auto", "ctxs"])
def test_deltas_are_the_same_bytes_batched_chunk_by_chunk_and_on_numpy(codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole deltas (cells of several tensors, sparse / ctxs / dense cells, small segments) written with
    the batch equal those written chunk by chunk and those of the numpy path (numba off)."""
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 64)
    monkeypatch.setattr(layout, "CELL_MIN_CHANGES", 1)
    old, new = _state(5)
    batched = encode_delta(old, new, base="b", codec=codec, segment_bytes=2048)
    with monkeypatch.context() as m:
        m.setattr(ctxs_cells, "encode_cells", lambda *a, **k: None)
        single = encode_delta(old, new, base="b", codec=codec, segment_bytes=2048)
    with monkeypatch.context() as m:
        m.setenv("DELTARL_NO_NUMBA", "1")
        numpy_path = encode_delta(old, new, base="b", codec=codec, segment_bytes=2048)
    assert len(batched) > 1
    assert batched == single == numpy_path
