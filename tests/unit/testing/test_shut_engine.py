"""``shut_engine`` finishes a vLLM shutdown that raised ``psutil.NoSuchProcess`` half way (vLLM 0.32
names a child process that exited meanwhile): the engine's processes and their children are
killed and the client's resources freed. Real processes; the engine client is a stand-in with
vLLM's attribute names, since the race cannot be forced inside a real engine."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace
from typing import Any

import psutil

from deltarl.testing.vllm_runs import shut_engine


def _engine_core_process() -> None:  # an engine core that started a worker, as vLLM's does
    worker = mp.get_context("fork").Process(target=time.sleep, args=(600,))
    worker.start()
    time.sleep(600)


class _Resources:
    def __init__(self, proc: Any) -> None:
        self.engine_manager = SimpleNamespace(processes=[proc])
        self.freed = False

    def __call__(self) -> None:
        self.freed = True


class _Core:
    def __init__(self, proc: Any) -> None:
        self.resources = _Resources(proc)
        self.ctx = None

    def shutdown(self) -> None:
        raise psutil.NoSuchProcess(12345, "VLLM::Worker_TP0")


def test_a_shutdown_that_raised_half_way_is_finished() -> None:
    proc = mp.get_context("fork").Process(target=_engine_core_process)
    proc.start()
    deadline = time.monotonic() + 30
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = psutil.Process(proc.pid).children()[0]
    core = _Core(proc)
    shut_engine(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core)))
    assert not proc.is_alive()
    worker.wait(10)  # killed (an orphan would sleep on for 600 s)
    assert not worker.is_running()
    assert core.resources.freed
