"""Reading vLLM 0.33+'s ``WeightSource`` layouts into row shards (deltarl.integrations.vllm.sources):
across all ranks of a mesh, every element of every parameter is published exactly once."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.integrations.vllm import sources  # noqa: E402


@dataclass(frozen=True)
class Replicate:  # vLLM 0.33's placement classes, by name and shape
    pass


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: Any
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    placements: tuple[Any, ...] | None = None


class Source:
    """0.33's data model over whole tensors: each rank's ``iter_local`` is its chunk per the layout."""

    def __init__(self, full: dict[str, Any], metas: list[ParamMeta], rank: int) -> None:
        self.full, self._metas, self.rank = full, metas, rank

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self._metas

    def implements_iter_full(self) -> bool:
        return True

    def implements_iter_local(self) -> bool:
        return True

    def iter_full(self) -> Iterator[tuple[str, Any]]:
        for m in self._metas:
            if m.owners is None or self.rank in m.owners:
                yield m.name, self.full[m.name]

    def iter_local(self) -> Iterator[tuple[str, Any]]:
        for m in self._metas:
            if m.owners is not None and self.rank not in m.owners:
                continue
            t = self.full[m.name]
            if m.placements is None:
                yield m.name, t
                continue
            index = m.owners.index(self.rank) if m.owners else 0
            coord = sources._unravel(index, m.mesh_shape)
            for axis, p in enumerate(m.placements):
                if isinstance(p, Shard):  # torch.chunk's split: trailing ranks may hold nothing
                    chunks = torch.chunk(t, m.mesh_shape[axis], dim=p.dim)
                    t = chunks[coord[axis]] if coord[axis] < len(chunks) else t[:0]
            yield m.name, t


def _published(full: dict[str, Any], metas: list[ParamMeta], world: int) -> dict[str, Any]:
    """Every rank's row shards put back together; each element counted once."""
    out = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in full.items()}
    hits = {n: torch.zeros(t.shape[0] if t.dim() else 1, dtype=torch.int64) for n, t in full.items()}
    for rank in range(world):
        for name, (part, shape, start) in sources.row_shards(Source(full, metas, rank), rank, world).items():
            assert tuple(shape) == tuple(full[name].shape)
            if not shape:
                if part.numel():
                    out[name] = part.reshape(())
                    hits[name][0] += 1
                continue
            rows = int(part.shape[0])
            out[name][start:start + rows] = part
            hits[name][start:start + rows] += 1
    for name, h in hits.items():
        assert bool((h == 1).all()), f"{name}: rows published {h.tolist()} times"
    return out


def test_fsdp_hsdp_replicated_and_plain_layouts_cover_every_row_once() -> None:
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in
            {"fsdp": (5, 3), "hsdp": (7, 2), "replicated": (4, 4), "plain": (3, 5), "scalar": ()}.items()}
    metas = [
        ParamMeta("fsdp", torch.bfloat16, (5, 3), (0, 1, 2, 3), (4,), (Shard(0),)),  # 5 rows over 4: 2, 2, 1, 0
        ParamMeta("hsdp", torch.bfloat16, (7, 2), (0, 1, 2, 3), (2, 2), (Replicate(), Shard(0))),
        ParamMeta("replicated", torch.bfloat16, (4, 4), (2, 3), (2,), None),
        ParamMeta("plain", torch.bfloat16, (3, 5)),
        ParamMeta("scalar", torch.bfloat16, ()),
    ]
    assert sources.row_shardable(metas)
    got = _published(full, metas, 4)
    for name, t in full.items():
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name
    local = sources.row_shards(Source(full, metas, 1), 1, 4)
    assert sum(math.prod(p.shape) for p, _, _ in local.values()) < sum(t.numel() for t in full.values()) // 2


def test_a_column_shard_is_published_whole_by_its_first_owner() -> None:
    full = {"tp": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)}
    metas = [ParamMeta("tp", torch.bfloat16, (3, 4), (0, 1), (2,), (Shard(1),))]
    assert not sources.row_shardable(metas)  # iter_full on every owner, owner 0 publishes it
    got = _published(full, metas, 2)
    assert torch.equal(got["tp"], full["tp"])


def test_the_support_window() -> None:
    from deltarl.integrations.vllm.plugin import check_version

    assert [check_version(v) for v in ("0.32.0", "0.33.0", "0.34.1.dev3+gabc", "0.31.2", "0.35.0", "main")] == \
        [True, True, True, False, False, False]
