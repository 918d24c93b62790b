"""The ``sparse`` codec (id 5): a low-density chunk whose decode reads the base only where it changed.

``ctx`` ranks each change among the chunk's elements of its exponent class, so its decoder scans
the whole chunk of the base: at 0.02% density that scan is ~5000 elements read per change. This
codec codes the positions themselves (Rice gaps with one parameter per chunk) and the values the
way ``ctx`` does (a sign bit per change, the few with ``|d| > 1`` as gaps and magnitudes). The
decoder turns the payload into positions and differences without the base, then reads the old
bits at those positions only (a gather, on the host or on the tensor's device): its cost is the
changes, not the chunk. Layout: docs/FORMAT.md, codec 5.
"""

from __future__ import annotations

import struct

import numpy as np

from deltarl.codec import bitio, kernels
from deltarl.codec.chunk import Changes, Decoded, OldReader, pack_streams, unpack_streams
from deltarl.errors import FormatError

_PARAMS = "<BBBQ"  # k_pos, k_big_gap, k_big_val, n_big
NSTREAMS = 10


def _k(values: np.ndarray) -> int:
    return int(bitio.rice_k(np.array([int(values.sum(dtype=np.uint64))]), np.array([values.size]))[0])


def encode(old: np.ndarray, new: np.ndarray, dtype: str, changes: Changes) -> bytes:
    """Encode the changes (non-empty): work in proportion to the changes."""
    pos = changes.positions()
    width = old.dtype.itemsize * 8
    o, n = kernels.gather(old, pos), kernels.gather(new, pos)
    d = (n.astype(np.int64) - o.astype(np.int64)) % (1 << width)
    neg = d >= (1 << (width - 1))
    mag = np.where(neg, (1 << width) - d, d) - 1  # |d| - 1 >= 0; mostly 0
    big = np.flatnonzero(mag > 0)
    u64 = np.uint64
    gaps = (np.diff(pos, prepend=-1) - 1).astype(u64)
    big_gaps = (np.diff(big, prepend=-1) - 1).astype(u64)
    big_vals = (mag[big] - 1).astype(u64)
    ks = (_k(gaps), _k(big_gaps), _k(big_vals))
    streams: list[bytes] = []
    for values, k in zip((gaps, big_gaps, big_vals), ks, strict=True):
        unary, rem, esc = bitio.rice_encode(values, k)
        streams += [unary, rem, esc.astype("<u8").tobytes()]
    streams.append(np.packbits(neg.astype(np.uint8)).tobytes())
    return pack_streams(struct.pack(_PARAMS, *ks, big.size), streams)


def _increasing(gaps: np.ndarray, limit: int, what: str) -> np.ndarray:
    """Positions ``p_i = p_{i-1} + gap_i + 1`` (``p_{-1} = -1``), all below ``limit``."""
    if gaps.size == 0:
        return np.zeros(0, dtype=np.int64)
    if int(gaps.max()) >= limit:
        raise FormatError(f"sparse {what} gap outside the chunk")
    if gaps.size * limit >= 1 << 62 and sum(int(g) + 1 for g in gaps.tolist()) > limit:
        raise FormatError(f"sparse {what} outside the chunk")  # no int64 wrap below
    out = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if int(out[-1]) >= limit:
        raise FormatError(f"sparse {what} outside the chunk")
    return out


def decode(old: np.ndarray, payload: memoryview, changed: int) -> Decoded:
    """Positions and new bits of one chunk whose base is at hand (read at the changes only)."""
    return decode_gather(lambda pos: kernels.gather(old, pos), old.size, payload, changed, old.dtype)


def decode_gather(read_old: OldReader, count: int, payload: memoryview, changed: int, udt: np.dtype) -> Decoded:
    """Positions and new bits of one chunk; the base is read only through ``read_old(positions)``."""
    (k_pos, k_bg, k_bv, n_big), st = unpack_streams(payload, _PARAMS, NSTREAMS)
    width = udt.itemsize * 8
    if max(k_pos, k_bg, k_bv) > 32:
        raise FormatError("sparse rice parameter > 32")
    if n_big > changed:
        raise FormatError(f"sparse chunk has {n_big} large values among {changed} changes")
    for i in (2, 5, 8):
        if len(st[i]) % 8:
            raise FormatError("sparse escape stream is not a whole number of u64")
    if len(st[9]) != (changed + 7) // 8:
        raise FormatError("sparse sign stream has the wrong length")
    esc = [np.frombuffer(st[i], dtype="<u8") for i in (2, 5, 8)]
    pos = _increasing(bitio.rice_decode(st[0], st[1], esc[0], k_pos, changed), count, "position")
    big = _increasing(bitio.rice_decode(st[3], st[4], esc[1], k_bg, n_big), changed, "large-value")
    big_vals = bitio.rice_decode(st[6], st[7], esc[2], k_bv, n_big)
    if big_vals.size and int(big_vals.max()) >= (1 << (width - 1)) - 1:
        raise FormatError("sparse value difference out of range")
    neg = np.unpackbits(np.frombuffer(st[9], dtype=np.uint8), count=changed).astype(bool)
    m = np.ones(changed, dtype=np.int64)
    m[big] = big_vals.astype(np.int64) + 2
    d = np.where(neg, (1 << width) - m, m).astype(udt)
    old = read_old(pos)
    return Decoded(pos, old + d, old)
