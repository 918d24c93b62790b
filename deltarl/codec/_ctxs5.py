"""The segment-format-5 ``ctxs`` payload (docs/FORMAT.md, "6 ctxs", format 5): one Rice code in two
streams and no lengths, class counts against the record's shares, saturated classes coded by their
unchanged elements, one sequence of large values.

Written once for both paths: every function here is ``register_jitable``, so the numba decoder and
encoder (:mod:`deltarl.codec._numba_ctxs`, :mod:`deltarl.codec._numba_ctxs_encode`) compile it into
their loops and the numpy path (:mod:`deltarl.codec.ctxs`, ``DELTARL_NO_NUMBA``) runs it as Python.

The payload is the forward stream (every code's remainder bits, 64 bits for an escaped code, then
one sign bit a change, zero padded to a byte) followed by the unary stream **reversed** (the
payload's last byte is the unary stream's first): each stream ends where the other begins, so
neither needs a length.

Editing this file: numba's on-disk cache of a compiled caller is keyed by the caller's own source
file, not by what it inlines, so clear ``deltarl/codec/__pycache__/*.nb*`` (an install replaces
every file and so invalidates every entry).
"""
# mypy: ignore-errors

from __future__ import annotations

import numpy as np
from numba.extending import register_jitable

# Error codes, shared with the ctx decoder (:mod:`deltarl.codec._numba_ctx`).
OK = 0
TABLE_BAD_ENTRY = 5
TABLE_SUM = 6
RICE_FEW_CODES = 7
RICE_LONG_RUN = 8
RICE_TRAILING = 9
RICE_REMAINDER = 10
RICE_SMALL_ESCAPE = 12
GAP_OUTSIDE = 13
BIG_GAP_OUTSIDE = 14
VALUE_RANGE = 15

ESCAPE = 40  # a unary run of 40 zeros: the value follows as 64 bits in the forward stream
SHARE_ONE = 1 << 16  # shares are changes of a class per 65,536 changes


@register_jitable
def rice_rule(total, count):
    """The integer Rice parameter rule (bitio.rice_k) for one group."""
    if count <= 0:
        return 0
    x = (total * 11) // (count * 16)
    if x <= 1:
        return 0
    k = 0
    y = x - 1
    while y > 0:
        k += 1
        y >>= 1
    return min(k, 32)


@register_jitable
def offsets(counts, n_big):
    """Each group's first change and first large change in class-major order."""
    cstart = np.empty(counts.size, np.int64)
    bstart = np.empty(counts.size, np.int64)
    c = 0
    b = 0
    for a in range(counts.size):
        cstart[a], bstart[a] = c, b
        c += counts[a]
        b += n_big[a]
    return cstart, bstart


@register_jitable
def bit_length(n):
    k = 0
    while n > 0:
        k += 1
        n >>= 1
    return k


@register_jitable
def count_k(changed):
    """Parameter of an extra class's count and of the large-value count: ``max(0, bit_length(changed) - 4)``."""
    return max(0, bit_length(changed) - 4)


@register_jitable
def expected(changed, share):
    """A record class's expected count in a chunk of ``changed`` changes."""
    return (changed * share + (SHARE_ONE >> 1)) >> 16


# -- reading ---------------------------------------------------------------------------------------


@register_jitable
def reader_start():
    """(unary bytes read, unary bits buffered, unary buffer, forward bytes read, forward bits
    buffered, forward buffer): the state :func:`take` keeps in a 6-slot int64 array (compiled) or
    list (Python). Buffers hold at most 56 bits, right-aligned, so every value fits an int64."""
    return np.zeros(6, np.int64)


@register_jitable
def _take_bits(fw, st, k):
    """The next ``k`` (1..32) bits of the forward stream, or -1 past its end."""
    if st[4] < k:
        while st[4] <= 48 and st[3] < len(fw):
            st[5] = (st[5] << 8) | fw[st[3]]
            st[4] += 8
            st[3] += 1
        if st[4] < k:
            return -1
    st[4] -= k
    v = st[5] >> st[4]
    st[5] &= (1 << st[4]) - 1
    return v


@register_jitable
def take(ur, fw, st, m, limit):
    """The next value (Golomb parameter ``m`` >= 1; a power of two is a Rice code), or minus an
    error code; it must be below ``limit``. ``ur`` is the unary stream (the payload reversed),
    ``fw`` the payload, ``st`` the state of :func:`reader_start`."""
    while st[1] <= 48 and st[0] < len(ur):
        st[2] = (st[2] << 8) | ur[st[0]]
        st[1] += 8
        st[0] += 1
    nb = st[1]
    u = st[2]
    q = 0
    while q <= ESCAPE and q < nb and ((u >> (nb - 1 - q)) & 1) == 0:
        q += 1
    if q > ESCAPE:
        return -RICE_LONG_RUN
    if q >= nb:
        return -RICE_FEW_CODES
    st[1] = nb - q - 1
    st[2] = u & ((1 << st[1]) - 1)
    if q == ESCAPE:
        hi = _take_bits(fw, st, 32)
        lo = _take_bits(fw, st, 32)
        if hi < 0 or lo < 0:
            return -RICE_REMAINDER
        if hi >= 1 << 31:
            return -VALUE_RANGE
        v = (hi << 32) | lo
        if v < ESCAPE * m:
            return -RICE_SMALL_ESCAPE
    else:
        b = bit_length(m - 1)
        r = 0
        if b > 0:
            cut = (1 << b) - m
            if b > 1:
                r = _take_bits(fw, st, b - 1)
            if r >= 0 and r >= cut:
                y = _take_bits(fw, st, 1)
                r = -1 if y < 0 else 2 * r + y - cut
            if r < 0:
                return -RICE_REMAINDER
        v = q * m + r
    if v >= limit:
        return -VALUE_RANGE
    return v


@register_jitable
def parse(ur, pay, st, changed, n_elems, width, cbits, rc, rmp, rkv, rkn, rsh):
    """Read one chunk's payload against its class record (``rc`` classes in record order, their
    ``m_pos``, ``k_big_val``, ``k_n``, ``share``): (error, active, counts, n_big, gaps, big_gaps,
    big_vals, sign bit offset). Groups in group order (the record's classes with changes, then the
    extra classes ascending); ``gaps`` their rank gaps group after group; ``big_gaps`` the gaps of
    each group's large changes within the group."""
    none = np.zeros(0, np.int64)
    m = len(rc)
    nclass = 1 << cbits
    kx = count_k(changed)
    nx = take(ur, pay, st, 1, nclass + 1)
    if nx < 0:
        return -nx, none, none, none, none, none, none, 0
    inrec = np.zeros(nclass, np.bool_)
    for i in range(m):
        inrec[rc[i]] = True
    xc = np.zeros(nx, np.int64)
    xkp = np.zeros(nx, np.int64)
    xkv = np.zeros(nx, np.int64)
    xn = np.zeros(nx, np.int64)
    rest = changed
    last = -1
    for i in range(nx):
        c = take(ur, pay, st, 1 << (cbits), nclass)
        kp = take(ur, pay, st, 1 << 5, 33)
        kv = take(ur, pay, st, 1 << 5, 33)
        n = take(ur, pay, st, 1 << (kx), changed + 1)
        if c < 0 or kp < 0 or kv < 0 or n < 0:
            return TABLE_BAD_ENTRY, none, none, none, none, none, none, 0
        if c <= last or inrec[c] or n < 1:
            return TABLE_BAD_ENTRY, none, none, none, none, none, none, 0
        last = c
        xc[i], xkp[i], xkv[i], xn[i] = c, kp, kv, n
        rest -= n
    cnt_r = np.zeros(m, np.int64)
    for r in range(1, m):
        z = take(ur, pay, st, 1 << (rkn[r]), 2 * changed + 2)
        if z < 0:
            return (TABLE_SUM if z == -VALUE_RANGE else -z), none, none, none, none, none, none, 0
        n = expected(changed, rsh[r]) + ((z >> 1) ^ -(z & 1))
        if n < 0 or n > changed:
            return TABLE_SUM, none, none, none, none, none, none, 0
        cnt_r[r] = n
        rest -= n
    if rest < 0 or (m == 0 and rest != 0):
        return TABLE_SUM, none, none, none, none, none, none, 0
    if m:
        cnt_r[0] = rest
    na = nx
    for r in range(m):
        na += cnt_r[r] > 0
    active = np.empty(na, np.int64)
    counts = np.empty(na, np.int64)
    kp_g = np.empty(na, np.int64)
    kv_g = np.empty(na, np.int64)
    mayflip = np.zeros(na, np.bool_)
    a = 0
    for r in range(m):
        if cnt_r[r] > 0:
            active[a], counts[a], kp_g[a], kv_g[a], mayflip[a] = rc[r], cnt_r[r], rmp[r], rkv[r], rmp[r] == 1
            a += 1
    for i in range(nx):
        active[a], counts[a], kp_g[a], kv_g[a] = xc[i], xn[i], 1 << xkp[i], xkv[i]
        a += 1
    gaps = np.empty(changed, np.int64)
    t = 0
    for a in range(na):
        n = counts[a]
        flip = 1
        if mayflip[a]:
            flip = take(ur, pay, st, 1, 2)
            if flip < 0:
                return -flip, none, none, none, none, none, none, 0
        if flip == 0:  # the class's unchanged elements are listed; every other rank is a change
            u = take(ur, pay, st, 1 << max(0, bit_length(n) - 5), n_elems - n + 1)
            if u < 0:
                return (GAP_OUTSIDE if u == -VALUE_RANGE else -u), none, none, none, none, none, none, 0
            k2 = rice_rule(n, u)
            prev_u = -1
            prev_c = -1
            for j in range(u):
                g = take(ur, pay, st, 1 << (k2), n + u)
                if g < 0 or prev_u + g + 1 > n + j:  # more than n changes before it
                    return (GAP_OUTSIDE if g >= 0 or g == -VALUE_RANGE else -g), none, none, none, none, none, none, 0
                nxt = prev_u + g + 1
                for rank in range(prev_u + 1, nxt):
                    gaps[t] = rank - prev_c - 1
                    prev_c = rank
                    t += 1
                prev_u = nxt
            for rank in range(prev_u + 1, n + u):
                gaps[t] = rank - prev_c - 1
                prev_c = rank
                t += 1
        else:
            for _ in range(n):
                g = take(ur, pay, st, kp_g[a], n_elems)
                if g < 0:
                    return (GAP_OUTSIDE if g == -VALUE_RANGE else -g), none, none, none, none, none, none, 0
                gaps[t] = g
                t += 1
    nb = take(ur, pay, st, 1 << (kx), changed + 1)
    if nb < 0:
        return (TABLE_SUM if nb == -VALUE_RANGE else -nb), none, none, none, none, none, none, 0
    kbg = rice_rule(changed - nb, nb)
    n_big = np.zeros(na, np.int64)
    big_gaps = np.empty(nb, np.int64)
    w = -1
    a = 0
    end = counts[0] if na else 0
    start = 0
    prev = -1
    for b in range(nb):
        g = take(ur, pay, st, 1 << (kbg), changed)
        if g < 0 or w + g + 1 >= changed:
            return (BIG_GAP_OUTSIDE if g >= 0 or g == -VALUE_RANGE else -g), none, none, none, none, none, none, 0
        w += g + 1
        while w >= end:
            a += 1
            start = end
            end += counts[a]
            prev = -1
        big_gaps[b] = w - start - prev - 1
        prev = w - start
        n_big[a] += 1
    big_vals = np.empty(nb, np.int64)
    top = (1 << (width - 1)) - 1
    b = 0
    for a in range(na):
        for _ in range(n_big[a]):
            v = take(ur, pay, st, 1 << (kv_g[a]), top)
            if v < 0:
                return -v, none, none, none, none, none, none, 0
            big_vals[b] = v
            b += 1
    used = st[0] * 8 - st[1]
    ubytes = (used + 7) // 8
    if used % 8 and (ur[ubytes - 1] & ((1 << (8 - used % 8)) - 1)) != 0:
        return RICE_TRAILING, none, none, none, none, none, none, 0
    sbase = st[3] * 8 - st[4]
    if ubytes + (sbase + changed + 7) // 8 != len(pay):
        return RICE_REMAINDER, none, none, none, none, none, none, 0
    return OK, active, counts, n_big, gaps, big_gaps, big_vals, sbase


# -- writing ---------------------------------------------------------------------------------------


@register_jitable
def _remainder(r, m):
    """(bits, width) of remainder ``r`` of a Golomb code with parameter ``m``: truncated binary."""
    b = bit_length(m - 1)
    cut = (1 << b) - m
    if b == 0:
        return 0, 0
    if r < cut:
        return r, b - 1
    return r + cut, b


@register_jitable
def _cost(v, m):
    """Bits of one Golomb code."""
    q = v // m
    if q >= ESCAPE:
        return ESCAPE + 1 + 64
    return q + 1 + _remainder(v - q * m, m)[1]


@register_jitable
def _put(vals, ms, t, v, m):
    vals[t] = v
    ms[t] = m
    return t + 1


@register_jitable
def pack(changed, active, counts, n_big, k_pos, k_bv, gaps, big_gaps, big_vals, neg, pops, rix, rmp, rkv, rkn, rsh,
         cbits):  # fmt: skip
    """One chunk's payload (uint8): its changes in class-major order as the ctx coder gives them
    (``active`` classes ascending, their counts, large counts, own ``k_pos`` / ``k_big_val``; per
    change its rank gap and sign; per large change its gap within its class and ``|d| - 2``),
    ``pops`` each class's elements in the chunk, and the class record (``rix``: a class's record
    index or -1, then the record's ``m_pos``, ``k_big_val``, ``k_n``, ``share``)."""
    m = rmp.size
    na = active.size
    kx = count_k(changed)
    slot = np.full(m, -1, np.int64)
    nx = 0
    for a in range(na):
        if rix[active[a]] >= 0:
            slot[rix[active[a]]] = a
        else:
            nx += 1
    order = np.empty(na, np.int64)  # record order, then the extra classes ascending
    o = 0
    for r in range(m):
        if slot[r] >= 0:
            order[o] = slot[r]
            o += 1
    for a in range(na):
        if rix[active[a]] < 0:
            order[o] = a
            o += 1
    cstart, bstart = offsets(counts, n_big)
    b = bstart[na - 1] + n_big[na - 1] if na else 0
    cap = 8 + 4 * nx + m + na + changed + 2 * b
    for a in range(na):
        if rix[active[a]] >= 0 and rmp[rix[active[a]]] == 1:
            cap += pops[active[a]]
    vals = np.empty(cap, np.int64)
    ks = np.empty(cap, np.int64)
    t = _put(vals, ks, 0, nx, 1)
    for a in range(na):  # the extra classes, ascending
        if rix[active[a]] < 0:
            t = _put(vals, ks, t, active[a], 1 << cbits)
            t = _put(vals, ks, t, k_pos[a], 1 << 5)
            t = _put(vals, ks, t, k_bv[a], 1 << 5)
            t = _put(vals, ks, t, counts[a], 1 << kx)
    for r in range(1, m):
        n = counts[slot[r]] if slot[r] >= 0 else 0
        d = n - expected(changed, rsh[r])
        t = _put(vals, ks, t, 2 * d if d >= 0 else -2 * d - 1, 1 << rkn[r])
    ranks = np.empty(changed, np.int64)
    for o in range(na):
        a = order[o]
        n = counts[a]
        s = cstart[a]
        r = rix[active[a]]
        if r >= 0 and rmp[r] == 1:
            plain = 2
            prev = -1
            for j in range(s, s + n):
                plain += _cost(gaps[j], 1)
                prev += gaps[j] + 1
                ranks[j] = prev
            u = pops[active[a]] - n
            k2 = rice_rule(n, u)
            ku = max(0, bit_length(n) - 5)
            inv = 1 + _cost(u, 1 << ku)
            j = s
            prev_u = -1
            for rank in range(n + u):  # the unchanged ranks: the holes between the changes'
                if j < s + n and ranks[j] == rank:
                    j += 1
                else:
                    inv += _cost(rank - prev_u - 1, 1 << k2)
                    prev_u = rank
            if inv < plain:
                t = _put(vals, ks, t, 0, 1 << 0)
                t = _put(vals, ks, t, u, 1 << ku)
                j = s
                prev_u = -1
                for rank in range(n + u):
                    if j < s + n and ranks[j] == rank:
                        j += 1
                    else:
                        t = _put(vals, ks, t, rank - prev_u - 1, 1 << k2)
                        prev_u = rank
                continue
            t = _put(vals, ks, t, 1, 1 << 0)
        kp = rmp[r] if r >= 0 else 1 << k_pos[a]
        for j in range(s, s + n):
            t = _put(vals, ks, t, gaps[j], kp)
    t = _put(vals, ks, t, b, 1 << kx)
    kbg = rice_rule(changed - b, b)
    goff = 0
    prev_g = -1
    for o in range(na):
        a = order[o]
        w = -1
        for j in range(bstart[a], bstart[a] + n_big[a]):
            w += big_gaps[j] + 1
            t = _put(vals, ks, t, goff + w - prev_g - 1, 1 << kbg)
            prev_g = goff + w
        goff += counts[a]
    for o in range(na):
        a = order[o]
        r = rix[active[a]]
        kv = rkv[r] if r >= 0 else k_bv[a]
        for j in range(bstart[a], bstart[a] + n_big[a]):
            t = _put(vals, ks, t, big_vals[j], 1 << kv)
    ubits = 0
    fbits = changed
    for i in range(t):
        q = vals[i] // ks[i]
        if q >= ESCAPE:
            ubits += ESCAPE + 1
            fbits += 64
        else:
            ubits += q + 1
            fbits += _remainder(vals[i] - q * ks[i], ks[i])[1]
    nf = (fbits + 7) // 8
    nu = (ubits + 7) // 8
    out = np.zeros(nf + nu, np.uint8)
    up = 0  # unary bit position (the stream is written from the payload's end backwards)
    fp = 0  # forward bit position
    for i in range(t):
        v = vals[i]
        m = ks[i]
        q = v // m
        if q >= ESCAPE:
            up += ESCAPE
            fp = _write(out, fp, v >> 32, 32)
            fp = _write(out, fp, v & 0xFFFFFFFF, 32)
        else:
            up += q
            bits, width = _remainder(v - q * m, m)
            fp = _write(out, fp, bits, width)
        out[nf + nu - 1 - (up >> 3)] |= np.uint8(0x80 >> (up & 7))
        up += 1
    for o in range(na):
        a = order[o]
        for j in range(cstart[a], cstart[a] + counts[a]):
            fp = _write(out, fp, neg[j], 1)
    return out


@register_jitable
def _write(out, fp, v, k):
    """Write the low ``k`` (0..32) bits of ``v`` MSB-first at bit ``fp`` of ``out``; the next bit position."""
    while k > 0:
        room = 8 - (fp & 7)
        n = min(k, room)
        k -= n
        out[fp >> 3] |= ((v >> k) & ((1 << n) - 1)) << (room - n)
        fp += n
    return fp
