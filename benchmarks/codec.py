"""Codec benchmark: deltarl's codecs and the peers' formats side by side, same trace, same run.

Run: ``.venv/bin/python -m benchmarks.codec [--quick]``. Builds a scaled Qwen3-like model and a
Qwen3-MoE layer with Qwen3-30B-A3B's tensor shapes and 16 experts (benchmarks/_trace.py), warms Adam up, then takes one step's BF16 delta at
the step sizes that change 0.01%, 0.02%, 0.05%, 0.1%, 1%, 5% and 10% of the elements (dense model),
and on the MoE model one step with MoE sparsity (a few hot experts, attention and router dense,
most experts nothing) at 0.02% and 0.1% overall, and a uniform 1% step on the same tensors.

Every format runs on every delta: deltarl ``auto`` and each of its codecs (segments, stage,
commit), and the peers' formats (``benchmarks/_peers.py``: AuroraRL, verl/TRL, slime, NeMo-RL,
each written from its published description). Every one is checked bit-exact. Columns: bytes per
changed element, encode GB/s (of BF16 model), decode+stage and decode+apply ns per change (deltarl:
stage, then stage + commit; a peer: decode and write), peak extra memory in model copies (RSS high
water over the encode and over the apply), and core-seconds per GB of model (encode, apply). Prints
the table and the issue-22 targets; writes benchmarks/results/codec.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._format1 import format1_bytes
from benchmarks._peers import PEERS, round_trip
from benchmarks._scale_state import reset_peak, rss_bytes
from deltarl.codec import BF16, delta_stats, encode_delta, stage_delta, state_digest
from deltarl.codec.heap import trim
from deltarl.codec.kernels import worker_threads

from ._trace import AdamTrace, moe_lr_scale, qwen3_like_shapes, qwen3_moe_shapes

CODECS = ["auto", "sparse", "ctx", "rice", "dense", "aurora"]
DENSITIES = [1e-4, 2e-4, 5e-4, 1e-3, 1e-2, 5e-2, 1e-1]
MOE_DENSITIES = [2e-4, 1e-3]
QUICK_DENSITIES = [2e-4, 1e-2]  # --quick: the two the stage-time target compares


def _timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """Best wall seconds, best process CPU seconds (all threads), and the last result."""
    wall = cpu = float("inf")
    out = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu, out


def _peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Extra resident bytes at the high water mark while ``fn`` runs (Linux VmHWM), and its result."""
    trim()
    before = rss_bytes("VmRSS")
    reset_peak()
    out = fn()
    return max(0, rss_bytes("VmHWM") - before), out


def _row(nbytes: int, changed: int, model: int, enc: tuple[float, float], dec: tuple[float, float],
         peak: int, stage: float | None = None) -> dict[str, Any]:  # fmt: skip
    gb = model / 1e9
    row = {
        "bytes": nbytes,
        "bytes_per_change": nbytes / max(changed, 1),
        "vs_full_bf16": nbytes / model,
        "encode_GBps": gb / enc[0],
        "apply_ns_per_change": dec[0] / max(changed, 1) * 1e9,
        "peak_extra_copies": peak / model,
        "encode_core_s_per_GB": enc[1] / gb,
        "apply_core_s_per_GB": dec[1] / gb,
    }
    if stage is not None:
        row["stage_ns_per_change"] = stage / max(changed, 1) * 1e9
        row["stage_s"] = stage
    return row


def measure(old: dict[str, BF16], new: dict[str, BF16], repeat: int) -> dict[str, Any]:
    """Every format on the delta old -> new (each checked bit-exact)."""
    model = sum(v.bits.nbytes for v in old.values())
    want = state_digest(new)
    rows: dict[str, Any] = {}
    changed = 0
    for codec in CODECS:
        enc_peak, segs = _peak(lambda c=codec: encode_delta(old, new, base="bench", codec=c))
        enc = _timed(lambda c=codec: encode_delta(old, new, base="bench", codec=c), repeat)[:2]
        stats = delta_stats(segs)
        changed = stats.changed_elements
        work = {k: BF16(v.bits.copy()) for k, v in old.items()}
        stage_s, apply_s, apply_cpu, dec_peak = float("inf"), float("inf"), float("inf"), 0
        for _ in range(repeat):
            trim()
            before = rss_bytes("VmRSS")
            reset_peak()
            t0, c0 = time.perf_counter(), time.process_time()
            upd = stage_delta(work, segs, base="bench")
            t1 = time.perf_counter()
            upd.commit()
            t2, c2 = time.perf_counter(), time.process_time()
            dec_peak = max(dec_peak, rss_bytes("VmHWM") - before)
            stage_s, apply_s, apply_cpu = min(stage_s, t1 - t0), min(apply_s, t2 - t0), min(apply_cpu, c2 - c0)
            if state_digest(work) != want:
                raise AssertionError(f"codec {codec}: decoded state differs from the target")
            upd.rollback()
        rows[f"deltarl {codec}"] = _row(stats.encoded_bytes, changed, model, enc, (apply_s, apply_cpu),
                                        max(enc_peak, dec_peak), stage_s)  # fmt: skip
        rows[f"deltarl {codec}"]["codecs_used"] = _codecs_used(segs)
        del segs, work
    flat = encode_delta(old, new, base="bench", cells=False)  # format 2 without cells, and format 1's bytes
    rows["deltarl auto"]["bytes_no_cells"] = sum(len(s) for s in flat)
    rows["deltarl auto"]["bytes_format1"] = format1_bytes(flat)
    del flat
    o = {k: v.bits.reshape(-1) for k, v in old.items()}
    n = {k: v.bits.reshape(-1) for k, v in new.items()}
    for peer in PEERS:
        blob = round_trip(peer, o, n)  # checked bit-exact here
        enc_peak, _ = _peak(lambda p=peer: p.encode(o, n))
        enc = _timed(lambda p=peer: p.encode(o, n), repeat)[:2]
        work_np = {k: v.copy() for k, v in o.items()}
        dec_peak, _ = _peak(lambda p=peer, b=blob, w=work_np: p.apply(w, b))
        dec = _timed(lambda p=peer, b=blob, w=work_np: p.apply(w, b), repeat)[:2]
        rows[peer.name] = _row(len(blob), changed, model, enc, dec, max(enc_peak, dec_peak))
        del blob, work_np
    return {"changed_fraction": changed / max(sum(v.bits.size for v in old.values()), 1), "changed": changed,
            "elements": sum(v.bits.size for v in old.values()), "formats": rows}  # fmt: skip


def _codecs_used(segs: list[bytes]) -> dict[str, int]:
    from deltarl.codec import read_segment_header

    out: dict[str, int] = {}
    for s in segs:
        for c in read_segment_header(s).chunks:
            out[c.codec] = out.get(c.codec, 0) + 1
    return out


def _trace(quick: bool, moe: bool, seed: int) -> AdamTrace:
    if moe:
        shapes = (qwen3_moe_shapes(layers=1, hidden=256, experts=16, moe_intermediate=128, heads=4, kv_heads=2,
                                   head_dim=64, vocab=1024) if quick else
                  qwen3_moe_shapes(layers=1, hidden=2048, experts=16, moe_intermediate=768, heads=32, kv_heads=4,
                                   head_dim=128, vocab=4096))  # Qwen3-30B-A3B's tensor shapes, 16 of 128 experts  # fmt: skip
    else:
        shapes = (qwen3_like_shapes(layers=1, hidden=256, intermediate=768, heads=4, kv_heads=2, head_dim=64,
                                    vocab=4096) if quick else qwen3_like_shapes(layers=4, vocab=32768))  # fmt: skip
    return AdamTrace(shapes, seed=seed, lr=1e-6)


def _warm() -> None:
    """Load every codec's numba kernels before anything is timed (a first call loads them)."""
    rng = np.random.default_rng(0)
    old = {"w": BF16(rng.integers(0, 1 << 15, 1 << 16, dtype=np.uint16))}
    for every in (3001, 97, 1):
        new = {"w": BF16(old["w"].bits.copy())}
        new["w"].bits[::every] += np.uint16(1)
        for codec in CODECS:
            stage_delta(old, encode_delta(old, new, base="w", codec=codec), base="w")


def scenarios(quick: bool, seed: int, repeat: int) -> tuple[dict[str, Any], dict[str, Any]]:
    _warm()
    out: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for moe in (False, True):
        tr = _trace(quick, moe, seed)
        tr.run(1 if quick else 8)  # past Adam's dense first step: the steady state
        base = tr.export()
        direction = tr.direction()
        kind = "moe" if moe else "dense"
        models[kind] = {"tensors": len(tr.w), "params": tr.numel, "bf16_bytes": tr.numel * 2}
        plan: list[tuple[str, float, dict[str, float] | None]] = []
        if moe:
            scale = moe_lr_scale(list(tr.w), seed=seed, hot=1, warm=2)  # 3 of 16 experts (30B-A3B: ~12 of 128)
            plan += [(f"moe {d:.2%}", d, scale) for d in (MOE_DENSITIES[:1] if quick else MOE_DENSITIES)]
            plan.append(("moe uniform 1.00%", 1e-2, None))
        else:
            plan += [(f"dense {d:.2%}", d, None) for d in (QUICK_DENSITIES if quick else DENSITIES)]
        for name, density, sc in plan:
            lr = tr.lr_for_density(direction, density, sc)
            new = tr.export(direction, lr, sc)
            t = time.perf_counter()
            out[name] = {"model": kind, "target_density": density, "lr": lr, **measure(base, new, repeat)}
            print(f"  {name}: {out[name]['changed_fraction']:.4%} changed, {time.perf_counter() - t:.1f}s", flush=True)
            del new
        del tr, base, direction
        trim()
    return out, models


def targets(sc: dict[str, Any]) -> dict[str, Any]:
    """The issue-22 targets from the scenarios: stage-time ratios and bytes against the best peer."""
    peers = [p.name for p in PEERS]
    out: dict[str, Any] = {"bytes_vs_best_peer": {}}
    for name, s in sc.items():
        f = s["formats"]
        best = min(peers, key=lambda p: f[p]["bytes_per_change"])
        out["bytes_vs_best_peer"][name] = {"auto": f["deltarl auto"]["bytes_per_change"], "best_peer": best,
                                           "best_peer_bytes": f[best]["bytes_per_change"],
                                           "ratio": f["deltarl auto"]["bytes_per_change"] / f[best]["bytes_per_change"]}  # fmt: skip

    def stage(name: str) -> float:
        return float(sc[name]["formats"]["deltarl auto"]["stage_s"])

    out["bytes_vs_format1"] = {name: s["formats"]["deltarl auto"]["bytes"] / s["formats"]["deltarl auto"]["bytes_format1"]
                               for name, s in sc.items()}  # fmt: skip
    out["stage_ratio_dense_0.02_vs_1"] = stage("dense 0.02%") / stage("dense 1.00%")
    out["stage_ratio_moe_0.02_vs_uniform_1"] = stage("moe 0.02%") / stage("moe uniform 1.00%")
    enc = {k: sc[k]["formats"]["deltarl auto"]["encode_GBps"] for k in ("dense 0.02%", "dense 5.00%") if k in sc}
    out["encode_GBps_auto"] = enc
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models, one repetition (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=None, help="timing repetitions (best of)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "codec.json"))
    args = ap.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    t0 = time.perf_counter()
    sc, models = scenarios(args.quick, args.seed, repeat)
    tg = targets(sc)
    _print(sc, tg)
    result = {
        "models": models,
        "command": " ".join(["python", "-m", "benchmarks.codec", *(sys.argv[1:] if argv is None else argv)]),
        "threads": worker_threads(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_average_at_end": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "processor": platform.processor()},
        "targets": tg,
        "scenarios": sc,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _print(sc: dict[str, Any], tg: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="delta formats, one trace, one run")
    cols = ("scenario", "changed", "format", "B/change", "enc GB/s", "stage ns/chg", "apply ns/chg",
            "peak copies", "enc core-s/GB", "apply core-s/GB")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for name, s in sc.items():
        for i, (fmt, row) in enumerate(s["formats"].items()):
            table.add_row(
                name if i == 0 else "",
                f"{s['changed_fraction']:.4%}" if i == 0 else "",
                fmt,
                f"{row['bytes_per_change']:.3f}",
                f"{row['encode_GBps']:.2f}",
                f"{row['stage_ns_per_change']:.0f}" if "stage_ns_per_change" in row else "-",
                f"{row['apply_ns_per_change']:.0f}",
                f"{row['peak_extra_copies']:.2f}",
                f"{row['encode_core_s_per_GB']:.2f}",
                f"{row['apply_core_s_per_GB']:.2f}",
            )
        table.add_section()
    Console(width=200).print(table)
    for name, s in sc.items():
        auto = s["formats"]["deltarl auto"]
        print(f"{name}: deltarl auto {auto['bytes']:,} B in format 2 (shard-grid cells), {auto['bytes_no_cells']:,} B "
              f"without cells, {auto['bytes_format1']:,} B in format 1: {tg['bytes_vs_format1'][name]:.3f}x format 1")  # fmt: skip
    worst = max(v["ratio"] for v in tg["bytes_vs_best_peer"].values())
    print(f"targets: stage(0.02%)/stage(1%) dense {tg['stage_ratio_dense_0.02_vs_1']:.3f}, MoE "
          f"{tg['stage_ratio_moe_0.02_vs_uniform_1']:.3f} (<= 0.10); auto bytes vs best peer, worst "
          f"{worst:.2f} (<= 0.85); auto encode GB/s {tg['encode_GBps_auto']}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
