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
    from deltarl.errors import DeltaRLError
    from deltarl.integrations.trl import DeltaRLCallback
    from deltarl.pipeline.publish_config import PublishConfig
    from deltarl.pipeline.publisher import Publisher
    from deltarl.pipeline.reader import RunReader
    from deltarl.pipeline.replay import replay
    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.pipeline.writer import VersionInfo
    from deltarl.storage.open import open_store
    from deltarl.storage.store import ObjectStore

__getattr__, __dir__, _names = lazy_exports(__name__)
__all__ = [
    "DeltaRLCallback",
    "DeltaRLError",
    "ObjectStore",
    "PublishConfig",
    "Publisher",
    "RunReader",
    "ShardedPublisher",
    "VersionInfo",
    "__version__",
    "open_store",
    "replay",
]
