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
