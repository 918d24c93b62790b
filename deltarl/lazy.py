"""Lazy package exports: a package names its public API and imports each module on first use.

``import deltarl.actor`` (and ``deltarl --help``) must not pay for torch, aiohttp or boto3, so a
package's ``__init__`` declares ``name -> module`` and lets this build its ``__getattr__``::

    __getattr__, __dir__ = lazy_exports(__name__, {"Fetcher": "deltarl.actor.fetcher"})
    __all__ = sorted(...)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name in ``exports`` is imported from its
    module on first access; any other name is an AttributeError, as for a plain module."""
    table = dict(exports)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        import sys

        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
