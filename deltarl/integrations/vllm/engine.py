"""``DeltaRLEngine``: vLLM's weight-transfer engine ``deltarl``, running in each vLLM worker.

A thin adapter of vLLM's four calls onto :class:`~deltarl.updater.inplace.InPlaceUpdater` (the
engine-agnostic in-place updater, which runs the same update mechanism as the HF actor and the
follower on vLLM's live parameters). Only a few dozen bytes of control travel through vLLM's RPC.
Lifecycle, as vLLM drives it:

* ``init_transfer_engine({"store": URL, "run": RUN, ...})`` (:class:`DeltaRLInitInfo`): checkpoint
  names are mapped onto vLLM's parameters through the model's own ``load_weights``
  (:mod:`deltarl.updater.probe`; once per tensor table), then ``version`` (default: HEAD) is
  rebuilt from the newest keyframe plus the deltas after it in fresh tensors, checked, and only
  then swapped into the parameters: a failed init (a missing store, version or object, a chain
  that does not verify) raises before any served weight is written, and the engine goes on
  serving what it served.
* after the bootstrap and after each commit the next version is staged in the background as soon
  as it is published, while vLLM generates.
* ``start_weight_update()`` opens an update session.
* ``update_weights({"update_info": {"version": N}})`` (or ``"latest"``) takes the version staged in
  the background. It never fetches or decodes inside the call (vLLM's engine does not generate
  while a worker RPC runs): a version not staged yet answers ``[deltarl:NotStaged]`` at once
  (``[deltarl:NotPublished]`` for one not committed yet), and the client asks again
  (:func:`deltarl.actor.backends.vllm.take_update` does). ``"latest"`` two or more versions
  behind is staged in one go, and must be the id HEAD names.
* ``finish_weight_update()`` commits the staged version in place (the pause); where the manifest
  records a state digest it is computed over the served weights and a mismatch rolls the version
  back before raising. Call ``reset_prefix_cache()`` afterwards: KV computed under the old
  weights is stale.

Every error carries its kind, ``[deltarl:ClassName] message`` (docs/integrations.md).
:class:`~deltarl.integrations.vllm.worker.DeltaRLWorkerExtension` reads the served version (and
its digest) back through ``collective_rpc``.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltarl.errors import ConfigError
from deltarl.updater.inplace import InPlaceUpdater, Served, tag

log = logging.getLogger(__name__)
R = TypeVar("R")


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


def tagged(method: Callable[..., R]) -> Callable[..., R]:
    """vLLM's call, with any error it raises tagged with its kind (``[deltarl:ClassName]``)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> R:
        try:
            return method(*args, **kwargs)
        except Exception as err:
            tag(err)
            if args and isinstance(args[0], DeltaRLEngine) and args[0].leave_to_last_rank(err):
                return None  # type: ignore[return-value]  # the last rank raises it for every rank
            raise err from err.__cause__

    return call


def _calling_worker() -> Any:
    """The vLLM worker creating this engine (found on the call stack), weakly, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and hasattr(obj, "_check_weight_transfer_engine"):
            return weakref.ref(obj)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _vllm_ranks() -> Any:
    """The engine's workers, from vLLM's world group (its gloo CPU group)."""
    from vllm.distributed.parallel_state import get_world_group

    from deltarl.updater.ranks import Ranks

    g = get_world_group()
    return Ranks(g.cpu_group, int(g.rank_in_group), int(g.world_size))


class DeltaRLEngine(WeightTransferEngine[DeltaRLInitInfo, DeltaRLUpdateInfo]):
    """The ``deltarl`` weight-transfer engine (one per vLLM worker; see the module docstring)."""

    init_info_cls = DeltaRLInitInfo
    update_info_cls = DeltaRLUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.updater = InPlaceUpdater("deltarl-vllm")
        self.placements: list[Any] = []
        self.init_info: DeltaRLInitInfo | None = None
        self.experts: Any = None  # LiveExperts: MoE layers whose kernel reads a packed copy (CPU build)
        self._worker = _calling_worker()

    def leave_to_last_rank(self, err: BaseException) -> bool:
        """Whether this rank leaves an agreed refusal to the engine's last rank to raise (True: it
        returns). vLLM's multiprocess executor raises at the first worker whose reply is an error
        and leaves the later workers' replies queued, so that the next call of every rank would read
        a stale reply; every refusal here is agreed by all ranks, so only the last one raises it.
        This rank's worker ends its update session as vLLM does on an error."""
        ranks = self.updater.ranks
        if ranks.size == 1 or ranks.rank == ranks.size - 1:
            return False
        log.info("deltarl: rank %d: %s (the last rank reports it)", ranks.rank, err)
        worker = None if self._worker is None else self._worker()
        if worker is not None and getattr(worker, "_weight_update_active", False):
            worker._weight_update_active = False
            self.reset_weight_update_target()
        return True

    @property
    def views(self) -> dict[str, Any]:
        """The served tensors by checkpoint name: views of vLLM's parameters."""
        return self.updater.views

    @property
    def served(self) -> Served | None:
        return self.updater.served

    @tagged
    def init_transfer_engine(self, init_info: DeltaRLInitInfo) -> None:
        from deltarl.integrations.vllm.experts import LiveExperts

        if int(getattr(self.parallel_config, "pipeline_parallel_size", 1)) != 1:
            raise ConfigError("deltarl's vLLM engine serves tensor and expert parallel ranks: pipeline parallel "
                              "size must be 1")
        if int(getattr(self.parallel_config, "tensor_parallel_size", 1)) > 1 and self.updater.ranks.size == 1:
            self.updater.ranks = _vllm_ranks()  # each rank holds part of the model: every update agreed by all
        if self.experts is None:  # MoE on the CPU build: live expert weights beside the kernel's packed copy
            self.experts = LiveExperts(self.model)
            if self.experts:
                self.updater.after_write = self._after_write
        self.updater.attach(self._probe, init_info.store, init_info.run, relays=init_info.relays, version=init_info.version,
                            streams=init_info.streams, token=init_info.token, verify=init_info.verify,
                            prefetch=init_info.prefetch, store_options=init_info.store_options)
        self.init_info = init_info

    def _probe(self, table: Sequence[Any]) -> dict[str, Any]:
        """Views of vLLM's parameters by checkpoint name, found by probing the model's ``load_weights``."""
        from deltarl.updater.probe import derive_views

        t0 = time.perf_counter()
        ranks, failed = self.updater.ranks, None
        with self.experts.loading():  # the probe sees (and writes) the experts' live weights
            try:
                views, self.placements = derive_views(self.model.load_weights, dict(self.model.named_parameters()),
                                                      list(table), sharded=ranks.size > 1)
            except Exception as err:  # the other ranks hear of it before it is raised (no rank waits forever)
                failed = err
        try:
            ranks.cover(list(table), None if failed else self.placements)  # the ranks' parts tile every tensor
        except Exception:
            if failed is not None:
                raise failed from None
            raise
        self.updater.placements = self.placements
        log.info("deltarl: %d checkpoint tensors mapped onto %d vLLM parameters in %.2f s",
                 len(views), len({p.param for p in self.placements}), time.perf_counter() - t0)
        return views

    @tagged
    def start_weight_update(self) -> None:
        self.updater.start_update()

    @tagged
    def update_weights(self, update_info: dict[str, Any]) -> None:
        super().update_weights(update_info)  # parses update_info (its errors tagged too), then receive_weights

    @tagged
    def receive_weights(self, update_info: DeltaRLUpdateInfo) -> None:
        self.updater.take(update_info.version, wait_s=update_info.wait_s)

    @tagged
    def finish_weight_update(self) -> None:
        self.updater.commit()

    def _after_write(self, changes: dict[str, Any] | None) -> None:
        """The kernel's packed experts follow what a commit or rollback wrote (None: everything)."""
        if changes is None:
            self.experts.repack()
        else:
            self.experts.mirror(self.placements, changes)

    def digest(self, algo: str | None = None) -> str:
        """The state digest of this rank's served weights by checkpoint name (hashed in place, no copy)."""
        return self.updater.digest(algo)

    def engine_digest(self) -> str:
        """The state digest of the whole engine's served weights (a collective: every rank calls it)."""
        return self.updater.engine_digest()

    def background(self) -> dict[str, Any]:
        return self.updater.background()

    def shutdown(self) -> None:
        self.updater.close()
