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

An actor that is new (:meth:`Subscriber.bootstrap`) or more than ``catch_up_after`` versions behind
catches up from the newest keyframe at or before HEAD, applying the deltas after it on a copy that
the next commit swaps in. (``deltarl.pipeline.replay.squash`` builds one delta between two versions
but needs the origin store; a relay-only actor uses the keyframe path.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.prefetch import VersionStaging
from deltarl.codec.heap import trim
from deltarl.codec.jit_warmup import warm_codec_quietly
from deltarl.errors import DeltaRLError, IntegrityError, ObjectNotFound, RunError, StagingError, TransferError
from deltarl.pipeline.layout import RunLayout, key_epoch
from deltarl.pipeline.manifest import HeadRecord, Manifest, RunInfo, version_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitInfo:
    """What one commit did, for logs and metrics."""

    version: int
    version_id: str
    #: Seconds the state was being written: the actor's whole pause (the digest check comes after).
    pause_s: float
    changed_elements: int
    #: True/False once the state digest the manifest records has been checked; None while the check
    #: is pending (``digest_pending``) and when there is none to check.
    state_digest_ok: bool | None
    #: Seconds from the manifest becoming visible to the version being staged.
    stage_s: float
    #: Wall-clock time (``time.time()``, comparable with a manifest's ``created_at``) at which the
    #: version was staged, ready to commit.
    staged_at: float
    #: Whether this commit replaced the whole state (keyframe catch-up) instead of a delta.
    full: bool = False
    #: Whether the state digest is being checked in the background (see :meth:`Subscriber.confirm`).
    digest_pending: bool = False
    #: Seconds the digest check took, off the pause (None: none has finished).
    digest_s: float | None = None


class _FullUpdate:
    """A catch-up: replace every tensor's contents (keyframe + deltas), undoable, in two copies.

    Commit *swaps* the contents of the live tensors and the new ones (chunk by chunk, through a
    small buffer), so afterwards the new tensors hold the old values for a rollback: the live
    state and the new state, never a third clone.
    """

    SWAP_CHUNK = 4 << 20  # elements per swap step

    def __init__(self, state: MutableMapping[str, Any], new: dict[str, Any]) -> None:
        self._state = state
        self._new = new
        self._swapped = False
        self._adopted = False
        self.changed_elements = sum(int(t.numel()) for t in new.values())

    def _swap(self) -> None:
        for name, t in self._new.items():  # same dtype and shape: copy_ is then bit-exact
            live, new = self._state[name].view(-1), t.view(-1)
            for a in range(0, live.numel(), self.SWAP_CHUNK):
                tmp = live[a : a + self.SWAP_CHUNK].clone()
                live[a : a + self.SWAP_CHUNK].copy_(new[a : a + self.SWAP_CHUNK])
                new[a : a + self.SWAP_CHUNK].copy_(tmp)

    def commit(self) -> None:
        if not self._state:
            self._state.update(self._new)
            self._adopted = True
            return
        if sorted(self._state) != sorted(self._new):
            raise StagingError("catch-up state has other tensors than the live state")
        for name, t in self._new.items():
            live = self._state[name]
            if live.dtype != t.dtype or live.shape != t.shape:
                raise StagingError(f"catch-up tensor {name!r} is {t.dtype}{list(t.shape)}, live {live.dtype}{list(live.shape)}")
            if not live.is_contiguous() or not t.is_contiguous():
                raise StagingError(f"catch-up tensor {name!r} is not contiguous")
        self._swap()
        self._swapped = True

    def rollback(self) -> None:
        if self._adopted:
            for name in self._new:
                self._state.pop(name, None)
            return
        if self._swapped:
            self._swap()
            self._swapped = False


#: Keyframe parts a bootstrap fetches at once: while one part's last ranges arrive, a relay is
#: already pulling the next one from its upstream.
KEYFRAME_PARTS_IN_FLIGHT = 2


class _InPlace:
    """A first bootstrap that loaded straight into the live tensors: nothing left to write, and
    nothing to roll back to (no version was held, the tensors held no run's weights)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.changed_elements = sum(int(t.numel()) for t in state.values())

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass


@dataclass
class _Staged:
    version: int
    version_id: str
    manifest: Manifest
    update: Any  # StagedUpdate or _FullUpdate
    stage_s: float
    full: bool
    staged_at: float = field(default_factory=time.time)


@dataclass
class _DigestCheck:
    """A committed version whose state digest is being computed in a background thread."""

    staged: _Staged
    previous: tuple[int | None, str | None]  # what the subscriber held before the commit
    info: CommitInfo
    future: Future[tuple[str, float]]  # (digest, seconds)

    def matches(self) -> bool:
        """Whether the digest equals the manifest's (waits for it; False if computing it failed)."""
        recorded = self.staged.manifest.state_digest
        return self.future.exception() is None and recorded is not None and self.future.result()[0] == recorded.value


def _timed_digest(state: Mapping[str, Any], algo: str) -> tuple[str, float]:
    from deltarl.codec import state_digest

    t0 = time.monotonic()
    return state_digest(state, algo), time.monotonic() - t0


class Subscriber:
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
        #: Every commit, its entry replaced once its digest check has finished.
        self.commits: list[CommitInfo] = []
        self._check: _DigestCheck | None = None
        self._digests: ThreadPoolExecutor | None = None
        self._staged: _Staged | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._warming: asyncio.Future[None] | None = None  # the codec warm-up (once)
        self._error: BaseException | None = None
        self._manifests: dict[int, tuple[Manifest, str]] = {}
        self._info: RunInfo | None = None
        self.speculate = speculate
        self._spec: tuple[int, VersionStaging, asyncio.Task[None] | None] | None = None
        #: Segments staged before their manifest was visible (verified against it afterwards).
        self.speculated_segments = 0
        #: Called (on the event loop) each time a version becomes staged: ready to commit.
        self.on_staged = on_staged

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

    async def _catch_up_state(self, target: int, into: dict[str, Any] | None = None) -> tuple[dict[str, Any], Manifest, str]:
        """The state at ``target``: the newest keyframe at or before it, then the deltas after; in
        fresh tensors, or in ``into``'s (the live state, written in place)."""
        from deltarl.codec import stage_delta

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

        async def segments_of(manifest: Manifest) -> list[bytes]:
            return [data async for _, data in self.fetcher.fetch_objects(list(manifest.segments))]  # any order

        # One version's segments are fetched ahead: the first delta's while the keyframe streams in
        # (and numba loads the decoder meanwhile), each next one's while the one before is decoded.
        ahead: dict[int, asyncio.Task[list[bytes]]] = {}
        if len(chain) > 1:
            await self._warm_codec()
            ahead[chain[1][0].version] = asyncio.ensure_future(segments_of(chain[1][0]))
        try:
            state = await self._load_base(chain, into)  # (may extend the chain down to an older keyframe)
            for pos in range(1, len(chain)):
                manifest = chain[pos][0]
                fetching = ahead.pop(manifest.version, None) or asyncio.ensure_future(segments_of(manifest))
                if pos + 1 < len(chain) and chain[pos + 1][0].version not in ahead:
                    ahead[chain[pos + 1][0].version] = asyncio.ensure_future(segments_of(chain[pos + 1][0]))
                segments = await fetching
                await asyncio.shield(await self._warm_codec())
                parent_id = self._manifests[manifest.version - 1][1]
                staged = await asyncio.to_thread(stage_delta, state, segments, base=parent_id)
                staged.commit()
        finally:
            for task in ahead.values():
                task.cancel()
            await asyncio.gather(*ahead.values(), return_exceptions=True)
        last, vid = chain[-1]
        # a keyframe alone was checked piece by piece as it landed: no second pass over it
        if last.state_digest is not None and len(chain) > 1:
            await self._check_digest(state, last)
        return state, last, vid

    async def _warm_codec(self) -> asyncio.Future[None]:
        """The codec warm-up for the run's dtypes, started on a thread the first time: by a catch-up
        with deltas to apply, else when background staging starts (the next version is a delta)."""
        if self._warming is None:
            dtypes = [t.dtype for t in (await self._run_info()).tensors]
            self._warming = asyncio.ensure_future(asyncio.to_thread(warm_codec_quietly, dtypes))
        return self._warming

    async def _run_info(self) -> RunInfo:
        if self._info is None:
            key = self.layout.run_json
            info = RunInfo.from_bytes(await self.fetcher.fetch_key(key), where=key)
            if info.run != self.layout.run:
                raise RunError(f"{key}: run.json names run {info.run!r}, not {self.layout.run!r}")
            self._info = info
        return self._info

    async def _load_keyframe(self, manifest: Manifest, into: dict[str, Any] | None = None) -> dict[str, Any]:
        """The full state of a keyframe version, read straight into fresh tensors (or ``into``'s):
        each part's header first (checked against the ranges the manifest records), then its bytes
        by ranges into the tensors they fill, checked by the part's pieces. No object-sized buffer,
        no second copy."""
        from deltarl.pipeline.keyframe import empty_state, part_views

        assert manifest.keyframe is not None
        info = await self._run_info()
        manifest.keyframe.check_covers(info.tensors, manifest.key)
        specs = {t.name: t for t in info.tensors}
        state = into if into is not None else await asyncio.to_thread(empty_state, info.tensors)
        ahead = asyncio.Semaphore(KEYFRAME_PARTS_IN_FLIGHT)

        async def load_part(part: Any) -> None:
            async with ahead:
                head = await self.fetcher.fetch_range(part.key, 0, min(part.size, 64 << 10))
                views = part_views(part, head, specs, state, named_by=manifest.key)
                if views is None:  # a header longer than 64 KiB: fetch it whole
                    head = await self.fetcher.fetch_range(part.key, 0, 8 + int.from_bytes(head[:8], "little"))
                    views = part_views(part, head, specs, state, named_by=manifest.key)
                    assert views is not None
                await self.fetcher.fetch_into(part, views)

        tasks = [asyncio.ensure_future(load_part(part)) for part in manifest.keyframe.parts]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return state

    async def _load_base(self, chain: list[tuple[Manifest, str]], into: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state of ``chain[0]``'s keyframe. One that no source delivers intact (or that does not
        load) is skipped with a warning naming it: the chain is extended down to an older keyframe,
        whose deltas lead back up (every version stores its delta)."""
        while True:
            kf = chain[0][0]
            assert kf.keyframe is not None
            try:
                return await self._load_keyframe(kf, into)
            except (TransferError, ValueError, RuntimeError) as err:  # FormatError, safetensors errors
                older: list[tuple[Manifest, str]] = []
                for v in range(kf.version - 1, -1, -1):
                    manifest, vid = await self.manifest(v)
                    parent = older[-1][0].parent if older else kf.parent
                    if parent != vid:
                        raise RunError(f"{manifest.key}: broken parent chain at version {v}") from err
                    older.append((manifest, vid))
                    if manifest.keyframe is not None:
                        break
                if not older or older[-1][0].keyframe is None:
                    raise
                log.warning("keyframe of version %d (%s) is unusable (%s); falling back to keyframe %d plus deltas",
                            kf.version, ", ".join(p.key for p in kf.keyframe.parts), err, older[-1][0].version)
                chain[:0] = reversed(older)

    async def bootstrap(self) -> CommitInfo:
        """Load the newest keyframe and apply deltas up to HEAD, now (for a new actor)."""
        head = await self.head()
        if head is None:
            raise ObjectNotFound(f"{self.layout.head}: run {self.layout.run!r} has no HEAD yet")
        t0 = time.monotonic()
        into = await self._writable_in_place()
        state, manifest, vid = await self._catch_up_state(head.version, into)
        stage_s = time.monotonic() - t0
        update = _InPlace(state) if into is not None else _FullUpdate(self.state, state)
        self._staged = _Staged(manifest.version, vid, manifest, update, stage_s, full=True)
        info = self.commit()
        trim()  # catch-up buffers (segments, staged deltas) are gone: give their memory back to the OS
        return info

    async def _writable_in_place(self) -> dict[str, Any] | None:
        """The live state, if a first bootstrap can load straight into it: no version is held (its
        tensors hold no run's weights, so there is nothing to keep for a rollback), and it has
        exactly run.json's tensors as contiguous CPU tensors of their dtypes and shapes (an actor's
        model, built before it joins). Then a bootstrap holds one copy of the model, not two."""
        import torch

        if self.version is not None or not self.state:
            return None
        info = await self._run_info()
        if set(self.state) != {t.name for t in info.tensors}:
            return None
        for spec in info.tensors:
            t = self.state[spec.name]
            if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                    and str(t.dtype) == f"torch.{spec.dtype}" and tuple(t.shape) == tuple(spec.shape)):
                return None
        return self.state if isinstance(self.state, dict) else dict(self.state)

    # --- the background loop ------------------------------------------------------------------------

    def start(self) -> None:
        """Start prefetching and staging in the background (needs a held version)."""
        if self.version is None or self.version_id is None:
            raise StagingError("subscriber holds no version: call bootstrap() first")
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        await self._stop_background()
        if self._warming is not None:  # an interpreter exiting mid-compile can crash: let it finish
            await asyncio.gather(self._warming, return_exceptions=True)
        if self._digests is not None:
            await asyncio.to_thread(self._digests.shutdown)
            self._digests = None

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

    def _predicted_segment_keys(self, version: int) -> Callable[[int], str]:
        """Segment keys of ``version`` as its writer will most likely name them: the epoch of the last
        manifest's objects (a new writer's epoch only makes speculation miss, never misapply)."""
        last = self._manifests.get(version - 1)
        refs = [] if last is None else [*last[0].segments, *(last[0].keyframe.parts if last[0].keyframe else ())]
        epoch = next((e for ref in refs if (e := key_epoch(ref.key)) is not None), None)
        return lambda i: self.layout.segment(version, i, epoch=epoch or 1)

    async def _stage_next(self) -> None:
        assert self.version is not None
        assert self.version_id is not None
        head = await self.head()
        if head is not None and head.version - self.version > self.catch_up_after:
            await self._drop_speculation()
            t0 = time.monotonic()
            state, manifest, vid = await self._catch_up_state(head.version)
            self._set_staged(_Staged(manifest.version, vid, manifest, _FullUpdate(self.state, state), time.monotonic() - t0, True))
            return
        target = self.version + 1
        if self._spec is None or self._spec[0] != target:
            await self._drop_speculation()
            staging = VersionStaging(self.state, self.version_id)
            task = None
            if self.speculate:  # fetch + decode segments as they are uploaded, before the manifest exists
                window = max(1, self.fetcher.streams)
                key_of = self._predicted_segment_keys(target)
                task = asyncio.ensure_future(staging.speculate(self.fetcher, key_of, window=window, wait_s=self.poll_wait_s))
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
        self.speculated_segments += len(staging.speculative)
        staged = _Staged(target, vid, manifest, update, time.monotonic() - visible, False)
        log.info("staged version %d (%d changed elements, %d of %d segments before its manifest) %.3fs after the manifest",
                 target, update.changed_elements, len(staging.speculative), len(manifest.segments), staged.stage_s)  # fmt: skip
        self._set_staged(staged)

    def _set_staged(self, staged: _Staged) -> None:
        self._staged = staged
        if self.on_staged is not None:
            self.on_staged()

    # --- the safe point -----------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether a version is staged and can be committed now."""
        return self._staged is not None

    @property
    def staged_version(self) -> int | None:
        return None if self._staged is None else self._staged.version

    @property
    def staged_at(self) -> float | None:
        """Wall-clock time (``time.time()``) at which the staged version became ready, or None."""
        return None if self._staged is None else self._staged.staged_at

    @property
    def digest_pending(self) -> bool:
        """Whether the last commit's state digest check has not been confirmed yet."""
        return self._check is not None

    @property
    def error(self) -> BaseException | None:
        """The last error of the background loop (it keeps retrying)."""
        return self._error

    def commit(self) -> CommitInfo:
        """Write the staged version into the state (call between batches). A failure part-way is
        rolled back before this raises.

        Where a delta's manifest records a state digest (and ``verify_digest``), the commit does not
        wait for it: the digest is computed in a background thread and checked by :meth:`confirm` (a
        catch-up state was checked when it was built). The
        pending check of the previous commit is settled first (waiting for it); if it mismatches,
        that version is rolled back, the version staged on top of it dropped, and this raises
        ``IntegrityError``.
        """
        staged = self._staged
        if staged is None:
            raise StagingError("nothing staged")
        self._settle()
        if not staged.full and staged.manifest.parent != self.version_id:
            self._staged = None
            self._wake.set()
            raise StagingError(f"{staged.manifest.key}: staged on {staged.manifest.parent}, we hold {self.version_id}")
        t0 = time.monotonic()
        try:
            self._write(staged)  # inside the try: a failure part-way is rolled back too
        except BaseException:
            self._undo(staged)
            self._staged = None
            self._wake.set()
            raise
        previous = (self.version, self.version_id)
        self.version, self.version_id = staged.version, staged.version_id
        self._staged = None
        self._error = None
        recorded = staged.manifest.state_digest is not None
        # a catch-up state was checked against the digest when it was built, and is copied bit for bit
        check = self.verify_digest and recorded and not staged.full
        info = CommitInfo(staged.version, staged.version_id, time.monotonic() - t0, staged.update.changed_elements,
                          True if staged.full and recorded else None, staged.stage_s, staged.staged_at, staged.full,
                          digest_pending=check)
        if check:
            if self._digests is None:
                self._digests = ThreadPoolExecutor(1, thread_name_prefix="deltarl-digest")
            self._check = _DigestCheck(staged, previous, info, self._digests.submit(_timed_digest, self.state, staged.manifest.state_digest.algo))  # type: ignore[union-attr]  # recorded
        self.commits.append(info)
        self._wake.set()
        return info

    async def confirm(self) -> CommitInfo | None:
        """Wait for the last commit's state digest check; its final :class:`CommitInfo`, or None if
        no check is pending.

        If the digest differs from the manifest's (or cannot be computed) the version is rolled
        back - every value the commit wrote is restored and the subscriber holds the previous
        version again - and this raises ``IntegrityError``. Call it at the safe point, before reporting anything generated since the
        commit: a rollback writes the state.
        """
        check = self._check
        if check is None:
            return None
        await asyncio.wait([asyncio.wrap_future(check.future)])
        if check is not self._check:  # settled by a commit meanwhile
            return None
        if check.matches() or self._task is None:
            return self._settle()
        await self._stop_background()  # it may be staging the next version against the state we roll back
        try:
            return self._settle()
        finally:
            self._task = asyncio.ensure_future(self._run())

    def _settle(self) -> CommitInfo | None:
        """Finish the pending digest check (waiting for it); a mismatch rolls its version back."""
        check, self._check = self._check, None
        if check is None:
            return None
        if check.matches():
            return self._record(check.info, state_digest_ok=True, digest_s=check.future.result()[1])
        self._undo(check.staged)
        self.version, self.version_id = check.previous
        self._staged = None  # staged on top of the version just rolled back
        self._wake.set()
        self._record(check.info, state_digest_ok=False)
        err = IntegrityError(f"{check.staged.manifest.key}: state digest differs after commit; "
                             f"rolled back to version {self.version}")
        self._error = err
        raise err from check.future.exception()

    def _record(self, info: CommitInfo, **changes: Any) -> CommitInfo:
        final = dataclasses.replace(info, digest_pending=False, **changes)
        for i in range(len(self.commits) - 1, -1, -1):
            if self.commits[i] is info:
                self.commits[i] = final
                break
        return final

    def _undo(self, staged: _Staged) -> None:
        try:
            staged.update.rollback()
            if self.backend is not None:
                self.backend.load_state(self.state)  # the served weights follow the restored shadow
        except StagingError as err:  # the commit's own check refused before writing anything
            log.error("rollback of version %d: %s", staged.version, err)

    def _write(self, staged: _Staged) -> None:
        if self.backend is None:
            staged.update.commit()
        elif staged.full:
            staged.update.commit()  # the shadow (keeping the old values for a rollback), then the workers
            self.backend.load_state(self.state)
        else:
            self.backend.commit(staged.update)  # workers and shadow, rolled back by the backend on failure

    async def _check_digest(self, state: dict[str, Any], manifest: Manifest) -> None:
        from deltarl.codec import state_digest

        recorded = manifest.state_digest
        assert recorded is not None
        got = await asyncio.to_thread(state_digest, state, recorded.algo)
        if got != recorded.value:
            raise IntegrityError(f"{manifest.key}: caught-up state digest {got[:16]}… differs from the manifest")
