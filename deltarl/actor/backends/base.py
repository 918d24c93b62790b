"""The interfaces of generation backends (transformers, vLLM), by where their weights live.

Every backend (:class:`GenerationBackend`):

* ``generate(prompts, max_new_tokens=, temperature=, n=)`` samples ``n`` completions for each
  prompt (lists of token ids) and returns them flat, prompt-major: the completions of prompt ``i``
  are ``result[i * n:(i + 1) * n]``. Each carries the sampled token ids (the eos token included when
  sampled), the log-probability of each sampled token under the distribution it was sampled from
  (logits / temperature; greedy when ``temperature == 0`` reports the raw log-softmax), and why it
  ended: ``"stop"`` (eos) or ``"length"`` (``max_new_tokens`` reached).
* ``served_digest()`` is the state digest of the weights generation uses (equal to the trainer's
  export of the served version); ``close()`` releases what the backend started.
* ``tokens_per_second`` is an EMA of measured generation throughput (completion tokens over wall
  time, throttle included); ``None`` before the first batch.
* Calls are not thread-safe: the actor loop generates and commits from one thread, between batches.

A backend whose weights live in this process, by exported (Hugging Face) name
(:class:`HostWeightsBackend`: transformers) also offers them for in-place updates:
``state_dict_for_update()`` returns the live tensors, and writing into them changes what the next
``generate`` uses (the state the codec's ``StagedUpdate`` commits into); ``commit(staged)`` commits
a ``StagedUpdate`` staged against them, all or nothing; ``load_state(state)`` overwrites every
weight with a full exported state. A backend whose weights live in an engine's own processes
(:class:`EngineBackend`: vLLM) has none of these: ``attach`` / ``update`` / ``status`` drive the
engine, which reads, verifies and commits the run itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from deltarl.actor.config import ActorConfig
    from deltarl.actor.weights import Weights
    from deltarl.model.record import RunModelInfo
    from deltarl.storage.store import ObjectStore

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Generation:
    """One sampled completion."""

    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        if len(self.completion_token_ids) != len(self.logprobs):
            raise ValueError("one logprob per completion token")


@runtime_checkable
class GenerationBackend(Protocol):
    """A model that samples completions; what the actor loop asks of every backend."""

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, n: int = 1
    ) -> list[Generation]:
        """Sample ``n`` completions per prompt; flat, prompt-major."""
        ...

    def served_digest(self) -> str:
        """The state digest of the weights generation uses."""
        ...

    def close(self) -> None:
        """Release what the backend started (engine processes); idempotent."""
        ...

    @property
    def tokens_per_second(self) -> float | None:
        """EMA of measured generation throughput; ``None`` before the first batch."""
        ...


@runtime_checkable
class HostWeightsBackend(GenerationBackend, Protocol):
    """A backend whose live weights are tensors in this process, by exported name."""

    def state_dict_for_update(self) -> dict[str, torch.Tensor]:
        """Live inference tensors by exported name (writes in place change generation)."""
        ...

    def commit(self, staged: Any) -> None:
        """Commit a ``StagedUpdate`` staged against ``state_dict_for_update()``; all or nothing."""
        ...

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite every served weight with a full exported state."""
        ...


@runtime_checkable
class EngineBackend(GenerationBackend, Protocol):
    """A backend whose weights live in an engine's own processes, which read and commit the run."""

    def attach(self, store: str, run: str, **init: Any) -> dict[str, Any]:
        """Point the engine at a run and load its version (default HEAD); the engine's status."""
        ...

    def update(self, version: int | str = "latest", *, wait_s: float = 0.0) -> dict[str, Any]:
        """Stage ``version`` in the engine and commit it in place; the engine's status."""
        ...

    def status(self, *, digest: bool = False) -> dict[str, Any]:
        """The served version, its id and the last update's timings (``digest``: the served digest)."""
        ...


class BackendAdapter(Protocol):
    """What a backend's adapter module gives the actor loop (module-level functions)."""

    def open_weights(self, config: ActorConfig, store: ObjectStore | None) -> Weights:
        """The weights handle (it reads ``model.json`` before :func:`build`, then bootstraps)."""
        ...

    def build(self, config: ActorConfig, info: RunModelInfo, tokenizer: Any, weights: Weights) -> tuple[GenerationBackend, Any]:
        """The generation backend for the run's model, bound to ``weights``; and the state that
        ``weights.bootstrap`` writes into (None where the engine loads the run itself)."""
        ...


class ThroughputMeter:
    """EMA of tokens/s over generation batches."""

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.value: float | None = None
        self.total_tokens = 0
        self.total_seconds = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        self.total_tokens += tokens
        self.total_seconds += seconds
        rate = tokens / max(seconds, 1e-9)
        self.value = rate if self.value is None else (1 - self.alpha) * self.value + self.alpha * rate
