"""``python -m benchmarks.e2e --full-size``: the e2e loop with real (unscaled, S = 1) bytes.

Qwen3 shapes at full size (``_scale_state``: the HF config numbers, BF16 built in place; each
version changes ~1% of the weights by an ulp, as Adam at lr 1e-6 does), every component its own
process (``fullnet.py``: origin relay in a network namespace, tbf-shaped veth per region, the link
emulator for delay and window, a ``deltarl relay`` per region, one actor process per region), the
trainer's Publisher in this process. Time may be scaled by T (durations / T, link rates x T);
bytes are not. Parts: ``main`` (the headline model at each rate: ideal, full, deltarl), ``sweep``
(a smaller model, regions 1..N), ``events`` (a late joiner, a relay killed mid-transfer, a slow
actor); each part updates its own section of the output JSON.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks._scale_state import MODELS, generate, qwen3_specs, reset_peak, rss_bytes

from .driver import Timeline, Window, drive, summarize
from .fullnet import FlatFullPublisher, FullNetwork, TrainerVersions, sleep_until
from .modes import IdealActor, IdealBoard
from .procs import Child

GB = 1e9
GBPS = 1e9


def _cpu() -> float:
    import os

    t = os.times()
    return t.user + t.system


@dataclass(frozen=True)
class Setting:
    """One full-size run's settings (durations at full size; the run divides them by T)."""

    model: str = "1.7b"
    regions: int = 2
    rate_gbps: float = 1.0
    T: float = 1.0
    rtt_s: float = 0.050
    window_bytes: int = 2 << 20
    gen_s: float = 45.0
    train_s: float = 15.0
    lag: int = 1
    steps: int = 3
    full_steps: int = 2
    segment_bytes: int = 16 << 20
    shard_bytes: int = 1 << 30
    range_bytes: int = 1 << 20
    streams: int = 4

    @property
    def copy_bytes(self) -> int:
        return 2 * sum(s.numel for s in qwen3_specs(MODELS[self.model]))

    @property
    def rate_bps(self) -> float:
        return self.rate_gbps * GBPS * self.T

    def t(self, seconds: float) -> float:
        return seconds / self.T


def ensure_trace(scratch: Path, model: str, versions: int) -> Path:
    """The generated states of ``model`` (version 0 and ``versions`` change sets), made once."""
    d = scratch / model
    meta = d / "meta.json"
    if not meta.exists() or json.loads(meta.read_text())["versions"] < versions:
        generate(d, model, versions)
    return d


Hook = Callable[[int, float, float], Awaitable[None]]


async def _drive_procs(children: list[Child], joiners: list[Child], publish: Callable[[int], dict[str, Any]],
                       prepare: Callable[[int], Any], st: Setting, steps: int,
                       on_publish_start: Hook | None = None, on_published: Hook | None = None) -> tuple[Timeline, dict[str, Any]]:  # fmt: skip
    """The step loop of ``driver.drive`` with the actors in their own processes: the trainer waits
    for window k from every (non-joining) actor, trains (``prepare`` builds the next export meanwhile),
    publishes. Returns the timeline and each actor's final report."""
    windows = steps + st.lag + 1
    loop = asyncio.get_running_loop()
    ends = {(c.name, k): loop.create_future() for c in children for k in range(windows)}
    tl = Timeline()
    reports: dict[str, dict[str, Any]] = {}

    async def listen(c: Child) -> None:
        while True:
            msg = await c.lines.get()
            if "end" in msg:
                tl.windows.append(Window(c.name, msg["end"], msg["start_t"], msg["t"], msg["wait"], msg["version"]))
                fut = ends.get((c.name, msg["end"]))
                if fut is not None and not fut.done():
                    fut.set_result(msg["t"])
            elif "bootstrapped" in msg:
                reports.setdefault(c.name, {})["bootstrap"] = msg
            elif "done" in msg:
                reports.setdefault(c.name, {}).update(msg)
                return
            elif "eof" in msg:
                raise RuntimeError(f"{c.name} exited (rc {msg['rc']}) before it was done")

    async def trainer() -> None:
        for k in range(steps):
            done = [await ends[c.name, k] for c in children]
            prep = asyncio.ensure_future(asyncio.to_thread(prepare, k + 1))
            await sleep_until(max(done) + st.t(st.train_s))
            t_ready = time.monotonic()
            await prep
            t0 = time.monotonic()
            if on_publish_start is not None:
                await on_publish_start(k + 1, t0, t0)
            c0 = _cpu()
            info = await asyncio.to_thread(publish, k + 1)
            t1 = time.monotonic()
            tl.publishes[k + 1] = {"start": t0, "end": t1, "cpu_s": _cpu() - c0, "prepare_late_s": t0 - t_ready, **info}
            if on_published is not None:
                await on_published(k + 1, t0, t1)

    listeners = [asyncio.ensure_future(listen(c)) for c in (*children, *joiners)]
    for c in children:
        c.send(go=1)
    await asyncio.gather(trainer(), *listeners)
    for name, rep in reports.items():
        tl.staged_at[name] = {int(v): t for v, t in rep["staged_at"].items()}
        tl.pauses[name] = list(rep["pauses"])
    return tl, reports


async def run_ideal(st: Setting, steps: int) -> dict[str, Any]:
    board = IdealBoard()
    actors = [IdealActor(f"region-{i + 1}", board) for i in range(st.regions)]
    tl = await drive(board.publish, [{}] * (steps + 1), actors, steps=steps, lag=st.lag, gen_s=st.t(st.gen_s),
                     train_s=st.t(st.train_s), publish_in_thread=False)  # fmt: skip
    out = summarize(tl, steps=steps, lag=st.lag, gen_s=st.t(st.gen_s))
    out.update(steps=steps, exact=None, link_bytes_per_step={a.name: 0 for a in actors})
    return out


async def run_real(mode: str, st: Setting, trace: Path, root: Path, *, steps: int, events: dict[str, Any] | None = None) -> dict[str, Any]:
    """One mode (``full`` or ``deltarl``) on a fresh network: relays, links and actors started for it."""
    from deltarl.codec import state_digest
    from deltarl.codec.jit_warmup import warm_codec
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage import LocalStore

    warm_codec(["bfloat16"])  # numba's compiled kernels loaded before any measurement (once per process)
    run = f"e2e-{mode}"
    copy = st.copy_bytes
    tv = TrainerVersions(trace, st.model, root / "trainer")
    events = events or {}
    reset_peak()
    base_rss = rss_bytes("VmRSS")
    async with FullNetwork(root / "net", st.regions, rate_bps=st.rate_bps, rtt_s=st.t(st.rtt_s), window_bytes=st.window_bytes) as net:
        store = LocalStore(str(net.origin_dir))
        current: dict[int, tuple[Any, dict[str, Any]]] = {0: tv.load(0)}
        keyframe: dict[str, Any] = {}
        vid0 = None
        if mode == "deltarl":
            pub = Publisher(store, run, keyframe_interval=10**9, digest_interval=10**9, segment_bytes=st.segment_bytes)
            t0, c0 = time.monotonic(), _cpu()
            await asyncio.to_thread(pub.publish, current[0][1], 0, owned=True)  # version 0: the keyframe
            keyframe = {"wall_s": time.monotonic() - t0, "cpu_s": _cpu() - c0}
            vid0 = pub.head_version_id

            def publish(v: int) -> dict[str, Any]:
                info = pub.publish(current[v][1], step=v, owned=True)
                current.pop(v - 1, None)
                return {"bytes": info.stats.encoded_bytes, "objects": len(info.segment_keys), "encode_s": info.encode_s,
                        "upload_s": info.upload_s, "changed_fraction": info.stats.changed_fraction}  # fmt: skip
        else:
            fpub = FlatFullPublisher(store, run, shard_bytes=st.shard_bytes)

            def publish(v: int) -> dict[str, Any]:
                out = fpub.publish(current[v][0], v)
                current.pop(v - 1, None)
                for key in store.list(f"{run}/full/{v - 2:012d}/") if v >= 2 else []:  # the trainer keeps two versions
                    store.delete(key)
                return out

        def prepare(v: int) -> None:
            current[v] = tv.load(v)

        windows = steps + st.lag + 1
        joiner_name = events.get("join_region")

        def actor_cfg(r: Any, join: bool) -> dict[str, Any]:
            return {"name": r.name, "mode": mode, "scratch": str(trace), "model": st.model, "run": run, "sources": r.sources,
                    "vid0": vid0, "windows": windows, "lag": st.lag, "gen_s": st.t(st.gen_s), "streams": st.streams,
                    "range_bytes": st.range_bytes, "staging": str(root / f"staging-{r.name}.bin"), "join": join,
                    "slowdown": events.get("slowdown", {}).get(r.name, 1.0)}  # fmt: skip

        children = [Child(r.name, "benchmarks._e2e.actorproc", actor_cfg(r, False)) for r in net.regions if r.name != joiner_name]
        joiners = [Child(r.name, "benchmarks._e2e.actorproc", actor_cfg(r, True)) for r in net.regions if r.name == joiner_name]
        loads = await asyncio.gather(*(c.start() for c in (*children, *joiners)))
        ev: dict[str, Any] = {}

        async def on_publish_start(v: int, t0: float, _: float) -> None:
            if v == events.get("kill_at_version"):
                region = next(r for r in net.regions if r.name == events["kill_region"])
                delay = events.get("kill_delay_s", 0.5)

                async def kill() -> None:
                    await asyncio.sleep(delay)
                    await asyncio.to_thread(region.relay.kill)
                    ev["relay_killed"] = {"region": region.name, "version": v, "at": time.monotonic(), "publish_start": t0}

                ev["kill_task"] = asyncio.ensure_future(kill())

        async def on_published(v: int, t0: float, t1: float) -> None:
            if joiners and v == events.get("join_after_version"):
                ev["join"] = {"go_at": time.monotonic(), "head": v}
                for j in joiners:
                    j.send(go=1, first_window=v + st.lag)

        before, cpu0 = await net.link_bytes(), net.cpu()
        t_start = time.monotonic()
        try:
            tl, reports = await _drive_procs(children, joiners, publish, prepare, st, steps, on_publish_start, on_published)
            cpu1 = net.cpu()
            after = await net.link_bytes()
            peaks = net.peak_rss()
            if "kill_task" in ev:
                await ev.pop("kill_task")
        finally:
            for c in (*children, *joiners):
                await c.close()
            if mode == "full":
                fpub.close()
            else:
                pub.close()
        wall = time.monotonic() - t_start
        final = current[steps]
        want = await asyncio.to_thread(state_digest, final[1])
    trainer_peak = rss_bytes("VmHWM")
    tv.cleanup()
    shutil.rmtree(root, ignore_errors=True)  # stores, relay caches, staging files: tens of GB at full size
    out = summarize(tl, steps=steps, lag=st.lag, gen_s=st.t(st.gen_s))
    pubs = list(tl.publishes.values())
    link = {name: after[name] - before[name] for name in after}
    versions = len(pubs)
    cpu = {"trainer_publish": statistics.fmean(p["cpu_s"] for p in pubs)}
    for name, rep in reports.items():
        cpu[f"actor:{name}"] = rep["cpu_s"] / versions
    for role, c in cpu1.items():
        if role in cpu0:
            cpu[role] = (c - cpu0[role]) / versions
    rss = {"trainer": (trainer_peak - base_rss) / copy}
    rss.update({f"actor:{n}": rep["peak_rss"] / copy for n, rep in reports.items()})
    rss.update({role: b / copy for role, b in peaks.items()})
    digests = {n: rep["digest"] for n, rep in reports.items()}
    out.update(
        steps=steps, wall_s=wall, link_bytes=link, link_bytes_per_step={n: b / steps for n, b in link.items()},
        cpu_s_per_version=cpu, peak_rss_copies=rss, digest=want, actor_digests=list(digests.values()),
        actor_versions={n: rep["version"] for n, rep in reports.items()},
        exact=all(d == want for d in digests.values()) and all(rep["version"] == steps for rep in reports.values()),
        exact_per_actor={n: d == want for n, d in digests.items()}, publishes=pubs, actor_load_s=[x["load_s"] for x in loads],
        trainer_prepare_late_s=max(p["prepare_late_s"] for p in pubs),
        fetch_bytes_by_source={n: rep["bytes_by_source"] for n, rep in reports.items()},
        failovers={n: rep["failovers"] for n, rep in reports.items()},
    )  # fmt: skip
    if keyframe:
        out["keyframe_publish"] = keyframe
    transfer_s = out["staged_s"] - out["publish_s"]
    if transfer_s > 0:
        per_link = sum(out["link_bytes_per_step"].values()) / len(link)
        out["link_utilization"] = per_link * 8 / (st.rate_bps * transfer_s)
    if events:
        out["events"] = _event_figures(events, ev, tl, reports, st, keyframe_bytes=copy)
    return out


def _event_figures(events: dict[str, Any], ev: dict[str, Any], tl: Timeline, reports: dict[str, Any], st: Setting,
                   keyframe_bytes: int) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {}
    name = events.get("join_region")
    if name and "join" in ev:
        rep = reports[name]
        boot = rep["bootstrap"]
        first = min((w for w in tl.windows if w.actor == name), key=lambda w: w.k)
        link_s = keyframe_bytes * 8 / st.rate_bps
        t_staged = boot["bootstrapped"] - boot["go_at"]
        out["late_joiner"] = {
            "region": name, "joined_after_version": ev["join"]["head"], "bootstrapped_version": boot["version"],
            "time_to_staged_s": t_staged, "time_to_first_window_s": first.start - boot["go_at"],
            "time_to_first_result_s": first.end - boot["go_at"], "first_window_version": first.version,
            "keyframe_bytes": keyframe_bytes, "keyframe_over_link_s": link_s, "staged_vs_link": t_staged / link_s,
            "bytes_by_source": boot["bytes_by_source"], "target_max": 1.3,
        }  # fmt: skip
    if "relay_killed" in ev:
        k = ev["relay_killed"]
        region = k["region"]
        v = k["version"]
        staged_at = tl.staged_at[region].get(v)
        windows = [w for w in tl.windows if w.actor == region]
        lost = [w.k for w in windows if w.version < max(0, w.k - st.lag)]
        out["relay_lost"] = {
            "region": region, "version": v, "killed_after_publish_start_s": k["at"] - k["publish_start"],
            "staged_after_kill_s": None if staged_at is None else staged_at - k["at"],
            "mid_transfer": staged_at is not None and staged_at > k["at"],
            "staged_after_publish_start_s": None if staged_at is None else staged_at - k["publish_start"],
            "failovers": reports[region]["failovers"], "bytes_by_source": reports[region]["bytes_by_source"],
            "windows_completed": len(windows), "windows_with_a_stale_policy": lost,
            "final_version": reports[region]["version"],
        }  # fmt: skip
    return out


def _ratio_row(rate: float, modes: dict[str, Any], st: Setting) -> dict[str, Any]:
    row: dict[str, Any] = {"rate_gbps": rate, "scaled_rate_bps": st.rate_bps, "modes": modes}
    ideal = modes["ideal"]["step_s"]
    for m, r in modes.items():
        row[f"{m}_step_s"] = r["step_s"]
        row[f"{m}_step_full_size_s"] = r["step_s"] * st.T
        row[f"{m}_ratio"] = r["step_s"] / ideal
    if "full" in modes:  # the same loop at the nominal link rate (the link emulator may fall short)
        f, gen = modes["full"], st.t(st.gen_s)
        transfer = sum(f["link_bytes_per_step"].values()) / len(f["link_bytes_per_step"]) * 8 / st.rate_bps
        x = st.t(st.train_s) + f["publish_s"] + transfer
        row["full_nominal_step_s"] = max(gen, (x + gen) / (st.lag + 1), transfer)
        row["full_nominal_ratio"] = row["full_nominal_step_s"] / ideal
    row["targets"] = {"deltarl_ratio_max": 1.05 if rate >= 1 else 1.10}
    if "deltarl" in modes:
        row["targets"]["met"] = row["deltarl_ratio"] <= row["targets"]["deltarl_ratio_max"]
    return row


async def part_main(st: Setting, rates: list[float], trace: Path, root: Path, modes: list[str], log: Callable[[str], None],
                    on_mode: Callable[[str, str, dict[str, Any]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    rows = {}
    for rate in rates:
        s = replace(st, rate_gbps=rate)
        real: dict[str, Any] = {}
        for m in modes:  # the real modes first: a failure shows before the ideal's minutes of waiting
            steps = s.full_steps if m == "full" else s.steps
            real[m] = await run_real(m, s, trace, root / f"{m}-{rate:g}", steps=steps)
            log(f"{rate:g} Gbit/s {m}: step {real[m]['step_s']:.2f}s staged {real[m]['staged_s']:.2f}s exact {real[m]['exact']}")
            if on_mode is not None:
                on_mode(f"{rate:g}gbps", m, real[m])
        res: dict[str, Any] = {"ideal": await run_ideal(s, s.steps), **real}
        log(f"{rate:g} Gbit/s ideal: step {res['ideal']['step_s']:.2f}s")
        rows[f"{rate:g}gbps"] = _ratio_row(rate, res, s)
        if on_mode is not None:
            on_mode(f"{rate:g}gbps", "ideal", res["ideal"])
    return rows


async def part_sweep(st: Setting, regions: list[int], trace: Path, root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    ideal = await run_ideal(st, st.steps)
    out: dict[str, Any] = {"rate_gbps": st.rate_gbps, "model": st.model, "ideal_step_s": ideal["step_s"], "points": []}
    for n in regions:
        s = replace(st, regions=n)
        point: dict[str, Any] = {"regions": n}
        for m in ("full", "deltarl"):
            r = await run_real(m, s, trace, root / f"sweep-{m}-{n}", steps=s.full_steps if m == "full" else s.steps)
            point[m] = {k: r[k] for k in ("step_s", "staged_s", "publish_s", "idle_fraction", "exact", "link_bytes_per_step",
                                          "cpu_s_per_version", "peak_rss_copies")}  # fmt: skip
            point[f"{m}_ratio"] = r["step_s"] / ideal["step_s"]
            log(f"sweep {n} regions {m}: {point[f'{m}_ratio']:.3f}x ideal, exact {r['exact']}")
        out["points"].append(point)
    return out


async def part_events(st: Setting, trace: Path, root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """deltarl with three events in one run: region-2's actor joins after version 1 (keyframe over
    its WAN link, then deltas), region-1's relay is SIGKILLed while version 3 is in flight, and a
    slow and a lost actor through the coordinator's scheduler in virtual time (``straggler``)."""
    events = {"join_region": "region-2", "join_after_version": 1, "kill_region": "region-1", "kill_at_version": 3,
              "kill_delay_s": st.t(1.0)}  # fmt: skip
    r = await run_real("deltarl", st, trace, root / "events", steps=st.steps, events=events)
    log(f"events: {json.dumps(r['events'])[:400]}")
    out = {"setting": asdict(st), "run": {k: v for k, v in r.items() if k != "publishes"}, **r["events"]}
    out["scheduler"] = straggler(st)
    return out


def straggler(st: Setting) -> dict[str, Any]:
    """One actor 2x slower, and one lost mid-step, through the coordinator's real scheduler
    (``deltarl.coordinator.scheduler.Scheduler``: EMA tokens/s, proportional guided leases,
    deadlines, two-phase admission) in virtual time (``deltarl.testing.fleet.simulate``); the window
    is scaled so the even split of the fleet at full speed fills one generation window."""
    import random

    from deltarl.coordinator.config import SchedulerConfig
    from deltarl.testing.fleet import Fleet, make_step, simulate

    spec, lengths = make_step(random.Random(0), 256, 4)
    work = float(sum(sum(v) for v in lengths.values()))
    tps = work / 2 / st.gen_s  # two actors at full speed finish the step in one window
    out: dict[str, Any] = {"prompts": 256, "group": 4, "tokens": work, "tokens_per_s_full_speed": tps}
    for name, speeds, death in (("slow", [1.0, 0.5], {}), ("lost", [1.0, 1.0], {1: st.gen_s * 0.4})):
        fleet = Fleet([tps * s for s in speeds], [[1.0], [1.0]], 1e9, death)
        res = simulate(SchedulerConfig(), fleet, spec, lengths)
        ideal = fleet.ideal(work)
        even = max(work / 2 / (tps * s) for s in speeds)
        out[name] = {"speeds": speeds, "died_at_s": death.get(1), **res, "ideal_makespan_s": ideal,
                     "makespan_ratio": res["makespan_s"] / ideal, "even_split_makespan_s": even if not death else None,
                     "share_fraction": [n / 256 for n in res["share"]]}  # fmt: skip
    return out


def tokens_per_dollar(rows: dict[str, Any], T: float) -> dict[str, Any]:
    """Tokens per dollar from the measured step times: the RDMA ideal on 8xH100 at $55.04/h + 26% for
    the RDMA fabric against deltarl (and full broadcast) on the same GPUs on Ethernet pricing. Per
    10,000 tokens/s of the cluster's generation throughput (tokens per step = that rate x the
    generation window; every figure scales with it)."""
    price, fabric, tps = 55.04, 0.26, 10_000
    out = {"gpu_price_per_h": price, "rdma_fabric_premium": fabric, "per_tokens_per_s": tps, "rates": {}}
    for key, row in rows.items():
        gen = row["modes"]["ideal"]["step_s"] * T  # the ideal step is the generation window
        tokens = tps * gen

        def per_dollar(step_s: float, price_h: float, tokens: float = tokens) -> float:
            return tokens / (step_s * T * price_h / 3600)

        rdma = per_dollar(row["ideal_step_s"], price * (1 + fabric))
        entry = {"rdma_ideal": rdma}
        for m in ("deltarl", "full"):
            if f"{m}_step_s" in row:
                entry[f"{m}_ethernet"] = per_dollar(row[f"{m}_step_s"], price)
                entry[f"{m}_vs_rdma"] = entry[f"{m}_ethernet"] / rdma
        out["rates"][key] = entry
    return out
