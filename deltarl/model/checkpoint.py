"""A small local checkpoint that vLLM serves: a tiny Qwen3 saved in BF16 with the offline byte
tokenizer as a Hugging Face tokenizer (``deltarl checkpoint``, ``deltarl demo --backend vllm``).
Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltarl.model.build import ModelSpec

if TYPE_CHECKING:
    import torch

#: the smallest tiny Qwen3 vLLM's CPU build serves: head_dim 64 (its CPU attention has no kernel below 32)
SERVABLE_TINY = ModelSpec(hidden_size=256, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                          max_positions=512, seed=3, init_std=0.02)


def write_checkpoint(path: str | Path, spec: ModelSpec = SERVABLE_TINY, *, config: Any = None) -> dict[str, torch.Tensor]:
    """Save ``spec``'s model in BF16 (or a transformers ``config``'s, random init) and the offline
    byte tokenizer under ``path``; return its BF16 export (a run's version 0)."""
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

