"""``deltarl follow`` on a run that is deleted and re-created under the same name (issue 33.12): it
recovers to the new run (its output is ``replay`` of the new run) or stops with one clear error
(a non-zero exit, one message, no ERROR log lines, no stale output); it never keeps looping."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.replay import replay
from deltarl.storage import LocalStore
from tests.fixtures.runs import TinyTrainer, publish_run, states_equal

pytestmark = [pytest.mark.torch, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[3]
RUN = "r"


def _follow(source: list[str], out: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.Popen([sys.executable, "-m", "deltarl.cli", "-v", "follow", RUN, *source, "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(proc: subprocess.Popen[str], text: str, timeout: float = 60.0) -> list[str]:
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + timeout
    for line in proc.stderr:
        lines.append(line)
        if text in line:
            return lines
        assert time.monotonic() < deadline, "".join(lines)
    raise AssertionError(f"the follower exited before {text!r}:\n{''.join(lines)}")


def _recreate(store: LocalStore, versions: int, seed: int, shapes: Any = None) -> list[dict[str, Any]]:
    for key in list(store.list(f"{RUN}/")):
        store.delete(key)
    trainer = TinyTrainer(seed, shapes=shapes)
    exports = []
    with Publisher(store, RUN) as pub:
        for step in range(versions):
            trainer.step()
            exports.append(trainer.export())
            pub.publish(exports[-1], step)
    return exports


def _finish(proc: subprocess.Popen[str], timeout: float = 60.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the follower was still running {timeout}s later:\n{proc.communicate()[1]}") from None
    return proc.returncode, err


def _stopped_with_one_error(rc: int, err: str, out: Path, cause: str) -> None:
    assert rc != 0, err
    assert [line for line in err.splitlines() if " ERROR " in line] == [], err
    said = [line for line in err.splitlines() if line.startswith("deltarl follow: ")]
    assert len(said) == 1, err
    assert cause in said[0], err
    assert not out.exists()  # no weights of a run that is gone


@pytest.mark.parametrize("through", ["origin", "relay"])
def test_a_run_recreated_with_other_tensors_stops_the_follower_with_one_error(background_relay: Any, tmp_path: Path,
                                                                             through: str) -> None:
    store = LocalStore(tmp_path / "store")
    publish_run(store, RUN, 2)
    source = ["--store", str(tmp_path / "store")] if through == "origin" else [
        "--relay", background_relay(str(tmp_path / "store")).url]
    out = tmp_path / "w.safetensors"
    with _follow(source, out) as proc:
        try:
            _wait_for(proc, "bootstrapped version 1")
            _recreate(store, 3, seed=3, shapes={"only": ((8, 8), "bfloat16")})
            rc, err = _finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
    # the origin shows the new tensor table; a relay still serves the old run's immutable objects
    # (run.json, version 1), so there the new history does not chain from its newest keyframe
    _stopped_with_one_error(rc, err, out, "another tensor table" if through == "origin" else "does not chain")


def test_a_run_recreated_with_the_same_tensors_is_followed_to_the_new_runs_state(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    publish_run(store, RUN, 2)
    out = tmp_path / "w.safetensors"
    with _follow(["--store", str(tmp_path / "store")], out, "--until-version", "4") as proc:
        try:
            _wait_for(proc, "bootstrapped version 1")
            new = _recreate(store, 5, seed=7)
            rc, err = _finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 0, err
    assert [line for line in err.splitlines() if " ERROR " in line] == [], err
    from safetensors.torch import load_file

    assert states_equal(load_file(str(out)), replay(store, RUN, 4))
    assert states_equal(load_file(str(out)), new[4])
