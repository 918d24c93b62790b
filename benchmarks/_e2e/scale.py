"""Scaling a full-size run (Qwen3-8B over WAN links) down to what one small machine can emulate.

Two factors, applied to everything at once so every ratio of the full-size case is kept:

* **S** (bytes): every tensor shrinks to ~1/S of its elements (each matrix dimension by sqrt(S),
  layer count and tensor count kept), and so do every byte-sized quantity that matters for
  transfer time: TCP windows, segment and shard sizes (segments no smaller than 256 KiB). S is reported as the *effective* ratio of
  full-size to scaled parameter counts.
* **T** (time): every duration shrinks by T: the generation window, the training time and the
  RTT. Link rates therefore shrink by S/T (bytes/S moved in time/T). With T = 1, rates shrink by
  exactly S and every transfer takes as long as at full size.

What does not scale: CPU work (extract, encode, decode, commit, hashing) is measured as it runs
here on the scaled model, i.e. the run models a trainer and actors whose codec throughput is S/T
times this machine's; and per-request overheads (HTTP, the asyncio link emulator) stay as they
are, so request grains (fetch ranges, relay pieces) are kept at fixed sizes, not scaled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .._trace import Shape, qwen3_like_shapes

#: Qwen3-8B (hidden 4096, 36 layers, MLP 12288, 32 heads / 8 KV heads of 128, vocab 151936, untied head).
QWEN3_8B = {"layers": 36, "hidden": 4096, "intermediate": 12288, "heads": 32, "kv_heads": 8, "head_dim": 128, "vocab": 151936}
GBPS = 1e9
#: Segments are not shrunk below this: the codec's chunks are segment_bytes/4 elements, and below
#: ~64K elements per chunk its per-chunk overhead (not per-element work) dominates decoding.
MIN_SEGMENT_BYTES = 256 << 10


def qwen3_8b_shapes(shrink: float = 1.0) -> list[tuple[str, Shape]]:
    """Qwen3-8B tensor shapes with every matrix dimension divided by ``sqrt(shrink)``."""
    f = math.sqrt(shrink)
    c = QWEN3_8B
    dim = lambda n: max(1, round(n / f))  # noqa: E731 - a one-line helper
    head_dim = dim(c["head_dim"])
    hidden = c["heads"] * head_dim if shrink != 1 else c["hidden"]
    vocab = dim(c["vocab"])
    shapes = qwen3_like_shapes(
        layers=c["layers"], hidden=hidden, intermediate=dim(c["intermediate"]), heads=c["heads"],
        kv_heads=c["kv_heads"], head_dim=head_dim, vocab=vocab,
    )  # fmt: skip
    shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def numel(shapes: list[tuple[str, Shape]]) -> int:
    return sum(math.prod(s) for _, s in shapes)


@dataclass(frozen=True)
class Scale:
    """Full-size settings and the factors that scale them; ``scaled_*`` are what the run uses."""

    S: float
    T: float
    full_params: int
    params: int
    rtt_s: float = 0.050
    window_bytes: int = 2 << 20
    gen_s: float = 45.0
    train_s: float = 15.0
    segment_bytes: int = 16 << 20
    shard_bytes: int = 1 << 30

    @classmethod
    def build(cls, shrink: float, time_scale: float, **full: Any) -> Scale:
        full_params = numel(qwen3_8b_shapes())
        params = numel(qwen3_8b_shapes(shrink))
        return cls(S=full_params / params, T=time_scale, full_params=full_params, params=params, **full)

    def rate_bps(self, full_bps: float) -> float:
        return full_bps * self.T / self.S

    def seconds(self, full_s: float) -> float:
        return full_s / self.T

    def nbytes(self, full_bytes: float, minimum: int = 4096) -> int:
        return max(minimum, int(full_bytes / self.S))

    @property
    def scaled(self) -> dict[str, float]:
        return {
            "rtt_s": self.seconds(self.rtt_s),
            "window_bytes": self.nbytes(self.window_bytes, 1024),
            "gen_s": self.seconds(self.gen_s),
            "train_s": self.seconds(self.train_s),
            "segment_bytes": self.nbytes(self.segment_bytes, MIN_SEGMENT_BYTES),
            "shard_bytes": self.nbytes(self.shard_bytes),
        }

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "scaled": self.scaled}
