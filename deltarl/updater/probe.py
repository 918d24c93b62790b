"""Checkpoint (Hugging Face) tensor names → the part of each one this rank's engine parameters hold,
found by the engine's own ``load_weights`` instead of a table per architecture.

:func:`derive_views` feeds the model's ``load_weights`` probe tensors and reads back where every
element landed, in two or three passes over the run's tensor table (each costs one load of the
model; every code written is a finite, normal number in both BF16 and FP16, :data:`_CODES`):

1. tensor *i* filled with code *i*, every parameter first filled with a sentinel: each checkpoint
   tensor lands as one contiguous block of one parameter, or nowhere on this rank (an expert
   another expert-parallel rank holds);
2. (and 3.) each element filled with its checkpoint index, one base-:data:`_M` digit a pass (the
   high digit only when some tensor has more than :data:`_M` elements): the block's first element
   names where the rank's part starts, and every element of the block is checked against the
   layout that start implies.

The part is a :class:`Region` of the checkpoint tensor: whole, a row range along dim 0
(column-parallel layers: q/k/v, gate/up, a vocabulary-parallel embedding or LM head, replicated KV
heads, an expert's gate/up rows inside a fused ``w13``, the experts an expert-parallel rank holds of
a fused experts tensor) or a column block along dim 1 (row-parallel layers: ``o_proj``,
``down_proj``, an expert's ``w2``: a strided block of the checkpoint, contiguous in the parameter),
of the tensor or of a *fold* of it (the same elements in the same order, seen in another shape): a
tensor-parallel rank's part of a fused experts tensor (``[E, 2I, H]`` gate/up: columns of
``(2E, I, H)``, each expert's gate half then its up half; ``[E, H, I]`` down: columns of
``(E * H, I)``). Each held tensor is then a *view* of the live parameter shaped like the rank's
part: decoding reads old values there and the commit writes there, so deltarl keeps no host copy of
the model. Whatever fusing and sharding the engine does, its loader did it during the probe; a
layout no region expresses (transposed, permuted, repacked, split over two blocks) is refused with a
``TensorMismatch`` naming the tensor. The cost is linear in the model's elements and the number of
tensors (no name matching).

The probe writes every 16-bit parameter; the served values are copied aside first and put back
before :func:`derive_views` returns or raises, so a failure after it (a run that does not load)
leaves the engine serving what it served.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltarl.errors import TensorMismatch

if TYPE_CHECKING:
    import torch

    from deltarl.codec.tensors import TensorSpec

_SENTINEL = -1  # 0xFFFF: a NaN in BF16 and FP16, never a code
_FOLD_PIECES = 8  # pieces a dimension may be cut into by a fold (fused gate/up: 2)
_CHUNK = 1 << 24  # elements a scan reads at once (bounded temporaries)

LoadWeights = Callable[[Iterable[tuple[str, "torch.Tensor"]]], Any]


@functools.lru_cache(maxsize=1)
def _code_table() -> Any:
    """The int16 bit patterns that are finite normal numbers in BF16 and in FP16, ascending."""
    import numpy as np

    b = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bf, f16 = (b >> 7) & 0xFF, (b >> 10) & 0x1F
    return b[(bf != 0) & (bf != 0xFF) & (f16 != 0) & (f16 != 0x1F)].view(np.int16)


_M = 61440  # len(_code_table()): tensors the first pass tells apart, and the digit base


@dataclass(frozen=True)
class Region:
    """The part of a checkpoint tensor one rank holds: ``kind`` ``"whole"``, ``"rows"`` (dim-0 range
    ``[start, stop)``) or ``"cols"`` (dim-1 range ``[start, stop)``, every row). ``fold``: the shape,
    in the tensor's own row-major order, that a ``"cols"`` range is taken in (None: the tensor's own):
    a fused experts tensor ``[E, 2I, H]`` split by tensor parallel is ``(2E, I, H)`` (every expert's
    gate rows, then its up rows), a fused ``[E, H, I]`` is ``(E * H, I)``."""

    kind: str
    start: int
    stop: int
    shape: tuple[int, ...]
    fold: tuple[int, ...] | None = None

    @property
    def grid(self) -> tuple[int, int, int]:
        """``(rows, cols, inner)`` of the shape the range is taken in."""
        f = self.fold or self.shape
        return (f[0] if f else 1), (f[1] if len(f) > 1 else 1), _row(f[1:]) if len(f) > 1 else 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.kind == "rows":
            return (self.stop - self.start, *self.shape[1:])
        if self.kind == "cols":
            f = self.fold or self.shape
            return (f[0], self.stop - self.start, *f[2:])
        return self.shape

    @property
    def numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n

    def flat_range(self) -> tuple[int, int]:
        """Checkpoint flat elements ``[lo, hi)`` the region lies within (exactly for whole and rows)."""
        row = _row(self.shape)
        if self.kind == "rows":
            return self.start * row, self.stop * row
        if self.kind == "cols":
            rows, cols, inner = self.grid
            return self.start * inner, ((rows - 1) * cols + self.stop) * inner
        return 0, self.numel


def _row(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[1:]:
        n *= d
    return n


@dataclass(frozen=True)
class Placement:
    """Where this rank's part of one checkpoint tensor lives: ``region`` of it, as ``numel`` elements
    of parameter ``param`` from flat offset ``start`` (``shape`` is the checkpoint tensor's)."""

    name: str
    param: str
    start: int
    numel: int
    shape: tuple[int, ...]
    region: Region


def _torch_dtype(spec: TensorSpec) -> torch.dtype:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(spec.dtype) or _unsupported(spec)


def _unsupported(spec: TensorSpec) -> Any:
    raise TensorMismatch(f"{spec.name}: deltarl's in-place updater serves 16-bit float tensors, the run has {spec.dtype}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().view(-1).view(torch.int16)


def _probe(specs: Sequence[TensorSpec], fill: Callable[[int, TensorSpec], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """One probe tensor at a time (never the whole model at once), in the checkpoint's dtype and shape."""
    for i, spec in enumerate(specs):
        yield spec.name, fill(i, spec).view(_torch_dtype(spec)).reshape(tuple(spec.shape))


def _digits(index: torch.Tensor, digit: int) -> torch.Tensor:
    """Codes of one base-_M digit of int64 checkpoint indices."""
    return _torch_codes()[(index // (_M**digit)) % _M]


@functools.lru_cache(maxsize=1)
def _torch_codes() -> torch.Tensor:
    import torch

    return torch.from_numpy(_code_table())


def _runs(bits: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(value, start, length)`` of each run of equal values of a flat int16 tensor, sentinel runs left out."""
    import torch

    out: list[tuple[int, int, int]] = []
    n = bits.numel()
    for a in range(0, n, _CHUNK):
        chunk = bits[a : min(n, a + _CHUNK)]
        cuts = (torch.nonzero(chunk[1:] != chunk[:-1]).view(-1) + 1).tolist()
        starts = [0, *cuts]
        ends = [*cuts, chunk.numel()]
        for s, e in zip(starts, ends, strict=True):
            value = int(chunk[s])
            if out and out[-1][0] == value and out[-1][1] + out[-1][2] == a + s:
                out[-1] = (value, out[-1][1], out[-1][2] + e - s)  # a run across a chunk boundary
            else:
                out.append((value, a + s, e - s))
    return [r for r in out if r[0] != _SENTINEL]


def _region_indices(region: Region, a: int, b: int) -> torch.Tensor:
    """Checkpoint flat indices of the region's local elements ``[a, b)`` (int64)."""
    import torch

    k = torch.arange(a, b, dtype=torch.int64)
    if region.kind == "cols":
        _, cols, inner = region.grid
        w = (region.stop - region.start) * inner  # the local elements of one row
        return (k // w) * (cols * inner) + region.start * inner + k % w
    return k + (region.start * _row(region.shape) if region.kind == "rows" else 0)


def _candidates(spec: TensorSpec, first: int, length: int) -> Iterator[Region]:
    """The regions whose first element is checkpoint index ``first`` and that hold ``length`` elements:
    whole, a row range, then a column range of the tensor or of one of its folds (dim ``k`` cut into
    ``m`` equal pieces, everything before the last piece's columns counted as rows): ``(d0 * m, d1 / m,
    ...)`` for fused gate/up experts, ``(d0 * d1, d2)`` for a fused ``w2``. A few per tensor, each
    checked element by element by the caller."""
    shape = tuple(spec.shape)
    row = _row(shape) if shape else 1
    if first == 0 and length == spec.numel:
        yield Region("whole", 0, shape[0] if shape else 1, shape)
    elif shape and first % row == 0 and length % row == 0 and first + length <= spec.numel:
        yield Region("rows", first // row, first // row + length // row, shape)
    for k in range(1, len(shape)):
        inner = _row(shape[k:])  # elements of one index of dim k
        for m in (d for d in range(1, min(shape[k], _FOLD_PIECES) + 1) if shape[k] % d == 0):
            cols = shape[k] // m
            rows = spec.numel // (cols * inner) if cols * inner else 0
            if not rows or first % inner or length % (rows * inner):
                continue
            a, w = first // inner, length // (rows * inner)
            if 0 < w < cols and a + w <= cols:
                fold = (rows, cols, *shape[k + 1 :])
                yield Region("cols", a, a + w, shape, None if fold == shape else fold)


def _matches(block: torch.Tensor, region: Region, digit: int) -> bool:
    """Whether ``block`` (a parameter's flat int16 bits) holds digit ``digit`` of the region's indices."""
    import torch

    n = block.numel()
    return all(torch.equal(block[a : min(n, a + _CHUNK)], _digits(_region_indices(region, a, min(n, a + _CHUNK)), digit))
               for a in range(0, n, _CHUNK))


def _index_fill(digit: int) -> Callable[[int, TensorSpec], torch.Tensor]:
    def fill(i: int, spec: TensorSpec) -> torch.Tensor:
        import torch

        out = torch.empty(spec.numel, dtype=torch.int16)
        for a in range(0, spec.numel, _CHUNK):  # chunk by chunk: the probe is the only tensor-sized buffer
            b = min(spec.numel, a + _CHUNK)
            out[a:b] = _digits(torch.arange(a, b, dtype=torch.int64), digit)
        return out

    return fill


def _tag_pass(load_weights: LoadWeights, wide: dict[str, torch.Tensor], specs: Sequence[TensorSpec],
              sharded: bool) -> list[tuple[str, int, int] | None]:
    """Pass 1: the block each tensor lands on (``(param, start, length)``), None where none."""
    import torch

    codes = torch.from_numpy(_code_table())
    index = {int(c): i for i, c in enumerate(codes[: len(specs)].tolist())}
    load_weights(_probe(specs, lambda i, spec: codes[i].expand(spec.numel).clone()))
    found: dict[int, list[tuple[str, int, int]]] = {}
    for pname, p in wide.items():
        for value, start, length in _runs(_bits(p)):
            if value in index:
                found.setdefault(index[value], []).append((pname, start, length))
    blocks: list[tuple[str, int, int] | None] = []
    for i, spec in enumerate(specs):
        pieces = found.get(i, [])
        if len(pieces) != 1 and (pieces or not sharded):
            where = ", ".join(f"{n}[{s}:{s + ln}]" for n, s, ln in pieces[:4]) or "nowhere"
            raise TensorMismatch(
                f"{spec.name} ({spec.numel} elements) lands in {len(pieces)} piece(s) of the engine's parameters ({where}): "
                "deltarl's in-place path needs each checkpoint tensor held as one contiguous block of one parameter")
        blocks.append(pieces[0] if pieces else None)
    return blocks


def _fill_sentinel(wide: dict[str, torch.Tensor]) -> None:
    for p in wide.values():
        _bits(p).fill_(_SENTINEL)


def _locate(load_weights: LoadWeights, wide: dict[str, torch.Tensor], specs: Sequence[TensorSpec],
            sharded: bool) -> list[Placement]:
    blocks = _tag_pass(load_weights, wide, specs, sharded)
    biggest = max((s.numel for s in specs), default=0)
    if biggest > _M * _M:
        raise TensorMismatch(f"a tensor of {biggest} elements: past what the probe's index digits tell apart ({_M * _M})")
    decode = {int(c): i for i, c in enumerate(_code_table().tolist())}
    firsts = [0] * len(specs)
    placements = []
    for digit in (1, 0) if biggest > _M else (0,):  # the high digit first: the low pass then knows each start
        _fill_sentinel(wide)
        load_weights(_probe(specs, _index_fill(digit)))
        for i, (spec, block) in enumerate(zip(specs, blocks, strict=True)):
            if block is None:
                continue
            flat = _bits(wide[block[0]])[block[1] : block[1] + block[2]]
            firsts[i] += decode.get(int(flat[0]), 0) * _M**digit
            if digit:
                continue
            # every element's low digit checked against each layout the block's first element allows
            region = next((r for r in _candidates(spec, firsts[i], block[2]) if _matches(flat, r, 0)), None)
            if region is None:
                raise TensorMismatch(f"{spec.name}: the engine's loader reorders its elements inside {block[0]} "
                                     "(transposed or repacked): not an in-place view")
            if region.kind != "whole" and not sharded:
                raise TensorMismatch(f"{spec.name}: this engine holds {region.kind} [{region.start}, {region.stop}) "
                                     "of it; a partial tensor needs the sharded updater (tensor or expert parallel ranks)")
            placements.append(Placement(spec.name, block[0], block[1], block[2], tuple(spec.shape), region))
    return placements


def derive_views(
    load_weights: LoadWeights, params: dict[str, torch.Tensor], specs: Sequence[TensorSpec], *, sharded: bool = False
) -> tuple[dict[str, torch.Tensor], list[Placement]]:
    """Views of ``params`` (the model's live parameters) by checkpoint name, for the tensors of
    ``specs`` (the run's tensor table) this rank holds, found by probing ``load_weights``; each view
    is shaped like the rank's part (:attr:`Placement.region`). ``sharded``: this rank may hold part
    of a tensor or none of it (tensor or expert parallel); otherwise every tensor must land whole.
    The parameters hold their served values again when this returns or raises.

    Raises:
        TensorMismatch: a tensor the loader drops (unsharded), splits, reorders or duplicates, or
            that two checkpoint tensors share (naming it).
    """
    import torch

    if len(specs) > _M:
        raise TensorMismatch(f"{len(specs)} tensors: the probe tells at most {_M} apart")
    wide = {n: p for n, p in params.items() if p.dtype in (torch.bfloat16, torch.float16) and p.is_contiguous()}
    with torch.no_grad():
        saved = {n: p.detach().to("cpu", copy=True) for n, p in wide.items()}  # put back whatever happens
        try:
            placements = _locate(load_weights, wide, specs, sharded)
        finally:
            for n, p in wide.items():
                p.detach().copy_(saved.pop(n))
    # detached: writes reach the parameters' memory, autograd never sees them (vLLM's may require grad)
    views = {pl.name: wide[pl.param].detach().view(-1)[pl.start : pl.start + pl.numel].view(pl.region.local_shape)
             for pl in placements}
    return views, placements
