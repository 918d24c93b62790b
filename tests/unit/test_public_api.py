"""The user-facing surface: ``deltarl``'s entry points and each package's curated ``__all__``."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import deltarl

PACKAGES = ["actor", "codec", "commands", "coordinator", "demo", "integrations", "model", "pipeline", "protocol", "relay", "storage", "testing", "trainer", "updater"]


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
    assert len(set(module.__all__)) == len(module.__all__), f"deltarl.{package}: a name listed twice"
    for name in module.__all__:
        assert getattr(module, name) is not None, f"deltarl.{package}.{name}"


def _cross_package_imports() -> dict[str, dict[str, str]]:
    """``{package: {name: importing module}}`` of every ``from deltarl.<package>[.module] import name``
    written in another part of deltarl (``cli.py``, which only wires, aside)."""
    root = Path(deltarl.__file__).parent
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    out: dict[str, dict[str, str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts == ("cli.py",) or len(rel.parts) == 1:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("deltarl.")):
                continue
            parts = node.module.split(".")  # type: ignore[union-attr]
            target = parts[1]
            if target not in packages or target == rel.parts[0]:
                continue
            for alias in node.names:
                if len(parts) == 2 and (root / target / f"{alias.name}.py").exists():
                    continue  # a module of the package, imported by name
                out.setdefault(target, {}).setdefault(alias.name, str(rel))
    return out


def test_each_package_lists_what_other_packages_import() -> None:
    missing = [
        f"deltarl.{package}.{name} (imported by deltarl/{where})"
        for package, names in sorted(_cross_package_imports().items())
        for name, where in sorted(names.items())
        if name not in getattr(importlib.import_module(f"deltarl.{package}"), "__all__", [])
    ]
    assert not missing, "add to the package's __all__ (deltarl.lazy.SURFACE for lazy packages): " + ", ".join(missing)
