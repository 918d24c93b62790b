"""Parsing of a single-range HTTP ``Range`` header (RFC 9110 byte ranges)."""

from __future__ import annotations

import re

from deltarl.errors import RangeNotSatisfiable

_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")
#: Longer numbers than this are only ever "past any object" (and ``int()`` refuses 4300+ digits).
_MAX_DIGITS = 19
_HUGE = 1 << 64


def _number(digits: str) -> int:
    return int(digits) if len(digits) <= _MAX_DIGITS else _HUGE


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Return ``(start, end)`` (end exclusive) for ``header`` against an object of ``size`` bytes.

    ``None`` means "no range: send the whole object" (200). Following RFC 9110 §14.2, a Range
    this server does not support (multiple ranges, a unit other than ``bytes``, bad syntax) is
    ignored, so it also gets ``None``. A single byte range that is empty or starts at or past the
    end raises :class:`RangeNotSatisfiable` (416).
    """
    if header is None:
        return None
    m = _RANGE.match(header)
    if m is None:
        return None
    first, last = m.group(1), m.group(2)
    if first == "" and last == "":
        return None
    if first == "":  # suffix range: the last N bytes
        n = _number(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"suffix range of {n} bytes of an object of {size} bytes")
        return max(0, size - n), size
    start = _number(first)
    end = size if last == "" else min(_number(last) + 1, size)
    if start >= size or (last != "" and _number(last) < start):
        raise RangeNotSatisfiable(f"range {header[:80]!r} outside an object of {size} bytes")
    return start, end
