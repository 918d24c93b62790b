"""The in-place updater of a tensor- or expert-parallel engine rank: every rank stages its own part,
and a version commits on every rank or on none.

:class:`ShardedUpdater` answers the calls :class:`~deltarl.updater.inplace.InPlaceUpdater` makes of its subscriber (bootstrap,
background staging of the next version, commit, confirm) for a rank that holds
:class:`~deltarl.updater.probe.Region` s of the checkpoint tensors: it stages each delta over its
regions only (:func:`deltarl.updater.shards.stage_regions`), builds a bootstrap in fresh tensors of
its part and swaps them in once every rank has built its own and the ranks' joined digest matches,
and agrees with the other ranks (:class:`~deltarl.updater.ranks.Ranks`, e.g. vLLM's gloo group)
before it keeps anything: a commit refused on one rank is rolled back on all, a digest that does not
match rolls back every rank. Every collective runs in a call vLLM makes on every worker in the same
order (vLLM: ``init_transfer_engine``, ``update_weights``, ``finish_weight_update``); the background
staging never talks to the other ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltarl.errors import (
    IntegrityError,
    NotPublished,
    NotStaged,
    ObjectNotFound,
    RunError,
    StagingError,
    short_pair,
)

log = logging.getLogger(__name__)


@dataclass
class Staged:
    """A version staged over this rank's regions."""

    version: int
    version_id: str
    manifest: Any
    update: Any  # StagedUpdate
    stage_s: float


@dataclass
class Committed:
    """What a commit (or a bootstrap) did."""

    version: int
    version_id: str
    pause_s: float = 0.0
    changed_elements: int = 0
    digest_s: float | None = None


class _Swap:
    """A version built whole for this rank's part in fresh tensors: the commit copies it in (keeping
    the old part for a rollback)."""

    def __init__(self, views: dict[str, Any], fresh: dict[str, Any]) -> None:
        self.views, self.fresh = views, fresh
        self.old: dict[str, Any] | None = None
        self.tensors = tuple(sorted(fresh))
        self.changed_elements = sum(int(t.numel()) for t in fresh.values())

    def commit(self) -> None:
        self.old = {n: v.clone() for n, v in self.views.items()}
        for n, v in self.views.items():
            v.copy_(self.fresh[n])

    def rollback(self) -> None:
        if self.old is not None:
            for n, v in self.views.items():
                v.copy_(self.old[n])


def _refusal(ranks: Any, err: BaseException | None, oks: list[bool], what: str) -> BaseException:
    if err is not None:
        return err
    bad = [r for r, ok in enumerate(oks) if not ok]
    return StagingError(f"{what} refused on rank(s) {bad} of {ranks.size}: no rank keeps it")


#: the refusals a client answers by asking again: another rank's is raised here as the same kind
_ASK_AGAIN = {"NotStaged": NotStaged, "NotPublished": NotPublished}


def agreed(ranks: Any, fn: Callable[[], Any], key: Callable[[], Any], drop: Callable[[], None]) -> None:
    """Run ``fn()`` here; then every rank must have succeeded with the same ``key()`` (what it took),
    else every rank ``drop()`` s what it took and raises: its own error; a rank that succeeded raises
    the first failing rank's kind when the client should ask again (NotStaged, NotPublished), else a
    StagingError carrying that rank's message; NotStaged while ranks hold different versions."""
    err: BaseException | None = None
    try:
        fn()
    except Exception as e:  # reported to every rank before it is raised here
        err = e
    mine = (True, key(), "", "") if err is None else (False, None, type(err).__name__, str(err))
    votes = ranks.gather(mine)
    if all(v[0] for v in votes) and len({v[1] for v in votes}) == 1:
        return
    drop()
    if err is not None:
        raise err
    failed = [(r, v) for r, v in enumerate(votes) if not v[0]]
    if not failed:
        raise NotStaged(f"the {ranks.size} ranks have staged different versions: ask again")
    rank, (_, _, kind, text) = failed[0]
    if kind in _ASK_AGAIN:
        raise _ASK_AGAIN[kind](f"rank {rank}: {text}")
    raise StagingError(f"refused on rank {rank} of {ranks.size} ({kind}): {text}")


class ShardedUpdater:
    """Keeps one rank's ``views`` (its parts of the checkpoint tensors) at the run's versions."""

    def __init__(self, views: dict[str, Any], placements: list[Any], table: list[Any], run: str, fetcher: Any,
                 ranks: Any, *, verify: bool = True, poll_wait_s: float = 5.0) -> None:
        from deltarl.actor.source import FetcherSource

        self.views, self.placements, self.table, self.ranks = views, placements, table, ranks
        self.fetcher, self.verify, self.poll_wait_s = fetcher, verify, poll_wait_s
        self._source = FetcherSource(fetcher, run)
        self.layout = self._source.layout
        self.version: int | None = None
        self.version_id: str | None = None
        self._staged: Staged | None = None
        self._last: tuple[Staged, float, Any] | None = None  # committed, not confirmed: (staged, pause_s, previous)
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.fatal: BaseException | None = None
        self.attempts = 0
        self.error_attempt = 0
        self.fetched_bytes = 0  # bytes the last staged version read (only the pieces holding this rank's part)
        self.stage_parts: dict[str, float] | None = None  # where the last stage's time went (RegionStage)
        self._aim: int | None = None  # a version several ahead asked for ("latest" far behind)

    # --- reads --------------------------------------------------------------------------------------
    async def head(self) -> Any:
        return await self._source.head()

    async def manifest(self, version: int, *, wait_s: float = 0.0) -> Any:
        return await self._source.manifest(version, wait_s=wait_s)

    # --- bootstrap ----------------------------------------------------------------------------------
    async def bootstrap(self, version: int | None = None, *, in_place: bool = False) -> Committed:
        """Build ``version`` (default HEAD) in fresh tensors of this rank's part; swap it in only once
        every rank built its own and their joined digest is the one the chain records."""
        import torch

        from deltarl.updater.shards import catch_up_regions

        err: BaseException | None = None
        fresh = {n: torch.empty_like(v) for n, v in self.views.items()}
        got: tuple[Any, str, Any] | None = None
        try:
            if version is None:
                head = await self.head()
                if head is None:
                    raise ObjectNotFound(f"{self.layout.head}: run {self.layout.run!r} has no HEAD yet")
                version = head.version
            got = await catch_up_regions(self._source, version, fresh, self.placements, self.table, verify=self.verify)
        except Exception as e:  # every rank learns of it before it is raised
            err = e
        votes = await asyncio.to_thread(self.ranks.gather, None if got is None else got[1])
        if err is not None or votes[0] is None or len(set(votes)) != 1:
            raise _refusal(self.ranks, err, [v is not None and v == votes[0] for v in votes], "the bootstrap")
        assert got is not None
        manifest, vid, digest_at = got
        if self.verify and digest_at is not None:
            have = await asyncio.to_thread(self.ranks.engine_digest, self.table, self.placements, fresh)
            if have != digest_at.state_digest.value:
                shown = short_pair(have, digest_at.state_digest.value)
                raise IntegrityError(f"{digest_at.key}: the ranks' rebuilt state hashes to {shown[0]}, the manifest "
                                     f"records {shown[1]}")
        for name, view in self.views.items():
            view.copy_(fresh.pop(name))
        self.version, self.version_id, self._staged = manifest.version, vid, None
        return Committed(manifest.version, vid, changed_elements=sum(v.numel() for v in self.views.values()))

    # --- the background staging of the next version -------------------------------------------------
    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        from deltarl.updater.shards import stage_region_reads

        loop = asyncio.get_running_loop()

        def get_range(key: str, start: int, end: int) -> bytes:  # on the staging thread, through the fetcher
            return asyncio.run_coroutine_threadsafe(self.fetcher.fetch_range(key, start, end), loop).result()

        while self._staged is None and self.version is not None:
            target, base = self.version + 1, str(self.version_id)
            self.attempts += 1
            try:
                if self._aim is not None and self._aim > target:
                    await self._stage_far(self._aim, base)
                    continue
                manifest, vid = await self._source.manifest(target, wait_s=self.poll_wait_s)
                if manifest.parent != base:
                    raise RunError(f"{manifest.key}: parent {manifest.parent} is not the served version's id {base}")
                t0 = time.monotonic()
                update, took = await asyncio.to_thread(stage_region_reads, get_range, manifest, self.views,
                                                       self.placements, self.table, base=base)
                if (self.version, self.version_id) == (target - 1, base):
                    self._staged = Staged(target, vid, manifest, update, time.monotonic() - t0)
                    self.fetched_bytes = took.fetched_bytes  # this rank's part of the version, and the headers
                    self.stage_parts = took.as_dict()
                    self.error = None
            except ObjectNotFound:
                continue  # not published yet: poll again
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.error, self.error_attempt = err, self.attempts
                log.warning("deltarl: staging version %d on rank %d: %s", target, self.ranks.rank, err)
                await asyncio.sleep(1.0)

    async def _stage_far(self, target: int, base: str) -> None:
        """Several versions ahead: the rank's part of ``target`` built whole in fresh tensors."""
        import torch

        from deltarl.updater.shards import catch_up_regions

        t0 = time.monotonic()
        fresh = {n: torch.empty_like(v) for n, v in self.views.items()}
        manifest, vid, _ = await catch_up_regions(self._source, target, fresh, self.placements, self.table,
                                                  verify=self.verify)
        if self.version_id == base:
            self._staged = Staged(target, vid, manifest, _Swap(self.views, fresh), time.monotonic() - t0)
            self._aim, self.error = None, None

    @property
    def staged(self) -> Staged | None:
        return self._staged

    @property
    def staged_version(self) -> int | None:
        return None if self._staged is None else self._staged.version

    def retry_now(self) -> None:
        self.start()

    def catch_up_to(self, version: int) -> None:
        """Stage ``version`` (several ahead) next: the rank's part rebuilt from the newest keyframe."""
        if self.version is not None and version > self.version + 1:
            self._aim = version
            if self._staged is not None and self._staged.version != version:
                self._staged = None
            self.start()

    def drop_staged(self) -> None:
        self._staged = None

    def forget(self) -> None:
        self._source.forget()

    async def pause(self) -> None:
        await self._stop()

    async def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        await self._stop()

    # --- the commit: every rank or none ----------------------------------------------------------
    def commit(self) -> Committed:
        """Write the staged version here; if any rank's commit is refused every rank that wrote rolls back."""
        staged = self._staged
        if staged is None:
            raise StagingError("nothing staged")
        t0 = time.perf_counter()
        err: BaseException | None = None
        try:
            staged.update.commit()
        except Exception as e:  # the other ranks hear of it before it is raised (none waits forever)
            err = e
        pause = time.perf_counter() - t0
        oks = self.ranks.gather(err is None)
        self._staged = None
        if not all(oks):
            if err is None:
                staged.update.rollback()
            self.start()
            raise _refusal(self.ranks, err, oks, "the commit")
        self._last = (staged, pause, (self.version, self.version_id))
        self.version, self.version_id = staged.version, staged.version_id
        return Committed(staged.version, staged.version_id, pause, staged.update.changed_elements)

    async def confirm(self) -> Committed | None:
        """Check a recorded state digest with every rank; a mismatch rolls every rank back."""
        last, self._last = self._last, None
        if last is None:
            return None
        staged, pause, previous = last
        recorded = staged.manifest.state_digest
        digest_s = None
        if self.verify and recorded is not None:
            t0 = time.perf_counter()
            got = await asyncio.to_thread(self.ranks.engine_digest, self.table, self.placements, self.views)
            digest_s = time.perf_counter() - t0
            if got != recorded.value:
                await self._stop()
                staged.update.rollback()
                self.version, self.version_id = previous
                self.start()
                shown = short_pair(got, recorded.value)
                raise IntegrityError(f"{staged.manifest.key}: the ranks' served weights hash to {shown[0]}, the "
                                     f"manifest records {shown[1]}; version {staged.version} rolled back on every rank")
        self.start()
        return Committed(staged.version, staged.version_id, pause, staged.update.changed_elements, digest_s)
