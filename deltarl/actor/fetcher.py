"""The actor-side multi-stream fetcher: relays in order of preference, then the origin store.

``fetch_objects(refs)`` splits each object into ranges of ``range_bytes`` and puts them, object
by object, on one queue that ``streams`` workers drain: consecutive ranges (and small objects)
land on different TCP streams (round-robin striping), so one window-limited stream no longer
bounds the transfer. Each range is retried on its source with capped, jittered backoff
(:class:`~deltarl.storage.retry.RetryPolicy`); when a source keeps failing (dead relay, refused
connection, truncated or stalled response), the range moves to the next source, and the source
is skipped for ``cooldown_s``. Ranges that already arrived are kept: a failover refetches only
what is missing. A 404 is final, not a fault: a relay says "not found" only after asking its own
upstream (or after a long-poll ``wait`` ran out), so the origin is not hammered by waiting actors.

Integrity is checked by the object's piece hashes, one pass: each range of whole pieces as it
lands (on a worker thread), so no object is hashed again once it is complete. ``fetch_into`` lands the ranges straight in the caller's memory (keyframe parts into the
tensors), so a whole-model bootstrap holds no object-sized buffer. On a mismatch the whole object is fetched again from
the next source after every source that contributed to it, and an object no source can deliver
intact raises :class:`~deltarl.errors.TransferError`. A verified object is never fetched again.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from deltarl.errors import (
    DeltaRLError,
    IntegrityError,
    InvalidRange,
    ObjectNotFound,
    StoreError,
    TransferError,
    short_pair,
)
from deltarl.pipeline.manifest import ObjectRef
from deltarl.pipeline.pieces import hash_piece
from deltarl.storage.aio import AsyncSource, make_async_source
from deltarl.storage.retry import RetryPolicy
from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)

T = TypeVar("T")

_HASH_IN_THREAD_BYTES = 1 << 20


@dataclass
class FetchStats:
    """What a fetcher moved, and the trouble it met."""

    bytes_by_source: dict[str, int] = field(default_factory=dict)
    objects: int = 0
    retries: int = 0
    failovers: int = 0
    integrity_refetches: int = 0


@dataclass
class _Object:
    ref: ObjectRef
    buf: bytearray
    ranges: list[tuple[int, int]]
    missing: set[int]
    source: int = 0  # first source index this object may use
    used: set[int] = field(default_factory=set)
    failed: BaseException | None = None
    #: fetch_into: (object offset, writable view) covering [0, size) in order; no buffer of its own
    views: list[tuple[int, memoryview]] | None = None
    #: ranges that hold whole pieces: each is checked as it lands (:meth:`land`), so the object
    #: needs no pass of its own at the end; ``mismatch`` if one differed
    checked_by_range: bool = False
    mismatch: bool = False
    #: ranges land on worker threads at once (:meth:`land`): the buffer is allocated once, under it
    _alloc: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def write(self, start: int, data: bytes) -> None:
        """Put one arrived range where it belongs: the object's buffer, or the caller's views."""
        if self.views is None:
            if len(self.buf) != self.ref.size:
                with self._alloc:  # two first ranges each allocating would drop what landed in the lost one
                    if len(self.buf) != self.ref.size:
                        self.buf = bytearray(self.ref.size)  # allocated when the first range lands
            self.buf[start : start + len(data)] = data
            return
        i = bisect.bisect_right(self.views, start, key=lambda v: v[0]) - 1
        pos, src = start, np.frombuffer(data, dtype=np.uint8)
        while src.size:  # numpy's copy drops the GIL (land() runs this on a worker thread)
            off, view = self.views[i]
            take = min(src.size, off + len(view) - pos)
            np.copyto(np.frombuffer(view, dtype=np.uint8)[pos - off : pos - off + take], src[:take])
            src, pos, i = src[take:], pos + take, i + 1

    def land(self, start: int, data: bytes) -> None:
        """Check one arrived range's pieces, then copy it into place (a worker thread: the hashing
        and numpy's copy drop the GIL, so the event loop keeps moving the other streams)."""
        ps = self.ref.piece_size
        mv = memoryview(data)
        for a in range(0, len(mv), ps):
            j = (start + a) // ps
            got = hash_piece(mv[a : a + ps])
            if got != self.ref.pieces[j]:
                log.warning("%s: piece %d (bytes %d..%d) has hash %s, its manifest records %s",
                            self.ref.key, j, start + a, start + a + len(mv[a : a + ps]), *short_pair(got, self.ref.pieces[j]))
                self.mismatch = True
                return  # never copied: the caller's memory holds no unchecked byte of it
        self.write(start, data)

    def verified(self) -> bool:
        """Whether the object holds exactly its bytes (its pieces): one pass, at the end, unless
        every range was checked as it landed."""
        if self.checked_by_range:
            return not self.mismatch
        verifier = self.ref.verifier("its manifest")
        try:
            if self.views is None:
                verifier.update(self.buf)
            else:
                for _, view in self.views:
                    verifier.update(view)
            verifier.finish()
        except IntegrityError as err:
            log.warning("%s", err)
            return False
        return True


class Fetcher:
    """Fetch immutable objects over several streams from relays, failing over to the origin.

    ``sources`` are tried in order: relay URLs (``http://…``), then usually the origin store (an
    :class:`ObjectStore` or a store URL). Use as ``async with``.
    """

    def __init__(
        self,
        sources: Sequence[str | ObjectStore | AsyncSource],
        *,
        streams: int = 4,
        range_bytes: int = 4 << 20,
        retry: RetryPolicy | None = None,
        attempts_per_source: int = 2,
        cooldown_s: float = 10.0,
        read_timeout_s: float = 30.0,
        token: str | None = None,
    ) -> None:
        if not sources:
            raise ValueError("a fetcher needs at least one source")
        if streams < 1 or range_bytes < 1 or attempts_per_source < 1:
            raise ValueError("streams, range_bytes and attempts_per_source must be >= 1")
        # streams for data, plus headroom for the long-polls of a manifest and HEAD held meanwhile
        self.sources = [
            make_async_source(s, connections=streams + 2, read_timeout_s=read_timeout_s, token=token, poll_interval_s=1.0)
            for s in sources
        ]
        self.streams = streams
        self.range_bytes = range_bytes
        self.retry = retry if retry is not None else RetryPolicy(attempts=attempts_per_source, base_delay=0.05, max_delay=1.0)
        self.attempts_per_source = attempts_per_source
        self.cooldown_s = cooldown_s
        self.stats = FetchStats()
        self._dead_until = [0.0] * len(self.sources)
        self._down = [False] * len(self.sources)

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sources))

    async def __aenter__(self) -> Fetcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- source selection ---------------------------------------------------------------------

    def _pick(self, first: int) -> int:
        """The first source at or after ``first`` that is not cooling down (else ``first``)."""
        now = time.monotonic()
        for i in range(first, len(self.sources)):
            if self._dead_until[i] <= now:
                return i
        return first if first < len(self.sources) else len(self.sources)

    def _mark_dead(self, i: int, err: BaseException) -> None:
        now = time.monotonic()
        alive = self._dead_until[i] <= now and not self._down[i]
        (log.warning if alive else log.debug)("source %s failed (%s); failing over for %.0fs",
                                              self.sources[i].url, err, self.cooldown_s)
        self._dead_until[i] = now + self.cooldown_s
        self._down[i] = True  # until it answers again: one warning per outage, not one per retry

    async def _with_failover(self, what: str, first: int, call: Callable[[AsyncSource, int], Awaitable[T]]) -> tuple[T, int]:
        """Run ``call(source, index)`` on source ``first`` or later; return ``(result, index)``."""
        i = self._pick(first)
        last: BaseException | None = None
        while i < len(self.sources):
            for attempt in range(self.attempts_per_source):
                try:
                    result = await call(self.sources[i], i)
                    if self._down[i]:
                        log.info("source %s answers again", self.sources[i].url)
                        self._down[i] = False
                    return result, i
                except (ObjectNotFound, InvalidRange):
                    self._down[i] = False  # it answered
                    raise  # authoritative: a relay answers 404 only after asking its own upstream
                except (StoreError, DeltaRLError, OSError, asyncio.TimeoutError) as err:
                    last = err
                    if attempt + 1 < self.attempts_per_source:
                        self.stats.retries += 1
                        await asyncio.sleep(self.retry.delay(attempt))
            assert last is not None
            self._mark_dead(i, last)
            self.stats.failovers += 1
            i = self._pick(i + 1)
        raise TransferError(f"{what}: every source failed; last error: {last}") from last

    # --- immutable objects --------------------------------------------------------------------

    async def fetch(self, ref: ObjectRef, *, wait_s: float = 0.0) -> bytes:
        """One verified object."""
        async for _, data in self.fetch_objects([ref], wait_s=wait_s):
            return data
        raise AssertionError("unreachable")

    async def fetch_objects(self, refs: Sequence[ObjectRef], *, wait_s: float = 0.0) -> AsyncIterator[tuple[ObjectRef, bytes]]:
        """Yield ``(ref, bytes)`` for every ref as soon as it is complete and verified.

        ``wait_s`` > 0 long-polls objects that do not exist yet (relays hold the request; the
        origin is polled). Raises :class:`TransferError` if an object cannot be delivered intact.
        """
        async for obj in self._run([self._plan(ref) for ref in refs], wait_s):
            data = bytes(obj.buf)
            obj.buf = bytearray()  # release memory early
            yield obj.ref, data

    async def fetch_into(self, ref: ObjectRef, views: Sequence[tuple[int, memoryview]], *, wait_s: float = 0.0) -> None:
        """Fetch ``ref`` straight into the caller's memory: ``views`` are ``(object offset, writable
        memoryview)`` pairs covering ``[0, ref.size)`` contiguously, in order (e.g. a keyframe part's
        header buffer, then slices of the tensors its ranges fill). Each range is copied once, into
        place and checked by its pieces (as it lands, where ranges hold whole pieces), and fetched
        again from the next source on a mismatch. Never allocates the whole object."""
        pos = 0
        for off, view in views:
            if off != pos:
                raise ValueError(f"{ref.key}: views must cover [0, {ref.size}) contiguously (gap or overlap at {pos})")
            pos += len(view)
        if pos != ref.size:
            raise ValueError(f"{ref.key}: views cover {pos} bytes, the object has {ref.size}")
        obj = self._plan(ref)
        obj.views = [(off, view.cast("B")) for off, view in views if len(view)]
        async for _ in self._run([obj], wait_s):
            pass

    async def _run(self, objects: list[_Object], wait_s: float) -> AsyncIterator[_Object]:
        """Yield each object once all its ranges arrived and it checked out."""
        work: asyncio.Queue[tuple[_Object, int] | None] = asyncio.Queue()
        done: asyncio.Queue[_Object] = asyncio.Queue()
        for obj in objects:
            for idx in range(len(obj.ranges)):
                work.put_nowait((obj, idx))
            if not obj.ranges:
                done.put_nowait(obj)
        workers = [asyncio.ensure_future(self._worker(work, done, wait_s)) for _ in range(min(self.streams, max(1, work.qsize())))]
        remaining = len(objects)
        try:
            while remaining:
                obj = await done.get()
                if obj.failed is not None:
                    raise obj.failed
                if obj.checked_by_range:
                    ok = obj.verified()
                elif obj.views is not None or obj.ref.size >= _HASH_IN_THREAD_BYTES:
                    ok = (obj.views is not None or len(obj.buf) == obj.ref.size) and await asyncio.to_thread(obj.verified)
                else:
                    ok = len(obj.buf) == obj.ref.size and obj.verified()
                if not ok:
                    self._requeue_after_mismatch(obj, work)
                    continue
                self.stats.objects += 1
                remaining -= 1
                yield obj
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    def _plan(self, ref: ObjectRef) -> _Object:
        ranges = [(o, min(o + self.range_bytes, ref.size)) for o in range(0, ref.size, self.range_bytes)]
        return _Object(ref=ref, buf=bytearray(), ranges=ranges, missing=set(range(len(ranges))),  # buffer: on first range
                       checked_by_range=self.range_bytes % ref.piece_size == 0)

    def _requeue_after_mismatch(self, obj: _Object, work: asyncio.Queue[tuple[_Object, int] | None]) -> None:
        self.stats.integrity_refetches += 1
        nxt = max(obj.used) + 1 if obj.used else obj.source + 1
        log.warning("%s: bytes that do not match its manifest from %s; refetching from the next source",
                    obj.ref.key, ", ".join(self.sources[i].url for i in sorted(obj.used)))
        if nxt >= len(self.sources):
            raise TransferError(f"{obj.ref.key}: no source delivered bytes matching its manifest (root {obj.ref.root[:16]}…)") from IntegrityError(
                f"{obj.ref.key}: piece hash mismatch from every source tried"
            )
        obj.source = nxt
        obj.mismatch = False
        obj.used.clear()
        obj.missing = set(range(len(obj.ranges)))
        obj.buf = bytearray()  # (views, if any, are overwritten in place)
        for idx in range(len(obj.ranges)):
            work.put_nowait((obj, idx))  # it re-enters `done` once these complete

    async def _worker(self, work: asyncio.Queue[tuple[_Object, int] | None], done: asyncio.Queue[_Object], wait_s: float) -> None:
        while True:
            item = await work.get()
            if item is None:
                return
            obj, idx = item
            if obj.failed is not None or idx not in obj.missing:
                continue
            start, end = obj.ranges[idx]
            call = functools.partial(_get_range, obj.ref.key, start, end, len(obj.ranges) == 1, wait_s)
            try:
                data, i = await self._with_failover(f"{obj.ref.key}[{start}:{end}]", obj.source, call)
            except (TransferError, ObjectNotFound) as err:
                obj.failed = err
                done.put_nowait(obj)
                continue
            if obj.checked_by_range:
                if len(data) >= _HASH_IN_THREAD_BYTES:
                    await asyncio.to_thread(obj.land, start, data)
                else:
                    obj.land(start, data)
            else:
                obj.write(start, data)
            obj.used.add(i)
            self._count(i, len(data))
            obj.missing.discard(idx)
            if not obj.missing:
                done.put_nowait(obj)

    def _count(self, source: int, n: int) -> None:
        name = self.sources[source].url
        self.stats.bytes_by_source[name] = self.stats.bytes_by_source.get(name, 0) + n

    # --- small and mutable objects ------------------------------------------------------------

    async def fetch_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an immutable object, unverified (e.g. a header to plan a
        :meth:`fetch_into`, which then checks every byte): failover only."""
        call = functools.partial(_get_range, key, start, end, False, 0.0)
        data, i = await self._with_failover(f"{key}[{start}:{end}]", 0, call)
        self._count(i, len(data))
        return data

    async def fetch_key(
        self, key: str, *, wait_s: float = 0.0, unverified: bool = False, check: Callable[[bytes], object] | None = None
    ) -> bytes:
        """A whole object whose hash is not known in advance (manifests, run.json): failover only.
        ``unverified``: a segment fetched before its manifest exists (the caller checks it later).
        ``check(data)`` raising a ``DeltaRLError`` (a manifest that does not parse, or is not the
        one HEAD names) counts as that source failing: the next source is asked (a relay that
        cached a bad copy falls back to the origin)."""

        async def call(src: AsyncSource, i: int) -> bytes:
            data = await src.get_range(key, 0, None, wait=wait_s, unverified=unverified)
            if check is not None:
                check(data)
            return data

        data, i = await self._with_failover(key, 0, call)
        self._count(i, len(data))
        return data

    async def get_mutable(self, key: str, *, etag: str | None = None, wait_s: float = 0.0) -> tuple[bytes, str] | None:
        """A mutable object (HEAD) and its ETag; ``None`` if still ``etag`` after ``wait_s``."""

        async def call(src: AsyncSource, i: int) -> tuple[bytes, str] | None:
            return await src.get_mutable(key, etag=etag, wait=wait_s)

        value, _ = await self._with_failover(key, 0, call)
        return value


async def _get_range(key: str, start: int, end: int, whole: bool, wait_s: float, src: AsyncSource, i: int) -> bytes:
    """Range ``[start, end)`` of ``key`` from ``src`` (a plain GET when it is the whole object, so
    a relay can check the object's pieces as it sends it); a short answer is an error."""
    data = await src.get_range(key, start, None if whole else end, wait=wait_s, unverified=True)  # we check every byte
    if len(data) != end - start:
        raise TransferError(f"{key}[{start}:{end}] from {src.url}: got {len(data)} of {end - start} bytes")
    return data
