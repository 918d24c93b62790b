"""The one way a deltarl package exports names: listed in its ``__init__``, imported on first use.

``import deltarl`` (and ``deltarl --help``, and ``import deltarl.actor.fetcher``) must not pay for
torch, aiohttp or boto3, so a package's ``__init__`` imports none of its modules. It lists its
surface, module by module, and :func:`lazy_exports` imports a name's module when the name is
first read::

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"encode": ("encode_delta",)})

``tests/unit/test_public_api.py`` checks every package's surface: that each name resolves, is
used by another part of deltarl, a benchmark or an example, or shown in the docs, and that the
names exported across deltarl stay few.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, whose public names are ``exports``:
    ``{module relative to the package: (name, ...)}``. A name's module is imported on its first
    access; any other name is an AttributeError (so a submodule is still imported by name)."""
    table = {name: f"{package}.{module}" for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__, sorted(table)
