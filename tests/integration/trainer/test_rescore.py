"""Rescoring rollouts against the version they claim: honest ones pass, a wrong version id is flagged."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.pipeline.publisher import Publisher  # noqa: E402
from deltarl.storage import MemoryStore  # noqa: E402
from deltarl.trainer.config import TrainerConfig  # noqa: E402
from deltarl.trainer.loop import TrainerLoop  # noqa: E402
from deltarl.trainer.rescore import rescore_rollouts, version_numbers  # noqa: E402
from tests.fixtures.models import LocalRollouts  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def trained_run(torch_threads: Any) -> tuple[MemoryStore, str, LocalRollouts]:
    store, run = MemoryStore(), "audit"
    cfg = TrainerConfig.tiny(run=run, steps=4, prompts_per_step=8, group_size=4)
    actor = LocalRollouts(store, run)
    with Publisher(store, run, keyframe_interval=3) as pub:
        TrainerLoop(cfg, coordinator=actor, publisher=pub, store=store).run()
    return store, run, actor


def test_honest_rollouts_pass(trained_run: tuple[MemoryStore, str, LocalRollouts]) -> None:
    store, run, actor = trained_run
    findings = rescore_rollouts(store, run, actor.results, 1000)
    assert len(findings) == sum(len(r.samples) for r in actor.results) == 4 * 8 * 4
    assert all(f.ok for f in findings), [f for f in findings if not f.ok][:3]
    assert {f.version for f in findings} == {0, 1, 2, 3}
    assert max(f.mean_abs_diff for f in findings) < 0.02
    sampled = rescore_rollouts(store, run, actor.results, 10, seed=1)
    assert len(sampled) == 10
    assert rescore_rollouts(store, run, actor.results, 0) == []


def test_wrong_version_claim_is_flagged(trained_run: tuple[MemoryStore, str, LocalRollouts]) -> None:
    store, run, actor = trained_run
    ids = {v: vid for vid, v in version_numbers(store, run).items()}
    honest = actor.results[1]  # step 2, generated with version 1
    assert honest.version_id == ids[1]
    for claimed in (0, 2, 4):  # the previous, the next and the newest version
        forged = honest.model_copy(update={"version_id": ids[claimed]})
        findings = rescore_rollouts(store, run, [forged], 1000)
        flagged = [f for f in findings if not f.ok]
        assert len(flagged) >= 0.9 * len(findings), (claimed, [f.mean_abs_diff for f in findings])
        assert all(f.reason == "logprob mismatch" and f.version == claimed for f in flagged)
    unknown = honest.model_copy(update={"version_id": "f" * 64})
    assert all(f.reason == "unknown version" and not f.ok for f in rescore_rollouts(store, run, [unknown], 3))


def test_tampered_logprobs_are_flagged(trained_run: tuple[MemoryStore, str, LocalRollouts]) -> None:
    store, run, actor = trained_run
    result = actor.results[2]
    samples = [s.model_copy(update={"logprobs": [x - 0.5 for x in s.logprobs]}) for s in result.samples]
    findings = rescore_rollouts(store, run, [result.model_copy(update={"samples": samples})], 1000)
    assert not any(f.ok for f in findings)


def test_unreplayable_version_is_flagged_not_passed(trained_run: tuple[MemoryStore, str, LocalRollouts]) -> None:
    store, run, actor = trained_run
    seg = next(k for k in store.list(f"{run}/versions/000000000002/") if k.endswith(".bin"))
    store.delete(seg)
    findings = rescore_rollouts(store, run, actor.results, 1000)
    by_version: dict[int | None, set[bool]] = {}
    for f in findings:
        by_version.setdefault(f.version, set()).add(f.ok)
    assert by_version[2] == {False}
    assert {f.reason for f in findings if f.version == 2} == {"version not replayable"}
    assert by_version[0] == by_version[1] == by_version[3] == {True}  # 3 is a keyframe: replayed without 2
