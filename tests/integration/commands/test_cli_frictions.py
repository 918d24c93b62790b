"""What a new user trips on at the command line: a closed pipe, a benchmark the help lists, the
files replay and follow write, an unreachable relay, an audit with nothing to audit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltarl.cli import build_parser
from deltarl.storage import LocalStore
from tests.fixtures.runs import publish_run

pytestmark = pytest.mark.torch
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    publish_run(LocalStore(root), "r", 3, keyframe_interval=2)
    return root


@pytest.mark.parametrize("argv", [["inspect", "r"], ["inspect", "r", "--json"], ["gc", "r", "--dry-run"],
                                  ["nginx-config", "--upstream", "http://127.0.0.1:8470"], ["--help"], ["inspect", "--help"]])
def test_a_closed_pipe_is_no_error(store_dir: Path, argv: list[str]) -> None:
    """``deltarl … | head``: the reader went away before (or while) the command wrote."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        if "--help" not in argv and argv[0] != "nginx-config":
            argv = [*argv, "--store", str(store_dir)]
        proc = subprocess.run([sys.executable, "-m", "deltarl.cli", *argv], stdout=write_end, stderr=subprocess.PIPE,
                              cwd=REPO, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr.decode() == ""
    # as a process killed by SIGPIPE reports it; argparse's help already ignores a failed write
    assert proc.returncode == (0 if "--help" in argv else 141)


def test_every_benchmark_the_help_lists_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    modules = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.stem.startswith("_"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    for name in modules:
        assert build_parser().parse_args(["bench", name, "--quick"]).name == name
        assert name in listed, name


@pytest.mark.slow
def test_replay_and_follow_write_the_same_file_honouring_the_umask(store_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from deltarl.pipeline.reader import RunReader
    from deltarl.pipeline.replay import replay
    from tests.fixtures.runs import states_equal

    outs = {}
    for name, argv, umask, mode in [("replay-1", ["replay", "r", "--no-progress"], 0o022, 0o644),
                                    ("replay-2", ["replay", "r", "--no-progress"], 0o077, 0o600),
                                    ("follow", ["follow", "r", "--until-version", "2"], 0o022, 0o644)]:
        out = tmp_path / f"{name}.safetensors"
        proc = subprocess.run([sys.executable, "-m", "deltarl.cli", *argv, "--store", str(store_dir), "--out", str(out)],
                              capture_output=True, text=True, cwd=REPO, timeout=120, umask=umask)
        assert proc.returncode == 0, proc.stderr
        assert out.stat().st_mode & 0o777 == mode, (name, oct(out.stat().st_mode))
        outs[name] = out.read_bytes()
    # one version, one file, whichever command or process wrote it
    assert outs["replay-1"] == outs["replay-2"] == outs["follow"]
    path = tmp_path / "follow.safetensors"
    assert states_equal(load_file(path), replay(LocalStore(store_dir), "r"))
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"run": "r", "version": "2", "version_id": RunReader(LocalStore(store_dir), "r").manifest(2)[1]}


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_an_unreachable_relay_is_one_clear_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    proc = subprocess.run([sys.executable, "-m", "deltarl.cli", "inspect", "r", "--store", url], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert f"cannot reach {url}: connection refused (gave up after 8 attempts)" in last, proc.stderr
    assert "NewConnectionError" not in proc.stderr
    assert "HTTPConnection(" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_unreachable_relay_through_the_async_client() -> None:
    import asyncio

    from deltarl.errors import TransientStoreError
    from deltarl.storage.http_client import RelayClient

    url = f"http://127.0.0.1:{_closed_port()}"

    async def head() -> None:
        async with RelayClient(url) as client:
            await client.head("r/run.json")

    with pytest.raises(TransientStoreError) as err:
        asyncio.run(head())
    assert str(err.value) == f"HEAD {url}/r/run.json: cannot reach {url}: connection refused"


def test_an_audit_with_no_rollouts_is_no_failure(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deltarl.cli import main

    assert main(["audit", "r", "--store", str(store_dir)]) == 0
    assert "no rollouts to audit" in capsys.readouterr().out
    assert main(["audit", "r", "--store", str(store_dir), "--require-rollouts"]) == 1
    err = capsys.readouterr().err
    assert "no rollouts to audit" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["audit", "nosuch", "--store", str(store_dir)]) == 1  # a run that is not there still fails
    assert "no run 'nosuch'" in capsys.readouterr().err
    (store_dir / "r" / "versions" / "000000000001" / "manifest.json").write_bytes(b"{}")
    assert main(["audit", "r", "--store", str(store_dir)]) == 1  # and so does a broken chain
    assert "no rollouts to audit" not in capsys.readouterr().out
