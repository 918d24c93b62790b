"""One object being pulled from upstream into a temporary file, readable while it arrives."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os


class Pull:
    """Progress of one upstream pull: readers wait on :meth:`changed` and read what has landed.

    The object is pulled in pieces of ``piece_bytes``, several at once, each streamed into the
    temporary file as its bytes arrive (:meth:`write`). :meth:`available` says how far the landed
    bytes run from any offset, so a reader of a range is served as soon as *that* range's bytes
    are here, not when everything before it is. ``prefix`` bytes are landed contiguously from
    offset 0 (and hashed). ``done`` means all ``size`` bytes arrived and passed the integrity
    check; ``error`` means the pull failed and nothing more will arrive. Only the event-loop
    thread mutates a pull.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.size: int | None = None
        self.etag = ""
        self.tmp_path: str | None = None
        self.prefix = 0
        self.done = False
        self.sha256: str | None = None
        self.error: BaseException | None = None
        self.joined = 0
        self.piece_bytes = 1
        self._filled: list[int] = []  # bytes landed from the start of each piece (pieces stream in order)
        self._fd = -1
        self._hasher = hashlib.sha256()
        self._event = asyncio.Event()

    @property
    def settled(self) -> bool:
        return self.done or self.error is not None

    def changed(self) -> asyncio.Event:
        """The event the next change sets (grab it *before* checking state, then wait on it)."""
        return self._event

    def notify(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    # --- the puller's side --------------------------------------------------------------------

    def begin(self, size: int, etag: str, tmp_path: str, piece_bytes: int) -> None:
        """Size known, temporary file created: readers may open it now."""
        self.size, self.etag, self.tmp_path, self.piece_bytes = size, etag, tmp_path, piece_bytes
        self._filled = [0] * (-(-size // piece_bytes))
        self._fd = os.open(tmp_path, os.O_RDWR)
        self.notify()

    def piece_range(self, i: int) -> tuple[int, int]:
        assert self.size is not None
        return i * self.piece_bytes, min((i + 1) * self.piece_bytes, self.size)

    @property
    def pieces(self) -> int:
        return len(self._filled)

    def write(self, offset: int, data: bytes) -> None:
        """Land ``data`` at ``offset``: the next bytes of the piece that holds ``offset``."""
        i = offset // self.piece_bytes
        assert offset == i * self.piece_bytes + self._filled[i], "a piece's bytes arrive in order"
        os.pwrite(self._fd, data, offset)  # page cache; readers pread it back in the same loop
        self._filled[i] += len(data)
        if offset == self.prefix:
            self._hasher.update(data)
            self.prefix += len(data)
        end = self.available(self.prefix)
        if end > self.prefix:  # pieces that landed ahead of the prefix are now contiguous with it
            self._hasher.update(os.pread(self._fd, end - self.prefix, self.prefix))
            self.prefix = end
        self.notify()

    def digest(self) -> str:
        """sha256 of the whole object (call once ``prefix == size``); closes the file."""
        assert self.prefix == self.size
        self._close_file()
        return self._hasher.hexdigest()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._close_file()
        if self.tmp_path is not None:
            with contextlib.suppress(FileNotFoundError):  # already moved or removed
                os.unlink(self.tmp_path)
        self.notify()

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # --- the readers' side --------------------------------------------------------------------

    def available(self, pos: int) -> int:
        """End of the landed bytes that run on from ``pos`` (``pos`` itself if none have)."""
        size = self.size or 0
        if self.done or self.prefix >= size:
            return size
        end = pos = max(pos, self.prefix)
        i = pos // self.piece_bytes
        while i < len(self._filled):
            start, stop = self.piece_range(i)
            got = start + self._filled[i]
            if got <= end:
                break
            end = got
            if got < stop:
                break
            i += 1
        return end

    async def wait_ready(self) -> None:
        """Return once the size is known or the pull failed."""
        while self.size is None and self.error is None:
            await self.changed().wait()
