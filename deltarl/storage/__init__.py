"""deltarl.storage: object stores only — the interface, its backends, and ``open_store``.

Every backend implements ``ObjectStore`` (``get``, ``get_range``, ``put``, ``put_if_absent``,
``exists``, ``list``, ``delete``, ``cas``; :mod:`.store`); ``open_store`` (:mod:`.open`) turns a
URL (a path, ``file://``, ``memory://``, ``s3://``, ``http(s)://``) into one; both are
``deltarl.ObjectStore`` and ``deltarl.open_store``. Exported here: the backends built by hand.
The run namespace on top of a store (manifests, publishing, replay) is :mod:`deltarl.pipeline`.
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "local": ("LocalStore",),
    "memory": ("MemoryStore",),
    "s3": ("S3Store",),
})
