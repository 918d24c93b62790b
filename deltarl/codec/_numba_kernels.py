"""numba versions of the per-element loops in :mod:`deltarl.codec.kernels` (imported lazily)."""
# mypy: ignore-errors

from __future__ import annotations

import numpy as np
from numba import njit

from deltarl.codec._ctxs5 import rice_rule as rice_k  # the integer Rice rule (bitio.rice_k), one definition
from deltarl.codec._numba_bits import rice_decode, rice_encode

__all__ = ["rice_decode", "rice_encode"]  # re-exported: kernels.jit() is this module

_BLOCK = 64


@njit(cache=True, nogil=True)
def _changed_words(a, b, lanes, lane_bits, out):
    """Changed element indices, comparing 64-bit words of packed lanes (skips equal words fast)."""
    k = 0
    lane_mask = (np.uint64(1) << np.uint64(lane_bits)) - np.uint64(1)
    for w in range(a.size):
        x = a[w] ^ b[w]
        if x != 0:
            for j in range(lanes):
                if (x >> np.uint64(j * lane_bits)) & lane_mask:
                    out[k] = w * lanes + j
                    k += 1
    return k


@njit(cache=True, nogil=True)
def _changed_tail(old, new, start, out, k):
    for i in range(start, old.size):
        if old[i] != new[i]:
            out[k] = i
            k += 1
    return k


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    lanes = 8 // old.dtype.itemsize
    nw = old.size // lanes
    out = np.empty(old.size, dtype=np.int64)
    k = 0
    aligned = old.ctypes.data % 8 == 0 and new.ctypes.data % 8 == 0
    if nw and aligned:
        a = old[: nw * lanes].view(np.uint64)
        b = new[: nw * lanes].view(np.uint64)
        k = _changed_words(a, b, lanes, old.dtype.itemsize * 8, out)
        k = _changed_tail(old, new, nw * lanes, out, k)
    else:
        k = _changed_tail(old, new, 0, out, 0)
    return out[:k].copy()


@njit(cache=True, nogil=True)
def _class_ranks_from(old, new, shift, mask, pos, cls, rank, start, cnt, k):
    for i in range(start, old.size):
        x = old[i]
        c = (x >> shift) & mask
        if x != new[i]:
            pos[k] = i
            cls[k] = c
            rank[k] = cnt[c]
            k += 1
        cnt[c] += 1
    return k


@njit(cache=True, nogil=True)
def _class_ranks_w16(a, b, shift, mask, pos, cls, rank, cnt):
    """_class_ranks over 16-bit lanes packed 4 to a u64 word (one load and compare per 4 elements)."""
    k = 0
    um = np.uint64(mask)
    for w in range(a.size):
        x = a[w]
        d = x ^ b[w]
        if d == 0:
            cnt[(x >> np.uint64(shift)) & um] += 1
            cnt[(x >> np.uint64(16 + shift)) & um] += 1
            cnt[(x >> np.uint64(32 + shift)) & um] += 1
            cnt[(x >> np.uint64(48 + shift)) & um] += 1
        else:
            for j in range(4):
                c = (x >> np.uint64(16 * j + shift)) & um
                if (d >> np.uint64(16 * j)) & np.uint64(0xFFFF):
                    pos[k] = w * 4 + j
                    cls[k] = c
                    rank[k] = cnt[c]
                    k += 1
                cnt[c] += 1
    return k


@njit(cache=True, nogil=True)
def _all_class_ranks(old, new, a64, b64, shift, mask, pos, cls, rank):
    cnt = np.zeros(mask + 1, np.int64)
    k = 0
    if a64.size:
        k = _class_ranks_w16(a64, b64, shift, mask, pos, cls, rank, cnt)
    return _class_ranks_from(old, new, shift, mask, pos, cls, rank, a64.size * 4, cnt, k)


def words16(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """u64 views of the 4-aligned prefix of 16-bit arrays (empty when not 8-byte aligned)."""
    n = arrays[0].size // 4 * 4
    if arrays[0].dtype.itemsize != 2 or n == 0 or any(a.ctypes.data % 8 for a in arrays):
        return tuple(np.zeros(0, dtype=np.uint64) for _ in arrays)
    return tuple(a[:n].view(np.uint64) for a in arrays)


def class_ranks(old: np.ndarray, new: np.ndarray, shift: int, mask: int) -> tuple[np.ndarray, ...]:
    n = old.size
    pos, cls, rank = (np.empty(n, dtype=np.int64) for _ in range(3))
    a64, b64 = words16(old, new)
    k = _all_class_ranks(old, new, a64, b64, shift, mask, pos, cls, rank)
    return pos[:k].copy(), cls[:k].copy(), rank[:k].copy()


def ctx_arrays(old: np.ndarray, new: np.ndarray, shift: int, mask: int, width: int) -> tuple:
    a64, b64 = words16(old, new)
    return _ctx_arrays(old, new, a64, b64, shift, mask, width)


@njit(cache=True, nogil=True)
def class_streams(rank_cm, dd, counts, width, gaps, neg, big_gaps, big_vals):
    """What ctx codes of each class (``counts``: its changes in class-major ``rank_cm`` ranks and
    ``dd`` wrapped differences): rank gaps, signs, the gaps between and the values of its changes
    larger than 1 ulp into ``gaps``, ``neg``, ``big_gaps``, ``big_vals``; returns (n_big, k_pos,
    k_big_gap, k_big_val per class, large values in all)."""
    na = counts.size
    full = np.int64(1) << width
    half = np.int64(1) << (width - 1)
    n_big = np.zeros(na, np.int64)
    k_pos = np.zeros(na, np.int64)
    k_bg = np.zeros(na, np.int64)
    k_bv = np.zeros(na, np.int64)
    nb = 0
    s = 0
    for a in range(na):
        e = s + counts[a]
        prev = -1
        prevb = -1
        gsum = 0
        bgsum = 0
        bvsum = 0
        nb0 = nb
        for t in range(s, e):
            g = rank_cm[t] - prev - 1
            prev = rank_cm[t]
            gaps[t] = g
            gsum += g
            d = dd[t]
            neg[t] = d >= half
            m = (full - d - 1) if d >= half else (d - 1)
            if m > 0:
                bgsum += t - s - prevb - 1
                bvsum += m - 1
                big_gaps[nb] = t - s - prevb - 1
                prevb = t - s
                big_vals[nb] = m - 1
                nb += 1
        k_pos[a] = rice_k(gsum, e - s)
        n_big[a] = nb - nb0
        k_bg[a] = rice_k(bgsum, nb - nb0)
        k_bv[a] = rice_k(bvsum, nb - nb0)
        s = e
    return n_big, k_pos, k_bg, k_bv, nb


@njit(cache=True, nogil=True)
def _ctx_arrays(old, new, a64, b64, shift, mask, width):
    """Everything the ctx encoder codes, in class-major order (mirrors classes._arrays_numpy)."""
    n = old.size
    nclass = mask + 1
    pos = np.empty(n, np.int64)
    cls = np.empty(n, np.int64)
    rank = np.empty(n, np.int64)
    k = _all_class_ranks(old, new, a64, b64, shift, mask, pos, cls, rank)
    ccount = np.zeros(nclass, np.int64)
    for j in range(k):
        ccount[cls[j]] += 1
    fill = np.zeros(nclass, np.int64)
    na = 0
    acc = 0
    for c in range(nclass):
        fill[c] = acc
        acc += ccount[c]
        if ccount[c] > 0:
            na += 1
    active = np.empty(na, np.int64)
    counts = np.empty(na, np.int64)
    a = 0
    for c in range(nclass):
        if ccount[c] > 0:
            active[a] = c
            counts[a] = ccount[c]
            a += 1
    rank_cm = np.empty(k, np.int64)
    dpos = np.empty(k, np.int64)
    dd = np.empty(k, np.int64)
    full = np.int64(1) << width
    for j in range(k):  # position order: old/new are read sequentially here, never again
        t = fill[cls[j]]
        fill[cls[j]] = t + 1
        rank_cm[t] = rank[j]
        p = pos[j]
        dpos[t] = p
        dd[t] = (np.int64(new[p]) - np.int64(old[p])) & (full - 1)
    gaps = np.empty(k, np.int64)
    neg = np.empty(k, np.uint8)
    big_gaps = np.empty(k, np.int64)
    big_vals = np.empty(k, np.int64)
    n_big, k_pos, k_bg, k_bv, nb = class_streams(rank_cm, dd, counts, width, gaps, neg, big_gaps, big_vals)
    ks_pos = np.empty(k, np.int64)
    s = 0
    for a in range(na):
        ks_pos[s : s + counts[a]] = k_pos[a]
        s += counts[a]
    ks_big = np.empty(nb, np.int64)
    ks_val = np.empty(nb, np.int64)
    t = 0
    for a in range(na):
        for _ in range(n_big[a]):
            ks_big[t] = k_bg[a]
            ks_val[t] = k_bv[a]
            t += 1
    return (
        active,
        counts,
        n_big,
        k_pos,
        k_bg,
        k_bv,
        gaps.astype(np.uint64),
        ks_pos,
        big_gaps[:nb].astype(np.uint64),
        big_vals[:nb].astype(np.uint64),
        ks_big,
        ks_val,
        neg,
        dpos,
    )


@njit(cache=True, nogil=True)
def first_stale(flat, pos, old, new):
    """Index of the first position holding neither its old nor its new bits, or -1."""
    for j in range(pos.size):
        x = flat[pos[j]]
        if x != old[j] and x != new[j]:
            return j
    return -1


@njit(cache=True, nogil=True)
def write_strict(flat, pos, other, vals):
    """One pass of check + write: each position must hold other[j] (the bits being replaced), and
    vals[j] is written. At the first position that does not, everything this call wrote is set back
    to other (exactly what it held) and that index is returned; -1 when all were written."""
    for j in range(pos.size):
        p = pos[j]
        if flat[p] != other[j]:
            for i in range(j):
                flat[pos[i]] = other[i]
            return j
        flat[p] = vals[j]
    return -1


@njit(cache=True, nogil=True)
def scatter(flat, pos, vals):
    for j in range(pos.size):
        flat[pos[j]] = vals[j]


@njit(cache=True, nogil=True)
def gather(flat, pos):
    out = np.empty(pos.size, flat.dtype)
    for j in range(pos.size):
        out[j] = flat[pos[j]]
    return out
