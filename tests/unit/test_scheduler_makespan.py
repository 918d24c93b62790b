"""The simulated fleet of the benchmark (speeds 1:0.5:0.3, drift +-30%, one death): within 1.10x of ideal."""

from __future__ import annotations

from deltarl.coordinator.config import SchedulerConfig
from deltarl.coordinator.simulate import scenario, simulate


def test_makespan_within_10_percent_of_ideal_and_beats_equal_split() -> None:
    for seed in range(3):
        sc = scenario(seed, prompts=128, group=4)
        ours = simulate(SchedulerConfig(), sc.fleet, sc.spec, sc.lengths)
        equal = simulate(SchedulerConfig(policy="equal", chunks=1, max_lease_seconds=1e9), sc.fleet, sc.spec, sc.lengths)
        assert ours["makespan_s"] / sc.ideal <= 1.10, (seed, ours, sc.ideal)
        assert equal["makespan_s"] > ours["makespan_s"]
        assert ours["revoked"] == 1  # the dead actor's lease went back to the pool
        assert sum(ours["share"]) == 128
