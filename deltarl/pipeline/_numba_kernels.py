"""numba versions of the per-element loops in :mod:`deltarl.pipeline.kernels` (imported lazily)."""

from __future__ import annotations

import numpy as np
from numba import njit

_BLOCK = 64


@njit(cache=True, nogil=True)
def _changed_positions(old, new, out):  # type: ignore[no-untyped-def]
    n = old.size
    k = 0
    for b0 in range(0, n, _BLOCK):
        b1 = min(n, b0 + _BLOCK)
        acc = 0
        for i in range(b0, b1):
            acc |= old[i] ^ new[i]
        if acc != 0:
            for i in range(b0, b1):
                if old[i] != new[i]:
                    out[k] = i
                    k += 1
    return k


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    out = np.empty(old.size, dtype=np.int64)
    k = _changed_positions(old, new, out)
    return out[:k].copy()


@njit(cache=True, nogil=True)
def _class_ranks(old, new, shift, mask, pos, cls, rank):  # type: ignore[no-untyped-def]
    cnt = np.zeros(mask + 1, np.int64)
    k = 0
    for i in range(old.size):
        x = old[i]
        c = (x >> shift) & mask
        if x != new[i]:
            pos[k] = i
            cls[k] = c
            rank[k] = cnt[c]
            k += 1
        cnt[c] += 1
    return k


def class_ranks(old: np.ndarray, new: np.ndarray, shift: int, mask: int) -> tuple[np.ndarray, ...]:
    n = old.size
    pos, cls, rank = (np.empty(n, dtype=np.int64) for _ in range(3))
    k = _class_ranks(old, new, shift, mask, pos, cls, rank)
    return pos[:k].copy(), cls[:k].copy(), rank[:k].copy()


@njit(cache=True, nogil=True)
def class_select(old, shift, mask, targets, tptr):  # type: ignore[no-untyped-def]
    out = np.full(targets.size, -1, np.int64)
    nclass = mask + 1
    ptr = tptr[:nclass].copy()
    nxt = np.full(nclass, -1, np.int64)
    for c in range(nclass):
        if ptr[c] < tptr[c + 1]:
            nxt[c] = targets[ptr[c]]
    cnt = np.zeros(nclass, np.int64)
    left = targets.size
    for i in range(old.size):
        if left == 0:
            break
        c = (old[i] >> shift) & mask
        r = cnt[c]
        cnt[c] = r + 1
        if r == nxt[c]:
            p = ptr[c]
            out[p] = i
            left -= 1
            p += 1
            ptr[c] = p
            nxt[c] = targets[p] if p < tptr[c + 1] else -1
    return out
