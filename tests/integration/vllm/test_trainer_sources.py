"""The trainer-side engine on the ``WeightSource`` data model of the vLLM that imports here: 0.32's
(iterable) in ``.venv-vllm``, 0.33+'s (``iter_full`` / ``iter_local`` / ``owned_names``, ``metadata``
a cached property) under ``make test-vllm-window`` (0.33's and 0.34's pure-Python modules ahead of
the installed build). vLLM's own ``ModuleSource`` is the source; every version replays bit-exact to
the model's export, and an FSDP2 model over two gloo ranks publishes without a hang (0.33+: each
rank its own rows through a ``ShardedPublisher``, no gather)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.filterwarnings("ignore")]  # vLLM's own warnings

STEPS = 2


class RecordingClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol, recording the calls (the engine side is not under test
    here: ``test_trainer.py`` drives a real one)."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(["init", init_info["version"]])

    def start_weight_update(self) -> None:
        self.calls.append(["start"])

    def update_weights(self, update_info: Any) -> None:
        self.calls.append(["update", update_info["version"]])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(["finish", weight_version])

    def reset_prefix_cache(self) -> None:
        self.calls.append(["reset"])


def _step(model: Any, opt: Any, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (2, 16), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _expected_calls() -> list[list[Any]]:
    calls: list[list[Any]] = [["init", 0], ["reset"]]
    for v in range(1, STEPS + 1):
        calls += [["start"], ["update", v], ["finish", str(v)], ["reset"]]
    return calls


def test_the_installed_data_model_publishes_every_round(tmp_path: Path) -> None:
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource

    from deltarl.codec import state_digest
    from deltarl.integrations.vllm import sources
    from deltarl.integrations.vllm.trainer import DeltaRLTrainerEngine, DeltaRLTrainerInitInfo
    from deltarl.model.build import ModelSpec, build_model, export_bf16
    from deltarl.pipeline.replay import replay
    from deltarl.storage.open import open_store

    model = build_model(ModelSpec(seed=0))
    source = ModuleSource(model)
    assert sources.is_split(source) == (not hasattr(type(source), "__iter__"))  # 0.33+: no __iter__
    client = RecordingClient()
    engine = DeltaRLTrainerEngine.trainer_init(
        DeltaRLTrainerInitInfo(store=str(tmp_path / "store"), run="t", rank=0), client=client, source=source)
    exports = [export_bf16(model)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, STEPS + 1):
        _step(model, opt, step)
        engine.send_weights()
        exports.append(export_bf16(model))
    engine.shutdown()
    assert client.calls == _expected_calls()
    store = open_store(str(tmp_path / "store"))
    try:
        for v, state in enumerate(exports):
            assert state_digest(replay(store, "t", v)) == state_digest(state)
    finally:
        store.close()


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer.base import ModuleSource

    from deltarl.integrations.gather import gather_bf16
    from deltarl.integrations.vllm import sources
    from deltarl.integrations.vllm.trainer import DeltaRLTrainerEngine, DeltaRLTrainerInitInfo
    from deltarl.model.build import ModelSpec, build_model
    from deltarl.testing.ranks import leave_process_group, traceback_to

    with traceback_to(Path(tmp, f"error-{rank}.txt")):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
        model = build_model(ModelSpec(seed=0))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        source = ModuleSource(model)
        client = RecordingClient()
        engine = DeltaRLTrainerEngine.trainer_init(
            DeltaRLTrainerInitInfo(store=os.path.join(tmp, "store"), run="r", rank=rank,
                                   publish={"segment_bytes": 8192}),
            client=client, source=source)
        published = 0
        if sources.is_split(source):  # what this rank publishes: its own rows, never the gathered model
            published = sum(part.numel() for part, _, _ in sources.row_shards(source, rank, world).values())
        fulls = [gather_bf16(model, is_main=rank == 0)]
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(1, STEPS + 1):
            _step(model, opt, step)
            engine.send_weights()
            fulls.append(gather_bf16(model, is_main=rank == 0))
        report = {"split": sources.is_split(source), "publisher": type(engine.publisher).__name__,
                  "calls": client.calls, "version": engine.version, "published": published,
                  "total": sum(int(p.numel()) for p in model.parameters())}
        engine.shutdown()
        Path(tmp, f"report-{rank}.json").write_text(json.dumps(report))
        if rank == 0:
            torch.save(fulls, os.path.join(tmp, "fulls.pt"))
    leave_process_group()


def test_an_fsdp_source_on_two_ranks_publishes_without_a_hang(tmp_path: Path) -> None:
    import torch

    from deltarl.codec import state_digest
    from deltarl.pipeline.replay import replay
    from deltarl.storage.open import open_store
    from deltarl.testing.ranks import spawn_ranks

    codes = spawn_ranks(_worker, 2, str(tmp_path), timeout_s=240)
    for err in sorted(tmp_path.glob("error-*.txt")):
        pytest.fail(err.read_text())
    assert codes == [0, 0]  # a rank left waiting on a collective would be killed: -9
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in range(2)]
    assert [r["version"] for r in reports] == [STEPS, STEPS]
    assert reports[0]["calls"] == _expected_calls()
    assert reports[1]["calls"] == []  # only rank 0 drives the engines
    if reports[0]["split"]:  # 0.33+: each rank publishes its own rows, together all of them once
        assert {r["publisher"] for r in reports} == {"ShardedPublisher"}
        assert all(0 < r["published"] < r["total"] for r in reports)
        assert sum(r["published"] for r in reports) == reports[0]["total"]
    else:
        assert reports[0]["publisher"] == "Publisher"
    fulls = torch.load(tmp_path / "fulls.pt")
    store = open_store(str(tmp_path / "store"))
    try:
        for v, state in enumerate(fulls):
            assert state_digest(replay(store, "r", v)) == state_digest(state)
    finally:
        store.close()
