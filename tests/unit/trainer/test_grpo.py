"""GRPO maths on tiny tensors, and one real optimiser step on the tiny model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.model.build import export_bf16  # noqa: E402
from deltarl.trainer.grpo import GRPOConfig, GRPOTrainer, clipped_surrogate, group_advantages, k3_kl  # noqa: E402
from deltarl.trainer.logprobs import completion_logprobs  # noqa: E402

pytestmark = pytest.mark.torch


@dataclass
class _Sample:
    prompt_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    reward: float
    completion_text: str = ""
    finish_reason: str = "stop"


@dataclass
class _Result:
    samples: list[_Sample] = field(default_factory=list)


def test_group_advantages_normalise_per_group() -> None:
    adv = group_advantages([1.0, 0.0, 1.0, 0.0, 5.0, 5.0], ["a", "a", "a", "a", "b", "b"], eps=0.0 + 1e-12)
    assert adv[:4] == pytest.approx([1.0, -1.0, 1.0, -1.0])
    assert adv[4:] == [0.0, 0.0]  # equal rewards: no signal
    mixed = group_advantages([0.0, 3.0, 1.0], ["x", "y", "x"])
    assert mixed[1] == 0.0
    assert mixed[0] == pytest.approx(-mixed[2])
    with pytest.raises(ValueError, match="group id"):
        group_advantages([1.0], [])


def test_clipped_surrogate_gradients() -> None:
    old = torch.zeros(4)
    # ratios 1.0, 1.5 (above 1+eps), 0.5 (below 1-eps), 1.1
    logp = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.1])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, ratio, clipped = clipped_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.2)
    assert ratio.detach().tolist() == pytest.approx([1.0, 1.5, 0.5, 1.1])
    assert loss.detach().tolist() == pytest.approx([-1.0, -1.2, 0.8, 1.1])
    assert clipped.tolist() == [0.0, 1.0, 1.0, 0.0]
    loss.sum().backward()
    grad = logp.grad.tolist()
    assert grad[1] == 0.0
    assert grad[2] == 0.0
    assert grad[0] == pytest.approx(-1.0)  # d(-r A)/dlogp = -r A
    assert grad[3] == pytest.approx(1.1)


def test_clipped_surrogate_keeps_pessimistic_side() -> None:
    # positive advantage, ratio below the clip: unclipped term (smaller) is kept, gradient flows
    logp = torch.log(torch.tensor([0.5])).requires_grad_()
    loss, _, clipped = clipped_surrogate(logp, torch.zeros(1), torch.tensor([2.0]), eps_low=0.2, eps_high=0.2)
    assert float(loss.detach()) == pytest.approx(-1.0)
    assert float(clipped) == 0.0
    loss.backward()
    assert float(logp.grad) == pytest.approx(-1.0)
    # asymmetric clip (DAPO clip-higher)
    logp2 = torch.log(torch.tensor([1.25]))
    loss2, _, clipped2 = clipped_surrogate(logp2, torch.zeros(1), torch.tensor([1.0]), eps_low=0.2, eps_high=0.28)
    assert float(clipped2) == 0.0
    assert float(loss2) == pytest.approx(-1.25)


def test_k3_kl_nonnegative_and_zero_at_equal() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.1])
    assert k3_kl(logp, logp).tolist() == [0.0, 0.0, 0.0]
    ref = torch.tensor([-1.5, -0.5, -3.0])
    kl = k3_kl(logp, ref)
    assert bool((kl > 0).all())
    d = ref - logp
    assert kl.tolist() == pytest.approx((torch.exp(d) - d - 1).tolist())


@torch.no_grad()
def test_completion_logprobs_shapes_and_mask(tiny_model: Any) -> None:
    logp, mask = completion_logprobs(tiny_model, [[257, 1, 2], [257]], [[5, 6], [7, 8, 9]], temperature=1.0, pad_token_id=256)
    assert logp.shape == (2, 3)
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert float(logp[0, 2]) == 0.0
    assert bool((logp[mask.bool()] < 0).all())
    # row independence: the same row alone gives the same numbers
    alone, _ = completion_logprobs(tiny_model, [[257]], [[7, 8, 9]], temperature=1.0, pad_token_id=256)
    assert torch.allclose(alone[0], logp[1], atol=1e-5)
    first_alone, _ = completion_logprobs(tiny_model, [[257, 1, 2]], [[5, 6]], temperature=1.0, pad_token_id=256)
    assert torch.allclose(first_alone[0], logp[0, :2], atol=1e-5)  # fewer logits kept, same numbers
    hot, _ = completion_logprobs(tiny_model, [[257]], [[7, 8, 9]], temperature=2.0, pad_token_id=256)
    assert not torch.allclose(hot[0], alone[0])


def _on_policy_results(model: Any, prompts: dict[str, list[int]], comps: dict[str, list[tuple[list[int], float]]]) -> list[_Result]:
    samples = []
    for pid, rows in comps.items():
        for toks, reward in rows:
            with torch.no_grad():
                lp, _ = completion_logprobs(model, [prompts[pid]], [toks], temperature=1.0, pad_token_id=256)
            samples.append(_Sample(pid, prompts[pid], toks, lp[0, : len(toks)].tolist(), reward))
    return [_Result(samples[:3]), _Result(samples[3:])]


def test_train_step_raises_logprob_of_rewarded_completion(tiny_model: Any) -> None:
    prompts = {"p": [257, 49, 43, 50, 61]}
    good, bad = [51, 258], [120, 121]
    results = _on_policy_results(tiny_model, prompts, {"p": [(good, 1.0), (bad, 0.0), (good, 1.0), (bad, 0.0)]})
    before = export_bf16(tiny_model)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=1e-2, micro_batch=3), pad_token_id=256)

    def lp(toks: list[int]) -> float:
        with torch.no_grad():
            out, _ = completion_logprobs(trainer.model, [prompts["p"]], [toks], temperature=1.0, pad_token_id=256)
        return float(out.sum())

    g0, b0 = lp(good), lp(bad)
    stats = trainer.train_step(results)
    assert stats.samples == 4
    assert stats.tokens == 8
    assert stats.groups == 1
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-4)  # on-policy
    assert stats.clip_frac == 0.0
    assert stats.kl == 0.0
    assert stats.reward_mean == 0.5
    assert stats.grad_norm > 0
    assert lp(good) > g0
    assert lp(bad) < b0
    after = trainer.export_bf16()
    assert after.keys() == before.keys()
    assert any(not torch.equal(after[k], before[k]) for k in after)


def test_train_step_with_reference_kl_and_reward_fn(tiny_model: Any, tiny_spec: Any) -> None:
    from deltarl.model.build import build_model

    ref = build_model(tiny_spec)
    prompts = {"a": [257, 50], "b": [257, 51]}
    results = _on_policy_results(tiny_model, prompts, {"a": [([1, 2], 0.0), ([3], 0.0)], "b": [([4, 5, 6], 0.0), ([7], 0.0)]})
    with pytest.raises(ValueError, match="reference"):
        GRPOTrainer(tiny_model, GRPOConfig(kl_coef=0.1), pad_token_id=256)
    trainer = GRPOTrainer(
        tiny_model,
        GRPOConfig(lr=1e-3, kl_coef=0.1, loss_agg="sequence"),
        pad_token_id=256,
        ref_model=ref,
        reward_fn=lambda s: float(len(s.completion_token_ids)),  # overrides the reported rewards
    )
    s1 = trainer.train_step(results)
    assert s1.reward_mean == pytest.approx(1.75)
    assert s1.kl == pytest.approx(0.0, abs=1e-6)
    s2 = trainer.train_step(results)  # the policy moved: KL > 0, ratio != 1 for the now-stale logprobs
    assert s2.kl > 0
    assert s2.ratio_mean != pytest.approx(1.0, abs=1e-6)


def test_train_step_rejects_bad_input(tiny_model: Any) -> None:
    trainer = GRPOTrainer(tiny_model, GRPOConfig(), pad_token_id=256)
    with pytest.raises(ValueError, match="at least one"):
        trainer.train_step([_Result([])])
    with pytest.raises(ValueError, match="one logprob"):
        trainer.train_step([_Result([_Sample("p", [1], [2, 3], [-1.0], 1.0)])])


def test_export_bf16_handles_tied_weights(tiny_model: Any) -> None:
    state = export_bf16(tiny_model)
    assert "lm_head.weight" not in state
    assert "model.embed_tokens.weight" in state
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu" for t in state.values())
    # copies, not views of the master weights
    p = dict(tiny_model.named_parameters())["model.norm.weight"]
    assert state["model.norm.weight"].data_ptr() != p.data_ptr()


@pytest.mark.parametrize("poison", ["logprob-nan", "logprob-ninf", "reward-inf"])
def test_non_finite_step_is_refused_and_weights_stay(tiny_model: Any, poison: str, caplog: pytest.LogCaptureFixture) -> None:
    from deltarl.errors import NonFiniteStep

    prompts = {"p": [257, 49, 43]}
    results = _on_policy_results(tiny_model, prompts, {"p": [([51, 258], 1.0), ([120, 121], 0.0)]})
    s = results[0].samples[0]
    if poison == "reward-inf":
        s.reward = float("inf")
    else:
        s.logprobs[1] = float("nan") if poison == "logprob-nan" else float("-inf")
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=1e-2), pad_token_id=256)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(NonFiniteStep, match="weights unchanged"):
        trainer.train_step(results)
    assert "skipped, weights unchanged" in caplog.text
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert not trainer.optimizer.state  # AdamW moments were not touched either
    s.reward, s.logprobs[1] = 1.0, -0.5
    trainer.train_step(results)  # the next finite step trains
    assert any(not torch.equal(before[k], trainer.model.state_dict()[k]) for k in before)
