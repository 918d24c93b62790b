"""The actor's subscriber: learn of new versions, prefetch and stage them while the actor generates,
commit in place at the safe point between batches.

A background task long-polls the next version's manifest through the fetcher (relays hold the
request until it lands; the origin is polled) and, meanwhile, its segments by key as the trainer
uploads them (``speculate``, see :mod:`deltarl.actor.prefetch`), decoding each into a
:class:`~deltarl.codec.Stager` as it arrives. Once the manifest is visible it checks that it
names the version we hold as its parent and every speculative segment's pieces, fetches what is
still missing on several streams, and keeps the result as the one staged version. The actor calls :meth:`Subscriber.ready` and
:meth:`Subscriber.commit` between batches; nothing is written into the state anywhere else, so a
rollout is never generated from a half-applied model.

The state digest a manifest may record is checked *after* the commit, off the actor's pause: the
commit writes the changed values and returns, a background thread hashes the state while the actor
generates on it, and :meth:`Subscriber.confirm` waits for that hash. A mismatch rolls the version
back (every value the commit wrote is restored) before ``confirm`` raises, so an actor that
confirms before reporting never reports a result generated from a state that differs from the
trainer's. The next commit confirms the previous one first.

An actor that is new (:meth:`Subscriber.bootstrap`), more than ``catch_up_after`` versions behind,
or whose version the run's history no longer holds (a run re-created under its name) catches up by
the one catch-up path (:mod:`deltarl.pipeline.catch_up`) from the newest keyframe at or before
HEAD, on a copy that the next commit swaps in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.prefetch import VersionStaging, predicted_segment_keys
from deltarl.actor.safepoint import SafePoint
from deltarl.actor.source import FetcherSource
from deltarl.actor.updates import (
    CommitInfo,
    DigestCheck,
    FullUpdate,
    InPlace,
    Staged,
    loadable_in_place,
)
from deltarl.codec.heap import trim
from deltarl.codec.jit_warmup import warm_codec_quietly
from deltarl.errors import (
    ChainBroken,
    DeltaRLError,
    ObjectNotFound,
    RunReplaced,
    StagingError,
    TransferError,
)
from deltarl.pipeline.catch_up import HeldState, catch_up
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import HeadRecord, Manifest
from deltarl.storage.retry import POLL_BACKOFF, RetryPolicy

log = logging.getLogger(__name__)

#: Waits between polls while every source fails (an outage): 0.25 s doubling to 5 s, with jitter.
_OUTAGE_BACKOFF = RetryPolicy(attempts=1, base_delay=0.25, max_delay=5.0)
#: catch-ups from the newest keyframe that find no chain, in a row, before the subscriber stops (fatal)
_REJOIN_ATTEMPTS = 3


class Subscriber(SafePoint):
    """Keeps ``state`` following a run's versions, one verified commit at a time.

    Args:
        state: the weights to keep current, written in place only by :meth:`commit`.
        run: the run's name.
        fetcher: where versions are read from (relays, then the origin).
        version, version_id: the version ``state`` already holds (None: :meth:`bootstrap` first).

    Example:
        >>> async with Fetcher(["http://relay:8470", store]) as fetcher:  # doctest: +SKIP
        ...     async with Subscriber(state, "qwen-grpo", fetcher) as sub:
        ...         await sub.bootstrap()
        ...         sub.start()
        ...         while training:
        ...             generate(state)
        ...             if sub.ready():
        ...                 sub.commit()
    """

    def __init__(
        self,
        state: MutableMapping[str, Any],
        run: str,
        fetcher: Fetcher,
        *,
        version: int | None = None,
        version_id: str | None = None,
        poll_wait_s: float = 10.0,
        poll_interval_s: float = 0.2,
        catch_up_after: int = 8,
        verify_digest: bool = True,
        speculate: bool = True,
        backend: Any | None = None,
        on_staged: Callable[[], None] | None = None,
    ) -> None:
        self.state = state
        #: A generation backend whose served weights are not ``state`` itself (``state`` is a copy it
        #: keeps in step): deltas are committed through ``backend.commit``, full states pushed with
        #: ``backend.load_state``. None: ``state`` is the live weights and is written directly.
        self.backend = backend
        self.layout = RunLayout(run)
        self.fetcher = fetcher
        self.version = version
        self.version_id = version_id
        self.poll_wait_s = poll_wait_s
        self.poll_interval_s = poll_interval_s
        self.catch_up_after = catch_up_after
        self.verify_digest = verify_digest
        #: Every commit, its entry replaced once its digest check has finished.
        self.commits: list[CommitInfo] = []
        self._check: DigestCheck | None = None
        self._digests: ThreadPoolExecutor | None = None
        self._staged: Staged | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._warming: asyncio.Future[None] | None = None  # the codec warm-up (once)
        self._warm_stop = threading.Event()  # set by close: the warm-up ends at its next step
        self._error: BaseException | None = None
        #: An error the background loop stopped on (the run was re-created with other tensors).
        self._fatal: BaseException | None = None
        self._source = FetcherSource(fetcher, run)
        self.speculate = speculate
        self._spec: tuple[int, VersionStaging, asyncio.Task[None] | None] | None = None
        #: Segments staged before their manifest was visible (verified against it afterwards).
        self.speculated_segments = 0
        #: Called (on the event loop) each time a version becomes staged: ready to commit.
        self.on_staged = on_staged
        #: A version asked for (:meth:`catch_up_to`): staged straight from the held state (or a
        #: keyframe, whichever fetches less) instead of one version at a time.
        self._aim: int | None = None
        self._kick = asyncio.Event()  # cuts a backoff short (:meth:`retry_now`)
        #: Staging attempts started so far, and the one :attr:`error` came from.
        self.attempts = 0
        self.error_attempt = 0

    # --- reads through the fetcher ----------------------------------------------------------------

    async def head(self) -> HeadRecord | None:
        return await self._source.head()

    async def manifest(self, version: int, *, wait_s: float = 0.0) -> tuple[Manifest, str]:
        """A version's manifest and id (cached: manifests are immutable)."""
        return await self._source.manifest(version, wait_s=wait_s)

    # --- bootstrap and catch-up -------------------------------------------------------------------

    async def _catch_up_state(self, target: int, into: dict[str, Any] | None = None) -> tuple[dict[str, Any], Manifest, str, bool]:
        """The state at ``target`` by the one catch-up path (:func:`deltarl.pipeline.catch_up.catch_up`):
        the newest usable keyframe at or before it, then the deltas after; in fresh tensors, or in
        ``into``'s (the live state, written in place). Also whether a digest was checked."""

        async def warmed() -> None:
            await asyncio.shield(await self._warm_codec())

        held = None
        if into is None and self.version is not None and self.version_id is not None and self.version < target:
            held = HeldState(self.version, self.version_id, self._copy_state)
        done = await catch_up(self._source, target, into=into, verify=self.verify_digest,
                              warm=lambda: asyncio.ensure_future(warmed()), held=held)
        return done.state, done.manifest, done.version_id, done.digest_checked

    def _copy_state(self) -> dict[str, Any]:
        """A host copy of the held state (the base of a catch-up by deltas)."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self.state.items()}

    async def _warm_codec(self) -> asyncio.Future[None]:
        """The codec warm-up for the run's dtypes, started on a thread the first time: by a catch-up
        with deltas to apply, else when background staging starts (the next version is a delta)."""
        if self._warming is None:
            dtypes = [t.dtype for t in (await self._source.run_info()).tensors]
            self._warming = asyncio.ensure_future(asyncio.to_thread(warm_codec_quietly, dtypes, stop=self._warm_stop))
        return self._warming

    async def bootstrap(self, version: int | None = None, *, in_place: bool = True) -> CommitInfo:
        """Load the newest keyframe and apply deltas up to ``version`` (default HEAD), now (for a
        new actor). ``in_place=False``: build it in fresh tensors and swap it in only once it is
        complete and checked (weights that serve something meanwhile are never half-written)."""
        head = await self.head()
        if head is None:
            raise ObjectNotFound(f"{self.layout.head}: run {self.layout.run!r} has no HEAD yet")
        t0 = time.monotonic()
        into = await self._writable_in_place() if in_place else None
        state, manifest, vid, checked = await self._catch_up_state(head.version if version is None else version, into)
        stage_s = time.monotonic() - t0
        update = InPlace(state) if into is not None else FullUpdate(self.state, state)
        self._staged = Staged(manifest.version, vid, manifest, update, stage_s, full=True, digest_checked=checked)
        info = self.commit()
        trim()  # catch-up buffers (segments, staged deltas) are gone: give their memory back to the OS
        return info

    async def _writable_in_place(self) -> dict[str, Any] | None:
        """The live state, if a first bootstrap can load straight into it (:func:`loadable_in_place`):
        no version is held, so its tensors hold no run's weights to keep for a rollback."""
        if self.version is not None or not self.state:
            return None
        return loadable_in_place(self.state, (await self._source.run_info()).tensors)

    # --- the background loop ------------------------------------------------------------------------

    def start(self) -> None:
        """Start prefetching and staging in the background (needs a held version)."""
        if self.version is None or self.version_id is None:
            raise StagingError("subscriber holds no version: call bootstrap() first")
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        await self._stop_background()
        if self._warming is not None:  # an interpreter exiting mid-compile can crash: let its current compile finish
            self._warm_stop.set()
            if not self._warming.done():
                log.info("closing: waiting for the codec warm-up's compile under way to finish")
            await asyncio.gather(self._warming, return_exceptions=True)
        if self._digests is not None:
            await asyncio.to_thread(self._digests.shutdown)
            self._digests = None

    async def pause(self) -> None:
        """Stop staging in the background (until :meth:`start`); anything staged stays."""
        await self._stop_background()

    @property
    def running(self) -> bool:
        """Whether the background loop is staging."""
        return self._task is not None

    def _restart(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _stop_background(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._drop_speculation()

    async def __aenter__(self) -> Subscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self) -> None:
        try:
            await self._warm_codec()
        except DeltaRLError as err:  # best effort (run.json unreachable now): the first delta loads the kernels
            log.debug("codec warm-up not started: %s", err)
        quiet = failures = rejoins = 0  # polls that found nothing new / failed / could not rejoin, in a row
        while True:
            if self._staged is not None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.attempts += 1
            try:
                await self._stage_next()
                quiet = failures = rejoins = 0
            except asyncio.CancelledError:
                raise
            except ObjectNotFound as err:  # not committed yet: relays held the poll, the origin answered at once
                log.debug("nothing new yet (%s)", err)
                await self._sleep(POLL_BACKOFF.delay(quiet))
                quiet += 1
            except TransferError as err:  # every source failed: back off, say so once per outage
                (log.warning if failures == 0 else log.debug)("run %s: cannot reach any source (%s); retrying with backoff",
                                                              self.layout.run, err)
                self._set_error(err)
                failures += 1
                await self._sleep(_OUTAGE_BACKOFF.delay(failures - 1))
            except RunReplaced as err:  # another tensor table under the same name: these weights can never follow it
                self._stop_fatally(err)
                return
            except ChainBroken as err:  # the run's history no longer holds our version
                (log.warning if rejoins == 0 else log.debug)("%s; catching up from the newest keyframe", err)
                try:
                    await self._rejoin()
                    rejoins = 0
                except RunReplaced as fatal:
                    self._stop_fatally(fatal)
                    return
                except ChainBroken as again:  # no chain even from the newest keyframe: not a passing state
                    rejoins += 1
                    if rejoins >= _REJOIN_ATTEMPTS:
                        self._stop_fatally(ChainBroken(
                            f"run {self.layout.run!r}: its history does not chain from the newest keyframe "
                            f"({rejoins} tries): {again}; was the run deleted and re-created under the same name "
                            "while a relay still serves the old run's objects? restart the relay or follow the origin"))
                        return
                    log.debug("cannot catch up with run %s yet (%d): %s", self.layout.run, rejoins, again)
                    await self._sleep(_OUTAGE_BACKOFF.delay(rejoins - 1))
                except Exception as again:
                    self._set_error(again)
                    passing = isinstance(again, (ObjectNotFound, TransferError))  # a run being re-created, a source down
                    (log.debug if failures else log.warning if passing else log.error)(
                        "cannot catch up with run %s: %s", self.layout.run, again)
                    failures += 1
                    await self._sleep(_OUTAGE_BACKOFF.delay(failures - 1))
            except Exception as err:  # a bad version: keep the error for the actor, retry later
                (log.error if failures == 0 else log.debug)("cannot stage version %s: %s", (self.version or 0) + 1, err)
                self._set_error(err)
                failures += 1
                await self._sleep(_OUTAGE_BACKOFF.delay(failures - 1))

    def _set_error(self, err: BaseException) -> None:
        self._error, self.error_attempt = err, self.attempts

    async def _sleep(self, seconds: float) -> None:
        """A backoff that :meth:`retry_now` cuts short."""
        if not self._kick.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), seconds)
        self._kick.clear()

    def retry_now(self) -> None:
        """Start the next staging attempt now instead of after the current backoff."""
        self._kick.set()

    def catch_up_to(self, version: int) -> None:
        """Stage ``version`` next, however far ahead of the held one: from the held state plus the
        deltas up to it, or from the newest keyframe when that fetches less (a lagging engine
        asked for ``"latest"``). A version staged below it is dropped."""
        if self.version is not None and version <= self.version + 1:
            return
        self._aim = version
        if self._staged is not None and self._staged.version < version:
            self.drop_staged()
        self.retry_now()

    def drop_staged(self) -> None:
        """Forget the staged version (it is not the one wanted: the run was replaced, or it lags);
        the background loop stages again."""
        self._staged = None
        self._wake.set()

    def forget(self) -> None:
        """Drop every manifest read so far (the run's history may have changed under its name)."""
        self._source.forget()

    def _stop_fatally(self, err: BaseException) -> None:
        log.debug("background staging stopped: %s", err)  # raised to whoever waits for a version: said once there
        self._error = self._fatal = err
        if self.on_staged is not None:
            self.on_staged()  # wake whoever waits for a version: there will be none

    async def _rejoin(self) -> None:
        """Stage the newest version as a full update, from the newest keyframe, after the run's
        history changed under us: same tensor table (a repaired or re-created run) → caught up;
        another table → :class:`~deltarl.errors.RunReplaced` (fatal)."""
        await self._drop_speculation()
        held = await self._source.run_info()
        self._source.forget()
        info = await self._source.run_info()
        if list(info.tensors) != list(held.tensors):
            raise RunReplaced(f"run {self.layout.run!r} was re-created with another tensor table "
                              f"({len(info.tensors)} tensors, was {len(held.tensors)}); the weights held "
                              f"(version {self.version}) cannot follow it")
        head = await self.head()
        if head is None:
            raise ObjectNotFound(f"{self.layout.head}: run {self.layout.run!r} has no HEAD now")
        t0 = time.monotonic()
        state, manifest, vid, checked = await self._catch_up_state(head.version)
        self._set_staged(Staged(manifest.version, vid, manifest, FullUpdate(self.state, state), time.monotonic() - t0,
                                 True, digest_checked=checked))

    async def _drop_speculation(self) -> None:
        if self._spec is not None:
            _, staging, task = self._spec
            self._spec = None
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            staging.close()

    async def _stage_next(self) -> None:
        assert self.version is not None
        assert self.version_id is not None
        head = await self.head()
        far = self._far_target(head)
        if far is not None:
            await self._drop_speculation()
            t0 = time.monotonic()
            state, manifest, vid, checked = await self._catch_up_state(far)
            self._set_staged(Staged(manifest.version, vid, manifest, FullUpdate(self.state, state), time.monotonic() - t0,
                                     True, digest_checked=checked))
            return
        target = self.version + 1
        if self._spec is None or self._spec[0] != target:
            await self._drop_speculation()
            staging = VersionStaging(self.state, self.version_id)
            task = None
            if self.speculate:  # fetch + decode segments as they are uploaded, before the manifest exists
                window = max(1, self.fetcher.streams)
                key_of = await predicted_segment_keys(self.fetcher, self._source, target)
                task = asyncio.ensure_future(staging.speculate(self.fetcher, key_of, window=window, wait_s=self.poll_wait_s))
            self._spec = (target, staging, task)
        expect = head.version_id if head is not None and head.version == target else None  # a replaced run: re-read
        manifest, vid = await self._source.manifest(target, wait_s=self.poll_wait_s, expect_id=expect)  # ObjectNotFound: keep speculating
        visible = time.monotonic()
        _, staging, task = self._spec
        if task is not None:  # let the speculative fetches of real segments finish, drop the others
            staging.limit(len(manifest.segments))
            try:
                await asyncio.wait_for(asyncio.shield(task), self.poll_wait_s)
            except asyncio.TimeoutError:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._spec = None
        try:
            if manifest.parent != self.version_id:
                raise ChainBroken(f"{manifest.key}: parent {manifest.parent} is not the version we hold ({self.version_id})")
            update = await staging.complete(self.fetcher, manifest)
        finally:
            staging.close()
        self.speculated_segments += len(staging.speculative)
        staged = Staged(target, vid, manifest, update, time.monotonic() - visible, False)
        log.info("staged version %d (%d changed elements, %d of %d segments before its manifest) %.3fs after the manifest",
                 target, update.changed_elements, len(staging.speculative), len(manifest.segments), staged.stage_s)  # fmt: skip
        self._set_staged(staged)

    def _far_target(self, head: HeadRecord | None) -> int | None:
        """The version to catch up to in one go (more than ``catch_up_after`` behind HEAD, or asked
        for by :meth:`catch_up_to`), else None: the next version is staged as a delta."""
        assert self.version is not None
        if head is None:
            return None
        if self._aim is not None and self._aim <= self.version:
            self._aim = None
        if self._aim is not None and self.version + 1 < self._aim <= head.version:
            return self._aim
        return head.version if head.version - self.version > self.catch_up_after else None

    def _set_staged(self, staged: Staged) -> None:
        self._staged = staged
        if self.on_staged is not None:
            self.on_staged()
