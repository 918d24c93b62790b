"""The relay's object logic, independent of HTTP: cache lookups, shared upstream pulls,
integrity checks against manifests (mutable objects: :mod:`.mutable`, long-polls: :mod:`.longpoll`)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from deltarl.errors import (
    CacheFull,
    FormatError,
    IntegrityError,
    ObjectNotFound,
    StoreError,
    TransientStoreError,
)
from deltarl.pipeline.layout import manifest_key_for
from deltarl.pipeline.manifest import Manifest, ObjectRef
from deltarl.relay.bodies import CachedBody, PullBody
from deltarl.relay.cache import CacheEntry, DiskCache, file_matches
from deltarl.relay.config import RelayConfig
from deltarl.relay.longpoll import LongPolls
from deltarl.relay.metrics import RelayMetrics
from deltarl.relay.mutable import MutableObjects
from deltarl.relay.passthrough import PassThroughBody, is_no_room
from deltarl.relay.pull import Pull
from deltarl.storage.aio import AsyncSource
from deltarl.storage.store import ObjectInfo

log = logging.getLogger(__name__)
T = TypeVar("T")

_PIECE_ATTEMPTS = 4

#: What a manifest records of an object: its ref (size, piece hashes, root).
Ref = ObjectRef


def manifest_refs(data: bytes, where: str = "manifest") -> dict[str, ObjectRef]:
    """``{key: ref}`` of every object a manifest names, parsed strictly by the pipeline's manifest
    parser (FormatError / UnsupportedFormatVersion for anything else)."""
    manifest = Manifest.from_bytes(data, where=where)
    parts = manifest.keyframe.parts if manifest.keyframe is not None else ()
    return {ref.key: ref for ref in (*manifest.segments, *parts)}


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (a write, hash or flush of a pull's file) on a worker thread, so a disk that
    throttles writes does not stall serving.

    A cancelled caller still waits for it to finish: the pull closes its file only after its piece
    tasks end, and a write racing that close could land in whatever file reuses the descriptor."""
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        raise


class ObjectService:
    """Everything a relay does per key. Lives in one event loop; ``close()`` it."""

    def __init__(self, upstream: AsyncSource, config: RelayConfig, metrics: RelayMetrics) -> None:
        self.upstream = upstream
        self.config = config
        self.metrics = metrics
        self.cache = DiskCache(config.cache_dir, config.cache_bytes, on_evict=lambda e: metrics.evictions.inc())
        metrics.cache_bytes.set(self.cache.bytes)
        self._pulls: dict[str, Pull] = {}
        self.polls = LongPolls(upstream, config, metrics)
        self.mutable = MutableObjects(upstream, config, metrics)
        self._manifests: OrderedDict[str, dict[str, Ref]] = OrderedDict()
        self._manifest_misses: dict[str, float] = {}
        self._uncacheable: OrderedDict[str, None] = OrderedDict()  # keys whose pull found no room on disk
        self._bad: dict[str, tuple[float, str, str]] = {}  # key -> (until, why, upstream ETag): bytes failed the manifest
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.polls.close()
        await self.upstream.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- immutable objects ----------------------------------------------------------------------

    async def open(self, key: str, *, wait: float = 0.0, unverified: bool = False) -> CachedBody | PullBody | PassThroughBody:
        """A readable body for ``key``: from the cache, a pull in flight, or a new pull; an object
        the cache's disk has no room for streams from upstream, in full, uncached.

        With ``wait`` > 0 a missing object is waited for (long-poll) before ``ObjectNotFound``.

        Segments and keyframe parts are served *verified*: only once a committed manifest names
        them, and then no byte goes out before it was checked against the manifest (piece by
        piece, so cut-through lags by at most one piece). An object
        no manifest names yet is waited for until ``wait`` (then ``ObjectNotFound``), unless the
        client asks for it ``unverified`` (speculative fetches, which check the bytes themselves).
        """
        deadline = time.monotonic() + min(wait, self.config.max_wait_s)
        await self._refuse_if_bad(key)
        ref: Ref | None = None
        if self.config.verify and manifest_key_for(key) is not None:
            # a committed object is served checked even to a client that asked for it unverified
            ref = await self._expected_ref(key) if unverified else await self._committed_ref(key, deadline)
        if key in self._uncacheable and key not in self.cache:
            return await self._pass_through(key, ref)
        while True:
            entry = self.cache.get(key)
            if entry is not None and self.config.verify and not entry.verified:
                entry = await self._check_cached(entry)
                if entry is not None and ref is not None and not entry.verified:
                    entry = None  # cached before its manifest and not checkable: pull it again
            if entry is not None:
                body = CachedBody.open(entry, self._evict_corrupt, check=self.config.check_on_serve)
                if body is not None:
                    self.metrics.cache_hits.inc()
                    return body
                log.warning("cached file of %s vanished or was cut short; fetching it again", key)
                self.cache.remove(key)
                self.metrics.cache_bytes.set(self.cache.bytes)
                continue
            pull = self._pulls.get(key)
            left = deadline - time.monotonic()
            if pull is None and left > 0:
                # A long-poll asks upstream with its wait at once (answered at once if the object is
                # there): no plain HEAD, 404 and second request first, one round trip per hop.
                info = await self.wait_for(key, left)
                if info is None:
                    raise ObjectNotFound(f"{key} is not in {self.upstream.url}")
                if key in self.cache or key in self._pulls:
                    continue
                self.metrics.cache_misses.inc()
                pull = self._start_pull(key, info)  # its size is known: no second HEAD upstream
            elif pull is None:
                self.metrics.cache_misses.inc()
                pull = self._start_pull(key)
            else:
                self.metrics.shared_pulls.inc()
            await pull.wait_ready()
            if isinstance(pull.error, CacheFull):
                return await self._pass_through(key, ref)
            if pull.size is not None and pull.tmp_path is not None and not pull.error:
                if pull.done:
                    continue  # committed between our wake-up and now: read the cache entry
                if ref is not None:
                    pull.expect(ref)
                try:
                    return PullBody(pull, cut_through=self.config.cut_through, rest=self._rest_of(key, pull, ref),
                                    verified_only=ref is not None)
                except FileNotFoundError:  # someone removed the cache folder under a pull in flight
                    log.warning("the file of the pull of %s vanished; serving it from upstream uncached", key)
                    return await self._pass_through(key, ref)
            if not isinstance(pull.error, ObjectNotFound):
                raise StoreError(f"upstream {self.upstream.url}: {key}: {pull.error}") from pull.error
            if deadline - time.monotonic() <= 0:
                raise ObjectNotFound(f"{key} is not in {self.upstream.url}")
            # (raced with a delete, or a pull started without a wait): wait for it above

    async def stat(self, key: str, *, wait: float = 0.0) -> tuple[int, str]:
        """Size and ETag without a pull (HEAD requests); a long-poll (``wait`` > 0) for an object
        not here yet starts its pull, since whoever waited for it is about to GET it."""
        entry = self.cache.get(key)
        if entry is not None:
            return entry.size, entry.etag
        pull = self._pulls.get(key)
        if pull is not None and pull.size is not None and pull.error is None:
            return pull.size, pull.etag
        if wait > 0:
            info = await self.wait_for(key, min(wait, self.config.max_wait_s))  # at once if it is upstream
            if info is None:
                raise ObjectNotFound(f"{key} is not in {self.upstream.url}")
            if key not in self._pulls and key not in self.cache:
                self._start_pull(key, info)
            return info.size, info.etag
        self.metrics.upstream_requests.labels("head").inc()
        info = await self.upstream.head(key)
        return info.size, info.etag

    async def _committed_ref(self, key: str, deadline: float) -> Ref:
        """The manifest ref of ``key``, waiting (until ``deadline``) for a manifest that names it."""
        mkey = manifest_key_for(key)
        assert mkey is not None
        if mkey not in self._manifests:
            self._manifest_misses.pop(mkey, None)  # a miss remembered from a speculative pull may be stale
        while True:
            ref = await self._expected_ref(key)
            if ref is not None:
                return ref
            left = deadline - time.monotonic()
            if left <= 0 or await self.wait_for(mkey, left) is None:
                raise ObjectNotFound(f"{key} is not named by a committed manifest (yet): ?wait=S waits for one, "
                                     "?unverified=1 serves the bytes unchecked")
            self._manifest_misses.pop(mkey, None)
            self._manifests.pop(mkey, None)
            if await self._expected_ref(key) is None:
                raise ObjectNotFound(f"{key} is not named by its version's manifest {mkey}")

    async def _pass_through(self, key: str, ref: Ref | None = None) -> PassThroughBody:
        self.metrics.upstream_requests.labels("head").inc()
        info = await self.upstream.head(key)
        if ref is None and self.config.verify:
            ref = await self._expected_ref(key)
        self.metrics.passthrough.inc()
        return PassThroughBody(self.upstream, key, info.size, info.etag, ref, verified_only=ref is not None)

    def _rest_of(self, key: str, pull: Pull, ref: Ref | None) -> Any:
        async def rest(pos: int, end: int, sent: bytes) -> Any:
            assert pull.size is not None
            r = ref or (await self._expected_ref(key) if self.config.verify else None)
            self.metrics.passthrough.inc()
            body = PassThroughBody(self.upstream, key, pull.size, pull.etag, r, verified_only=ref is not None)
            async for data in body.read(pos, end, sent):
                yield data

        return rest

    def _check_room(self, key: str, size: int) -> None:
        """Raise ``CacheFull`` unless the cache's disk has room for ``size`` bytes (after evicting)."""
        self.cache.ensure_directory()
        free = shutil.disk_usage(self.cache.directory).free
        need = size + (64 << 10)
        if free < need and free + self.cache.bytes >= need:
            oldest_first = self.cache.keys()
            for old in oldest_first:
                if free >= need:
                    break
                entry = self.cache.get(old)
                self.cache.remove(old)
                self.metrics.evictions.inc()
                free += entry.size if entry is not None else 0
            self.metrics.cache_bytes.set(self.cache.bytes)
        if free < need:
            raise CacheFull(f"{key}: {size} bytes, the relay cache's disk has {free} free")

    def _start_pull(self, key: str, info: ObjectInfo | None = None) -> Pull:
        pull = self._pulls[key] = Pull(key)
        self._spawn(self._run_pull(pull, info))
        return pull

    async def _run_pull(self, pull: Pull, known: ObjectInfo | None = None) -> None:
        key = pull.key
        try:
            if known is not None:
                info = known
            else:
                self.metrics.upstream_requests.labels("head").inc()
                info = await self.upstream.head(key)
        except Exception as err:  # handed to every reader of this pull
            self._pulls.pop(key, None)
            pull.fail(err)
            return
        self.metrics.upstream_pulls.inc()
        # Look the manifest's ref up while the bytes travel: pieces are checked as they land from then on.
        expected_task = asyncio.ensure_future(self._expected_ref(key)) if self.config.verify else None

        def learned(task: asyncio.Future[Ref | None]) -> None:  # check pieces as they land from now on
            if not task.cancelled() and task.exception() is None and (ref := task.result()) is not None:
                pull.expect(ref)

        if expected_task is not None:
            expected_task.add_done_callback(learned)
        size = info.size
        try:
            self._check_room(key, size)
            pull.begin(size, info.etag, self.cache.temp_path(), self.config.piece_bytes)
            # Up to pull_streams pieces stream in at once, each written as its bytes arrive; a new
            # piece starts as soon as any finishes (no head-of-line wait). pull_streams is the number
            # of connections an object may hold upstream, so pieces are not overlapped beyond it.
            inflight: set[asyncio.Task[None]] = set()
            nxt = 0
            try:
                while nxt < pull.pieces or inflight:
                    while len(inflight) < self.config.pull_streams and nxt < pull.pieces:
                        inflight.add(asyncio.ensure_future(self._piece(pull, nxt)))
                        nxt += 1
                    finished, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                    for task in finished:
                        task.result()
            except BaseException:
                for t in inflight:
                    t.cancel()
                await asyncio.gather(*inflight, return_exceptions=True)
                raise
            known_ref = await expected_task if expected_task is not None else None
            if known_ref is not None:
                pull.expect(known_ref)
            verified = pull.finish_check()  # raises the IntegrityError of a piece that differed
        except BaseException as err:
            if expected_task is not None and not expected_task.done():
                expected_task.cancel()
            self._pulls.pop(key, None)
            if err is pull.bad:
                self.metrics.integrity_failures.inc()
                self._bad[key] = (time.monotonic() + self.config.integrity_hold_s, str(err), info.etag)
            if is_no_room(err):
                err = CacheFull(f"{key}: the relay cache's disk is full: {err}")
            if isinstance(err, CacheFull):
                self._uncacheable[key] = None
                while len(self._uncacheable) > 1024:
                    self._uncacheable.popitem(last=False)
            pull.fail(err)
            if not isinstance(err, Exception):
                raise
            log.warning("pull of %s failed: %s", key, err)
            return
        assert pull.tmp_path is not None
        self._pulls.pop(key, None)
        try:
            self.cache.commit(key, pull.tmp_path, size=size, etag=pull.etag, ref=known_ref if verified else pull.own,
                              verified=verified)
        except OSError as err:  # a full disk: the readers in flight still hold the file; the next one pulls again
            log.warning("could not cache %s (%s); serving it uncached", key, err)
            if is_no_room(err):
                self._uncacheable[key] = None
        self.metrics.cache_bytes.set(self.cache.bytes)
        pull.done = True
        pull.notify()

    async def _piece(self, pull: Pull, i: int) -> None:
        """Stream piece ``i`` into the pull; a broken stream resumes where it stopped."""
        start, end = pull.piece_range(i)
        pos = start
        for attempt in range(_PIECE_ATTEMPTS):
            try:
                self.metrics.upstream_requests.labels("get_range").inc()
                async for data in self.upstream.stream_range(pull.key, pos, end, unverified=True):
                    data = data[: end - pos]
                    if data:
                        digest = await _off_loop(pull.store, pos, data)
                        pull.landed(pos, data, digest)
                        pos += len(data)
                        self.metrics.bytes_in.inc(len(data))
                        if (window := pull.flush_due()) is not None:
                            await _off_loop(pull.flush, *window)
                if pos != end:
                    raise TransientStoreError(f"{pull.key}: upstream stopped at {pos - start} of {end - start} bytes")
                return
            except TransientStoreError as err:
                if attempt == _PIECE_ATTEMPTS - 1:
                    raise
                log.info("retrying piece [%d, %d) of %s: %s", pos, end, pull.key, err)
                await asyncio.sleep(min(2.0, 0.05 * 2**attempt))

    async def _refuse_if_bad(self, key: str) -> None:
        """IntegrityError if ``key``'s upstream bytes failed their manifest within the last
        ``integrity_hold_s`` and the upstream still has the same object (same ETag): answered at
        once (502, integrity) so a client falls back instead of retrying; a repaired upstream
        object (another ETag) is pulled again."""
        bad = self._bad.get(key)
        if bad is None:
            return
        until, why, etag = bad
        if time.monotonic() < until:
            try:
                self.metrics.upstream_requests.labels("head").inc()
                same = (await self.upstream.head(key)).etag == etag
            except StoreError:
                same = False
            if same:
                raise IntegrityError(f"{key}: the upstream's bytes do not match their manifest ({why})")
        self._bad.pop(key, None)

    def _evict_corrupt(self, entry: CacheEntry) -> None:
        log.error("cached %s is corrupt; evicting it", entry.key)
        self.metrics.integrity_failures.inc()
        self.cache.remove(entry.key)
        self.metrics.cache_bytes.set(self.cache.bytes)

    async def _check_cached(self, entry: CacheEntry) -> CacheEntry | None:
        """Verify an entry cached before its manifest was known (or before a restart), by its pieces."""
        ref = await self._expected_ref(entry.key)
        if ref is None:
            return entry  # nothing to check against yet; readers check the pieces themselves
        own = entry.ref
        if own is not None and own.size == ref.size and own.piece_size == ref.piece_size:
            ok = own.pieces == ref.pieces  # the hashes taken as it landed: no second pass over the file
        else:
            ok = await asyncio.to_thread(file_matches, entry.path, ref)
        if not ok:
            self._evict_corrupt(entry)
            return None
        self.cache.mark_verified(entry.key, ref)
        return self.cache.get(entry.key)

    async def _expected_ref(self, key: str) -> Ref | None:
        """What the manifest of ``key``'s version records for it, or None (no manifest yet, not named)."""
        mkey = manifest_key_for(key)
        if mkey is None:
            return None
        refs = self._manifests.get(mkey)
        if refs is None:
            missed = self._manifest_misses.get(mkey)
            if missed is not None and time.monotonic() - missed < self.config.poll_interval_s:
                return None
            try:
                entry = self.cache.get(mkey)
                if entry is not None:
                    data = await asyncio.to_thread(_read_file, entry.path)
                else:
                    self.metrics.upstream_requests.labels("get").inc()
                    data, _ = await self.upstream.get_with_etag(mkey)
                refs = manifest_refs(data, mkey)
            except ObjectNotFound:
                self._manifest_misses[mkey] = time.monotonic()
                return None
            except FormatError as err:
                log.warning("cannot read refs from %s: %s", mkey, err)
                return None
            self._manifest_misses.pop(mkey, None)
            self._manifests[mkey] = refs
            while len(self._manifests) > 1024:
                self._manifests.popitem(last=False)
        return refs.get(key)

    async def wait_for(self, key: str, timeout: float) -> ObjectInfo | None:
        """Hold until ``key`` exists upstream (or is pushed here); its info, or ``None`` after ``timeout``."""
        return await self.polls.wait_for(key, timeout)

    def landed(self, key: str, info: ObjectInfo | None) -> None:
        """A push wrote (``info``) or deleted (``None``) ``key``: forget stale copies, wake long-polls."""
        self.cache.remove(key)
        self.mutable.forget(key)
        if info is not None:
            self.polls.found(key, info)


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
