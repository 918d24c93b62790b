"""The ``rice`` codec (id 2): Rice-coded gaps and zstd'd zigzag differences with escapes.

Gaps ``p_i - p_{i-1} - 1`` Rice-coded with one parameter per chunk; each change's zigzag(new - old)
as one byte, 255 escaping to the raw new value, the bytes zstd-compressed. Only used when asked for
by name. Layout: docs/FORMAT.md.
"""

from __future__ import annotations

import struct

import numpy as np

from deltarl.codec import bitio
from deltarl.codec.chunk import (
    Changes,
    Decoded,
    check_positions,
    pack_streams,
    raw_values,
    unpack_streams,
    unzigzag,
    unzstd,
    zigzag,
    zstd,
)
from deltarl.errors import FormatError

ESCAPE_BYTE = 255


def encode(old: np.ndarray, new: np.ndarray, dtype: str, changes: Changes) -> bytes:
    """Rice gaps + zigzag(new - old) bytes (255 = escape to the raw new value), zstd."""
    pos = changes.positions()
    gaps = np.diff(pos, prepend=-1) - 1
    k = bitio.rice_param(gaps)
    unary, rem, pos_esc = bitio.rice_encode(gaps, k)
    o, n = old[pos], new[pos]
    z = zigzag(n - o)
    esc = z >= ESCAPE_BYTE
    small = np.where(esc, ESCAPE_BYTE, z).astype(np.uint8)
    streams = [
        unary,
        rem,
        pos_esc.astype("<u8").tobytes(),
        zstd(small.tobytes()),
        n[esc].astype(n.dtype.newbyteorder("<")).tobytes(),
    ]
    return pack_streams(struct.pack("<B", k), streams)


def decode(old: np.ndarray, payload: memoryview, changed: int) -> Decoded:
    """Positions and new bits of one chunk."""
    (k,), (unary, rem, pos_esc_b, vals_z, esc_b) = unpack_streams(payload, "<B", 5)
    if k > 32:
        raise FormatError(f"rice parameter {k} > 32")
    if len(pos_esc_b) % 8:
        raise FormatError("position escape stream is not a whole number of u64")
    pos_esc = np.frombuffer(pos_esc_b, dtype="<u8")
    gaps = bitio.rice_decode(unary, rem, pos_esc, k, changed)
    if gaps.size and int(gaps.max()) >= old.size:
        raise FormatError("rice gap outside the chunk")
    pos = np.cumsum(gaps.astype(np.int64) + 1) - 1
    pos = check_positions(pos, old.size)
    small = np.frombuffer(unzstd(vals_z, changed), dtype=np.uint8)
    esc = small == ESCAPE_BYTE
    esc_vals = raw_values(esc_b, int(esc.sum()), old.dtype)
    o = old[pos]
    vals = o + unzigzag(small.astype(old.dtype))
    vals[esc] = esc_vals
    if bool((vals == o).any()):
        raise FormatError("a changed element decodes to its old value")
    return Decoded(pos, vals, o)
