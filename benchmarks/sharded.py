"""Sharded publishing: N ranks (gloo, one encode thread each) vs one rank with one thread.

Every rank synthesises only its own rows of a Qwen3-shaped BF16 state (deterministic per global
block of rows, so the state is the same at any world size), publishes version 0 (a keyframe in
parts) and then ``--versions`` delta versions in which ~1% of the elements move by one ulp (the
steady state of Adam at lr ~1e-6). Measured per delta version: wall time of ``publish_local`` from
a barrier to the commit seen by every rank (best and median over versions), bytes per version, and
each rank's peak RSS above its RSS before it held any tensor (the interpreter, torch and gloo).

Targets: N ranks publish a delta in <= 0.6x the one-rank wall time; no rank's data peak exceeds its
shard + its previous shard + 10% of one model copy; bytes within 3% of the one-rank encoding.

``--resume`` then opens a new job's publisher on the run and publishes one more version: its
base rows come from the store (rank 0 replays the HEAD version and scatters each rank's rows).
Measured: that version's wall time and each rank's peak RSS above its RSS before it, in model
copies (rank 0 holds the full state for the time of the resume; the others only their rows).

``--serve-as fp8-block128`` publishes the FP8 serving state instead (issue 35): the ranks reduce
their rows' block maxima in one collective and each quantizes its own rows (the one-rank baseline is
the same publisher on one rank: the one-process FP8 publish, quantizing the whole state). The JSON
then also records the collective's bytes per version (4 bytes per 128x128 block, plus the header).

    python -m benchmarks.sharded --ranks 2 [--model 1.7b|0.6b|tiny] [--versions 3] [--resume] [--serve-as fp8-block128] [--quick] [--out FILE]

``--quick`` (a smoke run, seconds): the tiny model, 1 delta version, the resume included.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from ._scale_state import reset_peak, rss_bytes
from ._trace import qwen3_like_shapes

RESULTS = Path(__file__).resolve().parent / "results"
#: name -> qwen3_like_shapes kwargs (Qwen3-1.7B and -0.6B element counts; tied embeddings)
MODELS: dict[str, dict[str, int]] = {
    "1.7b": {"layers": 28, "hidden": 2048, "intermediate": 6144, "heads": 16, "kv_heads": 8, "head_dim": 128, "vocab": 151936},
    "0.6b": {"layers": 28, "hidden": 1024, "intermediate": 3072, "heads": 16, "kv_heads": 8, "head_dim": 128, "vocab": 151936},
    "tiny": {"layers": 2, "hidden": 256, "intermediate": 768, "heads": 4, "kv_heads": 2, "head_dim": 64, "vocab": 4096},
}
BLOCK_ELEMENTS = 1 << 20
CHANGED = 0.01


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _row_blocks(shape: tuple[int, ...]) -> int:
    row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // row)


def _my_rows(shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    per = -(-shape[0] // world)
    start = min(per * rank, shape[0])
    return start, min(start + per, shape[0])


def _fill(k: int, shape: tuple[int, ...], a: int, b: int, version: int, out: np.ndarray) -> None:
    """Rows [a, b) of tensor ``k`` at ``version`` (0: values; >0: flip the low bit of ~1% in place)."""
    per = _row_blocks(shape)
    row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    for blk in range(a // per, -(-b // per)):
        lo, hi = max(a, blk * per), min(b, (blk + 1) * per)
        rng = np.random.default_rng((version, k, blk))
        n = ((blk + 1) * per - blk * per) * row
        view = out[(lo - a) * row : (hi - a) * row]
        skip = (lo - blk * per) * row
        if version == 0:
            vals = rng.integers(0x3A00, 0x3D00, size=n, dtype=np.uint16) | (rng.integers(0, 2, size=n, dtype=np.uint16) << 15)
            view[:] = vals[skip : skip + view.size]
        else:
            idx = rng.integers(0, n, size=max(1, int(n * CHANGED)), dtype=np.int64) - skip
            idx = idx[(idx >= 0) & (idx < view.size)]
            view[idx] ^= 1


def _warm_up() -> None:
    """Load the encoder's kernels (numba) before the baseline RSS, so it counts only tensors."""
    import torch

    from deltarl.codec import encode_delta

    old = {"w": torch.zeros(1 << 16, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][::97] = 1.0
    encode_delta(old, new, base="0" * 64)


def _worker(rank: int, world: int, args: argparse.Namespace, root: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.storage import LocalStore
    from deltarl.testing.ranks import leave_process_group

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="rank " + str(rank) + ": %(message)s")
    logging.getLogger("deltarl.pipeline.sharded").setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=world, timeout=timedelta(minutes=20))
    shapes = qwen3_like_shapes(**MODELS[args.model])
    _warm_up()
    base_rss = _current_rss()
    bits: dict[str, np.ndarray] = {}
    triples: dict[str, Any] = {}
    shard_bytes = 0
    for k, (name, shape) in enumerate(shapes):
        a, b = _my_rows(shape, rank, world)
        arr = np.empty((b - a, *shape[1:]), dtype=np.uint16)
        _fill(k, shape, a, b, 0, arr.reshape(-1))
        bits[name] = arr
        shard_bytes += arr.nbytes
        triples[name] = (torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16), shape, a)
    model_bytes = sum(int(np.prod(s)) * 2 for _, s in shapes)
    store = LocalStore(os.path.join(root, "store"))
    walls, sizes, encodes, cpus, phases = [], [], [], [], []
    with ShardedPublisher(store, "bench", keyframe_interval=10_000, digest_interval=10_000, encode_threads=1, upload_workers=2,
                          serve_as=args.serve_as) as pub:
        pub.publish_local(triples, 0, owned=True)
        os.sync()  # flush the keyframe's dirty pages now, not into the fsyncs of the timed versions
        dist.barrier()
        for v in range(1, args.versions + 1):
            triples = _next_rows(shapes, bits, rank, world, v)
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            info = pub.publish_local(triples, v, owned=True)
            dist.barrier()
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
            encodes.append(info.encode_s)
            phases.append({"encode_s": info.encode_s, "upload_wait_s": info.upload_wait_s, "commit_s": info.commit_s})
            sizes.append(info.stats.encoded_bytes)
            del triples
    peak = _rss_bytes() - base_rss
    del pub  # its previous rows: a new job starts without them
    resume = _resume(args, store, shapes, bits, rank, world) if args.resume else None
    rec = {"resume": resume, "rank": rank, "shard_bytes": shard_bytes, "peak_data_bytes": peak, "peak_rss_bytes": _rss_bytes(),
           "budget_bytes": 2 * shard_bytes + model_bytes // 10, "model_bytes": model_bytes, "walls": walls, "sizes": sizes,
           "encode_s": encodes, "cpu_s": cpus, "phases": phases}  # fmt: skip
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        out.put(gathered)
    leave_process_group(flush=(out,))  # not a normal return: gloo's teardown can abort at interpreter exit


def _next_rows(shapes: list[Any], bits: dict[str, np.ndarray], rank: int, world: int, version: int) -> dict[str, Any]:
    """This rank's rows of ``version`` (a new buffer per tensor, as a trainer's next export), as
    ``publish_local`` triples; ``bits`` is updated to them."""
    import torch

    triples: dict[str, Any] = {}
    for k, (name, shape) in enumerate(shapes):
        a, b = _my_rows(shape, rank, world)
        arr = bits[name].copy()
        _fill(k, shape, a, b, version, arr.reshape(-1))
        bits[name] = arr
        triples[name] = (torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16), shape, a)
    return triples


def _resume(args: argparse.Namespace, store: Any, shapes: list[Any], bits: dict[str, np.ndarray], rank: int, world: int
            ) -> dict[str, Any]:
    """One more version from a new job's publisher, which resumes the run: wall time, peak RSS above
    the start (this rank's current rows) in bytes."""
    import torch.distributed as dist

    from deltarl.pipeline.sharded import ShardedPublisher

    v = args.versions + 1
    triples = _next_rows(shapes, bits, rank, world, v)
    dist.barrier()
    reset_peak()
    before = rss_bytes("VmRSS")
    t = time.perf_counter()
    with ShardedPublisher(store, "bench", keyframe_interval=10_000, digest_interval=10_000, encode_threads=1,
                          upload_workers=2, writer_id="resumed", serve_as=args.serve_as) as pub:
        t_open = time.perf_counter()
        pub.publish_local(triples, v, owned=True)
        dist.barrier()
        t_first = time.perf_counter()
    return {"wall_s": t_first - t_open, "open_s": t_open - t, "peak_over_start_bytes": rss_bytes("VmHWM") - before}


def _fp8_collective_bytes(model: str, world: int) -> int:
    """The buffers each rank hands to the FP8 collectives per version (deltarl.pipeline.sharded_fp8):
    an int64 header of 4 + world entries and 4 bytes per 128x128 block of every quantized weight."""
    from deltarl.codec.fp8 import BLOCK, quantizes

    blocks = sum(-(-s[0] // BLOCK) * -(-s[1] // BLOCK) for n, s in qwen3_like_shapes(**MODELS[model]) if quantizes(n, tuple(s)))
    return 8 * (4 + world) + 4 * blocks


def run(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="deltarl-sharded-") as root:
        env = {"DELTARL_THREADS": "1", "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        os.environ.update(env)
        procs = [ctx.Process(target=_worker, args=(r, world, args, root, queue)) for r in range(world)]
        for p in procs:
            p.start()
        result = queue.get()
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"rank exited with {p.exitcode}")
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model", choices=sorted(MODELS), default="1.7b")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--name", default="sharded")
    ap.add_argument("--resume", action="store_true", help="also publish one version from a new job that resumes the run")
    ap.add_argument("--serve-as", choices=["fp8-block128"], default=None, help="publish the FP8 serving state (issue 35)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: the tiny model, 1 delta version, with --resume")
    ap.add_argument("--out", type=Path, default=None, help="where the JSON goes (default results/<name>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.versions, args.resume = "tiny", 1, True
    rows = {}
    load_before = os.getloadavg()
    for world in (1, args.ranks):
        recs = run(world, args)
        walls = recs[0]["walls"]
        rows[world] = {
            "wall_best_s": min(walls),
            "wall_median_s": statistics.median(walls),
            "bytes_per_version": statistics.median(recs[0]["sizes"]),
            "ranks": recs,
        }
    one, many = rows[1], rows[args.ranks]
    gib = 1 << 30
    print(f"{'ranks':>5} {'wall best s':>11} {'median s':>9} {'CPU s/rank':>12} {'bytes/version':>14} {'peak data GiB/rank':>19} {'budget GiB':>10}")
    for world, r in rows.items():
        peaks = " ".join(f"{x['peak_data_bytes'] / gib:.2f}" for x in r["ranks"])
        cpu = " ".join(f"{min(x['cpu_s']):.2f}" for x in r["ranks"])
        print(f"{world:>5} {r['wall_best_s']:>11.3f} {r['wall_median_s']:>9.3f} {cpu:>12} {r['bytes_per_version']:>14.0f} {peaks:>19} {r['ranks'][0]['budget_bytes'] / gib:>10.2f}")
    speed = many["wall_best_s"] / one["wall_best_s"]
    cpu_ratio = max(min(x["cpu_s"]) for x in many["ranks"]) / min(one["ranks"][0]["cpu_s"])
    size = many["bytes_per_version"] / one["bytes_per_version"]
    memory_ok = all(x["peak_data_bytes"] <= x["budget_bytes"] for x in many["ranks"])
    targets = {"wall_ratio": speed, "cpu_critical_path_ratio": cpu_ratio, "wall_ratio_met": speed <= 0.6, "bytes_ratio": size, "bytes_met": abs(size - 1) <= 0.03,
               "memory_met": memory_ok}  # fmt: skip
    print(f"{args.ranks} ranks / 1 rank wall (best): {speed:.2f}x (target <= 0.6), busiest rank's CPU time {cpu_ratio:.2f}x; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"bytes {size:.4f}x (within 3%); "
          f"memory within shard+previous+10%: {memory_ok}")  # fmt: skip
    if args.resume:
        for world, r in rows.items():
            copies = " ".join(f"{x['resume']['peak_over_start_bytes'] / x['model_bytes']:.2f}" for x in r["ranks"])
            print(f"resume with {world} rank(s): opened in {r['ranks'][0]['resume']['open_s']:.2f} s, "
                  f"{r['ranks'][0]['resume']['wall_s']:.2f} s for the first version; "
                  f"peak RSS above the start per rank, in model copies: {copies}")
    load = (load_before, os.getloadavg())
    out = {"benchmark": "sharded", "quick": args.quick, "model": args.model, "ranks": args.ranks, "versions": args.versions, "cpus": os.cpu_count(), "load_avg": load,
           "serve_as": args.serve_as, "results": {str(k): v for k, v in rows.items()}, "targets": targets}  # fmt: skip
    if args.serve_as:
        out["collective_bytes_per_version"] = {str(w): _fp8_collective_bytes(args.model, w) for w in rows}
        print(f"FP8 block-maxima collective per version: {out['collective_bytes_per_version']} bytes (by ranks)")
        for world, r in rows.items():
            copies = " ".join(f"{x['peak_data_bytes'] / x['model_bytes']:.2f}" for x in r["ranks"])
            print(f"{world} rank(s): peak data per rank in BF16 model copies: {copies}")
    path = args.out or RESULTS / f"{args.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
