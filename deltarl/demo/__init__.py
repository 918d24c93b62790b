"""``deltarl demo``: the whole loop as a multi-process deployment on one machine (runner, live view, report)."""
from __future__ import annotations

from deltarl.lazy import lazy_exports

#: Public name -> the module that defines it (imported on first use: ``import deltarl.demo`` stays light).
_EXPORTS = {
    "DemoOptions": "deltarl.demo.runner",
    "run_demo": "deltarl.demo.runner",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
