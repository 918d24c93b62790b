"""Staging one version, optionally *before* its manifest exists (speculative prefetch).

The commit protocol writes a version's manifest last, after every segment is durable. Waiting for
it would make an actor start fetching only once the whole upload is over. Instead, while the
manifest is awaited, :meth:`VersionStaging.speculate` long-polls the version's segments by key
(``e<epoch>-seg-r000-00000.bin``, ``…-00001.bin``, … up to ``window`` at a time once the first has landed,
only the first before) as the trainer uploads them,
and decodes each into the :class:`~deltarl.codec.apply.Stager` as it lands: relays cut them through
hop by hop, so the actor receives a segment while it is still crossing the WAN.

Nothing fetched this way is trusted yet: :meth:`VersionStaging.complete` checks every speculative
segment's pieces against the manifest once it arrives (composed from the hashes of its 64 KiB
blocks, taken once as it landed). If any differs (or is not in the manifest)
the decoded state is thrown away and the version is staged again from verified fetches; segments
not fetched speculatively are fetched (and verified) then. Decoding only stages values, it never
writes the live state, so discarding is always safe. All decodes of one staging run on one worker
thread, in arrival order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.source import FetcherSource
from deltarl.codec.hashing import leaves
from deltarl.errors import DeltaRLError, FormatError, ObjectNotFound, TransferError
from deltarl.pipeline.claim import WriterClaim
from deltarl.pipeline.layout import key_epoch
from deltarl.pipeline.manifest import Manifest
from deltarl.pipeline.pieces import pieces_of_blocks

log = logging.getLogger(__name__)


async def predicted_segment_keys(fetcher: Fetcher, source: FetcherSource, version: int) -> Callable[[int], str]:
    """Segment keys of ``version`` as its writer will name them: the epoch of the run's writer
    claim (a restarted or taking-over writer has a new one), else of the last manifest's objects.
    A wrong guess only makes speculation miss, never misapply."""
    layout = source.layout
    last = source.cached(version - 1)
    refs = [] if last is None else [*last[0].segments, *(last[0].keyframe.parts if last[0].keyframe else ())]
    epoch = next((e for ref in refs if (e := key_epoch(ref.key)) is not None), None) or 1
    try:
        got = await fetcher.get_mutable(layout.writer)
        if got is not None:
            epoch = max(epoch, WriterClaim.from_bytes(got[0], where=layout.writer).epoch)
    except (ObjectNotFound, TransferError, FormatError) as err:
        log.debug("writer claim of %s not read (%s); speculating with epoch %d", layout.run, err, epoch)
    return lambda i: layout.segment(version, i, epoch=epoch)


class VersionStaging:
    """Decode one version's segments into a Stager, speculatively or from a manifest."""

    def __init__(self, state: Mapping[str, Any], base: str) -> None:
        from deltarl.codec.stager import Stager

        self._state = state
        self._base = base
        self._stager = Stager(state, base=base)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltarl-stage")
        self._pending: list[asyncio.Future[None]] = []
        self._spec_decodes: list[tuple[str, tuple[int, bytes], asyncio.Future[None]]] = []  # key, (size, block hashes), decode
        self.speculative: dict[str, tuple[int, bytes]] = {}  # key -> (size, block hashes) of what was decoded (set by complete())
        self.speculation_failed = False
        self._limit: int | None = None
        self._limit_set = asyncio.Event()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, data: bytes) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._stager.add_segment, data)
        self._pending.append(fut)
        return fut

    async def _decode(self, data: bytes) -> None:
        await asyncio.shield(self._submit(data))  # a cancelled caller leaves the decode to finish

    def limit(self, count: int) -> None:
        """The manifest says the version has ``count`` segments: finish those in flight, drop the rest."""
        self._limit = count
        self._limit_set.set()

    async def speculate(self, fetcher: Fetcher, key_of: Callable[[int], str], *, window: int, wait_s: float) -> None:
        """Long-poll and decode segments 0, 1, … of ``version``, until cancelled, or until those below
        :meth:`limit` are done (or one is not a delta on our base). A segment that no source can
        deliver ends the speculation (the manifest's verified fetch retries with backoff), so an
        outage never walks the speculation through indices that do not exist."""
        next_index = 0
        landed = asyncio.Event()  # until a first segment lands, poll only segment 0 (an idle reader asks little)
        running: dict[asyncio.Task[None], int] = {}
        limit_wait: asyncio.Task[Any] = asyncio.ensure_future(self._limit_set.wait())
        landed_wait: asyncio.Task[Any] = asyncio.ensure_future(landed.wait())

        async def one(index: int) -> None:
            key = key_of(index)
            while True:
                try:  # the source holds or backs off (early 404s) for up to wait_s
                    data = await fetcher.fetch_key(key, wait_s=wait_s, unverified=True)  # checked in complete()
                    break
                except ObjectNotFound:
                    continue  # not uploaded yet (or never: the manifest will tell)
            landed.set()
            fut = self._submit(data)
            self._spec_decodes.append((key, (len(data), leaves(data)), fut))  # recorded before any await
            try:
                await asyncio.shield(fut)
            except DeltaRLError as err:  # e.g. another base: not the version we are waiting for
                log.info("speculative %s rejected: %s", key, err)
                self.speculation_failed = True

        try:
            while not self.speculation_failed:
                limit = self._limit
                for task, index in list(running.items()):
                    if limit is not None and index >= limit:
                        task.cancel()  # beyond the last segment: it will never land
                while len(running) < (window if landed.is_set() else 1) and (limit is None or next_index < limit):
                    running[asyncio.ensure_future(one(next_index))] = next_index
                    next_index += 1
                if not running:
                    return
                waiting: list[asyncio.Task[Any]] = [*running, limit_wait, landed_wait]
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if landed_wait in done:
                    landed_wait = asyncio.ensure_future(asyncio.Event().wait())  # fired once: never again
                for task in done:
                    if task not in running:
                        continue
                    del running[task]
                    if task.cancelled() or task.exception() is None:
                        continue
                    if isinstance(task.exception(), TransferError):  # no source delivers: stop guessing keys
                        log.debug("speculation stopped: %s", task.exception())
                        return
                    raise task.exception()  # type: ignore[misc]
        finally:
            limit_wait.cancel()
            landed_wait.cancel()
            for task in running:
                task.cancel()
            await asyncio.gather(limit_wait, landed_wait, *running, return_exceptions=True)

    async def complete(self, fetcher: Fetcher, manifest: Manifest) -> Any:
        """Verify speculative segments against ``manifest``, fetch the rest, return the StagedUpdate."""
        from deltarl.codec.stager import Stager

        await asyncio.gather(*self._pending, return_exceptions=True)
        for key, sha, fut in self._spec_decodes:
            if fut.exception() is None:
                self.speculative[key] = sha
            else:
                self.speculation_failed = True
        refs = {ref.key: ref for ref in manifest.segments}
        trusted = {k for k, (size, blocks) in self.speculative.items()
                   if k in refs and refs[k].size == size and pieces_of_blocks(blocks, refs[k].piece_size) == refs[k].pieces}
        if self.speculation_failed or len(trusted) != len(self.speculative):
            log.warning("%s: speculative segments disagree with the manifest; staging again", manifest.key)
            self._stager = Stager(self._state, base=self._base)
            trusted = set()
        self.speculative = {k: self.speculative[k] for k in trusted}
        missing = [ref for ref in manifest.segments if ref.key not in trusted]
        async for _, data in fetcher.fetch_objects(missing):
            await self._decode(data)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._stager.finish)
