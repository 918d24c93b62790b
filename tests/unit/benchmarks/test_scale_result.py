"""``benchmarks.scale``'s figures of a phase whose roles used less CPU than the clocks show (os.times
and /proc count 10 ms ticks): a fresh clone's CI once failed in the quick run's relay phase on
``16 / 0`` (ZeroDivisionError), where the tiny model's objects were served within one tick."""

from __future__ import annotations

import argparse

from benchmarks import scale


def _args() -> argparse.Namespace:
    return argparse.Namespace(model="tiny")


def test_a_phase_below_the_clock_tick_has_no_cpu_bound_rate() -> None:
    out = scale._result(_args(), 0.01, 0, {"actor": 0.0, "relay": 0.0})
    assert out["cpu_bound_gb_s_16_cores"] is None
    assert out["core_s_per_gb"] == {"actor": 0.0, "relay": 0.0}
    assert out["gb_s"] > 0


def test_the_slowest_role_bounds_the_rate() -> None:
    copy_gb = scale._model_bytes("tiny") / scale.GB
    out = scale._result(_args(), 1.0, 0, {"actor": 0.0, "relay": 2 * copy_gb})
    assert out["cpu_bound_gb_s_16_cores"] == 8.0
