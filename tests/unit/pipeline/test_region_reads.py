"""A TP rank reads only its part of a published version: segment pieces and keyframe parts, verified."""

from __future__ import annotations

import pytest
import torch

from deltarl.codec import delta_layout as layout
from deltarl.codec import stage_delta
from deltarl.codec.regions import Region
from deltarl.errors import IntegrityError
from deltarl.pipeline.publish_config import PublishConfig
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.region_reads import read_part_regions, read_segment_parts
from deltarl.storage.memory import MemoryStore

SHAPES = {"a.q": (256, 128), "b.down": (128, 384), "c.norm": (128,)}


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    old = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    new = {}
    for n, t in old.items():
        bits = t.view(torch.int16).clone()
        hit = torch.rand(t.shape, generator=g) < 0.02
        bits[hit] += 1
        new[n] = bits.view(torch.bfloat16)
    return old, new


def _regions(dim: int, rank: int) -> dict[str, Region]:
    return {n: Region.whole() if len(s) == 1 else Region.tp(dim, rank, 2, s[dim]) for n, s in SHAPES.items()}


def _views(state: dict[str, torch.Tensor], regions: dict[str, Region]) -> dict[str, torch.Tensor]:
    out = {}
    for n, r in regions.items():
        out[n] = state[n] if r.kind == "whole" else state[n].narrow(0 if r.kind == "rows" else 1, r.start, r.stop - r.start)
    return out


@pytest.mark.parametrize("dim", [0, 1])
def test_a_rank_reads_and_stages_its_part(monkeypatch: pytest.MonkeyPatch, dim: int) -> None:
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 1 << 12)
    monkeypatch.setattr(layout, "CELL_MIN_CHANGES", 1)  # cells at these small sizes too
    old, new = _states()
    store = MemoryStore()
    cfg = PublishConfig(segment_changes=256)  # several segments
    with Publisher(store, "r", config=cfg) as pub:
        pub.publish({n: t.clone() for n, t in old.items()}, 0)
        pub.publish({n: t.clone() for n, t in new.items()}, 1)
    reader = RunReader(store, "r")
    (m0, vid0), (m1, _) = reader.manifest(0), reader.manifest(1)
    specs = {t.name: t for t in reader.info().tensors}
    for rank in range(2):
        regions = _regions(dim, rank)
        state = {n: torch.zeros_like(t) for n, t in old.items()}
        read = sum(read_part_regions(store.get_range, p, specs, regions, _views(state, regions), named_by=m0.key)
                   for p in m0.keyframe.parts)  # fmt: skip
        assert read <= sum(p.size for p in m0.keyframe.parts)
        parts = read_segment_parts(store.get_range, m1, regions)
        stage_delta(_views(state, regions), [p.data for p in parts], base=vid0, regions=regions,
                    specs=list(specs.values()), headers=[p.header for p in parts]).commit()  # fmt: skip
        for n, r in regions.items():
            got, want = state[n].view(torch.int16), new[n].view(torch.int16)
            if r.kind == "rows":
                got, want = got[r.start : r.stop], want[r.start : r.stop]
            elif r.kind == "cols":
                got, want = got[:, r.start : r.stop], want[:, r.start : r.stop]
            assert torch.equal(got, want), (n, rank)
        if dim == 0:  # rows: strictly less than the whole delta (norms and headers are read by both)
            assert sum(p.fetched_bytes for p in parts) <= sum(s.size for s in m1.segments)


def test_a_flipped_byte_in_a_read_piece_is_refused() -> None:
    old, new = _states()
    store = MemoryStore()
    with Publisher(store, "r") as pub:
        pub.publish({n: t.clone() for n, t in old.items()}, 0)
        pub.publish({n: t.clone() for n, t in new.items()}, 1)
    m1, _ = RunReader(store, "r").manifest(1)
    key = m1.segments[0].key
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 1
    store.put(key, bytes(data))
    with pytest.raises(IntegrityError):
        read_segment_parts(store.get_range, m1, _regions(0, 0))
