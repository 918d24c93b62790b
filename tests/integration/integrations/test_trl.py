"""TRL's GRPOTrainer on CPU with DeltaRLCallback: every optimizer step lands as a version, replay bit-exact."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from deltarl.integrations.trl import DeltaRLCallback  # noqa: E402
from deltarl.model.build import ModelSpec, build_model, export_bf16  # noqa: E402
from deltarl.model.hf_byte import save_hf_byte_tokenizer  # noqa: E402
from deltarl.model.record import RunModelInfo, read_model_json  # noqa: E402
from deltarl.model.tokenizer import ByteTokenizer, TokenizerSpec  # noqa: E402
from deltarl.pipeline.reader import RunReader  # noqa: E402
from deltarl.pipeline.replay import replay  # noqa: E402
from deltarl.storage.open import open_store  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
    # transformers 5.24 renames gradient checkpointing; TRL 1.16 still uses the old names
    pytest.mark.filterwarnings("ignore:`(is_)?gradient_checkpointing.*` is deprecated:FutureWarning"),
]


def _ones(completions: list[str], **_: object) -> list[float]:
    """A reward with some spread, so GRPO's advantages are not all zero."""
    return [float(c.count("1") - c.count("0")) for c in completions]


def test_grpo_publishes_every_step_and_replays_bit_exact(tmp_path) -> None:
    tok_dir = save_hf_byte_tokenizer(tmp_path / "tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert tokenizer.encode("12+30=", add_special_tokens=False) == ByteTokenizer().encode("12+30=")
    spec = ModelSpec()
    model = build_model(spec)
    model.train()
    store = open_store(str(tmp_path / "store"))
    info = RunModelInfo(model=spec, tokenizer=TokenizerSpec(kind="hf", path=str(tok_dir)), max_new_tokens=8)
    callback = DeltaRLCallback(store, "trl-run", model_info=info, publisher_options={"keyframe_interval": 2})
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=3, report_to="none", save_strategy="no", learning_rate=1e-3, seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(8)]})
    trainer = GRPOTrainer(model=model, reward_funcs=_ones, args=args, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[callback])
    trainer.train()

    assert [(v.version, v.step) for v in callback.published] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert callback.publisher is None  # closed at the end of training: the claim is released
    assert all(v.stats.changed_elements > 0 for v in callback.published[1:])  # each step moved the weights
    reader = RunReader(store, "trl-run")
    assert reader.head().version == 3
    final = export_bf16(model)
    replayed = replay(store, "trl-run", 3, verify=True)
    assert sorted(replayed) == sorted(final)
    for name, tensor in final.items():
        assert torch.equal(replayed[name].view(torch.int16), tensor.view(torch.int16)), name
    assert read_model_json(store, "trl-run") == info
