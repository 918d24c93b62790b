"""FP8 serving benchmark: how sparse block-FP8 deltas are at RL learning rates, and what they cost.

Run: ``.venv/bin/python -m benchmarks.fp8 [--quick]`` (full size under
``flock /tmp/deltarl-heavy.lock``). On the project's Adam traces (benchmarks/_trace.py) - a dense
model with Qwen3-1.7B's tensor shapes (2 of 28 layers, 32768 of 151936 vocabulary rows) and one
Qwen3-30B-A3B MoE layer (16 of 128 experts, 3 of them touched per step) - at lr 1e-6 and 1e-5,
each step's BF16 export is quantized as ``Publisher(serve_as="fp8-block128")`` does
(deltarl/codec/fp8.py) and the step's FP8 delta is compared with its BF16 delta.

Per scenario (mean over the measured steps): the fraction of FP8 codes that changed, of blocks
whose scale changed, and of BF16 elements that changed; deltarl ``auto`` bytes of the FP8 delta
(split into codes, scales and the tensors kept in BF16) against the BF16 delta of the same step,
against the full FP8 state, and the peers' formats (benchmarks/_peers.py) on the same FP8 bits;
encode and apply (stage + commit) GB/s of the FP8 state and core-seconds per GB; quantization
core-seconds per GB of BF16. Every delta is checked bit-exact. Writes benchmarks/results/fp8.json.
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
import torch

from benchmarks._peers import PEERS, round_trip
from deltarl.codec import encode_delta, read_segment_header, stage_delta
from deltarl.codec.fp8 import quantize_state
from deltarl.codec.heap import trim
from deltarl.codec.kernels import worker_threads
from deltarl.codec.tensors import flat_bits

from ._trace import AdamTrace, moe_lr_scale, qwen3_like_shapes, qwen3_moe_shapes

LRS = [1e-6, 1e-5]
BASE = "0" * 64


def _shapes(quick: bool, moe: bool) -> list[tuple[str, tuple[int, ...]]]:
    if moe:
        return (qwen3_moe_shapes(layers=1, hidden=256, experts=8, moe_intermediate=128, heads=4, kv_heads=2,
                                 head_dim=64, vocab=1024) if quick else
                qwen3_moe_shapes(layers=1, hidden=2048, experts=16, moe_intermediate=768, heads=32, kv_heads=4,
                                 head_dim=128, vocab=4096))  # fmt: skip
    return (qwen3_like_shapes(layers=1, hidden=256, intermediate=768, heads=4, kv_heads=2, head_dim=64, vocab=1024)
            if quick else qwen3_like_shapes(layers=2, hidden=2048, intermediate=6144, heads=16, kv_heads=8,
                                            head_dim=128, vocab=32768))  # Qwen3-1.7B's shapes  # fmt: skip


def _torch(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.bits).view(torch.bfloat16) for k, v in state.items()}


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _bytes_by_kind(segs: list[bytes]) -> dict[str, int]:
    """Chunk payload bytes of codes, scales and BF16-kept tensors (headers: ``headers``)."""
    out = {"codes": 0, "scales": 0, "bf16": 0, "headers": 0}
    for s in segs:
        h = read_segment_header(s)
        payload = 0
        dtypes = {t.name: t.dtype for t in h.tensors}
        for c in h.chunks:
            kind = "codes" if dtypes[c.tensor] == "float8_e4m3fn" else "scales" if c.tensor.endswith("_scale_inv") else "bf16"
            out[kind] += c.nbytes
            payload += c.nbytes
        out["headers"] += len(s) - payload
    return out


def _bytes_of(segs: list[bytes], names: set[str]) -> int:
    """Chunk payload bytes of the tensors ``names``."""
    return sum(c.nbytes for s in segs for c in read_segment_header(s).chunks if c.tensor in names)


def _warm() -> None:
    """Load the 8-bit kernels before anything is timed (a first call compiles them)."""
    g = torch.Generator().manual_seed(0)
    a = {"l.q_proj.weight": (torch.randn(512, 512, generator=g) * 0.02).bfloat16()}
    for every in (4099, 97, 1):
        b = {k: v.clone() for k, v in a.items()}
        b["l.q_proj.weight"].view(-1)[::every] += 1e-3
        old8, new8 = quantize_state(a), quantize_state(b)
        stage_delta({k: v.clone() for k, v in old8.items()}, encode_delta(old8, new8, base=BASE), base=BASE).commit()


def _timed(fn: Any) -> tuple[float, float, Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def _step(old16: dict[str, torch.Tensor], new16: dict[str, torch.Tensor]) -> dict[str, Any]:
    q_s, q_cpu, old8 = _timed(lambda: quantize_state(old16))
    new8 = quantize_state(new16)
    fp8_bytes, bf16_model = _nbytes(old8), _nbytes(old16)
    codes = [k for k, v in old8.items() if v.dtype == torch.float8_e4m3fn]
    changed_codes = sum(int((old8[k].view(torch.uint8) != new8[k].view(torch.uint8)).sum()) for k in codes)
    n_codes = sum(old8[k].numel() for k in codes)
    scales = [k + "_scale_inv" for k in codes]
    changed_blocks = sum(int((old8[k].view(torch.int32) != new8[k].view(torch.int32)).sum()) for k in scales)
    n_blocks = sum(old8[k].numel() for k in scales)
    changed16 = sum(int((old16[k].view(torch.int16) != new16[k].view(torch.int16)).sum()) for k in old16)
    seg16 = encode_delta(old16, new16, base=BASE)
    enc_s, enc_cpu, seg8 = _timed(lambda: encode_delta(old8, new8, base=BASE))
    state = {k: v.clone() for k, v in old8.items()}
    app_s, app_cpu, _ = _timed(lambda: stage_delta(state, seg8, base=BASE).commit())
    if any(not torch.equal(state[k].view(torch.uint8), new8[k].view(torch.uint8)) for k in state):
        raise AssertionError("the FP8 delta does not apply bit-exact")
    bits_old = {k: flat_bits(k, v).copy() for k, v in old8.items()}
    bits_new = {k: flat_bits(k, v).copy() for k, v in new8.items()}
    peers = {p.name: len(round_trip(p, bits_old, bits_new)) for p in PEERS}
    b8, b16 = sum(map(len, seg8)), sum(map(len, seg16))
    q16 = _bytes_of(seg16, set(codes))  # the BF16 delta of the quantized tensors alone
    gb8, gb16 = fp8_bytes / 1e9, bf16_model / 1e9
    return {
        "codes_changed_fraction": changed_codes / n_codes, "blocks_scale_changed_fraction": changed_blocks / n_blocks,
        "bf16_changed_fraction": changed16 / sum(t.numel() for t in old16.values()),
        "fp8_delta_bytes": b8, "bf16_delta_bytes": b16, "fp8_vs_bf16_delta": b8 / b16,
        "fp8_delta_vs_full_fp8": b8 / fp8_bytes, "bf16_delta_bytes_quantized_tensors": q16,
        "fp8_codes_scales_vs_bf16_same_tensors": (_bytes_by_kind(seg8)["codes"] + _bytes_by_kind(seg8)["scales"]) / q16, "fp8_by_kind": _bytes_by_kind(seg8),
        "peers_bytes": peers, "peers_vs_deltarl": {k: v / b8 for k, v in peers.items()},
        "encode_GBps": gb8 / enc_s, "encode_core_s_per_GB": enc_cpu / gb8,
        "apply_GBps": gb8 / app_s, "apply_core_s_per_GB": app_cpu / gb8,
        "quantize_core_s_per_GB_bf16": q_cpu / gb16, "quantize_GBps_bf16": gb16 / q_s,
        "full_fp8_bytes": fp8_bytes, "full_bf16_bytes": bf16_model,
    }  # fmt: skip


def _mean(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in rows[0].items():
        if isinstance(v, dict):
            out[key] = _mean([r[key] for r in rows])
        else:
            out[key] = float(np.mean([r[key] for r in rows]))
    return out


def scenario(quick: bool, moe: bool, lr: float, seed: int, steps: int) -> dict[str, Any]:
    tr = AdamTrace(_shapes(quick, moe), seed=seed, lr=lr)
    tr.run(1 if quick else 4)  # past Adam's dense first step
    scale = moe_lr_scale(list(tr.w), seed=seed, hot=1, warm=2) if moe else None
    rows = []
    for _ in range(steps):
        old = _torch(tr.export())
        direction = tr.direction()
        new = _torch(tr.export(direction, lr, scale))
        for name, d in direction.items():
            tr.w[name] -= np.float32(lr * (1.0 if scale is None else scale[name])) * d
        rows.append(_step(old, new))
        del old, new, direction
        trim()
    return {"model": "moe" if moe else "dense", "lr": lr, "steps": steps, "params": tr.numel, **_mean(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models, one step each (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="measured steps per scenario (mean)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fp8.json"))
    args = ap.parse_args(argv)
    steps = args.steps or (1 if args.quick else 3)
    _warm()
    t0 = time.perf_counter()
    sc: dict[str, Any] = {}
    for moe in (False, True):
        for lr in LRS:
            name = f"{'moe' if moe else 'dense'} lr {lr:g}"
            sc[name] = scenario(args.quick, moe, lr, args.seed, steps)
            print(f"  {name}: done at {time.perf_counter() - t0:.0f}s", flush=True)
    _print(sc)
    result = {
        "command": " ".join(["python", "-m", "benchmarks.fp8", *(sys.argv[1:] if argv is None else argv)]),
        "threads": worker_threads(), "wall_s": round(time.perf_counter() - t0, 1),
        "load_average_at_end": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "processor": platform.processor()},
        "target_fp8_vs_bf16_delta": 0.5, "scenarios": sc,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _print(sc: dict[str, Any]) -> None:
    head = (f"{'scenario':18} {'codes chg':>9} {'blocks':>7} {'bf16 chg':>8} {'FP8 B':>10} {'vs BF16Δ':>8} "
            f"{'vs FP8':>7} {'codes/scales/bf16 B':>22} {'enc GB/s':>8} {'app GB/s':>8} {'enc cs/GB':>9} {'app cs/GB':>9}")  # fmt: skip
    print(head)
    for name, s in sc.items():
        k = s["fp8_by_kind"]
        print(f"{name:18} {s['codes_changed_fraction']:9.4%} {s['blocks_scale_changed_fraction']:7.2%} "
              f"{s['bf16_changed_fraction']:8.3%} {s['fp8_delta_bytes']:10.0f} {s['fp8_vs_bf16_delta']:8.3f} "
              f"{s['fp8_delta_vs_full_fp8']:7.4f} {k['codes']:8.0f}/{k['scales']:6.0f}/{k['bf16']:6.0f} "
              f"{s['encode_GBps']:8.2f} {s['apply_GBps']:8.2f} {s['encode_core_s_per_GB']:9.2f} "
              f"{s['apply_core_s_per_GB']:9.2f}")  # fmt: skip
    print("codes+scales bytes / the BF16 delta of the same (quantized) tensors:")
    for name, s in sc.items():
        print(f"  {name:18} {s['fp8_codes_scales_vs_bf16_same_tensors']:.3f}")
    print("peers on the FP8 bytes (x deltarl auto):")
    for name, s in sc.items():
        print(f"  {name:18} " + "  ".join(f"{p} {r:.2f}x" for p, r in s["peers_vs_deltarl"].items()))


if __name__ == "__main__":
    raise SystemExit(main())
