"""The vLLM worker extension's in-place apply and rollback, run on CPU stand-ins of TP workers.

The extension's own code runs unchanged; only its three hooks (TP rank/size, HF config, parameter
dict) are pointed at CPU tensors laid out as vLLM lays them out. The real-vLLM test at the end is
marked ``gpu`` and skips without vLLM and CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.actor.backends.vllm_ext import DeltaRLWorkerExtension, staged_changes  # noqa: E402
from deltarl.actor.backends.vllm_mapping import FusedLayout, shard_state, unshard_state  # noqa: E402
from deltarl.errors import StagingError, TensorMismatch  # noqa: E402
from deltarl.model.build import ModelSpec, build_model, export_bf16  # noqa: E402

pytestmark = pytest.mark.torch


class CpuWorker(DeltaRLWorkerExtension):
    """A TP rank holding vLLM-layout shards on CPU."""

    def __init__(self, config: Any, rank: int, size: int, shards: dict[str, torch.Tensor]) -> None:
        self.config, self.rank, self.size, self.shards = config, rank, size, shards

    def _deltarl_tp(self) -> tuple[int, int]:
        return self.rank, self.size

    def _deltarl_hf_config(self) -> Any:
        return self.config

    def _deltarl_params(self) -> dict[str, torch.Tensor]:
        return self.shards


def _versions() -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    spec = ModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=3)
    model = build_model(spec)
    v0 = export_bf16(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():  # sparse change: ~10% of the elements move
            mask = torch.rand(p.shape, generator=g) < 0.1
            p.add_(mask * torch.randn(p.shape, generator=g) * 0.05)
    return model.config, v0, export_bf16(model)


def _digest(state: dict[str, torch.Tensor]) -> str:
    from deltarl.codec import state_digest

    return state_digest(state)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_staged_update_applies_to_fused_shards(tp: int, torch_threads: Any) -> None:
    from deltarl.codec import encode_delta, stage_delta

    config, v0, v1 = _versions()
    layout = FusedLayout.from_hf_config(config, tp_size=tp)
    shadow = {k: v.clone() for k, v in v0.items()}
    staged = stage_delta(shadow, encode_delta(v0, v1, base="v0"), base="v0")
    changes = staged_changes(staged, {k: tuple(v.shape) for k, v in v0.items()})
    assert sum(int(i.numel()) for _, i, _ in changes.values()) == staged.changed_elements > 0
    workers = [CpuWorker(config, r, tp, shard_state(v0, layout, r)) for r in range(tp)]
    written = [w.deltarl_apply(changes) for w in workers]
    if tp == 1:
        assert written == [staged.changed_elements]
    for r, w in enumerate(workers):
        want = shard_state(v1, layout, r)
        assert all(torch.equal(w.shards[k].view(torch.int16), want[k].view(torch.int16)) for k in want), r
    names_shapes = {k: tuple(v.shape) for k, v in v0.items()}
    assert _digest(unshard_state([w.deltarl_local_shards() for w in workers], names_shapes, layout)) == _digest(v1)
    # idempotent re-apply, then rollback to v0
    for w in workers:
        w.deltarl_apply(changes)
    assert _digest(unshard_state([w.shards for w in workers], names_shapes, layout)) == _digest(v1)
    for w in workers:
        w.deltarl_rollback()
    # rollback undoes only the last apply, which overwrote v1 with v1: still v1. From v0, apply+rollback is v0.
    assert _digest(unshard_state([w.shards for w in workers], names_shapes, layout)) == _digest(v1)
    fresh = [CpuWorker(config, r, tp, shard_state(v0, layout, r)) for r in range(tp)]
    for w in fresh:
        w.deltarl_apply(changes)
        w.deltarl_rollback()
    assert _digest(unshard_state([w.shards for w in fresh], names_shapes, layout)) == _digest(v0)
    with pytest.raises(StagingError):
        fresh[0].deltarl_rollback()


def test_bad_update_writes_nothing() -> None:
    config, v0, _v1 = _versions()
    layout = FusedLayout.from_hf_config(config, tp_size=1)
    worker = CpuWorker(config, 0, 1, shard_state(v0, layout, 0))
    before = _digest(worker.deltarl_local_shards())
    good_name = "model.layers.0.self_attn.q_proj.weight"
    shape = tuple(v0[good_name].shape)
    good = (shape, torch.tensor([0, 1]), torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    with pytest.raises(TensorMismatch, match="does not have"):
        worker.deltarl_apply({good_name: good, "model.layers.9.mlp.up_proj.weight": good})
    with pytest.raises(TensorMismatch, match="outside"):
        worker.deltarl_apply({good_name: good, "model.norm.weight": ((32,), torch.tensor([40]), torch.tensor([1.0], dtype=torch.bfloat16))})
    with pytest.raises(TensorMismatch, match="BF16"):
        worker.deltarl_apply({good_name: (shape, torch.tensor([0]), torch.tensor([1.0]))})
    assert _digest(worker.deltarl_local_shards()) == before
    assert worker.deltarl_rollback() == 0  # the failed apply wrote nothing, so nothing to restore


def test_prepare_then_commit_is_the_scatter_and_refuses_moved_weights() -> None:
    from deltarl.codec import encode_delta, stage_delta

    config, v0, v1 = _versions()
    layout = FusedLayout.from_hf_config(config, tp_size=2)
    staged = stage_delta({k: v.clone() for k, v in v0.items()}, encode_delta(v0, v1, base="v0"), base="v0")
    changes = staged_changes(staged, {k: tuple(v.shape) for k, v in v0.items()})
    names_shapes = {k: tuple(v.shape) for k, v in v0.items()}
    workers = [CpuWorker(config, r, 2, shard_state(v0, layout, r)) for r in range(2)]
    with pytest.raises(StagingError, match="no prepared"):
        workers[0].deltarl_commit()
    for w in workers:
        w.deltarl_prepare(changes)
    assert _digest(unshard_state([w.shards for w in workers], names_shapes, layout)) == _digest(v0)  # nothing written
    assert sum(w.deltarl_commit() for w in workers) >= staged.changed_elements
    assert _digest(unshard_state([w.shards for w in workers], names_shapes, layout)) == _digest(v1)
    for w in workers:
        w.deltarl_rollback()
    assert _digest(unshard_state([w.shards for w in workers], names_shapes, layout)) == _digest(v0)
    w = workers[0]
    w.deltarl_prepare(changes)
    flat, idx = w._deltarl_plan[0][0], w._deltarl_plan[0][1]
    flat[idx[0]] = flat[idx[0]] + 1000.0  # the weights move after prepare: neither old nor new
    before = _digest(w.deltarl_local_shards())
    with pytest.raises(StagingError, match="changed since"):
        w.deltarl_commit()
    assert _digest(w.deltarl_local_shards()) == before


def test_module_imports_without_vllm() -> None:
    import importlib.util

    import deltarl.actor.backends.vllm_ext as ext

    assert ext.VLLM_EXTENSION == "deltarl.actor.backends.vllm_ext.DeltaRLWorkerExtension"
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError):
            ext.VLLMBackend("/nonexistent")


@pytest.mark.gpu
def test_vllm_backend_end_to_end(tmp_path: Path) -> None:  # pragma: no cover - needs vLLM and CUDA
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deltarl.actor.backends.hf import HFBackend
    from deltarl.actor.backends.vllm_ext import VLLMBackend
    from deltarl.codec import encode_delta, stage_delta

    spec = ModelSpec(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2)
    model = build_model(spec, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt")
    _, v0, v1 = _versions_of(model)
    backend = VLLMBackend(str(tmp_path / "ckpt"), shadow={k: v.clone() for k, v in v0.items()},
                          skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.2)
    prompts = [[257, *b"1+2="], [257, *b"4+4="]]
    before = backend.generate(prompts, max_new_tokens=6, temperature=0.0)
    staged = stage_delta(backend.state_dict_for_update(), encode_delta(v0, v1, base="v0"), base="v0")
    backend.commit(staged)
    assert _digest(backend.hf_state()) == _digest(v1)
    after = backend.generate(prompts, max_new_tokens=6, temperature=1.0, n=4)
    hf = HFBackend.from_spec(spec, eos_token_id=258, pad_token_id=256, state=v1, device="cuda")
    from deltarl.trainer.logprobs import completion_logprobs

    with torch.no_grad():
        lp, _ = completion_logprobs(hf.model, [p for p in prompts for _ in range(4)],
                                    [g.completion_token_ids for g in after], temperature=1.0, pad_token_id=256)
    for i, g in enumerate(after):
        assert torch.allclose(lp[i, : len(g.logprobs)].cpu(), torch.tensor(g.logprobs), atol=0.05)
    assert before is not None


def _versions_of(model: Any) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    v0 = export_bf16(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.config, v0, export_bf16(model)
