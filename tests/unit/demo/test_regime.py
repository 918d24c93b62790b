"""The demo's regime figures: aurora's bytes for the same versions, the 8B estimate, the trainer preset."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from deltarl.codec import iter_encode_delta  # noqa: E402
from deltarl.demo.preset import CHECKPOINT_LR, check_checkpoint, demo_trainer_config  # noqa: E402
from deltarl.demo.regime import AuroraCounting, scale_estimate  # noqa: E402
from deltarl.demo.view import StepRow, regime_line  # noqa: E402
from deltarl.errors import ConfigError  # noqa: E402
from deltarl.pipeline.publisher import Publisher  # noqa: E402
from deltarl.pipeline.replay import replay  # noqa: E402
from deltarl.storage import MemoryStore  # noqa: E402
from deltarl.trainer.config import SPARSE_GRPO, SPARSE_MODEL, SPARSE_WARMUP  # noqa: E402

pytestmark = pytest.mark.torch


def _states(n: int, changed: float) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(300, 200, generator=g).bfloat16(), "b": torch.randn(5000, generator=g).bfloat16()}
    out = [state]
    for _ in range(n - 1):
        nxt = {}
        for k, v in out[-1].items():
            bump = (torch.rand(v.shape, generator=g) < changed).to(v.dtype) * 0.05 * v.abs().clamp(min=1e-3)
            nxt[k] = (v + bump).contiguous()
        out.append(nxt)
    return out


def test_aurora_counting_measures_the_same_deltas_and_changes_nothing() -> None:
    states = _states(4, 0.02)
    store = MemoryStore()
    with Publisher(store, "r", keyframe_interval=10) as pub:
        counting = AuroraCounting(pub)
        assert counting.next_version == 0
        infos = [counting.publish(s, step, owned=True) for step, s in enumerate(states)]
    assert set(counting.aurora_bytes) == {1, 2, 3}  # version 0 is a keyframe, no delta
    for v in (1, 2, 3):
        expected = sum(len(seg) for seg in iter_encode_delta(states[v - 1], states[v], base=infos[v - 1].version_id,
                                                            segment_bytes=pub.config.segment_bytes, codec="aurora"))
        assert counting.aurora_bytes[v] == expected
        assert expected > infos[v].stats.encoded_bytes > 0  # the published codec is the smaller one
    replayed = replay(store, "r", 3)
    assert all(torch.equal(replayed[k].view(torch.int16), states[3][k].view(torch.int16)) for k in states[3])


def test_scale_estimate_from_measured_bytes() -> None:
    est = scale_estimate([100, 300], [10_000, 10_000], [150, 450])  # 2% changed, 1.5 B per changed element
    assert est is not None
    assert est.changed_fraction == pytest.approx(0.02)
    assert est.bytes_per_changed == pytest.approx(1.5)
    assert est.full_s == pytest.approx(16e9 * 8 / 1e9)  # 8B BF16 over 1 Gbit/s: 128 s
    assert est.delta_s == pytest.approx(8e9 * 0.02 * 1.5 * 8 / 1e9)
    line = est.line()
    assert "estimate" in line
    assert "128 s" in line
    assert "2.0% changed" in line
    assert scale_estimate([0], [10], [0]) is None
    assert scale_estimate([], [], []) is None


def test_regime_line_states_the_fractions() -> None:
    rows = [StepRow(step=i, version=i, reward=0.5, changed_fraction=0.02, delta_bytes=10 << 10, full_bytes=1 << 20,
                    wait_s=0, publish_s=0, changed_elements=10_000, aurora_bytes=30 << 10) for i in (1, 2)]
    line = regime_line(rows)
    assert "2.00% of BF16 elements changed" in line
    assert "0.98% of full BF16" in line
    assert "3.00x" in line
    assert regime_line([]) == ""


def test_demo_preset_and_overrides() -> None:
    cfg = demo_trainer_config(store="memory://", run="r", steps=3, prompts_per_step=4, group_size=2, torch_threads=1)
    assert cfg.model == SPARSE_MODEL
    assert cfg.grpo == SPARSE_GRPO
    assert cfg.warmup == SPARSE_WARMUP
    cfg = demo_trainer_config(store="memory://", run="r", steps=3, prompts_per_step=4, group_size=2, torch_threads=1,
                              lr=3e-5, warmup_steps=0)
    assert cfg.grpo.lr == 3e-5
    assert cfg.warmup.steps == 0
    assert cfg.model == SPARSE_MODEL


def test_checkpoint_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no checkpoint directory at .*nothing is downloaded") as err:
        check_checkpoint(str(tmp_path / "missing"))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"no config\.json"):
        check_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert check_checkpoint(str(tmp_path)) == tmp_path.resolve()


def test_checkpoint_preset(hf_checkpoint: Path) -> None:
    cfg = demo_trainer_config(store="memory://", run="r", steps=1, prompts_per_step=2, group_size=2, torch_threads=1,
                              model=str(hf_checkpoint))
    assert cfg.model.name == str(hf_checkpoint.resolve())
    assert cfg.tokenizer.kind == "hf"
    assert cfg.grpo.lr == CHECKPOINT_LR
    assert cfg.warmup.steps == 0
