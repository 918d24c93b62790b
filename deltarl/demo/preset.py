"""The trainer configuration ``deltarl demo`` runs: the sparse-regime preset, or a local checkpoint.

Without ``--model`` the demo trains the tiny model of ``TrainerConfig.sparse`` (a short supervised
warm-up, then GRPO at a small lr). With ``--model PATH`` it trains that local Hugging Face checkpoint
with its own tokenizer on the same addition task, at the lr real models use (1e-6) and without a
warm-up unless asked for. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltarl.errors import ConfigError

#: GRPO lr on a real checkpoint unless ``--lr`` says otherwise.
CHECKPOINT_LR = 1e-6
#: Supervised warm-up lr on a real checkpoint (``--warmup-steps``; none by default).
CHECKPOINT_WARMUP_LR = 1e-5


def check_checkpoint(path: str) -> Path:
    """The checkpoint directory ``path``; ``ConfigError`` (one line) when it is not a local HF checkpoint."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"no checkpoint directory at {path} (--model takes a local Hugging Face checkpoint; nothing is downloaded)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return p.resolve()


def demo_trainer_config(*, store: str, run: str, steps: int, prompts_per_step: int, group_size: int,
                        torch_threads: int | None, model: str | None = None, lr: float | None = None,
                        warmup_steps: int | None = None) -> Any:
    """The ``TrainerConfig`` of one demo run (``lr``/``warmup_steps`` None: the preset's)."""
    from deltarl.model.build import ModelSpec
    from deltarl.trainer.config import SPARSE_GRPO, SPARSE_WARMUP, TrainerConfig

    common: dict[str, Any] = {"store": store, "run": run, "steps": steps, "prompts_per_step": prompts_per_step,
                              "group_size": group_size, "torch_threads": torch_threads, "result_timeout_s": 600}
    warmup = SPARSE_WARMUP if warmup_steps is None else SPARSE_WARMUP.model_copy(update={"steps": warmup_steps})
    if model is None:
        grpo = SPARSE_GRPO if lr is None else SPARSE_GRPO.model_copy(update={"lr": lr})
        return TrainerConfig.sparse(grpo=grpo, warmup=warmup, **common)
    path = check_checkpoint(model)
    grpo = SPARSE_GRPO.model_copy(update={"lr": CHECKPOINT_LR if lr is None else lr})
    warmup = SPARSE_WARMUP.model_copy(update={"steps": warmup_steps or 0, "lr": CHECKPOINT_WARMUP_LR})
    return TrainerConfig(model=ModelSpec(name=str(path)), grpo=grpo, warmup=warmup, **common)
