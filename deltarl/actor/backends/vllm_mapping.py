"""Map Hugging Face tensor names and flat element indices to vLLM's fused, tensor-parallel parameters.

vLLM fuses ``q_proj/k_proj/v_proj`` into ``qkv_proj`` and ``gate_proj/up_proj`` into
``gate_up_proj``, and shards parameters across tensor-parallel ranks:

* column-parallel (``qkv_proj``, ``gate_up_proj``): output rows are split; rank ``r`` holds, for each
  fused part, the block ``[r * size, (r + 1) * size)`` of that part's rows, parts stacked in order
  (q, k, v / gate, up). K and V heads are replicated when ``tp > num_kv_heads``: rank ``r`` then
  holds kv head ``r // (tp // num_kv_heads)``.
* row-parallel (``o_proj``, ``down_proj``): input columns are split; biases are replicated.
* vocab-parallel (``embed_tokens``, ``lm_head``): rows of the vocabulary padded to a multiple of 64
  are split evenly; rows past the real vocabulary are padding.
* everything else (norms, ``q_norm``/``k_norm``) is replicated.

A sparse update for an HF tensor (flat indices into its row-major layout and absolute values) maps,
per rank, to flat indices into the local vLLM parameter. :func:`shard_state` builds a rank's fused
shards from a full HF state the direct way (slicing and concatenating); tests check that both paths
agree. Pure torch: importable and testable without vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

VOCAB_PADDING = 64

_QKV = re.compile(r"^(?P<pre>.*\.self_attn\.)(?P<part>q|k|v)_proj\.(?P<kind>weight|bias)$")
_GATE_UP = re.compile(r"^(?P<pre>.*\.mlp\.)(?P<part>gate|up)_proj\.(?P<kind>weight|bias)$")
_ROW = re.compile(r"^.*\.(?:self_attn\.o_proj|mlp\.down_proj)\.(?P<kind>weight|bias)$")
_VOCAB = re.compile(r"^(?:model\.embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class FusedLayout:
    """The shapes that decide how a Qwen2/Qwen3/Llama-style model is fused and sharded."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tp_size: int = 1
    vocab_padding: int = VOCAB_PADDING

    def __post_init__(self) -> None:
        tp = self.tp_size
        if tp < 1 or self.num_heads % tp or self.intermediate_size % tp:
            raise ValueError(f"tp_size {tp} must divide num_heads {self.num_heads} and intermediate_size")
        if tp >= self.num_kv_heads and tp % self.num_kv_heads:
            raise ValueError(f"tp_size {tp} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if tp < self.num_kv_heads and self.num_kv_heads % tp:
            raise ValueError(f"tp_size {tp} must divide num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf_config(cls, config: object, tp_size: int = 1) -> FusedLayout:
        """From a transformers config (``num_attention_heads``, ``num_key_value_heads``, ...)."""
        heads = int(getattr(config, "num_attention_heads"))  # noqa: B009 - config objects vary
        hidden = int(getattr(config, "hidden_size"))  # noqa: B009
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        return cls(
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(getattr(config, "intermediate_size")),  # noqa: B009
            vocab_size=int(getattr(config, "vocab_size")),  # noqa: B009
            tp_size=tp_size,
        )

    # per-rank sizes
    @property
    def q_rows(self) -> int:
        return self.num_heads // self.tp_size * self.head_dim

    @property
    def kv_heads_local(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kv_rows(self) -> int:
        return self.kv_heads_local * self.head_dim

    @property
    def kv_replicas(self) -> int:
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def mlp_rows(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def vocab_rows(self) -> int:
        padded = -(-self.vocab_size // self.vocab_padding) * self.vocab_padding
        return -(-padded // self.tp_size)


Split = Literal["rows", "cols", "replicated"]


@dataclass(frozen=True)
class Placement:
    """Where part of an HF tensor lives on one rank.

    ``split == "rows"``: HF rows ``[src, src + size)`` become local rows ``[dst, dst + size)``;
    ``"cols"``: HF columns ``[src, src + size)`` become local columns ``[0, size)``;
    ``"replicated"``: the whole tensor, same layout.
    """

    target: str
    split: Split
    src: int = 0
    size: int = 0
    dst: int = 0


def placement(name: str, layout: FusedLayout, rank: int) -> Placement:
    """Where HF tensor ``name`` lands on tensor-parallel ``rank``."""
    if not 0 <= rank < layout.tp_size:
        raise ValueError(f"rank {rank} outside tp_size {layout.tp_size}")
    m = _QKV.match(name)
    if m:
        target = f"{m['pre']}qkv_proj.{m['kind']}"
        if m["part"] == "q":
            return Placement(target, "rows", rank * layout.q_rows, layout.q_rows, 0)
        shard = rank // layout.kv_replicas
        dst = layout.q_rows + (layout.kv_rows if m["part"] == "v" else 0)
        return Placement(target, "rows", shard * layout.kv_rows, layout.kv_rows, dst)
    m = _GATE_UP.match(name)
    if m:
        target = f"{m['pre']}gate_up_proj.{m['kind']}"
        dst = layout.mlp_rows if m["part"] == "up" else 0
        return Placement(target, "rows", rank * layout.mlp_rows, layout.mlp_rows, dst)
    m = _ROW.match(name)
    if m:
        if m["kind"] == "bias":
            return Placement(name, "replicated")
        return Placement(name, "cols", -1, -1, 0)  # size depends on the tensor: see _cols
    if _VOCAB.match(name):
        start = rank * layout.vocab_rows
        size = max(0, min(layout.vocab_rows, layout.vocab_size - start))
        return Placement(name, "rows", start, size, 0)
    return Placement(name, "replicated")


def _cols(p: Placement, in_features: int, layout: FusedLayout, rank: int) -> Placement:
    if in_features % layout.tp_size:
        raise ValueError(f"{p.target}: {in_features} input columns do not split over tp_size {layout.tp_size}")
    size = in_features // layout.tp_size
    return Placement(p.target, "cols", rank * size, size, 0)


def local_shape(name: str, shape: tuple[int, ...], layout: FusedLayout) -> tuple[int, ...]:
    """Shape of the vLLM parameter that HF tensor ``name`` (of ``shape``) is part of, on any rank."""
    p = placement(name, layout, 0)
    if p.split == "replicated":
        return shape
    if p.split == "cols":
        return (shape[0], shape[1] // layout.tp_size)
    if ".qkv_proj." in p.target:
        rows = layout.q_rows + 2 * layout.kv_rows
    elif ".gate_up_proj." in p.target:
        rows = 2 * layout.mlp_rows
    else:
        rows = layout.vocab_rows
    return (rows, *shape[1:])


def map_sparse(
    name: str,
    shape: tuple[int, ...],
    indices: torch.Tensor,
    values: torch.Tensor,
    layout: FusedLayout,
    rank: int,
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Map an update of HF tensor ``name`` to rank ``rank``: ``(vLLM name, local flat indices, values)``.

    ``indices`` are flat (row-major) int64 positions into the HF tensor, ``values`` the absolute new
    values at them; positions this rank does not hold are dropped.
    """
    import torch

    p = placement(name, layout, rank)
    if p.split == "replicated":
        return p.target, indices, values
    cols = 1 if len(shape) == 1 else int(torch.tensor(shape[1:]).prod())
    row, col = indices // cols, indices % cols
    if p.split == "cols":
        p = _cols(p, shape[1], layout, rank)
        keep = (col >= p.src) & (col < p.src + p.size)
        local = row[keep] * p.size + (col[keep] - p.src)
        return p.target, local, values[keep]
    keep = (row >= p.src) & (row < p.src + p.size)
    local = (row[keep] - p.src + p.dst) * cols + col[keep]
    return p.target, local, values[keep]


def shard_state(hf: dict[str, torch.Tensor], layout: FusedLayout, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s vLLM parameters built from a full HF state by slicing and concatenation.

    The reference the index mapping is tested against (and what a worker would hold after a full
    load). Vocab padding rows are zero.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        p = placement(name, layout, rank)
        if p.split == "replicated":
            out[p.target] = t.clone()
            continue
        if p.split == "cols":
            p = _cols(p, t.shape[1], layout, rank)
            out[p.target] = t[:, p.src : p.src + p.size].contiguous()
            continue
        if p.target not in out:
            out[p.target] = torch.zeros(local_shape(name, tuple(t.shape), layout), dtype=t.dtype)
        out[p.target][p.dst : p.dst + p.size] = t[p.src : p.src + p.size]
    return out


def unshard_state(shards: list[dict[str, torch.Tensor]], names_shapes: dict[str, tuple[int, ...]], layout: FusedLayout) -> dict[str, torch.Tensor]:
    """Rebuild the HF state from every rank's vLLM parameters (inverse of :func:`shard_state`)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, shape in names_shapes.items():
        p0 = placement(name, layout, 0)
        if p0.split == "replicated":
            out[name] = shards[0][p0.target].clone()
            continue
        full = torch.empty(shape, dtype=shards[0][p0.target].dtype)
        for rank in range(layout.tp_size):
            p = placement(name, layout, rank)
            local = shards[rank][p.target]
            if p.split == "cols":
                p = _cols(p, shape[1], layout, rank)
                full[:, p.src : p.src + p.size] = local
            elif p.size:
                full[p.src : p.src + p.size] = local[p.dst : p.dst + p.size]
        out[name] = full
    return out
