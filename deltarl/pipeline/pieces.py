"""Piece hashes of a stored object (format 3): computed in the same pass as the bytes are written,
and checked piece by piece as they are read, so no byte is used before it is verified and no byte
is hashed twice.

``pieces[i]`` is the hash of bytes ``[i * piece_size, min((i + 1) * piece_size, size))``: the BLAKE3
of the hashes of its 64 KiB blocks (:mod:`deltarl.codec.hashing`); the object's root is composed
from the pieces. A writer feeds an object's bytes in order through :class:`PieceHasher` (any
buffer sizes), which also keeps every block hash (a keyframe's state digest is composed from
them); a reader feeds them through :class:`PieceVerifier`, which raises
:class:`~deltarl.errors.IntegrityError` naming the object at the first piece that differs, and at
:meth:`PieceVerifier.finish` if the object is truncated or oversized.
"""

from __future__ import annotations

from typing import Any

from deltarl.codec.hashing import BLOCK, HASH_BYTES, leaves, object_root, piece_hash
from deltarl.errors import IntegrityError, short_pair

DEFAULT_PIECE_SIZE = 1 << 20
MIN_PIECE_SIZE = 64 << 10
MAX_PIECE_SIZE = 64 << 20


def check_piece_size(piece_size: int, where: str) -> None:
    """A ValueError unless ``piece_size`` is a power of two in [64 KiB, 64 MiB]."""
    if (
        isinstance(piece_size, bool)
        or not isinstance(piece_size, int)
        or not MIN_PIECE_SIZE <= piece_size <= MAX_PIECE_SIZE
        or piece_size & (piece_size - 1)
    ):
        raise ValueError(f"{where}: piece_size must be a power of two in [{MIN_PIECE_SIZE}, {MAX_PIECE_SIZE}], got {piece_size!r}")


def piece_count(size: int, piece_size: int) -> int:
    """``ceil(size / piece_size)``: 0 for an empty object."""
    return -(-size // piece_size)


def hash_piece(data: Any) -> str:
    """The hash (hex) of one whole piece's bytes: one pass over them."""
    return piece_hash(leaves(data)).hex()


def pieces_of_blocks(block_hashes: bytes, piece_size: int) -> tuple[str, ...]:
    """The piece hashes (hex) of an object from the hashes of all its 64 KiB blocks: no byte hashed."""
    per = piece_size // BLOCK * HASH_BYTES
    return tuple(piece_hash(block_hashes[a : a + per]).hex() for a in range(0, len(block_hashes), per))


class _Blocks:
    """Cuts bytes fed in order into 64 KiB blocks and hashes each once (a partial block is carried)."""

    def __init__(self) -> None:
        self.carry = bytearray()
        self.hashes = bytearray()  # 32 bytes per finished block, in order

    def feed(self, mv: memoryview) -> None:
        pos = 0
        if self.carry:
            take = min(BLOCK - len(self.carry), len(mv))
            self.carry += mv[:take]
            pos = take
            if len(self.carry) < BLOCK:
                return
            self.hashes += leaves(self.carry)
            self.carry = bytearray()
        whole = pos + (len(mv) - pos) // BLOCK * BLOCK
        if whole > pos:
            self.hashes += leaves(mv[pos:whole])
        if whole < len(mv):
            self.carry += mv[whole:]

    def flush(self) -> None:
        if self.carry:
            self.hashes += leaves(self.carry)
            self.carry = bytearray()


class PieceHasher:
    """Block hashes, piece hashes and the root of an object, in one pass over bytes fed in order."""

    def __init__(self, piece_size: int = DEFAULT_PIECE_SIZE) -> None:
        check_piece_size(piece_size, "PieceHasher")
        self.piece_size = piece_size
        self.size = 0
        self._blocks = _Blocks()
        self._per_piece = piece_size // BLOCK * HASH_BYTES  # bytes of block hashes per piece
        self.pieces: list[str] = []

    def update(self, data: Any) -> None:
        """Feed the next bytes of the object (bytes, bytearray, memoryview or a contiguous array)."""
        mv = memoryview(data).cast("B")
        self.size += len(mv)
        self._blocks.feed(mv)
        hashes = self._blocks.hashes
        while (len(self.pieces) + 1) * self._per_piece <= len(hashes):
            i = len(self.pieces) * self._per_piece
            self.pieces.append(piece_hash(bytes(hashes[i : i + self._per_piece])).hex())

    @property
    def block_hashes(self) -> bytes:
        """The hash of every 64 KiB block fed so far (call after :meth:`finish` for all of them)."""
        return bytes(self._blocks.hashes)

    def finish(self) -> tuple[str, int, list[str]]:
        """``(root, size, pieces)`` of everything fed."""
        self._blocks.flush()
        hashes = self._blocks.hashes
        pieces = list(self.pieces)
        done = len(pieces) * self._per_piece
        if done < len(hashes):
            pieces.append(piece_hash(bytes(hashes[done:])).hex())
        return object_root(self.size, self.piece_size, pieces), self.size, pieces


class PieceVerifier:
    """Checks an object's bytes, fed in order, against its recorded pieces.

    Each piece is checked as soon as its last byte arrives; the pieces are bound to the manifest
    (and so to the version id), so the object is not hashed again as a whole.
    """

    def __init__(self, key: str, size: int, pieces: tuple[str, ...], piece_size: int, named_by: str) -> None:
        self.key = key
        self.size = size
        self.pieces = pieces
        self.piece_size = piece_size
        self.named_by = named_by
        self.offset = 0
        self._blocks = _Blocks()
        self._index = 0

    @property
    def verified_upto(self) -> int:
        """Bytes [0, verified_upto) are checked (whole pieces)."""
        return min(self._index * self.piece_size, self.size)

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        if self.offset + len(mv) > self.size:
            raise IntegrityError(f"{self.key}: oversized: more than the {self.size} bytes {self.named_by} records")
        pos = 0
        while pos < len(mv):
            end = min((self._index + 1) * self.piece_size, self.size)
            take = min(end - self.offset, len(mv) - pos)
            self._blocks.feed(mv[pos : pos + take])
            self.offset += take
            pos += take
            if self.offset == end:
                self._check_piece()

    def _check_piece(self) -> None:
        self._blocks.flush()
        got = piece_hash(bytes(self._blocks.hashes)).hex()
        self._blocks.hashes = bytearray()
        want = self.pieces[self._index]
        if got != want:
            start = self._index * self.piece_size
            shown_got, shown_want = short_pair(got, want)
            raise IntegrityError(
                f"{self.key}: piece {self._index} (bytes {start}..{min(start + self.piece_size, self.size)}) has hash "
                f"{shown_got}, {self.named_by} records {shown_want}"
            )
        self._index += 1

    def finish(self) -> None:
        """Raise IntegrityError unless exactly ``size`` bytes were fed and every piece matched."""
        if self.offset != self.size:
            raise IntegrityError(f"{self.key}: truncated: {self.offset} bytes, {self.named_by} records {self.size}")


__all__ = [
    "DEFAULT_PIECE_SIZE",
    "MAX_PIECE_SIZE",
    "MIN_PIECE_SIZE",
    "PieceHasher",
    "PieceVerifier",
    "check_piece_size",
    "hash_piece",
    "piece_count",
    "pieces_of_blocks",
]
