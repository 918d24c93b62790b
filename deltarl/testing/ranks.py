"""Spawning torch.distributed ranks for tests, and ending them without the gloo teardown abort.

A gloo rank that returns normally can die with SIGABRT ("terminate called without an active
exception") while the interpreter finalizes: C++ threads the process group or its store still own
are destroyed joinable. Tests and benchmarks that spawn ranks end them here instead: wait for every
rank (when all are alive), destroy the group, flush, and leave with ``os._exit`` so no finalizer runs.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def leave_process_group(exit_code: int = 0, *, barrier: bool = True, flush: tuple[Any, ...] = ()) -> None:
    """Destroy the default process group and end this process with ``exit_code``.

    ``barrier=False`` when a peer may be dead (a killed rank would make the barrier wait out its
    timeout). ``flush`` holds multiprocessing queues whose pending items must reach the parent first.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    for queue in flush:
        queue.close()
        queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


@contextmanager
def traceback_to(path: str | os.PathLike[str]) -> Iterator[None]:
    """Write the traceback of whatever the block raises to ``path``, then re-raise: a spawned rank's
    stderr is not the test's, so the parent reads the file to fail with the rank's own error."""
    try:
        yield
    except BaseException:
        Path(path).write_text(traceback.format_exc())
        raise


def spawn_ranks(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 240.0) -> list[int | None]:
    """Run ``target(rank, world, *args)`` in ``world`` spawned processes and return their exit codes
    (a process still running after ``timeout_s`` is killed: ``-SIGKILL``)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, world, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]
