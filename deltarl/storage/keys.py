"""Argument checks shared by every backend (keys, prefixes, byte ranges) and the local ETag."""

from __future__ import annotations

import hashlib

from deltarl.errors import InvalidKey, InvalidRange

_FORBIDDEN_CHARS = ("\\", "\x00")


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid object key, else raise ``InvalidKey``.

    A valid key is a non-empty ``str`` of ``/``-separated parts, none of them empty, ``.`` or
    ``..``, with no backslash or NUL anywhere (so no absolute path, ``a//b`` or trailing ``/``).
    """
    if not isinstance(key, str):
        raise InvalidKey(f"object key must be str, got {type(key).__name__}: {key!r}")
    if not key:
        raise InvalidKey("object key is empty")
    if any(ch in key for ch in _FORBIDDEN_CHARS):
        raise InvalidKey(f"object key contains a backslash or NUL: {key!r}")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKey(f"object key has an empty, '.' or '..' part: {key!r}")
    return key


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` unchanged if it can prefix valid keys, else raise ``InvalidKey``.

    A prefix is a plain string prefix (``"versions/0000"`` matches ``"versions/000000000042/…"``), so
    its last part may be empty or partial; every part before the last must be a valid key part.
    """
    if not isinstance(prefix, str):
        raise InvalidKey(f"key prefix must be str, got {type(prefix).__name__}: {prefix!r}")
    if any(ch in prefix for ch in _FORBIDDEN_CHARS):
        raise InvalidKey(f"key prefix contains a backslash or NUL: {prefix!r}")
    for part in prefix.split("/")[:-1]:
        if part in ("", ".", ".."):
            raise InvalidKey(f"key prefix has an empty, '.' or '..' part: {prefix!r}")
    return prefix


def etag_of(data: bytes) -> str:
    """The ETag memory and local stores give ``data``: its hex MD5, as S3 gives a single-part PUT."""
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def check_range_args(key: str, start: int, end: int | None) -> None:
    """Reject a range that is wrong whatever the object's size: negative start, or ``start > end``."""
    if start < 0 or (end is not None and end < start):
        raise InvalidRange(f"{key}: bad byte range [{start}, {end})")


def clamp_range(key: str, start: int, end: int | None, size: int) -> tuple[int, int]:
    """Return ``[start, end)`` clamped to ``size``; ``start > size`` raises ``InvalidRange``."""
    check_range_args(key, start, end)
    if start > size:
        raise InvalidRange(f"{key}: range start {start} is beyond the object's size {size}")
    return start, size if end is None else min(end, size)


def strip_etag(value: str | None) -> str:
    """An ETag as our stores report it: without quotes or a weak ``W/`` prefix ("" for none)."""
    if not value:
        return ""
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')
