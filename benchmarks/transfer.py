"""Cross-region transfer: multi-stream fetch, relay fan-out, cut-through, and faults.

Every link is an emulated WAN (:class:`deltarl.testing.wan.EmulatedLink`: one-way delay, a per-connection
window, one shared rate) in this process, so the whole benchmark runs without root on loopback.
A Python proxy cannot carry 1 Gbps on this 2-core machine, so the links run at **1/10 scale**
(100 Mbps instead of 1 Gbps, same 50 ms RTT, same 256 KiB window per connection); rates and byte
counts scale, ratios do not. Numbers taken while other work shares the CPUs are noisy.

1. **streams**: one object over the link, fetched on 1 stream vs N streams (range striping).
   Target: N streams >= 85% of the link rate, 1 stream <= 40%.
2. **fan-out**: one origin, two regions (a relay each behind its own WAN link), 8 actors. Egress
   counted from the relays' ``/metrics``: origin = 1 copy per region, relay = 1 copy per actor.
3. **cut-through**: a trainer uploads segments one after another; they cross two WAN hops
   (origin → relay B → relay C) to an actor that long-polls them (``?wait=``). Time from the first
   segment landing at the origin to the last one verified at the actor, with cut-through relays vs
   store-and-forward relays (each hop holds an object until it has all of it). The transfer time
   it is held to: the bytes over the bottleneck link at its rate, plus one round trip per hop for
   the request. Target: at most one segment's time over it.
3b. **staged**: the same two hops end to end: a real ``Publisher`` in another process uploads a
   version (segments landing at half the WAN rate, as when encoding is the bottleneck) and an
   actor's ``Subscriber`` stages it: speculative (segments long-polled and decoded before the
   manifest lands, verified after) vs waiting for the manifest, cut-through vs store-and-forward.
4. **faults**: a relay killed mid-transfer, a flipped byte in a relay's cache, a truncated
   response: every actor still ends with the exact bytes (sha256), from another source.

    python -m benchmarks.transfer [--quick] [--only streams,fanout,cutthrough,staged,faults] [--repeat N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from deltarl.actor.fetcher import Fetcher
from deltarl.pipeline.manifest import ObjectRef
from deltarl.relay import RelayConfig, RelayServer
from deltarl.storage import LocalStore, MemoryStore
from deltarl.testing.wan import EmulatedLink

RESULTS = Path(__file__).resolve().parent / "results" / "transfer.json"
SCALE = 0.1  # of a 1 Gbps link
RATE = 1e9 * SCALE
RTT = 0.05
WINDOW = 256 << 10
RUN = "bench"


def seg_key(version: int, i: int) -> str:
    return f"{RUN}/versions/{version:012d}/e000001-seg-r000-{i:05d}.bin"


def make_segments(store: MemoryStore, version: int, n: int, size: int) -> list[tuple[ObjectRef, bytes]]:
    out = []
    for i in range(n):
        data = os.urandom(size)
        store.put_if_absent(seg_key(version, i), data)
        out.append((ObjectRef.of(seg_key(version, i), data), data))
    return out


class Relays:
    """Relays started in the running loop, each with its own cache directory; stopped together."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[RelayServer] = []

    async def start(self, upstream: Any, **kw: Any) -> RelayServer:
        opts: dict[str, Any] = {"cache_dir": str(self.tmp / f"relay-{len(self.started)}"), "piece_bytes": 512 << 10,
                                "pull_streams": 4, "poll_interval_s": 0.02}  # fmt: skip
        opts.update(kw)
        relay = RelayServer(upstream, RelayConfig(**opts))
        await relay.start()
        self.started.append(relay)
        return relay

    async def close(self) -> None:
        for r in reversed(self.started):
            await r.stop()


async def scrape(url: str) -> dict[str, float]:
    """A relay's counters, read over HTTP from ``/metrics`` (as an operator would)."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {sample.name: sample.value for fam in text_string_to_metric_families(text) for sample in fam.samples if not sample.labels}


def link(port: int) -> EmulatedLink:
    return EmulatedLink("127.0.0.1", port, rate_bps=RATE, rtt_s=RTT, window_bytes=WINDOW)


# --- 1. streams ----------------------------------------------------------------------------------


async def bench_streams(tmp: Path, size: int, stream_counts: list[int]) -> dict[str, Any]:
    origin = MemoryStore()
    (ref, data), = make_segments(origin, 1, 1, size)
    relays = Relays(tmp / "streams")
    rows = []
    try:
        relay = await relays.start(origin)
        async with Fetcher([relay.url]) as warm:  # the relay's cache holds it: the link is the only bottleneck
            await warm.fetch(ref)
        for streams in stream_counts:
            async with link(relay.port) as wan, Fetcher([wan.url], streams=streams, range_bytes=1 << 20) as f:
                t0 = time.monotonic()
                got = await f.fetch(ref)
                dt = time.monotonic() - t0
            assert got == data
            rate = size * 8 / dt
            rows.append({"streams": streams, "seconds": dt, "goodput_bps": rate, "link_fraction": rate / RATE})
    finally:
        await relays.close()
    one = rows[0]["link_fraction"]
    best = max(r["link_fraction"] for r in rows[1:]) if len(rows) > 1 else one
    return {"object_bytes": size, "rows": rows, "one_stream_fraction": one, "best_multi_fraction": best,
            "target_met": one <= 0.40 and best >= 0.85}  # fmt: skip


# --- 2. fan-out ----------------------------------------------------------------------------------


async def bench_fanout(tmp: Path, n_segments: int, seg_bytes: int, actors_per_region: int = 4) -> dict[str, Any]:
    origin = MemoryStore()
    segs = make_segments(origin, 1, n_segments, seg_bytes)
    refs = [r for r, _ in segs]
    total = n_segments * seg_bytes
    relays = Relays(tmp / "fanout")
    try:
        front = await relays.start(origin)  # the origin's HTTP face (its egress is what crosses the WAN)
        async with link(front.port) as wan_a, link(front.port) as wan_b:
            region = {"a": await relays.start(wan_a.url), "b": await relays.start(wan_b.url)}
            fetchers = [Fetcher([region[r].url, origin], streams=4, range_bytes=1 << 20) for r in ("a", "b") for _ in range(actors_per_region)]

            async def actor(f: Fetcher) -> bool:
                got = {ref.key: d async for ref, d in f.fetch_objects(refs)}
                return all(got[r.key] == d for r, d in segs)

            t0 = time.monotonic()
            ok = await asyncio.gather(*(actor(f) for f in fetchers))
            dt = time.monotonic() - t0
            for f in fetchers:
                await f.close()
            m_front = await scrape(front.url)
            m_a, m_b = await scrape(region["a"].url), await scrape(region["b"].url)
            wan_bytes = wan_a.stats.down + wan_b.stats.down
    finally:
        await relays.close()
    origin_copies = m_front["deltarl_relay_served_bytes_total"] / total
    relay_copies = [m["deltarl_relay_served_bytes_total"] / total for m in (m_a, m_b)]
    return {
        "segments": n_segments, "segment_bytes": seg_bytes, "version_bytes": total, "regions": 2,
        "actors": len(fetchers), "all_exact": all(ok), "seconds": dt,
        "origin_egress_copies": origin_copies, "origin_egress_copies_per_region": origin_copies / 2,
        "relay_egress_copies": relay_copies, "relay_egress_copies_per_actor": [c / actors_per_region for c in relay_copies],
        "relay_upstream_pulls": [m["deltarl_relay_upstream_pulls_total"] for m in (m_a, m_b)],
        "wan_bytes_incl_http": wan_bytes,
        "target_met": all(ok) and abs(origin_copies - 2) < 0.01 and all(abs(c - actors_per_region) < 0.01 for c in relay_copies),
    }  # fmt: skip


# --- 3. cut-through --------------------------------------------------------------------------------


async def bench_cut_through(tmp: Path, n_segments: int, seg_bytes: int, cut_through: bool) -> dict[str, Any]:
    origin = MemoryStore()
    blobs = [os.urandom(seg_bytes) for _ in range(n_segments)]
    refs = [ObjectRef.of(seg_key(1, i), b) for i, b in enumerate(blobs)]
    seg_time = seg_bytes * 8 / RATE
    relays = Relays(Path(tempfile.mkdtemp(prefix=f"cut-{cut_through}-", dir=tmp)))  # fresh caches: new bytes, same keys
    try:
        opts = {"cut_through": cut_through, "piece_bytes": 256 << 10, "pull_streams": 8}
        front = await relays.start(origin, **opts)
        async with link(front.port) as wan1:
            b = await relays.start(wan1.url, **opts)
            async with link(b.port) as wan2:
                c = await relays.start(wan2.url, **opts)
                landed: list[float] = []

                async def trainer() -> None:  # uploads at twice the WAN rate, one segment after another
                    for key_ref, blob in zip(refs, blobs, strict=True):
                        await asyncio.sleep(seg_time / 2)
                        await asyncio.to_thread(origin.put_if_absent, key_ref.key, blob)
                        landed.append(time.monotonic())

                async with Fetcher([c.url], streams=8, range_bytes=seg_bytes) as f:
                    up = asyncio.ensure_future(trainer())
                    done_at: dict[str, float] = {}
                    async for ref, data in f.fetch_objects(refs, wait_s=60):
                        assert ObjectRef.of(ref.key, data, piece_size=ref.piece_size) == ref
                        done_at[ref.key] = time.monotonic()
                    await up
    finally:
        await relays.close()
    t_first = landed[0]
    elapsed = max(done_at.values()) - t_first
    hops = 2
    wan_transfer = n_segments * seg_time  # the bytes over the bottleneck link (every hop runs at RATE; they pipeline)
    transfer = wan_transfer + hops * RTT  # ... plus one round trip per hop for the request
    return {"cut_through": cut_through, "segments": n_segments, "segment_bytes": seg_bytes, "hops": hops,
            "first_landed_to_last_verified_s": elapsed, "upload_span_s": landed[-1] - t_first,
            "wan_transfer_s": wan_transfer, "transfer_s": transfer, "segment_time_s": seg_time,
            "excess_over_transfer_in_segments": (elapsed - transfer) / seg_time,
            "excess_over_wan_transfer_in_segments": (elapsed - wan_transfer) / seg_time,
            "target_met": elapsed <= transfer + seg_time}  # fmt: skip


# --- 3b. publish -> staged, end to end ----------------------------------------------------------------


class PacedStore(LocalStore):
    """The trainer's upload to the origin: once ``paced``, writes cross one link of ``rate_bps`` in turn."""

    def __init__(self, root: str, rate_bps: float) -> None:
        super().__init__(root)
        self.rate_bps = rate_bps
        self.paced = False
        self._lock = threading.Lock()
        self.landed: dict[str, float] = {}

    def put_if_absent(self, key: str, data: bytes) -> str:
        if self.paced:
            with self._lock:
                time.sleep(len(data) * 8 / self.rate_bps)
        etag = super().put_if_absent(key, data)
        self.landed.setdefault(key, time.monotonic())  # CLOCK_MONOTONIC: comparable across processes
        return etag


def _trace_states(shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[Any, Any]:
    from ._trace import AdamTrace

    trace = AdamTrace(shapes, seed=0, lr=1e-4)  # lr 1e-4: a dense-ish delta, big enough to time
    trace.run(warmup_steps=2)
    v0 = trace.export()
    trace.step()
    return v0, trace.export()


def _trainer_process(root: str, shapes: list[tuple[str, tuple[int, ...]]], rate_bps: float, ready: Any, go: Any, out: str) -> None:
    """The trainer, in its own process (its encoding must not share the GIL with relays and links)."""
    from deltarl.pipeline.publisher import Publisher

    v0, v1 = _trace_states(shapes)
    store = PacedStore(root, rate_bps)
    with Publisher(store, RUN, segment_bytes=1 << 20, keyframe_interval=1000, digest_interval=1000, upload_workers=2) as pub:
        info = pub.publish(v0, step=0)
        ready.put(info.version_id)
        go.wait()
        store.paced = True
        t0 = time.monotonic()
        pub.publish(v1, step=1)
    Path(out).write_text(json.dumps({"publish_start": t0, "landed": store.landed}))


async def bench_staged(tmp: Path, shapes: list[tuple[str, tuple[int, ...]]], speculate: bool, cut_through: bool) -> dict[str, Any]:
    """A real Publisher (another process) uploads a version; an actor two WAN hops away stages it.

    The trainer's segments land at half the WAN rate (as when encoding a large model is the
    bottleneck: ~10 s for 15 GB at 1.5 GB/s), so an actor that waits for the manifest starts its
    transfer only after the whole upload, while a speculative one overlaps them. The actor, the
    relays and the links share this process (and its GIL); the trainer does not."""
    import multiprocessing as mp

    from deltarl.actor.subscriber import Subscriber
    from deltarl.pipeline.layout import RunLayout

    layout = RunLayout(RUN)
    work = Path(tempfile.mkdtemp(prefix="staged-", dir=tmp))
    ctx = mp.get_context("spawn")
    ready, go = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_trainer_process, args=(str(work / "origin"), shapes, RATE / 2, ready, go, str(work / "landed.json")))
    proc.start()
    v0, v1 = _trace_states(shapes)
    vid0 = await asyncio.to_thread(ready.get, True, 300)
    origin = LocalStore(str(work / "origin"))
    relays = Relays(work)
    try:
        opts = {"cut_through": cut_through, "piece_bytes": 256 << 10, "pull_streams": 8, "poll_interval_s": 0.01}
        front = await relays.start(origin, **opts)
        async with link(front.port) as wan1:
            b = await relays.start(wan1.url, **opts)
            async with link(b.port) as wan2:
                c = await relays.start(wan2.url, **opts)
                state = {k: type(t)(t.bits.copy()) for k, t in v0.items()}
                async with Fetcher([c.url], streams=8, range_bytes=1 << 20) as f, Subscriber(
                    state, RUN, f, version=0, version_id=vid0, poll_wait_s=30, speculate=speculate, verify_digest=False
                ) as sub:
                    sub.start()
                    await asyncio.sleep(0.5)  # long-polls in place along the chain
                    go.set()
                    while not sub.ready():
                        await asyncio.sleep(0.002)
                    t_staged = time.monotonic()
                    commit = sub.commit()
                    speculated = sub.speculated_segments
    finally:
        await asyncio.to_thread(proc.join, 300)
        await relays.close()
    record = json.loads((work / "landed.json").read_text())
    landed: dict[str, float] = record["landed"]
    seg_times = [t for k, t in landed.items() if k.startswith(layout.version_prefix(1)) and k.endswith(".bin")]
    man = landed[layout.manifest(1)]
    delta = sum(len(origin.get(k)) for k in origin.list(layout.version_prefix(1)) if k.endswith(".bin"))
    exact = all((state[k].bits == v1[k].bits).all() for k in v1)
    return {"speculate": speculate, "cut_through": cut_through, "segments": len(seg_times), "delta_bytes": delta,
            "changed_elements": commit.changed_elements, "exact": bool(exact), "speculated_segments": speculated,
            "first_segment_to_staged_s": t_staged - min(seg_times), "manifest_to_staged_s": t_staged - man,
            "publish_start_to_staged_s": t_staged - record["publish_start"], "upload_s": man - record["publish_start"],
            "wan_transfer_s": delta * 8 / RATE, "segment_time_s": (1 << 20) * 8 / RATE}  # fmt: skip


# --- 4. faults -------------------------------------------------------------------------------------


async def bench_fault(tmp: Path, kind: str, n_segments: int, seg_bytes: int, actors: int = 4, range_bytes: int = 256 << 10) -> dict[str, Any]:
    origin = MemoryStore()
    segs = make_segments(origin, 1, n_segments, seg_bytes)
    refs = [r for r, _ in segs]
    relays = Relays(tmp / f"fault-{kind}")
    try:
        a = await relays.start(origin)
        a2 = await relays.start(origin)
        if kind.startswith("corrupt"):
            async with Fetcher([a.url]) as warm:
                async for _ in warm.fetch_objects(refs):
                    pass
            for ref in refs[: max(1, n_segments // 2)]:
                entry = a.service.cache.get(ref.key)
                assert entry is not None
                with open(entry.path, "r+b") as fh:
                    fh.seek(seg_bytes // 3)
                    b = fh.read(1)
                    fh.seek(seg_bytes // 3)
                    fh.write(bytes([b[0] ^ 0x01]))
        async with link(a.port) as wan:
            fetchers = [Fetcher([wan.url, a2.url, origin], streams=4, range_bytes=range_bytes, read_timeout_s=5) for _ in range(actors)]
            if kind == "truncate":
                wan.truncate_after = seg_bytes // 2

            async def killer() -> None:
                while wan.stats.down < actors * n_segments * seg_bytes // 3:
                    await asyncio.sleep(0.01)
                wan.kill()

            kill_task = asyncio.ensure_future(killer()) if kind == "kill" else None

            async def actor(f: Fetcher) -> bool:
                got = {ref.key: d async for ref, d in f.fetch_objects(refs)}
                return all(got[r.key] == d for r, d in segs)

            t0 = time.monotonic()
            ok = await asyncio.gather(*(actor(f) for f in fetchers))
            dt = time.monotonic() - t0
            if kill_task is not None:
                await kill_task
            for f in fetchers:
                await f.close()
            by_source: dict[str, int] = {}
            for f in fetchers:
                for name, n in f.stats.bytes_by_source.items():
                    label = "relay (faulty)" if name == wan.url else "relay 2" if name == a2.url else "origin"
                    by_source[label] = by_source.get(label, 0) + n
            stats = {k: sum(getattr(f.stats, k) for f in fetchers) for k in ("retries", "failovers", "integrity_refetches")}
        m_a = await scrape(a.url)
    finally:
        await relays.close()
    return {"fault": kind, "actors": actors, "range_bytes": range_bytes, "segments": n_segments, "segment_bytes": seg_bytes, "all_exact": all(ok),
            "seconds": dt, "bytes_by_source": by_source, **stats,
            "relay_integrity_failures": m_a.get("deltarl_relay_integrity_failures_total", 0.0)}  # fmt: skip


# --- main ------------------------------------------------------------------------------------------


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    only = set(args.only.split(","))
    q = args.quick
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp_s:
        tmp = Path(tmp_s)
        if "streams" in only:
            out["streams"] = await bench_streams(tmp, (16 if q else 48) << 20, [1, 4, 8] if q else [1, 2, 4, 8])
        if "fanout" in only:
            out["fanout"] = await bench_fanout(tmp, 4 if q else 8, (1 if q else 2) << 20)
        if "cutthrough" in only:
            n, size = (6, 1 << 20) if q else (8, 4 << 20)
            runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            for _ in range(args.repeat):  # alternate, so background load hits both alike
                for ct in (True, False):
                    runs[ct].append(await bench_cut_through(tmp, n, size, ct))
            out["cut_through"] = []
            for rs in runs.values():
                times = sorted(r["first_landed_to_last_verified_s"] for r in rs)
                best = min(rs, key=lambda r: r["first_landed_to_last_verified_s"])
                out["cut_through"].append({**best, "runs_s": times, "median_s": times[len(times) // 2]})
        if "staged" in only:
            from ._trace import qwen3_like_shapes

            small = {"hidden": 512, "intermediate": 1536, "heads": 8, "kv_heads": 4, "head_dim": 64, "vocab": 4096}
            shapes = qwen3_like_shapes(layers=1, **small) if q else qwen3_like_shapes(layers=2, vocab=8192)
            modes = ((True, True), (False, True), (False, False))
            tries: dict[tuple[bool, bool], list[dict[str, Any]]] = {m: [] for m in modes}
            for _ in range(1 if q else max(1, min(args.repeat, 2))):  # alternate modes; keep each mode's best
                for spec, ct in modes:
                    tries[(spec, ct)].append(await bench_staged(tmp, shapes, spec, ct))
            out["staged"] = []
            for rs in tries.values():
                best = min(rs, key=lambda r: r["manifest_to_staged_s"])
                out["staged"].append({**best, "runs_manifest_to_staged_s": sorted(r["manifest_to_staged_s"] for r in rs)})
        if "faults" in only:
            n, size = (4, 1 << 20) if q else (6, 2 << 20)
            out["faults"] = [
                await bench_fault(tmp, "kill", n, size),
                await bench_fault(tmp, "corrupt (ranged reads)", n, size),
                await bench_fault(tmp, "corrupt (whole reads)", n, size, range_bytes=size),
                await bench_fault(tmp, "truncate", n, size),
            ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller objects (about a minute)")
    parser.add_argument("--only", default="streams,fanout,cutthrough,staged,faults")
    parser.add_argument("--repeat", type=int, default=3, help="cut-through runs per mode (best and median reported)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    logging.basicConfig(level=logging.ERROR)  # failovers are expected here; the table reports them
    console = Console(width=140)
    console.print(f"links at 1/{1 / SCALE:.0f} scale: {RATE / 1e6:.0f} Mbps shared, RTT {RTT * 1e3:.0f} ms, "
                  f"window {WINDOW >> 10} KiB per connection (one stream <= {WINDOW * 8 / (RTT + WINDOW * 8 / RATE) / 1e6:.0f} Mbps)")  # fmt: skip
    res = asyncio.run(run_all(args))

    if "streams" in res:
        s = res["streams"]
        t = Table(title=f"1. streams: one {s['object_bytes'] >> 20} MiB object over one emulated link")
        for col in ("streams", "seconds", "goodput Mbps", "of link", "target"):
            t.add_column(col, justify="right")
        for r in s["rows"]:
            goal = "<= 40%" if r["streams"] == 1 else ">= 85%"
            t.add_row(str(r["streams"]), f"{r['seconds']:.2f}", f"{r['goodput_bps'] / 1e6:.1f}", f"{100 * r['link_fraction']:.0f}%", goal)
        console.print(t)
    if "fanout" in res:
        f = res["fanout"]
        t = Table(title=f"2. fan-out: {f['version_bytes'] >> 20} MiB version, 2 regions, {f['actors']} actors (bytes from /metrics)")
        for col in ("origin egress (copies)", "per region", "relay egress (copies)", "per actor", "upstream pulls", "exact", "seconds"):
            t.add_column(col, justify="right")
        t.add_row(f"{f['origin_egress_copies']:.2f}", f"{f['origin_egress_copies_per_region']:.2f}",
                  " / ".join(f"{c:.2f}" for c in f["relay_egress_copies"]),
                  " / ".join(f"{c:.2f}" for c in f["relay_egress_copies_per_actor"]),
                  " / ".join(f"{c:.0f}" for c in f["relay_upstream_pulls"]), str(f["all_exact"]), f"{f['seconds']:.2f}")  # fmt: skip
        console.print(t)
    if "cut_through" in res:
        t = Table(title=f"3. cut-through: first segment at the origin -> last segment verified at the actor, 2 WAN hops "
                        f"(best of {args.repeat})")  # fmt: skip
        for col in ("relays", "segments", "best s", "median s", "transfer s (bytes + RTT/hop)", "one segment s",
                    "excess of best (segments)", "target <= 1"):  # fmt: skip
            t.add_column(col, justify="right")
        for r in res["cut_through"]:
            t.add_row("cut-through" if r["cut_through"] else "store-and-forward", f"{r['segments']} x {r['segment_bytes'] >> 20} MiB",
                      f"{r['first_landed_to_last_verified_s']:.2f}", f"{r['median_s']:.2f}",
                      f"{r['transfer_s']:.2f} ({r['wan_transfer_s']:.2f} + {r['transfer_s'] - r['wan_transfer_s']:.2f})",
                      f"{r['segment_time_s']:.2f}", f"{r['excess_over_transfer_in_segments']:.2f}",
                      str(r["target_met"]) if r["cut_through"] else "-")  # fmt: skip
        console.print(t)
    if "staged" in res:
        t = Table(title="3b. publish -> staged at an actor 2 WAN hops away (real Publisher and Subscriber; segments land at 1/2 "
                        "the WAN rate; best run)")  # fmt: skip
        for col in ("actor / relays", "delta", "segments", "first seg -> staged s", "manifest -> staged s", "publish -> staged s",
                    "upload s", "WAN transfer s", "staged early", "exact"):  # fmt: skip
            t.add_column(col, justify="right")
        for r in res["staged"]:
            mode = ("speculative" if r["speculate"] else "after manifest") + " / " + ("cut-through" if r["cut_through"] else "store-and-forward")
            t.add_row(mode, f"{r['delta_bytes'] / 2**20:.1f} MiB", str(r["segments"]), f"{r['first_segment_to_staged_s']:.2f}",
                      f"{r['manifest_to_staged_s']:.2f}", f"{r['publish_start_to_staged_s']:.2f}", f"{r['upload_s']:.2f}",
                      f"{r['wan_transfer_s']:.2f}", str(r["speculated_segments"]), str(r["exact"]))  # fmt: skip
        console.print(t)
    if "faults" in res:
        t = Table(title="4. faults: 4 actors; sources in order: faulty relay (behind a link), relay 2, origin")
        for col in ("fault", "all exact", "seconds", "retries", "failovers", "sha refetches", "relay integrity fails", "bytes by source"):
            t.add_column(col, justify="right")
        for r in res["faults"]:
            t.add_row(r["fault"], str(r["all_exact"]), f"{r['seconds']:.2f}", str(r["retries"]), str(r["failovers"]),
                      str(r["integrity_refetches"]), f"{r['relay_integrity_failures']:.0f}",
                      ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in sorted(r["bytes_by_source"].items())))  # fmt: skip
        console.print(t)
    doc = {"benchmark": "transfer", "quick": args.quick, "load_average_at_end": os.getloadavg(), "scale_of_1gbps": SCALE, "rate_bps": RATE, "rtt_s": RTT,
           "window_bytes": WINDOW, "cpus": os.cpu_count(),
           "note": "emulated links (asyncio proxy) at 1/10 scale; measured on a shared 2-core box, noisy", **res}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
