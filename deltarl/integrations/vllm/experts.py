"""MoE experts on vLLM's CPU build: live expert weights deltarl writes, and the packed copy the kernel reads.

After loading, vLLM's CPU build replaces each fused-experts layer's ``w13_weight`` / ``w2_weight``
with a copy repacked for its grouped GEMM (``CPUUnquantizedExperts.process_weights_after_loading``:
the intermediate dim padded to the kernel's alignment, then ``cpu_prepack_moe_weight``), so a write
into those parameters never reaches the kernel as the checkpoint's values. :class:`LiveExperts`
keeps, per such layer, the weights in the layout vLLM's loader writes (``[experts, 2 * inter, hidden]``
and ``[experts, hidden, inter]``, the rank's experts and tensor-parallel slice): the ``load_weights``
probe maps checkpoint tensors onto them (:meth:`LiveExperts.loading`) and the updater writes them.
Packing is per expert and moves 16-bit values without changing them (a permutation, found once per
layer shape by packing index patterns, and checked on random weights): after each commit
:meth:`LiveExperts.mirror` copies just the changed elements into the packed copy at their packed
positions (work in proportion to the changes); a whole-state swap re-packs every expert
(:meth:`LiveExperts.repack`). The cost: one more copy of the rank's expert weights in host memory.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def _packed_positions(kernel_isa: str, rows: int, cols: int) -> Any:
    """For one expert's ``[rows, cols]`` block: the packed flat position of each flat element (int64),
    or None if packing is not a permutation of 16-bit values here."""
    import torch

    n = rows * cols
    idx = torch.arange(n, dtype=torch.int64)
    digits = []
    for part in (idx & 0xFFFF, idx >> 16):
        src = part.to(torch.int32).to(torch.int16).view(torch.bfloat16).reshape(1, rows, cols)
        out = torch.empty_like(src)
        torch.ops._C.prepack_moe_weight(src, out, kernel_isa)
        digits.append(out.view(-1).view(torch.int16).to(torch.int64))
    source = (digits[1] << 16) | (digits[0] & 0xFFFF)  # source[p]: the element packed at position p
    if not torch.equal(torch.sort(source).values, idx):
        return None
    where = torch.empty(n, dtype=torch.int64)
    where[source] = torch.arange(n, dtype=torch.int64)
    probe = torch.randn(1, rows, cols).to(torch.bfloat16)
    packed = torch.empty_like(probe)
    torch.ops._C.prepack_moe_weight(probe, packed, kernel_isa)
    if not torch.equal(packed.view(-1)[where], probe.view(-1)):
        return None
    return where


@dataclass
class _Layer:
    """One fused-experts layer: its module, the live weights, and how its kernel packs them."""

    module: Any
    prefix: str  # the parameters' name prefix ("model.layers.0.mlp.experts.")
    w13: Any  # live [experts, 2 * inter, hidden]
    w2: Any  # live [experts, hidden, inter]
    isa: str
    #: per live flat element of one expert, its packed flat position (None: re-pack whole experts)
    where13: Any = None
    where2: Any = None


def _packing_experts(module: Any) -> Any:
    """The layer's CPU experts kernel when it reads a repacked copy (None: it reads the parameters)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return None
    return experts


class LiveExperts:
    """The live expert weights of every repacked fused-experts layer of ``model`` (none off the CPU build)."""

    def __init__(self, model: Any) -> None:
        import torch

        self.layers: list[_Layer] = []
        self._where: dict[tuple[str, int, int], tuple[Any, Any]] = {}  # per layer shape: packed positions
        for name, module in model.named_modules():
            packed: Any = getattr(module, "w13_weight", None)
            experts = None if packed is None else _packing_experts(module)
            if experts is None:
                continue
            inter = int(experts.moe_config.intermediate_size_per_partition)
            n, _, hidden = packed.shape
            w13 = torch.zeros(n, 2 * inter, hidden, dtype=packed.dtype)
            w2 = torch.zeros(n, hidden, inter, dtype=packed.dtype)
            layer = _Layer(module, f"{name}." if name else "", w13, w2, experts.isa)
            self._positions(layer, packed.shape[1] // 2, module.w2_weight.shape[2])
            self.layers.append(layer)
        self._owner: dict[str, tuple[_Layer, str]] = {}
        for layer in self.layers:
            self._owner[f"{layer.prefix}w13_weight"] = (layer, "w13")
            self._owner[f"{layer.prefix}w2_weight"] = (layer, "w2")

    def __bool__(self) -> bool:
        return bool(self.layers)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """While inside, each layer's ``w13_weight`` / ``w2_weight`` are the live weights (the packed
        ones are put back on exit): ``named_parameters`` and ``load_weights`` see and write them."""
        import torch

        swapped: list[tuple[Any, str, Any]] = []
        try:
            for layer in self.layers:
                for attr, live in (("w13_weight", layer.w13), ("w2_weight", layer.w2)):
                    packed = layer.module._parameters[attr]
                    param = torch.nn.Parameter(live, requires_grad=False)
                    param.__dict__.update(packed.__dict__)  # weight_loader and vLLM's attributes
                    layer.module._parameters[attr] = param
                    swapped.append((layer.module, attr, packed))
            yield
        finally:
            for module, attr, packed in swapped:
                module._parameters[attr] = packed

    def repack(self, touched: dict[int, set[int]] | None = None) -> int:
        """Re-derive the packed copy of the ``touched`` experts (None: all) from the live weights;
        returns how many experts were packed."""
        import torch

        done = 0
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                experts = range(layer.w13.shape[0]) if touched is None else sorted(touched.get(i, ()))
                for e in experts:
                    self._pack_one(layer, e)
                    done += 1
        return done

    def _positions(self, layer: _Layer, padded: int, padded2: int) -> None:
        """The packed position of each live element of one expert (through the kernel's padding)."""
        import torch

        inter, hidden = layer.w2.shape[2], layer.w2.shape[1]
        key = (layer.isa, padded, hidden)
        if key not in self._where:
            w13 = _packed_positions(layer.isa, 2 * padded, hidden)
            w2 = _packed_positions(layer.isa, hidden, padded2)
            self._where[key] = (w13, w2)
        w13, w2 = self._where[key]
        if w13 is None or w2 is None:
            return
        rows = torch.arange(2 * inter, dtype=torch.int64)
        rows = torch.where(rows < inter, rows, rows - inter + padded)  # gate rows, then up rows after the padding
        layer.where13 = w13[(rows[:, None] * hidden + torch.arange(hidden)).reshape(-1)]
        layer.where2 = w2[(torch.arange(hidden)[:, None] * padded2 + torch.arange(inter)).reshape(-1)]

    def mirror(self, placements: Iterable[Any], changes: dict[str, tuple[Any, Any, Any]]) -> int:
        """Copy the elements a commit (or rollback) wrote into the kernel's packed copy. ``changes``:
        per checkpoint name, flat positions in its view (``StagedUpdate.changes()``). Returns how
        many elements were copied; experts whose layer has no permutation are re-packed whole."""
        import torch

        where = {p.name: p for p in placements}
        index = {id(layer): i for i, layer in enumerate(self.layers)}
        whole: dict[int, set[int]] = {}
        done = 0
        with torch.no_grad():
            for name, (pos, _old, _new) in changes.items():
                pl = where.get(name)
                owner = None if pl is None else self._owner.get(pl.param)
                if pl is None or owner is None:
                    continue
                layer, which = owner
                live = layer.w13 if which == "w13" else layer.w2
                packed = (layer.module.w13_weight if which == "w13" else layer.module.w2_weight).data
                perm = layer.where13 if which == "w13" else layer.where2
                off = torch.from_numpy(pos).to(torch.int64) + pl.start
                per = live[0].numel()
                if perm is None:
                    whole.setdefault(index[id(layer)], set()).update((off // per).unique().tolist())
                    continue
                dest = (off // per) * packed[0].numel() + perm[off % per]
                packed.view(-1).view(torch.int16)[dest] = live.view(-1).view(torch.int16)[off]
                done += int(off.numel())
        if whole:
            self.repack(whole)
        return done

    @staticmethod
    def _pack_one(layer: _Layer, e: int) -> None:
        import torch

        packed13, packed2 = layer.module.w13_weight, layer.module.w2_weight
        inter, padded = layer.w2.shape[2], packed2.shape[2]
        w13, w2 = layer.w13[e : e + 1], layer.w2[e : e + 1]
        if padded != inter:  # the kernel's alignment: gate and up each padded with zero rows
            pad13 = w13.new_zeros(1, 2 * padded, w13.shape[2])
            pad13[:, :inter] = w13[:, :inter]
            pad13[:, padded : padded + inter] = w13[:, inter:]
            pad2 = w2.new_zeros(1, w2.shape[1], padded)
            pad2[:, :, :inter] = w2
            w13, w2 = pad13, pad2
        torch.ops._C.prepack_moe_weight(w13.contiguous(), packed13.data[e : e + 1], layer.isa)
        torch.ops._C.prepack_moe_weight(w2.contiguous(), packed2.data[e : e + 1], layer.isa)
