"""Generation backends by name: the one table the actor, its config, its command and the demo read.

A row says what the actor needs of a backend without importing it (so configs are checked
without torch or vLLM): which engine options it takes, the most of each parallel size it serves,
whether it serves a local checkpoint, and the module of its adapter. The adapter (one file,
``hf.py``, ``vllm.py``) builds the generation backend and the weights handle that updates it.
Nothing else branches on a backend's name: adding an engine is a row here plus its adapter file.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deltarl.errors import ConfigError


@dataclass(frozen=True)
class BackendEntry:
    """One generation backend, as the table knows it (importable without the backend)."""

    name: str
    summary: str
    adapter: str  #: module with ``open_weights`` and ``build`` (``deltarl.actor.backends.base.BackendAdapter``)
    takes_engine_options: bool = False  #: whether ``engine_options`` go to the engine's constructor
    #: the most of each parallel-size engine option the backend serves (absent options count as 1)
    parallel_limits: Mapping[str, int] = field(default_factory=dict)
    parallel_why: str = ""  #: why the limits hold, for the refusal
    needs_checkpoint: bool = False  #: serves a local HF checkpoint (model.name is its path)
    demo_options: Mapping[str, Any] = field(default_factory=dict)  #: engine options on a shared CPU demo box
    demo_env: Mapping[str, str] = field(default_factory=dict)  #: environment defaults of its demo actors

    def load(self) -> Any:
        """The adapter module, a ``BackendAdapter`` (imported now: torch, and the engine where it has one)."""
        return importlib.import_module(self.adapter)

    def check_options(self, options: Mapping[str, Any]) -> None:
        """``ConfigError`` for engine options this backend cannot take, naming the engine and the limit."""
        if options and not self.takes_engine_options:
            raise ConfigError(f"backend {self.name!r} takes no engine options (got {sorted(options)})")
        for key, most in self.parallel_limits.items():
            value = options.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"backend {self.name!r}: engine option {key} must be a positive integer, got {value!r}")
            if value > most:
                raise ConfigError(f"backend {self.name!r} serves {key} up to {most}, got {value}"
                                  + (f" ({self.parallel_why})" if self.parallel_why else ""))


BACKENDS: dict[str, BackendEntry] = {
    entry.name: entry
    for entry in (
        BackendEntry("hf", "transformers in BF16 on a torch device (--device); the live parameters are the run's tensors",
                     "deltarl.actor.backends.hf"),
        BackendEntry("vllm", "vLLM with deltarl's weight-transfer engine in its workers (engine options: vllm.LLM keywords)",
                     "deltarl.actor.backends.vllm", takes_engine_options=True,
                     parallel_limits={"tensor_parallel_size": 8, "pipeline_parallel_size": 1},
                     parallel_why="each tensor-parallel rank reads and commits its own part, up to the 8-way "
                                  "shard grid of format 2; pipeline stages are not served",
                     needs_checkpoint=True,
                     demo_options={"enforce_eager": True, "gpu_memory_utilization": 0.05, "max_num_seqs": 64},
                     demo_env={"VLLM_CPU_KVCACHE_SPACE": "1"}),  # vLLM's CPU build: a 1 GiB KV cache
    )
}


def backend_entry(name: str) -> BackendEntry:
    """The table's row for ``name``; ``ConfigError`` naming the known backends otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown generation backend {name!r} (known: {', '.join(sorted(BACKENDS))})") from None
