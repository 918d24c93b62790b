"""The transformers backend: sampling, logprobs consistent with a forward pass, in-place updates."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.actor.backends.base import Generation, GenerationBackend  # noqa: E402
from deltarl.actor.backends.hf import HFBackend  # noqa: E402
from deltarl.model.build import export_bf16, load_bf16_into  # noqa: E402
from deltarl.trainer.logprobs import completion_logprobs  # noqa: E402

pytestmark = pytest.mark.torch

PROMPTS = [[257, *b"1+2="], [257, *b"9+9="], [257, *b"0+0=", 32, 32]]  # unequal lengths: left padding


def test_generate_shapes_and_finish_reasons(tiny_backend: HFBackend) -> None:
    assert isinstance(tiny_backend, GenerationBackend)
    assert tiny_backend.tokens_per_second is None
    gens = tiny_backend.generate(PROMPTS, max_new_tokens=5, temperature=1.0, n=4)
    assert len(gens) == 12
    assert all(isinstance(g, Generation) for g in gens)
    for g in gens:
        assert 1 <= len(g.completion_token_ids) <= 5
        assert len(g.logprobs) == len(g.completion_token_ids)
        assert all(lp <= 0.0 for lp in g.logprobs)
        if g.finish_reason == "stop":
            assert g.completion_token_ids[-1] == 258
            assert 258 not in g.completion_token_ids[:-1]
        else:
            assert len(g.completion_token_ids) == 5
            assert 258 not in g.completion_token_ids
    assert tiny_backend.tokens_per_second is not None
    assert tiny_backend.tokens_per_second > 0
    assert tiny_backend.generate([], max_new_tokens=3, temperature=1.0) == []
    with pytest.raises(ValueError, match="at least one token"):
        tiny_backend.generate([[]], max_new_tokens=3, temperature=1.0)


def test_sampling_is_seeded(tiny_spec: Any, tiny_model: Any) -> None:
    state = export_bf16(tiny_model)
    a = HFBackend.from_spec(tiny_spec, eos_token_id=258, pad_token_id=256, state=state, seed=7)
    b = HFBackend.from_spec(tiny_spec, eos_token_id=258, pad_token_id=256, state=state, seed=7)
    ga = a.generate(PROMPTS, max_new_tokens=4, temperature=1.0, n=2)
    assert ga == b.generate(PROMPTS, max_new_tokens=4, temperature=1.0, n=2)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_a_forward_pass(tiny_backend: HFBackend, temperature: float) -> None:
    gens = tiny_backend.generate(PROMPTS, max_new_tokens=6, temperature=temperature, n=3)
    prompts = [p for p in PROMPTS for _ in range(3)]
    with torch.no_grad():
        ref, _mask = completion_logprobs(
            tiny_backend.model, prompts, [g.completion_token_ids for g in gens], temperature=temperature, pad_token_id=256
        )
    for i, g in enumerate(gens):
        got = torch.tensor(g.logprobs)
        want = ref[i, : len(g.logprobs)]
        # BF16 incremental decoding vs one full BF16 forward: equal up to BF16 rounding
        assert torch.allclose(got, want, atol=0.03), (got, want)
    if temperature == 0.0:  # greedy: every row of a prompt is the same completion
        for k in range(3):
            assert gens[3 * k] == gens[3 * k + 1] == gens[3 * k + 2]


def test_fp32_trainer_agrees_with_bf16_actor(tiny_backend: HFBackend, tiny_model: Any) -> None:
    gens = tiny_backend.generate(PROMPTS, max_new_tokens=6, temperature=1.0, n=2)
    prompts = [p for p in PROMPTS for _ in range(2)]
    with torch.no_grad():
        fp32, mask = completion_logprobs(tiny_model, prompts, [g.completion_token_ids for g in gens], temperature=1.0, pad_token_id=256)
    actor = torch.zeros_like(fp32)
    for i, g in enumerate(gens):
        actor[i, : len(g.logprobs)] = torch.tensor(g.logprobs)
    ratio = torch.exp((fp32 - actor)[mask.bool()])
    assert float((ratio - 1).abs().max()) < 0.05


def test_live_parameters_are_the_export(tiny_backend: HFBackend, tiny_model: Any) -> None:
    from deltarl.codec import state_digest

    live = tiny_backend.state_dict_for_update()
    export = export_bf16(tiny_model)
    assert list(live) == list(export)
    assert state_digest(live) == state_digest(export)
    params = dict(tiny_backend.model.named_parameters())
    assert all(live[k].data_ptr() == params[k].data_ptr() for k in live)  # no copies


def test_staged_update_commits_in_place_and_rolls_back(tiny_backend: HFBackend, tiny_model: Any) -> None:
    from deltarl.codec import encode_delta, stage_delta, state_digest

    v0 = export_bf16(tiny_model)
    with torch.no_grad():  # a "training step": perturb the master weights
        gen = torch.Generator().manual_seed(3)
        for p in tiny_model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    v1 = export_bf16(tiny_model)
    segments = encode_delta(v0, v1, base="v0", segment_bytes=4096)
    live = tiny_backend.state_dict_for_update()
    greedy = {"max_new_tokens": 6, "temperature": 0.0}
    before = tiny_backend.generate(PROMPTS, **greedy)
    staged = stage_delta(live, segments, base="v0")
    assert state_digest(live) == state_digest(v0)  # staging writes nothing
    tiny_backend.commit(staged)
    assert state_digest(live) == state_digest(v1)  # bit for bit the trainer's export
    after = tiny_backend.generate(PROMPTS, **greedy)
    assert after != before
    # the tied LM head follows the embedding (one tensor): the forward matches a model loaded with v1
    fresh = HFBackend.from_spec(
        tiny_backend_spec(tiny_backend), eos_token_id=258, pad_token_id=256, state=v1
    )
    assert fresh.generate(PROMPTS, **greedy) == after
    staged.commit()  # idempotent
    assert state_digest(live) == state_digest(v1)
    staged.rollback()
    assert state_digest(live) == state_digest(v0)
    assert tiny_backend.generate(PROMPTS, **greedy) == before


def tiny_backend_spec(backend: HFBackend) -> Any:
    from deltarl.model.build import ModelSpec

    cfg = backend.model.config
    return ModelSpec(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
    )


def test_load_bf16_into_checks_names(tiny_backend: HFBackend, tiny_model: Any) -> None:
    from deltarl.errors import TensorMismatch

    state = export_bf16(tiny_model)
    state.pop("model.norm.weight")
    with pytest.raises(TensorMismatch, match="missing"):
        load_bf16_into(tiny_backend.model, state)


def test_throttle_slows_generation(tiny_spec: Any, tiny_model: Any) -> None:
    state = export_bf16(tiny_model)
    fast = HFBackend.from_spec(tiny_spec, eos_token_id=258, pad_token_id=256, state=state)
    slow = HFBackend.from_spec(tiny_spec, eos_token_id=258, pad_token_id=256, state=state, throttle=3.0)
    kw = {"max_new_tokens": 8, "temperature": 0.0, "n": 8}
    fast.generate(PROMPTS, **kw)
    assert fast.last_throttle_s == 0.0
    t0 = time.perf_counter()
    slow.generate(PROMPTS, **kw)
    t_slow = time.perf_counter() - t0
    assert slow.last_throttle_s == pytest.approx(2.0 * slow.last_compute_s)  # sleeps (throttle - 1) x compute
    assert t_slow >= slow.last_compute_s + slow.last_throttle_s
    assert slow.tokens_per_second is not None
    # its measured throughput includes the sleep: a third of what its compute alone would give
    assert slow.tokens_per_second <= (8 * 3 * 8) / (3.0 * slow.last_compute_s) * 1.01
    with pytest.raises(ValueError, match="throttle"):
        HFBackend.from_spec(tiny_spec, eos_token_id=258, pad_token_id=256, throttle=0.5)


def test_commit_refuses_a_moved_state_and_load_state(tiny_backend: HFBackend, tiny_model: Any) -> None:
    from deltarl.codec import encode_delta, stage_delta, state_digest
    from deltarl.errors import StagingError

    v0 = export_bf16(tiny_model)
    v1 = {k: (v.float() * 1.5).to(torch.bfloat16) for k, v in v0.items()}
    live = tiny_backend.state_dict_for_update()
    staged = stage_delta(live, encode_delta(v0, v1, base="v0"), base="v0")
    other = {k: (v.float() - 1.0).to(torch.bfloat16) for k, v in v0.items()}
    tiny_backend.load_state(other)  # the served weights move on after staging
    assert state_digest(live) == state_digest(other)
    with pytest.raises(StagingError):
        tiny_backend.commit(staged)
    assert state_digest(live) == state_digest(other)  # nothing half-applied
    tiny_backend.load_state(v0)
    t0 = time.perf_counter()
    tiny_backend.commit(staged)
    pause = time.perf_counter() - t0
    assert state_digest(live) == state_digest(v1)
    assert pause < 1.0  # the in-place write of the tiny model: milliseconds
