"""``deltarl audit --rescore``: an actor that claims one version but generated with another is caught.

A real run (model.json + two published versions of a tiny Qwen3), a real coordinator admitting
rollouts whose logprobs are computed under the version they claim, except for one lease whose
logprobs come from the other version; the audit's rescore flags exactly that lease.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from deltarl.cli import main
from deltarl.protocol.client import CoordinatorClient
from deltarl.protocol.records import LeaseGrant, RolloutResult, Sample
from deltarl.storage.local import LocalStore
from tests.fixtures.coordinator import (
    ACTOR_TOKEN,
    RUN,
    TRAINER_TOKEN,
    make_spec,
    service_config,
    start_service,
)

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _scorer(spec: Any, state: dict[str, Any], pad: int) -> Any:
    """logprobs of completions under ``state`` (BF16 model, as the actors serve and rescore rebuilds)."""
    import torch

    from deltarl.model.build import build_model, load_bf16_into
    from deltarl.trainer.logprobs import completion_logprobs

    model = build_model(spec, dtype=torch.bfloat16)
    load_bf16_into(model, state)

    def score(prompt: list[int], completion: list[int]) -> list[float]:
        with torch.no_grad():
            lp, _ = completion_logprobs(model, [prompt], [completion], temperature=1.0, pad_token_id=pad)
        return [float(x) for x in lp[0, : len(completion)]]

    return score


def _result(grant: LeaseGrant, version_id: str, score: Any, rng: random.Random) -> RolloutResult:
    samples = []
    for p in grant.prompts:
        for _ in range(p.group_size):
            prompt = [rng.randrange(3, 259) for _ in range(4)]
            completion = [rng.randrange(3, 259) for _ in range(6)]
            samples.append(Sample(prompt_id=p.prompt_id, prompt_token_ids=prompt, completion_token_ids=completion,
                                  completion_text="", logprobs=score(prompt, completion), reward=0.0))
    return RolloutResult(step=grant.lease.step, lease_id=grant.lease.lease_id, actor_id=grant.lease.actor_id,
                         version_id=version_id, samples=samples, gen_seconds=0.1,
                         tokens=sum(len(s.completion_token_ids) for s in samples))


async def test_rescore_flags_an_actor_that_lies_about_its_version(
    tmp_path: Any, torch_threads: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("deltarl.trainer.rescore")
    from deltarl.model.build import ModelSpec, build_model, export_bf16
    from deltarl.model.record import RunModelInfo, write_model_json
    from deltarl.model.tokenizer import ByteTokenizer, TokenizerSpec
    from deltarl.pipeline.publisher import Publisher

    store = LocalStore(str(tmp_path / "store"))
    spec = ModelSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, seed=1,
                     init_std=0.5)
    write_model_json(store, RUN, RunModelInfo(model=spec, tokenizer=TokenizerSpec(), temperature=1.0).to_bytes())
    states = [export_bf16(build_model(spec.model_copy(update={"seed": s}))) for s in (1, 2)]
    with Publisher(store, RUN) as pub:
        vids = [pub.publish(state, step=i).version_id for i, state in enumerate(states)]
    pad = ByteTokenizer().pad_token_id
    honest, other = _scorer(spec, states[1], pad), _scorer(spec, states[0], pad)

    runner, running = await start_service(store, service_config(lease_margin_s=60.0))
    rng = random.Random(0)
    liar = None
    try:
        async with CoordinatorClient(running.url, TRAINER_TOKEN) as trainer, \
                CoordinatorClient(running.url, ACTOR_TOKEN) as actor:
            aid = (await actor.register()).actor_id
            steps = make_spec(1, 6, versions=(vids[1], vids[0]), group=2)
            await trainer.open_step(1, steps.prompts, steps.accepted_versions)
            while (grant := (await actor.lease(aid, max_prompts=2)).grant) is not None:
                lie = liar is None
                if lie:
                    liar = grant.lease.lease_id
                await actor.report(_result(grant, vids[1], other if lie else honest, rng))
            assert (await trainer.step_results(1, timeout=10)).complete
    finally:
        await runner.cleanup()

    assert main(["audit", RUN, "--store", store.url]) == 0  # the bookkeeping checks cannot see it
    capsys.readouterr()
    assert main(["audit", RUN, "--store", store.url, "--rescore", "100", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["rescored"] == 12
    assert {f["lease_id"] for f in out["rescore_flagged"]} == {liar}
    store.close()
