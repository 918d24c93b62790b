"""``DeltaRLEngine``: vLLM's weight-transfer engine ``deltarl``, running in each vLLM worker.

A thin adapter of vLLM's four calls onto the one in-place update mechanism every backend uses
(:class:`~deltarl.actor.subscriber.Subscriber` on the engine's live parameters, read through the
actor's fetcher: relays, then the origin store; every piece checked against its manifest). Only a
few dozen bytes of control travel through vLLM's RPC. Lifecycle, as vLLM drives it:

* ``init_transfer_engine({"store": URL, "run": RUN, ...})`` (:class:`DeltaRLInitInfo`): checkpoint
  names are mapped onto vLLM's parameters through the model's own ``load_weights``
  (:mod:`deltarl.updater.probe`; once per tensor table: a re-init on the same table maps nothing
  again), then ``version`` (default: HEAD) is rebuilt from the newest keyframe plus the deltas after
  it in fresh tensors, checked, and only then swapped into the parameters. A failed init (a missing
  store, version or object, a chain that does not verify) raises before any served weight is
  written: the engine goes on serving what it served, and its status says so.
* after the bootstrap and after each commit the next version is staged in the background as soon
  as it is published (its segments even before its manifest), while vLLM generates.
* ``start_weight_update()`` opens an update session.
* ``update_weights({"update_info": {"version": N}})`` (or ``"latest"``) takes the version staged in
  the background. It never fetches or decodes inside the call (vLLM's engine does not generate
  while a worker RPC runs): a version not staged yet is staged in the background and the call
  answers ``[deltarl:NotStaged]`` at once (``[deltarl:NotPublished]`` for one not committed yet);
  the client asks again (:func:`deltarl.actor.backends.vllm.take_update` does). ``"latest"`` two
  or more versions behind stages HEAD in one go from the served weights plus the deltas up to it
  (or from the newest keyframe when that fetches less), and is checked to be the id HEAD names.
* ``finish_weight_update()`` commits the staged version in place (the pause: a checked scatter; a
  catch-up of several versions is a whole-state swap); where the manifest records a state digest
  it is computed over the served weights and a mismatch rolls the version back before raising.
  Call ``reset_prefix_cache()`` afterwards: KV computed under the old weights is stale.

Every error leaves the engine tagged with its kind, ``[deltarl:ClassName] message``
(docs/integrations.md lists them), so a client tells "not published yet" from a failure without
parsing prose. :class:`~deltarl.integrations.vllm.worker.DeltaRLWorkerExtension` reads the served
version (and its digest) back through ``collective_rpc``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltarl.errors import BaseMismatch, ConfigError, NotPublished, NotStaged, ObjectNotFound, RunError

log = logging.getLogger(__name__)
R = TypeVar("R")

#: how long one long-poll of the background staging waits for the next manifest
PREFETCH_POLL_S = 5.0
#: the longest ``update_weights`` holds vLLM's RPC (reading HEAD or a manifest), never a fetch
RPC_HOLD_S = 2.0


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
    """``update_info`` of the ``deltarl`` backend: the version to take (``"latest"``: HEAD)."""

    version: int | str = "latest"
    #: how long the client goes on asking for a version not committed yet: while it does (> 0) the
    #: engine keeps waiting for it in the background; 0 is a refusal that stops background staging
    #: until the next update
    wait_s: float = 0.0


@dataclass
class Served:
    """What the engine serves, and what the last update cost (read back by the worker extension)."""

    version: int
    version_id: str
    #: seconds from the manifest being visible to the version staged (fetch and decode overlap)
    fetch_s: float = 0.0
    #: 0: segments are decoded as they arrive, inside ``fetch_s``
    decode_s: float = 0.0
    pause_s: float = 0.0
    digest_s: float = 0.0
    changed: int = 0
    #: whether the update was staged in the background before it was asked for
    prefetched: bool = False


def tag(err: BaseException) -> BaseException:
    """``err`` with its kind in front of its message, ``[deltarl:ClassName] …`` (once)."""
    text = str(err)
    if not text.startswith("[deltarl:"):
        err.args = (f"[deltarl:{type(err).__name__}] {text}",)
    return err


def tagged(method: Callable[..., R]) -> Callable[..., R]:
    """vLLM's call, with any error it raises tagged with its kind (:func:`tag`)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> R:
        try:
            return method(*args, **kwargs)
        except Exception as err:
            raise tag(err) from err.__cause__

    return call


class DeltaRLEngine(WeightTransferEngine[DeltaRLInitInfo, DeltaRLUpdateInfo]):
    """The ``deltarl`` weight-transfer engine (one per vLLM worker; see the module docstring)."""

    init_info_cls = DeltaRLInitInfo
    update_info_cls = DeltaRLUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sub: Any = None  # the Subscriber keeping self.views at the run's versions
        self._closing: list[Any] = []  # the fetcher and origin store the subscriber reads through
        self._table: list[Any] | None = None  # the tensor table self.views were mapped for
        self.views: dict[str, Any] = {}
        self.placements: list[Any] = []
        self.served: Served | None = None
        self.init_info: DeltaRLInitInfo | None = None
        self._take: tuple[Any, bool] | None = None  # (Staged, staged before it was asked for)
        self._asked: tuple[int, int] | None = None  # (version, the subscriber's attempt when first asked)
        self.experts: Any = None  # LiveExperts: MoE layers whose kernel reads a packed copy (CPU build)
        self.ranks: Any = None  # Ranks: the engine's workers, agreeing on every update

    # --- the event loop the fetcher and the subscriber run on ---------------------------------------
    def _call(self, coro: Coroutine[Any, Any, R], timeout: float | None = None) -> R:
        assert self._loop is not None
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

    def _tp(self) -> int:
        return int(getattr(self.parallel_config, "tensor_parallel_size", 1)) * int(
            getattr(self.parallel_config, "pipeline_parallel_size", 1))

    # --- init -------------------------------------------------------------------------------------
    @tagged
    def init_transfer_engine(self, init_info: DeltaRLInitInfo) -> None:
        from deltarl.actor.fetcher import Fetcher
        from deltarl.actor.source import FetcherSource
        from deltarl.integrations.vllm.ranks import Ranks
        from deltarl.storage.open import open_store

        if int(getattr(self.parallel_config, "pipeline_parallel_size", 1)) != 1:
            raise ConfigError("deltarl's vLLM engine serves tensor and expert parallel ranks: pipeline parallel "
                              "size must be 1")
        if self.ranks is None:
            self.ranks = Ranks.of_vllm() if self._tp() > 1 else Ranks()
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="deltarl-vllm", daemon=True)
            self._thread.start()
        store = open_store(init_info.store, must_exist=True, **init_info.store_options)  # nothing changed yet
        fetcher = Fetcher([*init_info.relays, store], streams=init_info.streams, cooldown_s=5.0, token=init_info.token)
        sub = None
        try:
            info = self._call(FetcherSource(fetcher, init_info.run).run_info())
            self._map(list(info.tensors))
            sub = self._subscriber(init_info, fetcher)
            t0 = time.perf_counter()
            done = self._call(sub.bootstrap(init_info.version, in_place=False))  # fresh tensors, swapped in when checked
            self.experts.repack()  # MoE on the CPU build: the kernel's packed copy of every expert
        except BaseException:
            self._call(self._close_quietly(sub, fetcher, store))
            raise
        old, self._sub, self._closing = (self._sub, *self._closing), sub, [fetcher, store]
        self._call(self._close_quietly(*old))
        self.init_info, self._take, self._asked = init_info, None, None
        self.served = Served(done.version, done.version_id, fetch_s=time.perf_counter() - t0, changed=done.changed_elements)
        from deltarl.codec import trim

        trim()  # the keyframe read's and the swap's buffers back to the OS
        if init_info.prefetch:
            self._call(self._start())
        log.info("deltarl: serving %s version %d (%s)", init_info.run, done.version, done.version_id[:12])

    def _map(self, table: list[Any]) -> None:
        """Views of the parameters by checkpoint name, found by probing ``load_weights`` once per table."""
        from deltarl.codec import warm_codec_quietly
        from deltarl.integrations.vllm.experts import LiveExperts
        from deltarl.updater.probe import derive_views

        if table == self._table:
            return
        self.served, self._table = None, None  # the probe writes the parameters: nothing known is served
        t0 = time.perf_counter()
        if self.experts is None:  # MoE on the CPU build: live expert weights beside the kernel's packed copy
            self.experts = LiveExperts(self.model)
        failed: BaseException | None = None
        with self.experts.loading():
            try:
                self.views, self.placements = derive_views(self.model.load_weights, dict(self.model.named_parameters()),
                                                           table, sharded=self.ranks.size > 1)
            except Exception as err:  # the other ranks hear of it before it is raised (no rank waits forever)
                failed = err
        try:
            self.ranks.cover(table, None if failed else self.placements)  # the ranks' parts tile every tensor
        except Exception:
            if failed is not None:
                raise failed from None
            raise
        self._table = table
        warm_codec_quietly({t.dtype for t in table})  # numba's kernels, before the first delta
        log.info("deltarl: %d checkpoint tensors mapped onto %d vLLM parameters in %.2f s",
                 len(self.views), len({p.param for p in self.placements}), time.perf_counter() - t0)

    def _subscriber(self, init_info: DeltaRLInitInfo, fetcher: Any) -> Any:
        from deltarl.actor.subscriber import Subscriber
        from deltarl.integrations.vllm.sharded import ShardedUpdater

        if self.ranks.size > 1:  # each rank stages its part; every commit agreed by all
            return ShardedUpdater(self.views, self.placements, list(self._table or []), init_info.run, fetcher,
                                  self.ranks, verify=init_info.verify, poll_wait_s=PREFETCH_POLL_S)
        # catch_up_after: never on its own; an update for "latest" asks for it (catch_up_to)
        return Subscriber(self.views, init_info.run, fetcher, poll_wait_s=PREFETCH_POLL_S, catch_up_after=1 << 62,
                          verify_digest=init_info.verify, speculate=False)

    async def _start(self) -> None:
        self._sub.start()

    async def _close_quietly(self, *things: Any) -> None:
        for thing in things:
            if thing is None:
                continue
            try:
                result = thing.close()
                if asyncio.iscoroutine(result):
                    await result
            except Exception as err:  # closing what a failed init opened must not hide its error
                log.debug("deltarl: closing %r: %s", thing, err)

    # --- an update ----------------------------------------------------------------------------------
    @tagged
    def start_weight_update(self) -> None:
        self._take = None

    @tagged
    def update_weights(self, update_info: dict[str, Any]) -> None:
        super().update_weights(update_info)  # parses update_info (its errors tagged too), then receive_weights

    @tagged
    def receive_weights(self, update_info: DeltaRLUpdateInfo) -> None:
        from deltarl.integrations.vllm.sharded import agreed

        def drop() -> None:
            self._take = None

        agreed(self.ranks, lambda: self._receive_one(update_info),  # every rank takes the same version, or none
               lambda: None if self._take is None else self._take[0].version_id, drop)

    def _receive_one(self, update_info: DeltaRLUpdateInfo) -> None:
        if self.served is None or self._sub is None:
            raise RunError("deltarl: no version is served: init_weight_transfer_engine has not succeeded")
        served, sub = self.served, self._sub
        self._take = None
        target, head_id = self._target(update_info.version)
        if target == served.version:
            return  # already served: nothing to take
        if not isinstance(update_info.version, str) and target != served.version + 1:
            raise BaseMismatch(f"version {target} does not apply to the served version {served.version}: "
                               f"stage version {served.version + 1} next (one version an update; \"latest\" catches up)")
        staged = sub.staged
        if staged is not None and staged.version == target and head_id in (None, staged.version_id):
            self._take, self._asked = (staged, self._asked is None or self._asked[0] != target), None
            return
        if staged is not None and staged.version == target:  # HEAD names another id: the run was replaced
            log.warning("deltarl: staged version %d is not the one HEAD names (the run was replaced): staging again", target)
            self._on_loop(sub.drop_staged)
            self._on_loop(sub.forget)
        self._wait_for(target, update_info.wait_s)

    def _target(self, version: int | str) -> tuple[int, str | None]:
        """The version asked for, and the id HEAD names for it (None: not HEAD's)."""
        if version != "latest":
            if not isinstance(version, int) or isinstance(version, bool):
                raise ConfigError(f"update_info version must be an int or 'latest', not {version!r}")
            return version, None
        head = self._call(self._sub.head(), timeout=RPC_HOLD_S)
        if head is None:
            raise NotPublished(f"run {self._sub.layout.run!r} has no HEAD")
        if head.version > self.served.version + 1:  # type: ignore[union-attr]  # checked by the caller
            self._on_loop(self._sub.catch_up_to, head.version)
        return head.version, head.version_id

    def _wait_for(self, target: int, wait_s: float) -> None:
        """Raise what the caller should know about ``target``, not staged yet: the background
        staging's error, NotPublished or NotStaged; the background staging goes on unless refused."""
        sub = self._sub
        if self._asked is None or self._asked[0] != target:
            self._asked = (target, sub.attempts)
            self._on_loop(sub.retry_now)
        if not sub.running:
            self._call(self._start())
        err = sub.fatal or (sub.error if sub.error_attempt > self._asked[1] else None)
        try:
            if err is not None:
                raise err
            try:
                self._call(sub.manifest(target), timeout=RPC_HOLD_S)
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

    @tagged
    def finish_weight_update(self) -> None:
        if self._take is None:
            return
        staged, prefetched = self._take
        self._take = None
        sub = self._sub
        if not self.ranks.all_ok(sub.staged is staged):  # every rank still holds what it took, or none commits
            raise NotStaged(f"version {staged.version} was dropped before its commit (the run changed): ask again")
        info = self._call(self._commit())
        self.served = Served(info.version, info.version_id, fetch_s=staged.stage_s, pause_s=info.pause_s,
                             digest_s=info.digest_s or 0.0, changed=info.changed_elements, prefetched=prefetched)

    async def _commit(self) -> Any:
        """Commit in place, then confirm a recorded digest (a mismatch is rolled back and raises)."""
        update = self._sub.staged.update
        changes = update.changes() if self.experts and hasattr(update, "changes") else None
        try:
            info = self._sub.commit()
            return await self._sub.confirm() or info
        finally:  # MoE on the CPU build: the kernel's packed copy follows what was written (or rolled back)
            if changes is not None:
                self.experts.mirror(self.placements, changes)
            elif self.experts:
                self.experts.repack()

    # --- read back ----------------------------------------------------------------------------------
    def engine_digest(self) -> str:
        """The state digest of the whole engine's served weights (a collective: every rank calls it)."""
        return str(self.ranks.engine_digest(list(self._table or []), self.placements, self.views))

    def digest(self, algo: str | None = None) -> str:
        """The state digest of this rank's served weights by checkpoint name (hashed in place, no copy)."""
        from deltarl.codec import DIGEST_ALGO, state_digest

        return state_digest(self.views, algo or DIGEST_ALGO)

    def background(self) -> dict[str, Any]:
        """What the background staging holds: the staged version, and its last error with its kind."""
        sub = self._sub
        if sub is None:
            return {"staged": None, "error": None}
        err = sub.fatal or sub.error
        return {"staged": sub.staged_version, "error": None if err is None else str(tag(err))}

    def shutdown(self) -> None:
        if self._loop is None:
            return
        try:
            self._call(self._close_quietly(self._sub, *self._closing), timeout=30)
            self._sub, self._closing = None, []
        finally:
            loop, self._loop = self._loop, None
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=30)
