"""Coordinator benchmark: makespan of a step on a drifting, failing fleet, and HTTP throughput.

1. Makespan (simulated, virtual time, the real :class:`Scheduler`): three actors with speeds
   1 : 0.5 : 0.3 (x 3,000 tok/s), each drifting within +-30% (a new factor every ``--drift-period``
   s), the 0.5 actor dying at 40% of the step. The ideal makespan is the time at which the fleet's
   integrated speed (drift and death included) covers the step's total tokens. Compared: our
   scheduler (EMA-proportional, guided leases), the same with one lease per actor, and an equal
   split (every actor the same number of prompts, one lease each). Completion lengths are
   log-normal, unknown to the scheduler in advance; actors heartbeat every 2 s, death is noticed
   after 10 s of silence.
2. Throughput (real HTTP on loopback): a ``deltarl coordinator`` process over a local-directory
   store, 64 simulated actors (lease 1 prompt -> report -> heartbeat) and a trainer keeping steps
   open; requests/s and admitted results/s sustained. Client and server share this machine's CPUs.

Prints a table and ``makespan ratio vs ideal: <R>x``; writes ``benchmarks/results/scheduler.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deltarl.coordinator.config import CoordinatorConfig, SchedulerConfig, ServiceConfig
from deltarl.protocol.records import PromptItem, RolloutResult, Sample
from deltarl.testing.fleet import scenario, simulate

RESULTS = Path(__file__).resolve().parent / "results" / "scheduler.json"

# --- 1. simulated makespan ------------------------------------------------------------------------

POLICIES = {
    "ours (EMA-proportional, guided)": SchedulerConfig(),
    "proportional, one lease each": SchedulerConfig(chunks=1, max_lease_seconds=1e9),
    "equal split": SchedulerConfig(policy="equal", chunks=1, max_lease_seconds=1e9),
}


def bench_makespan(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    per_policy: dict[str, list[float]] = {k: [] for k in POLICIES}
    details: dict[str, list[dict[str, Any]]] = {k: [] for k in POLICIES}
    for seed in range(args.seeds):
        sc = scenario(seed, args.prompts, args.group, args.drift_period)
        for name, cfg in POLICIES.items():
            out = simulate(cfg, sc.fleet, sc.spec, sc.lengths)
            per_policy[name].append(out["makespan_s"] / sc.ideal)
            details[name].append(dict(out, seed=seed, ideal_s=sc.ideal, death_at_s=sc.death_at, tokens=sc.tokens))
    for name, ratios in per_policy.items():
        rows.append({
            "policy": name, "ratio_mean": statistics.mean(ratios), "ratio_max": max(ratios),
            "ratio_min": min(ratios), "runs": details[name],
        })
    return rows


# --- 2. HTTP throughput ---------------------------------------------------------------------------


async def _throughput(url: str, actors: int, seconds: float) -> dict[str, Any]:
    import aiohttp

    from deltarl.errors import AdmissionRejected
    from deltarl.protocol.client import CoordinatorClient

    counts = {"requests": 0, "admitted": 0, "rejected": 0, "empty": 0}
    latencies: list[float] = []
    stop = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=actors + 8)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as session:
        trainer = CoordinatorClient(url, "bench-trainer", session=session)
        client = CoordinatorClient(url, "bench-actor", session=session)
        step_n = itertools.count()

        async def open_next() -> int:
            n = next(step_n)
            prompts = [PromptItem(prompt_id=f"p{i}", text="x") for i in range(512)]
            await trainer.open_step(n, prompts, ["v1", "v0"])
            return n

        async def trainer_loop() -> None:
            pending = [await open_next(), await open_next()]
            while not stop.is_set():
                res = await trainer.step_results(pending[0], timeout=1.0)
                if res.complete:
                    pending = [pending[1], await open_next()]

        async def actor_loop() -> None:
            reg = await client.register(region="bench", backend="sim")
            k = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                resp = await client.lease(reg.actor_id, max_prompts=1)
                counts["requests"] += 1
                if resp.grant is None:
                    counts["empty"] += 1
                    await asyncio.sleep(0.01)
                    continue
                g = resp.grant
                samples = [Sample(prompt_id=p.prompt_id, prompt_token_ids=[1, 2], completion_token_ids=[3] * 16,
                                  completion_text="", logprobs=[-0.1] * 16, reward=1.0) for p in g.prompts]
                result = RolloutResult(step=g.lease.step, lease_id=g.lease.lease_id, actor_id=reg.actor_id,
                                       version_id="v1", samples=samples, gen_seconds=0.0, tokens=16 * len(samples))
                try:
                    await client.report(result)
                    counts["admitted"] += 1
                except AdmissionRejected:
                    counts["rejected"] += 1
                counts["requests"] += 1
                k += 1
                if k % 4 == 0:
                    await client.heartbeat(reg.actor_id)
                    counts["requests"] += 1
                latencies.append(time.perf_counter() - t0)

        tasks = [asyncio.create_task(trainer_loop())] + [asyncio.create_task(actor_loop()) for _ in range(actors)]
        await asyncio.sleep(1.0)  # warm-up
        base = dict(counts)
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - t0
        window = {k: counts[k] - base[k] for k in counts}
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    latencies.sort()
    return {
        "actors": actors, "seconds": elapsed, "requests_per_s": window["requests"] / elapsed,
        "admitted_per_s": window["admitted"] / elapsed, "rejected": window["rejected"],
        "lease_report_p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
        "lease_report_p99_ms": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else None,
    }


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = CoordinatorConfig(
            scheduler=SchedulerConfig(heartbeat_timeout_s=60.0),
            service=ServiceConfig(actor_tokens=["bench-actor"], trainer_tokens=["bench-trainer"]),
        )
        cfg_path = Path(tmp) / "coordinator.json"
        cfg_path.write_text(cfg.model_dump_json())
        log_path = Path(tmp) / "coordinator.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "deltarl.cli", "coordinator", "--store", str(Path(tmp) / "store"),
                 "--run", "bench", "--listen", "127.0.0.1:0", "--config", str(cfg_path)],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
            try:
                url = None
                for _ in range(600):
                    m = re.search(r"listening on (http://\S+)", log_path.read_text(errors="replace"))
                    if m:
                        url = m.group(1)
                        break
                    if proc.poll() is not None:
                        break
                    time.sleep(0.05)
                if url is None:
                    raise RuntimeError(f"coordinator did not start: {log_path.read_text(errors='replace')}")
                return asyncio.run(_throughput(url, args.actors, args.seconds))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds, shorter throughput window")
    parser.add_argument("--seeds", type=int, default=10, help="simulated steps per policy (default 10)")
    parser.add_argument("--prompts", type=int, default=256, help="prompts per simulated step (default 256)")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (default 4)")
    parser.add_argument("--drift-period", type=float, default=10.0, help="seconds between drift changes")
    parser.add_argument("--actors", type=int, default=64, help="simulated actors for the HTTP throughput")
    parser.add_argument("--seconds", type=float, default=10.0, help="throughput measuring window (s)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.seconds = min(args.seeds, 3), min(args.seconds, 3.0)

    from rich.console import Console
    from rich.table import Table

    console = Console()
    rows = bench_makespan(args)
    table = Table(title=f"makespan vs ideal: speeds 1:0.5:0.3, drift +-30%, one death, {args.seeds} steps")
    for col in ("policy", "mean", "min", "max", "mean leases", "mean revoked"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        runs = r["runs"]
        table.add_row(r["policy"], f"{r['ratio_mean']:.3f}x", f"{r['ratio_min']:.3f}x", f"{r['ratio_max']:.3f}x",
                      f"{statistics.mean(x['leases'] for x in runs):.0f}",
                      f"{statistics.mean(x['revoked'] for x in runs):.1f}")
    console.print(table)
    tp = bench_throughput(args)
    t2 = Table(title="coordinator over HTTP on loopback (client and server share this machine)")
    for col in ("actors", "requests/s", "admitted results/s", "lease+report p50", "p99"):
        t2.add_column(col, justify="right")
    t2.add_row(str(tp["actors"]), f"{tp['requests_per_s']:.0f}", f"{tp['admitted_per_s']:.0f}",
               f"{tp['lease_report_p50_ms']:.1f} ms", f"{tp['lease_report_p99_ms']:.1f} ms")
    console.print(t2)
    ours = rows[0]
    print(f"makespan ratio vs ideal: {ours['ratio_mean']:.3f}x")
    doc = {
        "benchmark": "scheduler", "quick": args.quick, "cpus": os.cpu_count(),
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "makespan": rows, "throughput": tp,
        "note": "throughput measured on a shared machine while other work ran: noisy",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
