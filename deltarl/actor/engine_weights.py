"""The actor loop's handle on weights that live in vLLM's workers (``backend: vllm``).

Same interface as :class:`~deltarl.actor.weights.Weights` (bootstrap, ready, commit at the safe
point, held version), but the fetch, the verification, the decode and the in-place write all
happen in the ``deltarl`` weight-transfer engine inside vLLM (see
:mod:`deltarl.actor.backends.vllm`); this process reads only ``model.json``, HEAD and manifests
(for timings), through the same fetcher (relays, then the origin). One version per commit, in
order: the engine stages version ``v + 1`` against the served ``v`` only.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from deltarl.actor.weights import Weights
from deltarl.errors import ConfigError, RunError

if TYPE_CHECKING:
    from deltarl.actor.backends.base import EngineBackend
    from deltarl.actor.config import ActorConfig
    from deltarl.actor.events import CommitTiming
    from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)


class EngineWeights(Weights):
    """Bootstrap and safe-point commits of an engine backend's served weights (vLLM's)."""

    def __init__(self, config: ActorConfig, store: ObjectStore | None, *, store_url: str | None = None) -> None:
        super().__init__(config, store)
        self.engine: EngineBackend | None = None
        self._store_url = store_url or config.store
        self._served: tuple[int, str] | None = None
        self._head_version: int | None = None
        self._head_read = 0.0
        self._workers_fetch: dict[str, Any] = {}  # the engine workers' fetch stats, as of the last status

    @property
    def version(self) -> int:
        assert self._served is not None
        return self._served[0]

    @property
    def version_id(self) -> str:
        assert self._served is not None
        return self._served[1]

    @property
    def held(self) -> tuple[int, str] | None:
        return self._served

    def bootstrap(self, state: Any, *, timeout_s: float, stop: threading.Event) -> bool:
        """Attach the engine to the run at HEAD (its workers load the newest keyframe and the
        deltas after it), waiting up to ``timeout_s`` for a first version. ``state`` is unused."""
        assert self.engine is not None, "set .engine first"
        relays = self.config.relay_urls()
        origin = self._store_url or (relays[0] if relays else None)
        if origin is None:
            raise ConfigError("the vllm backend needs a store URL or a relay for its workers to read the run from")
        deadline = time.monotonic() + timeout_s
        while not stop.is_set():  # wait for the run's first version here; the engine's errors are final
            self._head_read = 0.0
            if self._head() is not None:
                break
            if time.monotonic() > deadline:
                raise RunError(f"run {self.config.run!r}: no version to bootstrap from after {timeout_s}s")
            stop.wait(0.5)
        if stop.is_set():
            return False
        try:
            st = self.engine.attach(origin, self.config.run, relays=[r for r in relays if r != origin],
                                    streams=self.config.streams, verify=self.config.verify_digest)
        except Exception as err:  # vLLM re-raises a worker's error as its own RuntimeError
            raise RunError(f"run {self.config.run!r}: the vLLM engine could not attach: {err}") from err
        self._served = (int(st["version"]), str(st["version_id"]))
        self._workers_fetch = dict(st.get("fetch") or {})
        log.info("vLLM engine serves version %d (%s)", *self._served)
        return True

    def fetch_stats(self) -> dict[str, Any]:
        """This process's fetches (HEAD, manifests) plus the engine workers' (the weights), as of the
        last attach or commit: the weights are fetched in vLLM's workers, not here."""
        own, workers = super().fetch_stats(), self._workers_fetch
        out = dict(own or {})
        for key, value in workers.items():
            if key == "bytes_by_source":
                merged = dict(out.get(key) or {})
                for source, n in value.items():
                    merged[source] = merged.get(source, 0) + int(n)
                out[key] = merged
            elif isinstance(value, int):
                out[key] = int(out.get(key) or 0) + value
        return out

    def _head(self) -> int | None:
        now = time.monotonic()
        if now - self._head_read >= self.config.head_poll_s:
            self._head_read = now
            self._call(self._open_fetcher())
            from deltarl.actor.source import FetcherSource

            head = self._call(FetcherSource(self._fetcher, self.config.run).head())
            self._head_version = None if head is None else head.version
        return self._head_version

    def ready(self) -> bool:
        head = self._head()
        return self._served is not None and head is not None and head > self._served[0]

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(self.config.head_poll_s, max(0.0, deadline - time.monotonic())))
        return True

    def commit(self) -> CommitTiming | None:
        """Update the engine to the next version (staged in its workers, then written in place;
        a recorded state digest is checked there before it returns). None if there is none."""
        from deltarl.actor.events import CommitTiming, parse_utc
        from deltarl.actor.source import FetcherSource

        if not self.ready():
            return None
        assert self.engine is not None
        assert self._served is not None
        st = self.engine.update(self._served[0] + 1)
        self._served = (int(st["version"]), str(st["version_id"]))
        self._workers_fetch = dict(st.get("fetch") or {})
        manifest, _ = self._call(FetcherSource(self._fetcher, self.config.run).manifest(self._served[0]))
        published = parse_utc(manifest.created_at)
        staged_s = max(0.0, time.time() - float(st["pause_s"]) - published)
        timing = CommitTiming(version=self._served[0], version_id=self._served[1],
                              publish_to_staged_s=round(staged_s, 4), publish_to_commit_s=round(max(0.0, time.time() - published), 4),
                              pause_ms=round(float(st["pause_s"]) * 1000, 3), digest_checked=manifest.state_digest is not None)
        log.info("vLLM engine committed version %d: fetch %.0f ms, decode %.0f ms, pause %.2f ms", timing.version,
                 float(st["fetch_s"]) * 1e3, float(st["decode_s"]) * 1e3, timing.pause_ms)
        return timing

    def confirm(self) -> None:
        """Nothing pending: the engine checks a recorded digest before its commit returns."""
        return None
