"""Shards of a state as element ranges: from DTensors or plain row shards, checked for coverage.

A dim-0 (row) shard of a row-major tensor is one contiguous range of its flattened elements, so a
shard is described by its tensor's global :class:`TensorSpec` and its first element. This module
turns FSDP2/DTensor parameters and plain ``(local, global shape, row offset)`` triples into that
form, checks that ranges from every rank cover each tensor exactly once, and writes keyframe parts
(docs/FORMAT.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from deltarl.codec.tensors import DTYPES, TensorSpec, dtype_of
from deltarl.errors import IntegrityError, TensorMismatch, UnsupportedPlacement

Rows = dict[str, tuple[TensorSpec, int]]  # name -> (global spec, first element)
TensorRange = tuple[str, int, int]  # (name, first element, count)
PART_BYTES = 512 << 20


def local_rows(tensors: Mapping[str, tuple[Any, Sequence[int], int]]) -> tuple[dict[str, Any], Rows]:
    """``name -> (local tensor, global shape, row offset)`` as local tensors and their rows."""
    local: dict[str, Any] = {}
    rows: Rows = {}
    for name, item in tensors.items():
        if not isinstance(item, tuple) or len(item) != 3:
            raise TensorMismatch(f"tensor {name!r}: expected (local tensor, global shape, row offset)")
        value, shape, offset = item
        shape = tuple(int(d) for d in shape)
        have = tuple(int(d) for d in value.shape)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise TensorMismatch(f"tensor {name!r}: row offset must be an int >= 0, got {offset!r}")
        if not shape:  # a scalar: one rank holds it (offset 0, shape ()), the others pass an empty tensor
            if have not in ((), (0,)) or offset:
                raise TensorMismatch(f"tensor {name!r}: a scalar shard is the scalar itself or empty, got {list(have)}")
        elif len(have) != len(shape) or have[1:] != shape[1:] or offset + have[0] > shape[0]:
            raise TensorMismatch(
                f"tensor {name!r}: local shape {list(have)} at row {offset} is not a row shard of {list(shape)}"
            )
        spec = TensorSpec(name, dtype_of(name, value), shape)
        row = math.prod(shape[1:]) if shape else 1
        local[name] = value
        rows[name] = (spec, offset * row)
    return local, rows


def _width(spec: TensorSpec) -> int:
    return DTYPES[spec.dtype][1] // 8


def numel(value: Any) -> int:
    return math.prod(int(d) for d in value.shape)


def dtensor_rows(model: Any, rank_of_group: int, world: int) -> tuple[dict[str, Any], Rows]:
    """The BF16 CPU export of this rank's share of every parameter of ``model`` (no gather).

    DTensor parameters must be placed ``Shard(0)`` or ``Replicate()`` on every mesh dimension; a
    replicated dimension is published by its coordinate-0 ranks only. Plain tensors (replicated on
    every rank) are split by rows among the ranks of the publisher's group.
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local: dict[str, Any] = {}
    rows: Rows = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(int(d) for d in p.shape)
            if isinstance(p, DTensor):
                mesh, placements = p.device_mesh, p.placements
                for dim, pl in enumerate(placements):
                    if not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0 and type(pl) is Shard)):
                        raise UnsupportedPlacement(
                            f"parameter {name!r}: placement {pl!r} on mesh dimension {dim} is not a row shard; "
                            "redistribute it to Shard(0) (or Replicate) before publishing"
                        )
                local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
                coord = mesh.get_coordinate()
                owner = coord is not None and all(
                    c == 0 for c, pl in zip(coord, placements, strict=True) if isinstance(pl, Replicate)
                )
                t = p.to_local()
                start = int(offset[0]) if shape else 0
                if not owner:
                    t = t[:0] if shape else t.reshape(-1)[:0]
                elif tuple(t.shape) != tuple(local_shape):
                    t = t[: local_shape[0]] if shape else t
            else:
                t, start = _split_rows(p, rank_of_group, world)
            value = t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True).contiguous()
            spec = TensorSpec(name, "bfloat16", shape)
            rows[name] = (spec, start * (math.prod(shape[1:]) if shape else 1))
            local[name] = value
    return local, rows


def _split_rows(p: Any, rank: int, world: int) -> tuple[Any, int]:
    """Rank ``rank``'s rows of a tensor every rank holds whole (like ``torch.chunk``)."""
    if p.dim() == 0:
        return (p if rank == 0 else p.reshape(-1)[:0]), 0
    per = -(-p.shape[0] // world)
    start = min(per * rank, p.shape[0])
    stop = min(start + per, p.shape[0])
    return p[start:stop], start


def check_cover(table: Sequence[TensorSpec], ranges: Iterable[TensorRange], what: str) -> None:
    """IntegrityError unless ``ranges`` cover every element of every tensor of ``table`` exactly once."""
    numels = {spec.name: spec.numel for spec in table}
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name in numels}
    for name, start, count in ranges:
        if name not in spans:
            raise IntegrityError(f"{what}: tensor {name!r} is not in the run's tensor table")
        if count:
            spans[name].append((start, count))
    for name, items in spans.items():
        pos = 0
        for start, count in sorted(items):
            if start != pos:
                kind = "overlap" if start < pos else "gap"
                raise IntegrityError(f"{what}: {kind} in {name!r} at element {min(start, pos)}")
            pos = start + count
        if pos != numels[name]:
            raise IntegrityError(f"{what}: {name!r} covered up to element {pos} of {numels[name]}")


def held_ranges(local: Mapping[str, Any], rows: Rows) -> list[TensorRange]:
    """The element ranges this rank holds, in name order (empty shards left out)."""
    return [(name, rows[name][1], numel(local[name])) for name in sorted(rows) if numel(local[name])]


def plan_local_parts(local: Mapping[str, Any], rows: Rows, part_bytes: int = PART_BYTES) -> list[list[TensorRange]]:
    """This rank's keyframe parts: its held ranges cut at tensor boundaries into ~``part_bytes`` parts."""
    parts: list[list[TensorRange]] = []
    current: list[TensorRange] = []
    fill = 0
    for name, start, count in held_ranges(local, rows):
        nbytes = count * _width(rows[name][0])
        if current and fill + nbytes > part_bytes:
            parts.append(current)
            current, fill = [], 0
        current.append((name, start, count))
        fill += nbytes
    if current:
        parts.append(current)
    return parts


def iter_local_part(local: Mapping[str, Any], rows: Rows, ranges: Sequence[TensorRange], chunk: int = 8 << 20) -> Iterator[memoryview]:
    """The bytes of one keyframe part (docs/FORMAT.md) of this rank's rows: the header, then
    zero-copy views of the local tensors (``ranges`` hold global element positions)."""
    from deltarl.codec.tensors import flat_bits
    from deltarl.pipeline.keyframe import part_header

    specs = {name: rows[name][0] for name, _, _ in ranges}
    yield memoryview(part_header(ranges, specs))
    for name, start, count in ranges:
        view = flat_bits(name, local[name]).data.cast("B")
        size = _width(rows[name][0])
        lo = (start - rows[name][1]) * size
        for a in range(lo, lo + count * size, chunk):
            yield view[a : min(a + chunk, lo + count * size)]
