"""Readable bodies the relay serves: a cached file, or a pull still arriving (cut-through).

A whole-object read of a cached file (with ``check_on_serve``) checks what it sends against the
manifest's pieces and holds back the final bytes until every piece matched, so a client never
receives a complete object whose bytes are wrong: on a mismatch the read raises
:class:`~deltarl.errors.IntegrityError` and the handler drops the connection, which the client sees
as a truncated response. A pull in flight is checked piece by piece as it lands (:mod:`.pull`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable

from deltarl.errors import CacheFull, IntegrityError, TransientStoreError
from deltarl.pipeline.pieces import PieceVerifier
from deltarl.relay.cache import CacheEntry
from deltarl.relay.pull import Pull
from deltarl.storage import pagecache

CHUNK = 1 << 20
#: Bytes at the end of a whole-object response held back until its last piece is confirmed.
HOLDBACK = 64 << 10


def _read_check(fd: int, offset: int, n: int, verifier: PieceVerifier | None, drop: bool = False) -> bytes:
    data = os.pread(fd, n, offset)
    if drop and data:
        pagecache.drop(fd, offset, len(data))
    if verifier is not None:
        verifier.update(data)  # IntegrityError at the first piece that differs
    return data


class CachedBody:
    """An object in the cache; the data file is opened at construction (eviction-safe). With
    ``check``, whole-object reads are checked against the entry's pieces (``check_on_serve``)."""

    def __init__(self, entry: CacheEntry, fd: int, on_corrupt: Callable[[CacheEntry], None], *, check: bool = True) -> None:
        self.entry = entry
        self.check = check
        self.size = entry.size
        self.etag = entry.etag
        self._on_corrupt = on_corrupt
        self._fd = fd

    @classmethod
    def open(cls, entry: CacheEntry, on_corrupt: Callable[[CacheEntry], None], *, check: bool = True) -> CachedBody | None:
        """The body of a cached entry, or None if its data file vanished or is shorter than the entry
        (someone deleted or truncated the cache under the relay): a cache miss, not an error."""
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        if os.fstat(fd).st_size != entry.size:
            os.close(fd)
            return None
        return cls(entry, fd, on_corrupt, check=check)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def checks(self, start: int, end: int) -> bool:
        """Whether a read of ``[start, end)`` is checked against the pieces as it is sent (a whole
        object with ``check_on_serve``); other reads may go out by :meth:`sendfile`."""
        return self.check and self.entry.ref is not None and start == 0 and end == self.size

    async def sendfile(self, transport: asyncio.Transport, start: int, end: int) -> int:
        """Send ``[start, end)`` straight from the file to ``transport`` (``sendfile(2)``: no copy
        through user space); returns the bytes sent. A file shorter than the entry (truncated under
        the relay) is reported corrupt and raises IntegrityError. A big object's pages are dropped
        from the page cache once sent, as :meth:`read` does."""
        with open(os.dup(self._fd), "rb", buffering=0) as f:
            sent = await asyncio.get_running_loop().sendfile(transport, f, start, end - start)
        if self.size >= Pull.FLUSH_BYTES:
            pagecache.drop(self._fd, start, end - start)
        if sent != end - start:
            self._on_corrupt(self.entry)
            raise IntegrityError(f"cached {self.entry.key} is shorter than {self.size} bytes")
        return sent

    async def read(self, start: int, end: int) -> AsyncIterator[bytes]:
        ref = self.entry.ref
        whole = self.checks(start, end)
        verifier = ref.verifier("the relay cache" if not self.entry.verified else "its manifest") if whole and ref is not None else None
        drop = self.size >= Pull.FLUSH_BYTES  # big objects stream through, as they were written (Pull.flush)
        pos = start
        while pos < end:
            n = min(CHUNK, end - pos)
            if whole and pos + n > end - HOLDBACK:
                n = max(0, end - HOLDBACK - pos) or (end - pos)
            try:
                data = await asyncio.to_thread(_read_check, self._fd, pos, n, verifier, drop)
            except IntegrityError as err:
                self._on_corrupt(self.entry)
                raise IntegrityError(f"cached {self.entry.key} does not match its pieces: {err}") from err
            if len(data) != n:
                self._on_corrupt(self.entry)
                raise IntegrityError(f"cached {self.entry.key} is shorter than {self.size} bytes")
            pos += n
            yield data


class PullBody:
    """An object still arriving from upstream: serve the bytes that have landed, then wait for more."""

    def __init__(self, pull: Pull, *, cut_through: bool,
                 rest: Callable[[int, int, bytes], AsyncIterator[bytes]] | None = None,
                 verified_only: bool = False) -> None:
        assert pull.size is not None
        assert pull.tmp_path is not None
        self.pull = pull
        self.size = pull.size
        self.etag = pull.etag
        self.cut_through = cut_through
        self._rest = rest  # (pos, end, bytes sent before pos) -> the rest from upstream, if the cache fills up
        self.verified_only = verified_only  # send only bytes checked against the manifest's pieces
        self._fd = os.open(pull.tmp_path, os.O_RDONLY)  # same loop step as the lookup: no rename race

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.pull.readers.pop(id(self), None) is not None:
            self.pull.release()

    async def read(self, start: int, end: int) -> AsyncIterator[bytes | memoryview]:
        pull = self.pull
        pos = start
        pull.readers[id(self)] = pos  # the landed pieces from here on stay in memory for this read
        while pos < end:
            event = pull.changed()
            if isinstance(pull.error, CacheFull) and self._rest is not None:
                sent = await asyncio.to_thread(os.pread, self._fd, pos, 0) if start == 0 and end == self.size else b""
                async for data in self._rest(pos, end, sent):  # the file has no room: go on from upstream
                    yield data
                return
            if pull.error is not None:
                raise TransientStoreError(f"upstream pull of {pull.key} failed: {pull.error}") from pull.error
            # Any range is served as soon as its own bytes have landed; the tail of the object (and
            # everything, in store-and-forward mode) waits for the integrity check.
            if pull.done:
                limit = end
            elif self.verified_only:  # cut-through at the grain of the manifest's pieces
                limit = min(pull.verified(pos), end) if self.cut_through else start
            elif self.cut_through:
                limit = min(pull.available(pos), self.size - HOLDBACK, end)
            else:
                limit = start
            if limit > pos:
                # From memory while the pull holds the piece, else read back from the file (a
                # reader that fell behind, or one that came after the pull let the piece go).
                held = pull.memory_view(pos, limit)
                chunk = held if held is not None else await asyncio.to_thread(os.pread, self._fd, min(CHUNK, limit - pos), pos)
                pos += len(chunk)
                pull.readers[id(self)] = pos
                yield chunk  # aiohttp writes any buffer
                continue
            await event.wait()
