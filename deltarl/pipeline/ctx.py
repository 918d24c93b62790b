"""The ``ctx`` codec: positions and values coded with the old value's exponent as context.

The receiver holds the base, so both sides know every element's *class* (its exponent field).
Small weights have a small ULP and change far more often than large ones, so each class gets its
own Rice parameter for position gaps, counted in same-class elements (the rank gap), and for value
magnitudes. Values are the exact wrapped integer difference of bit patterns: a raw sign bit plus
Rice(|d| - 1). Layout: docs/FORMAT.md.
"""

from __future__ import annotations

import struct

import numpy as np

from deltarl.errors import FormatError
from deltarl.pipeline import bitio, kernels
from deltarl.pipeline.codecs import Decoded, pack_streams, unpack_streams

_PARAMS = "<BB"  # class shift, class bits
NSTREAMS = 11

# Exponent field of each bit width's float formats: 16 bit -> set by caller (bf16 vs fp16).
CLASS_FIELDS = {"bfloat16": (7, 8), "float16": (10, 5), "float32": (23, 8)}


def _rice_params(values: np.ndarray, cls_idx: np.ndarray, nclass: int) -> np.ndarray:
    """Per-class Rice parameter from the per-class mean (vectorised :func:`bitio.rice_param`)."""
    counts = np.bincount(cls_idx, minlength=nclass)
    sums = np.bincount(cls_idx, weights=values.astype(np.float64), minlength=nclass)
    mean = sums / np.maximum(counts, 1)
    with np.errstate(divide="ignore"):
        k = np.ceil(np.log2(np.maximum(mean, 1.0) * 0.6931471805599453))
    return np.clip(np.where(mean < 1.0, 0, k), 0, 32).astype(np.int64)


def _gaps_in_groups(ranks: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Gaps (r_i - r_{i-1} - 1, first r_0) of increasing ranks, restarting at each group of ``counts``."""
    prev = np.empty_like(ranks)
    prev[1:] = ranks[:-1]
    starts = np.cumsum(counts) - counts
    prev[starts[counts > 0]] = -1
    return ranks - prev - 1


def _ranks_in_groups(gaps: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_gaps_in_groups`."""
    if gaps.size == 0:
        return np.zeros(0, dtype=np.int64)
    cs = np.cumsum(gaps.astype(np.int64) + 1)
    starts = np.cumsum(counts) - counts
    base = np.where(starts > 0, cs[np.maximum(starts - 1, 0)], 0)
    return cs - 1 - np.repeat(base, counts)


def encode_ctx(old: np.ndarray, new: np.ndarray, shift: int, cbits: int, ch: object = None) -> bytes:
    """Encode the changes of one chunk; ``ch`` may carry precomputed (pos, cls, rank)."""
    mask = (1 << cbits) - 1
    if ch is None:
        ch = kernels.class_ranks(old, new, shift, mask)
    pos, cls, rank = ch.pos, ch.cls, ch.rank  # type: ignore[attr-defined]
    order = np.argsort(cls, kind="stable")
    pos, cls, rank = pos[order], cls[order], rank[order]
    active, counts = np.unique(cls, return_counts=True)
    idx = np.repeat(np.arange(active.size), counts)  # class index of each changed element
    gaps = _gaps_in_groups(rank, counts)
    width = old.dtype.itemsize * 8
    d = (new[pos].astype(np.int64) - old[pos].astype(np.int64)) % (1 << width)
    neg = d >= (1 << (width - 1))
    mag = np.where(neg, (1 << width) - d, d) - 1  # |d| - 1 >= 0; mostly 0
    big = np.flatnonzero(mag > 0)
    big_idx = idx[big]
    n_big = np.bincount(big_idx, minlength=active.size)
    within = np.arange(idx.size) - np.repeat(np.cumsum(counts) - counts, counts)
    big_gaps = _gaps_in_groups(within[big], n_big)
    big_vals = mag[big] - 1
    k_pos = _rice_params(gaps, idx, active.size)
    k_bg = _rice_params(big_gaps, big_idx, active.size)
    k_bv = _rice_params(big_vals, big_idx, active.size)
    table = b"".join(
        struct.pack("<BBBB", int(c), int(a), int(b), int(e)) + bitio.leb128_encode(np.array([n, m]))
        for c, a, b, e, n, m in zip(active, k_pos, k_bg, k_bv, counts, n_big, strict=True)
    )
    pu, pr, pe = bitio.rice_encode(gaps, k_pos[idx])
    bu, br, be = bitio.rice_encode(big_gaps, k_bg[big_idx])
    vu, vr, ve = bitio.rice_encode(big_vals, k_bv[big_idx])
    signs = np.packbits(neg.astype(np.uint8)).tobytes()
    u8 = "<u8"
    streams = [table, pu, pr, pe.astype(u8).tobytes(), bu, br, be.astype(u8).tobytes()]
    streams += [vu, vr, ve.astype(u8).tobytes(), signs]
    return pack_streams(struct.pack(_PARAMS, shift, cbits), streams)


def _class_table(data: memoryview, changed: int, nclass: int) -> tuple[np.ndarray, ...]:
    rows: list[tuple[int, ...]] = []
    off, last = 0, -1
    raw = bytes(data)
    while off < len(raw):
        if off + 6 > len(raw):
            raise FormatError("ctx class table is truncated")
        head = raw[off : off + 4]
        off += 4
        nums = []
        for _ in range(2):
            n, sh = 0, 0
            while True:
                if off >= len(raw) or sh > 56:
                    raise FormatError("ctx class table has a bad count")
                byte = raw[off]
                off += 1
                n |= (byte & 0x7F) << sh
                sh += 7
                if byte < 0x80:
                    break
            nums.append(n)
        c = head[0]
        if c <= last or c >= nclass or max(head[1:]) > 32 or nums[0] == 0 or nums[1] > nums[0]:
            raise FormatError(f"ctx class table entry {tuple(head)} {nums} is invalid")
        last = c
        rows.append((*head, *nums))
    cols = np.array(rows, dtype=np.int64).reshape(-1, 6).T
    if int(cols[4].sum()) != changed:
        raise FormatError(f"ctx class counts add up to {int(cols[4].sum())}, header says {changed}")
    return tuple(cols)


def decode_ctx(old: np.ndarray, payload: memoryview, changed: int) -> Decoded:
    (shift, cbits), st = unpack_streams(payload, _PARAMS, NSTREAMS)
    width = old.dtype.itemsize * 8
    if not 1 <= cbits <= 8 or shift + cbits > width:
        raise FormatError(f"ctx class field (shift {shift}, bits {cbits}) does not fit {width}-bit values")
    mask = (1 << cbits) - 1
    active, k_pos, k_bg, k_bv, counts, n_big = _class_table(st[0], changed, mask + 1)
    for i in (3, 6, 9):
        if len(st[i]) % 8:
            raise FormatError("ctx escape stream is not a whole number of u64")
    idx = np.repeat(np.arange(active.size), counts)
    gaps = bitio.rice_decode(st[1], st[2], np.frombuffer(st[3], dtype="<u8"), k_pos[idx], changed)
    if gaps.size and int(gaps.max()) >= old.size:
        raise FormatError("ctx rank gap outside the chunk")
    ranks = _ranks_in_groups(gaps, counts)
    tptr = np.zeros(mask + 2, dtype=np.int64)
    per_class = np.zeros(mask + 1, dtype=np.int64)
    per_class[active] = counts
    tptr[1:] = np.cumsum(per_class)
    pos = kernels.class_select(old, shift, mask, ranks, tptr)
    if pos.size and int(pos.min()) < 0:
        raise FormatError("ctx rank beyond the number of same-class elements")
    nb = int(n_big.sum())
    big_idx = np.repeat(np.arange(active.size), n_big)
    bg = bitio.rice_decode(st[4], st[5], np.frombuffer(st[6], dtype="<u8"), k_bg[big_idx], nb)
    if bg.size and int(bg.max()) >= changed:
        raise FormatError("ctx value gap outside the chunk")
    within = _ranks_in_groups(bg, n_big)
    if nb and bool((within >= counts[big_idx]).any()):
        raise FormatError("ctx large-value index beyond its class")
    bv = bitio.rice_decode(st[7], st[8], np.frombuffer(st[9], dtype="<u8"), k_bv[big_idx], nb)
    if bv.size and int(bv.max()) >= (1 << (width - 1)) - 1:
        raise FormatError("ctx value difference out of range")
    if len(st[10]) != (changed + 7) // 8:
        raise FormatError("ctx sign stream has the wrong length")
    neg = np.unpackbits(np.frombuffer(st[10], dtype=np.uint8), count=changed).astype(bool)
    m = np.ones(changed, dtype=np.int64)
    m[(np.cumsum(counts) - counts)[big_idx] + within] = bv.astype(np.int64) + 2
    d = np.where(neg, (1 << width) - m, m).astype(old.dtype)
    return Decoded(pos, old[pos] + d)
