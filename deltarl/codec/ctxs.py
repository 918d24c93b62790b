"""The ``ctxs`` codec (id 6): ``ctx`` for the grid cells of one tensor, its class parameters shared.

A tensor cut into grid cells (:mod:`deltarl.codec.grid`) has up to 64 cell chunks, and a chunk coded
``ctx`` carries its own class table (6+ bytes per class with changes, ~90 bytes at a few hundred
changes). Here the class field, the classes and their Rice parameters are a :class:`ClassRecord`,
written once per tensor in the header of each segment that holds its ``ctxs`` chunks (every reader
of any cell reads the headers anyway), and a cell's payload holds only its per-class counts, coded
with the record's parameters, and the ``ctx`` streams, all in one Rice code (one unary, one
remainder and one escape stream) with the sign bits after the last remainder bit. A class the record
lacks is an *extra* class of the chunk, listed as in a ``ctx`` class table. Layout: docs/FORMAT.md.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarl.codec import bitio, kernels
from deltarl.codec.chunk import Changes, Decoded, varint
from deltarl.codec.classes import CLASS_FIELDS, ClassCode, rank_classes
from deltarl.codec.ctx import _DECODE_ERRORS, changes_numpy
from deltarl.errors import FormatError

# How a record's chunks are coded: per-class counts and stream lengths (segment formats 3 and 4), or
# counts against the record's shares in one length-free code (format 5, :mod:`deltarl.codec._ctxs5`).
LAYOUT_COUNTS, LAYOUT_SHARES = 1, 2
_ROW2 = np.dtype([("c", "u1"), ("kv", "u1"), ("kn", "u1"), ("share", "<u2"), ("m", "<u4")])  # layout 2
_ENTRY = struct.Struct("<BBBB")  # an extra class: class, k_pos, k_big_gap, k_big_val (then varint n, n_big)
_U64 = np.uint64


@dataclass(frozen=True, eq=False)
class ClassRecord:
    """The class parameters shared by one tensor's ``ctxs`` chunks: the class field (``shift``,
    ``cbits``), the classes in record order and, per class, the Rice parameters of its rank gaps
    (``k_pos``), large-value gaps (``k_big_gap``), large values (``k_big_val``), a chunk's count of
    its changes (``k_n``) and of its large ones (``k_n_big``). The first class's count is not coded.

    ``layout``: how its chunks are coded. 1 (segment formats 3 and 4): counts and large-value counts
    per class, stream lengths as varints. 2 (format 5, :mod:`deltarl.codec._ctxs5`): ``share`` per
    class, a class's count coded against its share of the chunk's changes (``k_n`` the parameter of
    that difference), one sequence of large values (``k_big_gap`` and ``k_n_big`` unused)."""

    shift: int
    cbits: int
    classes: np.ndarray
    k_pos: np.ndarray
    k_big_gap: np.ndarray
    k_big_val: np.ndarray
    k_n: np.ndarray
    k_n_big: np.ndarray
    share: np.ndarray | None = None  # layout 2: each class's changes per 65,536 of the sample's
    m_pos: np.ndarray | None = None  # layout 2: the Golomb parameter of each class's rank gaps
    layout: int = LAYOUT_COUNTS

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClassRecord) and self.pack() == other.pack()

    def __hash__(self) -> int:
        return hash(self.pack())

    def pack(self) -> bytes:
        """``u8 shift, u8 cbits, varint m``, then ``m`` rows (docs/FORMAT.md, "Class records"): layout 1
        ``u8 class, k_pos, k_big_gap, k_big_val, k_n, k_n_big``; layout 2 ``u8 class, k_big_val,
        k_n, u16 share, u32 m_pos``."""
        if self.layout == LAYOUT_SHARES:
            rows = np.zeros(self.classes.size, dtype=_ROW2)
            rows["c"], rows["kv"], rows["kn"], rows["share"], rows["m"] = (
                self.classes, self.k_big_val, self.k_n, self.shares(), self.rank_param())
        else:
            cols = np.stack([self.classes, self.k_pos, self.k_big_gap, self.k_big_val, self.k_n, self.k_n_big], axis=1)
            rows = cols.astype(np.uint8)
        return struct.pack("<BB", self.shift, self.cbits) + varint(len(self.classes)) + rows.tobytes()

    def shares(self) -> np.ndarray:
        """The classes' shares (zeros for a layout 1 record)."""
        return np.zeros(self.classes.size, np.int64) if self.share is None else self.share

    def rank_param(self) -> np.ndarray:
        """What a chunk's rank gaps are coded with: layout 2 ``m_pos`` (Golomb), layout 1 ``k_pos`` (Rice)."""
        if self.layout == LAYOUT_SHARES:
            return np.ones(self.classes.size, np.int64) if self.m_pos is None else self.m_pos
        return self.k_pos


def parse_record(raw: memoryview, off: int, width: int, layout: int = LAYOUT_COUNTS) -> tuple[ClassRecord, int]:
    """One class record of ``layout`` from ``raw[off:]`` for ``width``-bit elements: (record, offset
    after it); FormatError if it is truncated or invalid."""
    if off + 3 > len(raw):
        raise FormatError("class record is truncated")
    shift, cbits = raw[off], raw[off + 1]
    m, off = read_varint(raw, off + 2, "class record")
    if not 1 <= cbits <= 8 or shift + cbits > width:
        raise FormatError(f"class record field (shift {shift}, bits {cbits}) does not fit {width}-bit values")
    row = _ROW2.itemsize if layout == LAYOUT_SHARES else 6
    if not 1 <= m <= 1 << cbits or off + row * m > len(raw):
        raise FormatError(f"class record of {m} classes is truncated or too long")
    block = bytes(raw[off : off + row * m])
    share = m_pos = None
    if layout == LAYOUT_SHARES:
        rows = np.frombuffer(block, dtype=_ROW2)
        zero = np.zeros(m, np.int64)
        cols = np.stack([rows["c"], zero, zero, rows["kv"], rows["kn"], zero]).astype(np.int64)
        share, m_pos = rows["share"].astype(np.int64), rows["m"].astype(np.int64)
        if int(m_pos.min()) < 1:
            raise FormatError("class record has a Golomb parameter of 0")
    else:
        cols = np.frombuffer(block, dtype=np.uint8).reshape(m, 6).T.astype(np.int64)
    if int(cols[0].max()) >= 1 << cbits or np.unique(cols[0]).size != m or int(cols[1:].max()) > 32:
        raise FormatError("class record has a repeated or out-of-range class, or a Rice parameter above 32")
    k_pos, k_big_gap, k_big_val, k_n, k_n_big = cols[1:]
    return ClassRecord(int(shift), int(cbits), cols[0], k_pos, k_big_gap, k_big_val, k_n, k_n_big, share=share,
                       m_pos=m_pos, layout=layout), off + row * m  # fmt: skip


def choose_record(old: np.ndarray, new: np.ndarray, dtype: str, chunk_elems: int,
                  field: tuple[int, int] | None = None, layout: int = LAYOUT_SHARES) -> ClassRecord:  # fmt: skip
    """The record an encoder writes for a tensor, from a sample of it (``old``/``new``: the sampled
    elements): every class of the sample's base, by decreasing sampled changes (then class), with
    ``k`` by the integer rule (:func:`deltarl.codec.bitio.rice_k`) on the sample's totals:
    ``k_pos`` (population - changes, changes), ``k_big_gap`` (changes - large, large), ``k_big_val``
    (sum of ``|d| - 2``, large), ``k_n_big`` (large ones per ``chunk_elems``) and ``k_n``: layout 1,
    (changes per ``chunk_elems``); layout 2, ``(13 isqrt(e), 8)`` for a class expected to change ``e``
    times in a chunk of ``chunk_elems`` (its count's spread). A class without sampled (large) changes
    counts one. Layout 2's ``share``: ``floor(65536 changes / all changes)``, at most 65,535."""
    shift, cbits = field or CLASS_FIELDS[dtype]
    mask = (1 << cbits) - 1
    width = old.dtype.itemsize * 8
    cls = (old >> old.dtype.type(shift)) & old.dtype.type(mask)
    pop = np.bincount(cls, minlength=mask + 1)
    hit = np.flatnonzero(old != new)
    d = (new[hit].astype(np.int64) - old[hit].astype(np.int64)) % (1 << width)
    mag = np.where(d >= 1 << (width - 1), (1 << width) - d, d)
    big = mag > 1
    n = max(int(old.size), 1)
    ch = cls[hit].astype(np.int64)
    chg = np.bincount(ch, minlength=mask + 1)
    nbig = np.bincount(ch[big], minlength=mask + 1)
    vsum = np.bincount(ch[big], weights=mag[big] - 2, minlength=mask + 1).astype(np.int64)
    classes = np.flatnonzero(pop)
    classes = classes[np.lexsort((classes, -chg[classes]))]
    c, b = np.maximum(chg[classes], 1), np.maximum(nbig[classes], 1)
    share = m_pos = None
    k_n = bitio.rice_k(chg[classes] * chunk_elems, np.full(classes.size, n))
    if layout == LAYOUT_SHARES:
        share = np.minimum((chg[classes] << 16) // max(hit.size, 1), 65535).astype(np.int64)
        gap = (pop[classes] - chg[classes]) * 709  # Golomb's ceil(ln 2 x mean gap), in integers
        m_pos = np.clip(-(-gap // (c * 1024)), 1, (1 << 32) - 1).astype(np.int64)
        spread = 13 * np.array([math.isqrt(int(e)) for e in (chg[classes] * chunk_elems) // n], dtype=np.int64)
        k_n = bitio.rice_k(spread, np.full(classes.size, 8))
    return ClassRecord(
        shift, cbits, classes,
        bitio.rice_k(pop[classes] - chg[classes], c),
        bitio.rice_k(np.where(nbig[classes] > 0, chg[classes] - nbig[classes], chg[classes]), b),
        bitio.rice_k(vsum[classes], b),
        k_n,
        bitio.rice_k(nbig[classes] * chunk_elems, np.full(classes.size, n)),
        share=share, m_pos=m_pos, layout=layout,
    )  # fmt: skip


def read_varint(raw: memoryview | bytes, off: int, what: str) -> tuple[int, int]:
    n = shift = 0
    while True:
        if off >= len(raw) or shift > 56:
            raise FormatError(f"{what} is truncated or has a bad count")
        byte = raw[off]
        off += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return n, off


def _regroup(sizes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Element indices that put groups of ``sizes`` (consecutive) in the group order ``order``."""
    starts = np.cumsum(sizes) - sizes
    s = sizes[order]
    return np.repeat(starts[order] - (np.cumsum(s) - s), s) + np.arange(int(s.sum()), dtype=np.int64)


def encode(old: np.ndarray, new: np.ndarray, dtype: str, changes: Changes, record: ClassRecord | None = None) -> bytes:
    """Encode one chunk's changes against its tensor's class record."""
    if record is None:
        raise ValueError("a ctxs chunk is coded against its tensor's class record")
    a = changes.classes
    if a is None or (a.shift, a.cbits) != (record.shift, record.cbits):
        a = rank_classes(old, new, dtype, field=(record.shift, record.cbits))
    if record.layout == LAYOUT_SHARES:
        pops = np.bincount(kernels.classes(old, record.shift, (1 << record.cbits) - 1), minlength=1 << record.cbits)
        return _pack5(a, record, pops)
    return _pack(a, record)


def _record_index(record: ClassRecord) -> np.ndarray:
    rix = np.full(1 << record.cbits, -1, dtype=np.int64)
    rix[record.classes] = np.arange(record.classes.size)
    return rix


def _pack5(a: ClassCode, record: ClassRecord, pops: np.ndarray) -> bytes:
    """Layout 2 (segment format 5): :func:`deltarl.codec._ctxs5.pack`, run as Python or compiled."""
    args = (a.active, a.counts, a.n_big, a.k_pos, a.k_bv, a.gaps.astype(np.int64), a.big_gaps.astype(np.int64),
            a.big_vals.astype(np.int64), a.neg.astype(np.uint8), pops.astype(np.int64), _record_index(record),
            record.rank_param(), record.k_big_val, record.k_n, record.shares())  # fmt: skip
    jit = kernels.ctx_jit()
    if jit is not None:
        from deltarl.codec import _numba_ctxs_encode

        return _numba_ctxs_encode.pack5(int(a.pos.size), *args, record.cbits).tobytes()
    from deltarl.codec import _ctxs5

    return _ctxs5.pack(int(a.pos.size), *[np.asarray(x, np.int64) if x.dtype != np.uint8 else x for x in args],
                       record.cbits).tobytes()  # fmt: skip


def _pack(a: ClassCode, record: ClassRecord) -> bytes:
    rix = np.full(1 << record.cbits, -1, dtype=np.int64)
    rix[record.classes] = np.arange(record.classes.size)
    where = rix[a.active]
    inrec = np.flatnonzero(where >= 0)
    extra = np.flatnonzero(where < 0)
    order = np.concatenate((inrec[np.argsort(where[inrec])], extra))  # groups: record order, then extras
    m = record.classes.size
    cnt_r = np.zeros(m, dtype=np.int64)
    cnt_r[where[inrec]] = a.counts[inrec]
    big_r = np.zeros(m, dtype=np.int64)
    big_r[where[inrec]] = a.n_big[inrec]
    g_kp, g_kb, g_kv = a.k_pos.copy(), a.k_bg.copy(), a.k_bv.copy()
    g_kp[inrec], g_kb[inrec], g_kv[inrec] = (k[where[inrec]] for k in (record.k_pos, record.k_big_gap, record.k_big_val))
    per = _regroup(a.counts, order)
    big = _regroup(a.n_big, order)
    has = cnt_r > 0
    values = [cnt_r[1:], big_r[has], a.gaps[per], a.big_gaps[big], a.big_vals[big]]
    ks = [record.k_n[1:], record.k_n_big[has], np.repeat(g_kp[order], a.counts[order]),
          np.repeat(g_kb[order], a.n_big[order]), np.repeat(g_kv[order], a.n_big[order])]  # fmt: skip
    v = np.concatenate([x.astype(_U64) for x in values])
    k = np.concatenate([x.astype(np.int64) for x in ks])
    unary, rem, esc = bitio.rice_encode(v, k)
    rbits = int(k[(v >> k.astype(_U64)) < bitio.RICE_ESCAPE].sum())
    bits = np.packbits(np.concatenate((np.unpackbits(np.frombuffer(rem, dtype=np.uint8))[:rbits], a.neg[per])))
    head = [varint(extra.size)]
    for i in extra.tolist():
        head.append(_ENTRY.pack(int(a.active[i]), int(a.k_pos[i]), int(a.k_bg[i]), int(a.k_bv[i])))
        head.append(varint(int(a.counts[i])) + varint(int(a.n_big[i])))
    escapes = esc.astype("<u8").tobytes()
    return b"".join([*head, varint(len(unary)), varint(len(escapes)), unary, escapes, bits.tobytes()])


@dataclass(frozen=True)
class _Parsed:
    extra: tuple[np.ndarray, ...]  # classes, k_pos, k_big_gap, k_big_val, n, n_big of the extra classes
    unary: np.ndarray
    escapes: np.ndarray
    bits: np.ndarray


def _parse(payload: memoryview, changed: int, record: ClassRecord) -> _Parsed:
    raw = bytes(payload[:24]) if len(payload) > 0 and payload[0] == 0 else bytes(payload)  # no extras: 2 varints
    nx, off = read_varint(raw, 0, "ctxs payload")
    if nx > 1 << record.cbits:
        raise FormatError(f"ctxs chunk lists {nx} extra classes")
    rows = []
    last = -1
    for _ in range(nx):
        if off + 4 > len(raw):
            raise FormatError("ctxs extra class is truncated")
        c, kp, kb, kv = _ENTRY.unpack_from(raw, off)
        n, off = read_varint(raw, off + 4, "ctxs extra class")
        nb, off = read_varint(raw, off, "ctxs extra class")
        if c <= last or c >> record.cbits or c in record.classes or max(kp, kb, kv) > 32 or not 0 < n <= changed or nb > n:
            raise FormatError(f"ctxs extra class {c} (k {kp}, {kb}, {kv}, n {n}, n_big {nb}) is invalid")
        last = c
        rows.append((c, kp, kb, kv, n, nb))
    extra = tuple(np.array(rows, dtype=np.int64).reshape(-1, 6).T.copy())
    nu, off = read_varint(raw, off, "ctxs payload")
    ne, off = read_varint(raw, off, "ctxs payload")
    if ne % 8 or off + nu + ne > len(payload):
        raise FormatError("ctxs stream lengths do not fit the payload")
    unary = np.frombuffer(payload[off : off + nu], dtype=np.uint8)
    escapes = np.frombuffer(payload[off + nu : off + nu + ne], dtype="<u8")
    return _Parsed(extra, unary, escapes, np.frombuffer(payload[off + nu + ne :], dtype=np.uint8))


def _width(old: np.ndarray, record: ClassRecord) -> int:
    width = old.dtype.itemsize * 8
    if record.shift + record.cbits > width:
        raise FormatError(f"class record field (shift {record.shift}, bits {record.cbits}) does not fit {width}-bit values")
    return width


def decode(old: np.ndarray, payload: memoryview, changed: int, record: ClassRecord | None = None) -> Decoded:
    """Positions and new bits of one chunk (a scan of the chunk's base), against its class record."""
    if record is None:
        raise FormatError("ctxs chunk without its tensor's class record")
    width = _width(old, record)
    mask = (1 << record.cbits) - 1
    jit = kernels.ctx_jit()
    if record.layout == LAYOUT_SHARES and jit is None:
        return _decode5_numpy(old, record, width, changed, payload)
    p = _parsed(payload, changed, record)
    if jit is None:
        assert p is not None  # layout 1
        return _decode_numpy(old, record, width, changed, p)
    state = _prepare(old, record, width, changed, p, payload)
    (a64,) = jit.words16(old)
    err, pos, old_v, new_v = jit.ctx_scan(old, a64, record.shift, mask, width, changed, 0, *state)
    _check(err)
    return Decoded(pos, new_v, old_v)


def decode_pair(a: tuple[np.ndarray, memoryview, int, ClassRecord], b: tuple[np.ndarray, memoryview, int, ClassRecord]
                ) -> tuple[Decoded, Decoded]:  # fmt: skip
    """``(decode(*a), decode(*b))``, the two 16-bit chunks scanned interleaved when their class fields agree."""
    jit = kernels.ctx_jit()
    (old_a, pay_a, ch_a, rec_a), (old_b, pay_b, ch_b, rec_b) = a, b
    if jit is None or (rec_a.shift, rec_a.cbits) != (rec_b.shift, rec_b.cbits) or old_a.dtype.itemsize != 2 or old_b.dtype.itemsize != 2:
        return decode(*a), decode(*b)
    (a64_a,), (a64_b,) = jit.words16(old_a), jit.words16(old_b)
    if not a64_a.size or not a64_b.size:
        return decode(*a), decode(*b)
    state_a = _prepare(old_a, rec_a, _width(old_a, rec_a), ch_a, _parsed(pay_a, ch_a, rec_a), pay_a)
    state_b = _prepare(old_b, rec_b, _width(old_b, rec_b), ch_b, _parsed(pay_b, ch_b, rec_b), pay_b)
    err_a, pos_a, oa, na, err_b, pos_b, ob, nb = jit.ctx_scan2(
        old_a, a64_a, ch_a, *state_a, old_b, a64_b, ch_b, *state_b, rec_a.shift, (1 << rec_a.cbits) - 1
    )
    _check(err_a)
    _check(err_b)
    return Decoded(pos_a, na, oa), Decoded(pos_b, nb, ob)


def _parsed(payload: memoryview, changed: int, record: ClassRecord) -> _Parsed | None:
    return None if record.layout == LAYOUT_SHARES else _parse(payload, changed, record)


def _prepare(old: np.ndarray, r: ClassRecord, width: int, changed: int, p: _Parsed | None, payload: memoryview
             ) -> tuple[np.ndarray, ...]:  # fmt: skip
    from deltarl.codec import _numba_ctxs

    if p is None:  # layout 2
        err, *state = _numba_ctxs.ctxs5_prepare(
            np.frombuffer(payload, dtype=np.uint8), old.size, width, changed, r.cbits, r.classes, r.rank_param(),
            r.k_big_val, r.k_n, r.shares(),
        )  # fmt: skip
        _check(err)
        return tuple(state)
    prepare: Any = _numba_ctxs.ctxs_prepare
    err, *state = prepare(
        old, r.shift, (1 << r.cbits) - 1, width, changed, r.classes, r.k_pos, r.k_big_gap, r.k_big_val, r.k_n,
        r.k_n_big, *p.extra, p.unary, p.escapes, p.bits,
    )  # fmt: skip
    _check(err)
    return tuple(state)


def _check(err: int) -> None:
    if err:
        raise FormatError(_DECODE_ERRORS[int(err)].replace("ctx ", "ctxs ", 1))


class _Reader:
    """The numpy path's reader of a ctxs payload's shared Rice code (unary, escape and bit streams)."""

    def __init__(self, p: _Parsed) -> None:
        u = np.unpackbits(p.unary)
        ones = np.flatnonzero(u)
        if p.unary.size != (int(ones[-1]) // 8 + 1 if ones.size else 0):
            raise FormatError("ctxs unary stream has trailing bits or bytes")
        self.q = np.diff(ones, prepend=-1) - 1
        if self.q.size and int(self.q.max()) > bitio.RICE_ESCAPE:
            raise FormatError("ctxs unary code longer than the escape length")
        self.esc, self.bits, self.nbytes = p.escapes.astype(_U64), np.unpackbits(p.bits).astype(_U64), p.bits.size
        self.nbits = self.bits.size
        self.bits = np.concatenate((self.bits, np.zeros(1, dtype=_U64)))  # an index past the end reads 0
        self.qi = self.ei = self.bi = 0

    def take(self, ks: np.ndarray, limit: int, what: str) -> np.ndarray:
        n = ks.size
        if self.qi + n > self.q.size:
            raise FormatError("ctxs unary stream holds fewer codes than expected")
        q = self.q[self.qi : self.qi + n]
        self.qi += n
        esc = q == bitio.RICE_ESCAPE
        w = np.where(esc, 0, ks)
        if self.bi + int(w.sum()) > self.nbits:
            raise FormatError("ctxs remainder stream has the wrong length")
        j = np.arange(33)
        live = j[None, :] < w[:, None]
        idx = np.minimum(self.bi + (np.cumsum(w) - w)[:, None] + j[None, :], self.bits.size - 1)
        shifts = np.where(live, w[:, None] - 1 - j[None, :], 0).astype(_U64)
        rem = (np.where(live, self.bits[idx], _U64(0)) << shifts).sum(axis=1, dtype=_U64)
        self.bi += int(w.sum())
        out = (q.astype(_U64) << ks.astype(_U64)) | rem.astype(_U64)
        ne = int(esc.sum())
        if self.ei + ne > self.esc.size:
            raise FormatError("ctxs escape stream does not match the escaped codes")
        ev = self.esc[self.ei : self.ei + ne]
        self.ei += ne
        if ne and bool((ev < (_U64(bitio.RICE_ESCAPE) << ks[esc].astype(_U64))).any()):
            raise FormatError("ctxs escaped value small enough for a plain code")
        out[esc] = ev
        if n and int(out.max()) >= limit:
            raise FormatError(f"ctxs {what} out of range")
        return out.astype(np.int64)

    def signs(self, changed: int) -> np.ndarray:
        if self.qi != self.q.size or self.ei != self.esc.size:
            raise FormatError("ctxs unary or escape stream has trailing codes")
        if (self.bi + changed + 7) // 8 != self.nbytes:
            raise FormatError("ctxs remainder stream has the wrong length")
        return self.bits[self.bi : self.bi + changed].astype(np.uint8)


def _decode_numpy(old: np.ndarray, r: ClassRecord, width: int, changed: int, p: _Parsed) -> Decoded:
    rd = _Reader(p)
    xc, xkp, xkb, xkv, xn, xnb = p.extra
    cnt_r = np.zeros(r.classes.size, dtype=np.int64)
    cnt_r[1:] = rd.take(r.k_n[1:], changed + 1, "class count")
    cnt_r[0] = changed - int(cnt_r[1:].sum()) - int(xn.sum())
    if cnt_r[0] < 0:
        raise FormatError(_DECODE_ERRORS[6].replace("ctx ", "ctxs ", 1))
    has = cnt_r > 0
    big_r = rd.take(r.k_n_big[has], changed + 1, "large-value count")
    if bool((big_r > cnt_r[has]).any()):
        raise FormatError(_DECODE_ERRORS[5].replace("ctx ", "ctxs ", 1))
    active = np.concatenate((r.classes[has], xc))
    counts = np.concatenate((cnt_r[has], xn))
    n_big = np.concatenate((big_r, xnb))
    kp = np.concatenate((r.k_pos[has], xkp))
    kb = np.concatenate((r.k_big_gap[has], xkb))
    kv = np.concatenate((r.k_big_val[has], xkv))
    gaps = rd.take(np.repeat(kp, counts), old.size, "rank gap")
    bg = rd.take(np.repeat(kb, n_big), changed, "value gap")
    bv = rd.take(np.repeat(kv, n_big), (1 << (width - 1)) - 1, "value difference")
    neg = rd.signs(changed)
    up = np.argsort(active, kind="stable")  # the numpy select takes the classes ascending
    per, big = _regroup(counts, up), _regroup(n_big, up)
    return changes_numpy(old, r.shift, (1 << r.cbits) - 1, width, (active[up], counts[up], n_big[up]),
                         (gaps[per], bg[big], bv[big], neg[per]))  # fmt: skip



def _decode5_numpy(old: np.ndarray, r: ClassRecord, width: int, changed: int, payload: memoryview) -> Decoded:
    """Layout 2 without numba: :func:`deltarl.codec._ctxs5.parse` as Python, then the numpy select."""
    from deltarl.codec import _ctxs5  # (numba's register_jitable: imported when a chunk needs it)


    raw = bytes(payload)  # Python ints from bytes and a list for the reader's state: ~1 us a code
    err, active, counts, n_big, gaps, bg, bv, sbase = _ctxs5.parse(
        raw[::-1], raw, [0] * 6, changed, old.size, width, r.cbits, *(x.tolist() for x in (
            r.classes, r.rank_param(), r.k_big_val, r.k_n, r.shares()))
    )  # fmt: skip
    pay = np.frombuffer(raw, dtype=np.uint8)
    _check(int(err))
    neg = np.unpackbits(pay, count=sbase + changed)[sbase:]
    up = np.argsort(active, kind="stable")  # the numpy select takes the classes ascending
    per, big = _regroup(counts, up), _regroup(n_big, up)
    try:
        return changes_numpy(old, r.shift, (1 << r.cbits) - 1, width, (active[up], counts[up], n_big[up]),
                             (gaps[per], bg[big], bv[big], neg[per]))  # fmt: skip
    except FormatError as err:  # the numba path's words
        raise FormatError(str(err).replace("ctx ", "ctxs ", 1)) from None
