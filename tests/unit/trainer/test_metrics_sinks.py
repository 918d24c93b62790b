"""The trainer's metric outputs, read back the way operators read them: a Prometheus scrape over HTTP,
TensorBoard's event files, and a wandb offline run directory."""

from __future__ import annotations

import glob
import json
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from deltarl.exposition import MetricsServer  # noqa: E402
from deltarl.pipeline.publisher import Publisher, VersionInfo  # noqa: E402
from deltarl.storage.memory import MemoryStore  # noqa: E402
from deltarl.trainer.grpo import TrainStats  # noqa: E402
from deltarl.trainer.loop import StepReport  # noqa: E402
from deltarl.trainer.metrics import TrainerMetrics  # noqa: E402
from deltarl.trainer.sinks import SinkConfig, Sinks, TensorBoardSink, WandbSink, step_values  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def versions() -> list[VersionInfo]:
    """Three real versions of a 4096-element state: 0 (keyframe), 1 (100 changed), 2 (keyframe, 300 changed)."""
    state = torch.zeros(4096, dtype=torch.bfloat16)
    out = []
    with Publisher(MemoryStore(), "r", keyframe_interval=2) as pub:
        for step, n in enumerate((0, 100, 300)):
            state = state.clone()
            state[:n] += 1
            out.append(pub.publish({"w": state}, step))
    return out


def _report(info: VersionInfo, reward: float) -> StepReport:
    stats = TrainStats(step=info.step, loss=0.5 - reward, reward_mean=reward, reward_std=0.1, kl=0.0, clip_frac=0.0,
                       ratio_mean=1.0, grad_norm=1.5, samples=16, tokens=96, groups=2, seconds=0.25)
    return StepReport(step=info.step, version=info.version, version_id=info.version_id, stats=stats,
                      accepted_versions=(), stale_samples=3, wait_s=0.75, publish_s=info.wall_s, publish=info)


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_prometheus_endpoint_of_the_publisher_and_trainer(versions: list[VersionInfo]) -> None:
    metrics = TrainerMetrics()
    metrics.published(versions[0])
    metrics.step(_report(versions[1], 0.25))
    metrics.step(_report(versions[2], 0.5))
    with MetricsServer(metrics.registry, port=0, host="127.0.0.1") as server:
        got = _scrape(server.url)
    assert got[("deltarl_publisher_version", ())] == 2
    assert got[("deltarl_publisher_versions_total", (("kind", "keyframe"),))] == 2
    assert got[("deltarl_publisher_versions_total", (("kind", "delta"),))] == 1
    assert got[("deltarl_publisher_delta_bytes_total", ())] == versions[1].stats.encoded_bytes + versions[2].stats.encoded_bytes
    assert got[("deltarl_publisher_keyframe_bytes_total", ())] == versions[0].keyframe_bytes + versions[2].keyframe_bytes > 0
    assert got[("deltarl_publisher_changed_fraction", ())] == pytest.approx(300 / 4096)  # all of the first 300 moved
    assert got[("deltarl_publisher_full_bytes", ())] == 8192
    for name in ("encode", "upload", "commit", "publish"):
        assert got[(f"deltarl_publisher_{name}_seconds_count", ())] == 3
    assert got[("deltarl_publisher_commit_seconds_sum", ())] > 0
    assert got[("deltarl_trainer_step", ())] == 2
    assert got[("deltarl_trainer_reward_mean", ())] == 0.5
    assert got[("deltarl_trainer_stale_samples_total", ())] == 6


def test_two_trainers_in_one_process_do_not_share_metrics(versions: list[VersionInfo]) -> None:
    a, b = TrainerMetrics(), TrainerMetrics()  # no global registry: no 'Duplicated timeseries' error either
    a.published(versions[0])
    assert b"deltarl_publisher_version -1.0" in b.render()


def test_tensorboard_event_file_reads_back(versions: list[VersionInfo], tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = Sinks([TensorBoardSink(str(tmp_path))])
    sinks.log_step(_report(versions[1], 0.25))
    sinks.log_step(_report(versions[2], 0.5))
    sinks.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert set(step_values(_report(versions[1], 0.0))) <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert [e.value for e in acc.Scalars("publish/changed_fraction")] == pytest.approx([100 / 4096, 300 / 4096])


def test_wandb_offline_run_reads_back(versions: list[VersionInfo], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("deltarl-test", name="r", config={"steps": 2}, directory=str(tmp_path))
    sink.log(step_values(_report(versions[1], 0.25)), 1)
    sink.log(step_values(_report(versions[2], 0.5)), 2)
    sink.close()
    import wandb

    wandb.teardown()  # the run file is written by wandb's service process: stop it, so every record is on disk
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    history = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
               for r in _wandb_records(Path(runs[0])) if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["train/reward_mean"]) for h in history] == [(1, 0.25), (2, 0.5)]
    assert [h["publish/changed_fraction"] for h in history] == pytest.approx([100 / 4096, 300 / 4096])


def _wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a ``.wandb`` file: a 7-byte ':W&B' header, then LevelDB-log chunks
    (crc32, little-endian length, type FULL/FIRST/MIDDLE/LAST) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_a_sink_without_its_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from deltarl.errors import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"pip install 'deltarl\[metrics\]'"):
        Sinks.open(SinkConfig(wandb_project="p"), run="r")
