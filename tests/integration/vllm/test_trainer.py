"""The trainer side: vLLM's ``WeightTransferTrainerFactory`` with backend ``deltarl`` publishes each
round through deltarl's ``Publisher`` and has the engine take it (a real engine, in process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.vllm.conftest import SPEC, engine, shut

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.filterwarnings("ignore")]  # vLLM's own warnings


def test_trainer_engine_publishes_and_the_engine_follows(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from deltarl.codec import state_digest
    from deltarl.integrations.vllm import LLMSyncClient, status
    from deltarl.integrations.vllm.plugin import request_amx
    from deltarl.integrations.vllm.trainer import DeltaRLTrainerInitInfo
    from deltarl.model.build import ModelSpec, export_bf16
    from deltarl.pipeline.replay import replay
    from deltarl.storage.open import open_store
    from deltarl.testing.vllm_runs import write_checkpoint

    request_amx()
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, ModelSpec(**SPEC))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, local_files_only=True)
    llm = engine(ckpt)
    try:
        trainer = WeightTransferTrainerFactory.trainer_init(
            DeltaRLTrainerInitInfo(store=str(tmp_path / "store"), run="t", rank=0, publish={"digest_interval": 1}),
            client=LLMSyncClient(llm), source=ModuleSource(model))
        assert status(llm, digest=True)[0]["digest"] == state_digest(export_bf16(model))  # version 0, attached
        for step in (1, 2):
            with torch.no_grad():  # an "optimizer step": a few elements of every tensor move
                for p in model.parameters():
                    flat = p.view(-1)
                    flat[:: 97 + step] += 0.01
            trainer.send_weights()
            st = status(llm, digest=True)[0]
            assert st["version"] == step
            assert st["digest"] == state_digest(export_bf16(model))
        trainer.shutdown()
        store = open_store(str(tmp_path / "store"))
        assert state_digest(replay(store, "t")) == state_digest(export_bf16(model))
        store.close()
    finally:
        shut(llm)
