"""numba ``ctxs`` encoder: a tensor's cell chunks coded against its class record in one call.

Per chunk, as ``ctxs.encode`` does chunk by chunk (and byte for byte the same): its changes found
and ranked in their classes (the record's class field) by a scan of the cell's rows where they lie
(no copy, no chunk-sized arrays; whole cells of one row band side by side, a tensor row at a time;
four class-counter tables, one per 16-bit lane of a word), their ctx code built in class-major order
as ``_numba_kernels._ctx_arrays`` builds it, and, where ``ctxs`` is the codec ``auto`` would choose
alone, its payload packed: the extra classes, one Rice code (``_numba_bits.rice_encode``) of the
class counts, the large-value counts, the rank gaps, the large-value gaps and the large values in
the record's class order (then the extra classes'), and the signs after the last remainder bit
(docs/FORMAT.md, codec 6). A chunk another codec could code (``sparse``, ``dense``), or one with a
NaN or Inf among its new values, is left to the caller's chunk-by-chunk path.
"""
# mypy: ignore-errors

from __future__ import annotations

import numpy as np
from numba import njit

from deltarl.codec import _ctxs5
from deltarl.codec._numba_bits import rice_encode
from deltarl.codec._numba_kernels import class_streams
from deltarl.codec.bitio import RICE_ESCAPE

__all__ = ["ctxs_encode_cells"]

CELL_CTXS, CELL_OTHER = 1, 2  # ctxs_cells.CELL_CTXS, ctxs_cells.CELL_OTHER (it imports this module, not the other way)


@njit(cache=True, nogil=True)
def _put_varint(out, at, n):
    while n >= 0x80:
        out[at] = np.uint8((n & 0x7F) | 0x80)
        n >>= 7
        at += 1
    out[at] = np.uint8(n)
    return at + 1


@njit(cache=True, nogil=True)
def _grow(out, need):
    if need <= out.size:
        return out
    bigger = np.empty(max(need, 2 * out.size), np.uint8)
    bigger[: out.size] = out
    return bigger


@njit(cache=True, nogil=True)
def _pack(out, at, changed, active, counts, n_big, k_pos, k_bg, k_bv, gaps, big_gaps, big_vals, neg,
          rix, rkp, rkb, rkv, rkn, rknb):  # fmt: skip
    """Append one chunk's ``ctxs`` payload to ``out`` at ``at``: (out, possibly grown; its end)."""
    m = rkp.size
    na = active.size
    cnt_r = np.zeros(m, np.int64)
    big_r = np.zeros(m, np.int64)
    slot = np.full(m, -1, np.int64)
    nx = 0
    for a in range(na):
        r = rix[active[a]]
        if r >= 0:
            cnt_r[r], big_r[r], slot[r] = counts[a], n_big[a], a
        else:
            nx += 1
    order = np.empty(na, np.int64)  # record order, then the extra classes ascending
    gkp = np.empty(na, np.int64)
    gkb = np.empty(na, np.int64)
    gkv = np.empty(na, np.int64)
    o = 0
    for r in range(m):
        if slot[r] >= 0:
            order[o], gkp[o], gkb[o], gkv[o] = slot[r], rkp[r], rkb[r], rkv[r]
            o += 1
    for a in range(na):
        if rix[active[a]] < 0:
            order[o], gkp[o], gkb[o], gkv[o] = a, k_pos[a], k_bg[a], k_bv[a]
            o += 1
    cstart, bstart = _ctxs5.offsets(counts, n_big)
    b = bstart[na - 1] + n_big[na - 1] if na else 0
    nhas = 0
    for r in range(m):
        nhas += cnt_r[r] > 0
    ncodes = max(m - 1, 0) + nhas + changed + 2 * b
    vals = np.empty(ncodes, np.uint64)
    ks = np.empty(ncodes, np.int64)
    t = 0
    for r in range(1, m):
        vals[t], ks[t] = cnt_r[r], rkn[r]
        t += 1
    for r in range(m):
        if cnt_r[r] > 0:
            vals[t], ks[t] = big_r[r], rknb[r]
            t += 1
    for o in range(na):
        a = order[o]
        for j in range(cstart[a], cstart[a] + counts[a]):
            vals[t], ks[t] = gaps[j], gkp[o]
            t += 1
    for o in range(na):
        a = order[o]
        for j in range(bstart[a], bstart[a] + n_big[a]):
            vals[t], ks[t] = big_gaps[j], gkb[o]
            t += 1
    for o in range(na):
        a = order[o]
        for j in range(bstart[a], bstart[a] + n_big[a]):
            vals[t], ks[t] = big_vals[j], gkv[o]
            t += 1
    unary, rem, esc = rice_encode(vals, ks, RICE_ESCAPE)
    rbits = 0
    ne = 0
    for t in range(ncodes):
        if esc[t]:
            ne += 1
        else:
            rbits += ks[t]
    out = _grow(out, at + 40 + 24 * nx + unary.size + 8 * ne + (rbits + changed + 7) // 8)
    at = _put_varint(out, at, nx)
    for a in range(na):  # the extra classes, ascending
        if rix[active[a]] < 0:
            out[at], out[at + 1], out[at + 2], out[at + 3] = active[a], k_pos[a], k_bg[a], k_bv[a]
            at = _put_varint(out, at + 4, counts[a])
            at = _put_varint(out, at, n_big[a])
    at = _put_varint(out, at, unary.size)
    at = _put_varint(out, at, 8 * ne)
    out[at : at + unary.size] = unary
    at += unary.size
    for t in range(ncodes):
        if esc[t]:
            v = vals[t]
            for y in range(8):
                out[at] = np.uint8((v >> np.uint64(8 * y)) & np.uint64(0xFF))
                at += 1
    whole = rbits // 8  # the remainder bits, then one sign bit a change in payload order
    out[at : at + whole] = rem[:whole]
    at += whole
    nbits = rbits - 8 * whole
    acc = np.int64(rem[whole]) >> (8 - nbits) if nbits else np.int64(0)
    for o in range(na):
        a = order[o]
        for j in range(cstart[a], cstart[a] + counts[a]):
            acc = (acc << 1) | np.int64(neg[j])
            nbits += 1
            if nbits == 8:
                out[at] = np.uint8(acc)
                at += 1
                acc = 0
                nbits = 0
    if nbits:
        out[at] = np.uint8(acc << (8 - nbits))
        at += 1
    return out, at


@njit(cache=True, nogil=True)
def _bits(mask):
    k = 0
    while mask:
        k += 1
        mask >>= 1
    return k


@njit(cache=True, nogil=True)
def _grown(ch):
    bigger = np.empty((2 * ch.shape[0], ch.shape[1]), ch.dtype)
    bigger[: ch.shape[0]] = ch
    return bigger


@njit(cache=True, nogil=True)
def _run(old, new, a64, b64, b, end, base, cid, c4, t0, ch, k, shift, mask):
    """Rank the changes of ``old[b : end]`` (chunk index of tensor index e: ``base + e``) within their
    classes, counting every element's class in the tables ``c4[t0 : t0 + 4 * classes]`` (four, one per
    16-bit lane of a word, so that a run of one class does not wait on one counter; a class's count
    is their sum); change ``k``, ``k + 1``, ... into rows of ``ch`` (chunk index, rank, tensor index,
    ``cid``). Returns (k, where it stopped): ``end``, or the first tensor index whose changes would
    not fit (the caller grows ``ch`` and goes on from there)."""
    um = np.uint64(mask)  # unsigned indices: numba checks a signed one for wrapping around
    n0 = np.uint64(t0)
    n1, n2, n3 = n0 + um + np.uint64(1), n0 + np.uint64(2) * (um + np.uint64(1)), n0 + np.uint64(3) * (um + np.uint64(1))
    s0, s1, s2, s3 = np.uint64(shift), np.uint64(16 + shift), np.uint64(32 + shift), np.uint64(48 + shift)
    cap = ch.shape[0]
    i = b
    if a64.size:
        while i < end and i % 4:
            h = (np.uint64(old[i]) >> s0) & um
            if old[i] != new[i]:
                if k == cap:
                    return k, i
                ch[k, 0], ch[k, 1], ch[k, 2], ch[k, 3] = base + i, c4[h + n0] + c4[h + n1] + c4[h + n2] + c4[h + n3], i, cid
                k += 1
            c4[h + n0] += 1
            i += 1
        for w64 in range(np.uint64(i // 4), np.uint64(end // 4)):
            x = a64[w64]
            c0 = ((x >> s0) & um) + n0
            c1 = ((x >> s1) & um) + n1
            c2 = ((x >> s2) & um) + n2
            c3 = ((x >> s3) & um) + n3
            d = x ^ b64[w64]
            if d != 0:
                e4 = 4 * np.int64(w64)
                if k + 4 > cap:
                    return k, e4
                for j in range(4):
                    if (d >> np.uint64(16 * j)) & np.uint64(0xFFFF):
                        c = (x >> np.uint64(16 * j + shift)) & um
                        r = c4[c + n0] + c4[c + n1] + c4[c + n2] + c4[c + n3]
                        r += (j > 0 and c0 == c + n0) + (j > 1 and c1 == c + n1) + (j > 2 and c2 == c + n2)
                        ch[k, 0], ch[k, 1], ch[k, 2], ch[k, 3] = base + e4 + j, r, e4 + j, cid
                        k += 1
            c4[c0] += 1
            c4[c1] += 1
            c4[c2] += 1
            c4[c3] += 1
        i = max(i, end // 4 * 4)
    for e in range(i, end):
        t = (np.uint64(old[e]) >> s0) & um
        if old[e] != new[e]:
            if k == cap:
                return k, e
            ch[k, 0], ch[k, 1], ch[k, 2], ch[k, 3] = base + e, c4[t + n0] + c4[t + n1] + c4[t + n2] + c4[t + n3], e, cid
            k += 1
        c4[t + n0] += 1
    return k, end


@njit(cache=True, nogil=True)
def _scan(old, new, a64, b64, stride, origin, w, start, stop, shift, mask, c4, ch):
    """The changes of elements ``start .. stop`` of a cell (its first element at ``origin``, rows ``w``
    elements wide and ``stride`` apart), a row at a time (:func:`_run`, one table set ``c4``):
    (count, ``ch`` grown as needed)."""
    c4[:] = 0
    k = 0
    q = start // w
    b = origin + q * stride + start - q * w
    idx = start
    while idx < stop:
        end = b + min(w - (idx - q * w), stop - idx)
        base = idx - start - b
        k, e = _run(old, new, a64, b64, b, end, base, 0, c4, 0, ch, k, shift, mask)
        while e < end:  # the change rows were full
            ch = _grown(ch)
            k, e = _run(old, new, a64, b64, e, end, base, 0, c4, 0, ch, k, shift, mask)
        idx += end - b
        q += 1
        b = origin + q * stride
    return k, ch


@njit(cache=True, nogil=True)
def _scan_band(old, new, a64, b64, stride, table, members, shift, mask, c4, ch):
    """The changes of chunks side by side in one row band (``table`` rows ``members``: chunks of the
    same whole rows of their cells), a tensor row at a time across them (the rows of a cell alone lie a stride apart, which
    the hardware's prefetch follows badly): (count, ``ch`` grown as needed, with column 3 the
    member's index)."""
    tables = 4 * (mask + 1)
    c4[: members.size * tables] = 0
    k = 0
    q0 = table[members[0], 0] // table[members[0], 3]
    for q in range(q0, q0 + table[members[0], 1] // table[members[0], 3]):
        for m in range(members.size):
            start, origin, w = table[members[m], 0], table[members[m], 2], table[members[m], 3]
            b = origin + q * stride
            base = q * w - start - b
            k, e = _run(old, new, a64, b64, b, b + w, base, m, c4, m * tables, ch, k, shift, mask)
            while e < b + w:  # the change rows were full
                ch = _grown(ch)
                k, e = _run(old, new, a64, b64, e, b + w, base, m, c4, m * tables, ch, k, shift, mask)
    return k, ch


@njit(cache=True, nogil=True)
def _class_code(ov, nv, rank, shift, mask, width):
    """The ctx code of a chunk's changes (old and new bits, ranks in their classes; position order),
    in class-major order, as ``_numba_kernels._ctx_arrays`` gives it: (active, counts, n_big, k_pos,
    k_bg, k_bv, gaps, big_gaps, big_vals, neg)."""
    k = ov.size
    nclass = mask + 1
    ccount = np.zeros(nclass, np.int64)
    for j in range(k):
        ccount[(np.int64(ov[j]) >> shift) & mask] += 1
    fill = np.zeros(nclass, np.int64)
    na = 0
    acc = 0
    for c in range(nclass):
        fill[c] = acc
        acc += ccount[c]
        na += ccount[c] > 0
    active = np.empty(na, np.int64)
    counts = np.empty(na, np.int64)
    a = 0
    for c in range(nclass):
        if ccount[c] > 0:
            active[a], counts[a] = c, ccount[c]
            a += 1
    rank_cm = np.empty(k, np.int64)
    dd = np.empty(k, np.int64)
    full = np.int64(1) << width
    for j in range(k):
        c = (np.int64(ov[j]) >> shift) & mask
        t = fill[c]
        fill[c] = t + 1
        rank_cm[t] = rank[j]
        dd[t] = (np.int64(nv[j]) - np.int64(ov[j])) & (full - 1)
    gaps = np.empty(k, np.uint64)
    neg = np.empty(k, np.uint8)
    big_gaps = np.empty(k, np.uint64)
    big_vals = np.empty(k, np.uint64)
    n_big, k_pos, k_bg, k_bv, nb = class_streams(rank_cm, dd, counts, width, gaps, neg, big_gaps, big_vals)
    return active, counts, n_big, k_pos, k_bg, k_bv, gaps, big_gaps[:nb], big_vals[:nb], neg


@njit(cache=True, nogil=True)
def pack5(changed, active, counts, n_big, k_pos, k_bv, gaps, big_gaps, big_vals, neg, pops, rix, rkp, rkv, rkn, rsh,
          cbits):  # fmt: skip
    """A layout 2 (segment format 5) payload: :func:`deltarl.codec._ctxs5.pack`, compiled."""
    return _ctxs5.pack(changed, active, counts, n_big, k_pos, k_bv, gaps, big_gaps, big_vals, neg, pops, rix, rkp, rkv,
                       rkn, rsh, cbits)  # fmt: skip


@njit(cache=True, nogil=True)
def _finish(old, new, ch, changed, count, shift, mask, width, rix, rkp, rkb, rkv, rkn, rknb, rsh, pops, lo, hi,
            others, weight, fmask, out, at):  # fmt: skip
    """One chunk from its changes (``ch`` rows in position order): (kind, NaN / Inf count, out, its end)."""
    ov = np.empty(changed, old.dtype)
    nv = np.empty(changed, old.dtype)
    for t in range(changed):
        ov[t], nv[t] = old[ch[t, 2]], new[ch[t, 2]]
    bad = 0
    if fmask:
        for t in range(changed):
            bad += (np.int64(nv[t]) & fmask) == fmask
    x = weight * changed
    alone = lo * count <= x < hi * count
    for r in range(others.shape[0]):
        if others[r, 0] * count <= x < others[r, 1] * count:
            alone = False
    if bad or not alone:
        return CELL_OTHER, bad, out, at
    active, counts, n_big, k_pos, k_bg, k_bv, gaps, big_gaps, big_vals, neg = _class_code(
        ov, nv, ch[:changed, 1], shift, mask, width
    )
    if pops.size:  # layout 2
        gi = np.empty(gaps.size, np.int64)
        bgi = np.empty(big_gaps.size, np.int64)
        bvi = np.empty(big_vals.size, np.int64)
        for t in range(gaps.size):
            gi[t] = np.int64(gaps[t])
        for t in range(big_gaps.size):
            bgi[t], bvi[t] = np.int64(big_gaps[t]), np.int64(big_vals[t])
        pay = pack5(changed, active, counts, n_big, k_pos, k_bv, gi, bgi, bvi, neg, pops, rix, rkp, rkv, rkn, rsh,
                    _bits(mask))  # one compiled pack (a dispatcher call), not a second inlined copy
        out = _grow(out, at + pay.size)
        out[at : at + pay.size] = pay
        return CELL_CTXS, 0, out, at + pay.size
    out, at = _pack(out, at, changed, active, counts, n_big, k_pos, k_bg, k_bv, gaps, big_gaps, big_vals, neg,
                    rix, rkp, rkb, rkv, rkn, rknb)  # fmt: skip
    return CELL_CTXS, 0, out, at


@njit(cache=True, nogil=True)
def ctxs_encode_cells(old, new, a64, b64, s0, table, shift, cbits, width, rc, rkp, rkb, rkv, rkn, rknb, rsh, layout,
                      lo, hi, others, weight, fmask, out):  # fmt: skip
    """Code the cell chunks of one tensor (``old`` / ``new``: its row-major bits, rows ``s0`` elements
    apart; ``a64`` / ``b64``: their u64 views for 16-bit elements 8-byte aligned, else empty) against
    its class record (``rc`` its classes, then their ``k_pos``, ``k_big_gap``, ``k_big_val``, ``k_n``,
    ``k_n_big``). ``table`` rows: first cell element of the chunk, elements, the cell's origin in the
    tensor, its row width in elements, a band (chunks of one band >= 0, the same whole rows of cells
    in one row band, are scanned side by side, a tensor row at a time; -1: alone). A chunk is coded ``ctxs`` when ``lo * n <=
    weight * changed < hi * n`` and no range of ``others`` (k x 2) holds it, and no new value has all
    the bits of ``fmask`` (0: no check) set. Returns ``(out, rows)``: the payloads in ``out`` (grown as
    needed), and per chunk (kind: ``CELL_NONE``, ``CELL_CTXS`` or ``CELL_OTHER`` of
    :mod:`deltarl.codec.ctxs`; changed; its payload's start and end in ``out``; its NaN / Inf count)."""
    mask = (1 << cbits) - 1
    rix = np.full(mask + 1, -1, np.int64)
    for i in range(rc.size):
        rix[rc[i]] = i
    n = table.shape[0]
    rows = np.zeros((n, 5), np.int64)
    c4 = np.zeros(4 * (mask + 1) * max(n, 1), np.int64)
    ch = np.empty((1024, 4), np.int64)
    done = np.zeros(n, np.bool_)
    at = 0
    for i in range(n):
        if done[i]:
            continue
        if table[i, 4] < 0:
            members = np.full(1, i, np.int64)
            k, ch = _scan(old, new, a64, b64, s0, table[i, 2], table[i, 3], table[i, 0], table[i, 0] + table[i, 1],
                          shift, mask, c4, ch)  # fmt: skip
        else:
            members = np.flatnonzero(table[:, 4] == table[i, 4])
            k, ch = _scan_band(old, new, a64, b64, s0, table, members, shift, mask, c4, ch)
        first = np.zeros(members.size + 1, np.int64)  # each member's changes together (a stable count sort)
        for t in range(k):
            first[ch[t, 3] + 1] += 1
        for m in range(members.size):
            first[m + 1] += first[m]
        mine = np.empty((k, 3), np.int64)
        fill = first[:-1].copy()
        for t in range(k):
            m = ch[t, 3]
            mine[fill[m], 0], mine[fill[m], 1], mine[fill[m], 2] = ch[t, 0], ch[t, 1], ch[t, 2]
            fill[m] += 1
        for m in range(members.size):
            j = members[m]
            done[j] = True
            changed = first[m + 1] - first[m]
            rows[j, 1], rows[j, 2], rows[j, 3] = changed, at, at
            if changed == 0:
                continue
            pops = np.zeros(mask + 1 if layout == 2 else 0, np.int64)  # the chunk's elements of each class
            t0 = m * 4 * (mask + 1) if table[i, 4] >= 0 else 0
            for c in range(pops.size):
                for lane in range(4):
                    pops[c] += c4[t0 + lane * (mask + 1) + c]
            kind, bad, out, at = _finish(old, new, mine[first[m] : first[m + 1]], changed, table[j, 1], shift, mask,
                                         width, rix, rkp, rkb, rkv, rkn, rknb, rsh, pops, lo, hi, others, weight,
                                         fmask, out, at)  # fmt: skip
            rows[j, 0], rows[j, 3], rows[j, 4] = kind, at, bad
    return out, rows
