"""``benchmarks.scale --model 30b-a3b``: Qwen3-30B-A3B layers at full size, one at a time.

A layer of Qwen3-30B-A3B (HF ``Qwen3MoeConfig`` for ``Qwen/Qwen3-30B-A3B``: hidden 2048, 128
experts with moe_intermediate 768, 32 q / 4 kv heads of head_dim 128, router ``mlp.gate``; 48
layers, vocab 151936, untied) is ~623M BF16 elements (1.25 GB); a whole model does not fit this
box's share, so ``--layers`` layers are built and measured one after another (each: the base, one
delta in flight, the staged update: ~2.3 copies of a layer), and the whole model and Qwen3-235B-A22B
are extrapolated from the per-layer figures (on paper, printed as such).

Per layer, on the same base: one MoE step at 0.02% of the layer's elements (per step 4 hot experts
take the full step, 8 warm ones a tenth, the other 116 nothing; attention, router and norms the
full step; changed with probability ~ lr / ulp(w) as in ``_scale_state``, by +-1 ulp, 10% by 2),
and a uniform step at 1%. For each: encode (``encode_delta``, codec auto) GB/s of the layer, bytes
per change, ``stage_delta`` and ``commit`` seconds, peak RSS over the layer's BF16 size, and the
stage-time ratio 0.02% / 1% (issue 22: <= 0.10).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._scale_state import _exponent, _to_bf16_bits, reset_peak, rss_bytes
from benchmarks._trace import moe_lr_scale

HIDDEN, EXPERTS, MOE_INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 2048, 128, 768, 32, 4, 128, 48
VOCAB = 151936
# Qwen3-235B-A22B: hidden 4096, 128 experts of 1536, 94 layers, 64 q / 4 kv heads of 128, vocab 151936.
BIG = {"hidden": 4096, "experts": 128, "moe_inter": 1536, "heads": 64, "kv_heads": 4, "head_dim": 128,
       "layers": 94}  # fmt: skip


def layer_shapes(i: int, hidden: int = HIDDEN, experts: int = EXPERTS, moe_inter: int = MOE_INTER,
                 heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> dict[str, tuple[int, ...]]:  # fmt: skip
    p = f"model.layers.{i}."
    out: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        p + "self_attn.q_norm.weight": (head_dim,),
        p + "self_attn.k_norm.weight": (head_dim,),
        p + "mlp.gate.weight": (experts, hidden),
    }
    for e in range(experts):
        q = f"{p}mlp.experts.{e}."
        out |= {q + "gate_proj.weight": (moe_inter, hidden), q + "up_proj.weight": (moe_inter, hidden),
                q + "down_proj.weight": (hidden, moe_inter)}  # fmt: skip
    return dict(sorted(out.items()))


def _numel(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(int(np.prod(s)) for s in shapes.values())


def build_layer(i: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """BF16 bits of one layer: N(0, 0.02) (norms 1 + N(0, 0.02)), varied in the low mantissa bits."""
    pool = _to_bf16_bits(rng.standard_normal(1 << 24, dtype=np.float32) * np.float32(0.02))
    norm_pool = _to_bf16_bits(rng.standard_normal(1 << 16, dtype=np.float32) * np.float32(0.02) + np.float32(1))
    out = {}
    for name, shape in layer_shapes(i).items():
        n = int(np.prod(shape))
        src = norm_pool if name.endswith("norm.weight") else pool
        s0 = int(rng.integers(src.size - n + 1)) if n <= src.size else 0
        out[name] = (np.resize(src[s0:], n) ^ rng.integers(0, 4, n, dtype=np.uint16)).reshape(shape)
    return out


def step(base: dict[str, np.ndarray], density: float, scale: dict[str, float] | None, rng: np.random.Generator
         ) -> dict[str, tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """One step's changes ``{name: (flat positions, new bits)}``: element ``i`` of a tensor with
    scale ``s`` moves with probability ``min(1, c * s / ulp(w_i))``, ``c`` set so that ``density`` of
    the layer's elements change; by +-1 ulp (10% by 2), sign kept."""
    ulp_w = np.ldexp(1.0, np.arange(256) - 127 - 7)
    weight = {n: (1.0 if scale is None else scale[n]) for n in base}
    hist = {n: np.bincount(_exponent(b.reshape(-1)), minlength=256) for n, b in base.items() if weight[n]}
    total = sum(b.size for b in base.values())

    def expected(c: float) -> float:
        return sum(float((np.minimum(1.0, c * weight[n] / ulp_w) * h).sum()) for n, h in hist.items()) / total

    lo, hi = 1e-12, 1.0
    for _ in range(60):
        mid = float(np.sqrt(lo * hi))
        lo, hi = (mid, hi) if expected(mid) < density else (lo, mid)
    c = float(np.sqrt(lo * hi))
    out = {}
    for name, bits in base.items():
        if not weight[name]:
            continue
        flat = bits.reshape(-1)
        p = np.minimum(1.0, c * weight[name] / ulp_w).astype(np.float32)
        hit = np.flatnonzero(rng.random(flat.size, dtype=np.float32) < p[_exponent(flat)])
        if not hit.size:
            continue
        mv = np.where(rng.random(hit.size, dtype=np.float32) < 0.1, 2, 1) * np.where(hit & 1, 1, -1)
        old = flat[hit]
        mag = np.clip((old & 0x7FFF).astype(np.int32) + mv, 1, 0x7F7F).astype(np.uint16)
        out[name] = (hit, (old & 0x8000) | mag)
    return out


def measure(base: dict[str, np.ndarray], changes: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    from deltarl.codec import BF16, encode_delta, stage_delta
    from deltarl.codec.heap import trim

    layer_bytes = sum(b.nbytes for b in base.values())
    old = {n: BF16(b) for n, b in base.items()}
    new_bits = {}
    for n, b in base.items():
        if n in changes:
            nb = b.copy().reshape(-1)
            nb[changes[n][0]] = changes[n][1]
            new_bits[n] = nb.reshape(b.shape)
        else:
            new_bits[n] = b  # untouched: the same array (the encoder still compares it)
    new = {n: BF16(b) for n, b in new_bits.items()}
    changed = sum(int(p.size) for p, _ in changes.values())
    trim()
    rss0 = rss_bytes("VmRSS")
    reset_peak()
    t, c = time.perf_counter(), time.process_time()
    segs = encode_delta(old, new, base="layer")
    enc_s, enc_cpu = time.perf_counter() - t, time.process_time() - c
    nbytes = sum(len(s) for s in segs)
    stage_s = commit_s = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        upd = stage_delta(old, segs, base="layer")
        stage_s = min(stage_s, time.perf_counter() - t)
        t = time.perf_counter()
        upd.commit()
        commit_s = min(commit_s, time.perf_counter() - t)
        exact = all(np.array_equal(base[n], new_bits[n]) for n in changes)
        upd.rollback()
        if not exact:
            raise AssertionError("the staged layer differs from the target")
    peak = rss_bytes("VmHWM") - rss0
    del segs, upd
    return {"changed": changed, "density": changed / sum(b.size for b in base.values()), "bytes": nbytes,
            "bytes_per_change": nbytes / max(changed, 1), "encode_s": round(enc_s, 3),
            "encode_GBps": round(layer_bytes / enc_s / 1e9, 3), "encode_core_s_per_GB": round(enc_cpu / (layer_bytes / 1e9), 3),
            "stage_s": round(stage_s, 4), "commit_s": round(commit_s, 4),
            "stage_ns_per_change": round(stage_s / max(changed, 1) * 1e9, 1),
            "peak_extra_layer_copies": round(peak / layer_bytes, 2)}  # fmt: skip


def run(layers: int, out_dir: Path) -> dict[str, Any]:
    from deltarl.codec.jit_warmup import warm_codec

    warm_codec(["bfloat16"])  # numba loads its kernels before anything is timed
    shapes = layer_shapes(0)
    per_layer = _numel(shapes)
    print(f"Qwen3-30B-A3B layer: {per_layer / 1e6:.0f}M BF16 elements ({per_layer * 2 / 1e9:.2f} GB); "
          f"measuring {layers} of {LAYERS} layers, one at a time", flush=True)  # fmt: skip
    rng = np.random.default_rng(0)
    rows = []
    for i in range(layers):
        base = build_layer(i, rng)
        scale = moe_lr_scale(list(base), seed=i, hot=4, warm=8)
        row: dict[str, Any] = {"layer": i}
        for key, density, sc in (("moe_0.02%", 2e-4, scale), ("uniform_1%", 1e-2, None)):
            row[key] = measure(base, step(base, density, sc, rng))
            print(f"  layer {i} {key}: {json.dumps(row[key])}", flush=True)
        row["stage_ratio"] = round(row["moe_0.02%"]["stage_s"] / row["uniform_1%"]["stage_s"], 4)
        rows.append(row)
        del base
    big = BIG
    big_layer = (2 * big["hidden"] + 2 * big["head_dim"] + big["heads"] * big["head_dim"] * big["hidden"] * 2
                 + 2 * big["kv_heads"] * big["head_dim"] * big["hidden"] + big["experts"] * big["hidden"]
                 + big["experts"] * 3 * big["moe_inter"] * big["hidden"])  # fmt: skip
    mean = {k: {f: float(np.mean([r[k][f] for r in rows])) for f in ("stage_s", "commit_s", "bytes", "encode_s")}
            for k in ("moe_0.02%", "uniform_1%")}  # fmt: skip
    paper = {}
    for name, layer_elems, nl in (("30b-a3b", per_layer, LAYERS), ("235b-a22b", big_layer, big["layers"])):
        f = layer_elems / per_layer * nl  # per-element costs scale with the layer's elements
        paper[name] = {"layers": nl, "layer_elements": layer_elems,
                       **{k: {"stage_s": round(v["stage_s"] * f, 2), "encode_s": round(v["encode_s"] * f, 1),
                              "bytes_GB": round(v["bytes"] * f / 1e9, 3)} for k, v in mean.items()}}  # fmt: skip
    result = {"model": "30b-a3b", "layer_elements": per_layer, "layers_measured": layers, "layers": rows,
              "on_paper_from_per_layer_figures": paper,
              "stage_ratio_worst": max(r["stage_ratio"] for r in rows)}  # fmt: skip
    print(f"stage(0.02% MoE) / stage(1% uniform), worst layer: {result['stage_ratio_worst']:.3f} (<= 0.10)")
    print(f"on paper (layers of the model x the per-layer figures; the embeddings and lm_head left out): "
          f"{json.dumps(paper)}")  # fmt: skip
    out_dir.mkdir(exist_ok=True)
    out = out_dir / "scale-30b-a3b.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result
