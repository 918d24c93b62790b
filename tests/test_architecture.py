"""The package layering of docs/ARCHITECTURE.md, enforced by reading every import (ast, no import side effects).

Each top-level part of ``deltarl`` is one role; imports point only downward. A module may import
anything inside its own part, and from other parts only those listed for it below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "deltarl"

BASE = {"errors", "defaults", "configfile", "exposition", "lazy"}
# part -> the other parts it may import
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "defaults": set(),
    "configfile": {"errors"},
    "exposition": set(),
    "lazy": set(),
    "storage": BASE,
    "codec": {"errors", "lazy"},  # the delta format knows nothing of stores, runs or configuration
    "pipeline": BASE | {"storage", "codec"},
    "model": BASE | {"storage", "codec", "pipeline"},
    "protocol": BASE | {"storage", "codec", "pipeline", "model"},
    "relay": BASE | {"storage", "codec", "pipeline"},
    "actor": BASE | {"storage", "codec", "pipeline", "model", "protocol", "relay"},
    # the in-place updater every engine adapter drives (over the actor's subscriber and fetcher)
    "updater": BASE | {"storage", "codec", "pipeline", "model", "actor"},
    "coordinator": BASE | {"storage", "codec", "pipeline", "model", "protocol"},
    "trainer": BASE | {"storage", "codec", "pipeline", "model", "protocol"},
    # integrations.vllm runs inside vLLM's workers and reads the run through the actor's fetcher
    "integrations": BASE | {"storage", "codec", "pipeline", "model", "protocol", "trainer", "actor", "updater"},
}
TOP = {"__init__", "cli", "demo", "commands", "testing"}  # may import everything


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "deltarl" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    own = ".".join(("deltarl", *path.relative_to(root).with_suffix("").parts))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module
                pkg = own.split(".")[: -node.level if path.name != "__init__.py" else len(own.split(".")) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((node.lineno, base))
    return found


def _violations(root: Path = PACKAGE) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        me = rel.parts[0].removesuffix(".py")
        for lineno, module in _imports(path, root):
            other = _part(module)
            if other is None or other == me or me in TOP:
                continue
            if me not in ALLOWED:
                out.append(f"{rel}: part {me!r} is not in the layer table")
                break
            if other not in ALLOWED.get(me, set()):
                out.append(f"{rel}:{lineno}: {me} imports {module} ({other} is not below {me})")
    return out


def test_imports_point_only_downward():
    assert _violations() == []


def test_every_part_is_in_the_table():
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts - set(ALLOWED) - TOP - {"py"} == set()


@pytest.mark.parametrize(
    "source", ["from deltarl.trainer.grpo import x", "import deltarl.actor.loop", "from ...relay import server"]
)
def test_the_check_catches_an_upward_import(tmp_path, source):
    # a module of the pipeline that imports a role above it is reported, relative imports included
    probe = tmp_path / "deltarl" / "pipeline" / "sub" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(source + "\n")
    assert [v.split(":")[0] for v in _violations(tmp_path / "deltarl")] == ["pipeline/sub/probe.py"]


def _module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the deltarl modules it imports (anywhere in the file, lazy and type-only imports too)."""
    modules = {
        ".".join(("deltarl", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in root.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        named = [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level for alias in node.names]
        for imported in [m for _, m in _imports(path, root)] + [m for m in named if m in modules]:
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()  # "from deltarl.x.y import name": the module is deltarl.x.y (or deltarl.x)
            target = ".".join(parts)
            if target and target != "deltarl" and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    # a module imports its own package's __init__ freely; any other loop (lazy imports included) is a cycle
    assert _cycles(_module_graph()) == []


def test_the_cycle_check_finds_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "deltarl" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from deltarl.demo.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from deltarl.demo import a\n")
    assert _cycles(_module_graph(tmp_path / "deltarl")) == [["deltarl.demo.a", "deltarl.demo.b"]]


def test_the_codec_imports_nothing_of_the_pipeline(tmp_path):
    # the delta format sits below the run namespace: a codec module importing the pipeline (or a
    # store) is reported
    probe = tmp_path / "deltarl" / "codec" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from deltarl.pipeline.layout import RunLayout\nimport deltarl.storage.local\n")
    assert [v.split(":")[0] for v in _violations(tmp_path / "deltarl")] == ["codec/probe.py", "codec/probe.py"]
