"""Publishing is pipelined: wall time of ``Publisher.publish`` vs max(encode time, upload time).

For each store target, the same steady-state Adam/BF16 deltas (``_trace.AdamTrace``, lr 1e-6) are
cut into many small segments and measured three ways per version:

* **encode**: ``encode_delta`` alone (the whole delta, no store);
* **upload**: the same segments put alone, on the same pool size as the publisher;
* **publish**: ``Publisher.publish`` (encode and upload overlapped, then manifest + HEAD CAS).

``ratio = publish wall / max(encode, upload)`` (standalone stages); 1.0 is perfect overlap, ~2.0 is serial, the target
is <= 1.25. Targets: a local directory; the same directory behind an *emulated* link (a wrapper
store that delays each put as if the bytes crossed one shared link of a fixed rate, chosen so that
upload time ~= encode time, the hardest case for a pipeline); and SeaweedFS (``weed mini`` on
loopback, real S3 over HTTP). Numbers taken while other work shares the CPUs are noisy.

    python benchmarks/publish.py [--quick] [--targets local,link,seaweed]
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _trace import AdamTrace, qwen3_like_shapes

from deltarl.pipeline import encode_delta
from deltarl.storage import LocalStore, ObjectStore, Publisher
from deltarl.storage.store import ObjectInfo

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "publish.json"


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

    def _cross(self, n: int) -> None:
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
            [sys.executable, str(REPO / "infra" / "seaweedfs.py"), "--dir", str(root / "data"), "--s3-port", "0"],
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


def calibrate_rate(states: list[dict[str, Any]], seg_bytes: int) -> float:
    """A link rate at which uploading a delta takes as long as encoding it (best of 3 encodes)."""
    times, size = [], 0
    for _ in range(3):
        t = time.perf_counter()
        size = sum(map(len, encode_delta(states[0], states[1], base="calibrate", segment_bytes=seg_bytes)))
        times.append(time.perf_counter() - t)
    return size / min(times)


def upload_alone(store: ObjectStore, prefix: str, segments: list[bytes], workers: int) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda kv: store.put_if_absent(f"{prefix}/seg-{kv[0]:05d}.bin", kv[1]), enumerate(segments)))
    return time.perf_counter() - t


def measure(name: str, store: ObjectStore, states: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    seg_bytes = args.segment_kib << 10
    rows = []
    with Publisher(
        store, f"bench-{name}", keyframe_interval=10**9, digest_interval=10**9, segment_bytes=seg_bytes,
        upload_workers=args.workers,
    ) as pub:  # fmt: skip
        pub.publish(states[0], step=0)
        for i in range(1, len(states)):
            base = pub.head_version_id
            assert base is not None
            t = time.perf_counter()
            segments = encode_delta(states[i - 1], states[i], base=base, segment_bytes=seg_bytes)
            encode = time.perf_counter() - t
            upload = upload_alone(store, f"bench-scratch/{name}/{i}", segments, args.workers)
            info = pub.publish(states[i], step=i)
            rows.append(
                {
                    "version": i,
                    "segments": len(info.segment_keys),
                    "delta_bytes": info.stats.encoded_bytes,
                    "changed_fraction": info.stats.changed_fraction,
                    "encode_s": encode,
                    "upload_s": upload,
                    "publish_wall_s": info.wall_s,
                    "publish_encode_s": info.encode_s,
                    "publish_upload_busy_s": info.upload_s,
                    "ratio": info.wall_s / max(encode, upload),
                    "ratio_in_run": info.wall_s / max(info.encode_s, info.upload_s),
                }
            )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "version"}
    return {"target": name, "store": store.url, "versions": rows, "median": med}


LABELS = {"local": "local dir", "link": "local dir + emulated link", "seaweed": "SeaweedFS S3 (weed mini)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, 2 measured versions")
    parser.add_argument("--targets", default="local,link,seaweed")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--versions", type=int, default=None, help="measured versions per target")
    parser.add_argument("--segment-kib", type=int, default=None, help="segment size (KiB); small, for many segments")
    parser.add_argument("--workers", type=int, default=4, help="upload workers")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    layers = args.layers or (1 if args.quick else 4)
    versions = args.versions or (2 if args.quick else 5)
    args.segment_kib = args.segment_kib or (16 if args.quick else 64)
    shapes = qwen3_like_shapes(layers=layers) if not args.quick else qwen3_like_shapes(
        layers=layers, hidden=512, intermediate=1536, heads=8, kv_heads=4, head_dim=64, vocab=8192)  # fmt: skip

    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    trace = AdamTrace(shapes, seed=0, lr=1e-6)
    console.print(f"model: {len(shapes)} tensors, {trace.numel / 1e6:.1f}M BF16 params; warming up Adam …")
    trace.run(warmup_steps=3)
    states = [trace.export()]
    for _ in range(versions):
        trace.step()
        states.append(trace.export())
    encode_delta(states[0], states[1], base="warm-up", segment_bytes=args.segment_kib << 10)  # JIT, caches

    results = []
    targets = args.targets.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
        root = Path(tmp)
        if "local" in targets or "link" in targets:
            local = measure("local", LocalStore(root / "local"), states, args)
            if "local" in targets:
                results.append(local)
            if "link" in targets:
                rate = calibrate_rate(states, args.segment_kib << 10)
                results.append(measure("link", LinkStore(LocalStore(root / "link"), rate), states, args))
        if "seaweed" in targets:
            (root / "weed").mkdir()
            weed = Seaweed(root / "weed")
            try:
                results.append(measure("seaweed", weed.store(), states, args))
            finally:
                weed.stop()

    table = Table(title=f"publish pipelining ({trace.numel / 1e6:.1f}M params, {args.segment_kib} KiB segments, "
                        f"{args.workers} upload workers; medians over {versions} versions)")  # fmt: skip
    for col in ("target", "segments", "delta", "changed", "encode s", "upload s", "publish wall s", "encode in publish s",
                "serial s", "wall/max", "≤1.25", "wall/max in-run"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for r in results:
        m = r["median"]
        table.add_row(
            LABELS[r["target"]], f"{m['segments']:.0f}", f"{m['delta_bytes'] / 1e6:.2f} MB", f"{100 * m['changed_fraction']:.2f}%",
            f"{m['encode_s']:.3f}", f"{m['upload_s']:.3f}", f"{m['publish_wall_s']:.3f}", f"{m['publish_encode_s']:.3f}",
            f"{m['encode_s'] + m['upload_s']:.3f}", f"{m['ratio']:.2f}", "yes" if m["ratio"] <= 1.25 else "NO",
            f"{m['ratio_in_run']:.2f}",
        )  # fmt: skip
    console.print(table)
    for r in results:
        console.print(f"  {LABELS[r['target']]}: {r['store']}")
    console.print("  'encode in publish': encoder time inside the pipelined publish (it shares the CPUs with the uploads);")
    console.print("  'wall/max in-run': publish wall / max(encode in publish, upload busy time in publish)")
    doc = {
        "benchmark": "publish",
        "params": trace.numel,
        "layers": layers,
        "segment_bytes": args.segment_kib << 10,
        "upload_workers": args.workers,
        "quick": args.quick,
        "note": "link = local dir behind an emulated shared link whose rate makes upload ~= encode",
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
