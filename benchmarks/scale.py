"""Full-size models: every whole-model path at real Qwen3 shapes, each phase in its own process.

    python -m benchmarks.scale [--model 0.6b|1.7b|4b|8b] [--scratch DIR] [--versions 3]
    python -m benchmarks.scale --model 30b-a3b [--layers 2]   # MoE layers, benchmarks/_scale_moe.py

Every phase also reports the CPU it used, as core-seconds per GB of model for each process (the
trainer/publisher, the relay, the actor or replay: ``os.times`` of each, over the timed window), so
a figure from a small box says what a bigger host would do: a phase bound by CPU runs at about
``cores / core-s per GB`` GB/s there. Runs under ``taskset`` write ``scale-<model>-<n>cpu.json``.

States are built in place as BF16 (``benchmarks/_scale_state.py``: HF config numbers, tied
embeddings for 0.6b/1.7b/4b, nothing downloaded), the next versions with ~1% of elements changed
the way Adam at lr 1e-6 changes BF16. Each phase runs in a fresh process and reports wall time,
GB of model per second and peak RSS (``VmHWM``, minus the RSS measured before the state was
allocated) as a multiple of one BF16 copy. The machine's limits are measured in the same run
(durable write + fsync, cached read, sha256 on one core, buffer copy, first touch of fresh
memory) and every phase is printed as a fraction of the limit it is bound by. Results:
``benchmarks/results/scale-<model>.json``.

Phases: keyframe publish (local store, durable), delta publishes (resumed publisher, each version
handed over), relay transfer (every object of the run through a cold relay in another process),
actor bootstrap (keyframe + deltas up to HEAD) through a cold relay into an empty state (a
follower), through a cold relay into the model the actor built before joining, and through a warm
relay into the model; stage + commit of each delta (with a plain numpy scatter of the same
positions and values), replay with verify, inspect, gc. The relay shares this machine's cores
with the actor (in a deployment it runs on its own host).

Opt-in: ``--only keyframe,deltas_long [--long 50]`` publishes 50 delta versions in a row and
records the RSS after each (memory must stay flat over a long run); it writes
``scale-<model>-long.json``.

``--quick --out FILE`` (a smoke run, CI): every phase but the machine's limits on the tiny tensor table.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._scale_state import (
    MODELS,
    generate,
    load_state,
    loadavg,
    qwen3_specs,
    reset_peak,
    rss_bytes,
)

RESULTS = Path(__file__).resolve().parent / "results"
RUN = "scale"
GB = 1e9


def _model_bytes(model: str) -> int:
    return 2 * sum(s.numel for s in qwen3_specs(MODELS[model]))


def _cpu() -> float:
    """CPU seconds (user + system, every thread) this process has used."""
    t = os.times()
    return t.user + t.system


def _result(args: argparse.Namespace, wall: float, base_rss: int, cpu: dict[str, float] | None = None,
            **extra: Any) -> dict[str, Any]:
    """A phase's figures; ``cpu``: CPU seconds of the timed window per role (process)."""
    copy = _model_bytes(args.model)
    peak = rss_bytes("VmHWM")
    out = {"wall_s": round(wall, 3), "gb_s": round(copy / wall / GB, 3), "peak_rss_copies": round((peak - base_rss) / copy, 3),
           "peak_rss_gb": round(peak / GB, 2), "base_rss_gb": round(base_rss / GB, 3), **extra}  # fmt: skip
    if cpu:
        out["cpu_s"] = {role: round(c, 3) for role, c in cpu.items()}
        out["core_s_per_gb"] = {role: round(c / (copy / GB), 3) for role, c in cpu.items()}
        out["core_s_per_gb_total"] = round(sum(cpu.values()) / (copy / GB), 3)
        # where CPU is the bound, a host with more cores runs a phase at about cores / core-s per GB
        # (each role on a host of its own: the slowest role's figure)
        # (None when no role used a tick of CPU that os.times or /proc shows, 10 ms: a quick run's tiny model)
        slowest = max(c / (copy / GB) for c in cpu.values())
        out["cpu_bound_gb_s_16_cores"] = round(16 / slowest, 2) if slowest > 0 else None
    return out


def _trim() -> None:
    from deltarl.codec.heap import trim

    trim()


# --- phases (each runs in its own process) ---------------------------------------------------------


def phase_limits(args: argparse.Namespace) -> dict[str, Any]:
    """This machine's limits: durable write (the way the local store writes: flushed and dropped
    from the page cache in 32 MiB windows, then fsync; and, for reference, everything written
    first and then one fsync), cached read, sha256 on one core, copy between warm buffers, and
    first touch of fresh memory (what materializing a state costs; on a VM whose host reclaims
    free guest memory it is far below a copy); BLAKE3 in 64 KiB blocks on one core (the format's hash)."""
    from deltarl.storage.pagecache import FLUSH_WINDOW_BYTES, WriteBehind

    size = 256 << 20
    buf = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    path = Path(args.scratch) / "limits.bin"

    def write(windowed: bool) -> float:
        t = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            behind = WriteBehind(f.fileno()) if windowed else None  # what the local store does
            for _ in range(4):
                for a in range(0, size, FLUSH_WINDOW_BYTES):
                    n = f.write(memoryview(buf)[a : a + FLUSH_WINDOW_BYTES])
                    if behind is not None:
                        behind.wrote(n)
            os.fsync(f.fileno())
        return 4 * size / (time.perf_counter() - t)

    windowed = write(True)
    buffered = write(False)
    out = np.empty_like(buf)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for _ in range(4):
            f.readinto(memoryview(out))
    read = 4 * size / (time.perf_counter() - t)
    path.unlink()
    t = time.perf_counter()
    hashlib.sha256(memoryview(buf)).digest()
    sha = size / (time.perf_counter() - t)
    from deltarl.codec.hashing import leaves

    t = time.perf_counter()
    leaves(memoryview(buf))  # the format's hash, as deltarl runs it: 64 KiB blocks, one core
    b3 = size / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(4):
        np.copyto(out, buf)
    copy = 4 * size / (time.perf_counter() - t)
    t = time.perf_counter()
    fresh = np.ones(1 << 30, dtype=np.uint8)  # first touch of 1 GiB of new anonymous memory
    first_touch = fresh.nbytes / (time.perf_counter() - t)
    del fresh
    return {"durable_write_gb_s": round(max(windowed, buffered) / GB, 3), "windowed_write_fsync_gb_s": round(windowed / GB, 3),
            "buffered_write_fsync_gb_s": round(buffered / GB, 3), "cached_read_gb_s": round(read / GB, 3),
            "sha256_gb_s": round(sha / GB, 3), "blake3_gb_s": round(b3 / GB, 3), "copy_gb_s": round(copy / GB, 3),
            "fresh_memory_gb_s": round(first_touch / GB, 3)}  # fmt: skip


def _store(args: argparse.Namespace) -> Any:
    from deltarl.storage import LocalStore

    return LocalStore(Path(args.scratch) / "store")


def phase_keyframe(args: argparse.Namespace) -> dict[str, Any]:
    from deltarl.pipeline.publisher import Publisher

    base = rss_bytes("VmRSS")
    _, state = load_state(Path(args.scratch), args.model, 0)
    reset_peak()
    t, c = time.perf_counter(), _cpu()
    with Publisher(_store(args), RUN, keyframe_interval=1000, digest_interval=1000, writer_id="bench") as pub:
        info = pub.publish(state, step=0, owned=True)
    wall = time.perf_counter() - t
    return _result(args, wall, base, {"trainer": _cpu() - c}, parts=len(info.keyframe_keys))


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


#: This benchmark shares the machine: it keeps its anonymous memory under this.
MEMORY_SHARE = int(os.environ.get("DELTARL_SCALE_MEMORY_SHARE", 14 << 30))


def _file_backed(path: Path, total: int) -> Any:
    import torch

    return torch.from_file(str(path), shared=True, size=total, dtype=torch.bfloat16)


def phase_deltas(args: argparse.Namespace) -> dict[str, Any]:
    """Resume the run from version 0 and publish versions 1..``--versions``, handing each export over.

    Two copies are inherent (the base and the new export). Where 2.3 copies do not fit in this
    benchmark's share of a shared machine, each new export is a file-backed (MAP_SHARED) mapping
    of a scratch copy, so the kernel can write it back and evict it under pressure instead of
    failing other processes; VmHWM still counts its resident pages."""
    return _publish_deltas(args, args.versions)


def phase_deltas_long(args: argparse.Namespace) -> dict[str, Any]:
    """``--long`` versions (default 50) of delta publishing from version 0: the peak stays at the
    base plus the new export, and the RSS after each version stays flat (each dropped export goes
    back to the OS). The generated change sets are applied forward and back (+1 +2 +3 -3 -2 -1 +1
    ...), so every version changes ~1% of the elements."""
    res = _publish_deltas(args, args.long)
    after = [p["rss_after_copies"] for p in res["versions"]]
    res["rss_after_copies_min_max"] = [min(after), max(after)]
    res["rss_growth_copies"] = round(after[-1] - after[min(4, len(after) - 1)], 3)  # last vs version 5
    return res


def _schedule(count: int, sets: int) -> list[tuple[int, bool]]:
    """(change set, forward?) of each version 1..count: +1 .. +sets, -sets .. -1, and again."""
    cycle = [(k, True) for k in range(1, sets + 1)] + [(k, False) for k in range(sets, 0, -1)]
    return [cycle[i % len(cycle)] for i in range(count)]


def _publish_deltas(args: argparse.Namespace, count: int) -> dict[str, Any]:
    import torch

    from benchmarks._scale_state import apply_changes, views
    from deltarl.pipeline.publisher import Publisher
    from deltarl.pipeline.reader import RunReader

    head = RunReader(_store(args), RUN).head()
    if head is None or head.version != 0:
        raise SystemExit(f"the deltas phases publish versions 1.. onto version 0; the store's HEAD is "
                         f"{None if head is None else head.version}: run them after the keyframe phase")
    scratch = Path(args.scratch)
    copy = _model_bytes(args.model)
    specs = qwen3_specs(MODELS[args.model])
    total = copy // 2
    backed = 2.3 * copy > min(MEMORY_SHARE, _mem_available() - (1 << 30))
    base = rss_bytes("VmRSS")
    if backed:
        flat = _file_backed(scratch / "v0.bin", total)  # read-only use: the publisher copies it
        state = views(flat, specs)
    else:
        flat, state = load_state(scratch, args.model, 0)
    undo: dict[int, np.ndarray] = {}  # change set -> the bits it overwrote
    per = []
    with Publisher(_store(args), RUN, previous_state=state, writer_id="bench") as pub:
        for v, (k, forward) in enumerate(_schedule(count, args.versions), start=1):
            if backed:  # the trainer's next export: a new buffer (file-backed here)
                work = scratch / f"work-{v % 3}.bin"  # version v - 3 used it: the publisher dropped it two versions ago
                shutil.copyfile(scratch / ("v0.bin" if v == 1 else f"work-{(v - 1) % 3}.bin"), work)
                flat = _file_backed(work, total)
            elif v > 1:
                flat = flat.clone()
            state = views(flat, specs)
            bits = flat.view(torch.int16).numpy().view(np.uint16)
            if not forward:
                bits[np.load(scratch / f"pos-v{k}.npy")] = undo.pop(k)
            else:
                if count > args.versions:  # it will be undone: keep the bits it overwrites (2 B a change)
                    undo[k] = bits[np.load(scratch / f"pos-v{k}.npy")]
                apply_changes(bits, scratch, k)
            t, c = time.perf_counter(), _cpu()
            info = pub.publish(state, step=v, owned=True)
            wall = time.perf_counter() - t
            cpu = _cpu() - c
            del state, bits
            _trim()
            per.append({"version": v, "wall_s": round(wall, 3), "gb_s": round(copy / wall / GB, 3),
                        "encode_s": round(info.encode_s, 3), "upload_s": round(info.upload_s, 3),
                        "segments": len(info.segment_keys), "encoded_mb": round(info.stats.encoded_bytes / 1e6, 1),
                        "changed": info.stats.changed_elements, "cpu_s": round(cpu, 3),
                        "rss_after_copies": round((rss_bytes("VmRSS") - base) / copy, 3)})  # fmt: skip
    walls = [p["wall_s"] for p in per]
    cpu = sum(p["cpu_s"] for p in per) / len(per)
    return _result(args, sum(walls) / len(walls), base, {"trainer": cpu}, versions=per,
                   state_backing="file (MAP_SHARED)" if backed else "anonymous")


def _serve_relay(args: argparse.Namespace) -> None:
    """Run a relay in front of the local store until stdin closes; print its URL first, then its CPU
    seconds for every line read from stdin."""
    from deltarl.relay import RelayConfig, RelayServer

    async def main() -> None:
        relay = RelayServer(_store(args), RelayConfig(cache_dir=args.cache, cache_bytes=64 << 30))
        await relay.start()
        print(relay.url, flush=True)
        while await asyncio.to_thread(sys.stdin.readline):
            print(_cpu(), flush=True)
        await relay.stop()

    asyncio.run(main())


class _Relay:
    """A relay in its own process (its memory is not the actor's), with a cold cache."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.cache = tempfile.mkdtemp(dir=args.scratch, prefix="relay-")
        cmd = [sys.executable, "-m", "benchmarks.scale", "--serve-relay", "--scratch", args.scratch, "--cache", self.cache,
               "--model", args.model]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()

    def cpu(self) -> float:
        """The relay process's CPU seconds so far."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.cache, ignore_errors=True)


def _run_objects(args: argparse.Namespace) -> list[Any]:
    """The refs of every segment and keyframe part of the run's versions."""
    from deltarl.pipeline.reader import RunReader

    reader = RunReader(_store(args), RUN)
    refs: list[Any] = []
    for v in range(args.versions + 1):
        manifest, _ = reader.manifest(v)
        refs += [*manifest.segments, *(manifest.keyframe.parts if manifest.keyframe else ())]
    return refs


def phase_relay(args: argparse.Namespace) -> dict[str, Any]:
    from deltarl.actor.fetcher import Fetcher

    refs = _run_objects(args)
    total = sum(r.size for r in refs)
    relay = _Relay(args)
    base = rss_bytes("VmRSS")
    reset_peak()

    sink = bytearray(max(r.size for r in refs))  # one reused buffer: this phase measures the relay, not a client's allocations

    async def pull() -> None:
        async with Fetcher([relay.url], streams=4) as f:
            for ref in refs:
                await f.fetch_into(ref, [(0, memoryview(sink)[: ref.size])])

    try:
        t, c, rc = time.perf_counter(), _cpu(), relay.cpu()
        asyncio.run(pull())
        wall = time.perf_counter() - t
        cpu = {"actor": _cpu() - c, "relay": relay.cpu() - rc}
    finally:
        relay.close()
    return _result(args, wall, base, cpu, bytes=total, object_gb_s=round(total / wall / GB, 3), objects=len(refs))


def _warm(relay: _Relay, args: argparse.Namespace) -> None:
    """Pull every object of the run through ``relay`` once (another actor came first)."""
    from deltarl.actor.fetcher import Fetcher

    refs = _run_objects(args)

    async def pull() -> None:
        async with Fetcher([relay.url], streams=4) as f:
            for ref in refs:
                await f.fetch(ref)  # dropped at once: only the relay keeps it

    asyncio.run(pull())
    _trim()


def phase_bootstrap(args: argparse.Namespace, *, into_model: bool = False, warm: bool = False) -> dict[str, Any]:
    """A new actor's first version through a relay: cold (its first actor) or ``warm`` (it has
    every object cached); into an empty state (a follower), or (``into_model``) into the model the
    actor built before joining, whose memory it then reuses."""
    import torch

    from deltarl.actor.fetcher import Fetcher
    from deltarl.actor.subscriber import Subscriber
    from deltarl.codec import state_digest

    relay = _Relay(args)
    if warm:
        _warm(relay, args)
    base = rss_bytes("VmRSS")
    state: dict[str, Any] = {}
    if into_model:  # the actor's model, built (and so in memory) before it joins; it counts as the one copy
        for spec in qwen3_specs(MODELS[args.model]):
            state[spec.name] = torch.zeros(spec.shape, dtype=torch.bfloat16)
    reset_peak()

    async def boot() -> Any:
        async with Fetcher([relay.url], streams=4) as f:
            sub = Subscriber(state, RUN, f, verify_digest=False, speculate=False)
            info = await sub.bootstrap()
            await sub.close()
            return info

    try:
        t, c, rc = time.perf_counter(), _cpu(), relay.cpu()
        info = asyncio.run(boot())
        wall = time.perf_counter() - t
        cpu = {"actor": _cpu() - c, "relay": relay.cpu() - rc}
    finally:
        relay.close()
    out = _result(args, wall, base, cpu, version=info.version)
    out["bit_exact"] = state_digest(state) == json.loads((Path(args.scratch) / "digests.json").read_text())[str(info.version)]
    return out


def phase_bootstrap_model(args: argparse.Namespace) -> dict[str, Any]:
    return phase_bootstrap(args, into_model=True)


def phase_bootstrap_warm(args: argparse.Namespace) -> dict[str, Any]:
    return phase_bootstrap(args, into_model=True, warm=True)


def phase_stage_commit(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from deltarl.codec import stage_delta
    from deltarl.pipeline.reader import RunReader

    base = rss_bytes("VmRSS")
    flat, state = load_state(Path(args.scratch), args.model, 0)
    bits = flat.view(torch.int16).numpy().view(np.uint16)
    reader = RunReader(_store(args), RUN)
    per = []
    for v in range(1, args.versions + 1):
        manifest, _ = reader.manifest(v)
        segments = [reader.segment(manifest, i) for i in range(len(manifest.segments))]
        t = time.perf_counter()
        staged = stage_delta(state, segments, base=manifest.parent)
        stage_s = time.perf_counter() - t
        del segments
        t = time.perf_counter()
        staged.commit()
        pause = time.perf_counter() - t
        del staged
        pos = np.load(Path(args.scratch) / f"pos-v{v}.npy")
        new = np.load(Path(args.scratch) / f"bits-v{v}.npy")
        t = time.perf_counter()
        bits[pos] = new  # the same positions and values (already there): a plain numpy scatter
        scatter = time.perf_counter() - t
        per.append({"version": v, "stage_s": round(stage_s, 3), "commit_s": round(pause, 4), "numpy_scatter_s": round(scatter, 4),
                    "pause_vs_scatter": round(pause / scatter, 2), "changed": int(pos.size)})  # fmt: skip
        del pos, new
    from deltarl.codec import state_digest

    exact = state_digest(state) == json.loads((Path(args.scratch) / "digests.json").read_text())[str(args.versions)]
    worst = max(p["pause_vs_scatter"] for p in per)
    return _result(args, sum(p["commit_s"] for p in per), base, versions=per, pause_vs_scatter=worst, bit_exact=exact)


def phase_replay(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # noqa: F401  # loaded before the clock, as in every other phase: a process's start-up, not replay work

    from deltarl.codec import state_digest
    from deltarl.pipeline.replay import replay

    base = rss_bytes("VmRSS")
    reset_peak()
    t, c = time.perf_counter(), _cpu()
    state = replay(_store(args), RUN, args.versions, verify=True)
    wall = time.perf_counter() - t
    out = _result(args, wall, base, {"replay": _cpu() - c})
    out["bit_exact"] = state_digest(state) == json.loads((Path(args.scratch) / "digests.json").read_text())[str(args.versions)]
    return out


def phase_inspect(args: argparse.Namespace) -> dict[str, Any]:
    from deltarl.pipeline.inspection import inspect_run

    base = rss_bytes("VmRSS")
    t = time.perf_counter()
    summary = inspect_run(_store(args), RUN)
    wall = time.perf_counter() - t
    return _result(args, wall, base, versions=len(summary.rows) if hasattr(summary, "rows") else None)


def phase_gc(args: argparse.Namespace) -> dict[str, Any]:
    from deltarl.pipeline.gc import gc

    base = rss_bytes("VmRSS")
    t = time.perf_counter()
    report = gc(_store(args), RUN, keep_last=args.versions + 1)
    wall = time.perf_counter() - t
    return _result(args, wall, base, orphans=len(report.orphans))


def phase_digests(args: argparse.Namespace) -> dict[str, Any]:
    """Setup, not timed: the expected state digest of every version (for bit-exactness)."""
    import torch

    from benchmarks._scale_state import apply_changes
    from deltarl.codec import state_digest

    flat, state = load_state(Path(args.scratch), args.model, 0)
    bits = flat.view(torch.int16).numpy().view(np.uint16)
    digests = {"0": state_digest(state)}
    for v in range(1, args.versions + 1):
        apply_changes(bits, Path(args.scratch), v)
        digests[str(v)] = state_digest(state)
    (Path(args.scratch) / "digests.json").write_text(json.dumps(digests))
    return {}


PHASES = {
    "limits": phase_limits,
    "digests": phase_digests,
    "keyframe": phase_keyframe,
    "deltas": phase_deltas,
    "deltas_long": phase_deltas_long,
    "relay": phase_relay,
    "bootstrap": phase_bootstrap,
    "bootstrap_model": phase_bootstrap_model,
    "bootstrap_warm": phase_bootstrap_warm,
    "stage_commit": phase_stage_commit,
    "replay": phase_replay,
    "inspect": phase_inspect,
    "gc": phase_gc,
}
#: Phases that run only when named in --only (a run that names one writes scale-<model>-long.json).
OPT_IN = {"deltas_long"}
#: (phase, the limit it is bound by, target GB/s as a fraction of that limit or absolute, target copies)
TARGETS = {
    "keyframe": ("durable_write_gb_s", ">= 0.8x limit", 1.3),
    "deltas": (None, ">= 2.0 GB/s", 2.3),
    "deltas_long": (None, ">= 2.0 GB/s", 2.3),
    "relay": ("cached_read_gb_s", "-", None),
    "bootstrap": ("blake3_gb_s", ">= 0.4 GB/s (cold relay)", 1.3),
    "bootstrap_model": ("blake3_gb_s", ">= 0.4 GB/s (cold relay)", 1.3),
    "bootstrap_warm": ("blake3_gb_s", ">= 0.5 GB/s (warm relay)", 1.3),
    "stage_commit": (None, "<= 1.3x numpy scatter", None),
    "replay": ("cached_read_gb_s", ">= 0.8 GB/s", 1.3),
}


def _run_phase(args: argparse.Namespace, name: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.scale", "--phase", name, "--scratch", args.scratch, "--model", args.model,
           "--versions", str(args.versions), "--long", str(args.long)]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}",
                "process_s": round(time.perf_counter() - t, 1)}  # fmt: skip
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["load_avg"] = loadavg()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1.7b", choices=[*sorted(MODELS), "30b-a3b"])
    parser.add_argument("--layers", type=int, default=1, help="30b-a3b: layers measured, one at a time")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--long", type=int, default=50, help="versions the deltas_long phase publishes (opt-in phase)")
    parser.add_argument("--scratch", default=None, help="scratch directory (default: a temp dir, removed after)")
    parser.add_argument("--only", default=None, help="comma-separated phases (default: all)")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: the tiny model, 2 versions, every phase but the machine's limits")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes (default results/scale-<model>.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.versions, args.long = "tiny", 2, 3
        args.only = args.only or ",".join(name for name in PHASES if name not in OPT_IN | {"limits"})
    if args.model == "30b-a3b":  # MoE: full-size layers measured one at a time (benchmarks/_scale_moe.py)
        from benchmarks._scale_moe import run

        run(args.layers, RESULTS)
        return
    if args.serve_relay:
        _serve_relay(args)
        return
    if args.phase:
        print(json.dumps(PHASES[args.phase](args)), flush=True)
        return
    own = args.scratch is None
    args.scratch = args.scratch or tempfile.mkdtemp(prefix=f"deltarl-scale-{args.model}-", dir=os.environ.get("DELTARL_SCRATCH"))
    scratch = Path(args.scratch)
    copy = _model_bytes(args.model)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"Qwen3-{args.model.upper()} shapes: {copy / GB:.2f} GB per BF16 copy, scratch {scratch}, {cpus} CPUs, "
          f"load {loadavg()}", flush=True)
    results: dict[str, Any] = {"model": args.model, "copy_gb": round(copy / GB, 3), "load_avg_start": loadavg(),
                               "cpus": cpus, "machine_cpus": os.cpu_count(), "phases": {}}  # fmt: skip
    try:
        if not (scratch / "meta.json").exists():
            t = time.perf_counter()
            results["state"] = generate(scratch, args.model, args.versions)
            print(f"generated states in {time.perf_counter() - t:.1f}s: {results['state']}", flush=True)
        only = args.only.split(",") if args.only else [name for name in PHASES if name not in OPT_IN]
        if "keyframe" in only:  # a reused scratch keeps its states, not the last run's store
            shutil.rmtree(scratch / "store", ignore_errors=True)
        if "digests" in only and not (scratch / "digests.json").exists():
            _run_phase(args, "digests")
        for name in only:
            if name == "digests":
                continue
            res = _run_phase(args, name)
            results["phases"][name] = res
            print(f"  {name:13s} {json.dumps(res)}", flush=True)
        results["load_avg_end"] = loadavg()
        _summarize(results)
        results["quick"] = args.quick
        RESULTS.mkdir(exist_ok=True)
        out = args.out or RESULTS / f"scale-{args.model}{'-long' if OPT_IN & set(only) else ''}{'' if cpus == os.cpu_count() else f'-{cpus}cpu'}.json"  # under taskset
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {out}")
    finally:
        if own:
            shutil.rmtree(scratch, ignore_errors=True)


def _summarize(results: dict[str, Any]) -> None:
    limits = results["phases"].get("limits", {})
    print(f"\nlimits: {limits}")
    print(f"{'phase':13s} {'wall s':>8s} {'GB/s':>7s} {'of limit':>9s} {'RSS/copy':>9s} {'core-s/GB by role':>32s}  target")
    for name, res in results["phases"].items():
        if name == "limits" or "wall_s" not in res:
            if "error" in res:
                print(f"{name:13s} ERROR {res['error']}")
            continue
        bound, target, copies = TARGETS.get(name, (None, "-", None))
        frac = res["gb_s"] / limits[bound] if bound and bound in limits else None
        res["fraction_of_limit"] = None if frac is None else round(frac, 3)
        res["limit"] = bound
        extra = f" pause/scatter {res['pause_vs_scatter']}" if "pause_vs_scatter" in res else ""
        roles = " ".join(f"{r} {v:.2f}" for r, v in res.get("core_s_per_gb", {}).items())
        print(f"{name:13s} {res['wall_s']:8.2f} {res['gb_s']:7.3f} {'' if frac is None else f'{frac:.2f}':>9s} "
              f"{res['peak_rss_copies']:9.2f} {roles:>32s}  {target}{'' if copies is None else f', <= {copies} copies'}{extra}")  # fmt: skip


if __name__ == "__main__":
    main()
