"""A segment's chunk table taken as columns by the stager (:mod:`deltarl.codec.stager`): how each
chunk meets a rank's regions, whether chunks of several segments overlap, and per-tensor sums and
runs, as array operations instead of a Python step a chunk (a 30B-A3B layer's delta has ~25,000)."""

from __future__ import annotations

import numpy as np

from deltarl.codec.grid import CELLS

# How a chunk meets a stager's regions: staged whole, in part, another rank's (counted, not
# decoded), or skipped (no region of its tensor here).
ALL, PART, NONE, SKIP = 1, 2, -1, 0
HOW = {"all": ALL, "part": PART, "none": NONE, None: SKIP}
EMPTY_ROWS = np.zeros((0, 4), dtype=np.int64)


def first_overlap(covered: np.ndarray, taken: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows ``(tensor id, cell, start, end)``: the chunks of these segments (``taken``, one array a
    segment, each segment's own chunks disjoint: its parse checked them) joined, and the first row
    that overlaps another of them or one of ``covered`` (staged before), or None. Only the rows of a
    (tensor, cell) these segments name are sorted."""
    new = [x for x in taken if x.size]
    rows = np.concatenate(new) if new else EMPTY_ROWS
    old = covered
    if old.size and rows.size:
        old = old[np.isin(old[:, 0] * (CELLS + 1) + old[:, 1], rows[:, 0] * (CELLS + 1) + rows[:, 1])]
    if len(new) + bool(old.size) < 2:
        return rows, None
    both = np.concatenate((old, rows))
    a = both[np.lexsort((both[:, 2], both[:, 1], both[:, 0]))]
    hit = np.flatnonzero((a[1:, 0] == a[:-1, 0]) & (a[1:, 1] == a[:-1, 1]) & (a[1:, 2] < a[:-1, 3]))
    return rows, (a[int(hit[0]) + 1] if hit.size else None)


def sums(keys: np.ndarray, values: np.ndarray) -> tuple[list[int], list[int]]:
    """The distinct ``keys`` and the sum of ``values`` over each."""
    uniq, inv = np.unique(keys, return_inverse=True)
    out = np.zeros(uniq.size, dtype=np.int64)
    np.add.at(out, inv, values)
    return uniq.tolist(), out.tolist()


def pairs(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int]]:
    """The distinct ``(a, b)`` pairs."""
    if not a.size:
        return []
    both = np.unique(np.stack((a.astype(np.int64), b.astype(np.int64)), axis=1), axis=0)
    return [(int(x), int(y)) for x, y in both.tolist()]


def runs(keys: np.ndarray, values: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
    """Runs of equal ``keys`` (sorted): each run's key and its ``values``."""
    if not keys.size:
        return [], []
    cut = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    return keys[np.concatenate(([0], cut))].tolist(), np.split(values, cut)
