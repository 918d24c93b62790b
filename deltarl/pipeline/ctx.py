"""The ``ctx`` codec: positions and values coded with the old value's exponent as context.

The receiver holds the base, so both sides know every element's *class* (its exponent field).
Small weights have a small ULP and change far more often than large ones, so each class gets its
own Rice parameter for position gaps, counted in same-class elements (the rank gap), and for value
magnitudes. Values are the exact wrapped integer difference of bit patterns: a raw sign bit plus
Rice(|d| - 1). Layout: docs/FORMAT.md.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np

from deltarl.errors import FormatError
from deltarl.pipeline import bitio, kernels
from deltarl.pipeline.codecs import Decoded, pack_streams, unpack_streams

_PARAMS = "<BB"  # class shift, class bits
NSTREAMS = 11

# Exponent field of each bit width's float formats: 16 bit -> set by caller (bf16 vs fp16).
CLASS_FIELDS = {"bfloat16": (7, 8), "float16": (10, 5), "float32": (23, 8)}


def rice_k(total: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Integer Rice parameter per group: ceil(log2(mean * ~ln2)) in exact integer arithmetic.

    x = (total * 11) // (count * 16); k = bit_length(x - 1) for x > 1, else 0; capped at 32.
    Integer-only so the numba and numpy encoders always choose the same parameters.
    """
    x = (total.astype(np.int64) * 11) // np.maximum(count.astype(np.int64) * 16, 1)
    k = np.zeros(x.shape, dtype=np.int64)
    y = np.maximum(x - 1, 0)
    while bool((y > 0).any()):
        k += y > 0
        y >>= 1
    return np.minimum(k, 32)


def _group_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    cs = np.concatenate(([0], np.cumsum(values.astype(np.int64))))
    ends = np.cumsum(counts)
    return cs[ends] - cs[ends - counts]


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


_FIELDS = [
    "active",
    "counts",
    "n_big",
    "k_pos",
    "k_bg",
    "k_bv",
    "gaps",
    "ks_pos",
    "big_gaps",
    "big_vals",
    "ks_big",
    "ks_val",
    "neg",
    "pos",
]


def _arrays_numpy(
    old: np.ndarray, new: np.ndarray, shift: int, mask: int, width: int
) -> tuple[np.ndarray, ...]:
    """Everything the encoder codes, in class-major order (the numba kernel ctx_arrays mirrors this)."""
    ch = kernels.class_ranks(old, new, shift, mask)
    order = np.argsort(ch.cls, kind="stable")
    pos, cls, rank = ch.pos[order], ch.cls[order], ch.rank[order]
    active, counts = np.unique(cls, return_counts=True)
    idx = np.repeat(np.arange(active.size), counts)
    gaps = _gaps_in_groups(rank, counts)
    d = (new[pos].astype(np.int64) - old[pos].astype(np.int64)) % (1 << width)
    neg = d >= (1 << (width - 1))
    mag = np.where(neg, (1 << width) - d, d) - 1  # |d| - 1 >= 0; mostly 0
    big = np.flatnonzero(mag > 0)
    big_idx = idx[big]
    n_big = np.bincount(big_idx, minlength=active.size).astype(np.int64)
    within = np.arange(idx.size) - np.repeat(np.cumsum(counts) - counts, counts)
    big_gaps = _gaps_in_groups(within[big], n_big)
    big_vals = mag[big] - 1
    k_pos = rice_k(_group_sums(gaps, counts), counts)
    k_bg = rice_k(_group_sums(big_gaps, n_big), n_big)
    k_bv = rice_k(_group_sums(big_vals, n_big), n_big)
    u64 = np.uint64
    return (
        active.astype(np.int64),
        counts.astype(np.int64),
        n_big,
        k_pos,
        k_bg,
        k_bv,
        gaps.astype(u64),
        k_pos[idx],
        big_gaps.astype(u64),
        big_vals.astype(u64),
        k_bg[big_idx],
        k_bv[big_idx],
        neg.astype(np.uint8),
        pos,
    )


def prepare(old: np.ndarray, new: np.ndarray, dtype: str) -> SimpleNamespace:
    """Detect the chunk's changes and compute the ctx code arrays (``.pos`` holds the positions)."""
    shift, cbits = CLASS_FIELDS[dtype]
    width = old.dtype.itemsize * 8
    jit = kernels.jit()
    if jit is not None:
        arrays = jit.ctx_arrays(old, new, shift, (1 << cbits) - 1, width)
    else:
        arrays = _arrays_numpy(old, new, shift, (1 << cbits) - 1, width)
    return SimpleNamespace(shift=shift, cbits=cbits, **dict(zip(_FIELDS, arrays, strict=True)))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_ctx(old: np.ndarray, new: np.ndarray, dtype: str, prep: SimpleNamespace | None = None) -> bytes:
    """Encode the changes of one chunk (``prep`` from :func:`prepare`, computed if not given)."""
    a = prep if prep is not None else prepare(old, new, dtype)
    table = b"".join(
        struct.pack("<BBBB", c, kp, kb, kv) + _varint(n) + _varint(m)
        for c, kp, kb, kv, n, m in zip(
            a.active.tolist(),
            a.k_pos.tolist(),
            a.k_bg.tolist(),
            a.k_bv.tolist(),
            a.counts.tolist(),
            a.n_big.tolist(),
            strict=True,
        )
    )
    pu, pr, pe = bitio.rice_encode(a.gaps, a.ks_pos)
    bu, br, be = bitio.rice_encode(a.big_gaps, a.ks_big)
    vu, vr, ve = bitio.rice_encode(a.big_vals, a.ks_val)
    signs = np.packbits(a.neg).tobytes()
    u8 = "<u8"
    streams = [table, pu, pr, pe.astype(u8).tobytes(), bu, br, be.astype(u8).tobytes()]
    streams += [vu, vr, ve.astype(u8).tobytes(), signs]
    return pack_streams(struct.pack(_PARAMS, a.shift, a.cbits), streams)


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
    nb = int(n_big.sum())
    big_idx = np.repeat(np.arange(active.size), n_big)
    bg = bitio.rice_decode(st[4], st[5], np.frombuffer(st[6], dtype="<u8"), k_bg[big_idx], nb)
    if bg.size and int(bg.max()) >= changed:
        raise FormatError("ctx value gap outside the chunk")
    bv = bitio.rice_decode(st[7], st[8], np.frombuffer(st[9], dtype="<u8"), k_bv[big_idx], nb)
    if bv.size and int(bv.max()) >= (1 << (width - 1)) - 1:
        raise FormatError("ctx value difference out of range")
    if len(st[10]) != (changed + 7) // 8:
        raise FormatError("ctx sign stream has the wrong length")
    neg = np.unpackbits(np.frombuffer(st[10], dtype=np.uint8), count=changed)
    jit = kernels.jit()
    if jit is not None:
        pos, vals, err = jit.ctx_decode(old, shift, mask, width, gaps, counts, active, n_big, bg, bv, neg)
        if err:
            raise FormatError(_DECODE_ERRORS[err])
        return Decoded(pos, vals)
    ranks = _ranks_in_groups(gaps, counts)
    tptr = np.zeros(mask + 2, dtype=np.int64)
    per_class = np.zeros(mask + 1, dtype=np.int64)
    per_class[active] = counts
    tptr[1:] = np.cumsum(per_class)
    pos, cm_index = kernels.class_select_sorted(old, shift, mask, ranks, tptr)
    within = _ranks_in_groups(bg, n_big)
    if nb and bool((within >= counts[big_idx]).any()):
        raise FormatError(_DECODE_ERRORS[2])
    m = np.ones(changed, dtype=np.int64)
    m[(np.cumsum(counts) - counts)[big_idx] + within] = bv.astype(np.int64) + 2
    d = np.where(neg.astype(bool), (1 << width) - m, m).astype(old.dtype)
    return Decoded(pos, old[pos] + d[cm_index])


_DECODE_ERRORS = {
    1: "ctx rank beyond the number of same-class elements",
    2: "ctx large-value index beyond its class",
}
