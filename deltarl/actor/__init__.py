"""deltarl.actor: the rollout actor — fetch, stage and commit weight versions; generate; report.

* :mod:`~deltarl.actor.fetcher` - ``Fetcher``: multi-stream ranged fetch from relays, failing over to the origin
* :mod:`~deltarl.actor.subscriber` - ``Subscriber``: keeps a state following a run, one verified commit at a time
* :mod:`~deltarl.actor.weights` - ``Weights``: the subscriber on the actor's own thread, behind a generation backend
* :mod:`~deltarl.actor.loop` - ``ActorLoop``: lease, generate, report; ``ActorConfig`` in :mod:`~deltarl.actor.config`
* :mod:`~deltarl.actor.backends` - Hugging Face and vLLM generation backends
"""
from __future__ import annotations

from deltarl.lazy import lazy_exports

#: Public name -> the module that defines it (imported on first use: ``import deltarl.actor`` stays light).
_EXPORTS = {
    "ActorConfig": "deltarl.actor.config",
    "ActorLoop": "deltarl.actor.loop",
    "CommitInfo": "deltarl.actor.subscriber",
    "FetchStats": "deltarl.actor.fetcher",
    "Fetcher": "deltarl.actor.fetcher",
    "Subscriber": "deltarl.actor.subscriber",
    "Weights": "deltarl.actor.weights",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
