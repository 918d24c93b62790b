"""Fused experts tensors (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``, as
transformers writes Qwen3-MoE) on tensor- and expert-parallel ranks, loaded the way vLLM's FusedMoE
loader narrows them (``_load_w13``: each of gate and up narrowed along dim 1 into the two halves of
``w13``; ``_load_w2``: narrowed along dim 2; expert parallel: the rank's experts only): the probe maps
each rank's part as a column range of a fold, deltas stage into it, the ranks' digests join."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deltarl.codec import encode_delta, state_digest  # noqa: E402
from deltarl.codec.tensors import TensorSpec  # noqa: E402
from deltarl.errors import RegionError  # noqa: E402
from deltarl.pipeline.shard_digest import combine_digest  # noqa: E402
from deltarl.updater.probe import derive_views  # noqa: E402
from deltarl.updater.shards import _local_positions, digest_shares, owners, stage_regions  # noqa: E402

E, INTER, H, RANKS = 4, 64, 256, 2
TABLE = [TensorSpec("down", "bfloat16", (E, H, INTER)), TensorSpec("gate_up", "bfloat16", (E, 2 * INTER, H))]


def _loader(params: dict[str, Any], rank: int, ep: bool) -> Any:
    """vLLM's FusedMoE weight loader for full (3-D) fused checkpoint tensors, one rank of two."""
    p = INTER // RANKS

    def load(weights: Iterable[tuple[str, Any]]) -> None:
        for name, t in weights:
            if ep:  # a rank holds its experts whole
                params["w13" if name == "gate_up" else "w2"].copy_(t[rank * E // RANKS : (rank + 1) * E // RANKS])
            elif name == "gate_up":
                gate, up = t.chunk(2, dim=1)
                params["w13"][:, :p].copy_(gate.narrow(1, rank * p, p))
                params["w13"][:, p:].copy_(up.narrow(1, rank * p, p))
            else:
                params["w2"].copy_(t.narrow(2, rank * p, p))

    return load


def _params(ep: bool) -> dict[str, Any]:
    e, p = (E // RANKS, INTER) if ep else (E, INTER // RANKS)
    return {"w13": torch.zeros(e, 2 * p, H, dtype=torch.bfloat16), "w2": torch.zeros(e, H, p, dtype=torch.bfloat16)}


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=gen).to(torch.bfloat16) for s in TABLE}


def _changed(old: dict[str, Any], fraction: float) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    new = {}
    for n, t in old.items():
        bits = t.clone().view(-1).view(torch.int16)
        bits[torch.randperm(bits.numel(), generator=gen)[: int(bits.numel() * fraction)]] += 1
        new[n] = bits.view(torch.bfloat16).view(t.shape)
    return new


def _ranks(state: dict[str, Any], ep: bool) -> list[tuple[dict[str, Any], dict[str, Any], list[Any]]]:
    """Per rank: its parameters loaded with ``state``, its views and placements."""
    out = []
    for rank in range(RANKS):
        params = _params(ep)
        load = _loader(params, rank, ep)
        views, placements = derive_views(load, params, TABLE, sharded=True)
        load(state.items())
        out.append((params, views, placements))
    return out


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_a_rank_part_of_fused_experts_is_a_view_of_its_parameters(ep: bool) -> None:
    state = _state(0)
    for rank, (params, views, placements) in enumerate(_ranks(state, ep)):
        regions = {p.name: p.region for p in placements}
        if ep:  # the rank's experts: a row range of the tensor itself
            assert {n: (r.kind, r.start, r.stop, r.fold) for n, r in regions.items()} == {
                "gate_up": ("rows", 2 * rank, 2 * rank + 2, None), "down": ("rows", 2 * rank, 2 * rank + 2, None)}
        else:  # columns of a fold: (2E, I, H) for gate/up, (E * H, I) for down
            p = INTER // RANKS
            assert {n: (r.kind, r.start, r.stop, r.fold) for n, r in regions.items()} == {
                "gate_up": ("cols", rank * p, rank * p + p, (2 * E, INTER, H)), "down": ("cols", rank * p, rank * p + p, (E * H, INTER))}
        assert torch.equal(views["gate_up"].reshape(params["w13"].shape), params["w13"])
        assert torch.equal(views["down"].reshape(params["w2"].shape), params["w2"])
        for name, r in regions.items():  # checkpoint flat positions -> the view's, as a keyframe is read
            flat = state[name].reshape(-1).view(torch.int16).numpy()
            inside, local = _local_positions(r, np.arange(flat.size, dtype=np.int64))
            got = np.zeros(views[name].numel(), dtype=np.int16)
            got[local[inside]] = flat[inside]
            assert np.array_equal(got, views[name].reshape(-1).view(torch.int16).numpy())


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_every_rank_stages_its_part_of_a_delta_and_the_digests_join(ep: bool) -> None:
    old = _state(0)
    new = _changed(old, 0.01)
    ranks = _ranks(old, ep)
    segments = encode_delta(old, new, base="v0", codec="auto")
    for _, views, placements in ranks:
        stage_regions(views, placements, TABLE, segments, base="v0").commit()
    for rank, (params, _, _) in enumerate(ranks):
        want = _params(ep)
        _loader(want, rank, ep)(new.items())
        assert all(torch.equal(params[n], want[n]) for n in params)  # the commit wrote the loader's layout
    owned = owners(TABLE, [{p.name: p.region for p in pls} for _, _, pls in ranks])
    shares = [s for (_, views, pls), mine in zip(ranks, owned, strict=True) for s in digest_shares(TABLE, pls, views, mine)]
    assert combine_digest(TABLE, shares) == state_digest(new)


def test_a_cell_chunk_of_a_folded_part_is_refused() -> None:
    """ctx codes each grid cell against the whole cell's base, and the grid cuts dims 0 and 1 of the
    tensor itself: a fold's column range holds part of every cell, which no rank can decode alone."""
    old = _state(0)
    new = _changed(old, 0.01)
    _, views, placements = _ranks(old, ep=False)[0]
    segments = encode_delta(old, new, base="v0", codec="ctx")  # tensors of 64K elements and more: cut into cells
    with pytest.raises(RegionError, match="row-major chunks only"):
        stage_regions(views, placements, TABLE, segments, base="v0")
