"""The real-model path on CPU: a local HF checkpoint + its own tokenizer + a JSONL dataset, end to end.

Everything is built offline in ``tmp_path`` (a tiny Qwen3 saved with ``save_pretrained`` and a
character-level ``tokenizers`` tokenizer), then trained for a few GRPO steps through the loop,
published, staged by an in-process actor, and rescored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from deltarl.codec import state_digest  # noqa: E402
from deltarl.model.record import read_model_json  # noqa: E402
from deltarl.model.tokenizer import HFTokenizer  # noqa: E402
from deltarl.pipeline.publisher import Publisher  # noqa: E402
from deltarl.pipeline.replay import replay  # noqa: E402
from deltarl.storage import MemoryStore  # noqa: E402
from deltarl.trainer.config import TrainerConfig  # noqa: E402
from deltarl.trainer.loop import TrainerLoop  # noqa: E402
from deltarl.trainer.rescore import rescore_rollouts  # noqa: E402
from tests.fixtures.models import LocalRollouts, build_hf_checkpoint  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def test_local_checkpoint_jsonl_run(tmp_path: Path, torch_threads: Any) -> None:
    ckpt = build_hf_checkpoint(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(
        json.dumps({"question": f"what is {a}+{b}?", "answer": f"{a}+{b}={a + b}.\n#### {a + b}"}) + "\n"
        for a in range(5) for b in range(5)
    ))
    store, run = MemoryStore(), "ckpt-run"
    cfg = TrainerConfig(
        run=run, steps=3, prompts_per_step=6, group_size=4, max_new_tokens=8,
        model={"name": str(ckpt)}, task={"kind": "jsonl", "path": str(data), "prompt_template": "{question} "},
        grpo={"lr": 1e-3},
    )
    assert cfg.tokenizer.kind == "hf"
    actor = LocalRollouts(store, run)
    with Publisher(store, run) as pub:
        loop = TrainerLoop(cfg, coordinator=actor, publisher=pub, store=store)
        reports = loop.run()
    assert isinstance(loop.tokenizer, HFTokenizer)
    assert read_model_json(store, run).model.name == str(ckpt)
    assert [r.version for r in reports] == [1, 2, 3]
    assert all(r.stats.samples == 24 for r in reports)
    prompt = actor.results[0].samples[0]
    assert loop.tokenizer.decode(prompt.prompt_token_ids).startswith("what is ")  # no bos: the tokenizer has none
    assert all(0.0 <= r.stats.reward_mean <= 1.0 for r in reports)
    assert state_digest(replay(store, run, 3)) == state_digest(loop.trainer.export_bf16())
    assert all(f.ok for f in rescore_rollouts(store, run, actor.results, 1000))
