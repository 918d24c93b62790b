"""The torch scatter path of a staged update: indices and values moved to the tensor's device at
staging, so the commit pause is a check (gather + compare) and ``index_copy_`` in place.

Used for CUDA tensors, and for CPU torch tensors when asked (``Stager(..., torch_scatter=True)``),
which runs the same device-agnostic code without a GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from deltarl.errors import TensorMismatch


def device_flat(name: str, value: Any) -> Any:
    """A flat signed-integer view of a torch tensor's bits (same memory, any device)."""
    torch = sys.modules["torch"]
    if not value.is_contiguous():
        raise TensorMismatch(f"tensor {name!r} is not contiguous")
    return value.detach().view(-1).view(torch.int16 if value.element_size() == 2 else torch.int32)


class DevicePlan:
    """One tensor's staged changes on its device: absolute int64 indices, old and new bits."""

    __slots__ = ("flat", "idx", "new", "old", "source")

    def __init__(self, source: Any, flat: Any, idx: Any, old: Any, new: Any) -> None:
        self.source, self.flat, self.idx, self.old, self.new = source, flat, idx, old, new

    @classmethod
    def build(cls, name: str, value: Any, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> DevicePlan:
        """Move absolute positions and old/new bits (host numpy) to ``value``'s device."""
        torch = sys.modules["torch"]
        flat = device_flat(name, value)
        signed = np.int16 if old.dtype.itemsize == 2 else np.int32
        dev = value.device
        return cls(
            value,
            flat,
            torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64)).to(dev),
            torch.from_numpy(np.ascontiguousarray(old).view(signed)).to(dev),
            torch.from_numpy(np.ascontiguousarray(new).view(signed)).to(dev),
        )

    def rebind(self, name: str, value: Any) -> DevicePlan:
        """The same changes aimed at ``value`` (a tensor of the same spec that replaced the staged one)."""
        dev = value.device
        return DevicePlan(value, device_flat(name, value), self.idx.to(dev), self.old.to(dev), self.new.to(dev))

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel() * t.element_size()) for t in (self.idx, self.old, self.new))

    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(int64 positions, old bits, new bits) as host numpy arrays (unsigned bits)."""
        udt = np.uint16 if self.old.element_size() == 2 else np.uint32
        return (
            self.idx.cpu().numpy(),
            self.old.cpu().numpy().view(udt),
            self.new.cpu().numpy().view(udt),
        )


def first_stale(plans: Sequence[DevicePlan]) -> int:
    """Index of the first plan whose tensor holds neither old nor new bits somewhere, or -1.

    One host synchronisation per device, not one per tensor.
    """
    if not plans:
        return -1
    torch = sys.modules["torch"]
    flags: dict[Any, list[tuple[int, Any]]] = {}
    for i, p in enumerate(plans):
        cur = p.flat[p.idx]
        flags.setdefault(p.flat.device, []).append((i, ((cur == p.old) | (cur == p.new)).all()))
    bad: list[int] = []
    for items in flags.values():
        ok = torch.stack([f for _, f in items]).cpu().numpy()
        bad += [items[k][0] for k in np.flatnonzero(~ok)]
    return min(bad) if bad else -1


def write(plans: Sequence[DevicePlan], to_new: bool) -> None:
    """Scatter the new (or old) bits in place."""
    for p in plans:
        p.flat.index_copy_(0, p.idx, p.new if to_new else p.old)
