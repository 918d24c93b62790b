"""The codec warm-up ends at its next step once its ``stop`` is set, so an owner closing early (an actor
stopped in its first minute on a fresh install) waits for one compile, not for every signature."""

from __future__ import annotations

import logging
import threading

import pytest

from deltarl.codec import kernels
from deltarl.codec.jit_warmup import warm_codec

pytestmark = pytest.mark.skipif(kernels.jit() is None, reason="numba is off: the warm-up has nothing to load")


class StopAfter(threading.Event):
    """An event that reads as set from its ``n``-th check on (the warm-up checks before each step)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.checks, self.n = 0, n

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks > self.n


def _steps(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("codec warm-up: ")]


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_warm_up_ends_at_the_step_after_stop(caplog: pytest.LogCaptureFixture, steps: int) -> None:
    caplog.set_level(logging.DEBUG, logger="deltarl.codec.jit_warmup")
    stop = StopAfter(steps)
    warm_codec(["bfloat16"], stop=stop)
    assert len(_steps(caplog)) == steps
    assert stop.checks == steps + 1
    assert any("stopped before" in r.getMessage() for r in caplog.records)


def test_warm_up_without_stop_runs_every_step(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="deltarl.codec.jit_warmup")
    warm_codec(["bfloat16"])
    assert len(_steps(caplog)) == 4  # sparse, ctx, dense, cells' ctxs
