"""The ``aurora`` codec (id 1): AuroraRL's reference layout, kept as a baseline.

Gaps between changed positions (the first position, then differences) as LEB128, and the new
values raw, little-endian. Only used when asked for by name. Layout: docs/FORMAT.md.
"""

from __future__ import annotations

import numpy as np

from deltarl.codec import bitio
from deltarl.codec.chunk import Changes, Decoded, check_positions, pack_streams, raw_values, unpack_streams
from deltarl.errors import FormatError


def encode(old: np.ndarray, new: np.ndarray, dtype: str, changes: Changes) -> bytes:
    """LEB128 gaps, then the new values raw."""
    pos = changes.positions()
    gaps = np.diff(pos, prepend=0)
    return pack_streams(
        b"", [bitio.leb128_encode(gaps), new[pos].astype(new.dtype.newbyteorder("<")).tobytes()]
    )


def decode(old: np.ndarray, payload: memoryview, changed: int) -> Decoded:
    """Positions and new bits of one chunk."""
    _, (gaps_b, vals_b) = unpack_streams(payload, "<", 2)
    gaps = bitio.leb128_decode(gaps_b, changed)
    if changed > 1 and int(gaps[1:].min()) == 0:
        raise FormatError("aurora gaps must be positive after the first")
    if gaps.size and int(gaps.max()) >= old.size:
        raise FormatError("aurora gap outside the chunk")
    pos = check_positions(np.cumsum(gaps.astype(np.int64)), old.size)
    vals = raw_values(vals_b, changed, old.dtype)
    o = old[pos]
    if bool((vals == o).any()):
        raise FormatError("a changed element decodes to its old value")
    return Decoded(pos, vals, o)
