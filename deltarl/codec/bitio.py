"""Vectorised (pure numpy) bit coders: split-stream Golomb-Rice, fixed-width packing, LEB128.

Rice codes are stored as two streams so both directions vectorise: a *unary* stream (per value,
``q`` zero bits then a one bit, MSB-first) and a *remainder* stream (``k`` bits per value,
MSB-first). A quotient of ``RICE_ESCAPE`` or more is written as ``RICE_ESCAPE`` zeros and a one, and
the value itself goes to a separate u64 escape list (no remainder bits). Every decoder validates
its input and raises FormatError; nothing here trusts lengths it was given.
"""

from __future__ import annotations

import numpy as np

from deltarl.codec import kernels
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


def rice_k(total: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Integer Rice parameter per group: ceil(log2(mean * ~ln2)) in exact integer arithmetic.

    x = (total * 11) // (count * 16); k = bit_length(x - 1) for x > 1, else 0; capped at 32.
    Integer-only so the numba and numpy encoders always choose the same parameters.
    """
    x = (total.astype(np.int64) * 11) // np.maximum(count.astype(np.int64) * 16, 1)
    k = np.zeros(x.shape, dtype=np.int64)
    y = np.maximum(x - 1, 0)
    while bool((y > 0).any()):
        k += y > 0
        y >>= 1
    return np.minimum(k, 32)


def pack_bits(values: np.ndarray, widths: np.ndarray | int) -> bytes:
    """Pack unsigned ``values[i]`` (< 2**widths[i]) as consecutive bit fields, MSB-first, zero padded."""
    v = values.astype(_U64, copy=False)
    w = np.broadcast_to(np.asarray(widths, dtype=np.int64), v.shape)
    total = int(w.sum())
    if total == 0:
        return b""
    starts = np.cumsum(w) - w
    rep = np.repeat(v, w)
    j = np.arange(total, dtype=np.int64) - np.repeat(starts, w)
    shift = (np.repeat(w, w) - 1 - j).astype(_U64)
    return np.packbits(((rep >> shift) & _U64(1)).astype(np.uint8)).tobytes()


def unpack_bits(data: bytes | memoryview, widths: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_bits`; the stream must be exactly ``ceil(sum(widths)/8)`` bytes."""
    w = widths.astype(np.int64, copy=False)
    total = int(w.sum())
    if len(data) != (total + 7) // 8:
        raise FormatError(f"bit-packed stream has {len(data)} bytes, expected {(total + 7) // 8}")
    if total == 0:
        return np.zeros(w.size, dtype=_U64)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=total).astype(_U64)
    starts = np.cumsum(w) - w
    j = np.arange(total, dtype=np.int64) - np.repeat(starts, w)
    shifted = bits << (np.repeat(w, w) - 1 - j).astype(_U64)
    out = np.zeros(w.size, dtype=_U64)
    nz = w > 0
    out[nz] = np.add.reduceat(shifted, starts[nz])
    return out


def rice_encode(values: np.ndarray, k: np.ndarray | int) -> tuple[bytes, bytes, np.ndarray]:
    """Rice-code unsigned ``values`` with parameter(s) ``k``: (unary bytes, remainder bytes, escapes)."""
    v = values.astype(_U64, copy=False)
    ks = np.broadcast_to(np.asarray(k, dtype=np.int64), v.shape)
    jit = kernels.jit()
    if jit is not None:
        unary_a, rem_a, esc_a = jit.rice_encode(v, np.ascontiguousarray(ks), RICE_ESCAPE)
        return unary_a.tobytes(), rem_a.tobytes(), v[esc_a]
    q = v >> ks.astype(_U64)
    esc = q >= RICE_ESCAPE
    q = np.where(esc, _U64(RICE_ESCAPE), q).astype(np.int64)
    ends = np.cumsum(q + 1) - 1  # bit index of each terminating one
    total = int(ends[-1]) + 1 if v.size else 0
    unary = np.zeros(total, dtype=np.uint8)
    unary[ends] = 1
    widths = np.where(esc, 0, ks)
    rem = pack_bits(v & ((_U64(1) << ks.astype(_U64)) - _U64(1)), widths)
    return np.packbits(unary).tobytes(), rem, v[esc]


def rice_decode(
    unary: bytes | memoryview, rem: bytes | memoryview, escapes: np.ndarray, k: np.ndarray | int, count: int
) -> np.ndarray:
    """Decode ``count`` Rice-coded values (parameter(s) ``k``); raises FormatError on any inconsistency."""
    ks = np.broadcast_to(np.asarray(k, dtype=np.int64), (count,))
    jit = kernels.jit()
    if jit is not None:
        return _rice_decode_jit(jit, unary, rem, escapes, np.ascontiguousarray(ks), count)
    u = np.unpackbits(np.frombuffer(unary, dtype=np.uint8))
    ones = np.flatnonzero(u)
    if ones.size != count:
        raise FormatError(f"unary stream holds {ones.size} codes, expected {count}")
    if len(unary) != (int(ones[-1]) // 8 + 1 if count else 0):
        raise FormatError("unary stream has trailing bytes")
    q = np.diff(ones, prepend=-1) - 1
    if q.size and int(q.max()) > RICE_ESCAPE:
        raise FormatError("unary code longer than the escape length")
    esc = q == RICE_ESCAPE
    n_esc = int(esc.sum())
    if n_esc != escapes.size:
        raise FormatError(f"{n_esc} escaped codes but {escapes.size} escape values")
    r = unpack_bits(rem, np.where(esc, 0, ks))
    out = (q.astype(_U64) << ks.astype(_U64)) | r
    esc_vals = escapes.astype(_U64, copy=False)
    if n_esc and bool((esc_vals < (_U64(RICE_ESCAPE) << ks[esc].astype(_U64))).any()):
        raise FormatError("escaped value small enough for a plain code")
    out[esc] = esc_vals
    return out


_RICE_ERRORS = {
    1: "unary stream holds fewer codes than expected",
    2: "unary code longer than the escape length",
    3: "unary stream has trailing bits or bytes",
    4: "remainder stream has the wrong length",
}


def _rice_decode_jit(
    jit: object,
    unary: bytes | memoryview,
    rem: bytes | memoryview,
    escapes: np.ndarray,
    ks: np.ndarray,
    count: int,
) -> np.ndarray:
    out = np.zeros(count, dtype=_U64)
    u = np.frombuffer(unary, dtype=np.uint8)
    r = np.frombuffer(rem, dtype=np.uint8)
    err, esc = jit.rice_decode(u, r, ks, count, RICE_ESCAPE, out)  # type: ignore[attr-defined]
    if err:
        raise FormatError(_RICE_ERRORS[err])
    n_esc = int(esc.sum())
    if n_esc != escapes.size:
        raise FormatError(f"{n_esc} escaped codes but {escapes.size} escape values")
    esc_vals = escapes.astype(_U64, copy=False)
    if n_esc and bool((esc_vals < (_U64(RICE_ESCAPE) << ks[esc].astype(_U64))).any()):
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
