"""Vectorised (pure numpy) bit coders: split-stream Golomb-Rice, fixed-width packing, LEB128.

Rice codes are stored as two streams so both directions vectorise: a *unary* stream (per value,
``q`` zero bits then a one bit, MSB-first) and a *remainder* stream (``k`` bits per value,
MSB-first). A quotient of ``RICE_ESCAPE`` or more is written as ``RICE_ESCAPE`` zeros and a one, and
the value itself goes to a separate u64 escape list (no remainder bits). Every decoder validates
its input and raises FormatError; nothing here trusts lengths it was given.
"""

from __future__ import annotations

import numpy as np

from deltarl.errors import FormatError

RICE_ESCAPE = 40
_U64 = np.uint64


def rice_param(values: np.ndarray) -> int:
    """The Rice parameter k (0..32) that is close to optimal for geometric-ish ``values``."""
    if values.size == 0:
        return 0
    mean = float(values.mean())
    if mean < 1.0:
        return 0
    # k = ceil(log2(mean * ln2)) is within a few % of the best for geometric sources.
    k = int(np.ceil(np.log2(mean * 0.6931471805599453)))
    return max(0, min(32, k))


def pack_bits(values: np.ndarray, width: int) -> bytes:
    """Pack unsigned ``values`` (< 2**width) as ``width``-bit fields, MSB-first, zero padded."""
    if width == 0 or values.size == 0:
        return b""
    v = values.astype(_U64, copy=False)
    shifts = np.arange(width - 1, -1, -1, dtype=_U64)
    bits = ((v[:, None] >> shifts[None, :]) & _U64(1)).astype(np.uint8)
    return np.packbits(bits.reshape(-1)).tobytes()


def unpack_bits(data: bytes | memoryview, count: int, width: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`; the stream must be exactly ``ceil(count*width/8)`` bytes."""
    need = (count * width + 7) // 8
    if len(data) != need:
        raise FormatError(f"bit-packed stream has {len(data)} bytes, expected {need}")
    if width == 0 or count == 0:
        return np.zeros(count, dtype=_U64)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count * width).reshape(count, width)
    weights = _U64(1) << np.arange(width - 1, -1, -1, dtype=_U64)
    return (bits.astype(_U64) * weights[None, :]).sum(axis=1, dtype=_U64)


def rice_encode(values: np.ndarray, k: int) -> tuple[bytes, bytes, np.ndarray]:
    """Rice-code unsigned ``values`` with parameter ``k``: (unary bytes, remainder bytes, escapes)."""
    v = values.astype(_U64, copy=False)
    q = v >> _U64(k)
    esc = q >= RICE_ESCAPE
    q = np.where(esc, _U64(RICE_ESCAPE), q).astype(np.int64)
    ends = np.cumsum(q + 1) - 1  # bit index of each terminating one
    total = int(ends[-1]) + 1 if v.size else 0
    unary = np.zeros(total, dtype=np.uint8)
    unary[ends] = 1
    plain = v[~esc]
    rem = pack_bits(plain & _U64((1 << k) - 1), k) if k else b""
    return np.packbits(unary).tobytes(), rem, v[esc]


def rice_decode(
    unary: bytes | memoryview, rem: bytes | memoryview, escapes: np.ndarray, count: int, k: int
) -> np.ndarray:
    """Decode ``count`` Rice-coded values; raises FormatError on any inconsistency."""
    u = np.unpackbits(np.frombuffer(unary, dtype=np.uint8))
    ones = np.flatnonzero(u)
    if ones.size != count:
        raise FormatError(f"unary stream holds {ones.size} codes, expected {count}")
    if count and len(unary) != int(ones[-1]) // 8 + 1:
        raise FormatError("unary stream has trailing bytes")
    if count == 0 and len(unary):
        raise FormatError("unary stream has trailing bytes")
    q = np.diff(ones, prepend=-1) - 1
    if q.size and int(q.max()) > RICE_ESCAPE:
        raise FormatError("unary code longer than the escape length")
    esc = q == RICE_ESCAPE
    n_esc = int(esc.sum())
    if n_esc != escapes.size:
        raise FormatError(f"{n_esc} escaped codes but {escapes.size} escape values")
    r = unpack_bits(rem, count - n_esc, k)
    out = np.empty(count, dtype=_U64)
    out[~esc] = (q[~esc].astype(_U64) << _U64(k)) | r
    esc_vals = escapes.astype(_U64, copy=False)
    if n_esc and int(esc_vals.min()) < (RICE_ESCAPE << k):
        raise FormatError("escaped value small enough for a plain code")
    out[esc] = esc_vals
    return out


def leb128_encode(values: np.ndarray) -> bytes:
    """Unsigned LEB128 varints of ``values``, concatenated."""
    v = values.astype(_U64, copy=False)
    if v.size == 0:
        return b""
    nbytes = np.ones(v.size, dtype=np.int64)
    for j in range(1, 10):
        nbytes += v >= (_U64(1) << _U64(7 * j))
    starts = np.cumsum(nbytes) - nbytes
    out = np.zeros(int(nbytes.sum()), dtype=np.uint8)
    for j in range(10):
        sel = nbytes > j
        if not sel.any():
            break
        byte = ((v[sel] >> _U64(7 * j)) & _U64(0x7F)).astype(np.uint8)
        more = (nbytes[sel] > j + 1).astype(np.uint8) << 7
        out[starts[sel] + j] = byte | more
    return out.tobytes()


def leb128_decode(data: bytes | memoryview, count: int) -> np.ndarray:
    """Decode exactly ``count`` LEB128 varints that fill ``data``; raises FormatError otherwise."""
    b = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if ends.size != count or (count and int(ends[-1]) != b.size - 1) or (count == 0 and b.size):
        raise FormatError(f"varint stream does not hold exactly {count} values")
    if count == 0:
        return np.zeros(0, dtype=_U64)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if int(lengths.max()) > 10:
        raise FormatError("varint longer than 10 bytes")
    j = np.arange(b.size) - np.repeat(starts, lengths)
    if int(lengths.max()) == 10 and bool((b[ends[lengths == 10]] > 1).any()):
        raise FormatError("varint overflows 64 bits")
    parts = (b & 0x7F).astype(_U64) << (7 * j).astype(_U64)
    return np.add.reduceat(parts, starts)
