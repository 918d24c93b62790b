"""Supervised warm-up: a few steps of next-token training on the task's correct answers before RL.

A model trained from scratch by RL needs a large learning rate, and then nearly every BF16 weight
changes on every step. A short supervised warm-up (seconds for the tiny model) puts the model where
GRPO at a small learning rate still improves it, which is the regime deltarl is built for: a few
percent of the BF16 elements change per version.

The warm-up is deterministic in its config, so its result (FP32 weights and AdamW's moments) is
cached in a folder under a key of everything that shapes it, and reused when the same configuration
runs again. The moments can be carried into the GRPO optimiser (:meth:`GRPOTrainer.load_moments`),
so the first GRPO step is not Adam's first step, which moves every weight by the full learning rate.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltarl.model.build import ModelSpec
from deltarl.model.tasks import Task, TaskSpec
from deltarl.model.tokenizer import Tokenizer, TokenizerSpec, encode_prompt

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Bump when the warm-up's procedure changes, so older cache entries are not reused.
WARMUP_FORMAT = 1
#: Offset of the task's step numbers the warm-up draws prompts from (RL steps count from 1).
_PROMPT_STEP_BASE = 1_000_000


class WarmupConfig(BaseModel):
    """The supervised warm-up before GRPO (``steps: 0`` means none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(default=0, ge=0, le=10**6, description="supervised steps on correct answers (0 = no warm-up)")
    lr: float = Field(default=2e-3, gt=0, le=1.0, description="AdamW learning rate of the warm-up")
    batch_size: int = Field(default=64, ge=1, le=65536, description="prompts per warm-up step")
    carry_moments: Literal["none", "both", "second"] = Field(
        default="second",
        description="AdamW moments handed to GRPO: 'both', 'second' (the squared-gradient average only; the "
        "first GRPO updates then start small) or 'none' (GRPO starts a fresh AdamW)",
    )


@dataclass(frozen=True)
class WarmupResult:
    """What the warm-up produced: FP32 weights, AdamW state per parameter name, the loss per step."""

    state: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]
    losses: tuple[float, ...]
    cached: bool
    seconds: float


def cache_key(model: ModelSpec, tokenizer: TokenizerSpec, task: TaskSpec, config: WarmupConfig) -> str:
    """A hex digest of everything the warm-up's result depends on (torch's version included)."""
    import torch

    ident = {
        "format": WARMUP_FORMAT,
        "torch": torch.__version__,
        "model": model.model_dump(mode="json"),
        "tokenizer": tokenizer.model_dump(mode="json"),
        "task": task.model_dump(mode="json"),
        "warmup": config.model_dump(mode="json", exclude={"carry_moments"}),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def supervised_warmup(model: torch.nn.Module, tokenizer: Tokenizer, task: Task, config: WarmupConfig,
                      *, chat_template: bool = False) -> WarmupResult:
    """Train ``model`` in place for ``config.steps`` steps of AdamW on ``-log p(answer, eos | prompt)``."""
    import torch

    from deltarl.trainer.logprobs import completion_logprobs

    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([p for p in params.values() if p.requires_grad], lr=config.lr, weight_decay=0.0)
    losses = []
    model.train()
    for step in range(config.steps):
        batch = task.prompts(_PROMPT_STEP_BASE + step, config.batch_size)
        prompts = [encode_prompt(tokenizer, tp.text, chat_template=chat_template) for tp in batch]
        answers = [[*tokenizer.encode(tp.answer), tokenizer.eos_token_id] for tp in batch]
        logp, mask = completion_logprobs(model, prompts, answers, temperature=1.0, pad_token_id=tokenizer.pad_token_id)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        log.debug("warm-up step %d: loss %.4f", step + 1, losses[-1])
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    by_param = {id(p): name for name, p in params.items()}
    moments = {by_param[id(p)]: {k: v.detach().clone() if hasattr(v, "detach") else torch.tensor(v) for k, v in st.items()}
               for p, st in optimizer.state.items()}
    state = {name: p.detach().clone() for name, p in params.items()}
    return WarmupResult(state, moments, tuple(losses), cached=False, seconds=time.perf_counter() - t0)


def warm_start(model: torch.nn.Module, tokenizer: Tokenizer, task: Task, config: WarmupConfig, *,
               key: str, cache_dir: str | Path | None = None, chat_template: bool = False) -> WarmupResult:
    """Warm ``model`` up in place, or load the cached result of the same ``key`` from ``cache_dir``.

    ``key`` is :func:`cache_key` of the run's specs. A fresh result is written to ``cache_dir`` (when
    given) so the next run with the same configuration starts at once.
    """
    import torch

    path = Path(cache_dir) / f"warmup-{key}.pt" if cache_dir is not None else None
    if path is not None and path.exists():
        t0 = time.perf_counter()
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            params = dict(model.named_parameters())
            if sorted(saved["state"]) != sorted(params):
                raise KeyError("parameter names differ")
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(saved["state"][name].to(device=p.device, dtype=p.dtype))
            log.info("warm-up: reused %s (%d steps, final loss %.3f)", path, len(saved["losses"]), saved["losses"][-1])
            return WarmupResult({n: p.detach().clone() for n, p in params.items()}, saved["moments"],
                                tuple(saved["losses"]), cached=True, seconds=time.perf_counter() - t0)
        except (OSError, RuntimeError, KeyError, ValueError, EOFError, pickle.UnpicklingError) as err:
            log.warning("warm-up cache %s unusable (%s); warming up again", path, err)
    result = supervised_warmup(model, tokenizer, task, config, chat_template=chat_template)
    log.info("warm-up: %d supervised steps in %.1fs, loss %.3f -> %.3f", config.steps, result.seconds,
             result.losses[0] if result.losses else 0.0, result.losses[-1] if result.losses else 0.0)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{time.time_ns()}")
        torch.save({"state": result.state, "moments": result.moments, "losses": list(result.losses)}, tmp)
        tmp.replace(path)
    return result
