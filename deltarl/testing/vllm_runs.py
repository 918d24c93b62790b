"""Runs for the vLLM engine's tests and benchmark: a local checkpoint built from a config, and
versions that change a fraction of its BF16 elements (never a download)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from deltarl.model.build import ModelSpec


def write_checkpoint(path: str | Path, spec: ModelSpec, *, config: Any = None) -> dict[str, torch.Tensor]:
    """Save ``spec``'s model in BF16 (or a transformers ``config``'s, random init) and the offline
    byte tokenizer under ``path``; return its BF16 export (the run's version 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from deltarl.model.build import build_model, export_bf16
    from deltarl.model.hf_byte import save_hf_byte_tokenizer

    path = Path(path)
    model: Any
    if config is None:
        model = build_model(spec, dtype=torch.bfloat16)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    save_hf_byte_tokenizer(path)
    return export_bf16(model)


def evolve(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with about ``fraction`` of each tensor's elements moved by a few BF16
    ulps (the shape of an RL step at post-training learning rates)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        new = t.clone()
        bits = new.view(-1).view(torch.int16)
        k = max(1, int(bits.numel() * fraction))
        idx = torch.randint(0, bits.numel(), (k,), generator=gen)
        step = torch.randint(1, 4, (k,), generator=gen, dtype=torch.int16) * (torch.randint(0, 2, (k,), generator=gen, dtype=torch.int16) * 2 - 1)
        bits[idx] = bits[idx] + step
        out[name] = new
    return out
