"""Checkpoint (Hugging Face) tensor names → the vLLM parameters that hold them, found by vLLM's own
``load_weights`` instead of a table per architecture.

:func:`derive_views` feeds the model's ``load_weights`` probe tensors and reads back where every
element landed, in two passes over the run's tensor table:

1. tensor *i* filled with one BF16 bit pattern of its own, every parameter first filled with a
   sentinel: each checkpoint tensor must land as exactly one contiguous block of one parameter
   (fused ``qkv_proj`` / ``gate_up_proj`` rows, a vocabulary padded past its end: all fine);
2. tensor *i* filled with its element index (mod a prime) as bit patterns: the block must hold the
   elements in their checkpoint order (no transpose, permutation or repacking).

Each checkpoint tensor is then a *view* of the live parameter: decoding reads old values there and
the commit writes there, so deltarl keeps no host copy of the model. Whatever fusing and sharding
vLLM does for the architecture, its loader did it during the probe. A layout the view path cannot
express (tensor parallel row shards, experts repacked by the CPU build) is refused with a
``TensorMismatch`` naming the tensor. The probe overwrites every weight: the engine loads the
run's state into the views right after it (``engine.DeltaRLEngine.init_transfer_engine``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltarl.errors import TensorMismatch

if TYPE_CHECKING:
    import torch

    from deltarl.codec.tensors import TensorSpec

_SENTINEL = -1  # 0xFFFF: a NaN no probe writes
_BASE = 0x3F80  # 1.0: probes are normal, finite BF16 numbers 0x3F80 .. 0x3F80 + 16000
_TAGS = 16000  # tensors the first pass tells apart
_PRIME = 15991  # the second pass: element index mod a prime
_CHUNK = 1 << 24  # elements a scan reads at once (bounded temporaries)

LoadWeights = Callable[[Iterable[tuple[str, "torch.Tensor"]]], Any]


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor lives: ``numel`` elements of parameter ``param`` from flat offset ``start``."""

    name: str
    param: str
    start: int
    numel: int
    shape: tuple[int, ...]


def _torch_dtype(spec: TensorSpec) -> torch.dtype:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(spec.dtype) or _unsupported(spec)


def _unsupported(spec: TensorSpec) -> Any:
    raise TensorMismatch(f"{spec.name}: deltarl's vLLM engine serves 16-bit float tensors, the run has {spec.dtype}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().view(-1).view(torch.int16)


def _probe(specs: Sequence[TensorSpec], fill: Callable[[int, TensorSpec], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """One probe tensor at a time (never the whole model at once), in the checkpoint's dtype and shape."""
    for i, spec in enumerate(specs):
        yield spec.name, fill(i, spec).view(_torch_dtype(spec)).reshape(tuple(spec.shape))


def _tag_fill(i: int, spec: TensorSpec) -> torch.Tensor:
    import torch

    return torch.full((spec.numel,), _BASE + i, dtype=torch.int16)


def _index_pattern(start: int, stop: int) -> torch.Tensor:
    import torch

    return (torch.arange(start, stop, dtype=torch.int32) % _PRIME + _BASE).to(torch.int16)


def _index_fill(i: int, spec: TensorSpec) -> torch.Tensor:
    import torch

    out = torch.empty(spec.numel, dtype=torch.int16)
    for a in range(0, spec.numel, _CHUNK):  # chunk by chunk: the probe is the only model-sized buffer
        b = min(spec.numel, a + _CHUNK)
        out[a:b] = _index_pattern(a, b)
    return out


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


def derive_views(
    load_weights: LoadWeights, params: dict[str, torch.Tensor], specs: Sequence[TensorSpec]
) -> tuple[dict[str, torch.Tensor], list[Placement]]:
    """Views of ``params`` (the model's live parameters) by checkpoint name, for the tensors of
    ``specs`` (the run's tensor table), found by probing ``load_weights``. Overwrites every 16-bit
    parameter; elements no checkpoint tensor lands on (vocabulary padding) are left zero.

    Raises:
        TensorMismatch: a tensor the loader drops, splits, reorders or duplicates, or that two
            checkpoint tensors share (naming it).
    """
    import torch

    if len(specs) > _TAGS:
        raise TensorMismatch(f"{len(specs)} tensors: the probe tells at most {_TAGS} apart")
    wide = {n: p for n, p in params.items() if p.dtype in (torch.bfloat16, torch.float16) and p.is_contiguous()}
    with torch.no_grad():
        for p in wide.values():
            _bits(p).fill_(_SENTINEL)
        load_weights(_probe(specs, _tag_fill))
        found: dict[int, list[tuple[str, int, int]]] = {}
        for pname, p in wide.items():
            for value, start, length in _runs(_bits(p)):
                found.setdefault(value - _BASE, []).append((pname, start, length))
        placements: list[Placement] = []
        for i, spec in enumerate(specs):
            pieces = found.get(i, [])
            candidates = [c for c in pieces if c[2] == spec.numel]
            if len(candidates) != 1:
                where = ", ".join(f"{n}[{s}:{s + ln}]" for n, s, ln in pieces[:4]) or "nowhere"
                raise TensorMismatch(
                    f"{spec.name} ({spec.numel} elements) lands in {len(pieces)} piece(s) of vLLM parameters ({where}): "
                    "deltarl's in-place path needs each checkpoint tensor to be one contiguous block of one "
                    "parameter (tensor-parallel row shards and repacked layouts are not)")
            pname, start, _ = candidates[0]
            placements.append(Placement(spec.name, pname, start, spec.numel, tuple(spec.shape)))
        for p in wide.values():
            _bits(p).fill_(_SENTINEL)
        load_weights(_probe(specs, _index_fill))
        for pl in placements:
            got = _bits(wide[pl.param])[pl.start : pl.start + pl.numel]
            if not all(torch.equal(got[a : a + _CHUNK], _index_pattern(a, min(pl.numel, a + _CHUNK)))
                       for a in range(0, pl.numel, _CHUNK)):
                raise TensorMismatch(f"{pl.name}: vLLM's loader reorders its elements inside {pl.param} "
                                     "(transposed or repacked): not an in-place view")
        for p in wide.values():
            bits = _bits(p)
            for a in range(0, bits.numel(), _CHUNK):
                part = bits[a : a + _CHUNK]
                part.masked_fill_(part == _SENTINEL, 0)
    views = {pl.name: wide[pl.param].view(-1)[pl.start : pl.start + pl.numel].view(pl.shape) for pl in placements}
    return views, placements
