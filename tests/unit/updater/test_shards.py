"""A rank holding part of each tensor (deltarl.updater.shards): deltas staged into row ranges and
column blocks, the engine's digest joined from every rank's shares, coverage checked."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from deltarl.codec import encode_delta, state_digest  # noqa: E402
from deltarl.codec.tensors import TensorSpec  # noqa: E402
from deltarl.errors import TensorMismatch  # noqa: E402
from deltarl.pipeline.shard_digest import combine_digest  # noqa: E402
from deltarl.updater.probe import Placement, Region  # noqa: E402
from deltarl.updater.shards import _copy_ranges, digest_shares, owners, stage_regions  # noqa: E402

R, C, TP = 256, 384, 2  # q and o past the size that format 2 cuts into shard-grid cells
TABLE = [TensorSpec("k", "bfloat16", (4, C)), TensorSpec("o", "bfloat16", (R, C)), TensorSpec("q", "bfloat16", (R, C))]


def _regions(rank: int) -> dict[str, Region]:
    """q column-parallel (rows), o row-parallel (columns), k replicated on both ranks."""
    return {"q": Region("rows", rank * R // TP, (rank + 1) * R // TP, (R, C)),
            "o": Region("cols", rank * C // TP, (rank + 1) * C // TP, (R, C)), "k": Region("whole", 0, 4, (4, C))}


def _part(t: Any, r: Region) -> Any:
    if r.kind == "rows":
        return t[r.start : r.stop].clone()
    if r.kind == "cols":
        return t[:, r.start : r.stop].clone()
    return t.clone()


def _rank(state: dict[str, Any], rank: int) -> tuple[dict[str, Any], list[Placement]]:
    regions = _regions(rank)
    views = {n: _part(state[n], r) for n, r in regions.items()}
    return views, [Placement(n, n, 0, views[n].numel(), r.shape, r) for n, r in regions.items()]


def _states(changed: float) -> tuple[dict[str, Any], dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    old = {s.name: torch.randn(s.shape, generator=gen).to(torch.bfloat16) for s in TABLE}
    new = {}
    for n, t in old.items():
        bits = t.clone().view(-1).view(torch.int16)
        idx = torch.randperm(bits.numel(), generator=gen)[: max(1, int(bits.numel() * changed))]
        bits[idx] += 1
        new[n] = bits.view(torch.bfloat16).view(t.shape)
    return old, new


@pytest.mark.parametrize("codec", ["auto", "sparse", "ctx"])
def test_every_rank_stages_its_part_and_the_digests_join(codec: str) -> None:
    old, new = _states(0.05)
    segments = encode_delta(old, new, base="v0", codec=codec)
    ranks = [_rank(old, r) for r in range(TP)]
    for views, placements in ranks:
        stage_regions(views, placements, TABLE, segments, base="v0").commit()
    for rank, (views, _) in enumerate(ranks):
        assert all(torch.equal(views[n], _part(new[n], r)) for n, r in _regions(rank).items())
    owned = owners(TABLE, [{p.name: p.region for p in placements} for _, placements in ranks])
    assert owned == [{"k", "o", "q"}, {"o", "q"}]  # the replicated k hashed once
    shares = [s for (views, placements), mine in zip(ranks, owned, strict=True)
              for s in digest_shares(TABLE, placements, views, mine)]
    assert combine_digest(TABLE, shares) == state_digest(new)


def test_ranks_that_leave_a_gap_are_refused() -> None:
    regions = [_regions(0), {n: r for n, r in _regions(1).items() if n != "o"}]
    with pytest.raises(TensorMismatch, match="does not cover"):
        owners(TABLE, regions)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_keyframe_range_lands_in_the_part_it_meets(data: Any) -> None:
    """Any range of a keyframe part's flat elements, copied into a rank's part (whole, a row range, a
    column block of the tensor or of a fold): exactly the part's elements of the range land, at
    the places the tensor's own slicing puts them, and nothing else is written."""
    rows, cols, inner = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9)), data.draw(st.integers(1, 3))
    shape = (rows, cols, inner) if inner > 1 else (rows, cols)
    kind = data.draw(st.sampled_from(["whole", "rows", "cols", "fold"]))
    full = torch.arange(rows * cols * inner, dtype=torch.int16).reshape(shape)
    if kind == "whole":
        region, part = Region("whole", 0, rows, shape), full
    elif kind == "fold":  # a fused [E, H, I] down projection's TP part: columns of (E * H, I)
        shape, fold = (rows, cols, inner + 1), (rows * cols, inner + 1)
        full = torch.arange(rows * cols * (inner + 1), dtype=torch.int16).reshape(shape)
        a = data.draw(st.integers(0, inner))
        b = data.draw(st.integers(a + 1, inner + 1))
        region, part = Region("cols", a, b, shape, fold), full.reshape(fold)[:, a:b]
    else:
        n = rows if kind == "rows" else cols
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        region = Region(kind, a, b, shape)
        part = full[a:b] if kind == "rows" else full[:, a:b]
    row = full.numel() // full.shape[0]  # a range spans whole rows and cuts one at either end, or not
    start = data.draw(st.integers(0, full.numel() - 1))
    count = min(full.numel() - start, data.draw(st.integers(0, full.shape[0])) * row + data.draw(st.integers(1, row)))
    pos = data.draw(st.integers(0, 5)) * 2  # the range's byte offset in the part
    raw = bytearray(pos) + bytearray(full.reshape(-1)[start : start + count].numpy().tobytes())
    spec = TensorSpec("w", "bfloat16", shape)
    view = torch.full(tuple(part.shape), -1, dtype=torch.int16).view(torch.bfloat16)
    _copy_ranges([("w", start, count, pos)], raw, {"w": spec}, {"w": view}, {"w": region})
    got = view.view(torch.int16)
    inside = (part >= start) & (part < start + count)  # the part's elements the range holds (the values are their flat positions)
    assert torch.equal(got[inside], part[inside])
    assert bool((got[~inside] == -1).all())
