"""Shard-grid cells (segment format 2): golden bytes, and every TP part along either dim decodes alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, encode_delta, read_segment_header, stage_delta
from deltarl.codec import delta_layout as layout
from deltarl.codec.grid import Grid, cell_size, morton
from deltarl.codec.regions import Region, overlap, plan_chunks
from deltarl.codec.segment import SegmentHeader
from deltarl.codec.tensors import tensor_table
from deltarl.errors import RegionError, StagingError

# A 16 x 16 bfloat16 tensor, 2 x 2 cells of 8 x 8, coded ctx cell by cell (Z order: 0, 1, 8, 9; classes
# of two exponents, shift 8 and 7 bits, as a cell with few changes has):
# element (r, c) changes by +1 ulp when (r * 16 + c) % 37 == 0, by -3 ulp when it is 100.
GOLDEN_CELLS = (
    "44524c53020000003f000000b44d67900200763001000000000001007401021000000000000000100000000000000004"
    "00000018000000000c0040031e00140040021c004c0040011500540040021c08070c010100010000010000013e020000"
    "02013f0000000100587040404008070c010100000000000000013c04000001003d0300000100a0f80008070601000000"
    "0000000000013e0000000100200008070c010100000000000000013d02000001003f030000010050a800f1f9911e"
)


def _cells_pair() -> tuple[dict, dict]:
    rng = np.random.default_rng(7)
    old = (0x3C00 + rng.integers(0, 0x0400, size=(16, 16))).astype(np.uint16)
    new = old.copy().reshape(-1)
    idx = np.arange(256)
    new[idx % 37 == 0] += 1
    new[100] -= 3
    return {"t": BF16(old)}, {"t": BF16(new.reshape(16, 16))}


def test_golden_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 1)
    old, new = _cells_pair()
    (seg,) = encode_delta(old, new, base="v0", codec="ctx")
    assert seg.hex() == GOLDEN_CELLS
    h = read_segment_header(seg)
    assert [(c.cell, c.start, c.count, c.codec) for c in h.chunks] == [
        (0, 0, 64, "ctx"), (1, 0, 64, "ctx"), (8, 0, 64, "ctx"), (9, 0, 64, "ctx"),
    ]  # fmt: skip
    state = {"t": BF16(old["t"].bits.copy())}
    stage_delta(state, [seg], base="v0").commit()
    assert np.array_equal(state["t"].bits, new["t"].bits)


def test_grid_cells_hold_every_tp_part() -> None:
    for n in (1, 7, 64, 100, 1024, 151936, 151665):
        cell = cell_size(n)
        assert -(-n // cell) <= 8
        padded = -(-n // 64) * 64
        for tp in (1, 2, 4, 8):
            if padded % (tp * cell) == 0 or n < 64:
                continue
            assert padded // tp % cell == 0  # vLLM's padded-vocabulary shards are unions of cells
    assert [morton(c) for c in (0, 1, 8, 9, 63)] == [0, 1, 2, 3, 63]
    g = Grid((100, 30, 2))
    assert sum(g.numel(c) for c in g.cells) == 6000


_SPECIAL = np.array([0x0000, 0x8000, 0x7FC1, 0xFFC0, 0x0001, 0x8001, 0x7F80, 0xFF80], dtype=np.uint16)


def _pair(rows: int, cols: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = (0x3800 + rng.integers(0, 0x0C00, size=rows * cols)).astype(np.uint16)
    old[rng.integers(0, old.size, size=max(1, old.size // 50))] = rng.choice(_SPECIAL, size=max(1, old.size // 50))
    new = old.copy()
    hit = rng.random(old.size) < density
    new[hit] += rng.choice(np.array([1, 1, 1, 0xFFFF, 2, 0x8000], dtype=np.uint16), size=int(hit.sum()))
    new[rng.integers(0, old.size, size=2)] = rng.choice(_SPECIAL, size=2)  # +-0, NaN, subnormals, inf
    return old.reshape(rows, cols), new.reshape(rows, cols)


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.copy().view(np.int16)).view(torch.bfloat16)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.sampled_from([8, 16, 40, 64, 72, 128]),
    cols=st.sampled_from([8, 24, 64, 96, 128]),
    density=st.sampled_from([0.0, 1e-3, 1e-2, 0.05, 0.3, 0.7, 1.0]),
    codec=st.sampled_from(["auto", "ctx", "ctxs", "sparse", "dense"]),
    seed=st.integers(0, 2**16),
    cell_min=st.sampled_from([1, 1 << 40]),  # 1 << 40: ``auto`` keeps w row-major, cut at its row bands
)
def test_every_tp_part_decodes_alone(rows: int, cols: int, density: float, codec: str, seed: int,
                                     cell_min: int) -> None:  # fmt: skip
    old_w, new_w = _pair(rows, cols, density, seed)
    old_v, new_v = _pair(1, rows * 2, density, seed + 1)
    old = {"w": BF16(old_w), "v": BF16(old_v.reshape(-1))}
    new = {"w": BF16(new_w), "v": BF16(new_v.reshape(-1))}
    saved = layout.TILE_MIN_ELEMENTS, layout.CELL_MIN_CHANGES, layout.BAND_MIN_CHANGES
    # these small tensors in cells too, or (cell_min 1 << 40, codec auto) in row bands
    layout.TILE_MIN_ELEMENTS, layout.CELL_MIN_CHANGES, layout.BAND_MIN_CHANGES = 64, cell_min, 1
    try:
        segs = encode_delta(old, new, base="b", codec=codec, segment_bytes=512)
    finally:
        layout.TILE_MIN_ELEMENTS, layout.CELL_MIN_CHANGES, layout.BAND_MIN_CHANGES = saved
    whole = {k: _torch(v.bits) for k, v in old.items()}
    stage_delta(whole, segs, base="b").commit()
    assert np.array_equal(whole["w"].view(torch.int16).numpy().view(np.uint16), new_w)
    specs = tensor_table(old)
    for dim in (0, 1):
        for tp in (1, 2, 4, 8):
            n = (rows, cols)[dim]
            if n % tp or ((n // tp) % cell_size(n) and tp > 1):
                continue  # not a union of cells: only TP parts of multiples of 64 (and padded vocabularies)
            for rank in range(tp):
                state = {k: _torch(v.bits) for k, v in old.items()}
                region = Region.tp(dim, rank, tp, n)
                views = {"w": state["w"].narrow(dim, region.start, region.stop - region.start), "v": state["v"]}
                regions = {"w": region, "v": Region.whole()}
                for seg in segs:  # the plan is the chunk-by-chunk reading of the table
                    h = read_segment_header(seg)
                    assert [(r.index, r.offset, r.overlap) for r in plan_chunks(h, regions)] == _plan_by_chunk(h, regions)
                upd = stage_delta(views, segs, base="b", regions=regions, specs=specs)
                upd.commit()
                got = state["w"].view(torch.int16).numpy().view(np.uint16)
                want = old_w.copy()
                sl = (slice(region.start, region.stop), slice(None)) if dim == 0 else (slice(None), slice(region.start, region.stop))
                want[sl] = new_w[sl]
                assert np.array_equal(got, want), (dim, tp, rank)  # its part new, the rest untouched
                upd.rollback()
                assert np.array_equal(state["w"].view(torch.int16).numpy().view(np.uint16), old_w)


def _plan_by_chunk(h: SegmentHeader, regions: dict[str, Region]) -> list[tuple[int, int, str]]:
    """What plan_chunks must return, one chunk at a time."""
    out, off = [], h.payload_offset
    specs = {t.name: t for t in h.tensors}
    for i, c in enumerate(h.chunks):
        r = regions.get(c.tensor)
        if r is not None and r.kind != "none" and c.changed:
            grid = Grid(specs[c.tensor].shape)
            how = "all" if r.kind == "whole" else overlap(grid, c, r.bounds(grid))
            if how != "none":
                out.append((i, off, how))
        off += c.nbytes
    return out


def test_row_bands_of_a_tensor_kept_out_of_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor too small for cells is written in row-major chunks cut at its grid's row bands, the
    top half's after the first Z-order quarter and the bottom half's after the third: a rank holding
    a TP 2 row half plans only its own bands' chunks."""
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 64)
    monkeypatch.setattr(layout, "CELL_MIN_CHANGES", 1 << 40)
    monkeypatch.setattr(layout, "BAND_MIN_CHANGES", 1)
    old_w, new_w = _pair(128, 64, 0.01, 3)
    (seg,) = encode_delta({"w": BF16(old_w)}, {"w": BF16(new_w)}, base="b")
    h = read_segment_header(seg)
    band = 16 * 64  # 8 bands of 16 rows
    assert [(c.cell, c.start, c.count, c.codec) for c in h.chunks] == [
        (-1, i * band, band, "sparse" if c.changed else "none") for i, c in enumerate(h.chunks)
    ]
    for rank in range(2):
        planned = plan_chunks(h, {"w": Region.tp(0, rank, 2, 128)})
        assert planned
        assert all(rank * 4 * band <= r.chunk.start < (rank + 1) * 4 * band for r in planned)


def test_a_region_that_cuts_a_cell_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 1)
    old, new = _cells_pair()
    (seg,) = encode_delta(old, new, base="v0", codec="ctx")
    state = {"t": _torch(old["t"].bits)}
    with pytest.raises(RegionError):
        plan_chunks(read_segment_header(seg), {"t": Region.rows(0, 4)})
    with pytest.raises(RegionError):
        stage_delta({"t": state["t"][0:4]}, [seg], base="v0", regions={"t": Region.rows(0, 4)}, specs=tensor_table(old))


def test_a_missing_cell_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 1)
    old, new = _cells_pair()
    segs = encode_delta(old, new, base="v0", codec="ctx", segment_bytes=16)
    assert len(segs) == 4
    state = {"t": _torch(old["t"].bits)}
    views = {"t": state["t"][8:16]}
    regions = {"t": Region.rows(8, 16)}
    parts = [s for s in segs if plan_chunks(read_segment_header(s), regions)]
    assert len(parts) == 2  # the two lower cells
    stage_delta(views, parts, base="v0", regions=regions, specs=tensor_table(old)).commit()
    with pytest.raises(StagingError, match="incomplete"):
        stage_delta(views, parts[:1], base="v0", regions=regions, specs=tensor_table(old))


def test_an_expert_on_another_rank_is_never_read() -> None:
    rng = np.random.default_rng(1)
    old = {f"e{i}": BF16((0x3C00 + rng.integers(0, 0x400, size=(64, 32))).astype(np.uint16)) for i in range(4)}
    new = {k: BF16(v.bits.copy()) for k, v in old.items()}
    for v in new.values():
        v.bits[rng.random(v.bits.shape) < 0.05] += 1
    segs = encode_delta(old, new, base="b", segment_bytes=64)
    regions = {"e0": Region.none(), "e1": Region.whole(), "e2": Region.none(), "e3": Region.whole()}
    assert {r.chunk.tensor for s in segs for r in plan_chunks(read_segment_header(s), regions)} == {"e1", "e3"}
    state = {k: _torch(v.bits) for k, v in old.items()}
    views = {k: state[k] for k in ("e1", "e3")}
    stage_delta(views, segs, base="b", regions=regions, specs=tensor_table(old)).commit()
    for k in old:
        want = new[k].bits if k in views else old[k].bits
        assert np.array_equal(state[k].view(torch.int16).numpy().view(np.uint16), want)
