"""The actor loop: register → lease → generate on the current version → report → commit at the safe point.

One thread generates and commits (the backend is not thread-safe); the subscriber fetches and
stages the next version in the background while that thread generates. Between batches the loop
commits a staged version if one is ready: the commit writes absolute values in place and is
rolled back if anything fails, so no rollout is ever generated from a half-applied model. Where the
version's manifest records a state digest, it is checked in the background while the batch after
the commit is generated; the loop confirms it before reporting that batch, and a mismatch rolls the
version back and drops the batch instead of reporting it.

A new actor first bootstraps (newest keyframe, then the deltas after it) and only then asks for
work. Every result is tagged with the version id of the weights that generated it.

Events (one JSON line each, in ``config.events``) let an operator or the demo follow the actor:
``registered``, ``bootstrap``, ``lease`` (granted, before its generation starts), ``lapsed`` (a
lease given up: no accepted version in time), ``commit`` (publish → staged seconds, the commit
pause), ``commit_failed`` (refused or rolled back, also after a digest mismatch), ``result``
(admitted or the rejection reason), ``exit``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from deltarl.actor.config import ActorConfig
from deltarl.actor.events import CommitTiming, EventLog
from deltarl.actor.metrics import WeightsMetrics
from deltarl.errors import (
    AdmissionRejected,
    AuthError,
    CoordinatorError,
    DeltaRLError,
    IntegrityError,
    UnknownActor,
)

if TYPE_CHECKING:
    from deltarl.actor.backends.base import BackendAdapter, Generation, GenerationBackend
    from deltarl.protocol.client import SyncCoordinatorClient
    from deltarl.protocol.records import LeaseGrant, PromptItem, RolloutResult
    from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)


class ActorLoop:
    """Runs one actor until :meth:`stop` (or a signal handler calling it). Not reentrant."""

    def __init__(self, config: ActorConfig, *, name: str | None = None, store: ObjectStore | None = None) -> None:
        self.config = config
        self.name = name or config.region or "actor"
        self._store = store
        self._stop = threading.Event()
        self._state_wanted = threading.Event()
        self.events = EventLog(config.events, self.name)
        self.actor_id: str | None = None
        self.backend: GenerationBackend | None = None
        self.weights: Any = None  # deltarl.actor.weights.Weights, built in run()
        self.timings: list[CommitTiming] = []
        self.results_admitted = 0
        self.results_rejected: dict[str, int] = {}
        self.metrics = WeightsMetrics("actor")
        self.metrics_server: Any = None  # deltarl.exposition.MetricsServer while running, with metrics_port

    # --- control ---------------------------------------------------------------------------------

    def request_state(self) -> None:
        """Ask the loop to write ``config.state_out`` at its next safe point (safe from signal handlers)."""
        self._state_wanted.set()

    def stop(self) -> None:
        """Ask the loop to finish its current batch and exit (safe from signal handlers and threads)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        """Bootstrap, register, then lease/generate/report/commit until stopped."""
        from deltarl.protocol.client import SyncCoordinatorClient
        from deltarl.storage.open import open_store

        cfg = self.config
        if cfg.metrics_port is not None:
            from deltarl.exposition import MetricsServer

            self.metrics_server = MetricsServer(self.metrics.registry, port=cfg.metrics_port, host=cfg.metrics_host)
        if self._store is None:
            cfg.check_sources()
        own_store = self._store is None and cfg.store is not None
        store = self._store if self._store is not None else open_store(cfg.store) if cfg.store else None
        client: SyncCoordinatorClient | None = None
        heartbeat: threading.Thread | None = None
        try:
            self._setup(store)
            if self.stopping:
                return
            client = SyncCoordinatorClient(cfg.coordinator, cfg.resolved_token())
            interval = self._register(client)
            if interval is None:
                return
            heartbeat = threading.Thread(target=self._heartbeat, args=(client, interval),
                                         name="actor-heartbeat", daemon=True)
            heartbeat.start()
            failures = 0
            while not self.stopping:
                self._safe_point()
                try:
                    assert self.actor_id is not None
                    grant = client.lease(self.actor_id, cfg.max_prompts)
                    failures = 0
                except UnknownActor:  # the coordinator does not know us (any more): register again
                    log.warning("coordinator does not know actor %s; registering again", self.actor_id)
                    if self._register(client) is None:
                        return
                    continue
                except AuthError:
                    raise
                except CoordinatorError as err:  # unreachable or restarting: keep the weights, try again
                    failures += 1
                    log.warning("lease request failed (%d in a row): %s", failures, err)
                    self._stop.wait(min(5.0, 0.2 * 2**failures))
                    continue
                if grant is None:
                    self._stop.wait(cfg.idle_poll_s)
                    continue
                self._serve(client, grant)
        finally:
            self._teardown(client, heartbeat, store if own_store else None, clean=self.stopping)

    def _teardown(self, client: SyncCoordinatorClient | None, heartbeat: threading.Thread | None,
                  own_store: ObjectStore | None, *, clean: bool) -> None:
        """Leave, write the state, close everything, emit ``exit``. Each step runs even if one before
        it failed (that failure is logged and named in the ``exit`` event): an actor that cannot close
        its fetcher still closes its engine and says it ended. ``clean``: stopped, not failed."""
        failed: list[str] = []

        def step(what: str, call: Callable[[], object]) -> None:
            try:
                call()
            except Exception:
                log.exception("actor %s: %s failed on the way out", self.name, what)
                failed.append(what)

        self._stop.set()
        if heartbeat is not None:
            heartbeat.join(timeout=10)
        if client is not None:
            if clean:
                step("leave", lambda: self._leave(client))  # counted as left, not died
            step("close the coordinator client", client.close)
        step("write the state", self._write_state)
        if self.weights is not None:
            step("close the weights", self.weights.close)
        if self.backend is not None:
            step("close the backend", self.backend.close)  # vLLM: its engine processes
        held = None if self.weights is None else self.weights.held
        self.events.emit("exit", version=None if held is None else held[0], admitted=self.results_admitted,
                         rejected=self.results_rejected, **({"teardown_failed": failed} if failed else {}))
        self.events.close()
        if self.metrics_server is not None:
            step("close the metrics server", self.metrics_server.close)
        if own_store is not None:
            step("close the store", own_store.close)

    def _leave(self, client: Any) -> None:
        if self.actor_id is None:
            return
        try:
            client.leave(self.actor_id)
        except CoordinatorError as err:  # gone or restarting: it will count us as silent instead
            log.info("could not tell the coordinator actor %s leaves: %s", self.actor_id, err)

    def _register(self, client: Any) -> float | None:
        """Register with the coordinator, retrying while it is unreachable; the heartbeat interval,
        or None if stopped first. An unknown token (``AuthError``) is final."""
        cfg = self.config
        deadline = time.monotonic() + cfg.bootstrap_timeout_s
        while not self.stopping:
            try:
                reg = client.register(region=cfg.region, backend=cfg.backend,
                                      capabilities={"name": self.name, "throttle": cfg.throttle})
            except AuthError:
                raise
            except CoordinatorError as err:
                if time.monotonic() > deadline:
                    raise
                log.warning("cannot register with %s yet: %s", cfg.coordinator, err)
                self._stop.wait(1.0)
                continue
            self.actor_id = reg.actor_id
            self.events.emit("registered", actor_id=reg.actor_id, version=self.weights.version)
            log.info("actor %s registered as %s at version %d", self.name, reg.actor_id, self.weights.version)
            return float(reg.heartbeat_interval_s)
        return None

    def _setup(self, store: ObjectStore | None) -> None:
        """Wait for the run, read its model spec, bootstrap the newest version into a backend (built
        by the backend table's adapter: ``deltarl.actor.backends.table.BACKENDS``)."""
        from deltarl.model.tasks import TaskSpec, build_task
        from deltarl.model.tokenizer import load_tokenizer

        cfg = self.config
        if cfg.torch_threads:
            import torch

            torch.set_num_threads(cfg.torch_threads)
        adapter: BackendAdapter = cfg.backend_entry().load()
        self.weights = adapter.open_weights(cfg, store)
        info = self.weights.wait_model_json(timeout_s=cfg.bootstrap_timeout_s, stop=self._stop)
        if info is None:
            return
        self.model_info = info
        self.tokenizer = load_tokenizer(info.tokenizer)
        self.task = build_task(TaskSpec(**info.task)) if info.task else None
        t0 = time.perf_counter()
        self.backend, live = adapter.build(cfg, info, self.tokenizer, self.weights)
        self.metrics.follow_fetcher(self.weights.fetch_stats)
        if not self.weights.bootstrap(live, timeout_s=cfg.bootstrap_timeout_s, stop=self._stop):
            return
        self.metrics.bootstrapped(self.weights.version)
        self.events.emit("bootstrap", version=self.weights.version, version_id=self.weights.version_id,
                         seconds=round(time.perf_counter() - t0, 4), fetch=self.weights.fetch_stats())
        log.info("actor %s bootstrapped version %d in %.2fs", self.name, self.weights.version, time.perf_counter() - t0)

    def _heartbeat(self, client: Any, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                client.heartbeat(self.actor_id)
            except CoordinatorError as err:
                log.warning("heartbeat failed: %s", err)

    # --- safe point: commit a staged version ----------------------------------------------------

    def _safe_point(self) -> CommitTiming | None:
        """Commit the staged version if one is ready (between batches only)."""
        if self._state_wanted.is_set():
            self._state_wanted.clear()
            self._write_state()
        if not self.weights.ready():
            return None
        try:
            timing = self.weights.commit()
        except IntegrityError as err:  # rolled back: keep generating on the version we hold
            log.error("commit refused and rolled back: %s", err)
            self.metrics.commit_failed()
            self.events.emit("commit_failed", error=str(err))
            return None
        if timing is None:
            return None
        self.timings.append(timing)
        self.metrics.committed(timing)
        self.events.emit("commit", version=timing.version, version_id=timing.version_id,
                         publish_to_staged_s=timing.publish_to_staged_s, publish_to_commit_s=timing.publish_to_commit_s,
                         pause_ms=timing.pause_ms, digest_checked=timing.digest_checked,
                         fetch=self.weights.fetch_stats())
        return timing

    def _confirmed(self) -> bool:
        """Whether the weights the last batch was generated from passed their digest check (waiting
        for it). False: that version was rolled back, and nothing generated from it may be reported."""
        try:
            self.weights.confirm()
        except IntegrityError as err:
            log.error("state digest check failed, version rolled back: %s", err)
            self.metrics.commit_failed()
            self.events.emit("commit_failed", error=str(err))
            return False
        return True

    def _ensure_accepted(self, accepted: Sequence[str]) -> bool:
        """Bring the weights to a version the step accepts (waiting for staging if needed)."""
        deadline = time.monotonic() + self.config.catch_up_timeout_s
        while self.weights.version_id not in accepted:
            if self.stopping or time.monotonic() > deadline:
                return False
            if self._safe_point() is None:
                self.weights.wait_ready(min(0.5, max(0.0, deadline - time.monotonic())))
        return True

    # --- one lease ---------------------------------------------------------------------------------

    def _serve(self, client: Any, grant: LeaseGrant) -> None:
        lease = grant.lease
        self.events.emit("lease", lease_id=lease.lease_id, step=lease.step, prompts=len(grant.prompts))
        if not self._ensure_accepted(grant.accepted_versions):
            log.warning("lease %s: no accepted version staged in time (have %s); letting it lapse",
                        lease.lease_id, self.weights.version_id[:12])
            self.events.emit("lapsed", lease_id=lease.lease_id, step=lease.step)
            return
        result = self._generate(grant)
        if not self._confirmed():
            self.metrics.result("rolled_back")
            self.events.emit("result", step=lease.step, lease_id=lease.lease_id, admitted=False, reason="rolled_back")
            return
        for attempt in range(3):
            try:
                ack = client.report(result)
                self.results_admitted += 1
                self.metrics.result("admitted")
                self.events.emit("result", step=lease.step, lease_id=lease.lease_id, admitted=True,
                                 duplicate=ack.duplicate, prompts=len(grant.prompts), samples=len(result.samples),
                                 tokens=result.tokens, version=self.weights.version, gen_seconds=result.gen_seconds)
                return
            except AdmissionRejected as err:
                self.results_rejected[err.reason] = self.results_rejected.get(err.reason, 0) + 1
                self.metrics.result(str(getattr(err.reason, "value", err.reason)))
                log.warning("lease %s rejected: %s (%s)", lease.lease_id, err.reason, err)
                self.events.emit("result", step=lease.step, lease_id=lease.lease_id, admitted=False, reason=err.reason)
                return
            except CoordinatorError as err:
                log.warning("reporting lease %s failed (attempt %d): %s", lease.lease_id, attempt + 1, err)
                self._stop.wait(0.5 * (attempt + 1))
        self.metrics.result("unreachable")
        self.events.emit("result", step=lease.step, lease_id=lease.lease_id, admitted=False, reason="unreachable")

    def _generate(self, grant: LeaseGrant) -> RolloutResult:
        from deltarl.protocol.records import RolloutResult, Sample

        assert self.backend is not None
        assert self.actor_id is not None
        info = self.model_info
        by_group: dict[int, list[PromptItem]] = {}
        for p in grant.prompts:
            by_group.setdefault(p.group_size, []).append(p)
        started = time.time()
        t0 = time.perf_counter()
        samples: list[Sample] = []
        for group, prompts in by_group.items():
            ids = [p.token_ids if p.token_ids else self._encode(p.text) for p in prompts]
            gens = self.backend.generate(ids, max_new_tokens=info.max_new_tokens, temperature=info.temperature, n=group)
            for k, (p, pids) in enumerate(zip(prompts, ids, strict=True)):
                for gen in gens[k * group : (k + 1) * group]:
                    samples.append(self._sample(p, pids, gen, Sample))
        gen_s = time.perf_counter() - t0
        return RolloutResult(
            step=grant.lease.step, lease_id=grant.lease.lease_id, actor_id=self.actor_id,
            version_id=self.weights.version_id, samples=samples, gen_seconds=gen_s,
            tokens=sum(len(s.completion_token_ids) for s in samples), started_at=started,
        )

    def _encode(self, text: str) -> list[int]:
        from deltarl.model.tokenizer import encode_prompt

        return encode_prompt(self.tokenizer, text, chat_template=self.model_info.tokenizer.chat_template)

    def _sample(self, p: PromptItem, prompt_ids: list[int], gen: Generation, sample_cls: Any) -> Any:
        text = self.tokenizer.decode(gen.completion_token_ids)
        reward = None
        if self.task is not None and p.answer is not None:
            reward = float(self.task.score(p.answer, text, gen.finish_reason))
        return sample_cls(prompt_id=p.prompt_id, prompt_token_ids=list(prompt_ids),
                          completion_token_ids=gen.completion_token_ids, completion_text=text,
                          logprobs=gen.logprobs, reward=reward, finish_reason=gen.finish_reason)

    # --- exit --------------------------------------------------------------------------------------

    def _write_state(self) -> None:
        """Write ``{version, version_id, state_digest}`` of the live weights to ``config.state_out``."""
        path = self.config.state_out
        held = None if self.weights is None else self.weights.held
        if not path or self.backend is None or held is None:
            return
        try:
            record = {"actor": self.name, "actor_id": self.actor_id, "version": held[0], "version_id": held[1],
                      "state_digest": self.backend.served_digest()}
            with open(path + ".tmp", "w") as fh:
                json.dump(record, fh, sort_keys=True)
            import os

            os.replace(path + ".tmp", path)
        except (OSError, DeltaRLError) as err:
            log.error("could not write the actor state to %s: %s", path, err)
