"""The simulated fleet of the benchmark (speeds 1:0.5:0.3, drift +-30%, one death): within 1.10x of ideal."""

from __future__ import annotations

from deltarl.coordinator.config import SchedulerConfig
from deltarl.testing.fleet import scenario, simulate


def test_makespan_within_10_percent_of_ideal_and_beats_equal_split() -> None:
    for seed in range(3):
        sc = scenario(seed, prompts=128, group=4)
        ours = simulate(SchedulerConfig(), sc.fleet, sc.spec, sc.lengths)
        equal = simulate(SchedulerConfig(policy="equal", chunks=1, max_lease_seconds=1e9), sc.fleet, sc.spec, sc.lengths)
        assert ours["makespan_s"] / sc.ideal <= 1.10, (seed, ours, sc.ideal)
        assert equal["makespan_s"] > ours["makespan_s"]
        assert ours["revoked"] == 1  # the dead actor's lease went back to the pool
        assert sum(ours["share"]) == 128


def test_5000_and_2500_tok_s_split_300_prompts_200_100_and_finish_together() -> None:
    from deltarl.protocol.records import PromptItem, StepSpec
    from deltarl.testing.fleet import Fleet

    fleet = Fleet(base=[5000.0, 2500.0], factors=[[1.0], [1.0]], period=1e9, death={})
    spec = StepSpec(step=0, prompts=[PromptItem(prompt_id=f"p{i}", text="") for i in range(300)], accepted_versions=["v1"])
    lengths = {p.prompt_id: [500] for p in spec.prompts}
    out = simulate(SchedulerConfig(prior_tokens_per_sample=500.0), fleet, spec, lengths)
    fast, slow = out["share"]
    assert abs(fast - 200) <= 3
    assert fast + slow == 300
    assert out["makespan_s"] <= 1.02 * fleet.ideal(300 * 500)  # they finish together


def test_an_actor_far_slower_than_the_prior_is_not_starved_by_expiring_probes() -> None:
    from deltarl.protocol.records import PromptItem, StepSpec
    from deltarl.testing.fleet import Fleet

    fleet = Fleet(base=[20.0], factors=[[1.0]], period=1e9, death={})  # 50x slower than the prior
    spec = StepSpec(step=0, prompts=[PromptItem(prompt_id=f"p{i}", text="") for i in range(20)], accepted_versions=["v1"])
    lengths = {p.prompt_id: [100] for p in spec.prompts}
    cfg = SchedulerConfig(prior_tokens_per_second=1000.0, lease_margin_s=5.0, heartbeat_timeout_s=1e9)
    out = simulate(cfg, fleet, spec, lengths)
    assert out["share"] == [20]
    assert out["expired"] <= 2
    assert out["makespan_s"] <= 1.5 * fleet.ideal(20 * 100)
