"""A realistic weight-update trace: FP32 master weights, Adam, BF16 export (reusable by benchmarks).

The master weights have LLM-like shapes and distributions (matrices ~N(0, sigma) with per-row
log-normal scale and sigma ~ 1/sqrt(fan_in), norm weights near 1, embeddings); gradients have a
persistent per-element signal plus fresh noise at a per-row log-normal scale, so Adam's normalised
step varies across elements as in practice. ``export()`` rounds to BF16 (round-to-nearest-even)
and returns ``{name: deltarl.codec.BF16}``; the first Adam step is the dense one (|update| = lr
everywhere). Pure numpy, processed per tensor so memory stays ~4x the FP32 model.

Typical use::

    tr = AdamTrace(qwen3_like_shapes(layers=2), seed=0, lr=1e-6)
    tr.run(warmup_steps=20)          # steady state
    a = tr.export(); tr.step(); b = tr.export()   # one step's BF16 delta a -> b

A delta at a chosen density: ``lr = tr.lr_for_density(direction, 1e-4)`` and
``tr.export(direction, lr)``. MoE-like sparsity (``qwen3_moe_shapes``, ``moe_lr_scale``): per step a
few hot experts get most of the changes, a few warm ones some, attention, router and norms the
full step, and most experts nothing (they saw no tokens), as per-tensor scales of the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deltarl.codec import BF16

Shape = tuple[int, ...]


def _attention(p: str, hidden: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple[str, Shape]]:
    """One decoder layer's attention and RMSNorm tensors (Qwen3 and Qwen3-MoE name them alike)."""
    return [
        (p + "input_layernorm.weight", (hidden,)),
        (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
        (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
        (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
        (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
        (p + "self_attn.q_norm.weight", (head_dim,)),
        (p + "self_attn.k_norm.weight", (head_dim,)),
        (p + "post_attention_layernorm.weight", (hidden,)),
    ]


def qwen3_like_shapes(
    layers: int = 4,
    hidden: int = 1024,
    intermediate: int = 3072,
    heads: int = 16,
    kv_heads: int = 8,
    head_dim: int = 128,
    vocab: int = 32768,
) -> list[tuple[str, Shape]]:
    """Tensor names and shapes of a (scaled) Qwen3-style decoder: attention, gated MLP, RMSNorms."""
    out: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            *_attention(p, hidden, heads, kv_heads, head_dim),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)),
            (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
        ]
    out.append(("model.norm.weight", (hidden,)))
    return out


def qwen3_moe_shapes(
    layers: int = 2,
    hidden: int = 512,
    experts: int = 32,
    moe_intermediate: int = 256,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int = 64,
    vocab: int = 8192,
) -> list[tuple[str, Shape]]:
    """A (scaled) Qwen3-MoE decoder in the HF names of ``Qwen3MoeForCausalLM``: attention, router
    (``mlp.gate``) and ``experts`` gated MLPs of ``moe_intermediate`` each (Qwen3-30B-A3B: hidden
    2048, 128 experts of 768, 48 layers, 32 q / 4 kv heads of 128)."""
    out: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            *_attention(p, hidden, heads, kv_heads, head_dim),
            (p + "mlp.gate.weight", (experts, hidden)),
        ]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out += [
                (q + "gate_proj.weight", (moe_intermediate, hidden)),
                (q + "up_proj.weight", (moe_intermediate, hidden)),
                (q + "down_proj.weight", (hidden, moe_intermediate)),
            ]
    out.append(("model.norm.weight", (hidden,)))
    return out


def expert_of(name: str) -> tuple[str, int] | None:
    """``("model.layers.3.", 17)`` for a tensor of expert 17 of layer 3, else None."""
    head, sep, tail = name.partition("mlp.experts.")
    if not sep:
        return None
    return head, int(tail.split(".", 1)[0])


def moe_lr_scale(
    names: Sequence[str], *, seed: int, hot: int = 2, warm: int = 4, warm_scale: float = 0.1
) -> dict[str, float]:
    """Per-tensor scale of one MoE step: per layer ``hot`` experts (drawn at random) take the full
    step, ``warm`` others ``warm_scale`` of it, every other expert nothing; attention, router, norms
    and embeddings the full step (dense: every token passes through them)."""
    rng = np.random.default_rng(seed)
    per_layer: dict[str, set[int]] = {}
    for name in names:
        if (ex := expert_of(name)) is not None:
            per_layer.setdefault(ex[0], set()).add(ex[1])
    chosen: dict[str, tuple[set[int], set[int]]] = {}
    for layer, experts in per_layer.items():
        order = rng.permutation(sorted(experts)).tolist()
        chosen[layer] = (set(order[:hot]), set(order[hot : hot + warm]))
    out = {}
    for name in names:
        ex = expert_of(name)
        if ex is None:
            out[name] = 1.0
        else:
            hot_set, warm_set = chosen[ex[0]]
            out[name] = 1.0 if ex[1] in hot_set else warm_scale if ex[1] in warm_set else 0.0
    return out


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """FP32 -> BF16 bit patterns, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
        np.uint16
    )


def _row_scale(rng: np.random.Generator, shape: Shape, sigma: float) -> np.ndarray:
    rows = shape[0] if len(shape) > 1 else 1
    s = rng.lognormal(0.0, sigma, size=(rows,) + (1,) * (len(shape) - 1)).astype(np.float32)
    return s


class AdamTrace:
    """FP32 master weights updated by Adam with synthetic gradients; BF16 export per step."""

    def __init__(
        self,
        shapes: Sequence[tuple[str, Shape]],
        *,
        seed: int,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        signal: float = 0.3,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.lr, self.beta1, self.beta2, self.eps, self.signal = lr, beta1, beta2, eps, signal
        self.t = 0
        self.w: dict[str, np.ndarray] = {}
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.mu: dict[str, np.ndarray] = {}
        self.gscale: dict[str, np.ndarray] = {}
        for name, shape in shapes:
            rng = self.rng
            if len(shape) == 1:  # norm weights: near 1, some spread
                w = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                sigma = 1.0 / np.sqrt(shape[-1]) if "embed" not in name else 0.02
                w = rng.standard_normal(shape, dtype=np.float32) * np.float32(sigma)
                w *= _row_scale(rng, shape, 0.3)
            self.w[name] = w
            self.m[name] = np.zeros(shape, np.float32)
            self.v[name] = np.zeros(shape, np.float32)
            self.mu[name] = (signal * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
            self.gscale[name] = _row_scale(rng, shape, 1.0) * np.float32(1e-3)

    @property
    def numel(self) -> int:
        return sum(w.size for w in self.w.values())

    def step(self) -> None:
        """One Adam step (bias-corrected) with fresh gradient noise, at ``self.lr``."""
        for name, upd in self.direction().items():
            upd *= np.float32(self.lr)
            self.w[name] -= upd

    def direction(self) -> dict[str, np.ndarray]:
        """Advance the Adam moments one step and return m_hat / (sqrt(v_hat) + eps) per tensor.

        The weights are not touched: ``w - lr * direction`` is the next master weight at any lr,
        so one warmed-up trace serves several learning rates.
        """
        self.t += 1
        out: dict[str, np.ndarray] = {}
        b1, b2 = np.float32(self.beta1), np.float32(self.beta2)
        c1 = np.float32(1 - self.beta1**self.t)
        c2 = np.float32(1 - self.beta2**self.t)
        for name, w in self.w.items():
            g = self.rng.standard_normal(w.shape, dtype=np.float32)
            g += self.mu[name]
            g *= self.gscale[name]
            m, v = self.m[name], self.v[name]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            g *= g
            v += (1 - b2) * g
            denom = np.sqrt(v / c2)
            denom += np.float32(self.eps)
            upd = m / c1
            upd /= denom
            out[name] = upd
        return out

    def run(self, warmup_steps: int) -> None:
        for _ in range(warmup_steps):
            self.step()

    def export(
        self, direction: dict[str, np.ndarray] | None = None, lr: float = 0.0, scale: dict[str, float] | None = None
    ) -> dict[str, BF16]:
        """BF16 bit patterns of the master weights, or of ``w - lr * scale[name] * direction`` when given."""
        if direction is None:
            return {name: BF16(bf16_bits(w)) for name, w in self.w.items()}
        out = {}
        for name, w in self.w.items():
            step = np.float32(lr * (1.0 if scale is None else scale[name]))
            out[name] = BF16(bf16_bits(w - step * direction[name]) if step else bf16_bits(w))
        return out

    def lr_for_density(
        self, direction: dict[str, np.ndarray], density: float, scale: dict[str, float] | None = None,
        sample: int = 1 << 22,
    ) -> float:
        """The step size at which about ``density`` of the BF16 elements change (bisection on an
        evenly strided sample of every tensor, ~``sample`` elements)."""
        stride = max(1, self.numel // sample)
        parts = [(self.w[n].reshape(-1)[::stride], direction[n].reshape(-1)[::stride],
                  1.0 if scale is None else scale[n]) for n in self.w]  # fmt: skip
        base = [bf16_bits(w) for w, _, _ in parts]
        total = sum(w.size for w, _, _ in parts)

        def frac(lr: float) -> float:
            hit = sum(int((bf16_bits(w - np.float32(lr * s) * d) != b).sum())
                      for (w, d, s), b in zip(parts, base, strict=True) if s)  # fmt: skip
            return hit / total

        lo, hi = 1e-12, 1e-2
        for _ in range(40):
            mid = float(np.sqrt(lo * hi))
            lo, hi = (mid, hi) if frac(mid) < density else (lo, mid)
            if hi / lo < 1.01:
                break
        return float(np.sqrt(lo * hi))
