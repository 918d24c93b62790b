"""``compile_codec`` holds an exclusive lock on numba's cache of the codec while it compiles, so two
processes starting at once (the main and the vLLM test suites, containers on one volume) compile each
kernel once and never write one cache index at once; a second caller waits, then loads."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deltarl.codec import jit_warmup, kernels


def _held_elsewhere(path: Path) -> bool:
    """Whether another open file description holds ``path``'s flock (flock locks conflict between
    descriptors, in one process too)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_the_lock_lives_in_numbas_cache_dir_and_is_exclusive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    lock = jit_warmup.cache_dir() / "deltarl-jit-warmup.lock"
    assert lock.parent.is_relative_to(tmp_path)
    with jit_warmup.cache_lock():
        assert lock.exists()
        assert _held_elsewhere(lock)
    assert not _held_elsewhere(lock)  # released on the way out


@pytest.mark.skipif(kernels.jit() is None, reason="numba is off: compile_codec compiles nothing")
def test_compile_codec_waits_for_a_process_holding_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    lock = jit_warmup.cache_dir() / "deltarl-jit-warmup.lock"
    seen: list[bool] = []
    monkeypatch.setattr(jit_warmup, "warm_codec", lambda dtypes: seen.append(_held_elsewhere(lock)))
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(  # another process holds the lock until its stdin closes
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        done = threading.Event()

        def compile_then_set() -> None:
            jit_warmup.compile_codec(["bfloat16"])
            done.set()

        worker = threading.Thread(target=compile_then_set)
        worker.start()
        assert not done.wait(0.5)  # blocked on the other process's lock
        assert holder.stdin is not None
        holder.stdin.close()  # the holder exits, its lock goes with it
        assert done.wait(30)
        worker.join()
    finally:
        holder.kill()
        holder.wait()
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
    assert seen == [True]  # it compiled holding the lock
