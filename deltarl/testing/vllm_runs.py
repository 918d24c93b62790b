"""Runs for the vLLM engine's tests and benchmark: a local checkpoint built from a config, and
versions that change a fraction of its BF16 elements (never a download)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from deltarl.model.checkpoint import write_checkpoint

if TYPE_CHECKING:
    import torch

__all__ = ["changes_between", "evolve", "shut_engine", "write_checkpoint"]


def evolve(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with about ``fraction`` of each tensor's elements moved by a few BF16
    ulps (the shape of an RL step at post-training learning rates)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        new = t.clone()
        bits = new.view(-1).view(torch.int16)
        k = max(1, int(bits.numel() * fraction))
        idx = torch.randint(0, bits.numel(), (k,), generator=gen)
        step = torch.randint(1, 4, (k,), generator=gen, dtype=torch.int32) * (torch.randint(0, 2, (k,), generator=gen, dtype=torch.int32) * 2 - 1)
        moved = bits[idx].to(torch.int32) + step
        # a step must not wrap the int16 bits (0x0000 - 1 is a NaN) nor leave the finite values
        keep = (moved >= -(1 << 15)) & (moved < (1 << 15))
        moved16 = moved.clamp(-(1 << 15), (1 << 15) - 1).to(torch.int16)
        keep &= torch.isfinite(moved16.view(torch.bfloat16))
        bits[idx[keep]] = moved16[keep]
        out[name] = new
    return out


def changes_between(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per tensor: the flat int64 positions whose bits differ, and the new values there."""
    import torch

    out = {}
    for name, t in new.items():
        a, b = old[name].view(-1).view(torch.int16), t.view(-1).view(torch.int16)
        idx = torch.nonzero(a != b).view(-1)
        out[name] = (idx, t.view(-1)[idx].clone())
    return out


# --- run inside a vLLM worker by the benchmark (llm.collective_rpc(fn, args=...); needs
# VLLM_ALLOW_INSECURE_SERIALIZATION=1): measurements only, on the worker's own model ---------------

def worker_memory(worker: Any) -> dict[str, int]:
    """The worker process's resident and peak resident bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def worker_vllm_sparse(worker: Any, path: str) -> float:
    """Seconds vLLM's own sparse path (``load_checkpoint_weight_patches``) takes to apply the
    changes saved at ``path`` (``{name: (shape, positions, values)}``) to the worker's model."""
    import time

    import torch
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    changes = torch.load(path)
    patches = [CheckpointWeightPatch(name, tuple(shape), vals.dtype, vals, idx) for name, (shape, idx, vals) in changes.items()]
    t0 = time.perf_counter()
    load_checkpoint_weight_patches(worker.model_runner.model, patches)
    return time.perf_counter() - t0


def worker_dense_reload(worker: Any) -> float:
    """Seconds a dense ``load_weights`` of the served state takes (read from the engine's views first)."""
    import time

    engine = worker.weight_transfer_engine
    state = [(name, t.clone()) for name, t in engine.views.items()]
    t0 = time.perf_counter()
    worker.model_runner.model.load_weights(state)
    took = time.perf_counter() - t0
    del state
    return took


def worker_scatter(worker: Any, path: str, repeats: int = 5) -> dict[str, Any]:
    """A plain ``index_copy_`` of the changes saved at ``path`` into the engine's views, in the worker
    (the same cores vLLM gives the worker's commit: on a small host vLLM reserves cores for its
    scheduler): median seconds, and the CPUs and torch threads the worker has. The values are the
    served ones (the last version's): nothing changes."""
    import os
    import statistics
    import time

    import torch

    views = worker.weight_transfer_engine.views
    changes = torch.load(path)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for name, (_shape, idx, vals) in changes.items():
            views[name].view(-1).index_copy_(0, idx, vals)
        times.append(time.perf_counter() - t0)
    return {"scatter_s": statistics.median(times), "cpus": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads()}


def shut_engine(llm: Any) -> None:
    """Stop a ``vllm.LLM``'s engine and close its client's zmq context, which vLLM's shutdown leaves
    to the garbage collector (whose ResourceWarning, during a later test, fails the session).

    vLLM 0.32's shutdown names each child process before killing it; a child that exits in between
    raises ``psutil.NoSuchProcess`` out of the shutdown and leaves the rest undone (a TP 2 engine
    whose workers outlived the grace period on a loaded box): that rest is done here."""
    import psutil

    core = llm.llm_engine.engine_core
    try:
        core.shutdown()
    except psutil.NoSuchProcess:
        for proc in getattr(core.resources.engine_manager, "processes", []):
            if proc.pid is not None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        with contextlib.suppress(psutil.NoSuchProcess):
                            child.kill()
            if proc.is_alive():
                proc.kill()
            proc.join(10)
        core.resources()
    ctx = getattr(core, "ctx", None)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)
