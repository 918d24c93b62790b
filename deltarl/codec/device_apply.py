"""The torch scatter path of a staged update: indices and values moved to the tensors' device at
staging, so the commit pause is a check (gather + compare, one host sync per batch) and one
``index_copy_`` per tensor, in place.

Tensors sharing a device and bit width form a :class:`DeviceBatch`: their old and new bits live in
one buffer each, so the check is one gather per tensor into a shared buffer and one comparison for
all of them (not five kernel launches per tensor). Used for CUDA tensors, and for CPU torch tensors
when asked (``Stager(..., torch_scatter=True)``), which runs the same device-agnostic code without
a GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from deltarl.codec.tensors import UINT_BY_SIZE, signed_torch_dtype
from deltarl.errors import TensorMismatch


def device_flat(name: str, value: Any) -> Any:
    """A flat signed-integer view of a torch tensor's bits (same memory, any device)."""
    if not value.is_contiguous():
        raise TensorMismatch(f"tensor {name!r} is not contiguous")
    return value.detach().view(-1).view(signed_torch_dtype(value.element_size()))


class DevicePlan:
    """One tensor's staged changes on its device: int64 indices, and its slices of the batch's
    old and new bits."""

    __slots__ = ("a", "b", "batch", "flat", "idx", "new", "old", "source")

    def __init__(self, batch: DeviceBatch, source: Any, flat: Any, idx: Any, a: int, b: int) -> None:
        self.batch, self.source, self.flat, self.idx, self.a, self.b = batch, source, flat, idx, a, b
        self.old, self.new = batch.old[a:b], batch.new[a:b]

    def rebind(self, name: str, value: Any) -> DevicePlan:
        """The same changes aimed at ``value`` (a tensor of the same spec that replaced the staged one)."""
        if value.device != self.flat.device:
            raise TensorMismatch(f"tensor {name!r} moved from {self.flat.device} to {value.device} since staging")
        return DevicePlan(self.batch, value, device_flat(name, value), self.idx, self.a, self.b)

    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(int64 positions, old bits, new bits) as host numpy arrays (unsigned bits)."""
        udt = UINT_BY_SIZE[self.old.element_size()]
        return self.idx.cpu().numpy(), self.old.cpu().numpy().view(udt), self.new.cpu().numpy().view(udt)

    def fresh(self) -> Any:
        """A 0-d bool tensor: every position holds its old or new bits (no sync)."""
        cur = self.flat[self.idx]
        return ((cur == self.old) | (cur == self.new)).all()


class DeviceBatch:
    """The staged changes of tensors on one device with one bit width."""

    def __init__(self, old: Any, new: Any) -> None:
        self.old, self.new = old, new
        self.cur = old.new_empty(old.shape)  # the gather target of the check
        self.members = 0  # tensors in the batch

    @staticmethod
    def build(items: Sequence[tuple[str, Any, np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, DevicePlan]:
        """Plans for ``(name, tensor, absolute positions, old bits, new bits)`` (host numpy), batched
        by device and bit width; everything is moved to the devices here."""
        if not items:
            return {}  # no torch tensors: torch may not even be imported
        torch = sys.modules["torch"]
        groups: dict[tuple[str, int], list[tuple[str, Any, np.ndarray, np.ndarray, np.ndarray]]] = {}
        for item in items:
            groups.setdefault((str(item[1].device), item[3].dtype.itemsize), []).append(item)
        plans: dict[str, DevicePlan] = {}
        for (dev, width), group in groups.items():
            signed = {1: np.int8, 2: np.int16, 4: np.int32}[width]
            old = torch.from_numpy(np.concatenate([g[3] for g in group]).view(signed)).to(dev)
            new = torch.from_numpy(np.concatenate([g[4] for g in group]).view(signed)).to(dev)
            batch = DeviceBatch(old, new)
            a = 0
            for name, value, pos, _o, _n in group:
                idx = torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64)).to(dev)
                plans[name] = DevicePlan(batch, value, device_flat(name, value), idx, a, a + pos.size)
                a += pos.size
            batch.members = len(group)
        return plans


def first_stale(plans: Sequence[DevicePlan]) -> int:
    """Index of the first plan whose tensor holds neither old nor new bits somewhere, or -1.

    A batch whose every tensor is checked gathers into its shared buffer and compares once; one
    host synchronisation for all batches.
    """
    if not plans:
        return -1
    torch = sys.modules["torch"]
    by_batch: dict[int, list[int]] = {}
    for i, p in enumerate(plans):
        by_batch.setdefault(id(p.batch), []).append(i)
    flags: list[Any] = []
    owners: list[list[int]] = []
    for members in by_batch.values():
        batch = plans[members[0]].batch
        if len(members) == batch.members:
            for i in members:
                p = plans[i]
                torch.index_select(p.flat, 0, p.idx, out=batch.cur[p.a : p.b])
            flags.append(((batch.cur == batch.old) | (batch.cur == batch.new)).all().to("cpu", non_blocking=False))
            owners.append(members)
        else:  # part of a batch (a refused commit stops early): check tensor by tensor
            flags += [plans[i].fresh().cpu() for i in members]
            owners += [[i] for i in members]
    ok = torch.stack(flags).numpy()
    bad = [i for k in np.flatnonzero(~ok) for i in owners[k]]
    if not bad:
        return -1
    return min(i for i in bad if not bool(plans[i].fresh()))


def write(plans: Sequence[DevicePlan], to_new: bool) -> None:
    """Scatter the new (or old) bits in place."""
    for p in plans:
        p.flat.index_copy_(0, p.idx, p.new if to_new else p.old)
