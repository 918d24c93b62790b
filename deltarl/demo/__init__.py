"""``deltarl demo``: the whole loop as a multi-process deployment on one machine (runner, live view, report)."""
from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__)  # its names: deltarl.lazy.SURFACE
