"""``DeltaRLEngine``: vLLM's weight-transfer engine ``deltarl``, running in each vLLM worker.

The worker reads the run itself (relays, then the origin store, multi-stream, every piece checked
against its manifest), decodes each version against its own live parameters and writes in place;
only a few dozen bytes of control travel through vLLM's RPC. Lifecycle, as vLLM drives it:

* ``init_transfer_engine({"store": URL, "run": RUN, ...})`` (:class:`DeltaRLInitInfo`): checkpoint
  names are mapped onto vLLM's parameters through the model's own ``load_weights``
  (:mod:`.mapping`), then the engine loads ``version`` (default: HEAD) from the newest keyframe at
  or before it plus the deltas after it, straight into those parameters, and checks the newest
  state digest on the way. From then on the engine serves a known version of the run.
* after the bootstrap and after each commit the engine stages the next version in the background
  as soon as it is published (``prefetch``, on by default): vLLM keeps generating meanwhile, and
  the update that asks for it finds it staged.
* ``start_weight_update()`` drops anything staged.
* ``update_weights({"update_info": {"version": N}})`` (or ``"latest"``): fetches version N's
  manifest and segments and stages its delta against the served weights, nothing written. A
  version whose parent is not the served version, that is missing, or whose bytes do not verify
  is refused here (the call raises; vLLM ends the update session) and the weights are untouched.
* ``finish_weight_update()`` commits the staged delta in place (the pause: a checked scatter);
  where the manifest records a state digest it is then computed over the served weights and a
  mismatch rolls the version back before raising. Call ``reset_prefix_cache()`` afterwards: KV
  computed under the old weights is stale.

:class:`~deltarl.integrations.vllm.worker.DeltaRLWorkerExtension` reads the served version (and
its digest) back through ``collective_rpc``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltarl.errors import BaseMismatch, ConfigError, IntegrityError, ObjectNotFound, RunError, short_pair

log = logging.getLogger(__name__)
R = TypeVar("R")

#: how long one long-poll of the background prefetch waits for the next manifest
PREFETCH_POLL_S = 5.0


@dataclass
class DeltaRLInitInfo(WeightTransferInitInfo):
    """``init_info`` of the ``deltarl`` backend."""

    #: the origin: any URL deltarl opens (a path, ``s3://bucket``, a relay's ``http://host:port``)
    store: str
    #: the run to serve
    run: str
    #: relays tried before ``store``, in order
    relays: list[str] = field(default_factory=list)
    #: the version to start from (None: the run's HEAD)
    version: int | None = None
    #: parallel HTTP streams per object
    streams: int = 4
    #: bearer token for relays and HTTP stores
    token: str | None = None
    #: check parent links up to HEAD at the bootstrap, and recorded state digests at each commit
    verify: bool = True
    #: extra keyword options of the origin store (``endpoint_url=`` for S3, ...)
    store_options: dict[str, Any] = field(default_factory=dict)
    #: stage the next version in the background as soon as it is published (off the pause)
    prefetch: bool = True


@dataclass
class DeltaRLUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of the ``deltarl`` backend: the version to stage (``"latest"``: HEAD)."""

    version: int | str = "latest"
    #: seconds to wait for a version that is not committed yet (long-polls the relays)
    wait_s: float = 0.0


@dataclass
class Served:
    """What the engine serves, and what the last update cost (read back by the worker extension)."""

    version: int
    version_id: str
    fetch_s: float = 0.0
    decode_s: float = 0.0
    pause_s: float = 0.0
    digest_s: float = 0.0
    changed: int = 0
    #: whether the update was staged in the background before it was asked for
    prefetched: bool = False


class DeltaRLEngine(WeightTransferEngine[DeltaRLInitInfo, DeltaRLUpdateInfo]):
    """The ``deltarl`` weight-transfer engine (one per vLLM worker; see the module docstring)."""

    init_info_cls = DeltaRLInitInfo
    update_info_cls = DeltaRLUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._fetcher: Any = None
        self._source: Any = None
        self._store: Any = None
        self.views: dict[str, Any] = {}
        self.placements: list[Any] = []
        self.experts: Any = None  # LiveExperts: MoE layers whose kernel reads a packed copy
        self.ranks: Any = None  # Ranks: the engine's workers, agreeing on every update
        self.table: list[Any] = []  # the run's tensor table
        self.served: Served | None = None
        self._staged: tuple[Any, Any, str, float, float] | None = None  # (staged, manifest, id, fetch_s, decode_s)
        # the background staging of the next version: (version, base id, published, future)
        self._ahead: tuple[int, str, threading.Event, concurrent.futures.Future[Any]] | None = None
        self.init_info: DeltaRLInitInfo | None = None
        self._prefetched = False

    # --- the event loop the fetcher runs on -------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, R]) -> R:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _tp(self) -> int:
        return int(getattr(self.parallel_config, "tensor_parallel_size", 1)) * int(
            getattr(self.parallel_config, "pipeline_parallel_size", 1))

    # --- vLLM's interface ----------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: DeltaRLInitInfo) -> None:
        from deltarl.actor.fetcher import Fetcher
        from deltarl.actor.source import FetcherSource
        from deltarl.codec import trim, warm_codec_quietly
        from deltarl.integrations.vllm.experts import LiveExperts
        from deltarl.integrations.vllm.ranks import Ranks
        from deltarl.integrations.vllm.sharded import sharded_bootstrap
        from deltarl.pipeline.catch_up import catch_up
        from deltarl.storage.open import open_store
        from deltarl.updater.probe import derive_views

        if int(getattr(self.parallel_config, "pipeline_parallel_size", 1)) != 1:
            raise ConfigError("deltarl's vLLM engine serves tensor and expert parallel ranks: pipeline parallel "
                              "size must be 1")
        self.ranks = Ranks.of_vllm() if self._tp() > 1 else Ranks()
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="deltarl-vllm", daemon=True)
            self._thread.start()
        self._close_source()
        self.init_info = init_info
        self._store = open_store(init_info.store, must_exist=True, **init_info.store_options)

        async def open_source() -> Any:
            self._fetcher = Fetcher([*init_info.relays, self._store], streams=init_info.streams,
                                    cooldown_s=5.0, token=init_info.token)
            self._source = FetcherSource(self._fetcher, init_info.run)
            return await self._source.run_info()

        info = self._call(open_source())
        t0 = time.perf_counter()
        if self.experts is None:  # MoE on the CPU build: live weights, the kernel's packed copy (kept across re-inits)
            self.experts = LiveExperts(self.model)
        with self.experts.loading():
            params = dict(self.model.named_parameters())
            self.views, self.placements = derive_views(self.model.load_weights, params, list(info.tensors),
                                                       sharded=self.ranks.size > 1)
        self.table = list(info.tensors)
        self.ranks.cover(self.table, self.placements)
        warm_codec_quietly({t.dtype for t in info.tensors})  # numba's kernels, before the first delta
        log.info("deltarl: %d checkpoint tensors mapped onto %d vLLM parameters in %.2f s",
                 len(self.views), len({p.param for p in self.placements}), time.perf_counter() - t0)

        async def bootstrap() -> Any:
            version = init_info.version
            if version is None:
                head = await self._source.head()
                if head is None:
                    raise RunError(f"run {init_info.run!r} has no HEAD: nothing to serve yet")
                version = head.version
            return await catch_up(self._source, version, into=self.views, verify=init_info.verify)

        t0 = time.perf_counter()
        if self.ranks.size > 1:
            caught = sharded_bootstrap(self, init_info, self._call)
        else:
            caught = self._call(bootstrap())
        self.experts.repack()
        self.served = Served(caught.manifest.version, caught.version_id, fetch_s=time.perf_counter() - t0)
        trim()  # the probes' and the keyframe read's buffers back to the OS
        self._prefetch()
        log.info("deltarl: serving %s version %d (%s) from keyframe %d + %d deltas",
                 init_info.run, caught.manifest.version, caught.version_id[:12], caught.keyframe_version, caught.deltas)

    def start_weight_update(self) -> None:
        self._staged = None

    async def _stage(self, served: Served, version: int, wait_s: float) -> tuple[Any, Any, str, float, float]:
        """Fetch (verified) and stage ``version`` against ``served``: (staged, manifest, id, fetch_s, decode_s)."""
        from deltarl.codec import stage_delta
        from deltarl.updater.shards import stage_regions

        t0 = time.perf_counter()
        manifest, vid = await self._source.manifest(version, wait_s=wait_s)
        if manifest.parent != served.version_id:
            named, has = short_pair(manifest.parent or "", served.version_id)
            raise BaseMismatch(f"{manifest.key}: parent {named} is not the served version's id {has}")
        segments = await self._source.segments(manifest)
        t1 = time.perf_counter()
        if self.ranks.size > 1:
            staged = await asyncio.to_thread(stage_regions, self.views, self.placements, self.table, segments,
                                             base=served.version_id)
        else:
            staged = await asyncio.to_thread(stage_delta, self.views, segments, base=served.version_id)
        return staged, manifest, vid, t1 - t0, time.perf_counter() - t1

    def _prefetch(self) -> None:
        """Stage the version after the served one in the background, while vLLM generates (reads only:
        the old values; the commit still checks every position). Long-polls until it is published."""
        self._cancel_prefetch()
        served, info = self.served, self.init_info
        if served is None or info is None or not info.prefetch or self._loop is None:
            return

        published = threading.Event()

        async def ahead() -> tuple[Any, Any, str, float, float]:
            while True:
                try:
                    await self._source.manifest(served.version + 1, wait_s=PREFETCH_POLL_S)
                except ObjectNotFound:  # not published yet: poll again (relays hold the request)
                    continue
                published.set()
                return await self._stage(served, served.version + 1, 0.0)

        fut = asyncio.run_coroutine_threadsafe(ahead(), self._loop)
        self._ahead = (served.version + 1, served.version_id, published, fut)

    def _cancel_prefetch(self) -> None:
        if self._ahead is not None:
            self._ahead[3].cancel()
            self._ahead = None

    def receive_weights(self, update_info: DeltaRLUpdateInfo) -> None:
        from deltarl.integrations.vllm.sharded import agreed

        agreed(self, self._receive_one, update_info)  # every rank staged the same version, or none keeps it

    def _receive_one(self, update_info: DeltaRLUpdateInfo) -> None:
        if self.served is None:
            raise RunError("deltarl: init_weight_transfer_engine has not run: no version is served")
        served = self.served
        self._staged = None
        self._prefetched = False
        want = update_info.version
        if want == "latest":
            head = self._call(self._source.head())
            want = served.version if head is None else head.version
        if not isinstance(want, int):
            raise ConfigError(f"update_info version must be an int or 'latest', not {want!r}")
        if want == served.version:
            return  # already served: nothing to stage
        if want != served.version + 1:
            raise BaseMismatch(f"version {want} does not apply to the served version {served.version}: "
                               f"stage version {served.version + 1} next (one version an update)")
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[:2] == (want, served.version_id) and ahead[2].is_set():
            self._staged = ahead[3].result()  # published: staged in the background, or about to be
            self._prefetched = True
            return
        if ahead is not None:
            ahead[3].cancel()  # not published yet: ask directly (waiting wait_s, ObjectNotFound after)
        self._staged = self._call(self._stage(served, want, update_info.wait_s))

    def finish_weight_update(self) -> None:
        from deltarl.integrations.vllm.sharded import commit_on_every_rank

        if self._staged is None:
            return
        staged, manifest, vid, fetch_s, decode_s = self._staged
        self._staged = None
        t0 = time.perf_counter()
        commit_on_every_rank(self.ranks, staged)
        touched = self.experts.experts_of(self.placements, staged.tensors)
        self.experts.repack(touched)
        pause = time.perf_counter() - t0
        digest_s = 0.0
        if manifest.state_digest is not None and self.init_info is not None and self.init_info.verify:
            t1 = time.perf_counter()
            got = self.engine_digest()
            digest_s = time.perf_counter() - t1
            if got != manifest.state_digest.value:
                staged.rollback()
                self.experts.repack(touched)
                shown_got, shown_rec = short_pair(got, manifest.state_digest.value)
                raise IntegrityError(f"{manifest.key}: served weights hash to {shown_got}, the manifest records "
                                     f"{shown_rec}; version {manifest.version} rolled back")
        self.served = Served(manifest.version, vid, fetch_s, decode_s, pause, digest_s, staged.changed_elements,
                             self._prefetched)
        self._prefetch()

    def engine_digest(self) -> str:
        """The state digest of the whole engine's served weights (a collective: every rank calls it)."""
        return str(self.ranks.engine_digest(self.table, self.placements, self.views))

    def digest(self, algo: str | None = None) -> str:
        """The state digest of this rank's served weights by checkpoint name (hashed in place, no copy)."""
        from deltarl.codec import DIGEST_ALGO, state_digest

        return state_digest(self.views, algo or DIGEST_ALGO)

    def _close_source(self) -> None:
        """Stop any prefetch and close the fetcher and the origin store (a re-attach, or shutdown)."""
        self._cancel_prefetch()
        fetcher, store, self._fetcher, self._store, self._source = self._fetcher, self._store, None, None, None
        if fetcher is not None and self._loop is not None:
            asyncio.run_coroutine_threadsafe(fetcher.close(), self._loop).result(timeout=30)
        if store is not None:
            store.close()

    def shutdown(self) -> None:
        if self._loop is None:
            return
        try:
            self._close_source()
        finally:
            loop, self._loop = self._loop, None
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=30)
