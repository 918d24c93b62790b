"""Typed configuration of the coordinator: scheduling policy and the HTTP service."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deltarl import defaults
from deltarl.configfile import load_model


class SchedulerConfig(BaseModel):
    """How prompts are shared out, how long leases last, when an actor counts as dead."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: Literal["proportional", "equal"] = Field(
        default="proportional", description="'proportional' to EMA tokens/s; 'equal' is the baseline"
    )
    ema_alpha: float = Field(default=0.5, gt=0.0, le=1.0, description="weight of a new tokens/s sample")
    prior_tokens_per_second: float = Field(
        default=1000.0, gt=0.0, description="speed assumed for a new actor when no actor is measured yet"
    )
    prior_tokens_per_sample: float = Field(default=512.0, gt=0.0, description="completion length before any is seen")
    chunks: int = Field(
        default=8, ge=1, le=1000,
        description="a lease is 1/chunks of the actor's remaining fair share (guided self-scheduling)",
    )
    probe_prompts: int = Field(default=2, ge=1, description="prompts in an unmeasured actor's first lease")
    max_lease_seconds: float = Field(
        default=120.0, gt=0.0, description="cap on a lease's expected duration (bounds work lost on death)"
    )
    lease_slack: float = Field(default=2.0, ge=1.0, description="deadline = expected time x slack + margin")
    lease_margin_s: float = Field(default=30.0, ge=0.0, description="fixed margin added to every deadline")
    heartbeat_interval_s: float = Field(default=2.0, gt=0.0, description="how often actors should heartbeat")
    heartbeat_timeout_s: float = Field(default=10.0, gt=0.0, description="silence after which an actor is dead")
    max_staleness: int = Field(default=1, ge=0, description="a step may accept at most max_staleness+1 versions")


class ServiceConfig(BaseModel):
    """The HTTP service: listen address, tokens, long-poll and tick periods."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(default=defaults.COORDINATOR_HOST, description="address to bind")
    port: int = Field(default=defaults.COORDINATOR_PORT, ge=0, le=65535, description="port to bind (0 picks one)")
    actor_tokens: list[str] = Field(default_factory=list, description="bearer tokens actors may present")
    trainer_tokens: list[str] = Field(default_factory=list, description="bearer tokens the trainer may present")
    long_poll_max_s: float = Field(default=60.0, gt=0.0, description="longest a results request waits")
    tick_interval_s: float = Field(default=0.5, gt=0.0, description="period of the expiry/death check")
    keep_closed_steps: int = Field(default=4, ge=0, description="closed steps whose results stay in memory")
    io_threads: int = Field(default=32, ge=1, le=1024, description="threads for store writes (fsyncs overlap)")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, le=1 << 31,
        description="largest request body accepted; a larger one (or Content-Length) gets 413 at once",
    )


class CoordinatorConfig(BaseModel):
    """One file describes a coordinator deployment; command-line flags override it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: str | None = Field(default=None, description="store URL of the run (a deployment file's; --store overrides)")
    run: str | None = Field(default=None, description="run name (a deployment file's; --run overrides)")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)

    @classmethod
    def load(cls, path: str | Path) -> CoordinatorConfig:
        """Read a YAML or JSON file (its ``coordinator:`` section if it has one: a deployment file);
        bad content raises ``ConfigError``."""
        return load_model(cls, path, "coordinator")
