"""The ``dense`` codec (id 3): every element's difference, for chunks that mostly changed.

Zigzag(new - old) of every element of the chunk (zero where unchanged), split into byte planes (low
byte first) and zstd-compressed. Layout: docs/FORMAT.md.
"""

from __future__ import annotations

import numpy as np

from deltarl.codec.chunk import Changes, Decoded, pack_streams, unpack_streams, unzigzag, unzstd, zigzag, zstd
from deltarl.errors import FormatError


def encode(old: np.ndarray, new: np.ndarray, dtype: str, changes: Changes) -> bytes:
    """Byte planes of zigzag(new - old) over the whole chunk, zstd (the positions are implied)."""
    z = zigzag(new - old).astype(old.dtype.newbyteorder("<"))
    planes = z.view(np.uint8).reshape(-1, old.dtype.itemsize).T.tobytes()
    return pack_streams(b"", [zstd(planes)])


def decode(old: np.ndarray, payload: memoryview, changed: int) -> Decoded:
    """Positions and new bits of one chunk."""
    _, (planes_z,) = unpack_streams(payload, "<", 1)
    isz = old.dtype.itemsize
    planes = np.frombuffer(unzstd(planes_z, old.size * isz), dtype=np.uint8)
    z = np.ascontiguousarray(planes.reshape(isz, -1).T).view(old.dtype.newbyteorder("<")).reshape(-1)
    z = z.astype(old.dtype)
    pos = np.flatnonzero(z)
    if pos.size != changed:
        raise FormatError(f"dense chunk changes {pos.size} elements, header says {changed}")
    o = old[pos]
    return Decoded(pos.astype(np.int64), o + unzigzag(z[pos]), o)
