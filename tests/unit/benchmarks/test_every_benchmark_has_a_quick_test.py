"""Every benchmark under ``benchmarks/`` has a ``--quick`` mode and a test that runs it, so none can
rot again (the scheduler benchmark once stopped running unnoticed: issue 33.10). A benchmark is a
module of ``benchmarks/`` whose name does not start with ``_``; its quick test is any test file
that runs ``["benchmarks.NAME", "--quick", …]``."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _benchmarks() -> list[str]:
    return sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.stem.startswith("_"))


def _quick_tests() -> dict[str, list[str]]:
    runs = re.compile(r"""["']benchmarks\.(\w+)["']\s*,\s*["']--quick["']""")
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        for name in runs.findall(path.read_text()):
            found.setdefault(name, []).append(path.relative_to(REPO).as_posix())
    return found


def test_there_are_benchmarks_to_check() -> None:
    assert {"codec", "scheduler", "vllm_update"} <= set(_benchmarks())


def test_every_benchmark_has_a_quick_mode() -> None:
    assert [b for b in _benchmarks() if '"--quick"' not in (REPO / "benchmarks" / f"{b}.py").read_text()] == []


def test_every_benchmark_has_a_test_that_runs_its_quick_mode() -> None:
    tests = _quick_tests()
    assert [b for b in _benchmarks() if b not in tests] == [], "add a --quick test (tests/integration/benchmarks/test_bench_quick.py)"


def test_the_vllm_benchmark_runs_where_vllm_is() -> None:
    assert _quick_tests()["vllm_update"] == ["tests/integration/vllm/test_bench_vllm_update_quick.py"]
