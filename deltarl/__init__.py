"""deltarl: lossless sparse weight deltas for RL post-training across regions.

The entry points (imported on first use, so ``import deltarl`` and ``deltarl --help`` stay fast
and never import torch):

* :class:`Publisher` / :class:`ShardedPublisher` (with :class:`PublishConfig`) - the trainer side:
  publish each policy version, from one process or from every rank of a sharded trainer
* :class:`DeltaRLCallback` - the same from a TRL / ``transformers`` trainer, one callback
* :func:`open_store` - an object store from a URL (path, ``file://``, ``memory://``, ``s3://``, ``http(s)://`` relay)
* :func:`replay` and :class:`RunReader` - any committed version rebuilt bit for bit, and the run read back, checked
* :class:`DeltaRLError` - the root of every error (``deltarl.errors``)

The codec alone is :mod:`deltarl.codec`; actors and followers are :mod:`deltarl.actor`; a vLLM
engine takes updates through the ``deltarl`` weight-transfer backend (:mod:`deltarl.integrations.vllm`).

Example:
    >>> import deltarl
    >>> store = deltarl.open_store("memory://example")
    >>> with deltarl.Publisher(store, "run-1") as pub:  # doctest: +SKIP
    ...     pub.publish(model.state_dict(), step=0)
    >>> state = deltarl.replay(store, "run-1")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltarl.lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:
    from deltarl.errors import DeltaRLError as DeltaRLError
    from deltarl.integrations.trl import DeltaRLCallback as DeltaRLCallback
    from deltarl.pipeline.publish_config import PublishConfig as PublishConfig
    from deltarl.pipeline.publisher import Publisher as Publisher
    from deltarl.pipeline.reader import RunReader as RunReader
    from deltarl.pipeline.replay import replay as replay
    from deltarl.pipeline.sharded import ShardedPublisher as ShardedPublisher
    from deltarl.pipeline.writer import VersionInfo as VersionInfo
    from deltarl.storage.open import open_store as open_store
    from deltarl.storage.store import ObjectStore as ObjectStore

__getattr__, __dir__, _names = lazy_exports(__name__, {
    "pipeline.publisher": ("Publisher",),
    "pipeline.sharded": ("ShardedPublisher",),
    "pipeline.publish_config": ("PublishConfig",),
    "pipeline.writer": ("VersionInfo",),
    "pipeline.replay": ("replay",),
    "pipeline.reader": ("RunReader",),
    "storage.open": ("open_store",),
    "storage.store": ("ObjectStore",),
    "integrations.trl": ("DeltaRLCallback",),
    "errors": ("DeltaRLError",),
})
__all__ = [*_names, "__version__"]
