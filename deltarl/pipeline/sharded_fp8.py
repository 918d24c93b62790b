"""The FP8 serving state of a sharded publish (``serve_as="fp8-block128"``): every rank quantizes its
own rows, and the ranks together publish the bits :class:`Publisher` publishes for the gathered state.

A block's scale needs the largest ``|x|`` of its 128 rows, which ranks may split (any split: not
aligned to 128, uneven, empty shards). Per version, collective over the publisher's group:

1. every rank computes its share of the block maxima of every quantized weight (the block rows
   its rows touch; zeros elsewhere, which never raise a maximum of absolute values) into one flat
   float32 buffer laid out by the sorted weight names;
2. one ``all_reduce(MAX)`` of a small int64 header: which ranks failed before quantizing, and the
   buffer's size and a hash of the quantized weights' names and shapes, so ranks that disagree stop
   before the buffers meet;
3. one ``all_reduce(MAX)`` of the buffers (4 bytes per 128x128 block of every quantized weight,
   1/8192 of their BF16 bytes: 344 KB at Qwen3-1.7B). The maximum is exact, so every rank holds
   the single-process block maxima and turns them into the same scales
   (:func:`~deltarl.codec.fp8.block_scales`);
4. each rank quantizes its own rows under those scales (:func:`~deltarl.codec.fp8.quantize_rows`)
   and publishes them as a row shard of ``<w>.weight`` (``float8_e4m3fn``); the scale row of block
   row ``i`` is published by the rank holding row ``128 i`` (rows ``ceil(lo/128) .. ceil(hi/128)``
   of ``<w>.weight_scale_inv`` for a rank holding rows ``lo .. hi``), so every element of both is
   published exactly once.

A rank that fails before or while quantizing fails the version on every rank like any other rank
failure (no manifest, no base moves); the other ranks name the ranks that failed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

from deltarl.codec.fp8 import BLOCK, SCALE_SUFFIX, block_amax, block_scales, quantize_rows, quantizes
from deltarl.codec.tensors import TensorSpec
from deltarl.errors import RunError, TensorMismatch
from deltarl.pipeline import shard_rows as sr
from deltarl.pipeline.shard_messages import Collectives

#: (name, rows, cols, first row held, first block maximum in the flat buffer) of one quantized weight
Plan = tuple[str, int, int, int, int]


def plan_fp8(local: Mapping[str, Any], rows: sr.Rows) -> tuple[list[Plan], int]:
    """The quantized weights of this rank's shard in name order, and the block maxima they take."""
    plan: list[Plan] = []
    size = 0
    for name in sorted(rows):
        spec, start = rows[name]
        if not quantizes(name, spec.shape):
            continue
        if name + SCALE_SUFFIX in rows:
            raise TensorMismatch(f"tensor {name + SCALE_SUFFIX!r} is already in the state: is it quantized already?")
        r, c = spec.shape
        if start % c or tuple(local[name].shape) != (sr.numel(local[name]) // c, c):
            raise TensorMismatch(f"tensor {name!r}: FP8 needs a row shard, got {list(local[name].shape)} at element {start}")
        plan.append((name, r, c, start // c, size))
        size += math.ceil(r / BLOCK) * math.ceil(c / BLOCK)
    return plan, size


def _signature(plan: list[Plan]) -> int:
    text = repr([(name, r, c) for name, r, c, _, _ in plan]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


def _all_max(comm: Collectives, t: Any) -> Any:
    """``all_reduce(MAX)`` of a CPU tensor over the group (through the CUDA device on NCCL)."""
    import torch

    backend = str(comm.dist.get_backend(comm.group))
    if "gloo" in backend or not torch.cuda.is_available():
        comm.dist.all_reduce(t, op=comm.dist.ReduceOp.MAX, group=comm.group)
        return t
    d = t.to(torch.device("cuda", torch.cuda.current_device()))
    comm.dist.all_reduce(d, op=comm.dist.ReduceOp.MAX, group=comm.group)
    return d.cpu()


def _partial_amax(local: Mapping[str, Any], plan: list[Plan], size: int) -> Any:
    import torch

    amax = torch.zeros(size, dtype=torch.float32)
    for name, _, c, lo, at in plan:
        w = local[name]
        if not sr.numel(w):
            continue
        cb = math.ceil(c / BLOCK)
        part = block_amax(w.detach(), row0=lo).cpu()
        b0 = lo // BLOCK
        block_scales(name, part)  # NaN/Inf in this rank's rows: refused here (a NaN would not survive MAX)
        amax[at + b0 * cb : at + (b0 + part.shape[0]) * cb] = part.reshape(-1)
    return amax


def reduce_block_maxima(comm: Collectives, local: Mapping[str, Any] | None, rows: sr.Rows | None,
                        early: Exception | None) -> tuple[list[Plan], Any, Exception | None]:
    """Collective: every quantized weight's whole block maxima on every rank (steps 1-3), or the
    error that fails the version on this rank. ``early``: this rank already failed (it still joins)."""
    import torch

    plan: list[Plan] = []
    amax = None
    size = sig = 0
    if early is None:
        assert local is not None
        assert rows is not None
        try:
            plan, size = plan_fp8(local, rows)
            sig = _signature(plan)
            amax = _partial_amax(local, plan, size)
        except Exception as err:
            early = err
    header = torch.zeros(4 + comm.world, dtype=torch.int64)
    header[:4] = torch.tensor([size, -size, sig, -sig])
    header[4 + comm.rank] = early is not None
    header = _all_max(comm, header)
    failed = [r for r in range(comm.world) if header[4 + r]]
    if early is not None:
        return [], None, early
    if failed:
        ranks = ", ".join(map(str, failed))
        return [], None, RunError(f"FP8 block scales not reduced: rank{'s' if len(failed) > 1 else ''} {ranks} failed")
    if header[0] != -header[1] or header[2] != -header[3]:
        return [], None, RunError("FP8 block scales not reduced: ranks disagree on the quantized weights "
                                  "(names or global shapes)")
    return plan, _all_max(comm, amax), None


def quantize_shard(local: Mapping[str, Any], rows: sr.Rows, plan: list[Plan], amax: Any, owned: bool
                   ) -> tuple[dict[str, Any], sr.Rows]:
    """This rank's shard of the FP8 serving state (step 4): its codes and its scale rows of every
    quantized weight, every other tensor as it is (copied unless ``owned``)."""
    import torch

    quantized = {p[0] for p in plan}  # replaced by their codes below: never copied
    out = {name: v if owned or name in quantized else v.detach().clone() for name, v in local.items()}
    out_rows = dict(rows)
    for name, r, c, lo, at in plan:
        cb = math.ceil(c / BLOCK)
        nb = math.ceil(r / BLOCK)
        scale = block_scales(name, amax[at : at + nb * cb].view(nb, cb))
        w = local[name]
        hi = lo + w.shape[0]
        out[name] = quantize_rows(w, scale, row0=lo) if hi > lo else torch.empty((0, c), dtype=torch.float8_e4m3fn)
        out_rows[name] = (TensorSpec(name, "float8_e4m3fn", (r, c)), lo * c)
        s0, s1 = -(-lo // BLOCK), -(-hi // BLOCK)  # block rows whose first row this rank holds
        scale_name = name + SCALE_SUFFIX
        out[scale_name] = scale[s0:s1].clone()
        out_rows[scale_name] = (TensorSpec(scale_name, "float32", (nb, cb)), s0 * cb)
    return out, out_rows

