"""The actor loop's handle on its weights: the async subscriber and fetcher, driven from a sync thread.

The subscriber and its fetcher live on a private event loop in a background thread, where they
prefetch and stage the next version while the actor's own thread generates. Every call that
touches the live state (bootstrap, commit) runs on that loop while the actor's thread waits, so
the state is written only at the safe point. The subscriber's ``on_staged`` hook wakes
:meth:`Weights.wait_ready` when a version is staged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Coroutine, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

from deltarl.actor.subscriber import CommitInfo, Subscriber
from deltarl.errors import ConfigError, ObjectNotFound, RunError, TransferError

if TYPE_CHECKING:
    from deltarl.actor.config import ActorConfig
    from deltarl.actor.events import CommitTiming
    from deltarl.model.record import RunModelInfo
    from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)

R = TypeVar("R")


class Weights:
    """Bootstrap, background staging and safe-point commits of one actor's live state."""

    def __init__(self, config: ActorConfig, store: ObjectStore | None, *, backend: Any | None = None) -> None:
        """``store``: the origin, the fallback after the config's relays (None: relays only).
        ``backend``: one whose served weights are not the state given to :meth:`bootstrap` (a
        host copy it keeps in step); commits then go through ``backend.commit`` / ``backend.load_state``. It may be
        set as an attribute until :meth:`bootstrap`."""
        self.config = config
        self.store = store
        self.backend = backend
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="actor-weights", daemon=True)
        self._thread.start()
        self._sub: Subscriber | None = None
        self._fetcher: Any = None
        self._ready = threading.Event()

    def _call(self, coro: Coroutine[Any, Any, R], timeout: float | None = None) -> R:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # --- state ---------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        assert self._sub is not None
        assert self._sub.version is not None
        return self._sub.version

    @property
    def version_id(self) -> str:
        assert self._sub is not None
        assert self._sub.version_id is not None
        return self._sub.version_id

    @property
    def held(self) -> tuple[int, str] | None:
        """``(version, version_id)`` of the live state, or None before the bootstrap."""
        if self._sub is None or self._sub.version is None or self._sub.version_id is None:
            return None
        return self._sub.version, self._sub.version_id

    def fetch_stats(self) -> dict[str, Any]:
        return {} if self._fetcher is None else dataclasses.asdict(self._fetcher.stats)

    # --- bootstrap -------------------------------------------------------------------------------------

    def wait_model_json(self, *, timeout_s: float, stop: threading.Event) -> RunModelInfo | None:
        """The run's ``model.json``, read through the relays (then the origin), waiting up to
        ``timeout_s`` for the trainer to write it; None if ``stop`` was set first."""
        from deltarl.model.record import RunModelInfo, model_json_key

        self._call(self._open_fetcher())
        key = model_json_key(self.config.run)
        deadline = time.monotonic() + timeout_s
        while not stop.is_set():
            left = deadline - time.monotonic()
            try:  # each source holds the request or backs off (early 404s) for up to the wait
                return RunModelInfo.from_bytes(self._call(self._fetcher.fetch_key(key, wait_s=max(0.0, min(2.0, left)))))
            except (ObjectNotFound, TransferError) as err:
                if time.monotonic() > deadline:
                    raise RunError(f"run {self.config.run!r} has no model.json after {timeout_s}s: {err}") from None
                if isinstance(err, TransferError):
                    stop.wait(min(1.0, max(0.0, left)))
        return None

    def bootstrap(self, state: MutableMapping[str, Any], *, timeout_s: float, stop: threading.Event) -> bool:
        """Load the newest keyframe and the deltas after it into ``state`` (the live tensors), waiting
        up to ``timeout_s`` for the run's first version. Returns False if ``stop`` was set first."""
        self._call(self._open(state))
        deadline = time.monotonic() + timeout_s
        while not stop.is_set():
            try:
                info = self._call(self._bootstrap())
                log.info("bootstrapped version %d (%s)", info.version, info.version_id[:12])
                self._call(self._start())
                return True
            except (ObjectNotFound, TransferError) as err:
                if time.monotonic() > deadline:
                    raise RunError(f"run {self.config.run!r}: no version to bootstrap from after {timeout_s}s: {err}") from err
                stop.wait(0.2)
        return False

    async def _open_fetcher(self) -> None:
        from deltarl.actor.fetcher import Fetcher

        if self._fetcher is None:
            sources: list[Any] = [*self.config.relay_urls(), *([self.store] if self.store is not None else [])]
            if not sources:
                raise ConfigError("the actor has neither relays nor an origin store to read the run from")
            self._fetcher = Fetcher(sources, streams=self.config.streams, cooldown_s=5.0)

    async def _open(self, state: MutableMapping[str, Any]) -> None:
        await self._open_fetcher()
        cfg = self.config
        self._sub = Subscriber(state, cfg.run, self._fetcher, poll_wait_s=5.0, poll_interval_s=cfg.head_poll_s,
                               verify_digest=cfg.verify_digest, backend=self.backend, on_staged=self._ready.set)

    async def _bootstrap(self) -> Any:
        assert self._sub is not None
        return await self._sub.bootstrap()

    async def _start(self) -> None:
        assert self._sub is not None
        self._sub.start()

    # --- the safe point ----------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether a version is staged; raises the subscriber's fatal error (the run was re-created
        with another tensor table: this actor can never follow it) so the actor stops."""
        if self._sub is not None and self._sub.fatal is not None:
            raise self._sub.fatal
        return self._sub is not None and self._sub.ready()

    def wait_ready(self, timeout: float) -> bool:
        """Block up to ``timeout`` s for a staged version."""
        self._ready.clear()  # before looking: a version staged from now on sets it again
        if self.ready():
            return True
        return self._ready.wait(timeout) and self.ready()

    def commit(self) -> CommitTiming | None:
        """Commit the staged version in place (rolled back on failure); its timings, or None if none.

        The previous commit's digest check is confirmed first (``IntegrityError`` if it failed: that
        version is rolled back); this commit's own check runs in the background until :meth:`confirm`.
        """
        from deltarl.actor.events import CommitTiming, parse_utc

        if not self.ready():
            return None
        self.confirm()
        info = self._call(self._commit())
        manifest, _ = self._call(self._manifest(info.version))
        published = parse_utc(manifest.created_at)
        timing = CommitTiming(
            version=info.version,
            version_id=info.version_id,
            publish_to_staged_s=round(max(0.0, info.staged_at - published), 4),
            publish_to_commit_s=round(max(0.0, time.time() - published), 4),
            pause_ms=round(info.pause_s * 1000, 3),
            digest_checked=info.digest_pending or info.state_digest_ok is True,
        )
        log.info("committed version %d: pause %.2f ms, publish→staged %s s%s", info.version, timing.pause_ms,
                 timing.publish_to_staged_s, ", checking its digest" if info.digest_pending else "")
        return timing

    def confirm(self) -> CommitInfo | None:
        """Wait for the last commit's state digest check (see :meth:`Subscriber.confirm`): its final
        info, or None if none is pending. A mismatch rolls that version back and raises
        ``IntegrityError``. Call it before reporting anything generated since the last commit."""
        if self._sub is None or not self._sub.digest_pending:
            return None
        info = self._call(self._sub.confirm())
        if info is not None:
            log.info("version %d: state digest ok (%.3f s, off the commit pause)", info.version, info.digest_s or 0.0)
        return info

    async def _commit(self) -> CommitInfo:
        assert self._sub is not None
        return self._sub.commit()

    async def _manifest(self, version: int) -> Any:
        assert self._sub is not None
        return await self._sub.manifest(version)

    # --- lifetime ------------------------------------------------------------------------------------

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop staging, close the subscriber and fetcher, end the loop's thread. A close that outlasts
        ``timeout_s`` (a codec compile that will not end) is logged and the loop stopped anyway."""
        if not self._loop.is_closed() and self._thread.is_alive():
            try:
                self._call(self._close(), timeout=timeout_s)
            except TimeoutError:
                log.warning("the weights' subscriber did not close in %.0fs; stopping its loop anyway", timeout_s)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    async def _close(self) -> None:
        if self._sub is not None:
            await self._sub.close()
        if self._fetcher is not None:
            await self._fetcher.close()
