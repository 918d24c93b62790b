"""deltarl.actor: the rollout actor — fetch, stage and commit weight versions; generate; report.

* :mod:`~deltarl.actor.fetcher` - ``Fetcher``: multi-stream ranged fetch from relays, failing over to the origin
* :mod:`~deltarl.actor.subscriber` - ``Subscriber``: keeps a state following a run, one verified commit at a time
* :mod:`~deltarl.actor.weights` - ``Weights``: the subscriber on the actor's own thread, behind a generation backend
* :mod:`~deltarl.actor.loop` - ``ActorLoop``: lease, generate, report; ``ActorConfig`` in :mod:`~deltarl.actor.config`
* :mod:`~deltarl.actor.backends` - Hugging Face and vLLM generation backends
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": ("ActorConfig",),
    "loop": ("ActorLoop",),
    "fetcher": ("Fetcher",),
    "follower": ("Follower",),
})
