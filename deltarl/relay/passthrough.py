"""Objects the relay's cache cannot hold (its disk is smaller than the object, or full): served
straight from upstream, in full, without caching them.

A whole-object read hashes what it sends and holds the last bytes back until the sha256 matches
the manifest's (when the manifest is known), like the cached and cut-through bodies.
"""

from __future__ import annotations

import errno
import hashlib
from collections.abc import AsyncIterator

from deltarl.errors import IntegrityError, TransientStoreError
from deltarl.relay.bodies import HOLDBACK
from deltarl.storage.aio import AsyncSource


def is_no_room(err: BaseException) -> bool:
    """An error that means the cache's disk is full (``ENOSPC``/``EDQUOT``)."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


class PassThroughBody:
    """An object streamed from upstream to one client, not cached."""

    def __init__(self, upstream: AsyncSource, key: str, size: int, etag: str, expected_sha256: str | None,
                 *, pieces: tuple[str, ...] | None = None, piece_size: int | None = None, verified_only: bool = False) -> None:
        self.upstream = upstream
        self.key = key
        self.size = size
        self.etag = etag
        self.expected = expected_sha256
        self.pieces = pieces
        self.piece_size = piece_size or 0
        self.verified_only = verified_only  # send no byte before it is checked against the manifest

    def close(self) -> None:
        pass

    async def read(self, start: int, end: int, sent: bytes = b"") -> AsyncIterator[bytes]:
        """Bytes ``[start, end)``; ``sent`` holds bytes ``[0, start)`` a reader already sent (they
        count towards the whole-object check)."""
        if self.verified_only:
            async for data in self._read_verified(start, end):
                yield data
            return
        whole = self.expected is not None and end == self.size and len(sent) == start
        hasher = hashlib.sha256(sent) if whole else None
        pos = start
        held = b""
        async for data in self.upstream.stream_range(self.key, start, end, unverified=True):
            data = data[: end - pos]
            pos += len(data)
            if hasher is None:
                yield data
                continue
            hasher.update(data)
            held += data
            if len(held) > HOLDBACK:
                out, held = held[:-HOLDBACK], held[-HOLDBACK:]
                yield out
        if pos != end:
            raise TransientStoreError(f"{self.key}: upstream stopped at {pos} of {end} bytes")
        if hasher is not None:
            if hasher.hexdigest() != self.expected:
                raise IntegrityError(f"{self.key} from {self.upstream.url} does not match its manifest's sha256")
            if held:
                yield held

    async def _read_verified(self, start: int, end: int) -> AsyncIterator[bytes]:
        """Whole manifest pieces (v2), or the whole object (v1), fetched and checked before any of
        their bytes in ``[start, end)`` is yielded."""
        if self.pieces is not None and self.piece_size:
            ps = self.piece_size
            first, last = start // ps, (end - 1) // ps
            for j in range(first, last + 1):
                lo, hi = j * ps, min((j + 1) * ps, self.size)
                data = b"".join([c async for c in self.upstream.stream_range(self.key, lo, hi, unverified=True)])[: hi - lo]
                if len(data) != hi - lo:
                    raise TransientStoreError(f"{self.key}: upstream sent {len(data)} of {hi - lo} bytes of piece {j}")
                if hashlib.sha256(data).hexdigest() != self.pieces[j]:
                    raise IntegrityError(f"{self.key}: piece {j} from {self.upstream.url} does not match its manifest")
                yield data[max(start, lo) - lo : min(end, hi) - lo]
            return
        data = b"".join([c async for c in self.upstream.stream_range(self.key, 0, self.size, unverified=True)])[: self.size]
        if len(data) != self.size or hashlib.sha256(data).hexdigest() != self.expected:
            raise IntegrityError(f"{self.key} from {self.upstream.url} does not match its manifest's sha256")
        yield data[start:end]
