"""The user-facing surface: ``deltarl``'s entry points and each package's curated ``__all__``.

One mechanism serves every package (:func:`deltarl.lazy.lazy_exports`, listed in the package's
``__init__``), the names are few, and each earns its place: another part of deltarl, a benchmark or
an example imports it, or the docs show it.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import deltarl

ROOT = Path(deltarl.__file__).parent
REPO = ROOT.parent
PACKAGES = sorted(p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in ROOT.glob("**/__init__.py") if p.parent != ROOT)
MAX_EXPORTED = 60


def test_import_deltarl_is_light() -> None:
    code = "import sys, deltarl; deltarl.open_store; deltarl.Publisher; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'aiohttp', 'boto3'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_entry_points_resolve_and_are_documented() -> None:
    for name in deltarl.__all__:
        obj = getattr(deltarl, name)
        assert obj is not None, name
    for name in ("open_store", "Publisher", "ShardedPublisher", "replay", "RunReader"):
        doc = getattr(deltarl, name).__doc__ or ""
        assert "Example:" in doc, name
        assert "Args:" in doc or "Args:" in (getattr(deltarl, name).__init__.__doc__ or ""), name
    with pytest.raises(AttributeError, match="no_such"):
        deltarl.no_such  # noqa: B018


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_exports_what_it_lists(package: str) -> None:
    module = importlib.import_module(f"deltarl.{package}")
    names = getattr(module, "__all__", [])
    assert isinstance(names, list)
    assert len(set(names)) == len(names), f"deltarl.{package}: a name listed twice"
    for name in names:
        assert getattr(module, name) is not None, f"deltarl.{package}.{name}"
        sub = ROOT / package.replace(".", "/") / name
        assert not sub.with_suffix(".py").exists(), f"deltarl.{package}.{name} is also a module"
        assert not sub.is_dir(), f"deltarl.{package}.{name} is also a package"


def _package_imports() -> dict[str, dict[str, str]]:
    """``{package: {name: importing module}}`` of every ``from deltarl.<package> import name`` (the
    package itself, not one of its modules; a submodule by name aside) written in deltarl."""
    out: dict[str, dict[str, str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("deltarl.")):
                continue
            package = node.module.removeprefix("deltarl.")  # type: ignore[union-attr]
            folder = ROOT / package.replace(".", "/")
            if not (folder / "__init__.py").exists():
                continue
            for alias in node.names:
                if not ((folder / f"{alias.name}.py").exists() or (folder / alias.name).is_dir()):
                    out.setdefault(package, {}).setdefault(alias.name, str(rel))
    return out


def test_deltarl_imports_names_from_their_modules() -> None:
    # through a package, a name is typed Any (the package resolves it lazily) and becomes surface
    through = [
        f"deltarl.{package}.{name} (imported by deltarl/{where})"
        for package, names in sorted(_package_imports().items())
        for name, where in sorted(names.items())
    ]
    assert not through, "import it from the module that defines it: " + ", ".join(through)


def _surfaces() -> dict[str, list[str]]:
    """``{package: its __all__}``, ``deltarl`` itself included (without ``__version__``)."""
    out = {"deltarl": [n for n in deltarl.__all__ if n != "__version__"]}
    for package in PACKAGES:
        out[f"deltarl.{package}"] = list(getattr(importlib.import_module(f"deltarl.{package}"), "__all__", []))
    return out


def test_few_names_are_exported() -> None:
    counts = {package: len(names) for package, names in _surfaces().items() if names}
    assert sum(counts.values()) <= MAX_EXPORTED, counts


def test_every_package_exports_through_one_mechanism() -> None:
    assert not hasattr(importlib.import_module("deltarl.lazy"), "SURFACE")
    for init in [ROOT / "__init__.py", *(ROOT / p.replace(".", "/") / "__init__.py" for p in PACKAGES)]:
        tree = ast.parse(init.read_text())
        rel = init.relative_to(REPO)
        for node in tree.body:  # module level only: a TYPE_CHECKING block may name types for checkers
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                assert module in ("__future__", "typing", "deltarl.lazy"), f"{rel} imports {module} (export lazily)"
            if isinstance(node, ast.FunctionDef):
                raise AssertionError(f"{rel} defines {node.name} (use deltarl.lazy.lazy_exports)")
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "lazy_exports"]
        module = importlib.import_module(str(rel.parent).replace("/", "."))
        assert calls or not getattr(module, "__all__", []), f"{rel} exports names without lazy_exports"


def _users() -> dict[str, set[str]]:
    """``{name: the places outside deltarl's own package that import it from deltarl}``: other
    packages of deltarl, benchmarks and examples (tests do not count: a test is no user)."""
    out: dict[str, set[str]] = {}
    files = [*ROOT.rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"), *(REPO / "examples").rglob("*.py")]
    for path in files:
        rel = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("deltarl"):
                for alias in node.names:
                    out.setdefault(alias.name, set()).add(f"{rel}:{node.module}")
    return out


def test_every_exported_name_is_used_or_documented() -> None:
    users = _users()
    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    unused = []
    for package, names in _surfaces().items():
        own = "deltarl/" + package.removeprefix("deltarl").strip(".").replace(".", "/")
        for name in names:
            outside = {u for u in users.get(name, ()) if not u.startswith(own.rstrip("/") + "/") or package == "deltarl"}
            outside = {u for u in outside if u.split(":")[1].startswith(package)}
            if not outside and not re.search(rf"\b{re.escape(name)}\b", docs):
                unused.append(f"{package}.{name}")
    assert not unused, "exported but neither used outside its package nor shown in the docs: " + ", ".join(unused)
