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

Only rank 0 publishes and calls the client; the weights travel through the store (and relays),
never through the client, so any number of engines in any region follow the same run (the
others attach with ``init_weight_transfer_engine`` themselves, or through their actor).
Importing this module registers the engine with vLLM's trainer-side factory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from deltarl.actor.backends.vllm import take_update
from deltarl.integrations.vllm.plugin import BACKEND


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
    """Publishes each round through deltarl (rank 0), then drives the engines' update."""

    init_info_cls = DeltaRLTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.publisher: Any = None
        self._store: Any = None
        self.version: int | None = None

    @classmethod
    def trainer_init(cls, init_info: DeltaRLTrainerInitInfo, *, client: Any, source: WeightSource | None = None
                     ) -> DeltaRLTrainerEngine:
        """Rank 0: claim the run, publish the current weights as the run's first version if it has
        none, and attach the engines to it."""
        from deltarl.pipeline.publisher import Publisher
        from deltarl.storage.open import open_store

        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        if not init_info.store or not init_info.run:
            raise ValueError("DeltaRLTrainerInitInfo needs store= and run=")
        engine._store = open_store(init_info.store, **init_info.store_options)
        engine.publisher = Publisher(engine._store, init_info.run, **init_info.publish)
        if engine.publisher.next_version == 0:
            engine._publish()
        else:
            engine.version = engine.publisher.next_version - 1
        client.init_weight_transfer_engine({"store": init_info.engine_store or init_info.store, "run": init_info.run,
                                            "relays": list(init_info.relays), "version": engine.version})
        return engine

    def _state(self) -> dict[str, Any]:
        import torch

        if self.source is None:
            raise ValueError("DeltaRLTrainerEngine needs a WeightSource (ModuleSource(model)) to publish from")
        # copies: the publisher keeps this state as the next base, and the trainer goes on writing its own
        return {name: t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True).contiguous() for name, t in self.source}

    def _publish(self) -> None:
        state = self._state()  # every rank iterates (materializing can be a collective)
        if self.is_sender:
            info = self.publisher.publish(state, step=self.publisher.next_version, owned=True)
            self.version = info.version

    def send_weights(self) -> None:
        """Publish the source's weights as the next version, then have the engines stage and commit it."""
        self._publish()
        if not self.is_sender:
            return
        # the engine answers "not staged yet" at once while it stages in the background: ask again
        assert self.version is not None  # published just above
        take_update(self.client.start_weight_update, self.client.update_weights, self.version)
        self.client.finish_weight_update(weight_version=str(self.version))

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self._store is not None:
            self._store.close()
            self._store = None


def register() -> None:
    """Register ``deltarl`` with vLLM's trainer-side factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, DeltaRLTrainerEngine)


register()
