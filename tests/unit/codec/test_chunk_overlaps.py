"""``regions.chunk_overlaps`` (the stager's per-segment pass) agrees with ``overlap`` chunk by chunk:
1 only where a chunk lies wholly in its region, -1 only where wholly outside, 0 (asked one by one)
for parts, tensors without a placement and a folded region's cells."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, encode_delta, read_segment_header
from deltarl.codec import delta_layout as layout
from deltarl.codec.regions import Placement, Region, chunk_overlaps, overlap
from deltarl.codec.segment import FLAT
from deltarl.codec.tensors import tensor_table
from tests.unit.codec.test_regions import _pair, _torch


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    rows=st.sampled_from([8, 16, 40, 64, 72, 128]),
    cols=st.sampled_from([8, 24, 64, 96, 128]),
    density=st.sampled_from([0.0, 1e-2, 0.3, 1.0]),
    codec=st.sampled_from(["auto", "ctxs", "sparse"]),
    seed=st.integers(0, 2**16),
    cell_min=st.sampled_from([1, 1 << 40]),
    dim=st.sampled_from([0, 1]),
    tp=st.sampled_from([1, 2, 3, 4, 8]),
    v_region=st.sampled_from(["whole", "none", "absent", "fold"]),
)
def test_chunk_overlaps_agree_with_overlap(rows: int, cols: int, density: float, codec: str, seed: int,
                                           cell_min: int, dim: int, tp: int, v_region: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    old_w, new_w = _pair(rows, cols, density, seed)
    old_v, new_v = _pair(rows * 2, 8, density, seed + 1)
    old, new = {"w": BF16(old_w), "v": BF16(old_v)}, {"w": BF16(new_w), "v": BF16(new_v)}
    for name, value in (("TILE_MIN_ELEMENTS", 64), ("CELL_MIN_CHANGES", cell_min), ("BAND_MIN_CHANGES", 1)):
        monkeypatch.setattr(layout, name, value)  # small tensors in cells too (or in row bands)
    segs = encode_delta(old, new, base="b", codec=codec, segment_bytes=512)
    specs = {s.name: s for s in tensor_table(old)}
    n = (rows, cols)[dim]
    regions = {"w": Region.tp(dim, 1 % tp, tp, n) if n % tp == 0 else Region.whole()}
    if v_region == "whole":
        regions["v"] = Region.whole()
    places = {}
    for k, r in regions.items():
        t = _torch(old[k].bits)
        view = t if r.kind == "whole" else t.narrow(0 if r.kind == "rows" else 1, r.start, r.stop - r.start)
        places[k] = Placement(k, specs[k], r, view)
    if v_region == "fold":  # v (2 rows x 8 wide) taken as (rows, 16): its first 8 columns of that shape
        fold = Region(kind="cols", start=0, stop=8, fold=(rows, 16))
        places["v"] = Placement("v", specs["v"], fold, _torch(old_v).reshape(rows, 16)[:, :8])
    seen = set()
    for seg in segs:
        h = read_segment_header(seg)
        got = chunk_overlaps(h, places).tolist()
        assert len(got) == len(h.chunks)
        for code, c in zip(got, h.chunks, strict=True):
            place = places.get(c.tensor)
            if place is None or (place.region.fold is not None and c.cell != FLAT):
                assert code == 0
                continue
            how = "all" if place.whole else overlap(place.grid, c, place.bounds)
            assert code == {"all": 1, "none": -1, "part": 0}[how], (c, how, code)
            seen.add(how)
    assert seen  # every draw has chunks of w at least
