"""numba ``ctxs`` encoder: a tensor's cell chunks coded against its class record in one call.

Per chunk, as ``ctxs.encode`` does chunk by chunk (and byte for byte the same): the chunk's rows are
copied out of the row-major tensor, its changes found and ranked in their classes (``_ctx_arrays``,
the record's class field), and, where ``ctxs`` is the codec ``auto`` would choose alone, its payload
packed: the extra classes, one Rice code (``_numba_bits.rice_encode``) of the class counts, the
large-value counts, the rank gaps, the large-value gaps and the large values in the record's class
order (then the extra classes'), and the signs after the last remainder bit (docs/FORMAT.md, codec 6).
A chunk another codec could code (``sparse``, ``dense``), or one with a NaN or Inf among its new
values, is left to the caller's chunk-by-chunk path.
"""
# mypy: ignore-errors

from __future__ import annotations

import numpy as np
from numba import njit

from deltarl.codec._numba_bits import rice_encode
from deltarl.codec._numba_kernels import _ctx_arrays
from deltarl.codec.bitio import RICE_ESCAPE

__all__ = ["ctxs_encode_cells"]

CELL_CTXS, CELL_OTHER = 1, 2  # ctxs.CELL_CTXS, ctxs.CELL_OTHER (ctxs imports this module, not the other way)


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
    cstart = np.empty(na, np.int64)
    bstart = np.empty(na, np.int64)
    c = 0
    b = 0
    for a in range(na):
        cstart[a], bstart[a] = c, b
        c += counts[a]
        b += n_big[a]
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
def ctxs_encode_cells(old, new, s0, so, sn, so64, sn64, table, shift, cbits, width, rc, rkp, rkb, rkv, rkn, rknb,
                      lo, hi, others, weight, fmask, out):  # fmt: skip
    """Code the cell chunks of one tensor (``old`` / ``new``: its row-major bits, rows ``s0`` elements
    apart) against its class record (``rc`` its classes, then their ``k_pos``, ``k_big_gap``,
    ``k_big_val``, ``k_n``, ``k_n_big``). ``table`` rows: first cell element of the chunk, elements,
    the cell's origin in the tensor, its row width in elements. ``so`` / ``sn`` hold the largest
    chunk (``so64`` / ``sn64``: their u64 views for 16-bit elements, else empty). A chunk is coded
    ``ctxs`` when ``lo * n <= weight * changed < hi * n`` and no range of ``others`` (k x 2) holds
    it, and no new value has all the bits of ``fmask`` (0: no check) set. Returns ``(out, rows)``:
    the payloads one after another in ``out`` (grown as needed), and per chunk (kind: ``CELL_NONE``,
    ``CELL_CTXS`` or ``CELL_OTHER`` of :mod:`deltarl.codec.ctxs`; changed; the end of its payload in ``out``; its NaN / Inf count)."""
    mask = (1 << cbits) - 1
    rix = np.full(mask + 1, -1, np.int64)
    for i in range(rc.size):
        rix[rc[i]] = i
    rows = np.zeros((table.shape[0], 4), np.int64)
    at = 0
    for i in range(table.shape[0]):
        start, count, origin, w = table[i, 0], table[i, 1], table[i, 2], table[i, 3]
        idx = start
        k = 0
        while k < count:  # the chunk, a row of its cell at a time
            q = idx // w
            c = idx - q * w
            run = min(w - c, count - k)
            b = origin + q * s0 + c
            so[k : k + run] = old[b : b + run]
            sn[k : k + run] = new[b : b + run]
            k += run
            idx += run
        a64 = so64[: count // 4] if so64.size else so64
        b64 = sn64[: count // 4] if sn64.size else sn64
        cur, nxt = so[:count], sn[:count]
        code = _ctx_arrays(cur, nxt, a64, b64, shift, mask, width)
        pos = code[13]
        changed = pos.size
        rows[i, 1] = changed
        rows[i, 2] = at
        if changed == 0:
            continue
        bad = 0
        if fmask:
            for t in range(changed):
                if (np.int64(nxt[pos[t]]) & fmask) == fmask:
                    bad += 1
        rows[i, 3] = bad
        x = weight * changed
        alone = lo * count <= x < hi * count
        for r in range(others.shape[0]):
            if others[r, 0] * count <= x < others[r, 1] * count:
                alone = False
        if bad or not alone:
            rows[i, 0] = CELL_OTHER
            continue
        out, at = _pack(out, at, changed, code[0], code[1], code[2], code[3], code[4], code[5], code[6], code[8],
                        code[9], code[12], rix, rkp, rkb, rkv, rkn, rknb)  # fmt: skip
        rows[i, 0] = CELL_CTXS
        rows[i, 2] = at
    return out, rows
