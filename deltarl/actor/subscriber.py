"""The actor's subscriber: learn of new versions, prefetch and stage them while the actor generates,
commit in place at the safe point between batches.

A background task long-polls the next version's manifest through the fetcher (relays hold the
request until it lands; the origin is polled) and, meanwhile, its segments by key as the trainer
uploads them (``speculate``, see :mod:`deltarl.actor.staging`), decoding each into a
:class:`~deltarl.pipeline.Stager` as it arrives. Once the manifest is visible it checks that it
names the version we hold as its parent and every speculative segment's sha256, fetches what is
still missing on several streams, and keeps the result as the one staged version. The actor calls :meth:`Subscriber.ready` and
:meth:`Subscriber.commit` between batches; nothing is written into the state anywhere else, so a
rollout is never generated from a half-applied model.

An actor that is new (:meth:`Subscriber.bootstrap`) or more than ``catch_up_after`` versions behind
catches up from the newest keyframe at or before HEAD, applying the deltas after it on a copy that
the next commit swaps in. (``deltarl.storage.replay.squash`` builds one delta between two versions
but needs the origin store; a relay-only actor uses the keyframe path.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.staging import VersionStaging
from deltarl.errors import IntegrityError, ObjectNotFound, RunError, StagingError, TransferError
from deltarl.storage.layout import RunLayout
from deltarl.storage.manifest import HeadRecord, Manifest, version_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitInfo:
    """What one commit did, for logs and metrics."""

    version: int
    version_id: str
    #: Seconds the state was being written (the actor's pause), digest check included.
    pause_s: float
    changed_elements: int
    #: True/False when the manifest records a state digest and it was checked; None otherwise.
    state_digest_ok: bool | None
    #: Seconds from the manifest becoming visible to the version being staged.
    stage_s: float
    #: Whether this commit replaced the whole state (keyframe catch-up) instead of a delta.
    full: bool = False
    #: Seconds of the in-place write alone (``pause_s`` minus the digest check).
    write_s: float = 0.0


class _FullUpdate:
    """A catch-up: replace every tensor's contents (keyframe + deltas), undoable."""

    def __init__(self, state: MutableMapping[str, Any], new: dict[str, Any]) -> None:
        self._state = state
        self._new = new
        self._old: dict[str, Any] | None = None
        self.changed_elements = sum(int(t.numel()) for t in new.values())

    def commit(self) -> None:
        if not self._state:
            self._state.update(self._new)
            return
        if sorted(self._state) != sorted(self._new):
            raise StagingError("catch-up state has other tensors than the live state")
        self._old = {n: t.clone() for n, t in self._state.items()}
        for name, t in self._new.items():
            self._state[name].copy_(t)

    def rollback(self) -> None:
        if self._old is None:
            for name in self._new:
                self._state.pop(name, None)
            return
        for name, t in self._old.items():
            self._state[name].copy_(t)


@dataclass
class _Staged:
    version: int
    version_id: str
    manifest: Manifest
    update: Any  # StagedUpdate or _FullUpdate
    stage_s: float
    full: bool


class Subscriber:
    """Keeps ``state`` following a run's versions, one verified commit at a time."""

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
    ) -> None:
        self.state = state
        #: A generation backend whose served weights are not ``state`` itself (vLLM: ``state`` is its
        #: host shadow): deltas are committed through ``backend.commit``, full states pushed with
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
        self.commits: list[CommitInfo] = []
        self._staged: _Staged | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._manifests: dict[int, tuple[Manifest, str]] = {}
        self.speculate = speculate
        self._spec: tuple[int, VersionStaging, asyncio.Task[None] | None] | None = None
        #: Segments staged before their manifest was visible (verified against it afterwards).
        self.speculated_segments = 0

    # --- reads through the fetcher ----------------------------------------------------------------

    async def head(self) -> HeadRecord | None:
        try:
            got = await self.fetcher.get_mutable(self.layout.head)
        except ObjectNotFound:
            return None
        assert got is not None
        return HeadRecord.from_bytes(got[0], where=self.layout.head)

    async def manifest(self, version: int, *, wait_s: float = 0.0) -> tuple[Manifest, str]:
        """A version's manifest and id (cached: manifests are immutable)."""
        hit = self._manifests.get(version)
        if hit is not None:
            return hit
        key = self.layout.manifest(version)
        data = await self.fetcher.fetch_key(key, wait_s=wait_s)
        manifest = Manifest.from_bytes(data, where=key)
        if manifest.run != self.layout.run or manifest.version != version:
            raise RunError(f"{key}: manifest is for run {manifest.run!r} version {manifest.version}")
        self._manifests[version] = (manifest, version_id(data))
        return self._manifests[version]

    # --- bootstrap and catch-up -------------------------------------------------------------------

    async def _catch_up_state(self, target: int) -> tuple[dict[str, Any], Manifest, str]:
        """A fresh state at ``target``: the newest keyframe at or before it, then the deltas after."""
        from safetensors.torch import load

        from deltarl.pipeline import stage_delta

        chain: list[tuple[Manifest, str]] = []
        v = target
        while True:
            manifest, vid = await self.manifest(v)
            if chain and chain[-1][0].parent != vid:
                raise RunError(f"{chain[-1][0].key}: broken parent chain at version {v}")
            chain.append((manifest, vid))
            if manifest.keyframe is not None:
                break
            if v == 0:
                raise RunError(f"{self.layout.run}: no keyframe at or before version {target}")
            v -= 1
        chain.reverse()
        kf = chain[0][0]
        assert kf.keyframe is not None
        state: dict[str, Any] = await asyncio.to_thread(load, await self.fetcher.fetch(kf.keyframe))
        for manifest, _ in chain[1:]:
            parent_id = self._manifests[manifest.version - 1][1]
            segments = [data async for _, data in self.fetcher.fetch_objects(list(manifest.segments))]  # any order
            staged = await asyncio.to_thread(stage_delta, state, segments, base=parent_id)
            staged.commit()
        last, vid = chain[-1]
        if last.state_digest is not None:
            await self._check_digest(state, last)
        return state, last, vid

    async def bootstrap(self) -> CommitInfo:
        """Load the newest keyframe and apply deltas up to HEAD, now (for a new actor)."""
        head = await self.head()
        if head is None:
            raise ObjectNotFound(f"{self.layout.head}: run {self.layout.run!r} has no HEAD yet")
        t0 = time.monotonic()
        state, manifest, vid = await self._catch_up_state(head.version)
        stage_s = time.monotonic() - t0
        self._staged = _Staged(manifest.version, vid, manifest, _FullUpdate(self.state, state), stage_s, full=True)
        return self.commit()

    # --- the background loop ------------------------------------------------------------------------

    def start(self) -> None:
        """Start prefetching and staging in the background (needs a held version)."""
        if self.version is None or self.version_id is None:
            raise StagingError("subscriber holds no version: call bootstrap() first")
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
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
        while True:
            if self._staged is not None:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._stage_next()
            except asyncio.CancelledError:
                raise
            except (ObjectNotFound, TransferError) as err:
                log.debug("nothing new yet (%s)", err)
                await asyncio.sleep(self.poll_interval_s)
            except Exception as err:  # a bad version: keep the error for the actor, retry later
                log.error("cannot stage version %s: %s", (self.version or 0) + 1, err)
                self._error = err
                await asyncio.sleep(max(1.0, self.poll_interval_s))

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
        if head is not None and head.version - self.version > self.catch_up_after:
            await self._drop_speculation()
            t0 = time.monotonic()
            state, manifest, vid = await self._catch_up_state(head.version)
            self._staged = _Staged(manifest.version, vid, manifest, _FullUpdate(self.state, state), time.monotonic() - t0, True)
            return
        target = self.version + 1
        if self._spec is None or self._spec[0] != target:
            await self._drop_speculation()
            staging = VersionStaging(self.state, self.version_id)
            task = None
            if self.speculate:  # fetch + decode segments as they are uploaded, before the manifest exists
                window = max(1, self.fetcher.streams)
                task = asyncio.ensure_future(staging.speculate(self.fetcher, self.layout, target, window=window, wait_s=self.poll_wait_s))
            self._spec = (target, staging, task)
        manifest, vid = await self.manifest(target, wait_s=self.poll_wait_s)  # ObjectNotFound: keep speculating
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
                raise RunError(f"{manifest.key}: parent {manifest.parent} is not the version we hold ({self.version_id})")
            update = await staging.complete(self.fetcher, manifest)
        finally:
            staging.close()
        self._staged = _Staged(target, vid, manifest, update, time.monotonic() - visible, False)
        self.speculated_segments += len(staging.speculative)
        log.info("staged version %d (%d changed elements, %d of %d segments before its manifest) %.3fs after the manifest",
                 target, update.changed_elements, len(staging.speculative), len(manifest.segments), self._staged.stage_s)  # fmt: skip

    # --- the safe point -----------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether a version is staged and can be committed now."""
        return self._staged is not None

    @property
    def staged_version(self) -> int | None:
        return None if self._staged is None else self._staged.version

    @property
    def error(self) -> BaseException | None:
        """The last error of the background loop (it keeps retrying)."""
        return self._error

    def commit(self) -> CommitInfo:
        """Write the staged version into the state (call between batches). Rolls back on failure."""
        staged = self._staged
        if staged is None:
            raise StagingError("nothing staged")
        t0 = time.monotonic()
        digest_ok: bool | None = None
        write_s = 0.0
        try:
            self._write(staged)  # inside the try: a failure part-way is rolled back too
            write_s = time.monotonic() - t0
            if self.verify_digest and staged.manifest.state_digest is not None:
                from deltarl.pipeline import state_digest

                digest_ok = state_digest(self.state) == staged.manifest.state_digest
                if not digest_ok:
                    raise IntegrityError(f"{staged.manifest.key}: state digest differs after commit")
        except BaseException:
            try:
                staged.update.rollback()
                if self.backend is not None:
                    self.backend.load_state(self.state)  # the served weights follow the restored shadow
            except StagingError as err:  # the commit's own check refused before writing anything
                log.error("rollback of version %d: %s", staged.version, err)
            self._staged = None
            self._wake.set()
            raise
        pause = time.monotonic() - t0
        self.version, self.version_id = staged.version, staged.version_id
        self._staged = None
        self._error = None
        self._wake.set()
        info = CommitInfo(staged.version, staged.version_id, pause, staged.update.changed_elements, digest_ok, staged.stage_s,
                          staged.full, write_s)
        self.commits.append(info)
        return info

    def _write(self, staged: _Staged) -> None:
        if self.backend is None:
            staged.update.commit()
        elif staged.full:
            staged.update.commit()  # the shadow (keeping the old values for a rollback), then the workers
            self.backend.load_state(self.state)
        else:
            self.backend.commit(staged.update)  # workers and shadow, rolled back by the backend on failure

    async def _check_digest(self, state: dict[str, Any], manifest: Manifest) -> None:
        from deltarl.pipeline import state_digest

        got = await asyncio.to_thread(state_digest, state)
        if got != manifest.state_digest:
            raise IntegrityError(f"{manifest.key}: caught-up state digest {got[:16]}… differs from the manifest")
