"""Publishing is pipelined: wall time of ``Publisher.publish`` vs max(encode time, upload time).

The same steady-state Adam/BF16 deltas (``_trace.AdamTrace``, lr 1e-6) are published at two sizes:

* **small**: 49M params (98 MB BF16), 64 KiB segments: ~20 segments of a ~1.3 MB delta; fixed
  per-publish costs (claim renewal, manifest, HEAD CAS) weigh most here;
* **large**: 128M params (256 MB), 256 KiB segments: ~9 segments of a ~2.3 MB delta. The model
  to segment size ratio (1000:1) is that of an 8B model (16 GB) with the default 16 MiB segments,
  and the delta spans several segments as a real one does (4 MiB segments would put this delta in
  a single segment, where nothing can overlap).

Each delta is measured four ways, in the same process with the same threads:

* **encode**: ``encode_delta`` alone (the whole delta, no store);
* **upload**: the same segment bytes put alone to the same store, as the publisher's upload stage
  does it (sha256 for the manifest, ``put_if_absent``, the same number of workers);
* **publish**: ``Publisher.publish(state, step, owned=True)`` (encode and upload overlapped, then
  claim check, manifest ``put_if_absent``, HEAD CAS; the state is handed over as the next base,
  as a trainer's fresh export per step can be);
* **publish (copying)**: the same without ``owned``: the publisher copies the committed state
  into its retained base after the commit (one pass over the whole model per version).

Repetitions interleave: ``--reps`` pairs of publishers (one run each) publish the same versions,
and for each version every repetition measures the four in a rotated order, so load from other
work hits them alike. Per version the best of the repetitions is kept (the
minimum is the least noisy estimate of a cost on a shared machine); ``ratio = best publish /
max(best encode, best upload)``, and the target is the median over versions ``<= 1.25`` (1.0 is
perfect overlap, ~2.0 serial). Medians of all repetitions are reported alongside.

Targets: a local directory; the same directory behind an *emulated* link (puts wait as if their
bytes crossed one shared link whose rate makes upload ~= encode, the hardest case for a
pipeline); SeaweedFS (``weed mini`` on loopback, real S3 over HTTP). SeaweedFS runs on the same
CPUs as the encoder, so its server CPU time during a publish is reported too.

    python -m benchmarks.publish [--quick] [--sizes small,large] [--targets local,link,seaweed] [--reps 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deltarl.codec import encode_delta
from deltarl.pipeline.manifest import ObjectRef
from deltarl.pipeline.publisher import Publisher
from deltarl.storage import LocalStore
from deltarl.storage.store import ObjectInfo, ObjectStore

from ._trace import AdamTrace, qwen3_like_shapes

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "publish.json"
FAKE_BASE = "0" * 64  # encode-alone segments name a base id of the real length

#: name -> (decoder layers of qwen3_like_shapes, segment KiB)
SIZES = {"small": (1, 64), "large": (6, 256)}
QUICK_SHAPES = {"hidden": 512, "intermediate": 1536, "heads": 8, "kv_heads": 4, "head_dim": 64, "vocab": 8192}
WHATS = ("encode", "upload", "publish", "publish_copying")
#: per repetition, the order of the measurements (rotated; the first encodes before uploading)
ORDERS = (
    ("encode", "upload", "publish", "publish_copying"),
    ("publish_copying", "encode", "upload", "publish"),
    ("publish", "publish_copying", "encode", "upload"),
    ("upload", "publish", "publish_copying", "encode"),
)
LABELS = {"local": "local dir", "link": "local dir + emulated link", "seaweed": "SeaweedFS S3 (weed mini)"}


class LinkStore(ObjectStore):
    """Emulated bandwidth-limited store: each put waits as if its bytes crossed one shared link.

    Puts are serialized on a virtual link of ``rate`` bytes/s (a put of n bytes occupies the link
    for n/rate seconds after the previous one), then written to ``inner``. Reads are not delayed.
    """

    def __init__(self, inner: ObjectStore, rate: float) -> None:
        self.inner, self.rate = inner, rate
        self.url = f"{inner.url} (emulated {rate / 1e6:.2f} MB/s link)"
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.bypass = False  # True while seeding the runs' keyframes, which are not measured

    def _cross(self, n: int) -> None:
        if self.bypass:
            return
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + n / self.rate
            done = self._free_at
        time.sleep(max(0.0, done - time.perf_counter()))

    def put(self, key: str, data: bytes) -> str:
        self._cross(len(data))
        return self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> str:
        self._cross(len(data))
        return self.inner.put_if_absent(key, data)

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        self._cross(len(data))
        return self.inner.cas(key, data, expected_etag)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        return self.inner.get_range(key, start, end)

    def head(self, key: str) -> ObjectInfo:
        return self.inner.head(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> Any:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


class Seaweed:
    """``weed mini`` on free loopback ports via infra/seaweedfs.py; a fresh bucket per ``store()``."""

    def __init__(self, root: Path) -> None:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        self.log = open(root / "weed.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "infra" / "seaweedfs.py"),
                "--dir",
                str(root / "data"),
                "--s3-port",
                "0",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            text = (root / "weed.log").read_text(errors="replace")
            if text.startswith("S3_ENDPOINT=") and "\n" in text:
                self.endpoint = text.splitlines()[0].split("=", 1)[1]
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS did not start:\n{text[-2000:]}")
            time.sleep(0.05)
        self.n = 0
        self.store()  # wait until writable

    def store(self) -> ObjectStore:
        from deltarl.errors import StoreError
        from deltarl.storage.retry import NO_RETRY
        from deltarl.storage.s3 import S3Store

        self.n += 1
        bucket = f"bench-publish-{os.getpid()}-{self.n}"
        deadline = time.monotonic() + 60
        while True:
            try:
                probe = S3Store(bucket, endpoint_url=self.endpoint, retry=NO_RETRY, connect_timeout=1)
                probe.create_bucket()
                probe.put("probe", b"ok")
                probe.close()
                break
            except StoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        return S3Store(bucket, endpoint_url=self.endpoint)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def cpu_clock(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (Linux), or this process for None."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def upload_alone(store: ObjectStore, prefix: str, segments: list[bytes], workers: int) -> None:
    """The publisher's upload stage without the encoder: hash for the manifest, put_if_absent."""

    def one(item: tuple[int, bytes]) -> ObjectRef:
        ref = ObjectRef.of(f"{prefix}/seg-{item[0]:05d}.bin", item[1])
        store.put_if_absent(ref.key, item[1])
        return ref

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, enumerate(segments)))


def make_states(layers: int, versions: int, quick: bool) -> tuple[list[dict[str, Any]], int]:
    shapes = qwen3_like_shapes(layers=layers, **(QUICK_SHAPES if quick else {}))
    trace = AdamTrace(shapes, seed=0, lr=1e-6)
    trace.run(warmup_steps=3)
    states = [trace.export()]
    for _ in range(versions):
        trace.step()
        states.append(trace.export())
    numel = trace.numel
    del trace
    gc.collect()
    return states, numel


def calibrate_rate(states: list[dict[str, Any]], seg_bytes: int) -> float:
    """A link rate at which uploading a delta takes as long as encoding it (best of 3 encodes)."""
    times, size = [], 0
    for _ in range(3):
        t = time.perf_counter()
        size = sum(map(len, encode_delta(states[0], states[1], base=FAKE_BASE, segment_bytes=seg_bytes)))
        times.append(time.perf_counter() - t)
    return size / min(times)


def measure_version(
    name: str, store: ObjectStore, pubs: list[Publisher], old: dict[str, Any], new: dict[str, Any], version: int,
    seg_bytes: int, args: argparse.Namespace, server_pid: int | None,
) -> dict[str, Any]:  # fmt: skip
    """One version: every repetition measures encode alone, upload alone and a publish, rotated."""
    segs: list[bytes] = []
    samples: dict[str, list[dict[str, float]]] = {w: [] for w in WHATS}
    infos = []
    for r in range(args.reps):
        scratch = f"bench-scratch/{name}/{version}/{r}"
        for what in ORDERS[r % len(ORDERS)]:
            t0 = cpu_clock(None), cpu_clock(server_pid) if server_pid else 0.0, time.perf_counter()
            if what == "encode":
                segs = encode_delta(old, new, base=FAKE_BASE, segment_bytes=seg_bytes)
            elif what == "upload":
                upload_alone(store, scratch, segs, args.workers)
            elif what == "publish":
                infos.append(pubs[2 * r].publish(new, step=version, owned=True))
            else:
                pubs[2 * r + 1].publish(new, step=version)
            wall = time.perf_counter() - t0[2]
            cpu = cpu_clock(None) - t0[0]
            server = cpu_clock(server_pid) - t0[1] if server_pid else 0.0
            samples[what].append({"wall": wall, "cpu": cpu, "server_cpu": server})
        for key in list(store.list(scratch + "/")):
            store.delete(key)
    best = {k: min(s["wall"] for s in v) for k, v in samples.items()}
    med = {k: statistics.median(s["wall"] for s in v) for k, v in samples.items()}
    return {
        "version": version,
        "segments": len(infos[0].segment_keys),
        "delta_bytes": infos[0].stats.encoded_bytes,
        "changed_fraction": infos[0].stats.changed_fraction,
        "encode_s": best["encode"],
        "upload_s": best["upload"],
        "publish_wall_s": best["publish"],
        "ratio": best["publish"] / max(best["encode"], best["upload"]),
        "ratio_of_medians": med["publish"] / max(med["encode"], med["upload"]),
        "publish_copying_wall_s": best["publish_copying"],
        "ratio_copying": best["publish_copying"] / max(best["encode"], best["upload"]),
        "publish_encode_s": min(x.encode_s for x in infos),
        "publish_upload_busy_s": min(x.upload_s for x in infos),
        "cpu_s": {k: min(s["cpu"] for s in v) for k, v in samples.items()},
        "server_cpu_s": {k: min(s["server_cpu"] for s in v) for k, v in samples.items()},
        "samples": samples,
    }


SCALARS = ("segments", "delta_bytes", "changed_fraction", "encode_s", "upload_s", "publish_wall_s", "ratio",
           "ratio_of_medians", "publish_copying_wall_s", "ratio_copying", "publish_encode_s",
           "publish_upload_busy_s")  # fmt: skip


def measure(
    name: str, store: ObjectStore, states: list[dict[str, Any]], seg_bytes: int, args: argparse.Namespace,
    server_pid: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Interleaved encode / upload / publish repetitions for every version, on one store."""
    load = [os.getloadavg()[0]]
    opts: dict[str, Any] = {"keyframe_interval": 10**9, "digest_interval": 10**9, "segment_bytes": seg_bytes}
    pubs = [  # per repetition: one publisher handed its states (owned=True), one copying them
        Publisher(store, f"bench-{name}-{r}-{how}", upload_workers=args.workers, **opts)
        for r in range(args.reps)
        for how in ("owned", "copying")
    ]
    rows = []
    try:
        if isinstance(store, LinkStore):  # the keyframes seed the runs; only the deltas are measured
            store.bypass = True
        for pub in pubs:
            pub.publish(states[0], step=0)
        if isinstance(store, LinkStore):
            store.bypass = False
        for i in range(1, len(states)):
            rows.append(
                measure_version(name, store, pubs, states[i - 1], states[i], i, seg_bytes, args, server_pid)
            )
            load.append(os.getloadavg()[0])
    finally:
        for pub in pubs:
            pub.close()
    med_row: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in SCALARS}
    for k in ("cpu_s", "server_cpu_s"):
        med_row[k] = {w: statistics.median(r[k][w] for r in rows) for w in WHATS}
    return {"target": name, "store": store.url, "load_1min": load, "versions": rows, "median": med_row}


def run_size(size: str, args: argparse.Namespace, console: Any) -> dict[str, Any]:
    layers, seg_kib = SIZES[size]
    seg_kib = args.segment_kib or seg_kib
    seg_bytes = seg_kib << 10
    states, numel = make_states(layers, args.versions, args.quick)
    console.print(
        f"[{size}] {numel / 1e6:.1f}M BF16 params, {seg_kib} KiB segments, load {os.getloadavg()[0]:.2f}"
    )
    encode_delta(states[0], states[1], base=FAKE_BASE, segment_bytes=seg_bytes)  # JIT, caches
    results = []
    targets = args.targets.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
        root = Path(tmp)
        if "local" in targets:
            results.append(measure("local", LocalStore(root / "local"), states, seg_bytes, args))
        if "link" in targets:
            rate = calibrate_rate(states, seg_bytes)
            results.append(
                measure("link", LinkStore(LocalStore(root / "link"), rate), states, seg_bytes, args)
            )
        if "seaweed" in targets:
            (root / "weed").mkdir()
            weed = Seaweed(root / "weed")
            try:
                results.append(
                    measure("seaweed", weed.store(), states, seg_bytes, args, server_pid=weed.proc.pid)
                )
            finally:
                weed.stop()
    return {"size": size, "params": numel, "layers": layers, "segment_bytes": seg_bytes, "results": results}


def print_table(console: Any, runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.table import Table

    table = Table(title=f"publish pipelining: best of {args.reps} interleaved repetitions per version, "
                        f"medians over {args.versions} versions, {args.workers} upload workers")  # fmt: skip
    cols = ("size", "target", "segs", "delta", "changed", "encode s", "upload s", "publish s", "wall/max", "≤1.25",
            "wall/max (medians)", "copying: publish s", "wall/max", "CPU s enc/pub", "server CPU s")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("size", "target") else "right")
    for run in runs:
        for r in run["results"]:
            m = r["median"]
            table.add_row(
                f"{run['size']} {run['params'] / 1e6:.0f}M", LABELS[r["target"]], f"{m['segments']:.0f}",
                f"{m['delta_bytes'] / 1e6:.2f} MB", f"{100 * m['changed_fraction']:.2f}%", f"{m['encode_s']:.3f}",
                f"{m['upload_s']:.3f}", f"{m['publish_wall_s']:.3f}", f"{m['ratio']:.2f}",
                "yes" if m["ratio"] <= 1.25 else "NO", f"{m['ratio_of_medians']:.2f}",
                f"{m['publish_copying_wall_s']:.3f}", f"{m['ratio_copying']:.2f}",
                f"{m['cpu_s']['encode']:.2f}/{m['cpu_s']['publish']:.2f}",
                f"{m['server_cpu_s']['publish']:.2f}" if r["target"] == "seaweed" else "-",
            )  # fmt: skip
    console.print(table)
    for run in runs:
        for r in run["results"]:
            load = ", ".join(f"{x:.1f}" for x in r["load_1min"])
            console.print(f"  {run['size']} {LABELS[r['target']]}: {r['store']}; 1-min load during: {load}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 versions, 2 repetitions")
    parser.add_argument("--sizes", default="small,large", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--targets", default="local,link,seaweed")
    parser.add_argument("--versions", type=int, default=None, help="measured versions per target")
    parser.add_argument(
        "--reps", type=int, default=None, help="interleaved repetitions (publishers) per version"
    )
    parser.add_argument(
        "--segment-kib", type=int, default=None, help="override the size's segment size (KiB)"
    )
    parser.add_argument("--workers", type=int, default=4, help="upload workers")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.versions = args.versions or (2 if args.quick else 4)
    args.reps = args.reps or (2 if args.quick else 3)
    if args.quick:
        args.sizes, args.segment_kib = "small", args.segment_kib or 16

    from rich.console import Console

    console = Console(width=200)
    load0 = os.getloadavg()
    runs = [run_size(size, args, console) for size in args.sizes.split(",")]
    print_table(console, runs, args)
    console.print(
        "  encode/upload/publish: best of the repetitions; 'wall/max (medians)' uses their medians instead;"
    )
    console.print(
        "  CPU s: this process's CPU time for encode alone / for the publish (uploads compete for the CPUs);"
    )
    console.print("  copying: the publisher copies each committed state (publish without owned=True)")
    console.print("  server CPU: SeaweedFS's own CPU time during the publish (it shares this machine's CPUs)")
    doc = {
        "benchmark": "publish",
        "upload_workers": args.workers,
        "reps": args.reps,
        "quick": args.quick,
        "note": "best of reps interleaved per version; link = local dir behind an emulated shared link "
        "whose rate makes upload ~= encode",
        "cpus": os.cpu_count(),
        "load_average_start": load0,
        "load_average_end": os.getloadavg(),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
