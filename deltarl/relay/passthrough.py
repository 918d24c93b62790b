"""Objects the relay's cache cannot hold (its disk is smaller than the object, or full): served
straight from upstream, in full, without caching them.

A whole-object read checks what it sends against the manifest's pieces (when the manifest is
known) and holds the last bytes back until every piece matched, like the cached body; a verified
read sends each piece only once it matched.
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator

from deltarl.errors import IntegrityError, TransientStoreError
from deltarl.pipeline.manifest import ObjectRef
from deltarl.pipeline.pieces import hash_piece
from deltarl.relay.bodies import HOLDBACK
from deltarl.storage.aio import AsyncSource


def is_no_room(err: BaseException) -> bool:
    """An error that means the cache's disk is full (``ENOSPC``/``EDQUOT``)."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


class PassThroughBody:
    """An object streamed from upstream to one client, not cached."""

    def __init__(self, upstream: AsyncSource, key: str, size: int, etag: str, ref: ObjectRef | None,
                 *, verified_only: bool = False) -> None:
        self.upstream = upstream
        self.key = key
        self.size = size
        self.etag = etag
        self.ref = ref  # the manifest's, if known
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
        whole = self.ref is not None and end == self.size and len(sent) == start
        verifier = self.ref.verifier("its manifest") if whole and self.ref is not None else None
        if verifier is not None and sent:
            verifier.update(sent)
        pos = start
        held = b""
        try:
            async for data in self.upstream.stream_range(self.key, start, end, unverified=True):
                data = data[: end - pos]
                pos += len(data)
                if verifier is None:
                    yield data
                    continue
                verifier.update(data)
                held += data
                if len(held) > HOLDBACK:
                    out, held = held[:-HOLDBACK], held[-HOLDBACK:]
                    yield out
        except IntegrityError as err:
            raise IntegrityError(f"{self.key} from {self.upstream.url} does not match its manifest: {err}") from err
        if pos != end:
            raise TransientStoreError(f"{self.key}: upstream stopped at {pos} of {end} bytes")
        if held:
            yield held

    async def _read_verified(self, start: int, end: int) -> AsyncIterator[bytes]:
        """Whole manifest pieces fetched and checked before any of their bytes in ``[start, end)`` is yielded."""
        assert self.ref is not None
        ps = self.ref.piece_size
        first, last = start // ps, (end - 1) // ps
        for j in range(first, last + 1):
            lo, hi = j * ps, min((j + 1) * ps, self.size)
            data = b"".join([c async for c in self.upstream.stream_range(self.key, lo, hi, unverified=True)])[: hi - lo]
            if len(data) != hi - lo:
                raise TransientStoreError(f"{self.key}: upstream sent {len(data)} of {hi - lo} bytes of piece {j}")
            if hash_piece(data) != self.ref.pieces[j]:
                raise IntegrityError(f"{self.key}: piece {j} from {self.upstream.url} does not match its manifest")
            yield data[max(start, lo) - lo : min(end, hi) - lo]
