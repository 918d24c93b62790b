"""The trainer's configuration: one YAML/JSON file, importable without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deltarl import defaults
from deltarl.configfile import load_model
from deltarl.model.build import ModelSpec
from deltarl.model.tasks import TaskSpec
from deltarl.model.tokenizer import TokenizerSpec
from deltarl.pipeline.publish_config import PublishConfig
from deltarl.trainer.grpo import GRPOConfig
from deltarl.trainer.sinks import SinkConfig
from deltarl.trainer.warmup import WarmupConfig

#: GRPO settings under which the tiny model learns the addition task from scratch in ~25 steps on
#: 2 CPU cores (measured: mean reward ~0.02 -> ~0.7 in 30 steps). The large learning rate changes
#: nearly every BF16 weight each step; real models use the default 1e-6.
TINY_GRPO = GRPOConfig(lr=1e-2)

#: The sparse-regime preset (the demo's): a wider tiny model with larger initial weights (a BF16
#: element's spacing grows with its magnitude, so the same update crosses fewer of them), warmed up
#: by 4 supervised steps on correct answers, then GRPO at a small lr starting from the warm-up's
#: AdamW second moments (so the first step is not Adam's sign-like first update, which changed ~9%
#: of the elements; 1% instead). Measured in ``deltarl demo``: ~1.8% of the BF16 elements change
#: per version, deltas ~0.9% of full BF16, reward +0.09-0.10 in 25 steps (README, "deltarl demo").
#: Tuned on the same loop: lr 2e-5 -> 2.2% changed; init std 0.08 -> ~4%; 16 warm-up steps leave
#: little headroom (reward ~0.93 before RL, at init std 0.08).
SPARSE_MODEL = ModelSpec(hidden_size=256, intermediate_size=768, num_layers=2, init_std=0.32)
SPARSE_WARMUP = WarmupConfig(steps=4, lr=2e-3, batch_size=64, carry_moments="second")
SPARSE_GRPO = GRPOConfig(lr=1.5e-5, weight_decay=0.0)


class CoordinatorEndpoint(BaseModel):
    """Where the coordinator listens and how the trainer authenticates."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(default=defaults.COORDINATOR_URL, description="base URL of the coordinator service")
    token: str | None = Field(default=None, description="bearer token of the trainer (or env DELTARL_TRAINER_TOKEN)")


class TrainerConfig(BaseModel):
    """Everything ``deltarl trainer`` needs: model, task, GRPO, step sizes, store and coordinator."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: str = Field(default=defaults.STORE, description="store URL: path, file://, memory://, s3://bucket/prefix")
    run: str = Field(default="run", description="run name (the prefix of the run in the store)")
    model: ModelSpec = Field(default_factory=ModelSpec)
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    task: TaskSpec = Field(default_factory=TaskSpec)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    steps: int = Field(default=25, ge=1, le=10**9, description="training steps (versions published after version 0)")
    prompts_per_step: int = Field(default=32, ge=1, le=10**6, description="prompts opened per step")
    group_size: int = Field(default=8, ge=1, le=4096, description="completions per prompt (GRPO group)")
    max_new_tokens: int = Field(default=6, ge=1, le=1 << 20, description="completion length cap")
    max_staleness: int = Field(default=1, ge=0, le=16, description="a step accepts the newest version and this many before it")
    reference_kl: bool = Field(default=False, description="keep a frozen copy of the initial model for the KL penalty")
    recompute_rewards: bool = Field(default=True, description="score completions with the task instead of trusting actors")
    result_timeout_s: float = Field(default=600.0, gt=0, description="longest wait for a step's results")
    device: str = Field(default="cpu", description="torch device of the trainer")
    torch_threads: int | None = Field(default=None, ge=1, le=1024, description="torch.set_num_threads (None = torch's default)")
    publish: PublishConfig = Field(default_factory=PublishConfig)
    coordinator: CoordinatorEndpoint = Field(default_factory=CoordinatorEndpoint)
    metrics: SinkConfig = Field(default_factory=SinkConfig, description="Prometheus endpoint, TensorBoard, wandb")

    @model_validator(mode="before")
    @classmethod
    def _checkpoint_tokenizer(cls, data: Any) -> Any:
        """A local checkpoint uses its own tokenizer unless another one is named."""
        if isinstance(data, dict):
            model, tok = data.get("model"), data.get("tokenizer")
            name = model.get("name") if isinstance(model, dict) else getattr(model, "name", None)
            if name and name != "tiny" and tok is None:
                data = {**data, "tokenizer": {"kind": "hf", "path": name}}
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if not self.model.is_tiny and self.tokenizer.kind == "byte":
            raise ValueError("a checkpoint needs its own tokenizer: set tokenizer: {kind: hf, path: ...}")
        if self.tokenizer.kind == "byte" and self.model.is_tiny and self.model.vocab_size != 259:
            raise ValueError("the byte tokenizer has 259 ids: set model.vocab_size to 259")
        if self.grpo.kl_coef > 0 and not self.reference_kl:
            raise ValueError("grpo.kl_coef > 0 needs reference_kl: true")
        return self

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> TrainerConfig:
        """Read a YAML or JSON file (its ``trainer:`` section if it has one: a deployment file), then
        apply non-None top-level ``overrides``; errors raise ``ConfigError``."""
        return load_model(cls, path, "trainer", overrides)

    @classmethod
    def tiny(cls, **fields: Any) -> TrainerConfig:
        """The tiny-model preset (the demo's): ``TINY_GRPO`` plus the defaults, then ``fields``."""
        fields.setdefault("grpo", TINY_GRPO)
        return cls(**fields)

    @classmethod
    def sparse(cls, **fields: Any) -> TrainerConfig:
        """The sparse-regime preset (the demo's): ``SPARSE_MODEL``, ``SPARSE_WARMUP``, ``SPARSE_GRPO``,
        then ``fields``."""
        fields.setdefault("model", SPARSE_MODEL)
        fields.setdefault("warmup", SPARSE_WARMUP)
        fields.setdefault("grpo", SPARSE_GRPO)
        return cls(**fields)
