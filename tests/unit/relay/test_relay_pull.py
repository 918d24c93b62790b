"""A pull in flight: pieces land out of order, readers see each range as soon as its bytes are here."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from deltarl.errors import IntegrityError
from deltarl.relay.pull import Pull


def _begun(tmp_path: Path, size: int, piece_bytes: int = 4096) -> tuple[Pull, Path]:
    """A pull whose size is known and whose temporary file exists, as the relay begins one."""
    tmp = tmp_path / "obj"
    tmp.touch()
    pull = Pull("k")
    pull.begin(size, "e", str(tmp), piece_bytes=piece_bytes)
    return pull, tmp


async def test_ranges_are_available_as_their_pieces_land_and_the_hash_follows_the_prefix(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    pull, tmp = _begun(tmp_path, len(data))  # pieces [0, 4096) [4096, 8192) [8192, 10000)
    assert pull.pieces == 3
    assert pull.available(0) == 0

    pull.write(4096, data[4096:5000])  # piece 1, ahead of the prefix
    assert pull.prefix == 0
    assert pull.available(0) == 0
    assert pull.available(4096) == 5000
    assert pull.available(4500) == 5000
    assert pull.available(5000) == 5000  # nothing past it yet

    pull.write(0, data[:4096])  # piece 0 whole: the prefix runs on into piece 1
    assert pull.prefix == 5000
    assert pull.available(100) == 5000

    pull.write(8192, data[8192:])  # piece 2 whole, piece 1 still short
    assert pull.available(5000) == 5000
    assert pull.available(9000) == 10_000
    pull.write(5000, data[5000:8192])  # closes the gap: everything is contiguous
    assert pull.prefix == 10_000
    assert pull.available(0) == 10_000
    assert pull.digest() == hashlib.sha256(data).hexdigest()
    assert tmp.read_bytes() == data


async def test_an_empty_object_needs_no_pieces(tmp_path: Path) -> None:
    pull, _ = _begun(tmp_path, 0)
    assert pull.pieces == 0
    assert pull.available(0) == 0
    assert pull.digest() == hashlib.sha256(b"").hexdigest()


def _pieces(data: bytes, size: int) -> tuple[str, ...]:
    return tuple(hashlib.sha256(data[i : i + size]).hexdigest() for i in range(0, len(data), size))


async def test_with_the_manifests_pieces_each_byte_is_hashed_once_and_the_digest_is_the_manifests(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    pull, tmp = _begun(tmp_path, len(data))
    pull.write(0, data[:3000])  # hashed whole while the manifest's ref is unknown
    pull.expect(hashlib.sha256(data).hexdigest(), _pieces(data, 4096), 4096)
    assert pull._hasher is None  # from now on the pieces are the check: no second pass over the bytes
    pull.write(3000, data[3000:4096])
    assert pull.verified(0) == 4096
    pull.write(4096, data[4096:8192])
    pull.write(8192, data[8192:])
    assert pull.verified(0) == 10_000
    assert pull.digest() == hashlib.sha256(data).hexdigest()
    assert tmp.read_bytes() == data


async def test_a_piece_that_differs_fails_the_digest_too(tmp_path: Path) -> None:
    data = os.urandom(9000)
    pull, _ = _begun(tmp_path, len(data))
    pull.expect(hashlib.sha256(data).hexdigest(), _pieces(data, 4096), 4096)
    pull.write(0, data[:4096])
    with pytest.raises(IntegrityError, match="piece 1"):
        pull.write(4096, b"\0" + data[4097:8192])
    with pytest.raises(IntegrityError, match="piece 1"):
        pull.write(8192, data[8192:])
    with pytest.raises(IntegrityError, match="piece 1"):
        pull.digest()  # never the manifest's sha256 for bytes that did not match it
