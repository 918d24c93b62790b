"""The ``ctxs`` decoder without numba (``DELTARL_NO_NUMBA``): segment formats 3 and 4's streams read
with numpy, format 5's with :mod:`deltarl.codec._ctxs5` run as Python; both end in ``ctx``'s numpy
select (:func:`deltarl.codec.ctx.changes_numpy`). The numba path gives the same changes and errors."""

from __future__ import annotations

import numpy as np

from deltarl.codec import _ctxs5, bitio
from deltarl.codec.chunk import Decoded
from deltarl.codec.ctx import _DECODE_ERRORS, changes_numpy
from deltarl.codec.ctxs import ClassRecord, _check
from deltarl.codec.ctxs import _Parsed as Parsed
from deltarl.codec.ctxs import _regroup as regroup
from deltarl.errors import FormatError

_U64 = np.uint64


class Reader:
    """The numpy path's reader of a ctxs payload's shared Rice code (unary, escape and bit streams)."""

    def __init__(self, p: Parsed) -> None:
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


def decode_numpy(old: np.ndarray, r: ClassRecord, width: int, changed: int, p: Parsed) -> Decoded:
    rd = Reader(p)
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
    per, big = regroup(counts, up), regroup(n_big, up)
    return changes_numpy(old, r.shift, (1 << r.cbits) - 1, width, (active[up], counts[up], n_big[up]),
                         (gaps[per], bg[big], bv[big], neg[per]))  # fmt: skip



def decode5_numpy(old: np.ndarray, r: ClassRecord, width: int, changed: int, payload: memoryview) -> Decoded:
    """Layout 2 without numba: :func:`deltarl.codec._ctxs5.parse` as Python, then the numpy select."""

    raw = bytes(payload)  # Python ints from bytes and a list for the reader's state: ~1 us a code
    err, active, counts, n_big, gaps, bg, bv, sbase = _ctxs5.parse(
        raw[::-1], raw, [0] * 6, changed, old.size, width, r.cbits, *(x.tolist() for x in (
            r.classes, r.rank_param(), r.k_big_val, r.k_n, r.shares()))
    )  # fmt: skip
    pay = np.frombuffer(raw, dtype=np.uint8)
    _check(int(err))
    neg = np.unpackbits(pay, count=sbase + changed)[sbase:]
    up = np.argsort(active, kind="stable")  # the numpy select takes the classes ascending
    per, big = regroup(counts, up), regroup(n_big, up)
    try:
        return changes_numpy(old, r.shift, (1 << r.cbits) - 1, width, (active[up], counts[up], n_big[up]),
                             (gaps[per], bg[big], bv[big], neg[per]))  # fmt: skip
    except FormatError as err:  # the numba path's words
        raise FormatError(str(err).replace("ctx ", "ctxs ", 1)) from None
