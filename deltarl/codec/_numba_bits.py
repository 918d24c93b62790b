"""numba split-stream Rice coder (the layout is in docs/FORMAT.md; bitio holds the numpy twin)."""
# mypy: ignore-errors

from __future__ import annotations

import numpy as np
from numba import njit

_CLZ8 = np.array([8] + [7 - int(np.log2(b)) for b in range(1, 256)], dtype=np.int64)


@njit(cache=True, nogil=True)
def rice_encode(values, ks, escape):
    """Split-stream Rice coding (see bitio): returns (unary bytes, remainder bytes, escaped mask)."""
    n = values.size
    ubits = 0
    rbits = 0
    esc = np.zeros(n, np.bool_)
    for i in range(n):
        q = values[i] >> np.uint64(ks[i])
        if q >= escape:
            esc[i] = True
            ubits += escape + 1
        else:
            ubits += np.int64(q) + 1
            rbits += ks[i]
    unary = np.zeros((ubits + 7) // 8, np.uint8)
    rem = np.zeros((rbits + 7) // 8, np.uint8)
    up = 0
    acc = np.uint64(0)
    nb = 0
    j = 0
    for i in range(n):
        k = ks[i]
        v = values[i]
        if esc[i]:
            up += escape
        else:
            up += np.int64(v >> np.uint64(k))
        unary[up >> 3] |= np.uint8(0x80 >> (up & 7))
        up += 1
        if not esc[i] and k > 0:
            acc = (acc << np.uint64(k)) | (v & ((np.uint64(1) << np.uint64(k)) - np.uint64(1)))
            nb += k
            while nb >= 8:
                nb -= 8
                rem[j] = np.uint8((acc >> np.uint64(nb)) & np.uint64(0xFF))
                j += 1
            acc &= (np.uint64(1) << np.uint64(nb)) - np.uint64(1)
    if nb > 0:
        rem[j] = np.uint8((acc << np.uint64(8 - nb)) & np.uint64(0xFF))
    return unary, rem, esc


@njit(cache=True, nogil=True)
def rice_decode(unary, rem, ks, count, escape, out):
    """Inverse of rice_encode into ``out``; escaped slots are left for the caller. Returns an error
    code: 0 ok, 1 too few codes, 2 unary run too long, 3 trailing unary bits/bytes, 4 remainder length.
    Escaped slots are marked in ``esc`` (returned second)."""
    esc = np.zeros(count, np.bool_)
    nbits_u = unary.size * 8
    up = 0
    rbits = 0
    for i in range(count):
        q = 0
        while True:
            if up >= nbits_u:
                return 1, esc
            off = up & 7
            b = (np.int64(unary[up >> 3]) << off) & 0xFF
            if b == 0:
                q += 8 - off
                up += 8 - off
                if q > escape:
                    return 2, esc
                continue
            z = _CLZ8[b]
            q += z
            up += z + 1
            break
        if q > escape:
            return 2, esc
        if q == escape:
            esc[i] = True
        else:
            out[i] = np.uint64(q) << np.uint64(ks[i])
            rbits += ks[i]
    if count == 0:
        if unary.size:
            return 3, esc
    else:
        if (up + 7) // 8 != unary.size:
            return 3, esc
        while up < nbits_u:
            if (unary[up >> 3] >> (7 - (up & 7))) & 1:
                return 3, esc
            up += 1
    if (rbits + 7) // 8 != rem.size:
        return 4, esc
    acc = np.uint64(0)
    nb = 0
    j = 0
    for i in range(count):
        k = ks[i]
        if esc[i] or k == 0:
            continue
        while nb < k:
            acc = (acc << np.uint64(8)) | np.uint64(rem[j])
            j += 1
            nb += 8
        nb -= k
        out[i] |= (acc >> np.uint64(nb)) & ((np.uint64(1) << np.uint64(k)) - np.uint64(1))
        acc &= (np.uint64(1) << np.uint64(nb)) - np.uint64(1)
    return 0, esc
