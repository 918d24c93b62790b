"""The ``deltarl`` entry point: every command is wired, help answers without heavy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deltarl.cli import COMMANDS, build_parser


def test_every_command_is_wired() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)  # type: ignore[arg-type]


def test_help_does_not_import_torch() -> None:
    code = "import sys; from deltarl.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_bench_rejects_unknown_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "nope"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["codec", "e2e", "transfer"])
def test_bench_runs_a_benchmark_module_from_the_checkout(name: str) -> None:
    # --help imports the benchmark and its package-relative parts, then exits: no measurement
    proc = subprocess.run([sys.executable, "-m", "deltarl.cli", "bench", name, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_bench_without_a_checkout_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from deltarl.commands import bench

    monkeypatch.setattr(bench, "checkout_root", lambda: None)
    assert bench.run(build_parser().parse_args(["bench", "codec"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "source" in err
