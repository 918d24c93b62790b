"""The ``ctx`` codec (id 4): positions and values coded with the old value's exponent as context.

The receiver holds the base, so both sides know every element's *class* (its exponent field).
Small weights have a small ULP and change far more often than large ones, so each class gets its
own Rice parameter for position gaps, counted in same-class elements (the rank gap), and for value
magnitudes. Values are the exact wrapped integer difference of bit patterns: a raw sign bit plus
Rice(|d| - 1). The classes are ranked during change detection (:mod:`deltarl.codec.classes`); the
decoder scans the whole chunk of the base (numba: :mod:`deltarl.codec._numba_ctx`). Layout:
docs/FORMAT.md.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from deltarl.codec import bitio, kernels
from deltarl.codec.chunk import Changes, Decoded, pack_streams, unpack_streams, varint
from deltarl.codec.classes import rank_classes, ranks_in_groups
from deltarl.errors import FormatError

_PARAMS = "<BB"  # class shift, class bits
NSTREAMS = 11


def encode(old: np.ndarray, new: np.ndarray, dtype: str, changes: Changes) -> bytes:
    """Encode the changes of one chunk (their classes ranked during detection, or here if not)."""
    a = changes.classes if changes.classes is not None else rank_classes(old, new, dtype)
    table = b"".join(
        struct.pack("<BBBB", c, kp, kb, kv) + varint(n) + varint(m)
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


def _streams(old: np.ndarray, payload: memoryview, changed: int) -> tuple[int, int, int, list[memoryview]]:
    """A ctx payload's (shift, mask, width, streams), with the checks both decoders share."""
    (shift, cbits), st = unpack_streams(payload, _PARAMS, NSTREAMS)
    width = old.dtype.itemsize * 8
    if not 1 <= cbits <= 8 or shift + cbits > width:
        raise FormatError(f"ctx class field (shift {shift}, bits {cbits}) does not fit {width}-bit values")
    for i in (3, 6, 9):
        if len(st[i]) % 8:
            raise FormatError("ctx escape stream is not a whole number of u64")
    if len(st[10]) != (changed + 7) // 8:
        raise FormatError("ctx sign stream has the wrong length")
    return shift, (1 << cbits) - 1, width, st


def decode(old: np.ndarray, payload: memoryview, changed: int) -> Decoded:
    """Positions and new bits of one chunk (a scan of the chunk's base)."""
    shift, mask, width, st = _streams(old, payload, changed)
    jit = kernels.ctx_jit()
    if jit is not None:
        state = _prepare_jit(jit, old, shift, mask, width, changed, st)
        (a64,) = jit.words16(old)
        err, pos, old_v, new_v = jit.ctx_scan(old, a64, shift, mask, width, changed, 0, *state)
        _check(err)
        return Decoded(pos, new_v, old_v)
    return _decode_numpy(old, shift, mask, width, changed, st)


def decode_pair(
    a: tuple[np.ndarray, memoryview, int], b: tuple[np.ndarray, memoryview, int]
) -> tuple[Decoded, Decoded]:
    """``(decode(*a), decode(*b))``, with the two 16-bit chunks scanned interleaved (faster)."""
    jit = kernels.ctx_jit()
    if jit is None:
        return decode(*a), decode(*b)
    (old_a, payload_a, changed_a), (old_b, payload_b, changed_b) = a, b
    shift, mask, width, st_a = _streams(old_a, payload_a, changed_a)
    params_b = _streams(old_b, payload_b, changed_b)
    (a64_a,), (a64_b,) = jit.words16(old_a), jit.words16(old_b)
    if params_b[:3] != (shift, mask, width) or width != 16 or not a64_a.size or not a64_b.size:
        return decode(*a), decode(*b)
    state_a = _prepare_jit(jit, old_a, shift, mask, width, changed_a, st_a)
    state_b = _prepare_jit(jit, old_b, shift, mask, width, changed_b, params_b[3])
    err_a, pos_a, oa, na, err_b, pos_b, ob, nb = jit.ctx_scan2(
        old_a, a64_a, changed_a, *state_a, old_b, a64_b, changed_b, *state_b, shift, mask
    )
    _check(err_a)
    _check(err_b)
    return Decoded(pos_a, na, oa), Decoded(pos_b, nb, ob)


def _prepare_jit(
    jit: Any, old: np.ndarray, shift: int, mask: int, width: int, changed: int, st: list[memoryview]
) -> tuple[np.ndarray, ...]:
    """Scan state of one chunk from the numba decoder (deltarl.codec._numba_ctx)."""
    u8 = [np.frombuffer(s, dtype=np.uint8) for s in st]
    u64 = [np.frombuffer(st[i], dtype="<u8") for i in (3, 6, 9)]
    err, *state = jit.ctx_prepare(
        old, shift, mask, width, changed, u8[0], u8[1], u8[2], u64[0], u8[4], u8[5], u64[1],
        u8[7], u8[8], u64[2], u8[10],
    )  # fmt: skip
    _check(err)
    return tuple(state)


def _check(err: int) -> None:
    if err:
        raise FormatError(_DECODE_ERRORS[int(err)])


def _decode_numpy(
    old: np.ndarray, shift: int, mask: int, width: int, changed: int, st: list[memoryview]
) -> Decoded:
    active, k_pos, k_bg, k_bv, counts, n_big = _class_table(st[0], changed, mask + 1)
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
    neg = np.unpackbits(np.frombuffer(st[10], dtype=np.uint8), count=changed)
    return changes_numpy(old, shift, mask, width, (active, counts, n_big), (gaps, bg, bv, neg))


def changes_numpy(old: np.ndarray, shift: int, mask: int, width: int, groups: tuple[np.ndarray, ...],
                  values: tuple[np.ndarray, ...]) -> Decoded:  # fmt: skip
    """The changes from decoded groups (``groups``: classes ascending, their counts and large-value
    counts; ``values``: rank gaps, large-value gaps, ``|d| - 2``, sign bits, class-major)."""
    active, counts, n_big = groups
    gaps, bg, bv, neg = values
    changed = int(gaps.size)
    nb = int(bg.size)
    big_idx = np.repeat(np.arange(active.size), n_big)
    ranks = ranks_in_groups(gaps, counts)
    tptr = np.zeros(mask + 2, dtype=np.int64)
    per_class = np.zeros(mask + 1, dtype=np.int64)
    per_class[active] = counts
    tptr[1:] = np.cumsum(per_class)
    pos, cm_index = kernels.class_select_sorted(old, shift, mask, ranks, tptr)
    within = ranks_in_groups(bg, n_big)
    if nb and bool((within >= counts[big_idx]).any()):
        raise FormatError(_DECODE_ERRORS[2])
    m = np.ones(changed, dtype=np.int64)
    m[(np.cumsum(counts) - counts)[big_idx] + within] = bv.astype(np.int64) + 2
    d = np.where(neg.astype(bool), (1 << width) - m, m).astype(old.dtype)
    o = old[pos]
    return Decoded(pos, o + d[cm_index], o)


_DECODE_ERRORS = {
    1: "ctx rank beyond the number of same-class elements",
    2: "ctx large-value index beyond its class",
    3: "ctx class table is truncated",
    4: "ctx class table has a bad count",
    5: "ctx class table entry is invalid",
    6: "ctx class counts do not add up to the chunk's changed count",
    7: "ctx unary stream holds fewer codes than expected",
    8: "ctx unary code longer than the escape length",
    9: "ctx unary stream has trailing bits or bytes",
    10: "ctx remainder stream has the wrong length",
    11: "ctx escape stream does not match the escaped codes",
    12: "ctx escaped value small enough for a plain code",
    13: "ctx rank gap outside the chunk",
    14: "ctx value gap outside the chunk",
    15: "ctx value difference out of range",
}
