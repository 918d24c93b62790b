"""Parsing of a single-range HTTP ``Range`` header (RFC 9110 byte ranges)."""

from __future__ import annotations

import re

from deltarl.errors import RangeNotSatisfiable

_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")



def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Return ``(start, end)`` (end exclusive) for ``header`` against an object of ``size`` bytes.

    ``None`` means "no range: send the whole object". Multi-range requests, malformed headers and
    ranges that start at or past the end raise :class:`RangeNotSatisfiable`.
    """
    if header is None:
        return None
    m = _RANGE.match(header)
    if m is None:
        raise RangeNotSatisfiable(f"unsupported Range header {header!r}")
    first, last = m.group(1), m.group(2)
    if first == "" and last == "":
        raise RangeNotSatisfiable(f"empty Range header {header!r}")
    if first == "":  # suffix range: the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"suffix range {header!r} of an object of {size} bytes")
        return max(0, size - n), size
    start = int(first)
    end = size if last == "" else min(int(last) + 1, size)
    if start >= size or (last != "" and int(last) < start):
        raise RangeNotSatisfiable(f"range {header!r} outside an object of {size} bytes")
    return start, end
