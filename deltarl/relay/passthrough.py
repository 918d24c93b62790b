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
from deltarl.relay.upstream import Upstream


def is_no_room(err: BaseException) -> bool:
    """An error that means the cache's disk is full (``ENOSPC``/``EDQUOT``)."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


class PassThroughBody:
    """An object streamed from upstream to one client, not cached."""

    def __init__(self, upstream: Upstream, key: str, size: int, etag: str, expected_sha256: str | None) -> None:
        self.upstream = upstream
        self.key = key
        self.size = size
        self.etag = etag
        self.expected = expected_sha256

    def close(self) -> None:
        pass

    async def read(self, start: int, end: int, sent: bytes = b"") -> AsyncIterator[bytes]:
        """Bytes ``[start, end)``; ``sent`` holds bytes ``[0, start)`` a reader already sent (they
        count towards the whole-object check)."""
        whole = self.expected is not None and end == self.size and len(sent) == start
        hasher = hashlib.sha256(sent) if whole else None
        pos = start
        held = b""
        async for data in self.upstream.stream_range(self.key, start, end):
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
