"""Model construction, BF16 export/load, local checkpoints, model.json, and the trainer config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.errors import ConfigError, FormatError, TensorMismatch, UnsupportedFormatVersion  # noqa: E402
from deltarl.model.build import ModelSpec, build_model, export_bf16, load_bf16_into  # noqa: E402
from deltarl.model.record import RunModelInfo  # noqa: E402
from deltarl.model.tasks import TaskSpec  # noqa: E402
from deltarl.model.tokenizer import TokenizerSpec  # noqa: E402
from deltarl.trainer.config import TINY_GRPO, TrainerConfig  # noqa: E402

pytestmark = pytest.mark.torch


def _digest(state: dict[str, Any]) -> str:
    from deltarl.codec import state_digest

    return state_digest(state)


def test_tiny_init_is_deterministic_and_leaves_global_rng(tiny_spec: ModelSpec, torch_threads: Any) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = export_bf16(build_model(tiny_spec))
    assert torch.equal(torch.rand(1), expected_next)  # build_model did not consume the global RNG
    b = export_bf16(build_model(tiny_spec))
    c = export_bf16(build_model(tiny_spec.model_copy(update={"seed": 99})))
    assert _digest(a) == _digest(b) != _digest(c)
    model = build_model(tiny_spec)
    assert model.config.model_type == "qwen3"
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert next(build_model(tiny_spec, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="num_heads"):
        ModelSpec(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelSpec(num_heads=4, num_kv_heads=3)


def test_load_bf16_into_round_trip(tiny_spec: ModelSpec, tiny_model: Any) -> None:
    state = export_bf16(tiny_model)
    other = build_model(tiny_spec.model_copy(update={"seed": 7}), dtype=torch.bfloat16)
    load_bf16_into(other, state)
    assert _digest(export_bf16(other)) == _digest(state)
    bad = dict(state)
    bad["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(TensorMismatch, match="shape"):
        load_bf16_into(other, bad)
    with pytest.raises(TensorMismatch, match="unexpected"):
        load_bf16_into(other, {**state, "extra.weight": torch.zeros(1)})


def test_local_checkpoint_by_path(tmp_path: Path, tiny_model: Any) -> None:
    tiny_model.save_pretrained(tmp_path / "ckpt")
    loaded = build_model(ModelSpec(name=str(tmp_path / "ckpt")))
    assert _digest(export_bf16(loaded)) == _digest(export_bf16(tiny_model))
    with pytest.raises(ConfigError, match="no local checkpoint"):
        build_model(ModelSpec(name=str(tmp_path / "missing")))


def test_model_json_round_trip() -> None:
    info = RunModelInfo(ModelSpec(seed=4), TokenizerSpec(), TaskSpec().model_dump(mode="json"), 0.7, 12)
    data = info.to_bytes()
    assert RunModelInfo.from_bytes(data) == info
    assert data == RunModelInfo.from_bytes(data).to_bytes()  # canonical
    with pytest.raises(UnsupportedFormatVersion):
        RunModelInfo.from_bytes(data.replace(b'"format_version":1', b'"format_version":2'))
    with pytest.raises(FormatError):
        RunModelInfo.from_bytes(b"{not json")
    with pytest.raises(FormatError):
        RunModelInfo.from_bytes(b'{"format_version":1}')


def test_trainer_config_yaml(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "trainer:\n  run: r1\n  steps: 3\n  grpo:\n    lr: 0.01\n  model:\n    hidden_size: 32\n    intermediate_size: 64\n"
        "coordinator:\n  listen: 127.0.0.1:0\n"
    )
    cfg = TrainerConfig.load(path, steps=5, store=None)
    assert (cfg.run, cfg.steps, cfg.grpo.lr, cfg.model.hidden_size) == ("r1", 5, 0.01, 32)
    assert TrainerConfig.tiny().grpo == TINY_GRPO
    assert TrainerConfig().grpo.lr == 1e-6
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 0\n")
    with pytest.raises(ConfigError, match="steps"):
        TrainerConfig.load(bad)
    with pytest.raises(ConfigError):
        TrainerConfig.load(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="reference_kl"):
        TrainerConfig(grpo={"kl_coef": 0.1})
    with pytest.raises(ValueError, match="259"):
        TrainerConfig(model={"vocab_size": 300})
    ckpt = TrainerConfig(model={"name": "/models/qwen"})
    assert (ckpt.tokenizer.kind, ckpt.tokenizer.path) == ("hf", "/models/qwen")
    with pytest.raises(ValueError, match="own tokenizer"):
        TrainerConfig(model={"name": "/models/qwen"}, tokenizer={"kind": "byte"})


def test_trainer_command_reports_bad_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltarl.cli import main

    monkeypatch.delenv("DELTARL_TRAINER_TOKEN", raising=False)
    monkeypatch.delenv("DELTARL_COORDINATOR_TOKEN", raising=False)
    assert main(["trainer", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    ok = tmp_path / "t.yaml"
    ok.write_text("run: r\n")
    assert main(["trainer", "--config", str(ok)]) == 2  # no coordinator token anywhere
    assert "token" in capsys.readouterr().err
