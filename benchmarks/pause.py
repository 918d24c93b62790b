"""Commit pause, staging memory, encode/decode threads and delta publishing at Qwen3-1.7B size.

Run: ``python -m benchmarks.pause`` (add ``--quick`` for a 1/16 size smoke run). Two phases, each
in its own process so its peak RSS (VmHWM) is its own:

* ``commit``: a synthetic 1.72e9-element BF16 state (a handful of 2048-column tensors), a next
  version with ~1% of elements moved by +-1-2 ulp; encode and stage with 1 and 2 threads (bytes
  and staged changes identical), staging bytes per change, then the commit pause (best of
  ``--repeat``, rolled back between) next to a plain numpy scatter ``flat[pos] = new`` of the same
  positions and values and a torch ``index_copy_`` of them on 1 and 2 threads (int64 positions
  prepared beforehand), bit-exact against the new version; core-seconds per GB of model of the
  commit (process CPU time), of encode and of staging.
* ``publish``: version 0 then ``--deltas`` 1% deltas through a :class:`Publisher` on a local
  store (fsync'd files), each export handed over (``owned=True``): GB of model per second, wall
  against max(encode, upload), and the delta phase's peak RSS as a multiple of one BF16 copy.
  Version 0's keyframe is serialized whole (until keyframes stream), about three copies at its
  peak, so this phase runs at ``--publish-elements`` (default half the model) to stay under ~9 GiB;
  VmHWM is reset after version 0.

The machine is shared: every figure carries the 1/5/15-minute load average taken with it.
Writes benchmarks/results/pause.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._synth import (
    QWEN3_1_7B_ELEMENTS,
    best,
    load,
    reset_hwm,
    shapes_for,
    step_in_place,
    vm_hwm,
    weights,
)

RESULTS = Path(__file__).resolve().parent / "results" / "pause.json"


def _state(elements: int, tensors: int, seed: int) -> dict[str, Any]:
    from deltarl.codec import BF16

    return {n: BF16(weights(s, seed + i)) for i, (n, s) in enumerate(shapes_for(elements, tensors).items())}


def _next(state: dict[str, Any], fraction: float, seed: int) -> tuple[dict[str, Any], int]:
    from deltarl.codec import BF16

    out, moved = {}, 0
    for i, (n, v) in enumerate(state.items()):
        bits = v.bits.copy()
        moved += step_in_place(bits, fraction, seed * 1000 + i)
        out[n] = BF16(bits)
    return out, moved


def _threads(n: int) -> None:
    os.environ["DELTARL_THREADS"] = str(n)


def phase_commit(args: argparse.Namespace) -> dict[str, Any]:
    from deltarl.codec import encode_delta, stage_delta

    t = time.perf_counter()
    old = _state(args.elements, args.tensors, 1)
    new, moved = _next(old, args.fraction, 2)
    model_bytes = sum(v.bits.nbytes for v in old.values())
    out: dict[str, Any] = {"elements": sum(v.bits.size for v in old.values()), "tensors": args.tensors,
                           "changed": moved, "model_bytes": model_bytes,
                           "build_s": round(time.perf_counter() - t, 2)}  # fmt: skip
    segs: dict[int, list[bytes]] = {}
    tiny = {"w": old[next(iter(old))].__class__(weights((64, 2048), 0))}
    step = {"w": tiny["w"].__class__(tiny["w"].bits ^ np.uint16(1))}
    stage_delta(tiny, encode_delta(tiny, step, base="t"), base="t")  # load the compiled kernels first
    for n in (1, 2):
        _threads(n)
        encode_delta(old, new, base="b")  # warm the kernels (numba cache) before timing
        secs, runs, cpu = best(lambda n=n: segs.__setitem__(n, encode_delta(old, new, base="b")), args.repeat)
        out[f"encode_{n}t"] = {"s": round(secs, 3), "runs": [round(x, 3) for x in runs],
                               "gb_per_s": round(model_bytes / secs / 1e9, 3),
                               "gb_per_cpu_s": round(model_bytes / cpu / 1e9, 3), "load": load()}  # fmt: skip
    assert segs[1] == segs[2], "encoded bytes differ between 1 and 2 threads"
    out["segments"] = len(segs[1])
    out["encoded_bytes"] = sum(len(s) for s in segs[1])
    staged: dict[int, Any] = {}
    for n in (1, 2):
        _threads(n)
        staged.pop(n, None)
        gc.collect()
        secs, runs, cpu = best(lambda n=n: staged.__setitem__(n, stage_delta(old, segs[1], base="b")), args.repeat)
        out[f"stage_{n}t"] = {"s": round(secs, 3), "runs": [round(x, 3) for x in runs],
                              "gb_per_s": round(model_bytes / secs / 1e9, 3),
                              "gb_per_cpu_s": round(model_bytes / cpu / 1e9, 3), "load": load()}  # fmt: skip
    upd = staged.pop(2)
    ref = staged.pop(1).changes()
    for name, arrays in upd.changes().items():
        assert all(np.array_equal(a, b) for a, b in zip(arrays, ref[name], strict=True)), name
    del ref
    out["staging_bytes_per_change"] = round(upd.host_bytes / upd.changed_elements, 3)
    out["staging_bytes"] = upd.host_bytes
    # the numpy baseline: the same positions (absolute int64, prepared) and values, one fancy-index store
    plain = {name: (old[name].bits.reshape(-1), pos, o, n) for name, (pos, o, n) in upd.changes().items()}

    def numpy_scatter() -> None:
        for flat, pos, _o, n in plain.values():
            flat[pos] = n

    def numpy_restore() -> None:
        for flat, pos, o, _n in plain.values():
            flat[pos] = o

    import torch  # the floor: torch's index_copy_ of the same changes, on 1 and 2 threads

    as_torch = {name: (torch.from_numpy(flat.view(np.int16)), torch.from_numpy(pos), torch.from_numpy(n.view(np.int16)))
                for name, (flat, pos, _o, n) in plain.items()}  # fmt: skip

    def index_copy() -> None:
        for flat, pos, n in as_torch.values():
            flat.index_copy_(0, pos, n)

    pauses: dict[str, list[float]] = {k: [] for k in ("numpy", "index_copy_1t", "index_copy_2t", "commit_1t", "commit_2t",
                                                      "rollback_2t")}  # fmt: skip
    commit_cpu: dict[str, list[float]] = {"commit_1t": [], "commit_2t": []}
    loads = []
    for rep in range(args.repeat):  # interleaved, so load swings hit every variant alike
        loads.append(load())
        t = time.perf_counter()
        numpy_scatter()
        pauses["numpy"].append(time.perf_counter() - t)
        numpy_restore()
        for n in (1, 2):
            torch.set_num_threads(n)
            t = time.perf_counter()
            index_copy()
            pauses[f"index_copy_{n}t"].append(time.perf_counter() - t)
            numpy_restore()
        for n in (1, 2):
            _threads(n)
            t, c = time.perf_counter(), time.process_time()
            upd.commit()
            pauses[f"commit_{n}t"].append(time.perf_counter() - t)
            commit_cpu[f"commit_{n}t"].append(time.process_time() - c)
            if rep == 0 and n == 1:
                assert all(np.array_equal(old[k].bits, new[k].bits) for k in old), "commit is not bit-exact"
            t = time.perf_counter()
            upd.rollback()
            if n == 2:
                pauses["rollback_2t"].append(time.perf_counter() - t)
    assert all(np.array_equal(old[k].bits, _state_bits(args, k)) for k in list(old)[:1]), "rollback is not exact"
    out["pause_s"] = {k: round(min(v), 4) for k, v in pauses.items()}
    out["pause_runs_s"] = {k: [round(x, 4) for x in v] for k, v in pauses.items()}
    out["pause_loads"] = loads
    out["commit_vs_numpy"] = {k: round(min(pauses[k]) / min(pauses["numpy"]), 3) for k in ("commit_1t", "commit_2t")}
    out["commit_vs_index_copy"] = {f"commit_{n}t": round(min(pauses[f"commit_{n}t"]) / min(pauses[f"index_copy_{n}t"]), 3)
                                   for n in (1, 2)}  # fmt: skip
    # core-seconds (process CPU time, every thread) per GB of model, the least of the runs
    out["core_s_per_gb"] = {**{k: round(min(v) / (model_bytes / 1e9), 4) for k, v in commit_cpu.items()},
                            **{f"{what}_{n}t": round(1 / out[f"{what}_{n}t"]["gb_per_cpu_s"], 4)
                               for what in ("encode", "stage") for n in (1, 2)}}  # fmt: skip
    out["ns_per_change"] = {k: round(min(v) / upd.changed_elements * 1e9, 2) for k, v in pauses.items()}
    out["peak_rss_copies"] = round(vm_hwm() / model_bytes, 3)
    return out


def _state_bits(args: argparse.Namespace, name: str) -> np.ndarray:
    i = list(shapes_for(args.elements, args.tensors)).index(name)
    return weights(shapes_for(args.elements, args.tensors)[name], 1 + i)


def phase_publish(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from deltarl.codec import BF16, encode_delta
    from deltarl.pipeline.publisher import Publisher
    from deltarl.pipeline.reader import RunReader
    from deltarl.storage import LocalStore

    _threads(os.cpu_count() or 1)
    tiny = {"w": BF16(weights((64, 2048), 0))}
    encode_delta(tiny, {"w": BF16(tiny["w"].bits ^ np.uint16(1))}, base="b")  # load the compiled kernels
    base_rss = vm_hwm()
    state = _state(args.publish_elements, args.tensors, 1)
    model_bytes = sum(v.bits.nbytes for v in state.values())

    def export(s: dict[str, Any]) -> dict[str, Any]:  # the trainer's fresh BF16 export, zero-copy
        return {n: torch.from_numpy(v.bits.view(np.int16)).view(torch.bfloat16) for n, v in s.items()}

    out: dict[str, Any] = {"elements": sum(v.bits.size for v in state.values()), "model_bytes": model_bytes,
                           "versions": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-pause-") as tmp, Publisher(
        LocalStore(tmp), "r", keyframe_interval=10_000, digest_interval=10_000
    ) as pub:
        t = time.perf_counter()
        pub.publish(export(state), 0, owned=True)
        out["version0_s"] = round(time.perf_counter() - t, 2)
        for key in list(LocalStore(tmp).list("r/keyframes/")):
            LocalStore(tmp).delete(key)  # not read again: give the disk back
        gc.collect()
        out["hwm_reset"] = reset_hwm()
        out["rss_after_v0_copies"] = round(vm_hwm() / model_bytes, 3)
        for v in range(1, args.deltas + 1):
            state, moved = _next(state, args.fraction, 10 + v)  # the previous export is the publisher's now
            before, cpu = load(), time.process_time()
            info = pub.publish(export(state), v, owned=True)
            cpu = time.process_time() - cpu
            out["versions"].append({
                "version": v, "changed": moved, "segments": len(info.segment_keys),
                "encoded_bytes": info.stats.encoded_bytes, "encode_s": round(info.encode_s, 3),
                "upload_s": round(info.upload_s, 3), "wall_s": round(info.wall_s, 3),
                "gb_per_s": round(model_bytes / info.wall_s / 1e9, 3),
                "gb_per_cpu_s": round(model_bytes / cpu / 1e9, 3),
                "wall_vs_max_encode_upload": round(info.wall_s / max(info.encode_s, info.upload_s), 3),
                "load_before": before, "load_after": load(),
            })  # fmt: skip
        assert RunReader(pub.store, "r").head().version == args.deltas
    out["peak_rss_copies_deltas"] = round(vm_hwm() / model_bytes, 3)
    out["peak_rss_copies_deltas_above_interpreter"] = round((vm_hwm() - base_rss) / model_bytes, 3)
    out["interpreter_rss_bytes"] = base_rss
    return out


def _child(phase: str, argv: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.pause", "--phase", phase, *argv]
    print(f"== {phase}: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{phase} phase failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(res: dict[str, Any]) -> None:
    c, p = res.get("commit"), res.get("publish")
    rows: list[tuple[str, str, str]] = []
    if c:
        rows += [
            ("state", f"{c['elements'] / 1e9:.2f}e9 BF16 in {c['tensors']} tensors, {c['changed'] / 1e6:.1f}M changed", ""),
            ("segments (1% delta)", f"{c['segments']} ({c['encoded_bytes'] / 2**20:.1f} MiB)", ">= 8"),
            ("encode 1 / 2 threads", f"{c['encode_1t']['gb_per_s']} / {c['encode_2t']['gb_per_s']} GB/s",
             f"{c['encode_1t']['gb_per_cpu_s']} / {c['encode_2t']['gb_per_cpu_s']} GB/cpu-s, load {c['encode_2t']['load']}"),
            ("stage 1 / 2 threads", f"{c['stage_1t']['gb_per_s']} / {c['stage_2t']['gb_per_s']} GB/s",
             f"{c['stage_1t']['gb_per_cpu_s']} / {c['stage_2t']['gb_per_cpu_s']} GB/cpu-s, load {c['stage_2t']['load']}"),
            ("staging bytes / change", str(c["staging_bytes_per_change"]), "<= 8"),
            ("numpy scatter", f"{c['pause_s']['numpy']:.3f} s ({c['ns_per_change']['numpy']} ns/change)", ""),
            ("torch index_copy_ 1t / 2t", f"{c['pause_s']['index_copy_1t']:.3f} / {c['pause_s']['index_copy_2t']:.3f} s", ""),
            ("commit pause 1t / 2t", f"{c['pause_s']['commit_1t']:.3f} / {c['pause_s']['commit_2t']:.3f} s",
             f"x{c['commit_vs_index_copy']['commit_1t']} / x{c['commit_vs_index_copy']['commit_2t']} index_copy_ (<= 1.3), "
             f"x{c['commit_vs_numpy']['commit_1t']} / x{c['commit_vs_numpy']['commit_2t']} numpy"),
            ("commit core-s / GB 1t / 2t", f"{c['core_s_per_gb']['commit_1t']} / {c['core_s_per_gb']['commit_2t']}",
             f"stage {c['core_s_per_gb']['stage_1t']} / {c['core_s_per_gb']['stage_2t']}"),
            ("rollback 2t", f"{c['pause_s']['rollback_2t']:.3f} s", f"loads {c['pause_loads']}"),
            ("commit phase peak RSS", f"{c['peak_rss_copies']} copies", "old + new + staging"),
        ]  # fmt: skip
    if p:
        for v in p["versions"]:
            rows.append((f"publish delta v{v['version']} ({p['elements'] / 1e9:.2f}e9)",
                         f"{v['gb_per_s']} GB/s ({v['gb_per_cpu_s']} GB/cpu-s), {v['segments']} segs, wall {v['wall_s']}s "
                         f"(enc {v['encode_s']} up {v['upload_s']})",
                         f"wall x{v['wall_vs_max_encode_upload']} (<= 1.25), load {v['load_after']}"))  # fmt: skip
        rows.append(("publish deltas peak RSS", f"{p['peak_rss_copies_deltas']} copies "
                     f"({p['peak_rss_copies_deltas_above_interpreter']} above the interpreter's own)", "<= 2.3"))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(x.ljust(w[i]) for i, x in enumerate(r)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["commit", "publish", "all"], default="all")
    ap.add_argument("--elements", type=int, default=QWEN3_1_7B_ELEMENTS)
    ap.add_argument("--publish-elements", type=int, default=QWEN3_1_7B_ELEMENTS // 2)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--deltas", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1/16 of the sizes (a smoke run)")
    ap.add_argument("--out", type=Path, default=None, help=f"where the JSON goes (default {RESULTS}; none for --quick)")
    args = ap.parse_args()
    if args.quick:
        args.elements //= 16
        args.publish_elements //= 16
    if args.phase == "commit":
        print(json.dumps(phase_commit(args)))
        return
    if args.phase == "publish":
        print(json.dumps(phase_publish(args)))
        return
    argv = [f"--elements={args.elements}", f"--publish-elements={args.publish_elements}", f"--tensors={args.tensors}",
            f"--fraction={args.fraction}", f"--deltas={args.deltas}", f"--repeat={args.repeat}"]  # fmt: skip
    res: dict[str, Any] = {"benchmark": "pause", "cpus": os.cpu_count(), "machine": platform.machine(),
                           "quick": args.quick, "load_start": load()}  # fmt: skip
    res["commit"] = _child("commit", argv)
    res["publish"] = _child("publish", argv)
    res["load_end"] = load()
    _table(res)
    out = args.out or (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
