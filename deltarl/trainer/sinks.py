"""Where a trainer's per-step numbers go besides the console: TensorBoard event files and Weights & Biases.

Both are optional dependencies (``pip install 'deltarl[metrics]'``); a sink asked for without its
package raises :class:`~deltarl.errors.ConfigError` naming the extra. wandb honours its own
environment (``WANDB_MODE=offline``, ``WANDB_DIR``, ``WANDB_API_KEY``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from deltarl.errors import ConfigError


class SinkConfig(BaseModel):
    """The trainer's metric outputs (all off by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metrics_port: int | None = Field(default=None, ge=0, le=65535,
                                     description="serve Prometheus metrics at http://<metrics_host>:<port>/metrics")
    metrics_host: str = Field(default="0.0.0.0", description="address the metrics endpoint binds")
    tensorboard: str | None = Field(default=None, description="write TensorBoard event files into this folder")
    wandb_project: str | None = Field(default=None, description="log each step to this Weights & Biases project")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(default=None, description="wandb mode: online, offline or disabled (else $WANDB_MODE)")


class MetricSink(Protocol):
    """Something that takes named scalars per step."""

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Record ``values`` at ``step``."""
        ...

    def close(self) -> None:
        """Flush and release files or connections."""
        ...


def step_values(report: Any) -> dict[str, float]:
    """The scalars of one trainer ``StepReport``: training, the published delta and the publish timings."""
    s, info = report.stats, report.publish
    st = info.stats
    return {
        "train/reward_mean": s.reward_mean,
        "train/reward_std": s.reward_std,
        "train/loss": s.loss,
        "train/kl": s.kl,
        "train/clip_frac": s.clip_frac,
        "train/grad_norm": s.grad_norm,
        "train/samples": float(s.samples),
        "train/tokens": float(s.tokens),
        "train/seconds": s.seconds,
        "train/wait_seconds": report.wait_s,
        "train/stale_samples": float(report.stale_samples),
        "publish/version": float(info.version),
        "publish/changed_fraction": st.changed_fraction,
        "publish/delta_bytes": float(st.encoded_bytes),
        "publish/ratio_vs_full": st.encoded_bytes / st.full_bytes if st.full_bytes else 0.0,
        "publish/encode_seconds": info.encode_s,
        "publish/upload_seconds": info.upload_s,
        "publish/commit_seconds": info.commit_s,
        "publish/seconds": report.publish_s,
    }


class TensorBoardSink:
    """Scalars into TensorBoard event files under ``logdir`` (one ``SummaryWriter``)."""

    def __init__(self, logdir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError(f"the tensorboard sink needs tensorboard: pip install 'deltarl[metrics]' ({err})") from err
        self.logdir = logdir
        self._writer = SummaryWriter(log_dir=logdir)

    def log(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars into a Weights & Biases run (``wandb.init`` once, ``run.log`` per step, ``finish`` on close)."""

    def __init__(self, project: str, *, name: str | None = None, config: Mapping[str, Any] | None = None,
                 mode: Literal["online", "offline", "disabled"] | None = None, directory: str | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError(f"the wandb sink needs wandb: pip install 'deltarl[metrics]' ({err})") from err
        self._run = wandb.init(project=project, name=name, config=dict(config or {}), mode=mode, dir=directory)

    @property
    def run_dir(self) -> str:
        return str(self._run.dir)

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """Every configured sink; :meth:`log_step` sends a ``StepReport`` to each."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self.sinks = sinks

    @classmethod
    def open(cls, config: SinkConfig, *, run: str, hyperparameters: Mapping[str, Any] | None = None) -> Sinks:
        sinks: list[MetricSink] = []
        try:
            if config.tensorboard:
                sinks.append(TensorBoardSink(config.tensorboard))
            if config.wandb_project:
                sinks.append(WandbSink(config.wandb_project, name=run, config=hyperparameters, mode=config.wandb_mode))
        except BaseException:
            for sink in sinks:
                sink.close()
            raise
        return cls(sinks)

    def log_step(self, report: Any) -> None:
        values = step_values(report)
        for sink in self.sinks:
            sink.log(values, report.step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
