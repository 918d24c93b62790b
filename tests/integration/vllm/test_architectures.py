"""Checkpoint names mapped through vLLM's own ``load_weights`` on other architectures: Llama (untied
LM head) updates bit for bit and generates as a fresh engine on ``replay`` (MoE and tensor parallel
layouts: test_parallel.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm.conftest import engine, greedy, shut

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.filterwarnings("ignore")]  # vLLM's own warnings

COMMON = {"vocab_size": 259, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 256, "initializer_range": 0.2}


def _run(root: Path, config: Any) -> tuple[Path, list[dict[str, Any]]]:
    from deltarl.integrations.vllm.plugin import request_amx
    from deltarl.model.build import ModelSpec
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store
    from deltarl.testing.vllm_runs import evolve, write_checkpoint

    request_amx()
    states = [write_checkpoint(root / "ckpt", ModelSpec(seed=5), config=config)]
    states.append(evolve(states[0], 0.01, seed=1))
    store = open_store(str(root / "store"))
    with Publisher(store, "r") as pub:
        for v, s in enumerate(states):
            pub.publish(s, v)
    store.close()
    return root / "ckpt", states


def test_llama_updates_equal_a_fresh_engine(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from deltarl.codec import state_digest
    from deltarl.integrations.vllm import attach, status, update

    ckpt, states = _run(tmp_path, LlamaConfig(**COMMON, tie_word_embeddings=False))
    assert "lm_head.weight" in states[0]
    llm = engine(ckpt)
    try:
        attach(llm, str(tmp_path / "store"), "r", version=0)
        assert update(llm, 1)["version"] == 1
        assert status(llm, digest=True)[0]["digest"] == state_digest(states[1])
        after = greedy(llm)
    finally:
        shut(llm)
    fresh_dir = tmp_path / "fresh"
    shutil.copytree(ckpt, fresh_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(states[1], str(fresh_dir / "model.safetensors"), metadata={"format": "pt"})
    fresh = engine(fresh_dir)
    try:
        assert greedy(fresh) == after
    finally:
        shut(fresh)
