"""Reading a trainer's weights out of vLLM's ``WeightSource``, whichever data model it has.

vLLM 0.32's source is iterable (``for name, t in source``, each a full tensor; ``metadata()`` a
method). From 0.33 on it is not: ``iter_full()`` yields the full tensor of each name a rank owns,
``iter_local()`` that rank's piece, ``owned_names(rank)`` says which, ``metadata`` is a
``cached_property`` and each ``ParamMeta`` carries ``owners`` / ``mesh_shape`` / ``placements``
(``Replicate`` / ``Shard(dim)``). Nothing here imports vLLM: both models are read by their shape.

Every function that iterates a source must be called on every trainer rank (materializing a
parameter is a collective among its owners).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deltarl.errors import IntegrationError

#: ``name -> (local BF16 rows, global shape, first row)``: what ``ShardedPublisher.publish_local`` takes
RowShards = dict[str, tuple[Any, tuple[int, ...], int]]


def is_split(source: Any) -> bool:
    """True for the 0.33+ data model (``iter_full`` / ``iter_local``, no ``__iter__``)."""
    return callable(getattr(source, "implements_iter_full", None))


def metadata(source: Any) -> list[Any]:
    """The source's ``ParamMeta`` list (a method on 0.32, a cached property from 0.33)."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def _bf16(t: Any) -> Any:
    import torch

    # a copy: the publisher keeps it as the next base, and the trainer goes on writing its own
    return t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True).contiguous()


def full_state(source: Any) -> dict[str, Any]:
    """Every name this rank iterates, as a full CPU BF16 tensor (0.32: iteration, where a rank that
    does not hold a name yields ``None`` for it; 0.33+: ``iter_full``)."""
    if is_split(source):
        if not source.implements_iter_full():
            raise IntegrationError(f"{type(source).__name__} implements neither iter_full nor a row-sharded iter_local")
        items = source.iter_full()
    else:
        items = iter(source)
    return {name: _bf16(t) for name, t in items if t is not None}


def _is_row_shard(placement: Any) -> bool:
    return type(placement).__name__ == "Shard" and getattr(placement, "dim", None) == 0


def _is_replicate(placement: Any) -> bool:
    return type(placement).__name__ == "Replicate"


def row_shardable(metas: Sequence[Any]) -> bool:
    """Whether every parameter's layout is one ``ShardedPublisher`` publishes from ``iter_local``
    pieces as they are: owned whole, or split by rows (``Shard(0)``) along at most one mesh axis."""
    for m in metas:
        placements = getattr(m, "placements", None)
        if placements is None:
            continue  # whole on each owner (replicated, or gathered by iter_local)
        if any(not (_is_row_shard(p) or _is_replicate(p)) for p in placements):
            return False
        if sum(1 for p in placements if _is_row_shard(p)) > 1:
            return False
    return True


def _empty(shape: tuple[int, ...]) -> Any:
    import torch

    return torch.empty((0, *shape[1:]) if shape else (0,), dtype=torch.bfloat16)


def _split_rows(t: Any, shape: tuple[int, ...], rank: int, world: int) -> tuple[Any, int]:
    """Rank ``rank``'s rows of a tensor every rank holds whole (``torch.chunk``'s split)."""
    if not shape:
        return (t if rank == 0 else _empty(shape)), 0
    per = -(-shape[0] // world)
    start = min(per * rank, shape[0])
    return t[start:min(start + per, shape[0])], start


def _share(meta: Any, t: Any, rank: int, world: int, *, whole: bool) -> tuple[Any, int]:
    """This rank's rows of ``meta``'s tensor and their first row; ``whole``: ``t`` is the full
    tensor (``iter_full``, or a layout ``iter_local`` gathers)."""
    shape = tuple(int(d) for d in meta.shape)
    owners = getattr(meta, "owners", None)
    if t is None:
        return _empty(shape), 0
    if owners is None:  # every rank holds it: each publishes a slice of its rows
        return _split_rows(t, shape, rank, world)
    index = list(owners).index(rank)
    placements = getattr(meta, "placements", None)
    if whole or placements is None:
        return (t if index == 0 else _empty(shape)), 0
    coord = _unravel(index, tuple(meta.mesh_shape))
    if any(c for c, p in zip(coord, placements, strict=True) if _is_replicate(p)):
        return _empty(shape), 0  # a replica: its coordinate-0 twin publishes these rows
    axis = next(a for a, p in enumerate(placements) if _is_row_shard(p))
    per = -(-shape[0] // meta.mesh_shape[axis])
    start = min(per * coord[axis], shape[0])
    if int(t.shape[0]) != min(per, shape[0] - start):
        raise IntegrationError(
            f"parameter {meta.name!r}: rank {rank}'s local piece has {int(t.shape[0])} rows where Shard(0) over "
            f"{meta.mesh_shape[axis]} ranks gives it {min(per, shape[0] - start)}"
        )
    return t, start


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def row_shards(source: Any, rank: int, world: int) -> RowShards:
    """This rank's rows of every parameter (0.33+ sources; every rank calls it): its ``iter_local``
    pieces where the layouts are row shards, else its ``iter_full`` tensors published by each
    parameter's first owner. Every name is present on every rank (empty rows where it holds none)."""
    metas = metadata(source)
    local = source.implements_iter_local() and row_shardable(metas)
    if not local and not source.implements_iter_full():
        raise IntegrationError(f"{type(source).__name__}: iter_local pieces that are not row shards, and no iter_full")
    pieces = {name: _bf16(t) for name, t in (source.iter_local() if local else source.iter_full())}
    out: RowShards = {}
    for meta in metas:
        part, start = _share(meta, pieces.get(meta.name), rank, world, whole=not local)
        out[meta.name] = (part, tuple(int(d) for d in meta.shape), start)
    return out

