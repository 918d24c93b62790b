"""Key, prefix and range validation shared by the backends."""

from __future__ import annotations

import pytest

from deltarl.errors import InvalidKey, InvalidRange
from deltarl.storage.keys import clamp_range, etag_of, validate_key, validate_prefix


@pytest.mark.parametrize(
    "key", ["a", "run/HEAD", "r/versions/000000000042/seg-00000.bin", ".hidden", "a/.b", "a..b"]
)
def test_valid_keys(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize(
    "key", ["", "/a", "a/", "a//b", ".", "..", "a/../b", "a/./b", "a\\b", "C:\\x", "a\x00", b"bytes", None]
)
def test_invalid_keys(key: object) -> None:
    with pytest.raises(InvalidKey):
        validate_key(key)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix", ["", "a", "a/", "run/versions/0000", "a/.", "a/.."])
def test_valid_prefixes(prefix: str) -> None:
    assert validate_prefix(prefix) == prefix


@pytest.mark.parametrize("prefix", ["/", "/a", "a//b", "../a", "a/../b/", "a\\", None])
def test_invalid_prefixes(prefix: object) -> None:
    with pytest.raises(InvalidKey):
        validate_prefix(prefix)  # type: ignore[arg-type]


def test_clamp_range() -> None:
    assert clamp_range("k", 0, None, 10) == (0, 10)
    assert clamp_range("k", 3, 7, 10) == (3, 7)
    assert clamp_range("k", 3, 70, 10) == (3, 10)
    assert clamp_range("k", 10, None, 10) == (10, 10)
    assert clamp_range("k", 4, 4, 10) == (4, 4)
    for start, end in ((11, None), (-1, 2), (5, 4)):
        with pytest.raises(InvalidRange, match="k"):
            clamp_range("k", start, end, 10)


def test_etag_is_md5_hex() -> None:
    assert etag_of(b"") == "d41d8cd98f00b204e9800998ecf8427e"
