"""``deltarl demo``: the whole RL loop as a real deployment on one machine.

A coordinator, one relay and N actors run as separate ``deltarl`` processes; the GRPO trainer runs in
this process and publishes every version to the store (a local folder by default). Actors of unequal
speed (throttles) fetch each version through the relay, stage it while they generate and commit it
between batches. A live table shows every step; at the end the demo checks that every actor and a
replay from the store hold the trainer's exact bits, audits every stored rollout, and draws a PNG.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from deltarl import defaults
from deltarl.actor.backends.table import backend_entry
from deltarl.demo.procs import Child, stop_all
from deltarl.demo.view import DemoView, StepRow
from deltarl.errors import ChildError

log = logging.getLogger(__name__)

#: Throttles of the demo's actors, in order: unequal speeds, like a fleet of H100/A100/L40s.
THROTTLES = (1.0, 1.7, 2.6, 3.5, 4.5, 6.0, 8.0, 10.0)


@dataclass
class DemoOptions:
    """What ``deltarl demo`` runs; the defaults finish in a few minutes on 2 CPU cores."""

    steps: int = 25
    actors: int = 3
    store: str | None = None
    out: Path = Path(defaults.STORE)
    run: str | None = None
    prompts_per_step: int = 32
    group_size: int = 8
    keyframe_interval: int = 10
    digest_interval: int = 5
    trainer_threads: int | None = 1  # one torch thread: on a shared 2-core box two spin-wait (measured 10x slower)
    throttles: Sequence[float] = THROTTLES
    live: bool | None = None  # None: live table when stdout is a terminal
    #: the trainer's Prometheus endpoint, TensorBoard folder and wandb project (deltarl.trainer.sinks)
    metrics: Any = None
    model: str | None = None  # a local HF checkpoint directory instead of the tiny model
    lr: float | None = None  # GRPO lr (None: the preset's, 1e-6 for a checkpoint)
    warmup_steps: int | None = None  # supervised warm-up steps (None: the preset's, 0 for a checkpoint)
    backend: str = "hf"  # the actors' generation backend, by name (deltarl.actor.backends.table.BACKENDS)


@dataclass
class ActorRun:
    """One actor child and what its events told us."""

    name: str
    throttle: float
    child: Child
    events: Path
    state_out: Path
    actor_id: str | None = None
    version: int = -1
    commits: list[dict[str, Any]] = field(default_factory=list)
    offset: int = 0
    exit_code: int | None = None
    state: dict[str, Any] | None = None


class _Counting:
    """The trainer's coordinator, counting each step's admitted prompts per actor for the view."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.prompts: dict[int, dict[str, int]] = {}

    def open_step(self, spec: Any) -> Any:
        return self.inner.open_step(spec)

    def wait_results(self, step: int, *, timeout: float) -> list[Any]:
        results = list(self.inner.wait_results(step, timeout=timeout))
        counts: dict[str, int] = {}
        for r in results:
            counts[r.actor_id] = counts.get(r.actor_id, 0) + len(r.prompt_counts())
        self.prompts[step] = counts
        return results


class Demo:
    """Runs the demo once; :meth:`run` returns the process exit status."""

    def __init__(self, options: DemoOptions, console: Console | None = None) -> None:
        self.o = options
        self.console = console or Console()
        if not self.console.is_terminal and self.console.width < 140:
            self.console.width = 140  # logs and CI: lines wide enough for the tables
        self.run_name = options.run or time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime())
        self.out = options.out.resolve()
        self.store_url = options.store or str(self.out)
        self.work = self.out / "_reports" / self.run_name
        self.token = secrets.token_urlsafe(18)
        self.children: list[Child] = []
        self.actors: list[ActorRun] = []
        self.rows: dict[int, StepRow] = {}
        self.view: DemoView | None = None
        self.trainer_config: Any = None  # the TrainerConfig of the run, once training starts
        self._stop_poll = threading.Event()
        # the poller thread and the main thread both follow the actors' events (and the training
        # thread applies commits): one at a time, or two reads from one offset count it twice
        self._events_lock = threading.Lock()
        self._failure: str | None = None

    # --- orchestration -----------------------------------------------------------------------------

    def run(self) -> int:
        from deltarl.errors import DeltaRLError

        t0 = time.perf_counter()
        self.work.mkdir(parents=True, exist_ok=True)
        self.console.print(f"[bold]deltarl demo[/bold]: run [cyan]{self.run_name}[/cyan] in store [cyan]{self.store_url}[/cyan]; "
                           f"{self.o.steps} steps, {self.o.actors} actors; logs in {self.work}")
        poller = threading.Thread(target=self._poll, name="demo-events", daemon=True)
        try:
            coordinator, relay = self._start_services()
            self._start_actors(coordinator, relay)
            poller.start()
            trainer, export = self._train(coordinator)
            train_s = time.perf_counter() - t0
            self._await_final(trainer.version_ids[-1], len(trainer.version_ids) - 1)
            self._stop_poll.set()
            self._stop_children()
            ok = self._finish(trainer, export, train_s, time.perf_counter() - t0)
            return 0 if ok else 1
        except KeyboardInterrupt:
            self.console.print(f"[yellow]interrupted[/yellow]{': ' + self._failure if self._failure else ''}; stopping every process")
            return 130 if self._failure is None else 1
        except (DeltaRLError, ChildError, OSError) as err:
            self.console.print(f"[red]demo failed:[/red] {err}")
            self.console.print(f"logs: {self.work}")
            return 1
        finally:
            self._stop_poll.set()
            self._stop_children()

    def _env(self) -> dict[str, str]:
        env = {defaults.COORDINATOR_TOKEN_ENV: self.token, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        for key, value in backend_entry(self.o.backend).demo_env.items():  # the caller's setting wins
            env[key] = os.environ.get(key, value)
        return env

    def _backend_args(self) -> list[str]:
        """The actors' backend flags: the engine small enough for a shared CPU machine (its table row's demo options)."""
        entry = backend_entry(self.o.backend)
        options = [f"{k}={json.dumps(v)}" for k, v in entry.demo_options.items()]
        return ["--backend", entry.name, *(arg for opt in options for arg in ("--engine-option", opt))]

    def _start_services(self) -> tuple[str, str]:
        from deltarl.coordinator.config import CoordinatorConfig, SchedulerConfig, ServiceConfig

        cfg = CoordinatorConfig(
            scheduler=SchedulerConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=15.0, lease_margin_s=20.0,
                                      prior_tokens_per_sample=6.0, chunks=3),
            service=ServiceConfig(tick_interval_s=0.2),
        )
        cfg_path = self.work / "coordinator.json"
        cfg_path.write_text(cfg.model_dump_json(indent=1))
        coord = Child("coordinator", ["coordinator", "--store", self.store_url, "--run", self.run_name,
                                      "--listen", "127.0.0.1:0", "--config", str(cfg_path)],
                      self.work / "coordinator.log", self._env())
        self.children.append(coord)
        relay = Child("relay", ["relay", "--upstream", self.store_url, "--listen", "127.0.0.1:0",
                                "--cache-dir", str(self.work / "relay-cache"), "--cache-bytes", "1G", "--head-ttl", "0.05"],
                      self.work / "relay.log", self._env())
        self.children.append(relay)
        coord_url = coord.wait_for(r"listening on (http://\S+)").group(1)
        relay_url = relay.wait_for(r" on (http://\S+)").group(1)
        return coord_url, relay_url

    def _start_actors(self, coordinator: str, relay: str) -> None:
        for i in range(self.o.actors):
            name = f"actor-{i + 1}"
            throttle = self.o.throttles[i % len(self.o.throttles)]
            events, state_out = self.work / f"{name}.events.jsonl", self.work / f"{name}.state.json"
            child = Child(name, ["-v", "actor", "--coordinator", coordinator, "--store", self.store_url, "--run", self.run_name,
                                 "--relay", relay, "--throttle", str(throttle), "--seed", str(i + 1), "--name", name,
                                 "--events", str(events), "--state-out", str(state_out), *self._backend_args()],
                          self.work / f"{name}.log", self._env())
            self.children.append(child)
            self.actors.append(ActorRun(name, throttle, child, events, state_out))

    def _train(self, coordinator: str) -> tuple[Any, dict[str, Any]]:
        from deltarl.demo.preset import demo_trainer_config
        from deltarl.demo.regime import AuroraCounting
        from deltarl.pipeline.publisher import Publisher
        from deltarl.protocol.client import SyncCoordinatorClient
        from deltarl.storage.open import open_store
        from deltarl.trainer.loop import ClientCoordinator, StepReport, TrainerLoop
        from deltarl.trainer.metrics import TrainerMetrics
        from deltarl.trainer.sinks import SinkConfig, Sinks

        o = self.o
        sink_config = o.metrics if o.metrics is not None else SinkConfig()
        metrics = TrainerMetrics()
        server = None
        if sink_config.metrics_port is not None:
            from deltarl.exposition import MetricsServer

            server = MetricsServer(metrics.registry, port=sink_config.metrics_port, host=sink_config.metrics_host)
        sinks = Sinks.open(sink_config, run=self.run_name, hyperparameters={"steps": o.steps, "actors": o.actors,
                                                                             "prompts_per_step": o.prompts_per_step,
                                                                             "group_size": o.group_size})
        cfg = demo_trainer_config(store=self.store_url, run=self.run_name, steps=o.steps, prompts_per_step=o.prompts_per_step,
                                  group_size=o.group_size, torch_threads=o.trainer_threads, model=o.model, lr=o.lr,
                                  warmup_steps=o.warmup_steps)
        self.trainer_config = cfg
        store = open_store(self.store_url)
        names = [a.name for a in self.actors]
        what = "tiny Qwen3" if cfg.model.is_tiny else Path(cfg.model.name).name
        title = f"deltarl demo: run {self.run_name}, {o.actors} actors (throttle " + \
            "/".join(f"{a.throttle:g}" for a in self.actors) + f"), {what} on addition, GRPO lr {cfg.grpo.lr:g}"
        live = o.live if o.live is not None else self.console.is_terminal
        if not live:
            self.console.print(title, highlight=False, soft_wrap=True)
        self.view = DemoView(names, title=title, console=self.console)
        self.view.status = "starting: actors load the model and bootstrap version 0 through the relay"
        counting: _Counting | None = None
        aurora: AuroraCounting | None = None

        def on_step(r: StepReport) -> None:
            metrics.step(r)
            sinks.log_step(r)
            st = r.publish.stats
            prompts = counting.prompts.get(r.step, {}) if counting is not None else {}
            row = StepRow(step=r.step, version=r.version, reward=r.stats.reward_mean,
                          changed_fraction=st.changed_fraction, delta_bytes=st.encoded_bytes, full_bytes=st.full_bytes,
                          wait_s=r.wait_s, publish_s=r.publish_s,
                          prompts={self._name_of(a): n for a, n in prompts.items()},
                          changed_elements=st.changed_elements,
                          aurora_bytes=aurora.aurora_bytes.get(r.version) if aurora is not None else None)
            self.rows[r.step] = row
            assert self.view is not None
            self.view.add_step(row)
            self._apply_commits()
            self.view.set_status(f"step {r.step}/{o.steps}: training {r.stats.seconds:.2f}s, publish {r.publish_s:.2f}s, "
                                 f"waited {r.wait_s:.2f}s for {r.stats.samples} samples")

        try:
            with SyncCoordinatorClient(coordinator, self.token) as client, Publisher(
                store, self.run_name, keyframe_interval=o.keyframe_interval, digest_interval=o.digest_interval
            ) as publisher:
                counting = _Counting(ClientCoordinator(client, poll_s=5.0))
                aurora = AuroraCounting(publisher)
                if cfg.warmup.steps:
                    self.console.print(f"warm-up: {cfg.warmup.steps} supervised steps on correct answers at lr {cfg.warmup.lr:g} "
                                       f"(cached in {self.out / '_cache'})", highlight=False)
                loop = TrainerLoop(cfg, coordinator=counting, publisher=aurora, store=store, on_step=on_step,
                                   warmup_cache=self.out / "_cache")
                if loop.warmup is not None:
                    w = loop.warmup
                    how = "reused from the cache" if w.cached else f"took {w.seconds:.1f} s"
                    self.console.print(f"warm-up {how}: loss {w.losses[0]:.3f} -> {w.losses[-1]:.3f}; "
                                       f"GRPO at lr {cfg.grpo.lr:g} starts from AdamW's moments ({cfg.warmup.carry_moments})",
                                       highlight=False)
                metrics.published(loop.start())  # version 0
                if live:
                    with self.view:
                        loop.run()
                else:
                    loop.run()
                export = loop.trainer.export_bf16()
        finally:
            sinks.close()
            if server is not None:
                server.close()
            store.close()
        return loop, export

    # --- actor events ------------------------------------------------------------------------------

    def _name_of(self, actor_id: str) -> str:
        return next((a.name for a in self.actors if a.actor_id == actor_id), actor_id[:12])

    def _read_events(self, a: ActorRun) -> None:
        with self._events_lock:
            lines, a.offset = _new_lines(a.events, a.offset)
            for line in lines:
                self._take_event(a, json.loads(line))

    @staticmethod
    def _take_event(a: ActorRun, ev: dict[str, Any]) -> None:
        if ev["event"] == "registered":
            a.actor_id = ev["actor_id"]
            a.version = max(a.version, ev["version"])
        elif ev["event"] == "bootstrap":
            a.version = max(a.version, ev["version"])
        elif ev["event"] == "commit":
            a.commits.append(ev)
            a.version = max(a.version, ev["version"])

    def _apply_commits(self) -> None:
        if self.view is None:
            return
        with self._events_lock:
            for a in self.actors:
                for c in a.commits:
                    if c.get("publish_to_staged_s") is not None:
                        self.view.set_staged(c["version"], a.name, c["publish_to_staged_s"], c.get("pause_ms"))

    def _poll(self) -> None:
        """Follow the actors' events; stop the demo if a service or every actor dies."""
        while not self._stop_poll.wait(0.25):
            for a in self.actors:
                self._read_events(a)
            self._apply_commits()
            if self.view is not None:
                self.view.refresh()
            dead = [c for c in self.children if not c.alive]
            services_dead = [c.name for c in dead if c.name in ("coordinator", "relay")]
            if services_dead or (self.actors and all(not a.child.alive for a in self.actors)):
                what = ", ".join(c.name for c in dead)
                self._failure = f"{what} exited unexpectedly (logs in {self.work})"
                _thread.interrupt_main()
                return

    def _await_final(self, final_id: str, final_version: int, timeout: float = 60.0) -> None:
        """Wait until every live actor has committed the final version (they do so while idle)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for a in self.actors:
                self._read_events(a)
            if all(a.version >= final_version for a in self.actors if a.child.alive):
                break
            time.sleep(0.1)
        self._apply_commits()
        if self.view is not None:
            self.view.set_status("done")

    def _stop_children(self) -> None:
        actors = [c for c in self.children if c.name.startswith("actor-")]
        codes = stop_all(actors, timeout=20)
        for a in self.actors:
            if a.name in codes and a.exit_code is None:
                a.exit_code = codes[a.name]
        stop_all([c for c in self.children if c not in actors], timeout=20)
        self.children = []

    # --- the end -----------------------------------------------------------------------------------

    def _finish(self, trainer: Any, export: dict[str, Any], train_s: float, wall_s: float) -> bool:
        from deltarl.demo.summary import ActorOutcome, DemoOutcome, Summary

        for a in self.actors:
            self._read_events(a)
            if a.state_out.exists():
                a.state = json.loads(a.state_out.read_text())
        self._apply_commits()
        outcome = DemoOutcome(
            run_name=self.run_name, store_url=self.store_url, store_given=self.o.store is not None, out=self.out,
            work=self.work, rows=tuple(self.rows[k] for k in sorted(self.rows)),
            actors=tuple(ActorOutcome(a.name, a.throttle, a.state, tuple(a.commits)) for a in self.actors),
            version_ids=tuple(trainer.version_ids), export=export, train_s=train_s, wall_s=wall_s,
            trainer_config=self.trainer_config,
        )
        return Summary(outcome, self.console).show()


def run_demo(options: DemoOptions, console: Console | None = None) -> int:
    """Run the demo; return the exit status (0 when every check passed)."""
    if os.environ.get(defaults.S3_ENDPOINT_ENV) is None and options.store and options.store.startswith("s3://"):
        log.info("no %s: using the AWS default endpoint for %s", defaults.S3_ENDPOINT_ENV, options.store)
    return Demo(options, console).run()


def _new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The complete lines of a JSON-lines file written after byte ``offset``, and the offset after
    them (a line still being written is left for the next read); none while the file does not exist."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    return chunk[:end].decode().splitlines(), offset + end
