"""Codec benchmark: size and speed of every delta codec on a realistic Adam/BF16 trace.

Run: ``.venv/bin/python -m benchmarks.codec [--quick]``. Builds a scaled Qwen3-like layer set
(benchmarks/_trace.py), warms Adam up, then measures one step's BF16 delta at lr 1e-6 / 3e-6 /
1e-5 (steady state) and Adam's dense first step, and prints side by side: changed fraction, bytes
per changed element and total bytes vs full BF16 for naive COO (int32 index + bf16 value),
``aurora`` and each of our codecs, detect+encode and stage+commit speed in GB/s of BF16 model,
and a plain buffer copy for reference. Every decode is checked bit-exact. Writes
benchmarks/results/codec.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from deltarl.codec import BF16, delta_stats, encode_delta, stage_delta, state_digest
from deltarl.codec.kernels import worker_threads

from ._trace import AdamTrace, qwen3_like_shapes

CODECS = ["aurora", "rice", "ctx", "dense", "auto"]


def _best(fn: Any, repeat: int) -> float:
    return _timed(fn, repeat)[0]


def _timed(fn: Any, repeat: int) -> tuple[float, float]:
    """Best wall-clock seconds and best process CPU seconds (all threads) over ``repeat`` runs."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu


def _copy_speed(state: dict[str, BF16], repeat: int) -> float:
    src = [v.bits for v in state.values()]
    dst = [np.empty_like(b) for b in src]

    def run() -> None:
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)

    nbytes = sum(b.nbytes for b in src)
    return nbytes / _best(run, repeat) / 1e9


def measure(old: dict[str, BF16], new: dict[str, BF16], codecs: list[str], repeat: int) -> dict[str, Any]:
    """Sizes and speeds of every codec for the delta old -> new (bit-exactness checked)."""
    model_bytes = sum(v.bits.nbytes for v in old.values())
    want = state_digest(new)
    rows: dict[str, Any] = {}
    changed = total = 0
    for codec in codecs:
        segs = encode_delta(old, new, base="bench", codec=codec)  # warm-up (numba load) + result
        enc, enc_cpu = _timed(lambda c=codec: encode_delta(old, new, base="bench", codec=c), repeat)
        stats = delta_stats(segs)
        changed, total = stats.changed_elements, stats.total_elements
        work = {k: BF16(v.bits.copy()) for k, v in old.items()}
        times, cpus = [], []
        for _ in range(repeat + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            upd = stage_delta(work, segs, base="bench")
            upd.commit()
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            if state_digest(work) != want:
                raise AssertionError(f"codec {codec}: decoded state differs from the target")
            upd.rollback()
        rows[codec] = {
            "bytes": stats.encoded_bytes,
            "bytes_per_changed": stats.encoded_bytes / max(changed, 1),
            "vs_full_bf16": stats.encoded_bytes / model_bytes,
            "encode_GBps": model_bytes / enc / 1e9,
            "decode_apply_GBps": model_bytes / min(times[1:]) / 1e9,
            "encode_GB_per_cpu_s": model_bytes / enc_cpu / 1e9,
            "decode_apply_GB_per_cpu_s": model_bytes / min(cpus[1:]) / 1e9,
            "segments": len(segs),
        }
    coo = changed * 6
    rows = {"coo": {"bytes": coo, "bytes_per_changed": 6.0, "vs_full_bf16": coo / model_bytes}, **rows}
    return {
        "changed_fraction": changed / max(total, 1),
        "changed": changed,
        "elements": total,
        "codecs": rows,
    }


def build(quick: bool, seed: int) -> tuple[AdamTrace, int]:
    if quick:
        shapes = qwen3_like_shapes(
            layers=1, hidden=512, intermediate=1536, heads=8, kv_heads=4, head_dim=64, vocab=8192
        )
        return AdamTrace(shapes, seed=seed, lr=1e-6), 4
    return AdamTrace(qwen3_like_shapes(layers=4, vocab=32768), seed=seed, lr=1e-6), 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, one repetition (well under a minute)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=None, help="timing repetitions (best of)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "codec.json"))
    ap.add_argument(
        "--no-numpy-path", action="store_true", help="skip the pure-numpy (DELTARL_NO_NUMBA=1) rows"
    )
    args = ap.parse_args(argv)
    repeat = args.repeat or (2 if args.quick else 5)

    tr, warmup = build(args.quick, args.seed)
    model_bytes = tr.numel * 2
    print(f"model: {len(tr.w)} tensors, {tr.numel / 1e6:.1f} M params, {model_bytes / 1e6:.0f} MB bf16")
    scenarios: dict[str, Any] = {}
    init = tr.export()
    first = tr.direction()
    scenarios["first step lr=1e-6"] = measure(init, tr.export(first, 1e-6), CODECS, repeat)
    for name, upd in first.items():
        tr.w[name] -= np.float32(1e-6) * upd
    tr.run(warmup - 1)
    base = tr.export()
    direction = tr.direction()
    for lr in (1e-6, 3e-6, 1e-5):
        scenarios[f"steady lr={lr:g}"] = measure(base, tr.export(direction, lr), CODECS, repeat)
    if not args.no_numpy_path:
        prev = os.environ.get("DELTARL_NO_NUMBA")
        os.environ["DELTARL_NO_NUMBA"] = "1"
        try:
            scenarios["steady lr=1e-06, numpy path"] = measure(base, tr.export(direction, 1e-6), ["ctx"], 1)
        finally:
            if prev is None:
                del os.environ["DELTARL_NO_NUMBA"]
            else:
                os.environ["DELTARL_NO_NUMBA"] = prev
    copy = _copy_speed(base, repeat)

    _print(scenarios, copy)
    main_row = scenarios["steady lr=1e-06"]["codecs"]["auto"]
    print(
        f"targets at lr 1e-6 steady state, codec auto: {main_row['bytes_per_changed']:.3f} B/changed "
        f"(<= 1.3, aim <= 1.0); encode {main_row['encode_GBps']:.2f} GB/s (>= 1.5); "
        f"decode+apply {main_row['decode_apply_GBps']:.2f} GB/s (>= 2); load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    result = {
        "model": {
            "tensors": len(tr.w),
            "params": tr.numel,
            "bf16_bytes": model_bytes,
            "warmup_steps": warmup,
        },
        "buffer_copy_GBps": copy,
        "numba": os.environ.get("DELTARL_NO_NUMBA", "") in ("", "0"),
        "command": " ".join(["python", "-m", "benchmarks.codec", *sys.argv[1:]]),
        "threads": worker_threads(),
        "load_average_at_end": os.getloadavg(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "processor": platform.processor(),
        },
        "scenarios": scenarios,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _print(scenarios: dict[str, Any], copy: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"delta codecs (buffer copy {copy:.2f} GB/s)")
    cols = ("scenario", "changed", "codec", "B/changed", "total vs bf16", "enc GB/s", "dec+apply GB/s")
    for col in (*cols, "enc GB/cpu-s", "dec+apply GB/cpu-s"):
        table.add_column(col, justify="right")
    for name, sc in scenarios.items():
        for i, (codec, row) in enumerate(sc["codecs"].items()):
            table.add_row(
                name if i == 0 else "",
                f"{sc['changed_fraction'] * 100:.2f}%" if i == 0 else "",
                codec,
                f"{row['bytes_per_changed']:.3f}",
                f"{row['vs_full_bf16'] * 100:.3f}%",
                f"{row['encode_GBps']:.2f}" if "encode_GBps" in row else "-",
                f"{row['decode_apply_GBps']:.2f}" if "decode_apply_GBps" in row else "-",
                f"{row['encode_GB_per_cpu_s']:.2f}" if "encode_GBps" in row else "-",
                f"{row['decode_apply_GB_per_cpu_s']:.2f}" if "decode_apply_GBps" in row else "-",
            )
        table.add_section()
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(main())
