"""One object being pulled from upstream into a temporary file, readable while it arrives."""

from __future__ import annotations

import asyncio
import contextlib
import os

from deltarl.codec.hashing import BLOCK, HASH_BYTES, leaves, object_root, piece_hash
from deltarl.errors import IntegrityError, short_pair
from deltarl.pipeline.manifest import ObjectRef
from deltarl.storage.pagecache import FLUSH_WINDOW_BYTES, flush_and_drop


class Pull:
    """Progress of one upstream pull: readers wait on :meth:`changed` and read what has landed.

    The object is pulled in pieces of ``piece_bytes``, several at once, each streamed into the
    temporary file as its bytes arrive (:meth:`write`). :meth:`available` says how far the landed
    bytes run from any offset, so a reader of a range is served as soon as *that* range's bytes
    are here, not when everything before it is. ``prefix`` bytes are landed contiguously from
    offset 0. ``done`` means all ``size`` bytes arrived and passed the integrity
    check; ``error`` means the pull failed and nothing more will arrive. Only the event-loop
    thread mutates a pull.

    Memory: the bytes of each piece stay in memory as they land, so readers following the pull
    are served from there (no read back from the file) and each piece's 64 KiB blocks are hashed
    from there, once (the manifest's pieces are composed from those block hashes); a
    piece is let go once every open reader is past it, or when a pull holds more than
    ``memory_bytes`` (a slow reader then reads it back from the file). The file is flushed and
    dropped from the page cache window by window behind the landed prefix (:meth:`flush_due`),
    so a multi-GB pull neither piles up dirty pages nor leaves them cached.

    Verification: once the object's manifest ref is known (:meth:`expect`), each of its pieces is
    checked as soon as all its bytes have landed, from the block hashes already computed (no byte
    is hashed twice, whenever the ref arrives); :meth:`verified` says how far the checked bytes run
    from an offset, and a reader that must not send unchecked bytes serves only those. A piece that
    differs fails the pull (``IntegrityError``) before any of its bytes reach such a reader.
    """

    #: Bytes of landed pieces a pull keeps in memory for its readers at most.
    MEMORY_BYTES = 64 << 20
    #: The file is flushed and dropped from the page cache in windows this large.
    FLUSH_BYTES = FLUSH_WINDOW_BYTES

    def __init__(self, key: str, *, memory_bytes: int = MEMORY_BYTES) -> None:
        self.key = key
        self.size: int | None = None
        self.etag = ""
        self.tmp_path: str | None = None
        self.prefix = 0
        self.done = False
        self.error: BaseException | None = None
        self.joined = 0
        self.piece_bytes = 1
        self._filled: list[int] = []  # bytes landed from the start of each piece (pieces stream in order)
        self._fd = -1
        self._event = asyncio.Event()
        self.expected: ObjectRef | None = None  # the manifest's ref, once known
        #: With no manifest ref: the object's pieces at the pull's grain, from the hashes taken as it landed.
        self.own: ObjectRef | None = None
        self._checked: list[bool] = []  # per manifest piece
        self._next_check = 0  # no piece below this one is left unchecked
        self.bad: IntegrityError | None = None  # a piece that differs from the manifest
        self.memory_bytes = memory_bytes
        self._mem: dict[int, list[bytes]] = {}  # piece -> its landed chunks, in order
        self._held = 0  # bytes in _mem
        self._leaves: dict[int, bytes] = {}  # pull piece -> its 64 KiB blocks' hashes, hashed where it landed
        self.readers: dict[int, int] = {}  # id of an open reader -> the offset it reads next
        self._flushed = 0  # the file's bytes [0, _flushed) are flushed and out of the page cache

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
        self.landed(offset, data, self.store(offset, data))

    def store(self, offset: int, data: bytes) -> bytes | None:
        """Write ``data`` into the temporary file (thread-safe: pieces never overlap); if it completes
        its piece, return the hashes of the piece's 64 KiB blocks (hashed here, from memory, once).
        A relay calls it on a worker thread, so neither a disk that throttles writes nor the hashing
        stalls its event loop, then :meth:`landed` on the loop."""
        i = offset // self.piece_bytes
        assert offset == i * self.piece_bytes + self._filled[i], "a piece's bytes arrive in order"
        os.pwrite(self._fd, data, offset)
        start, stop = self.piece_range(i)
        if offset + len(data) != stop or self.piece_bytes % BLOCK:
            return None
        chunks = self._mem.get(i, [])
        if sum(len(c) for c in chunks) != offset - start:
            return None  # part of the piece was let go: its pieces are hashed from the file on the loop
        return leaves(b"".join([*chunks, data]) if chunks else data)

    def landed(self, offset: int, data: bytes, block_hashes: bytes | None = None) -> None:
        """``data`` is in the file at ``offset``: readers may have it, and what it completes is checked
        (``block_hashes``: those of the piece it completes, from :meth:`store`)."""
        i = offset // self.piece_bytes
        assert offset == i * self.piece_bytes + self._filled[i], "a piece's bytes arrive in order"
        self._filled[i] += len(data)
        if data and (i in self._mem or offset == i * self.piece_bytes):
            self._mem.setdefault(i, []).append(data)
            self._held += len(data)
        if block_hashes is not None:
            self._leaves[i] = block_hashes
        if offset == self.prefix:
            self.prefix += len(data)
        end = self.available(self.prefix)
        if end > self.prefix:  # pieces that landed ahead of the prefix are now contiguous with it
            self.prefix = end
        self._check_pieces((offset, offset + len(data)))
        self.release()
        self.notify()
        if self.bad is not None:
            raise self.bad

    # --- memory and page cache ----------------------------------------------------------------

    def memory_view(self, pos: int, limit: int) -> memoryview | None:
        """Landed bytes from ``pos`` (up to ``limit``) still held in memory, or ``None``."""
        i = pos // self.piece_bytes
        at = i * self.piece_bytes
        for chunk in self._mem.get(i, ()):
            if at <= pos < at + len(chunk):
                return memoryview(chunk)[pos - at : min(limit, at + len(chunk)) - at]
            at += len(chunk)
        return None

    def release(self) -> None:
        """Let go of the pieces every open reader is past (all, with no reader), then of the
        oldest ones while more than ``memory_bytes`` are held."""
        if not self._mem:
            return
        behind = min(self.readers.values(), default=self.size or 0)
        for i in sorted(self._mem):
            start, stop = self.piece_range(i)
            if self._filled[i] == stop - start and (stop <= behind or self._held > self.memory_bytes):
                self._held -= sum(len(c) for c in self._mem.pop(i))

    def flush_due(self) -> tuple[int, int] | None:
        """The next window of the landed prefix to flush and drop from the page cache (and mark it
        taken), once at least ``FLUSH_BYTES`` of it (or the whole object) has landed. Objects smaller
        than a window (segments) stay cached: they are what many readers ask for again."""
        size = self.size or 0
        if self._fd < 0 or size < self.FLUSH_BYTES or (self.prefix - self._flushed < self.FLUSH_BYTES and not (self.prefix == size > self._flushed)):
            return None
        window, self._flushed = (self._flushed, self.prefix), self.prefix
        return window

    def flush(self, start: int, end: int) -> None:
        """Write ``[start, end)`` of the file back to disk and drop it from the page cache (worker thread)."""
        flush_and_drop(self._fd, start, end)

    # --- verification against the manifest ----------------------------------------------------

    def expect(self, ref: ObjectRef) -> None:
        """The manifest's ref for this object is known: check what has landed, and all that lands."""
        if self.expected is not None:
            return
        self.expected = ref
        self._checked = [False] * len(ref.pieces)
        if self.size is not None and self._fd >= 0:
            self._check_pieces()
        self.notify()

    def _check_pieces(self, touched: tuple[int, int] | None = None) -> None:
        """Check the manifest pieces that have wholly landed: all unchecked ones, or only those
        overlapping ``touched`` (the byte range a landing just extended), so each landing costs
        O(1) and not a walk over the whole object."""
        if self.expected is None or self.size is None or self._fd < 0:
            return
        pieces, ps = self.expected.pieces, self.expected.piece_size
        lo, hi = self._next_check, len(pieces)
        if touched is not None:
            lo, hi = max(lo, touched[0] // ps), min(hi, -(-touched[1] // ps))
        for j in range(lo, hi):
            if self._checked[j]:
                continue
            start, stop = j * ps, min((j + 1) * ps, self.size)
            if self.available(start) < stop:
                continue
            got = self._piece_from_blocks(start, stop) or self._hash_from_file(start, stop)
            if got != pieces[j]:
                shown_got, shown_want = short_pair(got, pieces[j])
                self.bad = IntegrityError(f"{self.key}: piece {j} (bytes {start}..{stop}) from upstream has hash "
                                          f"{shown_got}, its manifest records {shown_want}")
                return
            self._checked[j] = True
        while self._next_check < len(self._checked) and self._checked[self._next_check]:
            self._next_check += 1

    def _piece_from_blocks(self, start: int, stop: int) -> str | None:
        """The hash of bytes [start, stop) (a manifest piece) from the block hashes of the pull pieces
        that hold them, or ``None`` where one of those was not hashed (let go, or another grain)."""
        if self.piece_bytes % BLOCK:
            return None
        per = self.piece_bytes // BLOCK
        out = bytearray()
        b = start // BLOCK
        while b * BLOCK < stop:
            held = self._leaves.get(b // per)
            if held is None:
                return None
            k = b % per
            take = min(per - k, -(-(stop - b * BLOCK) // BLOCK))
            out += held[k * HASH_BYTES : (k + take) * HASH_BYTES]
            b += take
        return piece_hash(bytes(out)).hex()

    def _own_ref(self) -> ObjectRef | None:
        """The object's ref at the pull's grain, from the block hashes taken as it landed (a piece let
        go before it was hashed is read back): what the cache checks it by until a manifest names it."""
        from deltarl.pipeline.pieces import MAX_PIECE_SIZE, MIN_PIECE_SIZE

        pb = self.piece_bytes
        if self.size is None or not MIN_PIECE_SIZE <= pb <= MAX_PIECE_SIZE or pb & (pb - 1):
            return None
        pieces = []
        for i in range(self.pieces):
            start, stop = self.piece_range(i)
            pieces.append(self._piece_from_blocks(start, stop) or self._hash_from_file(start, stop))
        root = object_root(self.size, pb, pieces)
        return ObjectRef(key=self.key, root=root, size=self.size, piece_size=pb, pieces=tuple(pieces))

    def _hash_from_file(self, start: int, stop: int) -> str:
        """A manifest piece's hash from its bytes read back (a pull grain that is not whole blocks,
        or a pull piece let go before it was hashed)."""
        return piece_hash(leaves(os.pread(self._fd, stop - start, start))).hex()

    def verified(self, pos: int) -> int:
        """End of the manifest-checked bytes that run on from ``pos`` (``pos`` itself if none)."""
        if self.expected is None or self.size is None:
            return pos
        if self.done:
            return self.size
        ps = self.expected.piece_size
        j = pos // ps
        while j < len(self._checked) and self._checked[j]:
            j += 1
        return max(pos, min(j * ps, self.size))

    def finish_check(self) -> bool:
        """Once every byte landed (``prefix == size``): whether the object was checked against its
        manifest (every piece matched; ``False`` if no manifest ref is known); closes the file.
        Raises the IntegrityError of a piece that differs, or of one never checked."""
        assert self.prefix == self.size
        if self.expected is None:
            self.own = self._own_ref()
            self._close_file()
            return False
        self._check_pieces()
        unchecked = [j for j, ok in enumerate(self._checked) if not ok]
        self._close_file()
        if self.bad is not None:
            raise self.bad
        if unchecked:
            raise IntegrityError(f"{self.key}: piece {unchecked[0]} of {len(self._checked)} was never checked "
                                 f"(the object is {self.size} bytes)")
        return True

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._mem.clear()
        self._held = 0
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
