"""``deltarl demo``: the whole loop as a multi-process deployment on one machine (runner, live view, report)."""
from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that defines it (imported on first use: ``import deltarl.demo`` stays light).
_EXPORTS = {
    "DemoOptions": "deltarl.demo.runner",
    "run_demo": "deltarl.demo.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
