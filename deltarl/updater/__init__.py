"""deltarl.updater: keeping an engine's live parameters at a run's version, in place.

* :mod:`~deltarl.updater.inplace` - ``InPlaceUpdater``: what an engine adapter drives (attach, take
  the version staged in the background, commit at the engine's safe point), over the actor's
  subscriber: the one update mechanism
* :mod:`~deltarl.updater.probe` - ``derive_views``: checkpoint names → views of an engine's
  parameters, found by probing the engine's own ``load_weights``
"""
from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "inplace": ("InPlaceUpdater",),
    "probe": ("derive_views",),
})
