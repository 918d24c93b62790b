"""A pull in flight: pieces land out of order, readers see each range as soon as its bytes are here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deltarl.codec.hashing import leaves
from deltarl.errors import IntegrityError
from deltarl.pipeline.manifest import ObjectRef
from deltarl.relay.pull import Pull

P = 64 << 10  # the smallest piece a manifest records


def _begun(tmp_path: Path, size: int, piece_bytes: int = 4096) -> tuple[Pull, Path]:
    """A pull whose size is known and whose temporary file exists, as the relay begins one."""
    tmp = tmp_path / "obj"
    tmp.touch()
    pull = Pull("k")
    pull.begin(size, "e", str(tmp), piece_bytes=piece_bytes)
    return pull, tmp


async def test_ranges_are_available_as_their_pieces_land(tmp_path: Path) -> None:
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
    assert pull.finish_check() is False  # no manifest ref known: cached unverified
    assert tmp.read_bytes() == data


async def test_an_empty_object_needs_no_pieces(tmp_path: Path) -> None:
    pull, _ = _begun(tmp_path, 0)
    assert pull.pieces == 0
    assert pull.available(0) == 0
    assert pull.finish_check() is False


def _ref(data: bytes) -> ObjectRef:
    return ObjectRef.of("k", data, piece_size=P)


async def test_pieces_are_checked_from_the_block_hashes_taken_as_they_landed(tmp_path: Path) -> None:
    data = os.urandom(3 * P + 1000)
    pull, tmp = _begun(tmp_path, len(data), piece_bytes=P)
    pull.write(0, data[:3000])
    pull.write(3000, data[3000:P])  # hashed as it completes its piece, before the ref is known
    pull.expect(_ref(data))  # composed from the block hashes already taken: no second pass
    assert pull.verified(0) == P
    pull.write(P, data[P : 2 * P])
    pull.write(2 * P, data[2 * P :])
    assert pull.verified(0) == len(data)
    assert pull.finish_check() is True
    assert tmp.read_bytes() == data


async def test_a_manifest_piece_size_other_than_the_pulls_is_checked_too(tmp_path: Path) -> None:
    data = os.urandom(5 * P + 77)
    pull, _ = _begun(tmp_path, len(data), piece_bytes=P)
    pull.expect(ObjectRef.of("k", data, piece_size=2 * P))  # two pull pieces per manifest piece
    for i in range(0, len(data), P):
        pull.write(i, data[i : i + P])
    assert pull.finish_check() is True


async def test_a_piece_that_differs_fails_the_pull(tmp_path: Path) -> None:
    data = os.urandom(2 * P + 900)
    pull, _ = _begun(tmp_path, len(data), piece_bytes=P)
    pull.expect(_ref(data))
    pull.write(0, data[:P])
    with pytest.raises(IntegrityError, match="piece 1"):
        pull.write(P, b"\0" + data[P + 1 : 2 * P])
    with pytest.raises(IntegrityError, match="piece 1"):
        pull.write(2 * P, data[2 * P :])
    with pytest.raises(IntegrityError, match="piece 1"):
        pull.finish_check()  # never verified: bytes that did not match the manifest


async def test_landed_pieces_are_served_from_memory_until_every_reader_is_past_them(tmp_path: Path) -> None:
    data = os.urandom(4 * 4096)
    pull, _ = _begun(tmp_path, len(data))
    pull.readers[1] = 0  # a reader at the start
    pull.write(0, data[:4096])
    pull.write(4096, data[4096:8192])
    view = pull.memory_view(100, 6000)
    assert view is not None
    assert bytes(view) == data[100:4096]  # up to the end of the chunk holding 100
    assert bytes(pull.memory_view(4096, 8192) or b"") == data[4096:8192]
    pull.readers[1] = 4096  # the reader passed piece 0
    pull.release()
    assert pull.memory_view(0, 4096) is None  # let go: a late reader reads the file
    assert pull.memory_view(4096, 8192) is not None
    del pull.readers[1]
    pull.release()
    assert pull.memory_view(4096, 8192) is None  # no reader left: nothing is held


async def test_a_pull_holds_at_most_its_memory_budget_for_a_slow_reader(tmp_path: Path) -> None:
    data = os.urandom(8 * 4096)
    tmp = tmp_path / "obj"
    tmp.touch()
    pull = Pull("k", memory_bytes=3 * 4096)
    pull.begin(len(data), "e", str(tmp), piece_bytes=4096)
    pull.readers[1] = 0  # never moves
    for i in range(8):
        pull.write(i * 4096, data[i * 4096 : (i + 1) * 4096])
    assert sum(pull.memory_view(i * 4096, (i + 1) * 4096) is not None for i in range(8)) == 3  # the newest three
    assert pull.memory_view(7 * 4096, 8 * 4096) is not None
    assert tmp.read_bytes() == data  # every piece is in the file for the reader that fell behind


async def test_store_hashes_the_piece_it_completes_and_landed_checks_that_hash(tmp_path: Path) -> None:
    data = os.urandom(P + 9000)
    pull, _ = _begun(tmp_path, len(data), piece_bytes=P)
    pull.expect(_ref(data))
    assert pull.store(0, data[:1000]) is None  # the piece is not complete yet
    pull.landed(0, data[:1000])
    blocks = pull.store(1000, data[1000:P])
    assert blocks == leaves(data[:P])
    pull.landed(1000, data[1000:P], blocks)
    assert pull.verified(0) == P
    pull.store(P, data[P:])
    with pytest.raises(IntegrityError, match="piece 1"):  # bytes that hashed to other than the manifest's piece
        pull.landed(P, data[P:], b"\0" * 32)


async def test_big_pulls_are_flushed_window_by_window_and_small_ones_not(tmp_path: Path) -> None:
    data = os.urandom(10 * 4096 + 123)
    pull, tmp = _begun(tmp_path, len(data))
    pull.FLUSH_BYTES = 3 * 4096  # a window of three pieces (the default is 32 MiB)
    windows = []
    for i in range(0, len(data), 4096):
        pull.write(i, data[i : i + 4096])
        if (window := pull.flush_due()) is not None:
            pull.flush(*window)
            windows.append(window)
    assert windows == [(0, 12288), (12288, 24576), (24576, 36864), (36864, len(data))]
    assert tmp.read_bytes() == data
    (tmp_path / "small").mkdir()
    small, _ = _begun(tmp_path / "small", 5000)
    small.FLUSH_BYTES = 1 << 20
    small.write(0, os.urandom(4096))
    small.write(4096, os.urandom(5000 - 4096))
    assert small.flush_due() is None  # smaller than a window: it stays in the page cache for more readers
