"""A weights-only follower: keep a copy of a run's newest weights, for eval servers and inference
fleets that are not RL actors.

It is the actor's :class:`~deltarl.actor.subscriber.Subscriber` without the rollouts: bootstrap
from the newest keyframe, then stage each new version in the background and commit it as soon as
it is staged (a follower has no batch to finish first), checking the state digest where the
manifest records one. Everything is read through relays, the origin store only as the last
fallback (or not at all). :meth:`Follower.save` writes the committed state as safetensors, bit for
bit what the trainer published.

Async::

    async with Follower("run", relays=["http://relay:8470"]) as f:
        await f.follow(until_version=100)
        f.save("weights.safetensors")

Sync (a fresh event loop in the calling thread; ``stop`` ends it early)::

    info = Follower("run", relays=["http://relay:8470"]).run(until_version=100, out="weights.safetensors")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.subscriber import CommitInfo, Subscriber
from deltarl.errors import ConfigError, IntegrityError, ObjectNotFound, RunError, TransferError
from deltarl.storage.retry import POLL_BACKOFF
from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)


class Follower:
    """Follow ``run`` through ``relays`` (nearest first), then ``store`` if given; weights only.

    Args:
        run: the run's name.
        relays: relay base URLs (``http(s)://host:port``): deltarl relays or nginx caches.
        store: optional origin store (a store or its URL), the fallback after every relay.
        streams: parallel fetch streams.
        poll_wait_s: how long one poll for the next version may be held (relays) or retried.
        verify_digest: check the state digest after each commit where the manifest records one.
    """

    def __init__(
        self,
        run: str,
        relays: Sequence[str] = (),
        store: str | ObjectStore | None = None,
        *,
        streams: int = 4,
        poll_wait_s: float = 5.0,
        verify_digest: bool = True,
        catch_up_after: int = 8,
    ) -> None:
        sources: list[str | ObjectStore] = list(relays)
        if store is not None:
            sources.append(store)
        if not sources:
            raise ConfigError("a follower needs at least one relay or a store")
        for url in relays:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"relay URL must be http(s)://host:port, got {url!r}")
        self.run_name = run
        self._sources = sources
        self._streams = streams
        self._poll_wait_s = poll_wait_s
        self._verify_digest = verify_digest
        self._catch_up_after = catch_up_after
        #: The followed weights (name -> tensor), written only by commits.
        self.state: dict[str, Any] = {}
        self._fetcher: Fetcher | None = None
        self._sub: Subscriber | None = None
        self._staged: asyncio.Event | None = None

    # --- lifetime ----------------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the fetcher and subscriber (once; a follower is not reopened after ``close``)."""
        if self._fetcher is None:
            self._fetcher = Fetcher(self._sources, streams=self._streams, cooldown_s=5.0)
            self._staged = asyncio.Event()
            self._sub = Subscriber(self.state, self.run_name, self._fetcher, poll_wait_s=self._poll_wait_s,
                                   catch_up_after=self._catch_up_after, verify_digest=self._verify_digest,
                                   on_staged=self._staged.set)

    async def close(self) -> None:
        """Stop the background staging and release connections (``state`` and ``version`` stay)."""
        if self._sub is not None:
            await self._sub.close()
        if self._fetcher is not None:
            await self._fetcher.close()

    async def __aenter__(self) -> Follower:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- following ---------------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The committed version (None before the bootstrap)."""
        return None if self._sub is None else self._sub.version

    @property
    def version_id(self) -> str | None:
        return None if self._sub is None else self._sub.version_id

    @property
    def fetcher(self) -> Fetcher:
        if self._fetcher is None:
            raise RuntimeError("follower is not open")
        return self._fetcher

    async def bootstrap(self, *, timeout_s: float | None = None, stop: asyncio.Event | None = None) -> CommitInfo | None:
        """Load the newest version (waiting, with backoff, for the run's first one); None if stopped
        or ``timeout_s`` ran out first."""
        await self.open()
        assert self._sub is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        misses = 0
        while stop is None or not stop.is_set():
            try:
                info = await self._sub.bootstrap()
            except (ObjectNotFound, TransferError) as err:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                log.debug("run %s: nothing to bootstrap from yet (%s)", self.run_name, err)
                await _sleep_or_stop(POLL_BACKOFF.delay(misses), stop)
                misses += 1
                continue
            log.info("run %s: bootstrapped version %d", self.run_name, info.version)
            self._sub.start()
            return info
        return None

    async def step(self, *, timeout_s: float | None = None, stop: asyncio.Event | None = None) -> CommitInfo | None:
        """Wait for the next staged version and commit it (its digest confirmed); None if stopped or
        ``timeout_s`` ran out first. A digest mismatch rolls the version back and raises ``IntegrityError``."""
        if self._sub is None or self._sub.version is None:
            raise RuntimeError("bootstrap() first")
        assert self._staged is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._sub.ready():
            if self._sub.fatal is not None:
                raise self._sub.fatal
            if stop is not None and stop.is_set():
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._staged.clear()
            if self._sub.ready():
                break
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._staged.wait())]
            if stop is not None:
                waits.append(asyncio.ensure_future(stop.wait()))
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
                await asyncio.gather(*waits, return_exceptions=True)
        info = self._sub.commit()
        confirmed = await self._sub.confirm()
        return confirmed or info

    async def follow(
        self,
        until_version: int | None = None,
        *,
        stop: asyncio.Event | None = None,
        on_commit: Callable[[CommitInfo], None] | None = None,
        bootstrap_timeout_s: float | None = None,
    ) -> CommitInfo | None:
        """Bootstrap if needed, then commit each version as it lands, until ``until_version`` is
        held (returns at once if the bootstrap already reached it) or ``stop`` is set. Returns the
        last commit (None if nothing was committed). A version whose digest check fails is rolled
        back and staged again from verified fetches."""
        last: CommitInfo | None = None
        if self.version is None:
            last = await self.bootstrap(timeout_s=bootstrap_timeout_s, stop=stop)
            if last is None:
                if stop is not None and stop.is_set():
                    return None
                raise RunError(f"run {self.run_name!r}: no version to bootstrap from after {bootstrap_timeout_s}s")
            if on_commit is not None:
                on_commit(last)
        while until_version is None or (self.version or 0) < until_version:
            try:
                info = await self.step(stop=stop)
            except IntegrityError as err:
                log.error("%s; staging it again", err)
                continue
            if info is None:
                break
            last = info
            log.info("run %s: committed version %d", self.run_name, info.version)
            if on_commit is not None:
                on_commit(info)
        return last

    # --- output ------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the committed state as safetensors, atomically, byte for byte as ``deltarl replay``
        writes the same version (:mod:`deltarl.pipeline.state_file`)."""
        from deltarl.pipeline.state_file import write_state_file

        if not self.state:
            raise RunError(f"run {self.run_name!r}: nothing committed yet, no weights to save")
        write_state_file(path, self.state,
                         {"run": self.run_name, "version": str(self.version), "version_id": str(self.version_id)})

    def run(
        self,
        until_version: int | None = None,
        *,
        out: str | os.PathLike[str] | None = None,
        stop: threading.Event | None = None,
        bootstrap_timeout_s: float | None = None,
        on_commit: Callable[[CommitInfo], None] | None = None,
    ) -> CommitInfo | None:
        """The blocking form of :meth:`follow` (its own event loop): follow, then write the last
        committed state to ``out`` if given, also when ``stop`` ended it early; not when following
        failed (a run re-created under the same name: the held weights are no version of it)."""

        async def main() -> CommitInfo | None:
            stopped = asyncio.Event()
            watch = asyncio.ensure_future(_watch(stop, stopped)) if stop is not None else None
            async with self:
                try:
                    last = await self.follow(until_version, stop=stopped, bootstrap_timeout_s=bootstrap_timeout_s,
                                             on_commit=on_commit)
                finally:
                    if watch is not None:
                        watch.cancel()
                        await asyncio.gather(watch, return_exceptions=True)
                if out is not None and self.state:
                    self.save(out)
                return last

        return asyncio.run(main())


async def _sleep_or_stop(seconds: float, stop: asyncio.Event | None) -> None:
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def _watch(stop: threading.Event, stopped: asyncio.Event) -> None:
    """Carry a thread-side stop into the loop (checked every 50 ms; no network involved)."""
    while not stop.is_set():
        await asyncio.sleep(0.05)
    stopped.set()
