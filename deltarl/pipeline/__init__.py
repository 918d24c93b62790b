"""deltarl.pipeline: the version pipeline on an object store.

The run namespace (layout, manifests and records), the writer claim, the ``Publisher`` (and
``ShardedPublisher``, one per rank), the ``RunReader``, ``replay`` (those five are ``deltarl.*``),
``gc`` and ``inspect_run``. Exported here: :class:`RunLayout` (where a run's objects live) and
:func:`inspect_run`. The delta format itself is :mod:`deltarl.codec`.

Importing this package imports neither torch nor numba.
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "layout": ("RunLayout",),
    "inspection": ("inspect_run",),
})
