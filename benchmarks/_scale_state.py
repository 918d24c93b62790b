"""Full-size Qwen3 states for ``benchmarks.scale``: shapes from the HF configs, BF16 values built in
place (no FP32 master), and next versions changed the way Adam at lr ~1e-6 changes BF16 weights.

The shapes are the numbers of each model's ``config.json`` on the Hugging Face hub (nothing is
downloaded): ``Qwen/Qwen3-0.6B``, ``-1.7B``, ``-4B`` (tied embeddings) and ``-8B`` (untied).

A state lives in one flat BF16 buffer (one copy), its tensors are views of it in sorted-name
order, and the scratch directory holds version 0's raw bits (``v0.bin``) and, for each later
version, the changed positions (global element offsets) and their new bits. Adam's step is about
``lr`` in magnitude, so a BF16 weight ``w`` moves when the step crosses half an ulp: with
probability ~ ``lr / ulp(w)`` (~1% of elements at lr 1e-6 for weights ~0.02), by +-1 ulp (10% of
them by 2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deltarl.codec.tensors import TensorSpec


@dataclass(frozen=True)
class Qwen3Config:
    """The shape fields of a Qwen3 ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool


MODELS = {
    "0.6b": Qwen3Config(1024, 3072, 28, 16, 8, 128, 151936, True),
    "1.7b": Qwen3Config(2048, 6144, 28, 16, 8, 128, 151936, True),
    "4b": Qwen3Config(2560, 9728, 36, 32, 8, 128, 151936, True),
    "8b": Qwen3Config(4096, 12288, 36, 32, 8, 128, 151936, False),
    # not a real model: the same tensor table at a size a test runs in seconds
    "tiny": Qwen3Config(64, 192, 2, 4, 2, 16, 512, True),
}
LR = 1e-6
CHANGED = 0.01  # mean fraction of elements changed per version
CHUNK = 1 << 24  # elements per generation chunk (32 MiB of BF16)


def qwen3_specs(cfg: Qwen3Config) -> list[TensorSpec]:
    """The tensor table (HF names, sorted) of a Qwen3 model's BF16 state dict."""
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, h),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return [TensorSpec(name, "bfloat16", shapes[name]) for name in sorted(shapes)]


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _offsets(specs: list[TensorSpec]) -> list[int]:
    out, pos = [], 0
    for s in specs:
        out.append(pos)
        pos += s.numel
    return out


def _exponent(bits: np.ndarray) -> np.ndarray:
    return ((bits >> 7) & 0xFF).astype(np.uint8)


def generate(scratch: Path, model: str, versions: int, seed: int = 0) -> dict[str, Any]:
    """Write ``v0.bin`` and the changes of versions 1..versions into ``scratch``; return the meta.

    Values: N(0, 0.02) (norm weights 1 + N(0, 0.02)) rounded to BF16, drawn from a pool of 2^24 and
    varied in the low mantissa bits (cheap at billions of elements). Changes: element ``i`` moves
    with probability ``c * lr / ulp(w_i)`` (capped at 1), where ``c`` scales the mean to
    ``CHANGED`` (weights near zero have tiny ulps, so the raw ``lr / ulp`` changes ~4% of a normal
    state; the issue measured ~1%), by +-1 ulp (10% of them by 2). One random draw per element
    decides every version (disjoint bands), so each position changes in at most one version (the
    overlap of two 1% sets, 0.01%, is dropped) and the whole run is one pass."""
    specs = qwen3_specs(MODELS[model])
    total = sum(s.numel for s in specs)
    rng = np.random.default_rng(seed)
    scratch.mkdir(parents=True, exist_ok=True)
    pool = _to_bf16_bits(rng.standard_normal(1 << 24, dtype=np.float32) * np.float32(0.02))
    norm_pool = _to_bf16_bits(rng.standard_normal(1 << 16, dtype=np.float32) * np.float32(0.02) + np.float32(1))
    ulp = np.ldexp(1.0, np.arange(256) - 127 - 7)
    # the mean of min(1, lr/ulp) over N(0, 0.02) in BF16, from the pool, scaled to CHANGED
    hist = np.bincount(_exponent(pool), minlength=256)
    scale = CHANGED / float((np.minimum(1.0, LR / ulp) * hist).sum() / hist.sum())
    band = 65536 // versions  # one draw per element serves every version: disjoint bands of it
    thr = np.minimum(band, np.round(np.minimum(1.0, scale * LR / ulp) * 65536)).astype(np.uint32)
    pos_parts: list[list[np.ndarray]] = [[] for _ in range(versions)]
    new_parts: list[list[np.ndarray]] = [[] for _ in range(versions)]
    offset = 0
    with open(scratch / "v0.bin", "wb") as f:
        for spec in specs:
            src = norm_pool if spec.name.endswith("norm.weight") else pool
            for a in range(0, spec.numel, CHUNK):
                n = min(CHUNK, spec.numel - a)
                s0 = int(rng.integers(src.size - n + 1)) if n <= src.size else 0
                bits = np.resize(src[s0:], n) ^ rng.integers(0, 4, n, dtype=np.uint16)
                f.write(bits.tobytes())
                r = rng.integers(0, 65536, n, dtype=np.uint32)
                t = thr[_exponent(bits)]
                for v in range(versions):  # version v+1 changes where r falls in band v below its threshold
                    hit = np.flatnonzero((r >= v * band) & (r < v * band + t))
                    step = np.where(rng.random(hit.size, dtype=np.float32) < 0.1, 2, 1) * np.where(hit & 1, 1, -1)
                    old = bits[hit]  # a step of the magnitude, sign kept: -0.0 - 1 ulp must not wrap to NaN
                    mag = np.clip((old & 0x7FFF).astype(np.int32) + step, 1, 0x7F7F).astype(np.uint16)
                    new = (old & 0x8000) | mag
                    pos_parts[v].append(hit.astype(np.int64) + offset + a)
                    new_parts[v].append(new)
            offset += spec.numel
    changed = []
    for v in range(versions):  # the sets are disjoint, so each version's old value is version 0's
        pos = np.concatenate(pos_parts[v])
        np.save(scratch / f"pos-v{v + 1}.npy", pos)
        np.save(scratch / f"bits-v{v + 1}.npy", np.concatenate(new_parts[v]))
        changed.append(int(pos.size))
        pos_parts[v] = new_parts[v] = []
    meta = {"model": model, "total_elements": total, "tensors": len(specs), "versions": versions, "lr": LR,
            "lr_scale": round(scale, 4), "changed": changed}
    (scratch / "meta.json").write_text(json.dumps(meta))
    return meta


def load_state(scratch: Path, model: str, version: int) -> tuple[Any, dict[str, Any]]:
    """Version ``version`` as ``(flat, state)``: one BF16 buffer and its tensor views (one copy)."""
    import torch

    specs = qwen3_specs(MODELS[model])
    total = sum(s.numel for s in specs)
    flat = torch.empty(total, dtype=torch.bfloat16)
    bits = flat.view(torch.int16).numpy().view(np.uint16)
    mv = memoryview(bits).cast("B")
    with open(scratch / "v0.bin", "rb", buffering=0) as f:
        done = 0
        while done < len(mv):
            n = f.readinto(mv[done : done + (64 << 20)])
            if not n:
                raise OSError(f"{scratch / 'v0.bin'} is short")
            done += n
    for v in range(1, version + 1):
        apply_changes(bits, scratch, v)
    return flat, views(flat, specs)


def apply_changes(bits: np.ndarray, scratch: Path, version: int) -> tuple[np.ndarray, np.ndarray]:
    pos = np.load(scratch / f"pos-v{version}.npy")
    new = np.load(scratch / f"bits-v{version}.npy")
    bits[pos] = new
    return pos, new


def views(flat: Any, specs: list[TensorSpec]) -> dict[str, Any]:
    state = {}
    for spec, off in zip(specs, _offsets(specs), strict=True):
        state[spec.name] = flat[off : off + spec.numel].view(spec.shape)
    return state


def rss_bytes(field: str = "VmHWM") -> int:
    """``VmHWM`` (peak) or ``VmRSS`` of this process, in bytes (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs); best effort."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
