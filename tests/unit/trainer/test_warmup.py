"""The supervised warm-up: it learns, it is deterministic, its cache is reused, its moments carry into GRPO."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.model.build import ModelSpec, build_model  # noqa: E402
from deltarl.model.tasks import AdditionTask, TaskSpec  # noqa: E402
from deltarl.model.tokenizer import ByteTokenizer, TokenizerSpec  # noqa: E402
from deltarl.trainer.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from deltarl.trainer.warmup import WarmupConfig, cache_key, supervised_warmup, warm_start  # noqa: E402

pytestmark = pytest.mark.torch

SPEC = ModelSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, seed=3)
CFG = WarmupConfig(steps=6, lr=1e-2, batch_size=16)


def _key(cfg: WarmupConfig = CFG, spec: ModelSpec = SPEC) -> str:
    return cache_key(spec, TokenizerSpec(), TaskSpec(), cfg)


def test_warmup_lowers_the_loss_and_is_deterministic(torch_threads: Any) -> None:
    a, b = build_model(SPEC), build_model(SPEC)
    ra = supervised_warmup(a, ByteTokenizer(), AdditionTask(), CFG)
    rb = supervised_warmup(b, ByteTokenizer(), AdditionTask(), CFG)
    assert len(ra.losses) == CFG.steps
    assert ra.losses[-1] < ra.losses[0] * 0.8
    assert ra.losses == rb.losses
    assert all(torch.equal(ra.state[n], rb.state[n]) for n in ra.state)
    assert all(torch.equal(p, ra.state[n]) for n, p in a.named_parameters())
    assert set(ra.moments) == {n for n, _ in a.named_parameters()}
    assert all(float(m["step"]) == CFG.steps for m in ra.moments.values())


def test_warm_start_reuses_its_cache(tmp_path: Path, torch_threads: Any) -> None:
    first = build_model(SPEC)
    r1 = warm_start(first, ByteTokenizer(), AdditionTask(), CFG, key=_key(), cache_dir=tmp_path)
    assert not r1.cached
    assert [p.name for p in tmp_path.iterdir()] == [f"warmup-{_key()}.pt"]
    second = build_model(SPEC)
    r2 = warm_start(second, ByteTokenizer(), AdditionTask(), CFG, key=_key(), cache_dir=tmp_path)
    assert r2.cached
    assert r2.losses == r1.losses
    for (n, p), (_, q) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert r2.moments.keys() == r1.moments.keys()
    assert all(torch.equal(r2.moments[n]["exp_avg_sq"], r1.moments[n]["exp_avg_sq"]) for n in r1.moments)


def test_a_damaged_cache_is_warmed_up_again(tmp_path: Path, torch_threads: Any) -> None:
    (tmp_path / f"warmup-{_key()}.pt").write_bytes(b"not a torch file")
    r = warm_start(build_model(SPEC), ByteTokenizer(), AdditionTask(), CFG, key=_key(), cache_dir=tmp_path)
    assert not r.cached
    assert len(r.losses) == CFG.steps
    assert warm_start(build_model(SPEC), ByteTokenizer(), AdditionTask(), CFG, key=_key(), cache_dir=tmp_path).cached


def test_cache_key_follows_what_shapes_the_result() -> None:
    assert _key() == _key()
    assert _key(CFG.model_copy(update={"steps": 7})) != _key()
    assert _key(CFG.model_copy(update={"lr": 1e-3})) != _key()
    assert _key(spec=SPEC.model_copy(update={"init_std": 0.1})) != _key()
    assert _key(CFG.model_copy(update={"carry_moments": "both"})) == _key()  # GRPO's business, not the warm-up's


def test_moments_carry_into_grpo(torch_threads: Any) -> None:
    model = build_model(SPEC)
    r = supervised_warmup(model, ByteTokenizer(), AdditionTask(), CFG)
    names = {id(p): n for n, p in model.named_parameters()}
    for which in ("both", "second"):
        trainer = GRPOTrainer(model, GRPOConfig(lr=1e-5), pad_token_id=256)
        assert trainer.load_moments(r.moments, which=which) == len(r.moments)
        for p, st in trainer.optimizer.state.items():
            src = r.moments[names[id(p)]]
            assert torch.equal(st["exp_avg_sq"], src["exp_avg_sq"])
            assert float(st["step"]) == CFG.steps
            assert torch.equal(st["exp_avg"], src["exp_avg"] if which == "both" else torch.zeros_like(p))
    with pytest.raises(ValueError, match="which"):
        trainer.load_moments(r.moments, which="first")
    name = next(iter(r.moments))
    bad = {name: {**r.moments[name], "exp_avg_sq": torch.zeros(3)}}
    with pytest.raises(ValueError, match="moment shape"):
        GRPOTrainer(model, GRPOConfig(), pad_token_id=256).load_moments(bad)


def test_lr_ramps_over_the_warmup_steps(tiny_model: Any) -> None:
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=3e-5, lr_warmup_steps=2), pad_token_id=256)
    assert [trainer.lr_at(s) for s in (1, 2, 3, 10)] == pytest.approx([1e-5, 2e-5, 3e-5, 3e-5])
    assert GRPOTrainer(tiny_model, GRPOConfig(lr=3e-5), pad_token_id=256).lr_at(1) == 3e-5
