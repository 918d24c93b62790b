"""The trainer's outer loop: open a step, wait for admitted rollouts, train, export BF16, publish.

Wiring is by parameters, so the demo runs it in-process and ``deltarl trainer`` over HTTP:

* ``coordinator`` has ``open_step(spec: StepSpec)`` and ``wait_results(step, *, timeout)`` returning
  the step's admitted ``RolloutResult`` s once the step is complete (:class:`StepCoordinator`);
* ``publisher`` has ``publish(state_dict, step) -> VersionInfo``, ``publish_async`` and ``wait``
  (``deltarl.Publisher``).

Publishing runs in the background (``publish_async``): :meth:`TrainerLoop.run` hands step ``s``'s
export over and goes on with step ``s + 1`` (its prompts, the previous step's report and
``on_step``) until it needs version ``s``'s id to open step ``s + 1``; only then does it wait for the
commit. So version ``s + 1`` is never published before ``s`` commits, and a failed publish stops
the loop at that point (``PublishFailed`` from the publisher, chained to the cause).

Version 0 is the initial model, published by :meth:`TrainerLoop.start` together with
``<run>/model.json`` (model, tokenizer and task specs; immutable). Step ``s`` (1-based) is generated
with version ``s - 1`` (or up to ``max_staleness`` older) and its training publishes version ``s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from deltarl.errors import RunError
from deltarl.model.build import build_model
from deltarl.model.record import RunModelInfo, write_model_json
from deltarl.model.tasks import build_task
from deltarl.model.tokenizer import encode_prompt, load_tokenizer
from deltarl.trainer.config import TrainerConfig
from deltarl.trainer.grpo import GRPOTrainer, TrainStats
from deltarl.trainer.warmup import WarmupResult, cache_key, warm_start

if TYPE_CHECKING:
    from deltarl.protocol.records import RolloutResult, StepSpec
    from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)


class StepCoordinator(Protocol):
    """The two coordinator calls the trainer makes."""

    def open_step(self, spec: StepSpec) -> Any:
        """Open a step (idempotent for the same spec)."""
        ...

    def wait_results(self, step: int, *, timeout: float) -> Sequence[RolloutResult]:
        """Block until ``step`` is complete; return its admitted results."""
        ...


class VersionPublisher(Protocol):
    """What the loop needs of ``deltarl.Publisher``."""

    @property
    def next_version(self) -> int:
        """The version the next ``publish`` creates (0 for a run without versions)."""
        ...

    def publish(self, state_dict: Any, step: int, *, owned: bool = False) -> Any:
        """Publish ``state_dict`` as the next version of ``step``; its ``VersionInfo``.

        ``owned=True`` hands the tensors over: the caller never touches them again, so the
        publisher keeps them as the next base instead of copying the whole state."""
        ...

    def publish_async(self, state_dict: Any, step: int, *, owned: bool = False) -> Any:
        """``publish`` in the background; a future of its ``VersionInfo`` (one in flight at a time)."""
        ...

    def wait(self) -> Any:
        """Wait for the background publish in flight: its ``VersionInfo`` (None if none), or raise."""
        ...


class ClientCoordinator:
    """Adapts ``deltarl.protocol.client.SyncCoordinatorClient`` to :class:`StepCoordinator`."""

    def __init__(self, client: Any, *, poll_s: float = 30.0) -> None:
        self.client = client
        self.poll_s = poll_s

    def open_step(self, spec: StepSpec) -> Any:
        return self.client.open_step(spec.step, list(spec.prompts), list(spec.accepted_versions))

    def wait_results(self, step: int, *, timeout: float) -> list[RolloutResult]:
        done = self.client.wait_step(step, poll_s=min(self.poll_s, timeout), deadline_s=timeout)
        return [rec.result for rec in done.results]


@dataclass(frozen=True)
class StepReport:
    """One training step as the demo's live view shows it."""

    step: int
    version: int
    version_id: str
    stats: TrainStats
    accepted_versions: tuple[str, ...]
    stale_samples: int
    wait_s: float
    publish_s: float  # the publish's own wall time (it ran in the background)
    publish: Any  # the publisher's VersionInfo (changed elements, bytes, timings)
    publish_wait_s: float = 0.0  # how long the loop blocked waiting for that publish to commit


class TrainerLoop:
    """GRPO against a coordinator, publishing every version. Not thread-safe."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        coordinator: StepCoordinator,
        publisher: VersionPublisher,
        store: ObjectStore,
        on_step: Callable[[StepReport], None] | None = None,
        warmup_cache: str | Path | None = None,
    ) -> None:
        """``warmup_cache``: folder where the supervised warm-up (``config.warmup``) is cached and
        reused by runs of the same configuration (None: warm up every time)."""
        import torch

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        self.coordinator = coordinator
        self.publisher = publisher
        self.store = store
        self.on_step = on_step
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.task = build_task(config.task)
        model = build_model(config.model, dtype=torch.float32, device=config.device)
        self.warmup: WarmupResult | None = None
        if config.warmup.steps > 0:
            key = cache_key(config.model, config.tokenizer, config.task, config.warmup)
            self.warmup = warm_start(model, self.tokenizer, self.task, config.warmup, key=key, cache_dir=warmup_cache,
                                     chat_template=config.tokenizer.chat_template)
        ref = None
        if config.reference_kl:
            ref = build_model(config.model, dtype=torch.float32, device=config.device)
            ref.load_state_dict(model.state_dict())
            ref.requires_grad_(False)
        self._answers: dict[str, str] = {}
        self.trainer = GRPOTrainer(
            model, config.grpo, pad_token_id=self.tokenizer.pad_token_id, ref_model=ref, reward_fn=self._reward
        )
        if self.warmup is not None and config.warmup.carry_moments != "none":
            self.trainer.load_moments(self.warmup.moments, which=config.warmup.carry_moments)
        self.version_ids: list[str] = []
        self.reports: list[StepReport] = []
        self._pending: tuple[dict[str, Any], float] | None = None  # a step whose publish is in flight

    def _reward(self, sample: Any) -> float:
        if not self.config.recompute_rewards:
            if sample.reward is None:
                raise RunError(f"sample of {sample.prompt_id!r} carries no reward and recompute_rewards is off")
            return float(sample.reward)
        answer = self._answers.get(sample.prompt_id)
        if answer is None:
            raise RunError(f"a result holds prompt {sample.prompt_id!r}, which the current step did not open")
        text = self.tokenizer.decode(list(sample.completion_token_ids))
        return self.task.score(answer, text, sample.finish_reason)

    def model_info(self) -> RunModelInfo:
        """What ``<run>/model.json`` records for this configuration."""
        cfg = self.config
        return RunModelInfo(
            model=cfg.model,
            tokenizer=cfg.tokenizer,
            task=cfg.task.model_dump(mode="json"),
            temperature=cfg.grpo.temperature,
            max_new_tokens=cfg.max_new_tokens,
        )

    def start(self) -> Any:
        """Write ``model.json`` and publish version 0 (the initial weights); return its VersionInfo."""
        cfg = self.config
        write_model_json(self.store, cfg.run, self.model_info().to_bytes())
        if self.version_ids:
            raise RunError("start() was already called")
        if self.publisher.next_version != 0:
            raise RunError(f"run {cfg.run!r} already has versions; resuming a trainer is not supported, use a new run")
        info = self.publisher.publish(self.trainer.export_bf16(), 0, owned=True)
        if info.version != 0:
            raise RunError(f"run {cfg.run!r} already has versions (published {info.version}); use a new run name")
        self.version_ids.append(info.version_id)
        log.info("run %s: version 0 published (%s)", cfg.run, info.version_id[:16])
        return info

    def _spec(self, step: int, prompts: list[Any]) -> StepSpec:
        from deltarl.protocol.records import StepSpec

        accepted = list(reversed(self.version_ids[-(self.config.max_staleness + 1) :]))
        return StepSpec(step=step, prompts=prompts, accepted_versions=accepted, opened_at=time.time())

    def _prompts(self, step: int) -> list[Any]:
        from deltarl.protocol.records import PromptItem

        cfg = self.config
        prompts = []
        for i, tp in enumerate(self.task.prompts(step, cfg.prompts_per_step)):
            pid = f"{i:05d}-{tp.prompt_id}"
            self._answers[pid] = tp.answer
            ids = encode_prompt(self.tokenizer, tp.text, chat_template=cfg.tokenizer.chat_template)
            prompts.append(PromptItem(prompt_id=pid, text=tp.text, token_ids=ids, answer=tp.answer, group_size=cfg.group_size))
        return prompts

    def _train_and_publish(self, step: int) -> None:
        """Settle the previous step's publish (when its version id is needed), then open, wait,
        train and hand this step's export to a background publish."""
        cfg = self.config
        if not self.version_ids:
            self.start()
        self._answers.clear()
        prompts = self._prompts(step)  # overlaps the previous publish
        self._settle()
        spec = self._spec(step, prompts)
        t0 = time.perf_counter()
        self.coordinator.open_step(spec)
        results = list(self.coordinator.wait_results(step, timeout=cfg.result_timeout_s))
        wait_s = time.perf_counter() - t0
        accepted = set(spec.accepted_versions)
        for r in results:
            if r.version_id not in accepted:
                raise RunError(f"step {step}: result {r.lease_id} from version {r.version_id[:16]} was not accepted")
        stale = sum(len(r.samples) for r in results if r.version_id != spec.accepted_versions[0])
        stats = self.trainer.train_step(results)
        self.publisher.publish_async(self.trainer.export_bf16(), step, owned=True)
        partial = {"step": step, "stats": stats, "accepted_versions": tuple(spec.accepted_versions),
                   "stale_samples": stale, "wait_s": wait_s}  # fmt: skip
        self._pending = (partial, time.perf_counter())

    def _settle(self) -> StepReport | None:
        """Wait for the publish in flight (raising its failure) and report its step."""
        if self._pending is None:
            return None
        partial, submitted = self._pending
        self._pending = None
        t = time.perf_counter()
        info = self.publisher.wait()
        blocked = time.perf_counter() - t
        self.version_ids.append(info.version_id)
        report = StepReport(version=info.version, version_id=info.version_id, publish_s=info.wall_s,
                            publish=info, publish_wait_s=blocked, **partial)  # fmt: skip
        self.reports.append(report)
        log.info(
            "step %d: reward %.3f, version %d published in %.2fs in the background (%.2fs after handing it over, "
            "%.2fs of it waited for; waited %.2fs for %d samples)",
            report.step, report.stats.reward_mean, info.version, info.wall_s, time.perf_counter() - submitted,
            blocked, report.wait_s, report.stats.samples,
        )  # fmt: skip
        if self.on_step is not None:
            self.on_step(report)
        return report

    def run(self, steps: int | None = None) -> list[StepReport]:
        """Start (if needed) and run ``steps`` (default ``config.steps``) training steps, each publish
        overlapping the next step until that step needs the version; returns after the last commits."""
        if not self.version_ids:
            self.start()
        first = len(self.version_ids)
        for step in range(first, first + (steps or self.config.steps)):
            self._train_and_publish(step)
        self._settle()  # (after a failure above, the publisher's close waits for a publish in flight)
        return self.reports
