"""TRL's async GRPO on deltarl: a ``weight_transfer`` for ``trl.experimental.async_grpo.AsyncGRPOTrainer``.

TRL 1.16's ``AsyncGRPOTrainer(weight_transfer=...)`` takes any object with ``init_weight_transfer()``,
``pause()``, ``send_weights(iterator)``, ``resume()`` and ``destroy()`` (its ``WeightTransferProtocol``),
and calls them on the main process only: ``init_weight_transfer`` at train begin, then per sync
``pause`` → ``send_weights`` (every rank iterates; only the main one hands the iterator over) →
``resume``. Its default sends every parameter over NCCL; :class:`DeltaRLWeightTransfer` instead
publishes each sync as a version of a deltarl run (a sparse delta in the store, read by any number
of servers in any region) and has each ``vllm serve`` take it in place through its HTTP routes::

    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from deltarl.integrations.vllm.trl_async import DeltaRLWeightTransfer

    transfer = DeltaRLWeightTransfer(["http://rollout-0:8000"], "s3://runs", "grpo")
    trainer = AsyncGRPOTrainer(model=..., args=AsyncGRPOConfig(...), weight_transfer=transfer, ...)

The servers are started as ``deltarl serve-sync`` expects (docs/integrations.md). Nothing here
imports TRL or vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from deltarl.errors import ConfigError
from deltarl.integrations.vllm.serve_sync import attach, call_route, commit, server_status, stage

log = logging.getLogger(__name__)


class DeltaRLWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over a deltarl run and ``vllm serve`` endpoints."""

    def __init__(
        self,
        servers: Sequence[str],
        store: str,
        run: str,
        *,
        pause_mode: Literal["keep", "wait", "abort"] = "keep",
        engine_store: str | None = None,
        relays: Sequence[str] = (),
        publish: dict[str, Any] | None = None,
        store_options: dict[str, Any] | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        """``servers``: the ``vllm serve`` URLs TRL's rollout worker generates from. ``store``/``run``:
        where each sync is published (``engine_store``: what the servers read, default ``store``;
        ``relays`` first). ``pause_mode``: vLLM's ``/pause`` mode around the sync (TRL's own default is
        ``keep``: requests in flight are frozen and go on, on the new weights; ``wait`` lets them end
        on the old ones first; ``abort`` ends them). ``publish``: ``PublishConfig`` settings."""
        if pause_mode not in ("keep", "wait", "abort"):
            raise ConfigError(f"pause_mode must be keep, wait or abort, not {pause_mode!r}")
        self.servers = [u.rstrip("/") for u in servers]
        self.store_url, self.run = store, run
        self.engine_store, self.relays = engine_store or store, list(relays)
        self.pause_mode, self.timeout_s = pause_mode, timeout_s
        self.publish_options = dict(publish or {})
        self.store_options = dict(store_options or {})
        self.publisher: Any = None
        self._store: Any = None
        self.version: int | None = None
        self._attached: set[str] = set()
        self._pool = ThreadPoolExecutor(max(1, len(self.servers)), thread_name_prefix="deltarl-trl")

    def _each(self, fn: Any) -> None:
        """``fn(url)`` on every server at once; the first error is raised after all have ended."""
        errors = [f.exception() for f in [self._pool.submit(fn, url) for url in self.servers]]
        for err in errors:
            if err is not None:
                raise err

    def init_weight_transfer(self) -> None:
        """Open (claim) the run. Servers attach at the first :meth:`send_weights` (the run may have no
        version yet)."""
        from deltarl.pipeline.publisher import Publisher
        from deltarl.storage.open import open_store

        self._store = open_store(self.store_url, **self.store_options)
        self.publisher = Publisher(self._store, self.run, **self.publish_options)
        if self.publisher.next_version > 0:
            self.version = self.publisher.next_version - 1

    def pause(self) -> None:
        self._each(lambda url: call_route(url, f"pause?mode={self.pause_mode}", timeout_s=self.timeout_s))

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """Publish the iterated weights (BF16 on CPU) as the run's next version, then have every server
        stage and commit it (or attach at it, the first time), resetting its prefix cache."""
        import torch

        if self.publisher is None:
            self.init_weight_transfer()
        state = {name: t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True).contiguous()
                 for name, t in iterator}
        info = self.publisher.publish(state, step=self.publisher.next_version, owned=True)
        self.version = info.version
        self._each(self._take)

    def _take(self, url: str) -> None:
        assert self.version is not None
        if url in self._attached and server_status(url, timeout_s=self.timeout_s).get("version") == self.version - 1:
            stage(url, self.version, timeout_s=self.timeout_s)
            commit(url, self.version, timeout_s=self.timeout_s)
        else:  # first sync, or the server restarted: load this version from the run
            attach(url, self.engine_store, self.run, relays=self.relays, version=self.version, timeout_s=self.timeout_s)
            call_route(url, "update_weight_version", {"new_version": str(self.version)}, timeout_s=self.timeout_s)
            self._attached.add(url)
        log.info("deltarl: %s serves version %d", url, self.version)

    def resume(self) -> None:
        self._each(lambda url: call_route(url, "resume", timeout_s=self.timeout_s))

    def destroy(self) -> None:
        """Release the run's writer claim and the store."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self._store is not None:
            self._store.close()
            self._store = None
        self._pool.shutdown(wait=False)
