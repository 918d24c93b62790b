"""numba ``ctxs`` decoder: a cell chunk's payload and its tensor's class record -> the scan state of
:mod:`deltarl.codec._numba_ctx` (whose ``ctx_scan`` / ``ctx_scan2`` then find the changes).

Every Rice code of a ``ctxs`` payload shares one unary, one remainder and one escape stream, read
in order (class counts, large-value counts, rank gaps, large-value gaps, large values) through one
reader whose state lives in two small arrays; the sign bits follow the last remainder bit.
"""
# mypy: ignore-errors

from __future__ import annotations

import numpy as np
from numba import njit

from deltarl.codec import _ctxs5
from deltarl.codec._numba_ctx import (
    BIG_GAP_OUTSIDE,
    GAP_OUTSIDE,
    OK,
    RANK_BEYOND_CLASS,
    RICE_ESCAPES,
    RICE_FEW_CODES,
    RICE_LONG_RUN,
    RICE_REMAINDER,
    RICE_SMALL_ESCAPE,
    RICE_TRAILING,
    TABLE_BAD_ENTRY,
    TABLE_SUM,
    VALUE_RANGE,
    _clz64,
    _count_word,
    _fill,
    _hits_word,
    ctx_scan,
    ctx_scan2,
    outputs2,
)

__all__ = ["ctxs5_prepare", "ctxs_cells", "ctxs_prepare"]

_ESCAPE = 40


@njit(cache=True, nogil=True)
def _rice_seq(unary, rem, esc, st, buf, ks, ns, ngroups, limit, out, skip):
    """Decode the next ``sum(ns)`` Rice codes (``ns[g]`` with parameter ``ks[g]``) into ``out``,
    leaving ``skip`` slots after each group; every value must be below ``limit``. The reader's
    state: ``st`` = (unary bytes read, unary bits buffered, remainder bytes read, remainder bits
    buffered, escapes read), ``buf`` = (unary buffer, remainder buffer). Returns an error code."""
    nu = unary.size
    nr = rem.size
    ui, ubits, ri, rbits, ei = st[0], st[1], st[2], st[3], st[4]
    ubuf, rbuf = buf[0], buf[1]
    err = OK
    t = 0
    for g in range(ngroups):
        k = ks[g]
        uk = np.uint64(k)
        for _ in range(ns[g]):
            while ubits <= 56 and ui < nu:
                ubuf |= np.uint64(unary[ui]) << np.uint64(56 - ubits)
                ubits += 8
                ui += 1
            q = _clz64(ubuf)
            if q > _ESCAPE:
                err = RICE_LONG_RUN if ubits > _ESCAPE else RICE_FEW_CODES
                break
            if q >= ubits:
                err = RICE_FEW_CODES
                break
            ubuf <<= np.uint64(q + 1)
            ubits -= q + 1
            if q == _ESCAPE:
                if ei >= esc.size:
                    err = RICE_ESCAPES
                    break
                v = esc[ei]
                ei += 1
                if v < (np.uint64(_ESCAPE) << uk):
                    err = RICE_SMALL_ESCAPE
                    break
            else:
                v = np.uint64(q) << uk
                if k > 0:
                    if rbits < k:
                        while rbits <= 56 and ri < nr:
                            rbuf |= np.uint64(rem[ri]) << np.uint64(56 - rbits)
                            rbits += 8
                            ri += 1
                        if rbits < k:
                            err = RICE_REMAINDER
                            break
                    v |= rbuf >> np.uint64(64 - k)
                    rbuf <<= uk
                    rbits -= k
            if v >= limit:
                err = VALUE_RANGE
                break
            out[t] = np.int64(v)
            t += 1
        if err:
            break
        t += skip
    st[0], st[1], st[2], st[3], st[4] = ui, ubits, ri, rbits, ei
    buf[0], buf[1] = ubuf, rbuf
    return err


@njit(cache=True, nogil=True)
def ctxs_prepare(old, shift, mask, width, changed, rc, rkp, rkb, rkv, rkn, rknb, xc, xkp, xkb, xkv, xn, xnb,
                 unary, esc, bits):  # fmt: skip
    """Parse and check a ``ctxs`` chunk against its class record (``rc`` classes in record order with
    their ``k_pos``, ``k_big_gap``, ``k_big_val``, ``k_n``, ``k_n_big``) and its extra classes
    (``xc`` ascending, with their k and counts): (error, g2, dd, ptr, rem) as ``ctx_prepare``."""
    n = old.size
    nclass = mask + 1
    m = rc.size
    nx = xc.size
    g2 = np.empty(changed + m + nx + 2, np.int64)
    dd = np.empty(changed + m + nx + 2, np.int64)
    ptr = np.empty(nclass, np.int64)
    rem = np.empty(nclass, np.int64)
    st = np.zeros(5, np.int64)
    buf = np.zeros(2, np.uint64)
    cnt_r = np.zeros(m, np.int64)
    ones = np.ones(max(m, 1), np.int64)
    lim = np.uint64(changed + 1)
    err = _rice_seq(unary, bits, esc, st, buf, rkn[1:], ones, m - 1, lim, cnt_r[1:], 0) if m > 1 else OK
    if err:
        return (TABLE_SUM if err == VALUE_RANGE else err), g2, dd, ptr, rem
    rest = changed
    for i in range(nx):
        rest -= xn[i]
    for i in range(1, m):
        rest -= cnt_r[i]
    if rest < 0 or (m == 0 and rest != 0):
        return TABLE_SUM, g2, dd, ptr, rem
    if m:
        cnt_r[0] = rest
    na = nx
    for i in range(m):
        na += cnt_r[i] > 0
    active = np.empty(na, np.int64)
    kp = np.empty(na, np.int64)
    kb = np.empty(na, np.int64)
    kv = np.empty(na, np.int64)
    kn = np.empty(na, np.int64)
    cnt = np.empty(na, np.int64)
    nbig = np.zeros(na, np.int64)
    a = 0
    for i in range(m):
        if cnt_r[i] > 0:
            active[a], kp[a], kb[a], kv[a], kn[a], cnt[a] = rc[i], rkp[i], rkb[i], rkv[i], rknb[i], cnt_r[i]
            a += 1
    nr = a
    err = _rice_seq(unary, bits, esc, st, buf, kn[:nr], ones, nr, lim, nbig, 0)
    if err:
        return (TABLE_SUM if err == VALUE_RANGE else err), g2, dd, ptr, rem
    for i in range(nr):
        if nbig[i] > cnt[i]:
            return TABLE_BAD_ENTRY, g2, dd, ptr, rem
    for i in range(nx):
        active[nr + i], kp[nr + i], kb[nr + i], kv[nr + i] = xc[i], xkp[i], xkb[i], xkv[i]
        cnt[nr + i], nbig[nr + i] = xn[i], xnb[i]
    err = _rice_seq(unary, bits, esc, st, buf, kp, cnt, na, np.uint64(n), g2, 1)
    if err:
        return (GAP_OUTSIDE if err == VALUE_RANGE else err), g2, dd, ptr, rem
    nb = 0
    for i in range(na):
        nb += nbig[i]
    bg = np.empty(nb, np.int64)
    err = _rice_seq(unary, bits, esc, st, buf, kb, nbig, na, np.uint64(changed), bg, 0)
    if err:
        return (BIG_GAP_OUTSIDE if err == VALUE_RANGE else err), g2, dd, ptr, rem
    bv = np.empty(nb, np.int64)
    err = _rice_seq(unary, bits, esc, st, buf, kv, nbig, na, np.uint64((np.int64(1) << (width - 1)) - 1), bv, 0)
    if err:
        return err, g2, dd, ptr, rem
    used = st[0] * 8 - st[1]
    if (used + 7) // 8 != unary.size or buf[0] != 0:
        return RICE_TRAILING, g2, dd, ptr, rem
    if st[4] != esc.size:
        return RICE_ESCAPES, g2, dd, ptr, rem
    sbase = st[2] * 8 - st[3]
    if (sbase + changed + 7) // 8 != bits.size:
        return RICE_REMAINDER, g2, dd, ptr, rem
    return _fill(nclass, changed, width, na, active, cnt, nbig, bg, bv, bits, sbase, g2, dd, ptr, rem)


@njit(cache=True, nogil=True)
def ctxs5_prepare(pay, n_elems, width, changed, cbits, rc, rkp, rkv, rkn, rsh):
    """A layout 2 (segment format 5) chunk: :func:`deltarl.codec._ctxs5.parse`, then the scan state:
    (error, g2, dd, ptr, rem) as ``ctx_prepare``."""
    nclass = 1 << cbits
    err, active, counts, n_big, gaps, bg, bv, sbase = _ctxs5.parse(pay[::-1].copy(), pay, _ctxs5.reader_start(),
                                                                   changed, n_elems, width, cbits, rc, rkp, rkv,
                                                                   rkn, rsh)  # fmt: skip
    na = active.size
    g2 = np.empty(changed + na + 2, np.int64)
    dd = np.empty(changed + na + 2, np.int64)
    ptr = np.empty(nclass, np.int64)
    rem = np.empty(nclass, np.int64)
    if err:
        return err, g2, dd, ptr, rem
    slot = 0
    t = 0
    for a in range(na):
        for j in range(counts[a]):
            g2[slot + j] = gaps[t + j]
        t += counts[a]
        slot += counts[a] + 1
    return _fill(nclass, changed, width, na, active, counts, n_big, bg, bv, pay, sbase, g2, dd, ptr, rem)


@njit(cache=True, nogil=True)
def _varint(raw, off, end):
    """``(value, offset after it)``; value -1 when truncated or longer than 9 bytes."""
    n = np.int64(0)
    sh = 0
    while True:
        if off >= end or sh > 56:
            return np.int64(-1), off
        b = raw[off]
        off += 1
        n |= np.int64(b & 0x7F) << sh
        sh += 7
        if b < 0x80:
            return n, off


@njit(cache=True, nogil=True)
def _cell_streams(raw, off, end, changed, cbits, rc):
    """Parse one payload ``raw[off:end]`` as ``ctxs._parse`` does: (ok, extra columns, unary, escapes,
    bits); not ok on anything ``_parse`` rejects (the caller then asks it for the message)."""
    none = np.zeros(0, np.int64)
    empty = raw[0:0]
    nx, off = _varint(raw, off, end)
    if nx < 0 or nx > (1 << cbits):
        return False, none, none, none, none, none, none, empty, np.zeros(0, np.uint64), empty
    xs = np.empty((6, max(nx, 0)), np.int64)
    xc, xkp, xkb, xkv, xn, xnb = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5]
    last = -1
    for i in range(nx):
        if off + 4 > end:
            return False, xc, xkp, xkb, xkv, xn, xnb, empty, np.zeros(0, np.uint64), empty
        c, kp, kb, kv = np.int64(raw[off]), np.int64(raw[off + 1]), np.int64(raw[off + 2]), np.int64(raw[off + 3])
        n, off = _varint(raw, off + 4, end)
        nb, off = _varint(raw, off, end)
        bad = n < 0 or nb < 0 or c <= last or (c >> cbits) != 0 or max(kp, max(kb, kv)) > 32
        bad = bad or not (0 < n <= changed) or nb > n
        for j in range(rc.size):
            bad = bad or rc[j] == c
        if bad:
            return False, xc, xkp, xkb, xkv, xn, xnb, empty, np.zeros(0, np.uint64), empty
        last = c
        xc[i], xkp[i], xkb[i], xkv[i], xn[i], xnb[i] = c, kp, kb, kv, n, nb
    nu, off = _varint(raw, off, end)
    ne, off = _varint(raw, off, end)
    if nu < 0 or ne < 0 or ne % 8 or off + nu + ne > end:
        return False, xc, xkp, xkb, xkv, xn, xnb, empty, np.zeros(0, np.uint64), empty
    esc = np.zeros(ne // 8, np.uint64)
    for i in range(ne // 8):
        for b in range(8):
            esc[i] |= np.uint64(raw[off + nu + 8 * i + b]) << np.uint64(8 * b)
    return True, xc, xkp, xkb, xkv, xn, xnb, raw[off : off + nu], esc, raw[off + nu + ne : end]


@njit(cache=True, nogil=True)
def _cell_state(span, s0, scratch, raw, table, i, shift, cbits, width, rc, rkp, rkb, rkv, rkn, rknb, rsh, layout, copy):
    """Chunk ``i`` of ``table`` parsed, its base copied into ``scratch`` a row of its cell at a time
    (unless not ``copy``: it is read in place), and prepared: (error, g2, dd, ptr, rem) as ``ctx_prepare``."""
    off, nbytes, changed, start, count = table[i, 0], table[i, 1], table[i, 2], table[i, 3], table[i, 4]
    origin, w = table[i, 5], table[i, 6]
    if layout == 2:
        ok = True
        xc = xkp = xkb = xkv = xn = xnb = np.zeros(0, np.int64)
        unary, esc, bits = raw[0:0], np.zeros(0, np.uint64), raw[0:0]
    else:
        ok, xc, xkp, xkb, xkv, xn, xnb, unary, esc, bits = _cell_streams(raw, off, off + nbytes, changed, cbits, rc)
    if not ok:
        none = np.zeros(0, np.int64)
        return TABLE_BAD_ENTRY, none, none, none, none
    old = scratch[:count]  # (prepare reads its size only)
    idx = start
    k = 0 if copy else count
    while k < count:
        q = idx // w
        c = idx - q * w
        run = min(w - c, count - k)
        b = origin + q * s0 + c
        old[k : k + run] = span[b : b + run]
        k += run
        idx += run
    if layout == 2:
        return ctxs5_prepare(raw[off : off + nbytes], count, width, changed, cbits, rc, rkp, rkv, rkn, rsh)
    return ctxs_prepare(old, shift, (1 << cbits) - 1, width, changed, rc, rkp, rkb, rkv, rkn, rknb,
                        xc, xkp, xkb, xkv, xn, xnb, unary, esc, bits)  # fmt: skip


@njit(cache=True, nogil=True)
def _emit(table, i, s0, pos, o, n, out_pos, out_old, out_new):
    """Chunk ``i``'s hits (positions in its cell's row-major order) as span offsets into ``out_*``."""
    start, origin, w, at = table[i, 3], table[i, 5], table[i, 6], table[i, 7]
    for t in range(table[i, 2]):
        e = start + pos[t]
        q = e // w
        out_pos[at + t] = origin + q * s0 + e - q * w
        out_old[at + t] = o[t]
        out_new[at + t] = n[t]


@njit(cache=True, nogil=True)
def _rows_in_place(table, i, s0, span64):
    """Rows of chunks ``i`` and ``i + 1`` when both are whole rows of cells of one width, each row's
    base 8-byte aligned in ``span64`` (the span's u64 view): their bases are scanned in place, a row
    of each at a time; else -1 (copied)."""
    w, count = table[i, 6], table[i, 4]
    if span64.size == 0 or w % 4 or s0 % 4 or count == 0 or count % w:
        return -1
    for j in (i, i + 1):
        start, origin = table[j, 3], table[j, 5]
        if table[j, 6] != w or table[j, 4] != count or start % w or origin % 4:
            return -1
        if origin + (start // w + count // w - 1) * s0 + w > span64.size * 4:
            return -1
    return count // w


@njit(cache=True, nogil=True)
def _scan2_rows(span64, like, table, i, s0, rows, shift, mask, ca, g2a, dda, ptra, rema, cb, g2b, ddb, ptrb, remb):
    """:func:`ctx_scan2` of chunks ``i`` and ``i + 1`` (see :func:`_rows_in_place`) read in place:
    a row of each at a time, until both have every change (positions relative to each chunk; old
    and new bits of ``like``'s dtype)."""
    w = table[i, 6]
    pa, oa, na, pb, ob, nb = outputs2(ca, cb, like)
    um = np.uint64(mask)
    sh = np.uint64(shift)
    wa = (table[i, 5] + table[i, 3] // w * s0) // 4
    wb = (table[i + 1, 5] + table[i + 1, 3] // w * s0) // 4
    ka = 0
    kb = 0
    for r in range(rows):
        if ka == ca and kb == cb:
            break
        for j in range(w // 4):
            x = span64[wa + j]
            u = span64[wb + j]
            y = x >> sh
            v = u >> sh
            hit_a = _count_word(rema, y, um)
            hit_b = _count_word(remb, v, um)
            if (hit_a | hit_b) < 0:  # a countdown past its last target stays far from zero
                if hit_a < 0:
                    ka = _hits_word(rema, ptra, g2a, dda, x, y, um, r * w + 4 * j, pa, oa, na, ka)
                if hit_b < 0:
                    kb = _hits_word(remb, ptrb, g2b, ddb, u, v, um, r * w + 4 * j, pb, ob, nb, kb)
        wa += s0 // 4
        wb += s0 // 4
    ea = OK if ka == ca else RANK_BEYOND_CLASS
    eb = OK if kb == cb else RANK_BEYOND_CLASS
    return ea, pa[:ca], oa[:ca], na[:ca], eb, pb[:cb], ob[:cb], nb[:cb]


@njit(cache=True, nogil=True)
def ctxs_cells(span, span64, s0, scratch, scratch64, raw, table, out_pos, out_old, out_new, shift, cbits, width,
               rc, rkp, rkb, rkv, rkn, rknb, rsh, layout):  # fmt: skip
    """Decode the ``ctxs`` cell chunks of one tensor, each against its own base region of ``span``
    (rows ``s0`` elements apart), into ``out_*`` (span offsets, old and new bits). ``table`` rows:
    payload offset in ``raw``, payload bytes, changed, first cell element, elements, the cell's origin
    in the span, the cell's row width in elements, first output slot. ``scratch`` holds two halves,
    each the largest chunk's base rounded up to 4 elements (``scratch64``: its u64 view for 16-bit
    elements, else empty; ``span64``: the span's, when 16-bit and 8-byte aligned, else empty): 16-bit
    chunks are scanned two at a time (each countdown a dependency chain the core overlaps with the
    other's), in place when :func:`_rows_in_place` allows, else copied. Returns ``(error, index of
    the first chunk that failed)``, ``(OK, -1)`` when every chunk decoded."""
    mask = (1 << cbits) - 1
    half = scratch.size // 2
    sa, sb = scratch[:half], scratch[half:]
    nt = table.shape[0]
    i = 0
    while i < nt:
        pair = scratch64.size > 0 and i + 1 < nt
        rows = _rows_in_place(table, i, s0, span64) if pair else -1
        err, g2, dd, ptr, rem = _cell_state(span, s0, sa, raw, table, i, shift, cbits, width,
                                            rc, rkp, rkb, rkv, rkn, rknb, rsh, layout, rows < 0)  # fmt: skip
        if err:
            return err, i
        ca, count = table[i, 2], table[i, 4]
        a64 = scratch64[: count // 4] if scratch64.size else scratch64
        errb = OK
        if pair:
            errb, g2b, ddb, ptrb, remb = _cell_state(span, s0, sb, raw, table, i + 1, shift, cbits, width,
                                                     rc, rkp, rkb, rkv, rkn, rknb, rsh, layout, rows < 0)  # fmt: skip
            if errb == OK:
                cb, countb = table[i + 1, 2], table[i + 1, 4]
                if rows >= 0:
                    ea, pa, oa, na, eb, pb, ob, nb = _scan2_rows(span64, sa, table, i, s0, rows, shift, mask,
                                                                 ca, g2, dd, ptr, rem, cb, g2b, ddb, ptrb, remb)  # fmt: skip
                else:
                    b64 = scratch64[half // 4 : half // 4 + countb // 4]
                    ea, pa, oa, na, eb, pb, ob, nb = ctx_scan2(sa[:count], a64, ca, g2, dd, ptr, rem,
                                                               sb[:countb], b64, cb, g2b, ddb, ptrb, remb, shift, mask)  # fmt: skip
                if ea:
                    return ea, i
                if eb:
                    return eb, i + 1
                _emit(table, i, s0, pa, oa, na, out_pos, out_old, out_new)
                _emit(table, i + 1, s0, pb, ob, nb, out_pos, out_old, out_new)
                i += 2
                continue
            if rows >= 0:  # the first's base was left in place: copied now, for its scan alone
                err, g2, dd, ptr, rem = _cell_state(span, s0, sa, raw, table, i, shift, cbits, width,
                                                    rc, rkp, rkb, rkv, rkn, rknb, rsh, layout, True)  # fmt: skip
        err, pos, o, n = ctx_scan(sa[:count], a64, shift, mask, width, ca, 0, g2, dd, ptr, rem)
        if err:
            return err, i
        if errb:  # the second of the pair failed before its scan; the first came out whole
            return errb, i + 1
        _emit(table, i, s0, pos, o, n, out_pos, out_old, out_new)
        i += 1
    return OK, -1
