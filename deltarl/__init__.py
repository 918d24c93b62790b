"""deltarl: lossless sparse weight deltas for RL post-training across regions.

The entry points (imported on first use, so ``import deltarl`` and ``deltarl --help`` stay fast
and never import torch):

* :func:`open_store` - an object store from a URL (path, ``file://``, ``memory://``, ``s3://``, ``http(s)://`` relay)
* :class:`Publisher` (with :class:`PublishConfig`) - the trainer side: publish each policy version
* :func:`replay` - any committed version's full state, rebuilt and checked from the store
* :class:`Subscriber` (with :class:`Fetcher`) - the actor side: follow a run, one verified commit at a time
* :func:`encode_delta` / :func:`apply_delta` - the codec alone: a lossless sparse delta between two states

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
    from deltarl.actor.fetcher import Fetcher
    from deltarl.actor.subscriber import Subscriber
    from deltarl.codec.apply import apply_delta, stage_delta
    from deltarl.codec.encode import encode_delta
    from deltarl.errors import DeltaRLError
    from deltarl.pipeline.publish_config import PublishConfig
    from deltarl.pipeline.publisher import Publisher
    from deltarl.pipeline.replay import replay
    from deltarl.storage.open import open_store
    from deltarl.storage.store import ObjectStore

#: Public name -> the module that defines it.
_EXPORTS = {
    "DeltaRLError": "deltarl.errors",
    "Fetcher": "deltarl.actor.fetcher",
    "ObjectStore": "deltarl.storage.store",
    "PublishConfig": "deltarl.pipeline.publish_config",
    "Publisher": "deltarl.pipeline.publisher",
    "Subscriber": "deltarl.actor.subscriber",
    "apply_delta": "deltarl.codec.apply",
    "encode_delta": "deltarl.codec.encode",
    "open_store": "deltarl.storage.open",
    "replay": "deltarl.pipeline.replay",
    "stage_delta": "deltarl.codec.apply",
}

__all__ = [
    "DeltaRLError",
    "Fetcher",
    "ObjectStore",
    "PublishConfig",
    "Publisher",
    "Subscriber",
    "__version__",
    "apply_delta",
    "encode_delta",
    "open_store",
    "replay",
    "stage_delta",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
