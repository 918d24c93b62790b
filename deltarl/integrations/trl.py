"""Publish every optimizer step of a TRL (or any ``transformers``) trainer as a deltarl version.

Example::

    from deltarl.integrations.trl import DeltaRLCallback
    from deltarl.model.build import ModelSpec  # what actors rebuild: here a local checkpoint
    from deltarl.model.record import RunModelInfo
    from deltarl.model.tokenizer import TokenizerSpec

    info = RunModelInfo(model=ModelSpec(name="/ckpt/qwen3-8b"), tokenizer=TokenizerSpec(kind="hf", path="/ckpt/qwen3-8b"))
    callback = DeltaRLCallback("s3://bucket/runs", "grpo-1", model_info=info)
    GRPOTrainer(model=model, ..., callbacks=[callback]).train()

At the start of training rank 0 claims the run, writes ``<run>/model.json`` and publishes the initial
weights as version 0. After each optimizer step the new weights are published in the background
while training goes on, in one of two ways:

* **Sharded** (an FSDP2 / DTensor model, the default there): every rank exports its own shard to
  CPU BF16 and a :class:`~deltarl.pipeline.sharded.ShardedPublisher` encodes and uploads each
  rank's rows in parallel, on a gloo process group of its own; rank 0 commits. No rank ever holds
  the full state: memory per rank is its previous shard plus the shard being published.
* **Gathered** (ZeRO-3, FSDP1, PEFT LoRA merged, single process): every rank joins the gather of
  the full BF16 state (:func:`deltarl.integrations.gather.gather_bf16`) and rank 0 hands it to a
  :class:`~deltarl.pipeline.publisher.Publisher`. Memory on rank 0: the previous version plus the
  one being published, two CPU BF16 copies of the model; other ranks hold nothing extra.

At most one publish is in flight: the next step's export first waits for it, and a publish that
failed raises :class:`~deltarl.errors.IntegrationError` there (chained to the cause), so a broken
store stops training one step later instead of silently. At the end of training the last publish
is waited for and the writer claim released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from deltarl.errors import IntegrationError, PublishFailed
from deltarl.integrations.gather import gather_bf16
from deltarl.model.record import RunModelInfo, write_model_json

if TYPE_CHECKING:
    from deltarl.pipeline.publisher import Publisher
    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.pipeline.writer import VersionInfo
    from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)


class DeltaRLCallback(TrainerCallback):
    """A ``TrainerCallback`` that publishes the policy after every optimizer step, in the background.

    Args:
        store: an :class:`~deltarl.storage.store.ObjectStore` or a store URL (``open_store``'s forms).
        run: the run's name in the store.
        model_info: what actors rebuild and sample (written to ``<run>/model.json`` on rank 0); ``None``
            writes no ``model.json`` (followers that only need weights do not read it).
        publish_initial: publish the weights before the first step as version 0 (when the run is new).
        on_published: called on the publishing thread with each committed version's ``VersionInfo``
            (metrics, logging); an exception in it counts as a failed publish.
        publisher_options: keyword arguments of :class:`~deltarl.pipeline.publisher.Publisher` (or of
            :class:`~deltarl.pipeline.sharded.ShardedPublisher` when sharded): ``keyframe_interval``,
            ``digest_interval``, ``segment_bytes``, ``takeover``, ...
        sharded: publish each rank's shard (FSDP2) instead of gathering; ``None`` decides at the start
            of training: sharded when a process group of several ranks is up and the model's
            parameters are DTensors (and it is not a PEFT model, whose LoRA the gather merges).
    """

    def __init__(
        self,
        store: ObjectStore | str,
        run: str,
        *,
        model_info: RunModelInfo | None = None,
        publish_initial: bool = True,
        on_published: Callable[[VersionInfo], None] | None = None,
        publisher_options: dict[str, Any] | None = None,
        sharded: bool | None = None,
    ) -> None:
        self._store_arg = store
        self.run = run
        self.model_info = model_info
        self.publish_initial = publish_initial
        self.on_published = on_published
        self.publisher_options = dict(publisher_options or {})
        self.sharded = sharded
        self.publisher: Publisher | ShardedPublisher | None = None
        self._group: Any = None  # the sharded publisher's own gloo group
        self.published: list[VersionInfo] = []
        self._store: ObjectStore | None = None
        self._owns_store = False
        self._inflight_step: int | None = None  # the step of the last publish handed to the background

    # --- transformers' hooks (called on every rank) ----------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.sharded is None:
            self.sharded = model is not None and shards_itself(model)
        if self.sharded:
            self._open_sharded(bool(state.is_world_process_zero))
        elif state.is_world_process_zero:
            self._open()
        if self.publish_initial:
            new = self.publisher is not None and self.publisher.next_version == 0
            # every rank must join the gather or none: rank 0 decides, and the others learn it
            if _broadcast_flag(new, state.is_world_process_zero):
                self._publish(model, state, step=state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._publish(model, state, step=state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    # --- publishing ----------------------------------------------------------------------------------

    def _open_store(self, write_model: bool) -> ObjectStore:
        from deltarl.storage.open import open_store

        if isinstance(self._store_arg, str):
            self._store, self._owns_store = open_store(self._store_arg), True
        else:
            self._store = self._store_arg
        if write_model and self.model_info is not None:
            write_model_json(self._store, self.run, self.model_info.to_bytes())
        return self._store

    def _open(self) -> None:
        if self.publisher is not None:
            return
        from deltarl.pipeline.publisher import Publisher

        self.publisher = Publisher(self._open_store(True), self.run, **self.publisher_options)

    def _open_sharded(self, main: bool) -> None:
        """Every rank: a gloo group for the publisher's collectives, the store, and the publisher."""
        if self.publisher is not None:
            return
        import torch.distributed as dist

        from deltarl.pipeline.sharded import ShardedPublisher

        self._group = dist.new_group(backend="gloo")  # collective; ours alone, so it may run off the step
        self.publisher = ShardedPublisher(self._open_store(main), self.run, group=self._group, **self.publisher_options)

    def _record(self, info: Any) -> None:
        self.published.append(info)
        if self.on_published is not None:
            self.on_published(info)

    def _publish(self, model: Any, state: Any, *, step: int) -> None:
        if model is None:
            raise IntegrationError("the trainer passed no model to the callback; cannot publish")
        main = bool(state.is_world_process_zero)
        if self.sharded or main:
            self.wait()  # at most one publish in flight; a failure surfaces here, before the next export
        if self.sharded:
            from deltarl.pipeline.sharded import ShardedPublisher

            assert isinstance(self.publisher, ShardedPublisher)
            self.publisher.publish_model_async(model, step, on_published=self._record)  # copies this rank's shard first
            self._inflight_step = step
            return
        export = gather_bf16(model, is_main=main)  # collective: every rank, same point
        if not main:
            return
        from deltarl.pipeline.publisher import Publisher

        assert isinstance(self.publisher, Publisher)
        self.publisher.publish_async(export, step, owned=True, on_published=self._record)
        self._inflight_step = step

    def wait(self) -> None:
        """Wait for the publish in flight (rank 0; every rank when sharded); a failed one raises
        ``IntegrationError``."""
        if self.publisher is None:
            return
        try:
            self.publisher.wait()
        except PublishFailed as err:
            cause = err.__cause__ or err
            raise IntegrationError(
                f"run {self.run!r}: publishing the weights of step {self._inflight_step} failed: {cause}") from cause

    def close(self) -> None:
        """Wait for the last publish, then release the writer claim (idempotent)."""
        try:
            self.wait()
        finally:
            if self.publisher is not None:
                self.publisher.close()
                self.publisher = None
            if self._group is not None:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group(self._group)
                self._group = None
            if self._owns_store and self._store is not None:
                self._store.close()
            self._store = None


def shards_itself(model: Any) -> bool:
    """True when ``model`` can be published shard by shard: several ranks are up, its parameters are
    DTensors (FSDP2 ``fully_shard``), and it is not a PEFT model (its LoRA needs the gather's merge)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from deltarl.integrations.gather import is_peft

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or is_peft(model):
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _broadcast_flag(flag: bool, is_main: bool) -> bool:
    """Rank 0's ``flag`` on every rank (no-op without an initialised process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    box = [flag if is_main else None]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])
