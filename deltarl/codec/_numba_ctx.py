"""numba ctx decoder: payload streams -> scan state (ctx_prepare) -> (positions, old, new) (ctx_scan).

It mirrors the numpy decoder in :mod:`deltarl.codec.ctx` (same validation, same result) but
never materialises ranks: the class table is parsed here, the Rice streams are read through a
64-bit bit buffer, and the scan that counts each class down to its next target writes the
position, the old bits it just read and the new bits of every hit, so the stager needs no gather
afterwards. ``ctx_scan2`` scans two chunks interleaved. Everything runs without the GIL.
"""
# mypy: ignore-errors

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from deltarl.codec._numba_kernels import words16

__all__ = ["ctx_prepare", "ctx_scan", "ctx_scan2", "outputs2", "words16"]

_FAR = np.int64(1) << 62  # a countdown that no chunk reaches: "no more targets in this class"

# Error codes (ctx.py maps them to messages).
OK = 0
RANK_BEYOND_CLASS = 1
BIG_BEYOND_CLASS = 2
TABLE_TRUNCATED = 3
TABLE_BAD_COUNT = 4
TABLE_BAD_ENTRY = 5
TABLE_SUM = 6
RICE_FEW_CODES = 7
RICE_LONG_RUN = 8
RICE_TRAILING = 9
RICE_REMAINDER = 10
RICE_ESCAPES = 11
RICE_SMALL_ESCAPE = 12
GAP_OUTSIDE = 13
BIG_GAP_OUTSIDE = 14
VALUE_RANGE = 15


@intrinsic
def _clz64(typingctx, x):
    """Leading zero bits of a u64 (64 for 0)."""
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))

    return sig, codegen


@njit(cache=True, nogil=True)
def _class_table(raw, changed, nclass):
    """Parse the class table: (error, active, k_pos, k_big_gap, k_big_val, n, n_big, rows)."""
    active = np.empty(nclass, np.int64)
    kp = np.empty(nclass, np.int64)
    kb = np.empty(nclass, np.int64)
    kv = np.empty(nclass, np.int64)
    cnt = np.empty(nclass, np.int64)
    nbig = np.empty(nclass, np.int64)
    size = raw.size
    off = 0
    last = -1
    na = 0
    total = 0
    nums = np.zeros(2, np.uint64)
    while off < size:
        if off + 6 > size:
            return TABLE_TRUNCATED, active, kp, kb, kv, cnt, nbig, na
        c = np.int64(raw[off])
        k0 = np.int64(raw[off + 1])
        k1 = np.int64(raw[off + 2])
        k2 = np.int64(raw[off + 3])
        off += 4
        for f in range(2):
            v = np.uint64(0)
            sh = 0
            while True:
                if off >= size or sh > 56:
                    return TABLE_BAD_COUNT, active, kp, kb, kv, cnt, nbig, na
                byte = raw[off]
                off += 1
                v |= np.uint64(byte & 0x7F) << np.uint64(sh)
                sh += 7
                if byte < 0x80:
                    break
            nums[f] = v
        n = nums[0]
        m = nums[1]
        if c <= last or c >= nclass or max(k0, max(k1, k2)) > 32 or n == 0 or m > n:
            return TABLE_BAD_ENTRY, active, kp, kb, kv, cnt, nbig, na
        if n > np.uint64(changed):
            return TABLE_SUM, active, kp, kb, kv, cnt, nbig, na
        last = c
        active[na] = c
        kp[na] = k0
        kb[na] = k1
        kv[na] = k2
        cnt[na] = np.int64(n)
        nbig[na] = np.int64(m)
        total += np.int64(n)
        na += 1
    if total != changed:
        return TABLE_SUM, active, kp, kb, kv, cnt, nbig, na
    return OK, active, kp, kb, kv, cnt, nbig, na


@njit(cache=True, nogil=True)
def _rice_groups(unary, rem, esc, ks, ns, ngroups, escape, limit, out, skip):
    """Decode ``sum(ns)`` Rice codes, ``ns[g]`` of them with parameter ``ks[g]``, into ``out``,
    leaving ``skip`` slots of ``out`` after each group.

    The same split-stream code as bitio.rice_decode, with its checks; every value must also be
    below ``limit``. Returns an error code (0 ok).
    """
    nu = unary.size
    nr = rem.size
    ubuf = np.uint64(0)
    ubits = 0
    ui = 0
    rbuf = np.uint64(0)
    rbits = 0
    ri = 0
    ei = 0
    t = 0
    for g in range(ngroups):
        k = ks[g]
        uk = np.uint64(k)
        for _ in range(ns[g]):
            if ubits <= 56:
                while ubits <= 56 and ui < nu:
                    ubuf |= np.uint64(unary[ui]) << np.uint64(56 - ubits)
                    ubits += 8
                    ui += 1
            q = _clz64(ubuf)
            if q > escape:
                return RICE_LONG_RUN if ubits > escape else RICE_FEW_CODES
            if q >= ubits:
                return RICE_FEW_CODES
            ubuf <<= np.uint64(q + 1)
            ubits -= q + 1
            if q == escape:
                if ei >= esc.size:
                    return RICE_ESCAPES
                v = esc[ei]
                ei += 1
                if v < (np.uint64(escape) << uk):
                    return RICE_SMALL_ESCAPE
            else:
                v = np.uint64(q) << uk
                if k > 0:
                    if rbits < k:
                        while rbits <= 56 and ri < nr:
                            rbuf |= np.uint64(rem[ri]) << np.uint64(56 - rbits)
                            rbits += 8
                            ri += 1
                        if rbits < k:
                            return RICE_REMAINDER
                    v |= rbuf >> np.uint64(64 - k)
                    rbuf <<= uk
                    rbits -= k
            if v >= limit:
                return VALUE_RANGE
            out[t] = np.int64(v)
            t += 1
        t += skip
    used = ui * 8 - ubits
    if (used + 7) // 8 != nu or ubuf != 0:
        return RICE_TRAILING
    if ((ri * 8 - rbits) + 7) // 8 != nr:
        return RICE_REMAINDER
    if ei != esc.size:
        return RICE_ESCAPES
    return OK


@njit(cache=True, nogil=True)
def ctx_prepare(old, shift, mask, width, changed, tab, pu, pr, pe, bu, br, be, vu, vr, ve, signs):
    """Parse and check a ctx chunk's streams into its scan state: (error, g2, dd, ptr, rem).

    Slot layout: each class's targets in rank order, then a sentinel slot; one shared sentinel at
    the end for classes without targets. ``g2[s]`` is how many more elements of the class to pass
    before the target of slot ``s`` (the rank gap; FAR for a sentinel), ``dd[s]`` the wrapped
    difference to add to its old bits, ``ptr[c]`` class ``c``'s current slot, ``rem[c]`` its
    countdown. ``signs`` must already hold ceil(changed / 8) bytes.
    """
    n = old.size
    nclass = mask + 1
    g2 = np.empty(changed + nclass + 2, np.int64)  # + 1: _hits_word reads one slot ahead
    dd = np.empty(changed + nclass + 2, np.int64)
    ptr = np.empty(nclass, np.int64)
    rem = np.empty(nclass, np.int64)
    err, active, kp, kb, kv, cnt, nbig, na = _class_table(tab, changed, nclass)
    if err:
        return err, g2, dd, ptr, rem
    err = _rice_groups(pu, pr, pe, kp, cnt, na, 40, np.uint64(n), g2, 1)
    if err:
        return (GAP_OUTSIDE if err == VALUE_RANGE else err), g2, dd, ptr, rem
    nb = 0
    for a in range(na):
        nb += nbig[a]
    bg = np.empty(nb, np.int64)
    err = _rice_groups(bu, br, be, kb, nbig, na, 40, np.uint64(changed), bg, 0)
    if err:
        return (BIG_GAP_OUTSIDE if err == VALUE_RANGE else err), g2, dd, ptr, rem
    bv = np.empty(nb, np.int64)
    err = _rice_groups(vu, vr, ve, kv, nbig, na, 40, np.uint64((np.int64(1) << (width - 1)) - 1), bv, 0)
    if err:
        return err, g2, dd, ptr, rem
    return _fill(nclass, changed, width, na, active, cnt, nbig, bg, bv, signs, 0, g2, dd, ptr, rem)


@njit(cache=True, nogil=True)
def _fill(nclass, changed, width, na, active, cnt, nbig, bg, bv, signs, sbase, g2, dd, ptr, rem):
    """The scan state from decoded groups (``g2`` already holds each group's rank gaps, a slot left
    after each): signed differences, sentinels, each class's first slot and countdown. The sign of
    change ``i`` (group order) is bit ``sbase + i`` of ``signs``. Returns (error, g2, dd, ptr, rem)."""
    last = changed + na
    ptr[:] = last
    g2[last:] = _FAR
    dd[last:] = 0
    full = np.int64(1) << width
    s = 0
    slot = 0
    b = 0
    for a in range(na):
        m = cnt[a]
        ptr[active[a]] = slot
        for t in range(m):  # |d| = 1 with its sign (branch-free: signs are coin flips)
            i = sbase + s + t
            neg = np.int64((signs[i >> 3] >> (7 - (i & 7))) & 1)
            dd[slot + t] = 1 + neg * (full - 2)
        w = -1
        for _ in range(nbig[a]):
            w += bg[b] + 1
            if w >= m:
                return BIG_BEYOND_CLASS, g2, dd, ptr, rem
            mag = bv[b] + 2
            neg = np.int64(dd[slot + w] != 1)
            dd[slot + w] = mag + neg * (full - 2 * mag)
            b += 1
        g2[slot + m] = _FAR
        dd[slot + m] = 0
        slot += m + 1
        s += m
    for c in range(nclass):
        rem[c] = g2[ptr[c]]
    return OK, g2, dd, ptr, rem


@njit(cache=True, nogil=True, inline="always")
def _count_word(rem, y, um):
    """Count down the classes of the 4 lanes of one pre-shifted word; negative if any hit a target."""
    c0 = y & um
    c1 = (y >> np.uint64(16)) & um
    c2 = (y >> np.uint64(32)) & um
    c3 = (y >> np.uint64(48)) & um
    r0 = rem[c0] - 1
    rem[c0] = r0
    r1 = rem[c1] - 1
    rem[c1] = r1
    r2 = rem[c2] - 1
    rem[c2] = r2
    r3 = rem[c3] - 1
    rem[c3] = r3
    return r0 | r1 | r2 | r3


@njit(cache=True, nogil=True, inline="always")
def _hits_word(rem, ptr, g2, dd, x, y, um, base, out_pos, out_old, out_new, kk):
    """Undo _count_word, then redo it lane by lane, emitting each hit in position order.

    Branch-free: every lane writes an output slot and only a hit advances ``kk`` (the outputs
    have 4 slots of slack, ``g2`` one past its last sentinel).
    """
    for j in range(4):
        rem[(y >> np.uint64(16 * j)) & um] += 1
    for j in range(4):
        c = (y >> np.uint64(16 * j)) & um
        r = rem[c] - 1
        p = ptr[c]
        nxt = g2[p + 1]
        v = np.int64((x >> np.uint64(16 * j)) & np.uint64(0xFFFF))
        out_pos[kk] = base + j
        out_old[kk] = v
        out_new[kk] = (v + dd[p]) & 0xFFFF
        hit = np.int64(r < 0)
        kk += hit
        ptr[c] = p + hit
        rem[c] = nxt if hit else r
    return kk


@njit(cache=True, nogil=True)
def _scan16(a64, w0, shift, mask, ptr, rem, g2, dd, start, out_pos, out_old, out_new, kk, total):
    """Scan words ``w0..`` of 4 x 16-bit lanes; returns the hit count so far."""
    um = np.uint64(mask)
    sh = np.uint64(shift)
    for w in range(w0, a64.size):
        if kk == total:
            return kk
        x = a64[w]
        y = x >> sh
        if _count_word(rem, y, um) < 0:
            kk = _hits_word(rem, ptr, g2, dd, x, y, um, start + 4 * w, out_pos, out_old, out_new, kk)
    return kk


@njit(cache=True, nogil=True)
def _scan(old, first, shift, mask, width, ptr, rem, g2, dd, start, out_pos, out_old, out_new, kk, total):
    """The element-by-element scan (any width) over ``old[first:]``."""
    top = (np.int64(1) << width) - 1
    for i in range(first, old.size):
        if kk == total:
            return kk
        v = np.int64(old[i])
        c = (v >> shift) & mask
        r = rem[c] - 1
        if r < 0:
            p = ptr[c]
            out_pos[kk] = start + i
            out_old[kk] = v
            out_new[kk] = (v + dd[p]) & top
            kk += 1
            p += 1
            ptr[c] = p
            rem[c] = g2[p]
        else:
            rem[c] = r
    return kk


@njit(cache=True, nogil=True)
def ctx_scan(old, a64, shift, mask, width, changed, start, g2, dd, ptr, rem):
    """Find every target of a prepared chunk: (error, positions + start, old bits, new bits), sorted.

    ``a64`` is the u64 view of the 4-aligned prefix of 16-bit ``old`` (empty otherwise).
    """
    out_pos = np.empty(changed + 4, np.int64)  # + 4: _hits_word writes every lane
    out_old = np.empty(changed + 4, old.dtype)
    out_new = np.empty(changed + 4, old.dtype)
    kk = _scan16(a64, 0, shift, mask, ptr, rem, g2, dd, start, out_pos, out_old, out_new, 0, changed)
    kk = _scan(
        old, a64.size * 4, shift, mask, width, ptr, rem, g2, dd, start, out_pos, out_old, out_new, kk, changed
    )
    err = OK if kk == changed else RANK_BEYOND_CLASS
    return err, out_pos[:changed], out_old[:changed], out_new[:changed]


@njit(cache=True, nogil=True)
def outputs2(changed_a, changed_b, like):
    """Positions, old and new bits (``like``'s dtype) for two chunks' hits, 4 slots of slack each
    (:func:`_hits_word` writes every lane)."""
    pa = np.empty(changed_a + 4, np.int64)
    oa = np.empty(changed_a + 4, like.dtype)
    na = np.empty(changed_a + 4, like.dtype)
    pb = np.empty(changed_b + 4, np.int64)
    ob = np.empty(changed_b + 4, like.dtype)
    nb = np.empty(changed_b + 4, like.dtype)
    return pa, oa, na, pb, ob, nb


@njit(cache=True, nogil=True)
def ctx_scan2(
    old_a,
    a64_a,
    changed_a,
    g2_a,
    dd_a,
    ptr_a,
    rem_a,
    old_b,
    a64_b,
    changed_b,
    g2_b,
    dd_b,
    ptr_b,
    rem_b,
    shift,
    mask,
):
    """:func:`ctx_scan` of two 16-bit chunks at once (positions relative to each chunk).

    Each chunk's countdown is one dependency chain through its table, and the most frequent class
    makes it a long one; two independent chunks interleaved let the core overlap the chains.
    """
    pa, oa, na, pb, ob, nb = outputs2(changed_a, changed_b, old_a)
    um = np.uint64(mask)
    sh = np.uint64(shift)
    ka = 0
    kb = 0
    w = 0
    both = min(a64_a.size, a64_b.size)
    while w < both and ka < changed_a and kb < changed_b:
        x = a64_a[w]
        u = a64_b[w]
        y = x >> sh
        v = u >> sh
        hit_a = _count_word(rem_a, y, um)
        hit_b = _count_word(rem_b, v, um)
        if (hit_a | hit_b) < 0:
            if hit_a < 0:
                ka = _hits_word(rem_a, ptr_a, g2_a, dd_a, x, y, um, 4 * w, pa, oa, na, ka)
            if hit_b < 0:
                kb = _hits_word(rem_b, ptr_b, g2_b, dd_b, u, v, um, 4 * w, pb, ob, nb, kb)
        w += 1
    ka = _scan16(a64_a, w, shift, mask, ptr_a, rem_a, g2_a, dd_a, 0, pa, oa, na, ka, changed_a)
    ka = _scan(old_a, a64_a.size * 4, shift, mask, 16, ptr_a, rem_a, g2_a, dd_a, 0, pa, oa, na, ka, changed_a)
    kb = _scan16(a64_b, w, shift, mask, ptr_b, rem_b, g2_b, dd_b, 0, pb, ob, nb, kb, changed_b)
    kb = _scan(old_b, a64_b.size * 4, shift, mask, 16, ptr_b, rem_b, g2_b, dd_b, 0, pb, ob, nb, kb, changed_b)
    ea = OK if ka == changed_a else RANK_BEYOND_CLASS
    eb = OK if kb == changed_b else RANK_BEYOND_CLASS
    return (
        ea,
        pa[:changed_a],
        oa[:changed_a],
        na[:changed_a],
        eb,
        pb[:changed_b],
        ob[:changed_b],
        nb[:changed_b],
    )
