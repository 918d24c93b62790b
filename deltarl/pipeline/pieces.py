"""Piece hashes of a stored object (ObjectRef v2): computed in the same pass as its sha256 when
written, and checked piece by piece as it is read, so no byte is used before it is verified.

``pieces[i]`` is the sha256 of bytes ``[i * piece_size, min((i + 1) * piece_size, size))``. A
writer feeds an object's bytes in order through :class:`PieceHasher` (any buffer sizes); a reader
feeds them through :class:`PieceVerifier`, which raises :class:`~deltarl.errors.IntegrityError`
naming the object at the first piece that differs, and at :meth:`PieceVerifier.finish` if the
object is truncated or oversized.
"""

from __future__ import annotations

import hashlib
from typing import Any

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


class PieceHasher:
    """sha256 of a whole object and of each of its pieces, in one pass over bytes fed in order."""

    def __init__(self, piece_size: int = DEFAULT_PIECE_SIZE) -> None:
        check_piece_size(piece_size, "PieceHasher")
        self.piece_size = piece_size
        self.size = 0
        self._whole = hashlib.sha256()
        self._piece = hashlib.sha256()
        self._piece_fill = 0
        self.pieces: list[str] = []

    def update(self, data: Any) -> None:
        """Feed the next bytes of the object (bytes, bytearray, memoryview or a contiguous array)."""
        mv = memoryview(data).cast("B")
        self._whole.update(mv)
        self.size += len(mv)
        pos = 0
        while pos < len(mv):
            take = min(self.piece_size - self._piece_fill, len(mv) - pos)
            self._piece.update(mv[pos : pos + take])
            self._piece_fill += take
            pos += take
            if self._piece_fill == self.piece_size:
                self.pieces.append(self._piece.hexdigest())
                self._piece = hashlib.sha256()
                self._piece_fill = 0

    def finish(self) -> tuple[str, int, list[str]]:
        """``(sha256, size, pieces)`` of everything fed."""
        pieces = list(self.pieces)
        if self._piece_fill:
            pieces.append(self._piece.hexdigest())
        return self._whole.hexdigest(), self.size, pieces


class PieceVerifier:
    """Checks an object's bytes, fed in order, against its recorded pieces (v2) or sha256 (v1).

    With pieces, each piece is checked as soon as its last byte arrives and the whole object is
    not hashed again (the pieces are bound to the manifest, and so to the version id); a v1 ref
    (no pieces) is checked by its whole sha256 at :meth:`finish`.
    """

    def __init__(self, key: str, size: int, sha256: str, pieces: tuple[str, ...] | None, piece_size: int | None, named_by: str) -> None:
        self.key = key
        self.size = size
        self.sha256 = sha256
        self.pieces = pieces
        self.piece_size = piece_size or 0
        self.named_by = named_by
        self.offset = 0
        self._hash = hashlib.sha256()
        self._fill = 0
        self._index = 0

    @property
    def verified_upto(self) -> int:
        """Bytes [0, verified_upto) are checked (v2: whole pieces; v1: everything after finish)."""
        if self.pieces is None:
            return self.size if self.offset == self.size and self._index else 0
        return min(self._index * self.piece_size, self.size)

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        if self.offset + len(mv) > self.size:
            raise IntegrityError(f"{self.key}: oversized: more than the {self.size} bytes {self.named_by} records")
        self.offset += len(mv)
        if self.pieces is None:
            self._hash.update(mv)
            return
        pos = 0
        while pos < len(mv):
            take = min(self.piece_size - self._fill, len(mv) - pos)
            self._hash.update(mv[pos : pos + take])
            self._fill += take
            pos += take
            end = min((self._index + 1) * self.piece_size, self.size)
            if self._fill == end - self._index * self.piece_size:
                self._check_piece()

    def _check_piece(self) -> None:
        assert self.pieces is not None
        got = self._hash.hexdigest()
        want = self.pieces[self._index]
        if got != want:
            start = self._index * self.piece_size
            shown_got, shown_want = short_pair(got, want)
            raise IntegrityError(
                f"{self.key}: piece {self._index} (bytes {start}..{min(start + self.piece_size, self.size)}) has sha256 "
                f"{shown_got}, {self.named_by} records {shown_want}"
            )
        self._index += 1
        self._fill = 0
        self._hash = hashlib.sha256()

    def finish(self) -> None:
        """Raise IntegrityError unless exactly ``size`` bytes were fed and every check passed."""
        if self.offset != self.size:
            raise IntegrityError(f"{self.key}: truncated: {self.offset} bytes, {self.named_by} records {self.size}")
        if self.pieces is None:
            got = self._hash.hexdigest()
            if got != self.sha256:
                shown_got, shown_want = short_pair(got, self.sha256)
                raise IntegrityError(f"{self.key}: sha256 {shown_got} differs from {shown_want} recorded in {self.named_by}")
            self._index = 1


__all__ = ["DEFAULT_PIECE_SIZE", "MAX_PIECE_SIZE", "MIN_PIECE_SIZE", "PieceHasher", "PieceVerifier", "check_piece_size", "piece_count"]
