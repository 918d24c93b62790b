"""The commit pause taken apart inside a vLLM worker (run by ``benchmarks.vllm_update`` at TP 1).

:func:`worker_commit_parts` runs in the worker (``llm.collective_rpc``): it puts the served state
back at the previous version with a plain ``index_copy_`` of the old values, stages the last
version again through the subscriber's own path (fetch, decode, :class:`Stager`), then times,
interleaved, on the thread the engine commits on (the updater's event loop) and on the worker's
main thread: the plain ``index_copy_`` of the same changes, deltarl's commit and rollback, and the
commit's parts (resolving the targets, listing the tensors' tasks, the checked-write kernel alone,
a bare scatter of the same positions). The state ends at the served version, bit for bit.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def _on_loop(updater: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` on the updater's event-loop thread (where the engine's commit runs), waited for."""

    async def run() -> Any:
        return fn()

    return updater._call(run())


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _thread_info() -> dict[str, Any]:
    import torch

    from deltarl.codec.kernels import worker_threads

    return {"cpus": len(os.sched_getaffinity(0)), "deltarl_threads": worker_threads(), "torch_threads": torch.get_num_threads()}


def worker_commit_parts(worker: Any, changes_path: str, old_path: str, version: int, repeats: int = 5) -> dict[str, Any]:
    """The commit pause of ``version`` and its parts, in the worker (see the module docstring)."""
    import torch

    from deltarl.actor.prefetch import VersionStaging
    from deltarl.codec import kernels

    updater = worker.weight_transfer_engine.updater
    views, sub = updater.views, updater._sub
    changes = torch.load(changes_path)
    olds = torch.load(old_path)
    idx = {n: i for n, (_s, i, _v) in changes.items()}
    new = {n: v for n, (_s, _i, v) in changes.items()}

    def copy(vals: dict[str, Any]) -> None:
        for name, i in idx.items():
            views[name].view(-1).index_copy_(0, i, vals[name])

    copy(olds)  # the previous version, served again
    manifest, _vid = updater._call(sub._source.manifest(version))
    staging = VersionStaging(views, manifest.parent)
    try:
        t0 = time.perf_counter()
        update = updater._call(staging.complete(sub.fetcher, manifest))
        stage_s = time.perf_counter() - t0
    finally:
        staging.close()
    jobs, _ = update._targets("commit")
    tasks = update._cpu_tasks(jobs, True)  # (job, flat bit view, positions, old bits, new bits) per tensor
    k = kernels.jit()

    def kernel_only() -> None:  # the checked write, one call per tensor, nothing around it
        for _i, flat, pos, other, vals in tasks:
            k.write_strict(flat, pos, other, vals)

    def undo_parts() -> None:
        for _i, flat, pos, other, _vals in tasks:
            k.scatter(flat, pos, other)

    def scatter_only() -> None:
        for _i, flat, pos, _other, vals in tasks:
            k.scatter(flat, pos, vals)

    runs: dict[str, list[float]] = {key: [] for key in (
        "index_copy_main", "index_copy_loop", "commit_loop", "rollback_loop", "commit_main", "targets_loop",
        "tasks_loop", "kernel_loop", "scatter_loop")}
    for _ in range(repeats):  # interleaved: load swings hit every variant alike; each ends at the old values
        runs["index_copy_main"].append(_timed(lambda: copy(new)))
        copy(olds)
        runs["index_copy_loop"].append(_on_loop(updater, lambda: _timed(lambda: copy(new))))
        copy(olds)
        runs["commit_loop"].append(_on_loop(updater, lambda: _timed(update.commit)))
        runs["rollback_loop"].append(_on_loop(updater, lambda: _timed(update.rollback)))
        runs["commit_main"].append(_timed(update.commit))
        update.rollback()
        runs["targets_loop"].append(_on_loop(updater, lambda: _timed(lambda: update._targets("commit"))))
        runs["tasks_loop"].append(_on_loop(updater, lambda: _timed(lambda: update._cpu_tasks(jobs, True))))
        if k is not None:
            runs["kernel_loop"].append(_on_loop(updater, lambda: _timed(kernel_only)))
            undo_parts()
            runs["scatter_loop"].append(_on_loop(updater, lambda: _timed(scatter_only)))
            undo_parts()
    update.commit()  # the served version again
    out: dict[str, Any] = {key: statistics.median(v) for key, v in runs.items() if v}
    out["runs"] = runs
    out["stage_s"] = stage_s
    out["tensors"] = len(jobs)
    out["changed"] = update.changed_elements
    out["main_thread"] = _thread_info()
    out["loop_thread"] = _on_loop(updater, _thread_info)
    try:
        import numba

        out["numba_threading_layer"] = str(numba.config.THREADING_LAYER)
        out["numba_threads"] = int(numba.get_num_threads())
    except ImportError:
        pass
    return out
