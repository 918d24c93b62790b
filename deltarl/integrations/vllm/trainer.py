"""The trainer side of the ``deltarl`` backend: ``DeltaRLTrainerEngine``, a vLLM
``TrainerWeightTransferEngine`` whose ``send_weights`` publishes a version with deltarl's
``Publisher`` and then tells the engines to take it.

A trainer already speaking vLLM's trainer-side protocol switches by changing one name::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from deltarl.integrations.vllm.trainer import DeltaRLTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaRLTrainerInitInfo(store="s3://runs", run="grpo", rank=rank),
        client=HTTPVLLMWeightSyncClient("http://rollout:8000"), source=ModuleSource(model))
    ...
    engine.send_weights()          # after each optimizer step, on every rank

Every rank iterates the source; rank 0 (or, on vLLM 0.33+ with several ranks, every rank its own
rows through a ``ShardedPublisher``) publishes, and rank 0 alone calls the client, resetting the
engines' prefix caches after each commit. The weights travel through the store (and relays),
never through the client, so any number of engines in any region follow the same run (the
others attach with ``init_weight_transfer_engine`` themselves, or through their actor).
Importing this module registers the engine with vLLM's trainer-side factory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from deltarl.actor.backends.vllm import take_update
from deltarl.integrations.vllm import sources
from deltarl.integrations.vllm.plugin import BACKEND

log = logging.getLogger(__name__)


@dataclass
class DeltaRLTrainerInitInfo(TrainerInitInfo):
    """Where the trainer publishes, and what the engines are told to read."""

    backend: ClassVar[str] = BACKEND

    #: the store the trainer publishes to (a path, ``s3://bucket``, ...)
    store: str = ""
    #: the run's name
    run: str = ""
    #: the store URL the engines read (default ``store``; e.g. a relay in their region)
    engine_store: str | None = None
    #: relays the engines try first
    relays: list[str] = field(default_factory=list)
    #: ``PublishConfig`` settings (``keyframe_interval``, ``digest_interval``, ...)
    publish: dict[str, Any] = field(default_factory=dict)
    #: keyword options of the trainer's store (``endpoint_url=`` for S3, ...)
    store_options: dict[str, Any] = field(default_factory=dict)


class DeltaRLTrainerEngine(TrainerWeightTransferEngine[DeltaRLTrainerInitInfo]):
    """Publishes each round through deltarl, then drives the engines' update (rank 0).

    Every rank calls :meth:`trainer_init` and :meth:`send_weights` and iterates the source in both
    (no rank returns before a collective). On vLLM 0.33+'s data model with several ranks, each rank
    publishes its own rows through a ``ShardedPublisher`` (``iter_local`` pieces where the layouts
    are row shards, else its ``iter_full`` tensors from each parameter's first owner): no rank holds
    the whole model. Otherwise every rank iterates the full tensors and rank 0 publishes them.
    """

    init_info_cls = DeltaRLTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None = None, is_sender: bool = True, rank: int = 0) -> None:
        # vLLM 0.32's base takes no rank=; 0.33+'s does: set it here for both
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.rank = rank
        self.publisher: Any = None
        self._store: Any = None
        self._group: Any = None  # the sharded publisher's own gloo group
        self._world = 1
        self._next = 0
        self.version: int | None = None

    @classmethod
    def trainer_init(cls, init_info: DeltaRLTrainerInitInfo, *, client: Any, source: WeightSource | None = None
                     ) -> DeltaRLTrainerEngine:
        """Every rank: open the run (rank 0 claims it), publish the current weights as the run's first
        version if it has none, and (rank 0) attach the engines to it."""
        if not init_info.store or not init_info.run:
            raise ValueError("DeltaRLTrainerInitInfo needs store= and run=")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        nxt = engine._next = engine._open(init_info)
        if nxt == 0:
            engine._publish()
        else:
            engine.version = nxt - 1
        if engine.is_sender:
            client.init_weight_transfer_engine({"store": init_info.engine_store or init_info.store,
                                                "run": init_info.run, "relays": list(init_info.relays),
                                                "version": engine.version})
            engine._attached()
        return engine

    def _open(self, init_info: DeltaRLTrainerInitInfo) -> int:
        """Open the publisher (sharded: on every rank; else on rank 0) and return the run's next
        version, the same on every rank."""
        from deltarl.pipeline.publisher import Publisher
        from deltarl.storage.open import open_store

        self._world = _world_size()
        sharded = self._world > 1 and self.source is not None and sources.is_split(self.source)
        if sharded:
            import torch.distributed as dist

            from deltarl.pipeline.sharded import ShardedPublisher

            self._group = dist.new_group(backend="gloo")  # collective: every rank
            self._store = open_store(init_info.store, **init_info.store_options)
            self.publisher = ShardedPublisher(self._store, init_info.run, group=self._group, **init_info.publish)
            return int(self.publisher.next_version)
        nxt = -1
        if self.is_sender:
            self._store = open_store(init_info.store, **init_info.store_options)
            self.publisher = Publisher(self._store, init_info.run, **init_info.publish)
            nxt = int(self.publisher.next_version)
        return _from_rank0(nxt, self._world)

    def _publish(self) -> None:
        """Every rank: iterate the source (materializing can be a collective); publish."""
        from deltarl.pipeline.sharded import ShardedPublisher

        if self.source is None:
            raise ValueError("DeltaRLTrainerEngine needs a WeightSource (ModuleSource(model)) to publish from")
        if isinstance(self.publisher, ShardedPublisher):
            shards = sources.row_shards(self.source, self.rank, self._world)
            info = self.publisher.publish_local(shards, step=self.publisher.next_version, owned=True)
            self.version = info.version
            return
        state = sources.full_state(self.source)
        if self.is_sender:
            self.version = self.publisher.publish(state, step=self.publisher.next_version, owned=True).version
        else:  # the version rank 0 published (every rank knows the run's next version from _open)
            self.version = self._next
        self._next = self.version + 1

    def send_weights(self) -> None:
        """Every rank: publish the source's weights as the next version; rank 0 then has the engines
        stage and commit it, and resets their prefix caches (KV computed under the old weights)."""
        self._publish()
        if not self.is_sender:
            return
        # the engine answers "not staged yet" at once while it stages in the background: ask again
        assert self.version is not None  # published just above
        take_update(self.client.start_weight_update, self.client.update_weights, self.version)
        self.client.finish_weight_update(weight_version=str(self.version))
        reset_prefix_cache(self.client)

    def _attached(self) -> None:
        """After attaching: reset the engines' prefix caches (and, over HTTP, name the served version
        in ``/weight_info``)."""
        reset_prefix_cache(self.client)
        base = getattr(self.client, "base_url", None)
        if isinstance(base, str) and self.version is not None:
            _post(base, "update_weight_version", {"new_version": str(self.version)})

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None


def _world_size() -> int:
    try:
        import torch.distributed as dist
    except ImportError:
        return 1
    return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1


def _from_rank0(value: int, world: int) -> int:
    """Rank 0's ``value`` on every rank (a collective when ``world > 1``)."""
    if world == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _post(base_url: str, route: str, body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> None:
    import json
    import urllib.request

    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(f"{base_url.rstrip('/')}/{route}", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        resp.read()


def reset_prefix_cache(client: Any) -> None:
    """Reset the prefix cache of the engines behind a ``VLLMWeightSyncClient`` after a commit:
    its own ``reset_prefix_cache`` if it has one, ``POST /reset_prefix_cache`` for vLLM's HTTP
    client (a route of ``VLLM_SERVER_DEV_MODE=1``, as the weight-transfer routes are), each actor's
    ``reset_prefix_cache`` for vLLM's Ray client."""
    own = getattr(client, "reset_prefix_cache", None)
    if callable(own):
        own()
        return
    base = getattr(client, "base_url", None)
    if isinstance(base, str):
        _post(base, "reset_prefix_cache")
        return
    handles = getattr(client, "handles", None)
    if handles:
        import ray

        ray.get([h.reset_prefix_cache.remote() for h in handles])
        return
    log.warning("deltarl: %s has no way to reset the engines' prefix cache; cached KV predates the commit",
                type(client).__name__)


def register() -> None:
    """Register ``deltarl`` with vLLM's trainer-side factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, DeltaRLTrainerEngine)


register()
