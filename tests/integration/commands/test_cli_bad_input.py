"""Every bad input to a command: one line on stderr, a non-zero exit, no traceback (unless -v),
and read-only commands create nothing."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deltarl.cli import main
from deltarl.storage import LocalStore
from tests.fixtures.runs import publish_run

pytestmark = pytest.mark.torch


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    publish_run(LocalStore(root), "r1", 2)
    return root


def _fails_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str], match: str) -> None:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse refusals
        code = int(exit_.code or 0)
    err = capsys.readouterr().err
    assert code != 0, argv
    assert "Traceback" not in err
    assert match in err, (argv, err)
    assert len([line for line in err.splitlines() if line.strip() and not line.startswith("usage:")]) == 1, err


def test_gc_of_a_missing_run_fails(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_in_one_line(["gc", "nosuch", "--store", str(store_dir)], capsys, "no run 'nosuch'")


@pytest.mark.parametrize("command", [["inspect", "r1"], ["gc", "r1", "--dry-run"], ["audit", "r1"],
                                     ["replay", "r1", "--out", "x.st"]])
def test_read_only_commands_create_no_store(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    missing = tmp_path / "nonexistent" / "dir"
    if command[0] == "replay":
        command = [*command[:-1], str(tmp_path / "x.st")]
    _fails_in_one_line([*command, "--store", str(missing)], capsys, "no store at")
    assert not (tmp_path / "nonexistent").exists()


@pytest.mark.parametrize("url", ["bogus://x", "s3://", ""])
def test_bad_store_urls(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_in_one_line(["inspect", "r1", "--store", url], capsys, "deltarl inspect:")


def test_replay_out_into_a_missing_folder_or_onto_a_folder(store_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _fails_in_one_line(["replay", "r1", "--store", str(store_dir), "--out", str(tmp_path / "no" / "x.st")], capsys,
                       "does not exist")
    _fails_in_one_line(["replay", "r1", "--store", str(store_dir), "--out", str(tmp_path)], capsys, "is a directory")


@pytest.mark.parametrize("last", ["0", "-3", "x"])
def test_inspect_last_must_be_positive(store_dir: Path, last: str, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_in_one_line(["inspect", "r1", "--store", str(store_dir), "--last", last], capsys, "--last")


def test_relay_on_a_busy_port_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "deltarl.cli", "relay", "--upstream", str(tmp_path / "s"), "--cache-dir",
             str(tmp_path / "c"), "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "address already in use" in out.stderr.lower()
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_relay_refuses_a_missing_upstream(tmp_path: Path) -> None:
    missing = tmp_path / "missing" / "dir"
    argv = ["relay", "--upstream", str(missing), "--cache-dir", str(tmp_path / "cache"), "--listen", "127.0.0.1:0"]
    out = subprocess.run([sys.executable, "-m", "deltarl.cli", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "no store at" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "missing").exists()
