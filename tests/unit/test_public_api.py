"""The user-facing surface: ``deltarl``'s entry points and each package's curated ``__all__``."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import deltarl

PACKAGES = ["actor", "commands", "coordinator", "demo", "model", "pipeline", "protocol", "relay", "storage", "testing", "trainer"]


def test_import_deltarl_is_light() -> None:
    code = "import sys, deltarl; deltarl.open_store; deltarl.Publisher; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'aiohttp', 'boto3'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_entry_points_resolve_and_are_documented() -> None:
    for name in deltarl.__all__:
        obj = getattr(deltarl, name)
        assert obj is not None, name
    assert sorted(set(deltarl.__all__) - {"__version__"}) == sorted(__import__("deltarl.lazy").lazy.surface("deltarl"))
    for name in ("open_store", "Publisher", "ShardedPublisher", "replay", "RunReader"):
        doc = getattr(deltarl, name).__doc__ or ""
        assert "Example:" in doc, name
        assert "Args:" in doc or "Args:" in (getattr(deltarl, name).__init__.__doc__ or ""), name
    with pytest.raises(AttributeError, match="no_such"):
        deltarl.no_such  # noqa: B018


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_exports_what_it_lists(package: str) -> None:
    module = importlib.import_module(f"deltarl.{package}")
    assert isinstance(module.__all__, list)
    assert module.__all__ == sorted(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"deltarl.{package}.{name}"
