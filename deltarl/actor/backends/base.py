"""The interface every generation backend implements (transformers, vLLM).

Contract:

* ``generate(prompts, max_new_tokens=, temperature=, n=)`` samples ``n`` completions for each
  prompt (lists of token ids) and returns them flat, prompt-major: the completions of prompt ``i``
  are ``result[i * n:(i + 1) * n]``. Each carries the sampled token ids (the eos token included when
  sampled), the log-probability of each sampled token under the distribution it was sampled from
  (logits / temperature; greedy when ``temperature == 0`` reports the raw log-softmax), and why it
  ended: ``"stop"`` (eos) or ``"length"`` (``max_new_tokens`` reached).
* ``state_dict_for_update()`` returns the live inference tensors by exported (Hugging Face) name;
  writing into them in place changes what the next ``generate`` uses. This is the state the codec's
  ``StagedUpdate`` commits into, and whose ``state_digest`` equals the trainer's export. A backend
  whose live parameters are not laid out by HF name (vLLM: fused, sharded) returns a host shadow
  and applies committed changes with ``apply_sparse``.
* ``commit(staged)`` commits a codec ``StagedUpdate`` that was staged against
  ``state_dict_for_update()``: in place, all or nothing (a failure rolls back and re-raises);
  ``load_state(state)`` overwrites every weight with a full exported state (joining from a keyframe).
* ``tokens_per_second`` is an EMA of measured generation throughput (completion tokens over wall
  time, throttle included); ``None`` before the first batch.
* Calls are not thread-safe: the actor loop generates and commits from one thread, between batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

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
    """A model that samples completions and exposes its weights for in-place updates."""

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, n: int = 1
    ) -> list[Generation]:
        """Sample ``n`` completions per prompt; flat, prompt-major."""
        ...

    def state_dict_for_update(self) -> dict[str, torch.Tensor]:
        """Live inference tensors by exported name (writes in place change generation)."""
        ...

    def commit(self, staged: Any) -> None:
        """Commit a ``StagedUpdate`` staged against ``state_dict_for_update()``; all or nothing."""
        ...

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite every served weight with a full exported state."""
        ...

    @property
    def tokens_per_second(self) -> float | None:
        """EMA of measured generation throughput; ``None`` before the first batch."""
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
