"""``InPlaceUpdater``: what every engine adapter drives to keep an engine's live parameters at a
run's version, in place (vLLM's ``deltarl`` weight-transfer engine, an SGLang or TRL-server
adapter: docs/ARCHITECTURE.md, "Adding an engine").

It runs the one update mechanism, the actor's :class:`~deltarl.actor.subscriber.Subscriber`, on a
name → tensor-view mapping the adapter gives (its live parameters), on an event loop of its own
(a thread), reading the run through the actor's :class:`~deltarl.actor.fetcher.Fetcher` (relays,
then the origin store; every piece checked against its manifest), and answers from the engine's
own thread, synchronously:

* :meth:`InPlaceUpdater.attach`: the run's version (default HEAD) rebuilt by the one catch-up
  path in fresh tensors and swapped into the views only once complete and checked, so a failed
  attach writes nothing and the previous run goes on serving; the views are asked of the adapter
  (``views_for(table)``, e.g. the ``load_weights`` probe) only when the tensor table changes;
* :meth:`InPlaceUpdater.take`: the version an update asks for, *as staged in the background*:
  never a fetch or a decode in the call (an engine that does not generate while the call runs
  would stall): ``NotStaged`` / ``NotPublished`` at once and the caller asks again; ``"latest"``
  far behind is staged in one go (``Subscriber.catch_up_to``), and what is taken carries the id
  HEAD names (a run replaced under its name is staged again from its keyframe);
* :meth:`InPlaceUpdater.commit` at the engine's safe point: in place, then a recorded state
  digest confirmed (a mismatch is rolled back and raises).

An engine whose workers each hold part of the model (tensor / expert parallel) sets ``ranks``
(:class:`~deltarl.updater.ranks.Ranks`) and ``placements`` (the probe's, naming each view's region):
a :class:`~deltarl.updater.sharded.ShardedUpdater` then stands in for the subscriber, and every
take and commit is agreed by all ranks. ``after_write(changes)`` (``changes`` None: everything)
lets the adapter re-derive a copy its kernel reads (MoE experts repacked on vLLM's CPU build).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from deltarl.errors import BaseMismatch, ConfigError, NotPublished, NotStaged, ObjectNotFound, RunError
from deltarl.updater.ranks import Ranks

log = logging.getLogger(__name__)
R = TypeVar("R")

#: how long one long-poll of the background staging waits for the next manifest
POLL_WAIT_S = 5.0
#: the longest :meth:`InPlaceUpdater.take` holds its caller (reading HEAD or a manifest), never a fetch
HOLD_S = 2.0

#: ``views_for(table)``: the engine's live tensors by checkpoint name for a run's tensor table
ViewsFor = Callable[[Sequence[Any]], dict[str, Any]]


@dataclass
class Served:
    """What the engine serves, and what the last update cost."""

    version: int
    version_id: str
    #: seconds from the manifest being visible to the version staged (fetch and decode overlap)
    fetch_s: float = 0.0
    #: 0: segments are decoded as they arrive, inside ``fetch_s``
    decode_s: float = 0.0
    pause_s: float = 0.0
    digest_s: float = 0.0
    changed: int = 0
    #: whether the version was staged, or on its way, in the background before the update asked for it
    prefetched: bool = False


def tag(err: BaseException) -> BaseException:
    """``err`` with its kind in front of its message, ``[deltarl:ClassName] …`` (once): what a
    client reads back through an engine's RPC or HTTP error (docs/integrations.md)."""
    text = str(err)
    if not text.startswith("[deltarl:"):
        err.args = (f"[deltarl:{type(err).__name__}] {text}",)
    return err


class InPlaceUpdater:
    """Keeps ``views`` (an engine's live tensors by checkpoint name) at a run's versions."""

    def __init__(self, name: str = "deltarl-updater") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sub: Any = None  # the Subscriber keeping self.views at the run's versions
        self._closing: list[Any] = []  # the fetcher and origin store it reads through
        self._table: list[Any] | None = None  # the tensor table self.views were made for
        self.views: dict[str, Any] = {}
        self.served: Served | None = None
        self._take: tuple[Any, bool] | None = None  # (Staged, prefetched)
        # (version, the subscriber's attempt when first asked, whether its background staging was running then)
        self._asked: tuple[int, int, bool] | None = None
        self.ranks: Any = Ranks()  # the engine's workers (one: nothing to agree on)
        self.placements: list[Any] = []  # set by a sharded engine's views_for: each view's region
        self.after_write: Callable[[dict[str, Any] | None], Any] | None = None

    @property
    def fetcher(self) -> Any:
        """The fetcher the served run is read through (its ``stats``: bytes by source), or None."""
        return self._closing[0] if self._closing else None

    # --- the event loop the fetcher and the subscriber run on ---------------------------------------
    def _call(self, coro: Coroutine[Any, Any, R], timeout: float | None = None) -> R:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name=self._name, daemon=True)
            self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the event loop (the subscriber's events belong to it), waited for."""

        async def run() -> None:
            fn(*args)

        self._call(run())

    @staticmethod
    async def _close_quietly(*things: Any) -> None:
        for thing in things:
            if thing is None:
                continue
            try:
                result = thing.close()
                if asyncio.iscoroutine(result):
                    await result
            except Exception as err:  # closing what a failed attach opened must not hide its error
                log.debug("deltarl: closing %r: %s", thing, err)

    # --- attach -------------------------------------------------------------------------------------
    def attach(self, views_for: ViewsFor, store: str, run: str, *, relays: Sequence[str] = (), version: int | None = None,
               streams: int = 4, token: str | None = None, verify: bool = True, prefetch: bool = True,
               store_options: dict[str, Any] | None = None) -> Served:
        """Serve ``run`` at ``version`` (default HEAD) from ``store`` (after ``relays``); see the module doc."""
        from deltarl.actor.fetcher import Fetcher
        from deltarl.actor.source import FetcherSource
        from deltarl.codec.heap import trim
        from deltarl.storage.open import open_store

        origin = open_store(store, must_exist=True, **(store_options or {}))  # nothing changed yet
        fetcher = Fetcher([*relays, origin], streams=streams, cooldown_s=5.0, token=token)
        sub = None
        try:
            info = self._call(FetcherSource(fetcher, run).run_info())
            self._map(views_for, list(info.tensors))
            sub = self._subscriber(run, fetcher, verify)
            t0 = time.perf_counter()
            done = self._call(sub.bootstrap(version, in_place=False))  # fresh tensors, swapped in when checked
        except BaseException:
            self._call(self._close_quietly(sub, fetcher, origin))
            raise
        old, self._sub, self._closing = (self._sub, *self._closing), sub, [fetcher, origin]
        self._call(self._close_quietly(*old))
        self._take, self._asked = None, None
        if self.after_write is not None:
            self.after_write(None)  # the whole state was swapped in
        self.served = Served(done.version, done.version_id, fetch_s=time.perf_counter() - t0, changed=done.changed_elements)
        trim()  # the keyframe read's and the swap's buffers back to the OS
        if prefetch:
            self._on_loop(sub.start)
        log.info("deltarl: serving %s version %d (%s)", run, done.version, done.version_id[:12])
        return self.served

    def _map(self, views_for: ViewsFor, table: list[Any]) -> None:
        """The views for ``table``, asked of the adapter only when the table changes."""
        from deltarl.codec.jit_warmup import warm_codec_quietly

        if table == self._table:
            return
        # mapping may write the parameters (a probe): what was served is gone, and so is its subscriber
        self._call(self._close_quietly(self._sub, *self._closing))
        self.served, self._table, self._sub, self._closing = None, None, None, []
        self.views = views_for(table)
        self._table = table
        warm_codec_quietly({t.dtype for t in table})  # numba's kernels, before the first delta

    def _subscriber(self, run: str, fetcher: Any, verify: bool) -> Any:
        from deltarl.actor.subscriber import Subscriber

        if self.ranks.size > 1:  # each rank stages its part; every take and commit agreed by all
            from deltarl.updater.sharded import ShardedUpdater

            return ShardedUpdater(self.views, self.placements, list(self._table or []), run, fetcher, self.ranks,
                                  verify=verify, poll_wait_s=POLL_WAIT_S)
        # catch_up_after: never on its own; an update for "latest" asks for it (catch_up_to).
        # speculate=False: a version is staged from its manifest's verified segments
        return Subscriber(self.views, run, fetcher, poll_wait_s=POLL_WAIT_S, catch_up_after=1 << 62,
                          verify_digest=verify, speculate=False)

    # --- an update ----------------------------------------------------------------------------------
    def start_update(self) -> None:
        """A new update: nothing taken."""
        self._take = None

    def take(self, version: int | str = "latest", *, wait_s: float = 0.0) -> None:
        """:meth:`_take_here` on this rank, kept only if every rank took the same version."""
        from deltarl.updater.sharded import agreed

        def drop() -> None:
            self._take = None

        agreed(self.ranks, lambda: self._take_here(version, wait_s=wait_s),
               lambda: None if self._take is None else self._take[0].version_id, drop)

    def _take_here(self, version: int | str = "latest", *, wait_s: float = 0.0) -> None:
        """Take ``version`` (the next after the served one, or ``"latest"``) as staged in the
        background, for :meth:`commit`. Raises ``NotStaged`` / ``NotPublished`` at once when it is
        not staged yet (ask again; with ``wait_s`` > 0 the background staging waits for an
        unpublished version, else the refusal stops it until the next ask), or the background
        staging's own error for it."""
        if self.served is None or self._sub is None:
            raise RunError("deltarl: no version is served: attach has not succeeded")
        served, sub = self.served, self._sub
        self._take = None
        target, head_id = self._target(version)
        if target == served.version:
            return  # already served: nothing to take
        if not isinstance(version, str) and target != served.version + 1:
            raise BaseMismatch(f"version {target} does not apply to the served version {served.version}: "
                               f"stage version {served.version + 1} next (one version an update; \"latest\" catches up)")
        staged = sub.staged
        if staged is not None and staged.version == target and head_id in (None, staged.version_id):
            self._take, self._asked = (staged, self._asked is None or self._asked[0] != target or self._asked[2]), None
            return
        if staged is not None and staged.version == target:  # HEAD names another id: the run was replaced
            log.warning("deltarl: staged version %d is not the one HEAD names (the run was replaced): staging again", target)
            self._on_loop(sub.drop_staged)
            self._on_loop(sub.forget)
        self._wait_for(target, wait_s)

    def _target(self, version: int | str) -> tuple[int, str | None]:
        """The version asked for, and the id HEAD names for it (None: not HEAD's)."""
        if version != "latest":
            if not isinstance(version, int) or isinstance(version, bool):
                raise ConfigError(f"the version must be an int or 'latest', not {version!r}")
            return version, None
        head = self._call(self._sub.head(), timeout=HOLD_S)
        if head is None:
            raise NotPublished(f"run {self._sub.layout.run!r} has no HEAD")
        assert self.served is not None
        if head.version > self.served.version + 1:
            self._on_loop(self._sub.catch_up_to, head.version)
        return head.version, head.version_id

    def _wait_for(self, target: int, wait_s: float) -> None:
        """Raise what the caller should know about ``target``, not staged yet: the background
        staging's error, NotPublished or NotStaged; the background staging goes on unless refused."""
        sub = self._sub
        if self._asked is None or self._asked[0] != target:
            self._asked = (target, sub.attempts, sub.running)
            self._on_loop(sub.retry_now)
        if not sub.running:
            self._on_loop(sub.start)
        err = sub.fatal or (sub.error if sub.error_attempt > self._asked[1] else None)
        try:
            if err is not None:
                raise err
            try:
                self._call(sub.manifest(target), timeout=HOLD_S)
            except ObjectNotFound as missing:
                raise NotPublished(f"version {target} is not published yet ({missing})") from None
            except TimeoutError:
                pass  # the source is slow: the background staging will tell
        except BaseException as refused:
            if not (isinstance(refused, NotPublished) and wait_s > 0):  # a refusal: stage nothing until asked again
                self._asked = None
                self._call(sub.pause())
            raise
        raise NotStaged(f"version {target} is being staged in the background: ask again")

    def commit(self) -> Served | None:
        """Write the version :meth:`take` took, in place (the pause), then confirm a recorded state
        digest (a mismatch rolls it back and raises ``IntegrityError``). None if nothing was taken."""
        if self._take is None:
            return None
        staged, prefetched = self._take
        self._take = None
        if not self.ranks.all_ok(self._sub.staged is staged):  # every rank still holds what it took, or none commits
            raise NotStaged(f"version {staged.version} was dropped before its commit (the run changed): ask again")
        info = self._call(self._commit())
        self.served = Served(info.version, info.version_id, fetch_s=staged.stage_s, pause_s=info.pause_s,
                             digest_s=info.digest_s or 0.0, changed=info.changed_elements, prefetched=prefetched)
        return self.served

    async def _commit(self) -> Any:
        update = self._sub.staged.update
        changes = update.changes() if self.after_write is not None and hasattr(update, "changes") else None
        try:
            info = self._sub.commit()
            return await self._sub.confirm() or info
        finally:  # what was written (or rolled back), for a copy the engine's kernel reads
            if self.after_write is not None:
                self.after_write(changes)

    # --- read back, close ---------------------------------------------------------------------------
    def digest(self, algo: str | None = None) -> str:
        """The state digest of the served weights by checkpoint name (hashed in place, no copy)."""
        from deltarl.codec.tensors import DIGEST_ALGO, state_digest

        return state_digest(self.views, algo or DIGEST_ALGO)

    def engine_digest(self) -> str:
        """The state digest of the whole engine's served weights, joined from every rank's part (a
        collective: every rank calls it); with one rank, :meth:`digest`."""
        return str(self.ranks.engine_digest(list(self._table or []), self.placements, self.views))

    def background(self) -> dict[str, Any]:
        """What the background staging holds: the staged version, and its last error with its kind."""
        sub = self._sub
        if sub is None:
            return {"staged": None, "error": None}
        err = sub.fatal or sub.error
        return {"staged": sub.staged_version, "error": None if err is None else str(tag(err))}

    def close(self) -> None:
        if self._loop is None:
            return
        try:
            self._call(self._close_quietly(self._sub, *self._closing), timeout=120)  # a cold codec compile: a minute
            self._sub, self._closing = None, []
        except TimeoutError:
            log.warning("deltarl: the subscriber did not close in 120s; stopping its loop anyway")
        finally:
            loop, self._loop = self._loop, None
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=30)
            if not loop.is_running():
                loop.close()
