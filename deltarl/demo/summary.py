"""The demo's ending: bit-exact checks (actors, replay), the audit, the numbers, the PNG and the next commands."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from deltarl import defaults
from deltarl.demo.view import StepRow


@dataclass(frozen=True)
class ActorOutcome:
    """What one demo actor ended with."""

    name: str
    throttle: float
    state: dict[str, Any] | None  # its final state report (version, version_id, state_digest)
    commits: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class DemoOutcome:
    """Everything the summary checks and prints, frozen when the demo's loop has ended."""

    run_name: str
    store_url: str
    store_given: bool  # --store was passed (else the local store under ``out``)
    out: Path
    work: Path  # the run's report folder
    rows: tuple[StepRow, ...]  # one per step, in order
    actors: tuple[ActorOutcome, ...]
    version_ids: tuple[str, ...]  # every version the trainer published, in order
    export: dict[str, Any]  # the trainer's final BF16 export
    train_s: float
    wall_s: float
    trainer_config: Any = None  # the TrainerConfig the demo ran (what summary.json records of it)


def _bits_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    if sorted(a) != sorted(b):
        return False
    return all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
               and torch.equal(a[n].contiguous().view(torch.uint8), b[n].contiguous().view(torch.uint8)) for n in a)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _config_fields(cfg: Any) -> dict[str, Any]:
    """What summary.json records of the trainer's configuration."""
    if cfg is None:
        return {}
    return {"model": cfg.model.name, "grpo_lr": cfg.grpo.lr, "lr_warmup_steps": cfg.grpo.lr_warmup_steps,
            "warmup_steps": cfg.warmup.steps, "carry_moments": cfg.warmup.carry_moments}


class Summary:
    """Checks and prints the outcome of one demo run."""

    def __init__(self, outcome: DemoOutcome, console: Console) -> None:
        self.outcome = outcome
        self.console = console
        self.export = outcome.export
        self.train_s = outcome.train_s
        self.wall_s = outcome.wall_s

    def show(self) -> bool:
        from deltarl.codec.tensors import state_digest
        from deltarl.coordinator.audit import audit_run
        from deltarl.demo.regime import scale_estimate
        from deltarl.demo.report import write_report
        from deltarl.demo.view import regime_line
        from deltarl.pipeline.replay import replay
        from deltarl.storage.open import open_store

        d, console = self.outcome, self.console
        final_version = len(d.version_ids) - 1
        final_id = d.version_ids[-1]
        digest = state_digest(self.export)
        store = open_store(d.store_url)
        try:
            replayed = replay(store, d.run_name, final_version)
            replay_ok = _bits_equal(replayed, self.export)
            audit = audit_run(store, d.run_name)
        finally:
            store.close()
        actor_ok = {a.name: bool(a.state and a.state["version_id"] == final_id and a.state["state_digest"] == digest)
                    for a in d.actors}
        rows = list(d.rows)
        names = [a.name for a in d.actors]
        png = write_report(rows, names, d.work / "report.png",
                           title=f"deltarl demo {d.run_name}: {len(rows)} steps, {len(names)} actors")

        rewards = [r.reward for r in rows]
        k = max(1, min(3, len(rewards)))
        staged = [max(r.staged_s.values()) for r in rows if len(r.staged_s) == len(names)]
        pauses = [c["pause_ms"] for a in d.actors for c in a.commits]
        estimate = scale_estimate([r.changed_elements for r in rows], [r.full_bytes // 2 for r in rows],
                                  [r.delta_bytes for r in rows])
        prompts = {n: sum(r.prompts.get(n, 0) for r in rows) for n in names}
        total_prompts = sum(prompts.values()) or 1

        table = Table(title="actors")
        for col in ("actor", "throttle", "prompts", "share", "final version", "weights = trainer's export",
                    "median publish→staged", "median commit pause"):
            table.add_column(col, justify="right")
        for a in d.actors:
            st = [c["publish_to_staged_s"] for c in a.commits if c.get("publish_to_staged_s") is not None]
            ps = [c["pause_ms"] for c in a.commits]
            table.add_row(a.name, f"{a.throttle:g}x", str(prompts[a.name]), f"{prompts[a.name] / total_prompts:.0%}",
                          str(a.state["version"]) if a.state else "?",
                          "[green]yes, bit for bit[/green]" if actor_ok[a.name] else "[red]NO[/red]",
                          f"{_median(st):.3f} s" if st else "-", f"{_median(ps):.2f} ms" if ps else "-")
        console.print(table)
        mark = {True: "[green]OK[/green]", False: "[red]FAILED[/red]"}
        rollouts = sum(s.results for s in audit.steps)
        console.print(
            f"reward {statistics.mean(rewards[:k]):.3f} → {statistics.mean(rewards[-k:]):.3f} over {len(rows)} steps "
            f"(first/last {k}); wall time {self.wall_s:.0f} s (training loop {self.train_s:.0f} s)\n"
            f"{regime_line(rows)}\n"
            f"{estimate.line() if estimate is not None else 'no element changed: no estimate at scale'}\n"
            f"publish → staged on every actor: median {_median(staged) or 0:.3f} s, max {max(staged, default=0):.3f} s; "
            f"commit pause (the in-place write; state digests are checked after it, before results are reported): "
            f"median {_median(pauses) or 0:.2f} ms, max {max(pauses, default=0):.2f} ms\n"
            f"replay of version {final_version} from the store equals the trainer's export bit for bit: {mark[replay_ok]}\n"
            f"every actor holds the trainer's final weights: {mark[all(actor_ok.values())]}\n"
            f"audit of {rollouts} stored rollouts in {len(audit.steps)} steps ({len(audit.failures)} failed checks): {mark[audit.ok]}\n"
            f"report: {png}",
            soft_wrap=True,  # long lines stay whole in logs (a terminal wraps them itself)
        )
        store_flag = "" if not d.store_given and str(d.out) == str(d.out.cwd() / defaults.STORE) else f" --store {d.store_url}"
        endpoint = os.environ.get(defaults.S3_ENDPOINT_ENV)
        if d.store_url.startswith("s3://") and endpoint:
            console.print(f"(S3 endpoint: export {defaults.S3_ENDPOINT_ENV}={endpoint} before the commands below)")
        console.print(
            f"\nrun folder: [cyan]{d.store_url}/{d.run_name}[/cyan]" if not d.store_given else f"\nrun: {d.store_url} / {d.run_name}"
        )
        console.print(f"  deltarl inspect {d.run_name}{store_flag}\n"
                      f"  deltarl replay {d.run_name}{store_flag} --verify --out {d.run_name}.safetensors\n"
                      f"  deltarl audit {d.run_name}{store_flag} --rescore 8")
        ok = replay_ok and all(actor_ok.values()) and audit.ok
        (d.work / "summary.json").write_text(json.dumps({
            "run": d.run_name, "store": d.store_url, "ok": ok, "wall_s": round(self.wall_s, 2),
            "train_s": round(self.train_s, 2), "rewards": rewards, "changed_fraction": [r.changed_fraction for r in rows],
            "delta_bytes": [r.delta_bytes for r in rows], "full_bytes": [r.full_bytes for r in rows],
            "publish_to_staged_max_s": staged, "commit_pause_ms": pauses, "prompts": prompts,
            "publish_to_staged_s": {r.version: r.staged_s for r in rows}, "replay_ok": replay_ok,
            "actors_ok": actor_ok, "audit_ok": audit.ok, "rollouts": rollouts,
            "changed_elements": [r.changed_elements for r in rows], "aurora_bytes": [r.aurora_bytes for r in rows],
            "estimate_8b": estimate.as_dict() if estimate is not None else None, **_config_fields(d.trainer_config),
        }, indent=1))
        return ok
